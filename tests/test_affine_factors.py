"""Affine factors: a reducing factor whose unsplit inputs enter as ``Partial(sum)``.

``addmm(bias, x, w)`` split along ``k`` gives ``bias + x_k @ w_k`` per shard; with the bias
replicated the shards add it n times, with the bias ``Partial(sum)`` (its value on one shard,
zeros elsewhere, or any parts adding up to it) they add up to the whole. These tests cover the
rule's text and JSON forms, discovery (numpy ops without a framework, then ATen ops, with ops
where the trick is unsound), strategies and resharding, the oracle, and a Megatron row-parallel
``nn.Linear`` with bias trained on two gloo processes against one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from numpy_executor import NumpyExecutor

from metadist.frontends.torch.discovery import TorchExecutor
from metadist.ir import Factor, Mesh, MetaOp, Node, Partial, Reduce, Replicate, Rule, RuleError, Shard, TensorSpec, Value, ValueRef, parse_rule
from metadist.ir.plan import AxisChoice, strategy_from_choices
from metadist.shardcombine import OpCall, check_factor, discover
from metadist.shardcombine.discover import affine_parts

ADDMM_RULE = "a,bc,ca->ba | c:sum+0 | pass 0:max 0:min"


# ----------------------------------------------------------------- the rule's forms


def test_affine_factor_text_and_json_round_trip():
    rule = parse_rule(ADDMM_RULE)
    k = rule.factors[2]
    assert k == Factor((None, 1, 0), (Reduce("sum"),), (0,)) and k.partial_op == "sum"
    assert rule.to_text() == ADDMM_RULE and parse_rule(rule.to_text()) == rule
    assert Rule.from_dict(json.loads(json.dumps(rule.to_dict()))) == rule
    assert rule.to_dict()["factors"][2]["partial_inputs"] == [0]
    assert "partial_inputs" not in rule.to_dict()["factors"][0]  # plain factors keep their stored form
    two = parse_rule("ab,bc,_,ac->ac | b:sum+2+3")  # two partial inputs (one of them the same shape as the output)
    assert two.factors[1].partial_inputs == (2, 3) and parse_rule(two.to_text()) == two
    assert parse_rule("ab,bc->ac | b:sum") != parse_rule("ab,bc,_->ac | b:sum")  # sanity: arity is part of the rule


@pytest.mark.parametrize(
    "text",
    [
        "a,bc,ca->ba | c:sum+1",  # input 1 carries the factor: it cannot also be Partial
        "a,bc,ca->ba | c:sum+7",  # no input 7
        "ab->ab | a:id+0",  # only reducing factors have Partial inputs
        "a,bc,ca->ba | d:sum+0",  # no factor d
    ],
)
def test_malformed_affine_factors_are_rejected(text):
    with pytest.raises(RuleError):
        parse_rule(text)


def test_partial_inputs_need_reducing_outputs():
    from metadist.ir import Concat

    with pytest.raises(RuleError):
        Factor((None, 0), (Concat(0),), (0,))


def test_the_rule_database_stores_and_reads_an_affine_rule(tmp_path):
    from metadist.ir import RULE_FORMAT_VERSION
    from metadist.shardcombine.database import RuleDatabase

    assert RULE_FORMAT_VERSION >= 2  # rows of format 1 (no partial inputs) are never read as these
    with RuleDatabase(str(tmp_path / "rules.db")) as db:
        db.put("aten.addmm.default(T0, T1, T2) :: f32[a] f32[b,c] f32[c,a] -> f32/2", "torch", "v", parse_rule(ADDMM_RULE), "aten.addmm.default")
        got = db.get("aten.addmm.default(T0, T1, T2) :: f32[a] f32[b,c] f32[c,a] -> f32/2", "torch", "v")
    assert got == parse_rule(ADDMM_RULE)


# ----------------------------------------------------------------- discovery on numpy ops


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


_NUMPY_OPS = {
    "np.affine": lambda b, a, w: [b + a @ w],  # sound: bias Partial(sum)
    "np.affine_two": lambda b, c, a, w: [a @ w + b + c],  # sound: both b and c Partial(sum)
    "np.affine_square": lambda b, a, w: [b * b + a @ w],  # zero parts pass, random parts do not
    "np.affine_relu": lambda b, a, w: [_relu(b + a @ w)],  # nonlinear
    "np.affine_eps": lambda b, a, w: [b + a @ w + 1e-6],  # a constant is added once per shard
}


NUMPY = NumpyExecutor(_NUMPY_OPS)


def np_call(target: str, shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]) -> OpCall:
    refs = tuple(ValueRef(f"x{i}") for i in range(len(shapes)))
    node = Node("n", MetaOp(target), refs, (), (Value("y", TensorSpec(out_shape, "float64")),))
    return OpCall(node, tuple(TensorSpec(s, "float64") for s in shapes))


def _k_factor(rule: Rule, k_dims: tuple) -> Factor | None:
    """The factor of ``rule`` that splits the matmul's k (``k_dims``: dim per input, None elsewhere)."""
    return next((f for f in rule.factors if f.inputs == k_dims), None)


