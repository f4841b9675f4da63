"""Lowering unit tests: local shapes, resharding lists (1-D and 2-D meshes), argument rewriting.

The resharding tests simulate every rank with numpy: each rank's local piece
is built from a global tensor under the source sharding, the planned steps
run as collectives over the simulated ranks, and the result must be exactly
the target sharding's pieces. No torch needed.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from metadist.ir import (
    Graph, GraphInput, GraphOutput, MetaOp, Mesh, Node, Partial, Role, Shard, TensorSpec, Value, ValueRef,
    parse_rule, parse_sharding,
)
from metadist.ir.plan import REPLICATE, AxisChoice, NodeStrategy, Plan, graph_fingerprint, strategy_from_choices
from metadist.lowering import (
    LocalOp, LoweringError, Reshard, local_shape, lower, mesh_coordinates, plan_resharding, replicate_plan, shard_offset,
)

S = parse_sharding

# ---------------------------------------------------------------- local shapes


def test_local_shape_nests_axes_in_order():
    mesh = Mesh((2, 4))
    assert local_shape((8, 12), S("(S(0), S(1))"), mesh) == (4, 3)
    assert local_shape((16, 12), S("(S(0), S(0))"), mesh) == (2, 12)
    assert local_shape((8, 12), S("(P(sum), R)"), mesh) == (8, 12)
    # axis 0 splits dim 0 first, axis 1 splits axis 0's piece
    assert [shard_offset((16, 12), S("(S(0), S(0))"), mesh, coords, 0) for coords in [(0, 0), (0, 3), (1, 0), (1, 2)]] == [0, 6, 8, 12]


def test_uneven_split_names_value_dim_and_axis():
    mesh = Mesh((2, 3), ("dp", "tp"))
    with pytest.raises(LoweringError, match=r"batch input %x.*dim 1.*mesh axis 'tp' of size 3"):
        local_shape((4, 10), S("(S(0), S(1))"), mesh, what="batch input %x")


def test_mesh_coordinates_are_row_major():
    mesh = Mesh((2, 3))
    assert [mesh_coordinates(mesh, rank) for rank in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    with pytest.raises(LoweringError):
        mesh_coordinates(mesh, 6)


# ---------------------------------------------------------------- resharding lists


def kinds(steps):
    return [(step.kind, step.axis) for step in steps]


def test_resharding_on_a_1d_mesh():
    mesh, shape, itemsize = Mesh((4,)), (8, 16), 4  # 512 bytes whole
    plan = lambda src, dst: plan_resharding(shape, itemsize, S(src), S(dst), mesh, (1,))
    assert plan("(S(0))", "(S(0))") == ()
    assert plan("(P(sum))", "(P(sum))") == ()
    (gather,) = plan("(S(0))", "(R)")
    assert (gather.kind, gather.dim, gather.local_shape_out, gather.comm_bytes) == ("all_gather", 0, (8, 16), 384)
    (reduce,) = plan("(P(sum))", "(R)")
    assert (reduce.kind, reduce.op, reduce.comm_bytes) == ("all_reduce", "sum", 768)
    (scatter,) = plan("(P(max))", "(S(1))")
    assert (scatter.kind, scatter.op, scatter.dim, scatter.comm_bytes) == ("reduce_scatter", "max", 1, 384)
    (swap,) = plan("(S(0))", "(S(1))")
    assert (swap.kind, swap.dim, swap.split_dim, swap.local_shape_out, swap.comm_bytes) == ("all_to_all", 0, 1, (8, 4), 96)
    (piece,) = plan("(R)", "(S(1))")
    assert (piece.kind, piece.coordinate, piece.comm_bytes) == ("local_slice", 1, 0)
    (zero,) = plan("(R)", "(P(sum))")
    assert zero.kind == "zero_partial"
    assert plan("(R)", "(P(max))") == ()


def test_resharding_order_on_a_2d_mesh():
    mesh = Mesh((2, 2))
    plan = lambda src, dst: kinds(plan_resharding((8, 8), 4, S(src), S(dst), mesh, (0, 1)))
    # only the inner split goes; the outer one stays
    assert plan("(S(0), S(0))", "(S(0), R)") == [("all_gather", 1)]
    # the outer split goes: the inner one must be gathered first and re-sliced after
    assert plan("(S(0), S(0))", "(R, S(0))") == [("all_gather", 1), ("all_gather", 0), ("local_slice", 1)]
    # partial sums reduce-scatter straight into a nested split
    assert plan("(P(sum), P(sum))", "(S(0), S(0))") == [("reduce_scatter", 0), ("reduce_scatter", 1)]
    # slicing first makes the reduction smaller
    assert plan("(R, P(sum))", "(S(0), S(0))") == [("local_slice", 0), ("reduce_scatter", 1)]
    assert plan("(S(1), P(sum))", "(R, R)") == [("all_gather", 0), ("all_reduce", 1)]


PLACEMENTS_2D = ["R", "S(0)", "S(1)", "P(sum)"]
SHARDINGS_2D = [S(f"({a}, {b})") for a, b in itertools.product(PLACEMENTS_2D, repeat=2)]


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_every_resharding_moves_exactly_the_right_values(mesh_shape):
    """Simulate all ranks: every (source, target) pair of shardings ends in the target's pieces."""
    mesh = Mesh(mesh_shape)
    placements = ["R", "S(0)", "S(1)", "P(sum)", "P(max)"] if len(mesh_shape) == 1 else PLACEMENTS_2D
    shardings = [S("(" + ", ".join(combo) + ")") for combo in itertools.product(placements, repeat=mesh.ndim)]
    whole = np.arange(8 * 8, dtype=np.float64).reshape(8, 8) - 20.0
    for source, target in itertools.product(shardings, repeat=2):
        pieces = {coords: _piece(whole, source, mesh, coords) for coords in _all_coords(mesh)}
        steps_by_rank = {c: plan_resharding(whole.shape, 8, source, target, mesh, c) for c in pieces}
        pieces = _simulate(pieces, steps_by_rank, mesh)
        assert np.array_equal(_reassemble(pieces, target, mesh), whole), (source, target)


