"""The solver on captured built-in workloads with ShardCombine's rules."""

from __future__ import annotations

import pytest

from metadist.cost import cluster_for
from metadist.ir import Mesh, Role, Shard
from metadist.solver import baseline_plan, explain, plan_graph


@pytest.fixture(scope="module")
def rules_db():
    return None  # the user's rule database: discovery runs once per machine, not once per test run


def _graph_and_rules(name: str, rules_db: str):
    from metadist.api import capture_and_discover

    return capture_and_discover(name, rules_db)


def _check_consistent(graph, plan):
    assert set(plan.node_strategies) == {node.name for node in graph.nodes}
    # the ILP prices every edge; the estimate prices a resharding its readers share once, as the runtime runs it, and
    # the coalesced calls the plan makes where the objective prices shares of their fixed costs (coalesced_s): the
    # objective bounds the rest (HiGHS solves to a feasibility tolerance)
    assert plan.solver["objective_s"] >= (plan.estimate["step_s"] - plan.estimate["coalesced_s"]) * (1 - 1e-4)
    for out, sharding in zip(graph.outputs, plan.output_shardings):
        if out.replaces:
            assert sharding == plan.input_shardings[out.replaces]


def test_captured_mlp_splits_the_batch_and_explains_itself(rules_db):
    graph, rules = _graph_and_rules("mlp", rules_db)
    cluster = cluster_for("h100x8", Mesh((4,)))
    plan = plan_graph(graph, rules, cluster)
    beam = plan_graph(graph, rules, cluster, solver="beam")
    _check_consistent(graph, plan)
    assert plan.estimate["step_s"] <= beam.estimate["step_s"] * (1 + 1e-9)
    assert plan.solver["nodes_without_rule"].keys() == set(rules.missing)
    assert "chose" in explain(plan, graph.nodes[0].name) or "single strategy" in explain(plan, graph.nodes[0].name)
    assert baseline_plan(graph, rules, cluster, "dp").estimate["step_s"] >= plan.estimate["step_s"] * (1 - 1e-9)


@pytest.mark.slow
def test_captured_gpt2_tiny_on_a_two_level_mesh(rules_db):
    graph, rules = _graph_and_rules("gpt2-tiny", rules_db)
    cluster = cluster_for("h100-ib", Mesh((2, 4)))
    plan = plan_graph(graph, rules, cluster, time_limit_s=60)
    _check_consistent(graph, plan)
    assert plan.solver["classes_after_tying"] < plan.solver["units_after_merging"] < len(graph.nodes) + len(graph.inputs)
    zero3 = baseline_plan(graph, rules, cluster, "zero3")
    assert any(isinstance(p, Shard) for gi in graph.inputs_by_role(Role.PARAM) for p in zero3.input_shardings[gi.value.name])
    assert plan.estimate["step_s"] <= zero3.estimate["step_s"] * (1 + 1e-9)


def test_the_backward_seed_reads_no_value_so_a_data_parallel_loss_is_reduced_with_the_gradients(rules_db):
    """``ones_like(loss)``, the backward's seed, reads the loss for its shape only: captured as the factory it amounts
    to, the loss is read by no node. Under data parallelism the loss is ``Partial`` until the end of the step; read by
    the seed, it was all-reduced before the backward could start, a call of its own on the critical path. Now it is
    reduced at the end, in the gradients' call. (The mean's count of targets, read by the
    backward, is still reduced before it.)"""
    from metadist.lowering import CoalescedReshard, Reshard, lower_for_rank

    graph, rules = _graph_and_rules("mlp", rules_db)
    assert not [node.op.target for node in graph.nodes if node.op.target.endswith("_like.default")]
    loss = next(output.name for output in graph.outputs if output.role is Role.LOSS)
    assert not [node.name for node in graph.nodes if loss in node.input_names]
    plan = baseline_plan(graph, rules, cluster_for("cpu-gloo", Mesh((2,))), "dp")
    program = lower_for_rank(graph, plan, 0, overlap=True)
    (bucket,) = [item for item in program.instructions if isinstance(item, CoalescedReshard) and item.kind == "all_reduce"]
    assert loss in {member.source for member in bucket.members}
    weights = {output.replaces for output in graph.outputs if output.role is Role.PARAM}
    assert len(bucket.members) > len(weights)  # every gradient with it
    assert not [item for item in program.instructions if isinstance(item, Reshard) and item.source == loss]


def test_a_tied_weights_two_partial_gradients_are_added_then_reduced_once(rules_db):
    """GPT-2 ties its embedding to its output layer: the weight's gradient is the sum of two, one from each reader,
    each ``Partial(sum)`` under data parallelism. ``add`` is linear in both operands at once (a joint partial pass,
    ``0+1:sum``), so the sum stays ``Partial(sum)`` and is reduced once, with the other gradients; before, both
    operands were reduced before the add, each in a call of its own."""
    from metadist.lowering import lower_for_rank

    graph, rules = _graph_and_rules("gpt2-tiny", rules_db)
    plan = baseline_plan(graph, rules, cluster_for("cpu-gloo", Mesh((2,))), "dp")
    tied = next(item for item in graph.inputs if item.role is Role.PARAM and item.source.endswith("wte.weight"))
    adds = [node for node in graph.nodes if node.op.target == "aten.add.Tensor" and node.outputs[0].spec == tied.value.spec
            and all(graph.producer(name) is not None for name in node.input_names)]
    joint = [node for node in adds if plan.node_strategies[node.name].choices[0].joint]
    assert len(joint) == 1, [str(plan.node_strategies[node.name].choices[0]) for node in adds]
    program = lower_for_rank(graph, plan, 0, overlap=True)
    reduced = [item.spec.shape for item in program.reshards() if any(step.kind == "all_reduce" for step in item.steps)]
    assert reduced.count(tied.value.spec.shape) == 1
