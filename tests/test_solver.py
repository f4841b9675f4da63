"""Golden tests of the solver on hand-built training steps with hand-written rules.

Each test states a known-good plan and checks the solver recovers it (the pattern of
meta-pytorch/autoparallel's test_optimize_placement.py).
"""

from __future__ import annotations

import json

import pytest

from metadist.cost import cluster_for
from metadist.ir import Mesh, Replicate, Shard
from metadist.ir.plan import Plan
from metadist.solver import InfeasibleBudgetError, SolverError, baseline_plan, explain, plan_graph
from test_solver_helpers import mlp_step

R, S0, S1 = Replicate(), Shard(0), Shard(1)
MIB = 2**20
H100X8 = cluster_for("h100x8", Mesh((8,)))


def _forward_matmuls(plan: Plan, layers: int):
    return [plan.node_strategies[f"mm_{3 * i + j}"] for i in range(layers) for j in (0, 2)]


def test_data_parallel_when_memory_is_ample_and_the_batch_large():
    graph, rules = mlp_step(65536, 256, 1024, layers=2)
    plan = plan_graph(graph, rules, H100X8)
    for strategy in _forward_matmuls(plan, 2):
        assert strategy.inputs[0] == (S0,)  # activations split on the batch dim
        assert strategy.inputs[1] == (R,)  # whole weights: no tensor parallelism
    assert plan.estimate["memory_bytes_peak"] < 80e9


def test_megatron_column_then_row_when_weights_are_large_and_the_batch_small():
    graph, rules = mlp_step(8, 8192, 32768, layers=1)
    plan = plan_graph(graph, rules, H100X8)
    first, second = plan.node_strategies["mm_0"], plan.node_strategies["mm_2"]
    assert first.inputs == ((R,), (S1,))  # column-parallel: w1 split on its output dim
    assert second.inputs == ((S1,), (S0,))  # row-parallel: w2 split on its input dim
    assert second.outputs == ((Partial_sum(),),)  # one all-reduce after the block
    assert plan.input_shardings["layers.0.w1"] == (S1,) and plan.input_shardings["layers.0.w2"] == (S0,)


def Partial_sum():
    from metadist.ir import Partial

    return Partial("sum")


def _state_bytes(plan: Plan) -> float:
    roles = plan.estimate["memory_bytes_by_role"]
    return roles.get("param", 0.0) + roles.get("optim_state", 0.0)


def _sharded(plan: Plan, suffix: str) -> int:
    return sum(1 for name, sharding in plan.input_shardings.items() if name.startswith("layers") and name.endswith(suffix) and sharding != (R,))


def test_shrinking_budget_shards_optimizer_state_then_parameters():
    graph, rules = mlp_step(4096, 2048, 1024, layers=2)
    plans = [plan_graph(graph, rules, H100X8, memory_budget_bytes=budget * MIB) for budget in (1e6, 45, 35)]
    ample, middle, tight = plans
    for plan, budget in zip(plans, (1e6, 45, 35)):
        assert plan.estimate["memory_bytes_peak"] <= budget * MIB
    assert _sharded(ample, ":momentum") == 4  # the update runs on 1/8 of each state: ZeRO-like even when memory is ample
    assert _sharded(ample, ".w1") + _sharded(ample, ".w2") < 4  # most parameters stay whole
    assert _sharded(tight, ".w1") + _sharded(tight, ".w2") == 4  # parameters sharded too: FSDP-like
    assert _state_bytes(ample) > _state_bytes(middle) >= _state_bytes(tight)
    assert ample.estimate["step_s"] <= middle.estimate["step_s"] <= tight.estimate["step_s"]


def test_infeasible_budget_names_the_smallest_footprint():
    graph, rules = mlp_step(4096, 2048, 1024, layers=2)
    with pytest.raises(InfeasibleBudgetError, match="smallest footprint") as caught:
        plan_graph(graph, rules, H100X8, memory_budget_bytes=10 * MIB)
    minimum = caught.value.minimum_bytes
    assert 10 * MIB < minimum < 40 * MIB
    assert "--memory-gb" in str(caught.value)
    plan = plan_graph(graph, rules, H100X8, memory_budget_bytes=minimum * 1.02)
    assert plan.estimate["memory_bytes_peak"] <= minimum * 1.02


def test_heavy_traffic_lands_on_the_fast_axis_of_a_two_level_mesh():
    graph, rules = mlp_step(4096, 2048, 8192, layers=2)
    cluster = cluster_for("h100-ib", Mesh((4, 8), ("node", "gpu")))
    plan = plan_graph(graph, rules, cluster)
    sent = plan.estimate["comm_bytes_by_axis"]
    assert sent["gpu"] > 2 * sent["node"]