def _all_coords(mesh):
    return list(itertools.product(*(range(size) for size in mesh.shape)))


def _piece(whole, sharding, mesh, coords):
    """Rank ``coords``'s piece: nested slices, and partial shares (sum: 1/4 vs 3/4; max: others lower)."""
    piece = whole
    for axis, placement in enumerate(sharding):
        c, k = coords[axis], mesh.shape[axis]
        if isinstance(placement, Shard):
            piece = np.split(piece, k, axis=placement.dim)[c]
        elif isinstance(placement, Partial) and placement.op == "sum":
            weights = [0.25] * (k - 1) + [1 - 0.25 * (k - 1)]
            piece = piece * weights[c]
        elif isinstance(placement, Partial):
            piece = piece if c == 0 else piece - 7.0
    return piece


def _groups(mesh, axis):
    """Rank lists along ``axis`` (coordinate order), one per position on the other axes."""
    others = [range(size) if a != axis else [None] for a, size in enumerate(mesh.shape)]
    for fixed in itertools.product(*others):
        yield [tuple(c if a == axis else fixed[a] for a in range(mesh.ndim)) for c in range(mesh.shape[axis])]


def _simulate(pieces, steps_by_rank, mesh):
    count = len(next(iter(steps_by_rank.values())))
    for index in range(count):
        step = next(iter(steps_by_rank.values()))[index]
        new = {}
        for group in _groups(mesh, step.axis):
            inputs = [pieces[c] for c in group]
            for position, coords in enumerate(group):
                new[coords] = _run(step.kind, step, inputs, position, steps_by_rank[coords][index])
        pieces = new
    return pieces


