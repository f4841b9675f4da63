"""Activation recomputation inside the search: the ILP's keep/recompute decision per layer, the rewrite, the run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metadist.cost import cluster_for, liveness
from metadist.ir import Mesh
from metadist.ir.plan import Plan
from metadist.solver import InfeasibleBudgetError, baseline_plan, plan_graph
from metadist.solver.ilp import ShardingILP
from metadist.solver.planner import _peaks_after_recompute, assignment_from, smallest_memory_bytes
from metadist.solver.problem import build_problem, with_peaks
from metadist.solver.recompute import CLONE_SUFFIX, apply_recompute, recompute_layers, recompute_terms

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BLOCKS = '''
import torch, metadist


class Block(torch.nn.Module):
    def __init__(self, width, dropout):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


class Blocks(torch.nn.Module):
    def __init__(self, width=16, depth=3, dropout=0.1):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width, dropout) for _ in range(depth)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def workload():
    torch.manual_seed(0)
    return metadist.Workload(model=Blocks(), batch={"x": torch.randn(64, 16)},
                             loss_fn=lambda model, batch: model(batch["x"]),
                             optimizer=lambda params: torch.optim.SGD(params, lr=1e-2))
'''


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    from metadist.api import capture_and_discover

    folder = tmp_path_factory.mktemp("blocks")
    path = folder / "blocks.py"
    path.write_text(BLOCKS)
    graph, rules = capture_and_discover(str(path), str(folder / "rules.db"))
    return path, graph, rules


def _smallest(graph, rules, cluster) -> tuple[float, float]:
    """The smallest footprint without recomputation, and with every layer free to recompute."""
    problem = build_problem(graph, rules.rules, cluster)
    without = smallest_memory_bytes(problem)
    every = tuple(layer.layer for layer in recompute_layers(graph))
    problem = with_peaks(problem, tuple(sorted({*problem.peaks, *_peaks_after_recompute(graph, every)})))
    terms = recompute_terms(problem, recompute_layers(graph))
    return without, ShardingILP(problem, None, minimize_memory=True, recompute=terms).solve().objective_s


def test_layers_recompute_their_saved_values_and_keep_random_draws_and_boundaries(blocks):
    _, graph, _ = blocks
    layers = recompute_layers(graph)
    assert [layer.layer for layer in layers] == [0, 1]  # layer 2 computes the loss: its backward follows at once
    for layer in layers:
        assert not any(graph.node(name).op.is_random for name in layer.cloned)
    rewritten = apply_recompute(graph, [0, 1])
    clones = [node for node in rewritten.nodes if node.name.endswith(CLONE_SUFFIX)]
    assert len(clones) == len(layers[0].cloned) + len(layers[1].cloned)
    random_outputs = {v.name for node in graph.nodes if node.op.is_random for v in node.output_values}
    assert random_outputs & {name for clone in clones for name in clone.input_names}  # clones replay the kept draws
    assert rewritten.outputs == graph.outputs and rewritten.inputs == graph.inputs
    assert max(liveness(rewritten).replicated_bytes_at_peaks) < max(liveness(graph).replicated_bytes_at_peaks)
    with pytest.raises(ValueError, match="cannot recompute"):
        apply_recompute(graph, [7])


def test_a_tight_budget_flips_layers_to_recompute_and_a_loose_one_keeps_all(blocks):
    _, graph, rules = blocks
    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    without, with_recompute = _smallest(graph, rules, cluster)
    assert with_recompute < 0.9 * without
    loose = plan_graph(graph, rules, cluster, memory_budget_bytes=2 * without)
    assert loose.recompute == () and "recompute" not in loose.solver
    some = plan_graph(graph, rules, cluster, memory_budget_bytes=0.99 * without)
    tight = plan_graph(graph, rules, cluster, memory_budget_bytes=1.01 * with_recompute)
    assert 0 < len(some.recompute) <= len(tight.recompute)
    for plan, budget in ((some, 0.99 * without), (tight, 1.01 * with_recompute)):
        assert plan.estimate["memory_bytes_peak"] <= budget
        assert plan.solver["recompute"]["layers"] == list(plan.recompute)
        plan.check_for(apply_recompute(graph, plan.recompute), plan.metadist_version)
        assert Plan.from_json(plan.to_json()).recompute == plan.recompute
    assert tight.estimate["compute_s"] > loose.estimate["compute_s"]  # the recomputed forward is paid for
    with pytest.raises(InfeasibleBudgetError, match="even recomputing all 2"):
        plan_graph(graph, rules, cluster, memory_budget_bytes=0.9 * with_recompute)
    with pytest.raises(InfeasibleBudgetError):
        plan_graph(graph, rules, cluster, memory_budget_bytes=0.99 * without, recompute=False)


def test_the_recompute_ilp_prices_what_the_rewritten_graph_holds(blocks):
    _, graph, rules = blocks
    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    problem = build_problem(graph, rules.rules, cluster)
    every = tuple(layer.layer for layer in recompute_layers(graph))
    problem = with_peaks(problem, tuple(sorted({*problem.peaks, *_peaks_after_recompute(graph, every)})))
    from metadist.solver.estimate import Assignment, estimate

    position = {node.name: index for index, node in enumerate(graph.nodes)}
    for _ in range(4):  # as the planner does: a true peak outside the problem's peaks is added, and solved again
        solution = ShardingILP(problem, None, minimize_memory=True, recompute=recompute_terms(problem, recompute_layers(graph))).solve()
        assert solution.recompute
        rewritten = apply_recompute(graph, solution.recompute)
        assignment = assignment_from(problem, solution.choice)
        strategies = {node.name: assignment.node_strategies[node.name.removesuffix(CLONE_SUFFIX)] for node in rewritten.nodes}
        figures = estimate(rewritten, Assignment(strategies, assignment.input_shardings), cluster, liveness(rewritten), problem.bucketing)
        peak = figures["memory_peak_position"]
        while 0 <= peak < len(rewritten.nodes) and rewritten.nodes[peak].name.endswith(CLONE_SUFFIX):
            peak += 1  # a clone's peak is priced at the node it runs before
        peak = position[rewritten.nodes[peak].name] if 0 <= peak < len(rewritten.nodes) else peak
        if peak in problem.peaks:
            break
        problem = with_peaks(problem, tuple(sorted({*problem.peaks, peak})))
    assert figures["memory_bytes_peak"] == pytest.approx(solution.objective_s, rel=1e-6)


def test_a_recomputed_forward_takes_its_original_strategies(blocks):
    """A clone's unit is tied to its original's (one class: the same strategy), as the recompute ILP prices it. Left
    free, LLaMA-tiny bf16 with every layer recomputed on 2x2 gave HiGHS an LP of 553 classes that took 33 s; tied:
    507 classes, 6 s, the same optimum."""
    from metadist.solver.planner import recomputed_rules

    _, graph, rules = blocks
    rewritten = apply_recompute(graph, [0, 1])
    clone_rules, without = recomputed_rules(rewritten, rules.rules)
    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    problem = build_problem(rewritten, clone_rules, cluster)
    assert not without

    mirrored = []  # clone units made of the clones of an original unit's members (a dropout mask is kept, not
    for unit, members in enumerate(problem.units):  # recomputed, so its block's clones form a smaller unit)
        original = tuple(name.removesuffix(CLONE_SUFFIX) for name in members.members)
        if members.members[0].endswith(CLONE_SUFFIX) and problem.units[problem.member_unit[original[0]][0]].members == original:
            mirrored.append((unit, problem.member_unit[original[0]][0]))
    assert mirrored
    assert all(problem.unit_class[unit] == problem.unit_class[original] for unit, original in mirrored)
    plan = plan_graph(rewritten, clone_rules, cluster, memory_budget_bytes=float("inf"))
    for unit, _ in mirrored:
        for name in problem.units[unit].members:
            assert plan.node_strategies[name] == plan.node_strategies[name.removesuffix(CLONE_SUFFIX)]


def test_zero3_with_full_recomputation_baseline(blocks):
    _, graph, rules = blocks
    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    plain, full = (baseline_plan(graph, rules, cluster, "zero3", recompute=flag) for flag in (False, True))
    assert full.recompute == (0, 1) and full.solver["kind"] == "zero3+recompute"
    assert full.estimate["memory_bytes_peak"] < plain.estimate["memory_bytes_peak"]
    assert full.estimate["compute_s"] > plain.estimate["compute_s"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_plan_that_recomputes_dropout_layers_matches_one_device(blocks):
    path, graph, rules = blocks
    without, with_recompute = _smallest(graph, rules, cluster_for("cpu-gloo", Mesh((2,))))
    budget_gb = 1.01 * with_recompute / 1e9
    result = subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", str(path), "--nproc", "2", "--steps", "3",
                             "--memory-gb", f"{budget_gb:.9f}", "--check", "--timeout-s", "120"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "recompute: layers" in result.stdout
    assert "check: PASS" in result.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_a_recomputing_plan_file_runs_on_the_capture_rewritten_the_same_way(blocks, tmp_path):
    path, graph, rules = blocks
    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    without, _ = _smallest(graph, rules, cluster)
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=0.99 * without)
    assert plan.recompute
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    result = subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", str(path), "--nproc", "2", "--steps", "2",
                             "--plan", str(plan_file), "--check", "--timeout-s", "120"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert f"recompute: layers {', '.join(map(str, plan.recompute))}" in result.stdout
    assert "check: PASS" in result.stdout


def test_layers_the_user_already_checkpoints_are_not_offered_again():
    import torch

    from metadist.frontends.torch import capture_step
    from test_recompute import Checkpointed, step

    torch.manual_seed(0)
    model = Checkpointed()
    graph = capture_step(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16)).graph
    assert recompute_layers(graph) == ()


@pytest.fixture(scope="module")
def deep_blocks(tmp_path_factory):
    """Eight blocks (seven may recompute): tied layers whose recomputation the ILP prices alike."""
    from metadist.api import capture_and_discover

    folder = tmp_path_factory.mktemp("deep-blocks")
    path = folder / "deep_blocks.py"
    path.write_text(BLOCKS.replace("model=Blocks()", "model=Blocks(depth=8)"))
    graph, rules = capture_and_discover(str(path), str(folder / "rules.db"))
    return graph, rules


def test_alike_layers_share_one_count_and_solve_as_one_binary_each(deep_blocks, monkeypatch):
    """The ILP counts how many of a group of alike layers recompute (one integer, not one binary per layer); the
    optimum is the one-binary-per-layer formulation's, under a budget and when minimizing memory."""
    import metadist.solver.ilp as ilp_module

    graph, rules = deep_blocks
    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    problem = build_problem(graph, rules.rules, cluster)
    candidates = recompute_layers(graph)
    assert len(candidates) == 7
    every = tuple(layer.layer for layer in candidates)
    problem = with_peaks(problem, tuple(sorted({*problem.peaks, *_peaks_after_recompute(graph, every)})))
    terms = recompute_terms(problem, candidates)
    groups = ilp_module._layer_groups(terms)
    assert sorted(index for members in groups for index in members) == list(range(7))
    assert max(len(members) for members in groups) > 1 and len(groups) < 7  # tied layers fold into groups
    for members in groups:  # members of a group are alike term for term
        assert all(terms.seconds[i] == terms.seconds[members[0]] for i in members)
        assert all(per_peak[i] == per_peak[members[0]] for per_peak in terms.freed for i in members)

    without = smallest_memory_bytes(problem)
    grouped_memory = ShardingILP(problem, None, minimize_memory=True, recompute=terms).solve()
    budget = 0.5 * (without + grouped_memory.objective_s)  # some layers must recompute, not all
    grouped = ShardingILP(problem, budget, recompute=terms).solve()
    monkeypatch.setattr(ilp_module, "_layer_groups", lambda t: [(index,) for index in range(len(t.layers))])
    single_memory = ShardingILP(problem, None, minimize_memory=True, recompute=terms).solve()
    single = ShardingILP(problem, budget, recompute=terms).solve()
    assert grouped_memory.objective_s == pytest.approx(single_memory.objective_s, rel=1e-6)
    assert grouped.objective_s == pytest.approx(single.objective_s, rel=1e-4)  # mip_rel_gap 1e-4
    assert 0 < len(grouped.recompute) < 7 and len(grouped.recompute) == len(single.recompute)
    for members in groups:  # of each group, the first layers in layer order
        chosen = [terms.layers[i] for i in members if terms.layers[i] in grouped.recompute]
        assert chosen == [terms.layers[i] for i in members[: len(chosen)]]