def _without_timings(plan: Plan) -> dict:
    data = plan.to_dict()
    for key in ("problem_build_s", "build_s", "solve_s", "explain_s"):
        data["solver"].pop(key, None)
    for search in ("whole_calls", "short_waits"):  # a second search's report holds its seconds
        data["solver"].get(search, {}).pop("search_s", None)
    return data


def test_plans_are_deterministic_and_round_trip_through_json():
    graph, rules = mlp_step(1024, 512, 2048, layers=2)
    first = plan_graph(graph, rules, H100X8)
    second = plan_graph(graph, rules, H100X8)
    assert _without_timings(first) == _without_timings(second)
    again = Plan.from_json(first.to_json())
    assert again.node_strategies == first.node_strategies and again.input_shardings == first.input_shardings
    assert json.loads(again.to_json()) == json.loads(first.to_json())


def test_objective_bounds_the_estimate_and_state_outputs_end_where_they_started():
    graph, rules = mlp_step(1024, 512, 2048, layers=2)
    plan = plan_graph(graph, rules, cluster_for("h100-ib", Mesh((2, 4))))
    # the ILP prices every edge; the estimate prices a resharding shared by several readers once, as the runtime runs
    # it, and the coalesced calls the plan makes where the objective shares their fixed costs (coalesced_s)
    assert plan.solver["objective_s"] >= (plan.estimate["step_s"] - plan.estimate["coalesced_s"]) * (1 - 1e-9)
    for out, sharding in zip(graph.outputs, plan.output_shardings):
        if out.replaces:
            assert sharding == plan.input_shardings[out.replaces]
    assert len(plan.node_strategies) == len(graph.nodes)


def test_ilp_is_no_worse_than_beam_search():
    graph, rules = mlp_step(2048, 1024, 4096, layers=2)
    cluster = cluster_for("h100-ib", Mesh((2, 4)))
    ilp = plan_graph(graph, rules, cluster, solver="ilp")
    beam = plan_graph(graph, rules, cluster, solver="beam", beam_width=4)
    assert ilp.estimate["step_s"] <= beam.estimate["step_s"] * (1 + 1e-9)
    assert beam.solver["solver"] == "beam"


def test_repeated_layers_are_tied_and_solved_once():
    graph, rules = mlp_step(2048, 512, 2048, layers=4)
    plan = plan_graph(graph, rules, H100X8)
    assert plan.solver["classes_after_tying"] < plan.solver["units_after_merging"]
    assert plan.node_strategies["mm_3"] == plan.node_strategies["mm_6"]  # layers 1 and 2, forward
    assert plan.input_shardings["layers.1.w1"] == plan.input_shardings["layers.2.w1"]


def test_a_batch_the_mesh_does_not_divide_is_split_unevenly():
    # 6 rows over 4 devices: torch.chunk pieces of 2, 2, 2, 0 (excluded before uneven shards were planned). Rows of
    # 16 Mi elements, no weights, and rules that split only the rows: splitting quarters the work (a third, on the
    # largest piece) and costs one scalar all-reduce.
    from metadist.ir import Graph, GraphOutput
    from test_solver_helpers import _Builder

    b = _Builder("float32")
    x = b.input("batch.x", (6, 1 << 24), "batch")
    relu = b.op("relu", [x], (6, 1 << 24), rule="a_->a_")
    loss = b.op("sum", [relu], (), rule="a_-> | a:sum | pass 0:sum")
    graph = Graph(tuple(b.inputs), tuple(b.nodes), (GraphOutput(loss, "loss", source="loss"),), name="rows")
    plan = plan_graph(graph, b.rules, cluster_for("h100x8", Mesh((4,))))
    assert plan.solver["excluded_indivisible_strategies"] == 0 and plan.solver["uneven_strategies"] > 0
    assert plan.node_strategies["relu_0"].inputs[0] == (S0,)


def test_a_node_without_a_rule_is_replicated_and_listed_with_its_cost():
    graph, rules = mlp_step(4096, 512, 2048, layers=1)
    rules = {name: rule for name, rule in rules.items() if name != "relu_1"}
    plan = plan_graph(graph, rules, H100X8)
    assert plan.node_strategies["relu_1"].inputs == ((R,),)
    listed = plan.solver["nodes_without_rule"]["relu_1"]
    assert listed["reason"] == "no rule given" and listed["compute_s"] > 0