def _run(kind, step, inputs, position, own_step):
    k = len(inputs)
    reduce = {"sum": np.add.reduce, "max": np.maximum.reduce}.get(step.op or "")
    if kind == "all_gather":
        return np.concatenate(inputs, axis=step.dim)
    if kind == "all_reduce":
        return reduce(np.stack(inputs))
    if kind == "reduce_scatter":
        return np.split(reduce(np.stack(inputs)), k, axis=step.dim)[position]
    if kind == "all_to_all":
        return np.concatenate([np.split(x, k, axis=step.split_dim)[position] for x in inputs], axis=step.dim)
    if kind == "local_slice":
        assert own_step.coordinate == position
        return np.split(inputs[position], k, axis=step.dim)[position]
    if kind == "zero_partial":
        return inputs[position] if position == 0 else np.zeros_like(inputs[position])
    raise AssertionError(kind)


def _reassemble(pieces, sharding, mesh):
    """Undo a sharding: reduce partial axes, check replicated axes agree, concatenate shards (inner axes first)."""
    for axis in reversed(range(mesh.ndim)):
        placement, merged = sharding[axis], {}
        for group in _groups(mesh, axis):
            values = [pieces[c] for c in group]
            if isinstance(placement, Shard):
                value = np.concatenate(values, axis=placement.dim)
            elif isinstance(placement, Partial):
                value = (np.add if placement.op == "sum" else np.maximum).reduce(np.stack(values))
            else:
                assert all(np.array_equal(v, values[0]) for v in values)
                value = values[0]
            for coords in group:
                merged[coords] = value
        pieces = merged
    return next(iter(pieces.values()))


# ---------------------------------------------------------------- lowering a graph


def _small_graph() -> Graph:
    f32 = lambda *shape: TensorSpec(tuple(shape), "float32")
    x, w = Value("x", f32(8, 4)), Value("w", f32(4, 6))
    nodes = (
        Node("mm", MetaOp("aten.mm.default"), (ValueRef("x"), ValueRef("w")), (), (Value("y", f32(8, 6)),)),
        Node("view", MetaOp("aten.view.default", {"view"}), (ValueRef("y"), (2, 4, 6)), (), (Value("v", f32(2, 4, 6)),)),
        Node("arange", MetaOp("aten.arange.default"), (8,), (), (Value("r", TensorSpec((8,), "int64")),)),
        Node("sum", MetaOp("aten.sum.default"), (ValueRef("v"),), (), (Value("loss", f32()),)),
    )
    inputs = (GraphInput(x, Role.BATCH), GraphInput(w, Role.PARAM))
    outputs = (GraphOutput("loss", Role.LOSS), GraphOutput("r", Role.ACTIVATION))
    return Graph(inputs, nodes, outputs, name="small")


def _data_parallel_plan(graph: Graph, mesh: Mesh) -> Plan:
    rules = {"mm": parse_rule("ab,bc->ac | b:sum"), "view": parse_rule("a_->a__"), "sum": parse_rule("abc-> | a:sum b:sum c:sum")}
    choice = AxisChoice("factor", 0)
    strategies = {name: strategy_from_choices(rule, (choice,)) for name, rule in rules.items()}
    strategies["arange"] = NodeStrategy((REPLICATE,), (), (S("(S(0))"),))
    return Plan(graph.name, graph_fingerprint(graph), "test", mesh, strategies,
                {"x": S("(S(0))"), "w": S("(R)")}, (S("(R)"), S("(R)")))


def test_lowering_rewrites_shapes_and_inserts_reshards():
    graph, mesh = _small_graph(), Mesh((2,))
    program = lower(graph, _data_parallel_plan(graph, mesh), (1,))
    ops = {item.node: item for item in program.instructions if isinstance(item, LocalOp)}
    assert ops["mm"].output_local_shapes == ((4, 6),)
    assert ops["view"].args[1] == (1, 4, 6)  # the view's size is the local shape
    assert (ops["arange"].target, ops["arange"].args) == ("aten.arange.start_step", (4, 8, 1))  # rank 1's rows
    reshards = [item for item in program.instructions if isinstance(item, Reshard)]
    assert [(r.source, [s.kind for s in r.steps]) for r in reshards] == [("loss", ["all_reduce"]), ("r", ["all_gather"])]
    assert program.predicted_comm() == {("all_reduce", 0): (1, 4), ("all_gather", 0): (1, 32)}


