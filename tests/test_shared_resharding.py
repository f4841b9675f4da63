"""A resharding is priced once per (value, source, target), however many readers share it, as the lowering runs it.

The ILP's objective of every choice equals the estimate's step time, so an optimal plan needs no baseline re-solve;
a problem whose pricing is not the estimate's still gets the baselines' check.
"""

from __future__ import annotations

import random

import pytest

from metadist.cost import cluster_for, reshard
from metadist.ir import Graph, GraphInput, GraphOutput, Mesh, MetaOp, Node, Replicate, Shard, TensorSpec, Value, ValueRef, parse_rule
from metadist.solver import baseline_plan, build_problem, plan_graph
from metadist.solver.estimate import estimate, node_compute_s
from metadist.solver.local_search import objective_s
from metadist.solver.planner import assignment_from
from test_solver_helpers import RULES, mlp_step

R, S0 = Replicate(), Shard(0)
READERS = 6
BATCH, WIDTH, HIDDEN = 512, 16384, 4096


def fan_out_graph():
    """``h = x @ w`` read by READERS nodes without a rule (they run replicated): one all-gather of ``h`` serves them all."""
    spec = lambda *shape: TensorSpec(shape, "float32")  # noqa: E731
    inputs = (GraphInput(Value("batch.x", spec(BATCH, WIDTH)), "batch", "batch.x"),
              GraphInput(Value("w", spec(WIDTH, HIDDEN)), "param", "w"))
    nodes = [Node("h", MetaOp("test.mm"), (ValueRef("batch.x"), ValueRef("w")), (), (Value("h", spec(BATCH, HIDDEN)),))]
    nodes += [Node(f"read_{i}", MetaOp("test.relu"), (ValueRef("h"),), (), (Value(f"read_{i}", spec(BATCH, HIDDEN)),))
              for i in range(READERS)]
    outputs = tuple(GraphOutput(f"read_{i}", "activation") for i in range(READERS))
    return Graph(inputs, tuple(nodes), outputs, name="fan_out"), {"h": parse_rule(RULES["mm"])}


def test_readers_share_one_resharding_and_the_ilp_prices_it_once():
    graph, rules = fan_out_graph()
    cluster = cluster_for("h100x8", Mesh((8,)))
    h = graph.node("h")
    split = next(st for st in _strategies(graph, rules, cluster, "h") if st.inputs == ((S0,), (R,)))
    whole = next(st for st in _strategies(graph, rules, cluster, "h") if st.inputs == ((R,), (R,)))
    gather_s = reshard(h.outputs[0].spec, (S0,), (R,), cluster).comm_s
    split_s, whole_s = node_compute_s(graph, "h", split, cluster), node_compute_s(graph, "h", whole, cluster)
    # the premise: splitting h and gathering it once beats computing it whole, but not when each reader pays a gather
    assert split_s + gather_s < whole_s < split_s + READERS * gather_s
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))
    assert plan.node_strategies["h"].outputs[0] != (R,)  # h is split ...
    assert all(plan.node_strategies[f"read_{i}"].inputs == ((R,),) for i in range(READERS))
    assert plan.estimate["collectives_by_kind"] == {"all_gather": 1}  # ... and gathered once for all its readers
    assert plan.solver["objective_s"] == pytest.approx(plan.estimate["step_s"], rel=1e-9)
    assert plan.solver["baselines_checked"] == {} and plan.solver["baselines_reason"].startswith("not needed")


def _strategies(graph, rules, cluster, name):
    from metadist.solver.strategies import node_strategies

    node = graph.node(name)
    ins = tuple(graph.value(v).spec.shape for v in node.input_names)
    return node_strategies(rules[name], ins, (node.outputs[0].spec.shape,), cluster.mesh, True).strategies


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_objective_equals_the_estimate_for_every_choice(mesh):
    graph, rules = mlp_step(256, 512, 2048, layers=2)  # momentum SGD: bucketed update-phase reads and state outputs
    problem = build_problem(graph, rules, cluster_for("h100-ib", Mesh(mesh)))
    draw = random.Random(0)
    for _ in range(30):
        choice = {c: draw.randrange(problem.strategy_count(c)) for c in problem.classes}
        figures = estimate(graph, assignment_from(problem, choice), problem.cluster, problem.liveness, problem.bucketing)
        # the one difference: the estimate prices the coalesced calls the choice makes, the objective shares of them
        assert objective_s(problem, choice) == pytest.approx(figures["step_s"] - figures["coalesced_s"], rel=1e-9)
    assert problem.prices_as_estimate and problem.charges  # readers of different classes share reshardings here