def test_explain_names_the_runner_up():
    graph, rules = mlp_step(8, 8192, 32768, layers=1)
    plan = plan_graph(graph, rules, H100X8)
    text = explain(plan, "mm_0")
    assert "chose" in text and "runner-up" in text and "communication" in text
    assert "sharding" in explain(plan, "layers.0.w1")


def test_a_plan_made_without_its_explanations_is_the_same_plan_and_says_so_when_asked():
    graph, rules = mlp_step(2048, 1024, 4096, layers=2)
    cluster = cluster_for("h100-ib", Mesh((2, 4)))
    explained, bare = plan_graph(graph, rules, cluster), plan_graph(graph, rules, cluster, explain=False)
    assert explained.solver["explain"] and "explain" not in bare.solver and "explain_s" not in bare.solver
    explained_data = _without_timings(explained)
    del explained_data["solver"]["explain"]
    assert _without_timings(bare) == explained_data
    with pytest.raises(SolverError, match="made without its explanations"):
        explain(bare, "layers.0.w1")
    baseline = baseline_plan(graph, rules, cluster, "zero3", explain=False)
    assert "explain" not in baseline.solver
    assert baseline.node_strategies == baseline_plan(graph, rules, cluster, "zero3").node_strategies


def test_explanations_price_each_class_on_its_own_edges_as_on_all_of_them():
    """The explanation looks up each class's edges once (a scan of every edge per class took 0.3 s on LLaMA-7B 8x8);
    each class's costs are the same as when every edge is scanned."""
    from metadist.solver.explain import _class_costs, explanation_data
    from metadist.solver.problem import build_problem

    graph, rules = mlp_step(2048, 1024, 4096, layers=2)
    problem = build_problem(graph, rules, cluster_for("h100-ib", Mesh((2, 4))))
    assert problem.edges  # the case under test: classes with several strategies on both ends of a resharding
    choice = {c: problem.strategy_count(c) - 1 for c in problem.classes}
    data = explanation_data(problem, choice, None)
    for c in problem.classes:
        if problem.strategy_count(c) == 1:
            continue
        mine = [edge for edge in problem.edges if c in (edge.producer, edge.consumer)]
        assert _class_costs(problem, c, choice, (), mine) == _class_costs(problem, c, choice)
        for name in problem.units[c].members:
            compute, comm = _class_costs(problem, c, choice, (), mine)
            if name in data:
                assert data[name]["compute_s"] == compute[choice[c]]


def test_baselines_are_priced_by_the_same_model_and_never_beat_the_plan():
    graph, rules = mlp_step(2048, 1024, 4096, layers=2)
    cluster = cluster_for("h100-ib", Mesh((2, 4)))
    plan = plan_graph(graph, rules, cluster)
    baselines = {kind: baseline_plan(graph, rules, cluster, kind) for kind in ("dp", "zero2", "zero3", "megatron")}
    params = [n for n in plan.input_shardings if n.startswith("layers") and ":" not in n]
    states = [n for n in plan.input_shardings if n.endswith(":momentum")]
    assert all(baselines["dp"].input_shardings[n] == (R, R) for n in params + states)
    assert all(baselines["zero2"].input_shardings[n] == (R, R) for n in params)
    assert all(baselines["zero2"].input_shardings[n] != (R, R) for n in states)
    assert all(baselines["zero3"].input_shardings[n] != (R, R) for n in params)
    assert all(baselines["megatron"].input_shardings[n][0] == R for n in params)
    for baseline in baselines.values():
        assert plan.estimate["step_s"] <= baseline.estimate["step_s"] * (1 + 1e-9)


def test_strategies_are_enumerated_jointly_over_axes_and_exclusions_counted():
    from metadist.ir import parse_rule
    from metadist.solver.strategies import node_strategies

    mesh = Mesh((2, 4))
    found = node_strategies(parse_rule("ab,bc->ac | b:sum"), ((8, 6), (6, 16)), ((8, 16),), mesh)
    choices = {tuple(str(c) for c in st.choices) for st in found.strategies}
    assert ("f0", "f0") in choices  # both axes split the same dim (8 = 2 x 4)
    assert ("f1", "f2") in choices and ("R", "f2") in choices
    assert ("f1", "f1") in choices and found.uneven > 0  # 6 over 8: torch.chunk pieces, priced with their padding
    assert found.excluded_indivisible == 0
    blocked = node_strategies(parse_rule("ab->ab | a:chunk=2"), ((8, 8),), ((8, 8),), mesh)
    assert blocked.excluded_inexpressible > 0
    assert all(choice.index != 0 for st in blocked.strategies for choice in st.choices if choice.kind == "factor")