def test_the_footprint_ilp_runs_only_for_the_error_the_user_sees(blocks, monkeypatch):
    """A budget only recomputation meets: the plan recomputes, and no memory-minimizing ILP ran for an error nobody
    sees (on LLaMA-70B 128x8 that ILP outlasted the time limit and its failure hid the recomputation). When nothing
    fits, the error names the footprint, or says it could not be computed when that ILP finds none in time."""
    import metadist.solver.planner as planner
    from metadist.solver import SolverError

    _, graph, rules = blocks
    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    without, with_recompute = _smallest(graph, rules, cluster)
    footprints = []
    real = planner.ShardingILP

    class Counting(real):
        def __init__(self, problem, budget, minimize_memory=False, recompute=None, **options):
            if minimize_memory:
                footprints.append(recompute is not None)
            super().__init__(problem, budget, minimize_memory=minimize_memory, recompute=recompute, **options)

    monkeypatch.setattr(planner, "ShardingILP", Counting)
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=0.99 * without)
    assert plan.recompute and footprints == []
    with pytest.raises(InfeasibleBudgetError, match="smallest footprint any plan reaches"):
        plan_graph(graph, rules, cluster, memory_budget_bytes=0.9 * with_recompute)
    assert footprints == [True]  # recomputing every layer: the footprint with recomputation

    class Failing(real):
        def solve(self, time_limit_s=60.0):
            if self.minimize_memory:
                raise SolverError("HiGHS found no plan within 1 s")
            return super().solve(time_limit_s)

    monkeypatch.setattr(planner, "ShardingILP", Failing)
    with pytest.raises(InfeasibleBudgetError, match="could not be computed"):
        plan_graph(graph, rules, cluster, memory_budget_bytes=0.9 * with_recompute)
    with pytest.raises(InfeasibleBudgetError, match="could not be computed"):
        plan_graph(graph, rules, cluster, memory_budget_bytes=0.99 * without, recompute=False)


