"""Overlap and shared collectives, as lowering passes (no processes).

Placement: each collective (a bucket or a one-collective reshard) is issued right after the
last of its sources is made and waited for right before its first reader; the program stays
in a valid order; the bytes of collectives in flight stay under the cap; local ops keep their
order; the same collectives run (same calls and bytes). Sharing: one value resharded to two
targets whose chains start with the same collective runs that collective once.
"""

from __future__ import annotations

import pytest

from test_coalesce import MLP_PLANS, assert_valid_order, mlp_graph, zero3_plan  # noqa: F401 (mlp_graph: a fixture)

from metadist.ir import Graph, GraphInput, GraphOutput, MetaOp, Mesh, Node, Role, TensorSpec, Value, ValueRef
from metadist.ir import parse_sharding as S
from metadist.ir.plan import AxisChoice, NodeStrategy, Plan, graph_fingerprint
from metadist.lowering import CoalescedReshard, LocalOp, Reshard, Wait, is_async, lower, schedule_overlap
from metadist.lowering.overlap import held_bytes, reads, targets

F32 = TensorSpec((8,), "float32")


def _interleaved_grads_graph(n: int = 3) -> Graph:
    """A backward pass that makes gradient g_i, then more work (h_i), in turn; then an update of each parameter."""
    inputs = [GraphInput(Value(f"p{i}", F32), Role.PARAM) for i in range(n)]
    nodes = []
    for i in range(n):
        nodes.append(Node(f"grad{i}", MetaOp("aten.mul.Tensor"), (ValueRef(f"p{i}"), 2.0), (), (Value(f"g{i}", F32),)))
        nodes.append(Node(f"work{i}", MetaOp("aten.neg.default"), (ValueRef(f"p{i}"),), (), (Value(f"h{i}", F32),)))
    nodes += [Node(f"upd{i}", MetaOp("aten.sub.Tensor"), (ValueRef(f"h{i}"), ValueRef(f"g{i}")), (), (Value(f"q{i}", F32),))
              for i in range(n)]
    outputs = [GraphOutput(f"q{i}", Role.PARAM, replaces=f"p{i}") for i in range(n)]
    return Graph(tuple(inputs), tuple(nodes), tuple(outputs), name="interleaved")


def _interleaved_plan(graph: Graph) -> Plan:
    factor = (AxisChoice("factor", 0),)
    partial, replicated = S("(P(sum))"), S("(R)")
    strategies = {}
    for node in graph.nodes:
        if node.name.startswith("grad"):
            strategies[node.name] = NodeStrategy(factor, (replicated,), (partial,))
        elif node.name.startswith("work"):
            strategies[node.name] = NodeStrategy(factor, (replicated,), (replicated,))
        else:
            strategies[node.name] = NodeStrategy(factor, (replicated, replicated), (replicated,))
    return Plan(graph.name, graph_fingerprint(graph), "test", Mesh((2,)), strategies,
                {i.value.name: replicated for i in graph.inputs}, tuple(replicated for _ in graph.outputs))


def _position(program, predicate) -> int:
    return next(index for index, item in enumerate(program.instructions) if predicate(item))


def _op(name: str):
    return lambda item: isinstance(item, LocalOp) and item.node == name


def _issue_and_wait(program, target: str) -> tuple[int, int]:
    issue = _position(program, lambda item: is_async(item) and target in targets(item))
    wait = _position(program, lambda item: isinstance(item, Wait) and target in item.targets)
    return issue, wait