def test_local_search_improves_a_rounding_and_never_beats_the_ilp():
    from metadist.solver.ilp import ShardingILP
    from metadist.solver.local_search import improve, memory_at_peaks, objective_s, round_relaxation
    from metadist.solver.problem import build_problem

    graph, rules = mlp_step(64, 1024, 4096, layers=2)
    problem = build_problem(graph, rules, cluster_for("h100-ib", Mesh((2, 4))))
    exact = ShardingILP(problem, None).solve(60.0)
    assert objective_s(problem, exact.choice) == pytest.approx(exact.objective_s, rel=1e-6)
    flat = {c: [1.0] * problem.strategy_count(c) for c in problem.classes}
    start = round_relaxation(problem, flat)  # every class on its first strategy
    improved = improve(problem, start, None)
    assert exact.objective_s * (1 - 1e-9) <= objective_s(problem, improved) <= objective_s(problem, start)
    budget = max(memory_at_peaks(problem, start))
    fitted = improve(problem, start, budget)
    assert max(memory_at_peaks(problem, fitted)) <= budget
    # the rounded relaxation reports its exact gap to the bound it is given
    ilp = ShardingILP(problem, None)
    values = ilp._values_of(start)
    rounded = ilp.rounded(values, exact.objective_s, 0.0)
    assert rounded.stats["mip_gap"] == pytest.approx((rounded.objective_s - exact.objective_s) / rounded.objective_s, abs=1e-12)


def test_repair_moves_a_rounding_that_breaks_the_budget_into_it():
    """A rounded relaxation under a tight budget breaks it at a few peaks; :func:`repair` moves classes until it fits
    (where the rounding was thrown away and branch and bound took a minute on LLaMA-70B), or says None when no move
    can: the budget below the smallest footprint any plan reaches."""
    from metadist.solver.ilp import ShardingILP
    from metadist.solver.local_search import memory_at_peaks, objective_s, repair, round_relaxation
    from metadist.solver.planner import smallest_memory_bytes
    from metadist.solver.problem import build_problem

    graph, rules = mlp_step(4096, 2048, 1024, layers=2)
    problem = build_problem(graph, rules, cluster_for("h100-ib", Mesh((2, 4))))
    start = round_relaxation(problem, {c: [1.0] * problem.strategy_count(c) for c in problem.classes})  # replicated
    peak, smallest = max(memory_at_peaks(problem, start)), smallest_memory_bytes(problem)
    assert smallest < 0.5 * peak
    assert repair(problem, start, peak) == start  # already fits: unchanged
    budget = 0.5 * (smallest + peak)
    repaired = repair(problem, start, budget)
    assert repaired is not None and max(memory_at_peaks(problem, repaired)) <= budget
    assert sum(repaired[c] != start[c] for c in problem.classes) < len(problem.classes)  # a few moves, not a new plan
    assert repair(problem, start, 0.99 * smallest) is None
    # the ILP's rounding repairs before it improves: a plan within the budget, its gap to the exact optimum reported
    ilp = ShardingILP(problem, budget)
    exact = ilp.solve(60.0)
    rounded = ilp.rounded(ilp._values_of(start), exact.objective_s, 0.0)
    assert rounded is not None and max(memory_at_peaks(problem, rounded.choice)) <= budget
    assert rounded.objective_s == pytest.approx(objective_s(problem, rounded.choice), rel=1e-12)
    assert rounded.objective_s >= exact.objective_s * (1 - 1e-9)


@pytest.mark.parametrize("first_peaks", ["none", "some"])
def test_peaks_added_to_a_solved_ilp_solve_on_to_the_fresh_ilps_optimum(first_peaks):
    """The planner adds a plan's true memory peak and solves again: the ILP takes the new peaks' rows into the
    relaxation it solved and runs on from its basis, with the optimum of an ILP built afresh with every peak."""
    from metadist.solver.ilp import ShardingILP
    from metadist.solver.local_search import memory_at_peaks
    from metadist.solver.problem import build_problem, with_peaks

    graph, rules = mlp_step(4096, 2048, 1024, layers=2)
    problem = build_problem(graph, rules, H100X8)
    assert len(problem.peaks) > 1
    budget = 45 * MIB  # binds (test_the_relaxation_takes_the_memory_rows_only_when_its_optimum_breaks_the_budget)
    first = with_peaks(problem, () if first_peaks == "none" else problem.peaks[:1])
    ilp = ShardingILP(first, budget)
    before = ilp.solve(60.0)
    assert max(memory_at_peaks(problem, before.choice)) > budget  # the peaks left out break the budget
    full = with_peaks(first, problem.peaks)
    ilp.add_peaks(full)
    after = ilp.solve(60.0)
    fresh = ShardingILP(full, budget).solve(60.0)
    assert max(memory_at_peaks(full, after.choice)) <= budget
    assert after.objective_s == pytest.approx(fresh.objective_s, rel=2e-4)  # both within mip_rel_gap 1e-4
    with pytest.raises(SolverError, match="same problem with more peaks"):
        ilp.add_peaks(first)


