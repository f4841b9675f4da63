"""Coalescing pass unit tests: buckets form, run before any member is read, respect the cap and the key.

Small hand-made graphs pin the rule down; the MLP's real programs under data parallel,
ZeRO-3 and 2-D plans check the invariants on whole training steps (every value defined
before it is read, the same bytes as without coalescing, fewer calls).
"""

from __future__ import annotations

import dataclasses

import pytest

from metadist.ir import Graph, GraphInput, GraphOutput, MetaOp, Mesh, Node, Role, TensorSpec, Value, ValueRef
from metadist.ir import parse_sharding as S
from metadist.ir.plan import AxisChoice, NodeStrategy, Plan, graph_fingerprint
from metadist.lowering import (
    CoalescedReshard, LocalOp, Reshard, Wait, coalesce, lower, plan_resharding, share_collectives, split_stages,
)


def _grads_graph(n: int = 3, dtypes=None, size: int = 8) -> Graph:
    """``n`` Partial gradients made one after another, then an update that reads each in turn."""
    dtypes = dtypes or ["float32"] * n
    inputs = [GraphInput(Value(f"p{i}", TensorSpec((size,), dtypes[i])), Role.PARAM) for i in range(n)]
    nodes = [Node(f"grad{i}", MetaOp("aten.mul.Tensor"), (ValueRef(f"p{i}"), 2.0), (), (Value(f"g{i}", TensorSpec((size,), dtypes[i])),))
             for i in range(n)]
    nodes += [Node(f"upd{i}", MetaOp("aten.sub.Tensor"), (ValueRef(f"p{i}"), ValueRef(f"g{i}")), (),
                   (Value(f"q{i}", TensorSpec((size,), dtypes[i])),)) for i in range(n)]
    outputs = [GraphOutput(f"q{i}", Role.PARAM, replaces=f"p{i}") for i in range(n)]
    return Graph(tuple(inputs), tuple(nodes), tuple(outputs), name="grads")


def _grads_plan(graph: Graph, mesh: Mesh, grad_placement: str = "(P(sum))", param_placement: str = "(R)") -> Plan:
    """Gradients come out ``grad_placement``; the updates need them in the parameters' placement."""
    factor = (AxisChoice("factor", 0),) * mesh.ndim
    strategies = {}
    for node in graph.nodes:
        if node.name.startswith("grad"):
            strategies[node.name] = NodeStrategy(factor, (S(param_placement),), (S(grad_placement),))
        else:
            strategies[node.name] = NodeStrategy(factor, (S(param_placement), S(param_placement)), (S(param_placement),))
    inputs = {i.value.name: S(param_placement) for i in graph.inputs}
    return Plan(graph.name, graph_fingerprint(graph), "test", mesh, strategies, inputs,
                tuple(S(param_placement) for _ in graph.outputs))


def assert_valid_order(program) -> None:
    """Every value read (op arguments, reshard sources, outputs) is defined earlier; each is defined once."""
    defined = {item.name for item in program.inputs}

    def define(name):
        assert name not in defined, f"%{name} defined twice"
        defined.add(name)

    def refs(arg):
        if isinstance(arg, ValueRef):
            yield arg.name
        elif isinstance(arg, (tuple, list)):
            for item in arg:
                yield from refs(item)

    awaited = {target for item in program.instructions if isinstance(item, Wait) for target in item.targets}
    for item in program.instructions:
        if isinstance(item, LocalOp):
            for name in refs((item.args, tuple(value for _, value in item.kwargs))):
                assert name in defined, f"{item.node} reads %{name} before it is defined"
            for name in item.outputs:
                if name is not None:
                    define(name)
        elif isinstance(item, Wait):
            for name in item.targets:
                define(name)  # an issued collective's results are defined where it is waited for
        elif isinstance(item, Reshard):
            assert item.source in defined, f"reshard reads %{item.source} before it is defined"
            if item.target not in awaited:
                define(item.target)
        else:
            for member in item.members:
                assert member.source in defined, f"bucket reads %{member.source} before it is defined"
            for member in item.members:
                if member.target not in awaited:
                    define(member.target)
    for output in program.outputs:
        assert output.value in defined


def _buckets(program) -> list[CoalescedReshard]:
    return [item for item in program.instructions if isinstance(item, CoalescedReshard)]