def assert_issued_early_and_waited_late(program, cap: int) -> None:
    """Every collective is issued right after its last source is defined, or as soon as the in-flight cap let
    it (no local op ran in between while it would have fit), and waited for right before its first reader;
    every issued collective is waited for exactly once, after it."""
    defined_at = {item.name: -1 for item in program.inputs}
    first_read: dict[str, int] = {}
    in_flight_before, in_flight = [], {}
    for index, item in enumerate(program.instructions):
        in_flight_before.append(sum(in_flight.values()))
        if is_async(item):
            in_flight[targets(item)] = held_bytes(item)
        elif isinstance(item, Wait):
            del in_flight[item.targets]
        if isinstance(item, LocalOp):
            for name in item.outputs:
                if name is not None:
                    defined_at[name] = index
        elif isinstance(item, Wait):
            for name in item.targets:
                defined_at[name] = index
        elif not is_async(item):
            defined_at[item.target] = index
        if not isinstance(item, Wait):
            for name in reads(item):
                first_read.setdefault(name, index)
    waits = [item for item in program.instructions if isinstance(item, Wait)]
    issued = [item for item in program.instructions if is_async(item)]
    assert sorted(t for w in waits for t in w.targets) == sorted(t for item in issued for t in targets(item))
    for item in issued:
        issue, wait = _issue_and_wait(program, targets(item)[0])
        assert issue < wait
        last_source = max(defined_at[name] for name in reads(item))
        for position in range(last_source + 1, issue):
            other = program.instructions[position]
            if not (isinstance(other, Wait) or is_async(other)):
                assert 0 < in_flight_before[position] and in_flight_before[position] + held_bytes(item) > cap, \
                    f"{targets(item)} could have been issued before {position} (its last source is defined at {last_source})"
        readers = [first_read[name] for name in targets(item) if name in first_read]
        end = min(readers) if readers else len(program.instructions)
        assert wait < end and all(isinstance(other, Wait) or is_async(other) for other in program.instructions[wait + 1:end]), \
            f"{targets(item)} waited for at {wait}, first read at {end}"


def test_each_gradient_is_issued_right_after_it_is_made_and_waited_for_before_its_update():
    graph = _interleaved_grads_graph(3)
    plan = _interleaved_plan(graph)
    plain = lower(graph, plan, (0,), bucket_cap_bytes=32)  # 32 bytes: one gradient per bucket
    program = schedule_overlap(plain, 1 << 20)
    assert_valid_order(program)
    assert_issued_early_and_waited_late(program, 1 << 20)
    for i in range(3):
        issue, wait = _issue_and_wait(program, f"g{i}~{i}")
        assert issue == _position(program, _op(f"grad{i}")) + 1, "issued right after the op that makes the gradient"
        assert program.instructions[wait + 1] == program.instructions[_position(program, _op(f"upd{i}"))]
    # lowered with overlap, two 32-byte buckets may be in flight: the third gradient waits for the first's wait
    capped = lower(graph, plan, (0,), bucket_cap_bytes=32, overlap=True)
    assert_issued_early_and_waited_late(capped, 64)
    issue, _ = _issue_and_wait(capped, "g2~2")
    assert issue == _position(capped, lambda item: isinstance(item, Wait) and item.targets == ("g0~0",)) + 1
    # the reductions overlap the rest of the backward pass: work0, grad1, ... run between issue and wait of g0
    issue, wait = _issue_and_wait(program, "g0~0")
    assert {item.node for item in program.instructions[issue:wait] if isinstance(item, LocalOp)} >= {"work0", "grad1", "work2"}
    # local ops keep their order; the same collectives run
    assert [i.node for i in program.instructions if isinstance(i, LocalOp)] == [i.node for i in plain.instructions if isinstance(i, LocalOp)]
    assert program.predicted_comm() == plain.predicted_comm() == {("all_reduce", 0): (3, 3 * 32)}
    assert not any(isinstance(item, Wait) for item in plain.instructions), "overlap off: no waits, as lowered"


def test_a_bucket_is_issued_after_its_last_member_is_made():
    graph = _interleaved_grads_graph(3)
    program = lower(graph, _interleaved_plan(graph), (0,), overlap=True)
    (bucket,) = [item for item in program.instructions if isinstance(item, CoalescedReshard)]
    issue, wait = _issue_and_wait(program, "g0~0")
    assert program.instructions[issue] is bucket
    assert issue == _position(program, _op("grad2")) + 1 and wait < _position(program, _op("upd0"))
    assert [item.node for item in program.instructions[issue:wait] if isinstance(item, LocalOp)] == ["work2"]
    assert_issued_early_and_waited_late(program, 50 << 20)