def test_a_budget_below_every_peaks_floor_is_infeasible_with_nothing_solved(monkeypatch):
    """Each class at its smallest at a peak bounds that peak from below: over the budget, no plan fits, and HiGHS is not
    run to find out; the floor never exceeds what the memory-minimizing ILP reaches."""
    from metadist.solver.ilp import ShardingILP
    from metadist.solver.planner import smallest_memory_bytes
    from metadist.solver.problem import build_problem

    graph, rules = mlp_step(4096, 2048, 1024, layers=2)
    problem = build_problem(graph, rules, H100X8)
    smallest = smallest_memory_bytes(problem)
    floor = max(ShardingILP(problem, None).memory_floor_bytes())
    assert 0 < floor <= smallest * (1 + 1e-9)

    def no_highs(*args, **kwargs):
        raise AssertionError("HiGHS ran")

    monkeypatch.setattr(ShardingILP, "_run", no_highs)
    assert ShardingILP(problem, 0.9 * floor).solve(60.0) is None
    with pytest.raises(AssertionError, match="HiGHS ran"):  # a budget above the floor is left to the solver
        ShardingILP(problem, 1.1 * smallest).solve(60.0)


def test_a_baseline_whose_restricted_floor_breaks_the_budget_is_refused_with_nothing_solved(monkeypatch):
    """A baseline's restriction raises each peak's floor (its classes at their smallest among the strategies they may
    take): where that floor breaks the budget, the restricted problem has no plan and HiGHS is not run to find out
    (LLaMA-70B on 128x8 under 80 GB: data parallelism, ZeRO-2 and Megatron took ~16 s each so); below it, the
    restricted relaxation runs and its plan fits."""
    from metadist.solver.baselines import baseline_choices
    from metadist.solver.ilp import ShardingILP
    from metadist.solver.local_search import memory_at_peaks
    from metadist.solver.problem import build_problem

    graph, rules = mlp_step(4096, 2048, 1024, layers=2)
    problem = build_problem(graph, rules, H100X8)
    allowed = baseline_choices(problem, "dp")
    assert allowed
    unbudgeted = ShardingILP(problem, None)
    free, restricted = (max(unbudgeted.memory_floor_bytes(restriction)) for restriction in (None, allowed))
    assert restricted > free * 1.5  # every parameter whole on every device, its gradient and optimizer states too
    runs = []
    original = ShardingILP._run_lp
    monkeypatch.setattr(ShardingILP, "_run_lp", lambda self, *args: runs.append(1) or original(self, *args))
    budget = (free + restricted) / 2
    ilp = ShardingILP(problem, budget)
    assert ilp.restricted(allowed, 60.0) is None and not runs
    roomy = 2 * restricted
    solution = ShardingILP(problem, roomy).restricted(allowed, 60.0)
    assert runs and solution is not None and max(memory_at_peaks(problem, solution.choice)) <= roomy


@pytest.mark.parametrize("batch", [256, 384])
def test_a_plan_whose_coalesced_calls_cost_more_than_their_shares_is_searched_again_and_compared_with_the_baselines(batch):
    """The objective shares a coalesced call's fixed cost among every update-phase value (buckets / values); the
    estimate prices the calls the plan makes, one per bucket of each kind, axis, reduce op and dtype. Where those cost
    more than their shares by over 0.5 % of the step, the problem is solved again with every coalesced resharding
    priced as a call of its own, and the cheaper plan by the estimate is then compared with the baselines' layouts and
    the replicated layout (every rank the whole step, no collective). At 256 rows the second search's plan wins (no
    collective, one matmul split locally: cheaper than the replicated layout); at 384 data parallelism's one
    all-reduce of the gradients does."""
    graph, rules = mlp_step(batch, 64, 256, layers=2)
    cluster = cluster_for("cpu-gloo", Mesh((4,)))
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))
    whole = plan.solver["whole_calls"]
    assert whole["kept"] == "whole calls" and whole["step_s"] < whole["step_s_at_shares"]
    assert plan.solver["baselines_reason"].startswith("the plan is the second search's")
    checked = plan.solver["baselines_checked"]
    assert set(checked) == {"dp", "zero2", "zero3", "megatron", "replicated"}
    baselines = {kind: baseline_plan(graph, rules, cluster, kind).estimate["step_s"] for kind in ("dp", "zero2", "zero3", "megatron")}
    assert plan.estimate["step_s"] <= min([*baselines.values(), *checked.values(), whole["step_s"]]) * (1 + 1e-6)
    if batch == 384:
        assert plan.solver["method"].startswith("dp layout, solved on the same problem")
        assert checked["dp"] == pytest.approx(plan.estimate["step_s"], rel=1e-6)
        assert checked["dp"] < whole["step_s"]
    else:
        assert plan.solver["method"].endswith("every coalesced resharding priced as a call of its own")
        assert plan.estimate["step_s"] == pytest.approx(whole["step_s"], rel=1e-6)
        assert plan.estimate["comm_s"] == 0 and plan.estimate["step_s"] < checked["replicated"] < checked["dp"]