def test_discovery_finds_the_k_split_with_the_bias_partial():
    rule = discover(np_call("np.affine", [(4,), (6, 10), (10, 4)], (6, 4)), NUMPY)
    # and the joint passes: linear in (bias, x) and in (bias, w) at once, the third input replicated
    assert rule.to_text() == "a,bc,ca->ba | c:sum+0 | pass 0:max 0:min 0+1:sum 0+2:sum"


def test_discovery_takes_every_added_input_as_partial():
    rule = discover(np_call("np.affine_two", [(4,), (6, 4), (6, 10), (10, 4)], (6, 4)), NUMPY)
    assert _k_factor(rule, (None, None, 1, 0)) == Factor((None, None, 1, 0), (Reduce("sum"),), (0, 1))


@pytest.mark.parametrize("target", ["np.affine_square", "np.affine_relu", "np.affine_eps"])
def test_no_k_split_where_the_bias_is_not_affine(target):
    rule = discover(np_call(target, [(4,), (6, 10), (10, 4)], (6, 4)), NUMPY)
    assert _k_factor(rule, (None, 1, 0)) is None, rule
    assert [f.inputs for f in rule.factors] == [(0, None, 1), (None, 0, None)]  # n and m are still found


def test_the_checks_see_through_a_bias_that_only_zero_parts_fool():
    """``b*b + a@w`` recombines when the bias is cut as value-then-zeros, not when cut randomly."""
    call = np_call("np.affine_square", [(4,), (6, 10), (10, 4)], (6, 4))
    rng = np.random.default_rng(3)
    inputs = NUMPY.example_inputs(call, rng, call.input_shapes)
    factor = Factor((None, 1, 0), (Reduce("sum"),), (0,))
    whole = NUMPY.run(call, inputs)[0]
    b, a, w = inputs
    zero = affine_parts(b, 2, "zero", rng)
    assert np.allclose(sum(NUMPY.run(call, [zero[k], a[:, k * 5:(k + 1) * 5], w[k * 5:(k + 1) * 5]])[0] for k in range(2)), whole)
    assert check_factor(call, NUMPY, factor, inputs, 2) is not None  # the random and alternating cuts catch it
    for split in ("random", "alternating"):
        parts = affine_parts(b, 3, split, rng)
        assert np.allclose(sum(parts), b) and not any(np.allclose(part, 0) for part in parts)


# ----------------------------------------------------------------- discovery on ATen ops


TORCH = TorchExecutor()
X, Y, Z = ValueRef("x"), ValueRef("y"), ValueRef("z")
F32 = "float32"


def aten(target: str, args: tuple, inputs: list, output: tuple, kwargs: tuple = ()) -> OpCall:
    node = Node("n", MetaOp(f"aten.{target}"), args, kwargs, (Value("y0", TensorSpec(output, F32)),))
    return OpCall(node, tuple(TensorSpec(shape, F32) for shape in inputs))


def addmm(bias_shape=(4,), kwargs=()):
    return aten("addmm.default", (Z, X, Y), [bias_shape, (8, 16), (16, 4)], (8, 4), kwargs)