def test_gradients_share_one_all_reduce_that_runs_before_the_first_update():
    graph = _grads_graph(3)
    program = lower(graph, _grads_plan(graph, Mesh((2,))), (0,))
    (bucket,) = _buckets(program)
    assert (bucket.kind, bucket.axis, bucket.op, bucket.dtype) == ("all_reduce", 0, "sum", "float32")
    assert [member.source for member in bucket.members] == ["g0", "g1", "g2"]
    position = program.instructions.index(bucket)
    first_update = next(i for i, item in enumerate(program.instructions) if isinstance(item, LocalOp) and item.node == "upd0")
    assert position < first_update, "the bucket runs before the first instruction that reads a member"
    assert all(isinstance(item, LocalOp) and item.node.startswith("grad") for item in program.instructions[:position])
    assert_valid_order(program)
    uncoalesced = lower(graph, _grads_plan(graph, Mesh((2,))), (0,), bucket_cap_bytes=0)
    assert _buckets(uncoalesced) == [] and len(uncoalesced.reshards()) == 3
    assert program.predicted_comm() == {("all_reduce", 0): (1, 3 * 32)}
    assert uncoalesced.predicted_comm() == {("all_reduce", 0): (3, 3 * 32)}


def test_a_member_whose_source_is_not_yet_defined_waits_for_a_later_bucket():
    """upd1 reads g0 again after g1 is made: g1 cannot join a bucket that opens before it exists."""
    f32 = TensorSpec((8,), "float32")
    inputs = (GraphInput(Value("p", f32), Role.PARAM),)
    nodes = (
        Node("a", MetaOp("aten.mul.Tensor"), (ValueRef("p"), 2.0), (), (Value("g0", f32),)),
        Node("u0", MetaOp("aten.neg.default"), (ValueRef("g0"),), (), (Value("h0", f32),)),
        Node("b", MetaOp("aten.mul.Tensor"), (ValueRef("h0"), 3.0), (), (Value("g1", f32),)),
        Node("c", MetaOp("aten.mul.Tensor"), (ValueRef("p"), 4.0), (), (Value("g2", f32),)),
        Node("u1", MetaOp("aten.add.Tensor"), (ValueRef("g1"), ValueRef("g2")), (), (Value("h1", f32),)),
    )
    graph = Graph(inputs, nodes, (GraphOutput("h1", Role.ACTIVATION),), name="chain")
    factor = (AxisChoice("factor", 0),)
    partial, replicated = S("(P(sum))"), S("(R)")
    strategies = {"a": NodeStrategy(factor, (replicated,), (partial,)), "u0": NodeStrategy(factor, (replicated,), (replicated,)),
                  "b": NodeStrategy(factor, (replicated,), (partial,)), "c": NodeStrategy(factor, (replicated,), (partial,)),
                  "u1": NodeStrategy(factor, (replicated, replicated), (replicated,))}
    plan = Plan(graph.name, graph_fingerprint(graph), "test", Mesh((2,)), strategies, {"p": replicated}, (replicated,))
    program = lower(graph, plan, (0,))
    assert_valid_order(program)
    kinds = [type(item).__name__ for item in program.instructions]
    assert kinds == ["LocalOp", "Reshard", "LocalOp", "LocalOp", "LocalOp", "CoalescedReshard", "LocalOp"]
    (bucket,) = _buckets(program)
    assert [member.source for member in bucket.members] == ["g1", "g2"]


def test_the_byte_cap_bounds_every_bucket():
    graph = _grads_graph(7, size=16)  # 64 bytes per gradient
    plan = _grads_plan(graph, Mesh((2,)))
    program = lower(graph, plan, (0,), bucket_cap_bytes=3 * 64)
    buckets = _buckets(program)
    assert [len(bucket.members) for bucket in buckets] == [3, 3]
    assert all(bucket.buffer_bytes <= 3 * 64 for bucket in buckets)
    assert len([item for item in program.instructions if isinstance(item, Reshard)]) == 1, "the seventh runs alone"
    assert program.predicted_comm()[("all_reduce", 0)] == (3, 7 * 64)  # 2 (k-1)/k of 64 bytes each
    assert_valid_order(program)
    # a cap below one member's buffer: nothing coalesces
    assert _buckets(lower(graph, plan, (0,), bucket_cap_bytes=63)) == []


def test_buckets_never_mix_dtypes_or_collective_kinds():
    graph = _grads_graph(4, dtypes=["float32", "float64", "float32", "float64"])
    program = lower(graph, _grads_plan(graph, Mesh((2,))), (0,))
    assert sorted((bucket.dtype, len(bucket.members)) for bucket in _buckets(program)) == [("float32", 2), ("float64", 2)]
    assert_valid_order(program)
    # reduce-scatters (to a sharded update) and all-reduces do not share a bucket
    graph = _grads_graph(2)
    plan = _grads_plan(graph, Mesh((2,)), param_placement="(S(0))")
    program = lower(graph, plan, (0,))
    (bucket,) = _buckets(program)
    assert bucket.kind == "reduce_scatter" and [m.collective.dim for m in bucket.members] == [0, 0]