def _gathers_graph(n: int) -> tuple[Graph, Plan]:
    """``n`` sharded parameters, each gathered and read by one op in turn (ZeRO-3-like forward)."""
    inputs = [GraphInput(Value(f"w{i}", F32), Role.PARAM) for i in range(n)]
    nodes = [Node("start", MetaOp("aten.neg.default"), (ValueRef("w0"),), (), (Value("a0", F32),))]
    nodes += [Node(f"layer{i}", MetaOp("aten.add.Tensor"), (ValueRef(f"a{i}"), ValueRef(f"w{i}")), (), (Value(f"a{i + 1}", F32),))
              for i in range(n)]
    graph = Graph(tuple(inputs), tuple(nodes), (GraphOutput(f"a{n}", Role.ACTIVATION),), name="gathers")
    factor = (AxisChoice("factor", 0),)
    replicated, sharded = S("(R)"), S("(S(0))")
    strategies = {"start": NodeStrategy(factor, (replicated,), (replicated,))}
    strategies.update({f"layer{i}": NodeStrategy(factor, (replicated, replicated), (replicated,)) for i in range(n)})
    plan = Plan(graph.name, graph_fingerprint(graph), "test", Mesh((2,)), strategies,
                {i.value.name: sharded for i in graph.inputs}, (replicated,))
    return graph, plan


def test_in_flight_bytes_stay_under_the_cap():
    graph, plan = _gathers_graph(5)
    plain = lower(graph, plan, (0,), bucket_cap_bytes=0)  # one all-gather per parameter, 32-byte buffers
    assert all(held_bytes(item) == 32 for item in plain.instructions if is_async(item))
    for cap, at_start in [(64, 2), (96, 3), (1 << 20, 5)]:
        program = schedule_overlap(plain, cap)
        assert_valid_order(program)
        assert_issued_early_and_waited_late(program, cap)
        in_flight, most = {}, 0
        for item in program.instructions:
            if is_async(item):
                in_flight[targets(item)] = held_bytes(item)
            elif isinstance(item, Wait):
                del in_flight[item.targets]
            most = max(most, sum(in_flight.values()))
        assert most <= cap
        assert all(is_async(item) for item in program.instructions[:at_start]), f"cap {cap}: {at_start} gathers issued at once"
        assert not is_async(program.instructions[at_start])
        assert program.predicted_comm() == plain.predicted_comm()
    # a cap below one buffer: one collective in flight at a time, issued as soon as the previous one is waited for
    tight = schedule_overlap(plain, 8)
    assert_issued_early_and_waited_late(tight, 8)
    kinds = [type(item).__name__ for item in tight.instructions]
    assert kinds == ["Reshard", "Wait", "Reshard", "LocalOp", "LocalOp"] + ["Wait", "Reshard", "LocalOp"] * 3 + ["Wait", "LocalOp"]


@pytest.mark.parametrize("name", list(MLP_PLANS))
def test_whole_step_programs_overlap_in_a_valid_order_with_the_same_collectives(mlp_graph, name):
    mesh_shape, inputs = MLP_PLANS[name]
    plan = zero3_plan(mlp_graph, Mesh(mesh_shape), inputs)
    for coords in [(0,) * len(mesh_shape), (1,) * len(mesh_shape)]:
        synchronous = lower(mlp_graph, plan, coords)
        program = lower(mlp_graph, plan, coords, overlap=True)
        assert_valid_order(program)
        assert_issued_early_and_waited_late(program, 50 << 20)
        assert program.predicted_comm() == synchronous.predicted_comm()
        assert [i for i in program.instructions if isinstance(i, LocalOp)] == [i for i in synchronous.instructions if isinstance(i, LocalOp)]
        overlapped = 0
        for item in program.instructions:
            if is_async(item):
                issue, wait = _issue_and_wait(program, targets(item)[0])
                overlapped += any(isinstance(other, LocalOp) for other in program.instructions[issue:wait])
        assert overlapped > 0, "some collective runs while local ops do"
        assert schedule_overlap(program) is program, "scheduling twice changes nothing"


# ---------------------------------------------------------------- shared collectives