def test_recomputed_layers_tie_as_their_originals_do(blocks, deep_blocks):
    """Eight blocks make as many classes as three, as captured and with every layer recomputing: the recomputed layers'
    backward runs (their clones first) tie to one another (LLaMA-7B 8x8 rewritten: 1,811 classes where 424 were captured, before
    they did; 461 after)."""
    from types import SimpleNamespace

    from metadist.solver.planner import recomputed_rules

    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    counts = []
    for graph, rules in (blocks[1:], deep_blocks):
        captured = build_problem(graph, rules.rules, cluster).stats["classes_after_tying"]
        rewritten = apply_recompute(graph, [layer.layer for layer in recompute_layers(graph)])
        clone_rules, _ = recomputed_rules(rewritten, rules.rules)
        counts.append((captured, build_problem(rewritten, SimpleNamespace(rules=clone_rules, missing={}).rules,
                                               cluster).stats["classes_after_tying"]))
    (three, three_rewritten), (eight, eight_rewritten) = counts
    assert eight_rewritten == three_rewritten, counts  # five more recomputed layers, no more classes
    # as captured too: the backward reads each layer's weights through their transposes (views of its state), which
    # now split it into one run per layer; it was one run, untied past its first layer (78 classes against 43)
    assert eight == three, counts


def test_a_fractional_relaxation_rounds_each_group_count_up(deep_blocks):
    """The planner's recompute ILP gives a fractional relaxation's layer counts rounded up, group by group, instead of
    branching (LLaMA-70B on 128x8: the same layers as branch and bound, 11 s sooner); the rewritten graph, planned
    next, fits the budget."""
    import math

    import numpy as np

    graph, rules = deep_blocks
    cluster = cluster_for("cpu-gloo", Mesh((2,)))
    problem = build_problem(graph, rules.rules, cluster)
    candidates = recompute_layers(graph)
    every = tuple(layer.layer for layer in candidates)
    problem = with_peaks(problem, tuple(sorted({*problem.peaks, *_peaks_after_recompute(graph, every)})))
    terms = recompute_terms(problem, candidates)
    without = smallest_memory_bytes(problem)
    least = ShardingILP(problem, None, minimize_memory=True, recompute=terms).solve().objective_s
    rounded_up = 0
    for fraction in (0.2, 0.35, 0.5, 0.65, 0.8):
        budget = least + fraction * (without - least)
        ilp = ShardingILP(problem, budget, recompute=terms, round_recompute_up=True)
        solution = ilp.solve()
        exact = ShardingILP(problem, budget, recompute=terms).solve()
        assert solution is not None and exact is not None
        if solution.stats["method"] != "LP relaxation, recompute counts rounded up":
            assert solution.recompute == exact.recompute  # an integral relaxation is the ILP's optimum
            continue
        rounded_up += 1
        values = np.array(ilp._relaxation.getSolution().col_value)
        for members, r in zip(ilp.groups, ilp.r):
            chosen = [terms.layers[i] for i in members if terms.layers[i] in solution.recompute]
            assert chosen == [terms.layers[i] for i in members[: math.ceil(values[r] - 1e-6)]]
        assert solution.objective_s <= exact.objective_s * (1 + 1e-9)  # the relaxation's bound
        plan = plan_graph(graph, rules, cluster, memory_budget_bytes=budget)
        assert plan.recompute and plan.estimate["memory_bytes_peak"] <= budget
    assert rounded_up  # some budget left the relaxation fractional, else this test checks nothing