def test_a_search_priced_unlike_the_estimate_still_never_costs_more_than_a_baseline(monkeypatch):
    """Per-reader pricing (the objective before shared charges) rejects the fan-out's sharing plan, which is data
    parallel's layout; a problem that says it prices unlike the estimate is checked against the baselines."""
    from metadist.solver import problem as problem_module

    def per_reader(self, a, pm, pk, spec, limited, readers, count):  # each reader priced as if it were alone
        self.exact = False
        for reader in readers:
            original(self, a, pm, pk, spec, limited, (reader,), count)

    original = problem_module._Pricing.value
    graph, rules = fan_out_graph()
    cluster = cluster_for("h100x8", Mesh((8,)))
    dp = baseline_plan(graph, rules, cluster, "dp")
    monkeypatch.setattr(problem_module._Pricing, "value", per_reader)
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))
    assert set(plan.solver["baselines_checked"]) == {"dp", "zero2", "zero3", "megatron", "replicated"}
    assert "largest share" in plan.solver["baselines_reason"]
    assert "layout, solved on the same problem" in plan.solver["method"]  # the mispriced search's own plan cost more
    assert plan.estimate["step_s"] <= dp.estimate["step_s"] * (1 + 1e-9)


def test_objective_equals_the_estimate_on_a_captured_model_with_tied_layers():
    """GPT-2's layers are tied (a value's copies priced once, times their count) and its mask and position values are
    read by every layer: on random choices the objective still equals the estimate."""
    from metadist.api import capture_and_discover
    from metadist.workloads import load_workload

    graph, rules = capture_and_discover(load_workload("gpt2-tiny"))  # the session's rule cache: other tests discovered it
    problem = build_problem(graph, rules.rules, cluster_for("cpu-gloo", Mesh((2, 2))), missing=rules.missing)
    assert problem.stats["classes_after_tying"] < problem.stats["units_after_merging"] and problem.charges
    draw = random.Random(1)
    for _ in range(10):
        choice = {c: draw.randrange(problem.strategy_count(c)) for c in problem.classes}
        figures = estimate(graph, assignment_from(problem, choice), problem.cluster, problem.liveness, problem.bucketing)
        # the one difference: the estimate prices the coalesced calls the choice makes, the objective shares of them
        assert objective_s(problem, choice) == pytest.approx(figures["step_s"] - figures["coalesced_s"], rel=1e-9)


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_the_ilp_prices_each_shared_charge_at_its_largest_term_at_fractional_points_too(mesh):
    """The ILP writes a charge as its seconds on its first term plus ``z >= term_k - term_0`` (one row less per charge):
    at any point of the relaxation, not just at integral ones, the charge then costs its seconds times its largest term,
    as ``z >= term_k`` for every term would price it, so the relaxation's optimum is unchanged."""
    import numpy as np

    from metadist.solver.ilp import OBJECTIVE_SCALE, ShardingILP
    from metadist.solver.problem import charge_s

    graph, rules = mlp_step(256, 512, 2048, layers=2)
    problem = build_problem(graph, rules, cluster_for("h100-ib", Mesh(mesh)))
    ilp = ShardingILP(problem, None)
    charged = set(ilp.z)
    assert problem.charges and sum(1 for index, *_ in ilp.rows if charged & set(index)) == sum(
        len(charge.terms) - 1 for charge in problem.charges)  # one row per term after the first
    cost = np.array(ilp.cost)
    draw = random.Random(2)
    for _ in range(10):
        choices = [{c: draw.randrange(problem.strategy_count(c)) for c in problem.classes} for _ in range(3)]
        weights = np.array([draw.random() + 0.1 for _ in choices])
        weights /= weights.sum()
        values = sum(weight * ilp._values_of(choice) for weight, choice in zip(weights, choices))
        expected = sum(weight * objective_s(problem, choice) for weight, choice in zip(weights, choices))
        for charge, z in zip(problem.charges, ilp.z):
            terms = [float(values[ilp._term_variables(term)].sum()) for term in charge.terms]
            values[z] = max(0.0, max(terms) - terms[0])  # the least z the rows allow
            paid = sum(weight * charge_s(problem, charge, choice) for weight, choice in zip(weights, choices))
            expected += charge.seconds * max(terms) - paid  # the mixture pays the largest term, not the mean of maxima
        for index, coefficients, lower, upper in ilp.rows:
            assert lower - 1e-9 <= float(np.dot(values[index], coefficients)) <= upper + 1e-9
        assert float(cost @ values) / OBJECTIVE_SCALE + ilp.constant_s() == pytest.approx(expected, rel=1e-9)
        assert any(0.0 < value < 1.0 for value in values[ilp.z])  # a fractional point, where max differs from a sum