def test_replicate_plan_lowers_without_communication():
    graph = _small_graph()
    program = lower(graph, replicate_plan(graph, Mesh((2, 2)), "test"), (0, 1))
    assert program.reshards() == ()
    assert [item.args for item in program.instructions if isinstance(item, LocalOp) and item.node == "view"] == [(ValueRef("y"), (2, 4, 6))]


def test_lowering_rejects_an_uneven_split_that_a_reshape_merges():
    graph = _small_graph()
    plan = _data_parallel_plan(graph, Mesh((3,), ("dp",)))  # 8 rows in pieces of 3, 3, 2; the view makes them 2 x 4
    with pytest.raises(LoweringError, match=r"node 'view'.*different numbers of elements"):
        lower(graph, plan, (0,))


def test_lowering_rejects_state_that_ends_elsewhere():
    f32 = TensorSpec((4,), "float32")
    graph = Graph(
        (GraphInput(Value("p", f32), Role.PARAM),),
        (Node("neg", MetaOp("aten.neg.default"), (ValueRef("p"),), (), (Value("q", f32),)),),
        (GraphOutput("q", Role.PARAM, replaces="p"),),
    )
    mesh = Mesh((2,))
    plan = replicate_plan(graph, mesh, "test")
    plan = Plan(plan.graph_name, plan.graph_fingerprint, "test", mesh, plan.node_strategies, plan.input_shardings, (S("(S(0))"),))
    with pytest.raises(LoweringError, match="updated state must end where it starts"):
        lower(graph, plan, (0,))


def test_slice_of_a_sharded_dim_is_rejected():
    f32 = lambda *shape: TensorSpec(tuple(shape), "float32")
    graph = Graph(
        (GraphInput(Value("x", f32(8, 4)), Role.BATCH),),
        (Node("slice", MetaOp("aten.slice.Tensor", {"view"}), (ValueRef("x"), 0, 0, 3), (), (Value("y", f32(3, 4)),)),),
        (GraphOutput("y", Role.ACTIVATION),),
    )
    mesh = Mesh((2,))
    strategy = NodeStrategy((AxisChoice("factor", 0),), (S("(S(0))"),), (S("(R)"),))
    plan = Plan("step", graph_fingerprint(graph), "test", mesh, {"slice": strategy}, {"x": S("(S(0))")}, (S("(R)"),))
    with pytest.raises(LoweringError, match=r"indexes into dim 0 .* mesh axis 'axis0'"):
        lower(graph, plan, (0,))