def test_multi_collective_reshards_split_into_stages_that_coalesce_per_axis():
    mesh = Mesh((2, 2))
    graph = _grads_graph(3)
    program = lower(graph, _grads_plan(graph, mesh, grad_placement="(P(sum), P(sum))", param_placement="(R, R)"), (1, 0))
    buckets = _buckets(program)
    assert [(bucket.kind, bucket.axis, len(bucket.members)) for bucket in buckets] == [("all_reduce", 0, 3), ("all_reduce", 1, 3)]
    first, second = buckets
    assert [m.target for m in first.members] == [m.source for m in second.members]
    assert [m.target_sharding for m in first.members] == [S("(R, P(sum))")] * 3
    assert_valid_order(program)
    assert program.predicted_comm() == {("all_reduce", 0): (1, 96), ("all_reduce", 1): (1, 96)}


def test_split_stages_keeps_the_steps_and_tracks_the_sharding():
    mesh = Mesh((2, 2))
    spec = TensorSpec((8, 4), "float32")
    steps = plan_resharding(spec.shape, 4, S("(S(0), S(0))"), S("(S(1), R)"), mesh, (1, 1))
    reshard = Reshard("x", "x~0", spec, S("(S(0), S(0))"), S("(S(1), R)"), steps)
    stages = split_stages(reshard)
    assert [step for stage in stages for step in stage.steps] == list(steps)
    assert [[s.kind for s in stage.steps] for stage in stages] == [["all_gather"], ["all_gather", "local_slice"]]
    assert [(stage.source, stage.target) for stage in stages] == [("x", "x~0.0"), ("x~0.0", "x~0")]
    assert stages[0].target_sharding == S("(S(0), R)") and stages[1].source_sharding == S("(S(0), R)")
    assert split_stages(Reshard("y", "y~1", spec, S("(P(sum), R)"), S("(R, R)"), steps[:1])) != ()


def test_cap_zero_leaves_the_program_as_lowered():
    graph = _grads_graph(3)
    plan = _grads_plan(graph, Mesh((2,)))
    plain = lower(graph, plan, (0,), bucket_cap_bytes=0)
    assert coalesce(plain, 0) is plain
    assert coalesce(plain).instructions == lower(graph, plan, (0,)).instructions


# ---------------------------------------------------------------- whole training steps

WEIGHTS = ("fc1.weight", "fc2.weight", "fc3.weight")
DP = {"batch.inputs": "(S(0))", "batch.targets": "(S(0))"}
#: ZeRO-3 on the weights (see :func:`zero3_plan`); biases replicated (their gradients all-reduced)
ZERO3 = {**DP, **{name: "(S(0))" for name in WEIGHTS}, **{f"{name}:momentum_buffer": "(S(0))" for name in WEIGHTS}}
MLP_PLANS = {
    "dp": ((2,), DP),
    "zero3": ((2,), ZERO3),
    "dp2d_zero3": ((2, 2), {"batch.inputs": "(S(0), S(0))", "batch.targets": "(S(0), S(0))",
                            "fc1.weight": "(S(0), S(0))", "fc2.weight": "(S(0), S(0))", "fc3.weight": "(S(1), S(1))"}),
}


def zero3_plan(graph: Graph, mesh: Mesh, inputs: dict) -> Plan:
    """The greedy plan, with every node that reads a weight replicated: weights are all-gathered
    where they are read (FSDP-style), their gradients reduce-scattered into the sharded update."""
    import dataclasses

    from test_runtime_support import greedy_plan

    from metadist.ir import Replicate
    from metadist.ir.plan import REPLICATE

    plan = greedy_plan(graph, mesh, inputs)
    replicated = tuple(Replicate() for _ in mesh.shape)
    strategies = dict(plan.node_strategies)
    for node in graph.nodes:
        if set(node.input_names) & set(WEIGHTS) and node.op.target == "aten.t.default":
            strategies[node.name] = NodeStrategy(tuple(REPLICATE for _ in mesh.shape), (replicated,), (replicated,))
    return dataclasses.replace(plan, node_strategies=strategies)