def test_the_replicated_layout_is_compared_and_kept_where_every_plan_with_calls_costs_more(monkeypatch):
    """The replicated layout (every rank the whole step) is one choice, priced by the estimate beside the baselines:
    where the search's plan is poor (a stand-in for a mispriced or unfinished search) and every call costs more than
    the compute it saves, it is the plan, with no collective."""
    from metadist.solver.ilp import ShardingILP, Solution
    from metadist.solver.local_search import objective_s

    def poor_search(self, time_limit_s=60.0, start=None):
        choice = {c: len(self.x.get(c, [0])) - 1 for c in self.problem.classes}
        return Solution(choice, objective_s(self.problem, choice), self._stats(0.0, "Feasible", 0.5, 0, "poor search"))

    graph, rules = mlp_step(256, 64, 256, layers=2)
    cluster = cluster_for("cpu-gloo", Mesh((4,)))
    monkeypatch.setattr(ShardingILP, "solve", poor_search)
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))
    checked = plan.solver["baselines_checked"]
    assert plan.solver["method"].startswith("replicated layout")
    assert checked["replicated"] == pytest.approx(plan.estimate["step_s"], rel=1e-6)
    assert all(seconds is None or seconds > checked["replicated"] for kind, seconds in checked.items() if kind != "replicated")
    assert plan.estimate["comm_s"] == 0 and plan.estimate["collectives_by_kind"] == {}
    assert all(isinstance(p, Replicate) for sharding in plan.input_shardings.values() for p in sharding)
    assert all(all(choice.kind == "replicate" for choice in strategy.choices) for strategy in plan.node_strategies.values())


def test_a_layout_without_a_replicated_strategy_offers_no_replicated_choice():
    from metadist.solver.planner import replicated_choice
    from metadist.solver.problem import Restrictions, build_problem

    graph, rules = mlp_step(64, 64, 256, layers=2)
    cluster = cluster_for("cpu-gloo", Mesh((4,)))
    free = build_problem(graph, rules, cluster, Restrictions(), {})
    choice = replicated_choice(free)
    assert choice is not None and set(choice) == set(free.classes)
    pinned = build_problem(graph, rules, cluster, Restrictions(input_shardings={"batch.x": frozenset({(Shard(0),)})}), {})
    assert replicated_choice(pinned) is None


def test_a_plan_not_proven_optimal_never_costs_more_than_a_baseline(monkeypatch):
    from metadist.solver.ilp import ShardingILP, Solution
    from metadist.solver.local_search import objective_s

    def poor_search(self, time_limit_s=60.0, start=None):  # stands in for a rounding or a time limit: a feasible, poor plan
        choice = {c: len(self.x.get(c, [0])) - 1 for c in self.problem.classes}
        return Solution(choice, objective_s(self.problem, choice), self._stats(0.0, "Feasible", 0.5, 0, "poor search"))

    graph, rules = mlp_step(4096, 256, 1024, layers=2)
    cluster = cluster_for("h100-ib", Mesh((2, 4)))
    baselines = {kind: baseline_plan(graph, rules, cluster, kind).estimate["step_s"] for kind in ("dp", "zero2", "zero3", "megatron")}
    monkeypatch.setattr(ShardingILP, "solve", poor_search)
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))
    assert set(plan.solver["baselines_checked"]) == {*baselines, "replicated"}
    assert "layout, solved on the same problem" in plan.solver["method"]
    assert plan.estimate["step_s"] <= min(baselines.values()) * (1 + 1e-6)
    assert plan.solver["objective_s"] == pytest.approx(plan.estimate["step_s"] - plan.estimate["coalesced_s"], rel=1e-4)