def _two_targets_graph(second: str, first: str = "(S(0), S(0))") -> tuple[Graph, Plan]:
    """``x`` made ``first`` on a 2x2 mesh, read ``(R, R)`` by one op and ``second`` by another."""
    spec = TensorSpec((8, 8), "float32")
    inputs = (GraphInput(Value("p", spec), Role.PARAM),)
    nodes = (
        Node("make", MetaOp("aten.neg.default"), (ValueRef("p"),), (), (Value("x", spec),)),
        Node("whole", MetaOp("aten.neg.default"), (ValueRef("x"),), (), (Value("y", spec),)),
        Node("part", MetaOp("aten.neg.default"), (ValueRef("x"),), (), (Value("z", spec),)),
    )
    graph = Graph(inputs, nodes, (GraphOutput("y", Role.ACTIVATION), GraphOutput("z", Role.ACTIVATION)), name="two")
    factor = (AxisChoice("factor", 0),) * 2
    sharded, replicated = S(first), S("(R, R)")
    strategies = {"make": NodeStrategy(factor, (sharded,), (sharded,)),
                  "whole": NodeStrategy(factor, (replicated,), (replicated,)),
                  "part": NodeStrategy(factor, (S(second),), (S(second),))}
    plan = Plan(graph.name, graph_fingerprint(graph), "test", Mesh((2, 2)), strategies, {"p": sharded},
                (replicated, S(second)))
    return graph, plan


@pytest.mark.parametrize("second,post", [("(S(0), R)", ()), ("(S(1), R)", ("local_slice",))])
def test_two_reshards_of_one_value_share_their_collectives(second, post):
    """(S(0), S(0)) -> (R, R) gathers on axis 1, then on axis 0. -> (S(0), R) is the first of these
    gathers; -> (S(1), R) is both, then a local slice: each shares what it repeats."""
    graph, plan = _two_targets_graph(second)
    for coords in [(0, 0), (1, 1)]:
        unshared = lower(graph, plan, coords, bucket_cap_bytes=0)  # as lowered: each chain on its own
        program = lower(graph, plan, coords)
        assert_valid_order(program)
        calls = lambda p: {key: count for key, (count, _) in p.predicted_comm().items()}  # noqa: E731
        assert calls(unshared) == {("all_gather", 1): 2, ("all_gather", 0): 1 + len(post)}
        assert calls(program) == {("all_gather", 1): 1, ("all_gather", 0): 1}
        saved = {key: unshared.predicted_comm()[key][1] - nbytes for key, (_, nbytes) in program.predicted_comm().items()}
        # axis 1's gather makes half the tensor (a rank sends half of that); axis 0's the whole (same)
        assert saved == {("all_gather", 1): 256 // 2 // 2, ("all_gather", 0): 256 // 2 * len(post)}
        gathers = [item for item in program.instructions if isinstance(item, Reshard) and any(s.kind == "all_gather" for s in item.steps)]
        assert [(g.source, [s.kind for s in g.steps]) for g in gathers] == [("x", ["all_gather"]), (gathers[0].target, ["all_gather"])]
        local = [item for item in program.instructions if isinstance(item, Reshard) and item not in gathers]
        assert sorted(tuple(s.kind for s in r.steps) for r in local) == sorted([()] + ([tuple(post)] if post else [])), \
            "the second target keeps only its local steps (a reshard with none is an alias)"
        overlapped = lower(graph, plan, coords, overlap=True)
        assert_valid_order(overlapped)
        assert overlapped.predicted_comm() == program.predicted_comm()


def test_different_collectives_on_one_value_are_not_shared():
    # (S(0), S(1)) -> (R, R) gathers dim 1 on axis 1 first; -> (R, S(1)) gathers dim 0 on axis 0 only
    graph, plan = _two_targets_graph("(R, S(1))", first="(S(0), S(1))")
    program = lower(graph, plan, (0, 0))
    unshared = lower(graph, plan, (0, 0), bucket_cap_bytes=0)
    assert unshared.predicted_comm() == {("all_gather", 0): (2, 64 + 128), ("all_gather", 1): (1, 64)}
    assert program.predicted_comm() == {("all_gather", 0): (1, 64 + 128), ("all_gather", 1): (1, 64)}  # coalesced, not shared