@pytest.fixture(scope="module")
def mlp_graph():
    from metadist.frontends.torch import capture_step
    from metadist.workloads import builtin_workload

    workload = builtin_workload("mlp", optimizer="sgd")
    optimizer = workload.optimizer(workload.model.parameters())
    return capture_step(workload.train_step(), workload.model, optimizer, workload.batch).graph


@pytest.mark.parametrize("name", list(MLP_PLANS))
def test_whole_step_programs_stay_valid_with_the_same_bytes_and_fewer_calls(mlp_graph, name):
    mesh_shape, inputs = MLP_PLANS[name]
    plan = zero3_plan(mlp_graph, Mesh(mesh_shape), inputs)
    for coords in [(0,) * len(mesh_shape), (1,) * len(mesh_shape)]:
        plain = lower(mlp_graph, plan, coords, bucket_cap_bytes=0)
        program = lower(mlp_graph, plan, coords)
        assert_valid_order(program)
        before, after = plain.predicted_comm(), program.predicted_comm()
        # the same bytes as the plain program with its identical collectives shared (fewer where any are)
        stages = [stage for item in plain.instructions for stage in (split_stages(item) if isinstance(item, Reshard) else (item,))]
        shared = dataclasses.replace(plain, instructions=tuple(share_collectives(stages))).predicted_comm()
        assert {key: nbytes for key, (_, nbytes) in shared.items()} == {key: nbytes for key, (_, nbytes) in after.items()}
        assert sum(nbytes for _, nbytes in shared.values()) <= sum(nbytes for _, nbytes in before.values())
        calls_before, calls_after = sum(c for c, _ in before.values()), sum(c for c, _ in after.values())
        assert calls_after < calls_before, (name, before, after)
        assert {bucket.kind for bucket in _buckets(program)} >= BUCKET_KINDS[name]


BUCKET_KINDS = {"dp": {"all_reduce"}, "zero3": {"all_gather", "reduce_scatter", "all_reduce"},
                "dp2d_zero3": {"all_gather", "all_reduce"}}


def test_the_cost_model_prices_the_runtimes_bucket():
    from metadist.cost import DEFAULT_BUCKET_CAP_BYTES as priced
    from metadist.lowering import DEFAULT_BUCKET_CAP_BYTES as run

    assert priced == run


def test_a_lowered_program_is_priced_one_call_per_bucket():
    """``program_comm`` prices what the program runs: the three gradients' bucket is one all-reduce paying one fixed
    cost and the three gradients' bytes; lowered without coalescing, three calls. Bytes and calls equal the
    program's own count (``predicted_comm``), which the runs measure."""
    from metadist.cost import cluster_for
    from metadist.cost.comm import priced_collective, program_comm
    from metadist.cost.compute import copy_seconds

    graph = _grads_graph(3, size=1024)
    mesh = Mesh((2,))
    cluster = cluster_for("cpu-gloo", mesh)
    link = cluster.link(0)
    coalesced = lower(graph, _grads_plan(graph, mesh), (0,))
    separate = lower(graph, _grads_plan(graph, mesh), (0,), bucket_cap_bytes=0)
    priced = {name: program_comm(program, cluster) for name, program in (("coalesced", coalesced), ("separate", separate))}
    one, sent = priced_collective("all_reduce", 3 * 4096, 2, link)
    alone = priced_collective("all_reduce", 4096, 2, link)[0]
    assert priced["coalesced"] == {"comm_s_by_axis": {"axis0": pytest.approx(one)}, "comm_bytes_by_axis": {"axis0": sent},
                                   "collectives_by_kind": {"all_reduce": 1}, "copy_s": pytest.approx(
                                       2 * copy_seconds(cluster.device, "float32", 3 * 1024))}  # packed, then cloned
    assert priced["separate"]["copy_s"] == pytest.approx(3 * copy_seconds(cluster.device, "float32", 1024))
    assert priced["separate"]["comm_s_by_axis"]["axis0"] == pytest.approx(3 * alone)
    assert priced["separate"]["collectives_by_kind"] == {"all_reduce": 3}
    assert 3 * alone - one == pytest.approx(2 * (alone - priced_collective("all_reduce", 4096, 2, link, fixed_share=0.0)[0]))
    for name, program in (("coalesced", coalesced), ("separate", separate)):
        (calls, ring_bytes), = program.predicted_comm().values()
        assert priced[name]["collectives_by_kind"]["all_reduce"] == calls
        assert priced[name]["comm_bytes_by_axis"]["axis0"] == priced_collective("all_reduce", ring_bytes, 2, link)[1]