def test_when_the_relaxation_runs_out_of_time_branch_and_bound_starts_from_the_replicated_plan(monkeypatch, caplog):
    """A relaxation that does not finish (LLaMA-tiny under the bf16 policy with every layer recomputed, on 2x2) left
    branch and bound without a start, and it found no plan at all. Here both solves get no time: branch and bound
    keeps the replicated start, and the stats say the time limit stopped the solver."""
    from metadist.solver import ilp

    graph, rules = mlp_step(2048, 512, 2048, layers=2)
    run = ilp.ShardingILP._run
    monkeypatch.setattr(ilp.ShardingILP, "_run", lambda self, time_limit_s, relax, start=None: run(self, 1e-9, relax, start))
    with caplog.at_level("WARNING", logger="metadist.solver.ilp"):
        plan = plan_graph(graph, rules, H100X8)
    assert "branch and bound starts from the replicated plan" in caplog.text
    assert plan.solver["status"] == "Time limit reached"
    # not proven optimal, so the planner also priced the baselines' layouts and kept the cheapest (here Megatron's)
    assert plan.solver["baselines_reason"].startswith("not proven")
    assert plan.estimate["step_s"] <= baseline_plan(graph, rules, H100X8, "dp").estimate["step_s"]


@pytest.mark.parametrize("stopped", ["relaxation", "branch and bound"])
def test_a_search_given_a_plan_ends_no_dearer_than_it_however_short_its_time(monkeypatch, stopped):
    """The planner's second search starts from the first search's plan. Stopped by its time limit, before its
    relaxation ends or in branch and bound after a rounding dearer than the plan given, it keeps the plan given
    (where it started from the replicated plan or the rounding, and ended with either)."""
    from metadist.solver import ilp
    from metadist.solver.local_search import objective_s
    from metadist.solver.problem import build_problem

    graph, rules = mlp_step(2048, 512, 2048, layers=2)
    problem = build_problem(graph, rules, H100X8)
    best = ilp.ShardingILP(problem, None).solve(60.0)
    replicated = {c: 0 for c in problem.classes}
    assert best.objective_s < 0.9 * objective_s(problem, replicated)
    run = ilp.ShardingILP._run
    if stopped == "relaxation":
        monkeypatch.setattr(ilp.ShardingILP, "_run", lambda self, time_limit_s, relax, start=None: run(self, 1e-9, relax, start))
    else:  # a fractional relaxation whose rounding is the replicated plan, far from the bound
        monkeypatch.setattr(ilp.ShardingILP, "_run",
                            lambda self, time_limit_s, relax, start=None: run(self, 60.0 if relax else 1e-9, relax, start))
        monkeypatch.setattr(ilp.ShardingILP, "_integral", lambda self, values: False)
        monkeypatch.setattr(ilp.ShardingILP, "rounded", lambda self, values, bound_s, started, allowed=None: ilp.Solution(
            choice=replicated, objective_s=objective_s(problem, replicated), stats={"mip_gap": 0.5}))
    stuck = ilp.ShardingILP(problem, None).solve(60.0)
    assert stuck.objective_s == pytest.approx(objective_s(problem, replicated), rel=1e-9)
    given = ilp.ShardingILP(problem, None).solve(60.0, start=best.choice)
    assert given.choice == best.choice and given.objective_s == pytest.approx(best.objective_s, rel=1e-9)


def test_a_plan_carries_into_a_problem_of_the_same_graph_built_on_other_figures():
    """The second search's start: the first plan, class by class of a problem built on the same graph with other
    figures; none where the strategies differ (another mesh)."""
    from metadist.solver.ilp import ShardingILP
    from metadist.solver.planner import assignment_from, choice_in
    from metadist.solver.problem import build_problem

    graph, rules = mlp_step(2048, 512, 2048, layers=2)
    problem = build_problem(graph, rules, H100X8)
    best = ShardingILP(problem, None).solve(60.0)
    assert any(best.choice.values())  # not the replicated plan: a mapping that drops strategies would show
    assert choice_in(problem, best.choice, problem) == best.choice
    other = build_problem(graph, rules, cluster_for("v100x8", Mesh((8,))))
    mapped = choice_in(problem, best.choice, other)
    assert mapped is not None and set(mapped) == set(other.classes)
    assert assignment_from(other, mapped) == assignment_from(problem, best.choice)
    assert choice_in(problem, best.choice, build_problem(graph, rules, cluster_for("h100-ib", Mesh((2, 4))))) is None


