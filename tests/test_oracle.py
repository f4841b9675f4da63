"""The DTensor oracle (metadist.shardcombine.oracle): DTensor's strategies as factors, and the execution re-check.

Rules come from the real discovery (``graph_rules`` with the PyTorch executor); DTensor's strategies from
its sharding propagator on a 1-D mesh of a fake process group (one process, nothing launched).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.tensor", reason="the oracle needs torch.distributed.tensor (DTensor)")

from metadist.frontends.torch.discovery import TorchExecutor  # noqa: E402
from metadist.ir import Graph, GraphInput, GraphOutput, MetaOp, Node, TensorSpec, Value, ValueRef, parse_rule  # noqa: E402
from metadist.shardcombine.api import graph_rules  # noqa: E402
from metadist.shardcombine.errors import OracleError  # noqa: E402
from metadist.shardcombine.oracle import (  # noqa: E402
    DTensorOracle,
    Strategy,
    check_rule_by_execution,
    compare_node,
    merge_reports,
    rule_strategies,
    verify_graph,
)
from metadist.shardcombine.executor import op_call  # noqa: E402


@pytest.fixture(scope="module")
def oracle():
    with DTensorOracle(mesh_size=2) as started:
        yield started


@pytest.fixture(scope="module")
def executor():
    return TorchExecutor()


def one_node_graph(target: str, inputs: list[tuple[int, ...]], args: tuple, outputs: list[tuple[int, ...]]) -> Graph:
    """A graph of one node; ``args`` holds ``"x0"``... where the inputs go."""
    graph_inputs = tuple(GraphInput(Value(f"x{i}", TensorSpec(shape, "float32")), "batch") for i, shape in enumerate(inputs))
    node_args = tuple(ValueRef(arg) if isinstance(arg, str) and arg.startswith("x") else arg for arg in args)
    node_outputs = tuple(Value(f"out{i}", TensorSpec(shape, "float32")) for i, shape in enumerate(outputs))
    node = Node("op", MetaOp(target), node_args, (), node_outputs)
    return Graph(graph_inputs, (node,), (GraphOutput("out0", "activation"),))


CASES = {
    "mm": one_node_graph("aten.mm.default", [(16, 12), (12, 8)], ("x0", "x1"), [(16, 8)]),
    "add": one_node_graph("aten.add.Tensor", [(16, 12), (16, 12)], ("x0", "x1"), [(16, 12)]),
    "sum": one_node_graph("aten.sum.dim_IntList", [(16, 12)], ("x0", (1,), False), [(16,)]),
    "softmax": one_node_graph("aten._softmax.default", [(16, 12)], ("x0", -1, False), [(16, 12)]),
    "layer_norm": one_node_graph(
        "aten.native_layer_norm.default", [(16, 12), (12,), (12,)], ("x0", (12,), "x1", "x2", 1e-5), [(16, 12), (16, 1), (16, 1)]
    ),
}

# Strategies both sides must list (DTensor's words; one mesh axis).
MUST_AGREE = {
    "mm": {"S(0), R -> S(0)", "R, S(1) -> S(1)", "S(1), S(0) -> P(sum)", "P(sum), R -> P(sum)", "R, P(sum) -> P(sum)"},
    "add": {"S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)"},
    "sum": {"S(0) -> S(0)", "S(1) -> P(sum)", "P(sum) -> P(sum)"},
    "softmax": {"S(0) -> S(0)"},
    "layer_norm": {"S(0), R, R -> S(0), S(0), S(0)"},
}


@pytest.fixture(scope="module")
def comparisons(oracle, executor):
    results = {}
    for name, graph in CASES.items():
        rules = graph_rules(graph, executor).rules
        assert "op" in rules, f"discovery found no rule for {name}"
        results[name] = compare_node(graph.nodes[0], graph, rules["op"], oracle, executor)
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_discovered_rules_agree_with_dtensor_and_pass_the_recheck(comparisons, name: str) -> None:
    comparison = comparisons[name]
    assert comparison.dtensor == "registered"
    agreed = {str(strategy) for strategy in comparison.agreements}
    assert MUST_AGREE[name] <= agreed, f"{name}: rule {comparison.rule_text}; agreed {sorted(agreed)}"
    assert not comparison.wrong, [f"{check.what}: {check.detail}" for check in comparison.wrong]
    assert all(check.ok for check in comparison.checks), comparison.checks  # every part of these rules is checkable
    for finding in comparison.only_dtensor:  # every DTensor-only strategy comes with a known reason
        assert finding.reason != "not discovered by ShardCombine", (name, str(finding.strategy))


def test_softmax_has_no_factor_along_its_dim_on_either_side(comparisons) -> None:
    comparison = comparisons["softmax"]
    strategies = {str(s) for s in comparison.agreements} | {str(f.strategy) for f in comparison.only_ours}
    assert "S(1) -> S(1)" not in strategies


def test_add_joint_partial_inputs_agree_or_are_explained(comparisons) -> None:
    """Both addends Partial(sum) is ShardCombine's joint pass (0+1:sum) too; Partial(avg) is not modelled."""
    assert "P(sum), P(sum) -> P(sum)" in {str(strategy) for strategy in comparisons["add"].agreements}
    reasons = {str(finding.strategy): finding.reason for finding in comparisons["add"].only_dtensor}
    assert "Partial(avg)" in reasons["P(avg), P(avg) -> P(avg)"]