def test_a_plan_that_computes_a_whole_output_from_an_empty_piece_is_refused():
    """A plan file made before the solver excluded such splits: convolution_backward split along 3 input channels over
    2x2 (2 / 1, 1 / 0) with its bias gradient replicated (every piece computes it whole), or a max reduction of an
    empty piece, is refused on every rank; a sum of an empty piece (zeros) and a split with no empty piece are not."""
    f32 = lambda *shape: TensorSpec(tuple(shape), "float32")
    graph = Graph(
        (GraphInput(Value("g", f32(4, 16)), Role.ACTIVATION), GraphInput(Value("x", f32(4, 3)), Role.BATCH)),
        (Node("cb", MetaOp("test.weight_and_bias_grads"), (ValueRef("g"), ValueRef("x")), (),  # as convolution_backward
              (Value("gw", f32(16, 3)), Value("gb", f32(16)))),),
        (GraphOutput("gw", Role.ACTIVATION), GraphOutput("gb", Role.ACTIVATION)),
    )

    def plan(mesh, x, outputs):
        choices = tuple(AxisChoice("factor", 0) for _ in mesh.shape)
        replicated = tuple(S("(R)")[0] for _ in mesh.shape)
        strategy = NodeStrategy(choices, (replicated, S(x)), tuple(S(text) for text in outputs))
        return Plan("step", graph_fingerprint(graph), "test", mesh, {"cb": strategy}, {"g": replicated, "x": S(x)},
                    tuple(S(text) for text in outputs))

    square = Mesh((2, 2))
    for coords in ((0, 0), (1, 1)):
        with pytest.raises(LoweringError, match=r"node 'cb'.*dim 1 of size 3 over mesh axes of sizes \[2, 2\].*output\(s\) \[1\]"):
            lower(graph, plan(square, "(S(1), S(1))", ("(S(1), S(1))", "(R, R)")), coords)
    with pytest.raises(LoweringError, match="leaves a piece empty"):
        lower(graph, plan(square, "(S(1), S(1))", ("(S(1), S(1))", "(P(max), P(max))")), (0, 0))
    for ok in (plan(square, "(S(1), S(1))", ("(S(1), S(1))", "(P(sum), P(sum))")),  # an empty piece sums to zeros
               plan(Mesh((2,)), "(S(1))", ("(S(1))", "(R)"))):  # 2, 1: no empty piece
        for coords in itertools.product(*(range(size) for size in ok.mesh.shape)):
            assert [item.node for item in lower(graph, ok, coords).instructions if isinstance(item, LocalOp)] == ["cb"]


def test_lowering_imports_no_framework():
    code = "import sys; sys.modules['torch'] = None; sys.modules['jax'] = None; import metadist.lowering"
    subprocess.run([sys.executable, "-c", code], check=True)


def _one_node_program(target, args, in_shapes, out_shapes, in_shardings, out_shardings, mesh=Mesh((2,))):
    f32 = lambda shape: TensorSpec(tuple(shape), "float32")
    inputs = tuple(GraphInput(Value(f"x{i}", f32(shape)), Role.ACTIVATION) for i, shape in enumerate(in_shapes))
    outputs = tuple(Value(f"y{i}", f32(shape)) for i, shape in enumerate(out_shapes))
    node = Node("n", MetaOp(target), args, (), outputs)
    graph = Graph(inputs, (node,), tuple(GraphOutput(v.name, Role.ACTIVATION) for v in outputs))
    strategy = NodeStrategy((AxisChoice("factor", 0),), tuple(map(S, in_shardings)), tuple(map(S, out_shardings)))
    plan = Plan("step", graph_fingerprint(graph), "test", mesh, {"n": strategy},
                {f"x{i}": S(text) for i, text in enumerate(in_shardings)}, tuple(map(S, out_shardings)))
    (op,) = [item for item in lower(graph, plan, (1,)).instructions if isinstance(item, LocalOp)]
    return op


def test_shape_arguments_follow_the_rules_executor_rewrites():
    # slice_backward: input_sizes is the local output shape
    op = _one_node_program("aten.slice_backward.default", (ValueRef("x0"), (8, 6), 1, 0, 3, 1), [(8, 3)], [(8, 6)], ["(S(0))"], ["(S(0))"])
    assert op.args[1] == (4, 6)
    with pytest.raises(LoweringError, match="writes into dim 1"):
        _one_node_program("aten.slice_backward.default", (ValueRef("x0"), (8, 6), 1, 0, 4, 1), [(8, 4)], [(8, 6)], ["(S(1))"], ["(S(1))"])
    # split of a sharded dim: as many pieces, each local / count
    op = _one_node_program("aten.split.Tensor", (ValueRef("x0"), 4, 1), [(2, 12)], [(2, 4)] * 3, ["(S(1))"], ["(S(1))"] * 3)
    assert op.args[1] == 2
    # layer norm: normalized_shape follows the input's local trailing dims
    op = _one_node_program("aten.native_layer_norm.default", (ValueRef("x0"), (6,), None, None, 1e-5), [(4, 6)],
                           [(4, 6), (4, 1), (4, 1)], ["(S(1))"], ["(S(1))", "(R)", "(R)"])
    assert op.args[1] == (3,)