@pytest.mark.parametrize("budget_mib, binds", [(45, True), (1e6, False)])
def test_the_relaxation_takes_the_memory_rows_only_when_its_optimum_breaks_the_budget(budget_mib, binds):
    """Left out, the budget's dense rows cost the simplex nothing when the unconstrained optimum meets them; when it
    breaks one they join and the relaxation solves on: either way its optimum is the one with every row from the start."""
    from metadist.solver.ilp import ShardingILP, quiet_highs
    from metadist.solver.local_search import memory_at_peaks
    from metadist.solver.problem import build_problem

    graph, rules = mlp_step(4096, 2048, 1024, layers=2)
    problem = build_problem(graph, rules, H100X8)
    ilp = ShardingILP(problem, budget_mib * MIB)
    assert ilp.memory_rows
    lazy = ilp._run(60.0, relax=True)
    eager = quiet_highs()
    model = ilp._model(with_memory_rows=True)
    model.integrality_ = []
    eager.passModel(model)
    eager.run()
    assert lazy.getNumRow() == len(ilp.rows) + (len(ilp.memory_rows) if binds else 0)
    assert lazy.getInfo().objective_function_value == pytest.approx(eager.getInfo().objective_function_value, rel=1e-9)
    solution = ShardingILP(problem, budget_mib * MIB).solve(60.0)
    assert max(memory_at_peaks(problem, solution.choice)) <= budget_mib * MIB
    unconstrained = ShardingILP(problem, None).solve(60.0)
    assert (solution.objective_s > unconstrained.objective_s * (1 + 1e-9)) == binds


def test_highs_refusing_to_run_is_a_clear_solver_error():
    """HiGHS solves nothing when an option clashes with its process-wide state (a thread count other than its scheduler's):
    a SolverError that says so, never a plan read from an unsolved model. MetaDist's own instances share one count."""
    from metadist.solver.ilp import SOLVER_THREADS, quiet_highs, run_highs

    tiny = quiet_highs()
    assert tiny.getOptionValue("threads")[1] == SOLVER_THREADS
    tiny.addVar(0.0, 1.0)
    tiny.changeColCost(0, 1.0)
    run_highs(tiny)  # starts the scheduler (if nothing in this process has) on MetaDist's count
    clashing = quiet_highs()
    clashing.addVar(0.0, 1.0)
    clashing.setOptionValue("threads", 977)  # no scheduler started with this many
    with pytest.raises(SolverError, match="HiGHS refused to solve"):
        run_highs(clashing)


def test_a_problem_priced_again_under_other_bucketing_equals_the_one_built_under_it():
    """The second search at whole calls reprices a built problem's reshardings under ``NO_BUCKETING``
    (:func:`metadist.solver.problem.with_bucketing`) instead of building it again: its edges, shared charges and
    linear seconds are those a problem built under that bucketing has, its strategies, classes, compute and memory
    rows (added peaks too) those of the problem it came from."""
    from metadist.cost import NO_BUCKETING, bucketing_for
    from metadist.solver.problem import Restrictions, build_problem, with_bucketing, with_peaks

    graph, rules = mlp_step(256, 64, 256, layers=2)
    cluster = cluster_for("cpu-gloo", Mesh((4,)))
    restrictions = Restrictions()
    shared = build_problem(graph, rules, cluster, restrictions, bucketing=bucketing_for(graph))
    assert shared.bucketing.edges  # the update phase's reshardings are coalesced: the two prices differ
    shared = with_peaks(shared, tuple(sorted({*shared.peaks, len(graph.nodes) // 2})))
    whole = build_problem(graph, rules, cluster, restrictions, bucketing=NO_BUCKETING)
    again = with_bucketing(shared, restrictions, NO_BUCKETING)
    assert again is not None and again.bucketing is NO_BUCKETING
    assert again.linear_comm_s == whole.linear_comm_s and again.linear_comm_s != shared.linear_comm_s
    assert again.edges == whole.edges and again.charges == whole.charges
    assert again.prices_as_estimate == whole.prices_as_estimate
    assert again.units == whole.units and again.compute_s == whole.compute_s and again.classes == whole.classes
    assert again.peaks == shared.peaks and again.memory_bytes == shared.memory_bytes  # the added peak kept
    assert again.stats["bucketed_edges"] == 0 and again.stats["graph_nodes"] == whole.stats["graph_nodes"]
    # a bucketing that starts the update phase elsewhere offers other strategies: built again, not repriced
    moved = bucketing_for(graph).__class__(frozenset(), 1.0, shared.bucketing.update_start + 1)
    assert with_bucketing(shared, restrictions, moved) is None