@pytest.mark.parametrize(
    "call,text",
    [
        (addmm(), "a,bc,ca->ba | c:sum+0 | pass 0:max 0:min 0+1:sum 0+2:sum"),
        (addmm((8, 4)), "ab,ac,cb->ab | c:sum+0 | pass 0:max 0:min 0+1:sum 0+2:sum"),
        (addmm(kwargs=(("beta", 0.5), ("alpha", 2.0))), "a,bc,ca->ba | c:sum+0 | pass 0:max 0:min 0+1:sum 0+2:sum"),
        (aten("baddbmm.default", (Z, X, Y), [(2, 8, 4), (2, 8, 16), (2, 16, 4)], (2, 8, 4)), "abc,abd,adc->abc | d:sum+0 | pass 0:max 0:min 0+1:sum 0+2:sum"),
        # biased convolutions: the input-channel split (dim 1 of input and weight) with the bias Partial(sum)
        (aten("convolution.default", (X, Y, Z, (1,), (0,), (1,), False, (0,), 1), [(2, 6, 10), (4, 6, 3), (4,)], (2, 4, 8)),
         "ab_,cb_,c->ac_ | b:sum+2 | pass 0+2:sum 1+2:sum 2:max 2:min"),
        (aten("convolution.default", (X, Y, Z, (1, 1), (1, 1), (1, 1), False, (0, 0), 1), [(2, 6, 5, 5), (4, 6, 3, 3), (4,)], (2, 4, 5, 5)),
         "abcd,eb__,e->aecd | b:sum+2 c:halo=1 d:halo=1 | pass 0+2:sum 1+2:sum 2:max 2:min"),  # padded: H and W split with a halo of 1
        # unchanged: no input lacks the factor (mm, bmm), or the conv has no bias
        (aten("mm.default", (X, Y), [(8, 16), (16, 4)], (8, 4)), "ab,bc->ac | b:sum | pass 0:sum 1:sum"),
        (aten("bmm.default", (X, Y), [(2, 8, 16), (2, 16, 4)], (2, 8, 4)), "abc,acd->abd | c:sum | pass 0:sum 1:sum"),
        (aten("convolution.default", (X, Y, None, (1,), (0,), (1,), False, (0,), 1), [(2, 6, 10), (4, 6, 3)], (2, 4, 8)),
         "ab_,cb_->ac_ | b:sum | pass 0:sum 1:sum"),
    ],
    ids=["addmm", "addmm-2d-bias", "addmm-beta-alpha", "baddbmm", "conv1d-bias", "conv2d-bias", "mm", "bmm", "conv1d-no-bias"],
)
def test_aten_rules_with_affine_factors(call, text):
    assert discover(call, TORCH).to_text() == text


@pytest.mark.parametrize("use_gelu", [False, True])
def test_fused_addmm_activation_gets_no_k_split(use_gelu):
    """``_addmm_activation`` is relu/gelu(bias + x @ w): no way to cut the bias makes the k split sound."""
    call = aten("_addmm_activation.default", (Z, X, Y), [(4,), (8, 16), (16, 4)], (8, 4), (("use_gelu", use_gelu),))
    rule = discover(call, TORCH)
    assert _k_factor(rule, (None, 1, 0)) is None and len(rule.factors) == 2, rule


def test_addmm_k_split_fails_with_the_bias_replicated_and_holds_with_it_partial():
    call = addmm()
    inputs = TORCH.example_inputs(call, np.random.default_rng(5), call.input_shapes)
    replicated = Factor((None, 1, 0), (Reduce("sum"),))
    partial = Factor((None, 1, 0), (Reduce("sum"),), (0,))
    for shards in (2, 4):
        assert check_factor(call, TORCH, replicated, inputs, shards) is not None
        assert check_factor(call, TORCH, partial, inputs, shards, seed=shards) is None


# ----------------------------------------------------------------- strategies, resharding, cost


def test_strategies_give_the_bias_partial_sum_and_resharding_it_is_free():
    from metadist.cost.cluster import resolve_cluster
    from metadist.cost.comm import reshard
    from metadist.lowering.reshard import plan_resharding
    from metadist.solver.strategies import node_strategies

    rule = parse_rule(ADDMM_RULE)
    mesh = Mesh((2, 2))
    found = node_strategies(rule, ((4,), (8, 16), (16, 4)), ((8, 4),), mesh).strategies
    row = strategy_from_choices(rule, (AxisChoice("factor", 1), AxisChoice("factor", 2)))  # m on axis 0, k on axis 1
    assert row in found
    assert row.inputs == ((Replicate(), Partial("sum")), (Shard(0), Shard(1)), (Replicate(), Shard(0)))
    assert row.outputs == ((Shard(0), Partial("sum")),)
    both = strategy_from_choices(rule, (AxisChoice("factor", 2),) * 2)  # k split over both axes
    assert both.inputs[0] == (Partial("sum"), Partial("sum")) and both.outputs == ((Partial("sum"), Partial("sum")),)
    spec = TensorSpec((4,), F32)
    assert reshard(spec, (Replicate(), Replicate()), (Replicate(), Partial("sum")), resolve_cluster("cpu-gloo", mesh)).comm_s == 0.0
    steps = plan_resharding((4,), 4, (Replicate(), Replicate()), (Replicate(), Partial("sum")), mesh, (0, 1))
    assert [(step.kind, step.comm_bytes) for step in steps] == [("zero_partial", 0)]


# ----------------------------------------------------------------- the oracle