def test_wrong_rules_are_caught_by_the_recheck(oracle, executor) -> None:
    softmax = CASES["softmax"]
    wrong = compare_node(softmax.nodes[0], softmax, parse_rule("ab->ab"), oracle, executor)  # splits the softmax dim
    assert [check.what for check in wrong.wrong] == ["S(1) -> S(1)"]
    assert any(f.reason.startswith("WRONG") for f in wrong.only_ours)
    add = CASES["add"]
    # P(sum) in one addend with the other replicated adds the other N times: not a pass-through
    checks = check_rule_by_execution(op_call(add, add.nodes[0]), parse_rule("ab,ab->ab | pass 0:sum"), executor)
    failing = {check.what: check for check in checks if check.ok is False}
    assert set(failing) == {"pass 0:sum"} and failing["pass 0:sum"].max_abs_error > 0.1


def test_recheck_catches_an_additive_constant_below_float32_resolution(executor) -> None:
    """``x + 1e-8`` is not linear in x; at magnitude 1 the constant hides under float32 rounding."""
    graph = one_node_graph("aten.add.Tensor", [(16,)], ("x0", 1e-8), [(16,)])
    checks = check_rule_by_execution(op_call(graph, graph.nodes[0]), parse_rule("a->a | pass 0:sum 0:max"), executor)
    by_label = {check.what: check for check in checks}
    assert by_label["S(0) -> S(0)"].ok and by_label["pass 0:max"].ok
    assert by_label["pass 0:sum"].ok is False and "scaled by 1e-06" in by_label["pass 0:sum"].detail


def test_rule_strategies_map_factors_and_passes() -> None:
    comparable, other = rule_strategies(parse_rule("ab,bc->ac | b:sum | pass 0:max"))
    assert {str(s) for s in comparable} == {"S(0), R -> S(0)", "S(1), S(0) -> P(sum)", "R, S(1) -> S(1)", "P(max), R -> P(max)"}
    assert not other
    comparable, other = rule_strategies(parse_rule("a->a | a:chunk=2"))
    assert not comparable and [str(s) for s in other] == ["S(0) -> S(0,chunk=2,halo=0)"]


def test_verify_graph_counts_and_merges(oracle, executor) -> None:
    reports = []
    for name in ("mm", "softmax"):
        graph = CASES[name]
        reports.append(verify_graph(graph, graph_rules(graph, executor).rules, oracle, executor, model=name))
    merged = merge_reports(reports + reports[:1])  # a signature seen twice counts once
    assert merged.models == ("mm", "softmax", "mm")
    assert merged.signatures == 2 and merged.dtensor_registered == 2
    assert merged.agreements == sum(op.agreements for op in merged.ops) >= 6
    assert merged.checks_failed == 0 and not merged.wrong_rules
    assert {op.op_target for op in merged.ops} == {"aten.mm.default", "aten._softmax.default"}


def test_ops_dtensor_does_not_register_are_reported() -> None:
    graph = one_node_graph("aten.bernoulli.p", [(8, 4)], ("x0", 0.5), [(8, 4)])
    with DTensorOracle() as started:  # nested: reuses the module's process group
        assert started.strategies(graph.nodes[0], graph) == "DTensor registers no sharding strategy for this op"


def test_oracle_used_outside_its_context_is_a_clear_error() -> None:
    graph = CASES["mm"]
    with pytest.raises(OracleError, match="outside 'with DTensorOracle"):
        DTensorOracle().strategies(graph.nodes[0], graph)
    with pytest.raises(OracleError, match="at least 2"):
        DTensorOracle(mesh_size=1)


def test_strategy_text() -> None:
    assert str(Strategy(("S(1)", "S(0)"), ("P(sum)", None))) == "S(1), S(0) -> P(sum), -"
    assert Strategy(("R", "R"), ("R",)).is_trivial and not Strategy(("P(sum)", "R"), ("P(sum)",)).is_trivial


def test_a_wrong_dtensor_strategy_is_caught_by_the_recheck(oracle, executor) -> None:
    """torch 2.13's DTensor lets cumsum along dim -1 keep Shard(-1 normalized): each shard restarts its sum."""
    graph = one_node_graph("aten.cumsum.default", [(16, 12)], ("x0", -1), [(16, 12)])
    rule = graph_rules(graph, executor).rules["op"]
    comparison = compare_node(graph.nodes[0], graph, rule, oracle, executor)
    assert "S(0) -> S(0)" in {str(s) for s in comparison.agreements} and not comparison.wrong
    by_strategy = {str(finding.strategy): finding.reason for finding in comparison.dtensor_wrong}
    if "S(1) -> S(1)" not in {str(finding.strategy) for finding in comparison.only_dtensor}:
        pytest.skip("this PyTorch's DTensor no longer lists S(1) -> S(1) for cumsum(dim=-1)")
    assert by_strategy["S(1) -> S(1)"].startswith("WRONG in DTensor: fails the execution re-check")