def test_the_oracle_agrees_with_dtensor_on_the_addmm_k_split_and_rejects_a_wrong_one():
    from metadist.ir import Graph, GraphInput, Role
    from metadist.shardcombine.oracle import DTensorOracle, check_rule_by_execution, compare_node

    call = addmm()
    rule = discover(call, TORCH)
    inputs = tuple(GraphInput(Value(name, spec), Role.ACTIVATION) for name, spec in zip(("z", "x", "y"), call.input_specs))
    graph = Graph(inputs, (call.node,), (), name="addmm")
    with DTensorOracle(mesh_size=2) as oracle:
        comparison = compare_node(call.node, graph, rule, oracle, TORCH)
    assert "P(sum), S(1), S(0) -> P(sum)" in [str(strategy) for strategy in comparison.agreements]
    assert comparison.checks and all(check.ok for check in comparison.checks)
    # the same claim for relu(bias + x @ w) is shown wrong by the oracle's own re-execution
    fused = aten("_addmm_activation.default", (Z, X, Y), [(4,), (8, 16), (16, 4)], (8, 4))
    checks = check_rule_by_execution(fused, parse_rule("a,bc,ca->ba | c:sum+0"), TORCH)
    assert [check.ok for check in checks if check.what == "P(sum), S(1), S(0) -> P(sum)"] == [False]


# ----------------------------------------------------------------- Megatron row-parallel Linear with bias, end to end


def _megatron_mlp_plan():
    """The built-in mlp on a 1-D tp mesh of 2: fc1 column-parallel, fc2 row-parallel (weight split along k).

    The solver plans the step with the layer weights pinned; fc2's addmm then takes the row-parallel strategy its
    rule offers (bias Partial(sum), input S(1), weight S(0)), the lowering resharding around it as it needs. The
    solver itself need not pick it: on this small MLP gathering the weight can cost less.
    Returns the graph, the plan and the row-parallel addmm's name.
    """
    from dataclasses import replace

    import metadist
    from metadist.api import capture_and_discover
    from metadist.cost.cluster import resolve_cluster
    from metadist.solver import plan_graph
    from metadist.solver.problem import Restrictions
    from metadist.solver.strategies import node_strategies

    graph, graph_rules = capture_and_discover(metadist.builtin_workload("mlp", optimizer="adamw"))
    forced = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1), "fc2.bias": Replicate()}
    allowed = {}
    for graph_input in graph.inputs:
        param = graph_input.value.name.split(":")[0]
        placement = forced.get(param, Replicate()) if graph_input.value.spec.rank else Replicate()
        allowed[graph_input.value.name] = frozenset({(placement,)})
    mesh = Mesh((2,))
    plan = plan_graph(graph, graph_rules.rules, resolve_cluster("cpu-gloo", mesh), restrictions=Restrictions(input_shardings=allowed))
    fc2 = next(node for node in graph.nodes if node.op.target == "aten.addmm.default"
               and graph.producer(node.input_names[2]).input_names == ("fc2.weight",))
    def row_parallel(rule):
        shapes = tuple(graph.value(n).spec.shape for n in fc2.input_names), tuple(v.spec.shape for v in fc2.output_values)
        return [st for st in node_strategies(rule, *shapes, mesh).strategies if st.inputs == ((Partial("sum"),), (Shard(1),), (Shard(0),))]

    rule = graph_rules.rules[fc2.name]
    row = row_parallel(rule)
    assert row and row[0].outputs == ((Partial("sum"),),), "the addmm rule offers no row-parallel strategy with a Partial bias"
    stripped = Rule(rule.input_ranks, rule.output_ranks, tuple(f for f in rule.factors if not f.partial_inputs), rule.partial_passes)
    assert not row_parallel(stripped), "without the affine factor the bias could not be Partial"
    return graph, replace(plan, node_strategies={**plan.node_strategies, fc2.name: row[0]}), fc2.name


def _run_check(plan_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "metadist.cli.main", "run", "mlp", "--nproc", "2", "--mesh", "2", "--steps", "3",
               "--check", "--optimizer", "adamw", "--plan", str(plan_path), "--timeout-s", "120"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.distributed
def test_megatron_row_parallel_linear_splits_k_with_the_bias_partial_and_trains_correctly(tmp_path):
    graph, plan, row = _megatron_mlp_plan()
    good = tmp_path / "row_parallel.json"
    good.write_text(plan.to_json())
    result = _run_check(good)
    assert result.returncode == 0 and "check: PASS" in result.stdout, result.stdout[-2500:] + result.stderr[-2500:]

    # the same plan with the bias replicated instead of Partial(sum) adds it twice: the check must catch it
    document = json.loads(plan.to_json())
    document["node_strategies"][row]["inputs"][0] = "(R)"
    wrong = tmp_path / "bias_replicated.json"
    wrong.write_text(json.dumps(document))
    result = _run_check(wrong)
    assert result.returncode != 0 and "check: FAIL" in result.stdout, result.stdout[-2500:] + result.stderr[-2500:]
