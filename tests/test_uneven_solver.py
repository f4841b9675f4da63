"""Uneven shards in the solver and the cost model: which uneven splits are planned, why the others are not, and padding."""

from __future__ import annotations

import itertools

import pytest

from metadist.cost import cluster_for, compute_seconds, local_nbytes, reshard
from metadist.cost.compute import Work, uneven_scale
from metadist.ir import Mesh, Replicate, Shard, TensorSpec, parse_rule, parse_sharding
from metadist.ir.plan import AxisChoice, strategy_from_choices
from metadist.lowering import plan_resharding
from metadist.solver import plan_graph
from metadist.solver.strategies import input_strategies, node_strategies, piece_lengths
from test_solver_helpers import mlp_step

S = parse_sharding


def _choices(found):
    return {tuple(str(choice) for choice in st.choices) for st in found.strategies}


def test_an_uneven_split_is_planned_when_the_factor_has_one_size():
    found = node_strategies(parse_rule("ab,bc->ac | b:sum"), ((6, 10), (10, 7)), ((6, 7),), Mesh((4,)))
    assert {("f0",), ("f1",), ("f2",)} <= _choices(found)  # 6 rows, 10 (k, Partial), 7 columns over 4: all uneven
    assert found.uneven == 3 and found.excluded_indivisible == 0


def test_a_reshape_that_merges_the_split_dim_keeps_refusing_uneven_pieces():
    merge = parse_rule("a_->a")  # (6, 3) -> (18): the factor occupies 6 rows in, 18 elements out
    found = node_strategies(merge, ((6, 3),), ((18,),), Mesh((4,)))
    assert _choices(found) == {("R",)} and dict(found.excluded_uneven) == {"sizes_differ": 1}
    assert node_strategies(merge, ((8, 3),), ((24,),), Mesh((4,))).uneven == 0  # even: 2 rows -> 6 elements each
    assert ("f0",) in _choices(node_strategies(merge, ((8, 3),), ((24,),), Mesh((4,))))


def test_halo_factors_and_empty_max_or_identity_pieces_are_refused_with_their_reason():
    conv = parse_rule("abcd,eb__->aecd | b:sum c:halo=1")
    halo = node_strategies(conv, ((2, 3, 10, 8), (4, 3, 3, 3)), ((2, 4, 10, 8),), Mesh((4,)))
    assert dict(halo.excluded_uneven) == {"halo": 1}  # 10 rows over 4: the halo exchange needs equal pieces
    amax = parse_rule("ab->b | a:max")
    assert dict(node_strategies(amax, ((6, 5),), ((5,),), Mesh((4,))).excluded_uneven) == {"empty_max_min": 1}  # 2, 2, 2, 0
    assert ("f0",) in _choices(node_strategies(amax, ((7, 5),), ((5,),), Mesh((4,))))  # 2, 2, 2, 1: no empty piece
    total = parse_rule("ab->b | a:sum")
    assert ("f0",) in _choices(node_strategies(total, ((6, 5),), ((5,),), Mesh((4,))))  # an empty piece sums to zeros
    # an output every piece computes whole must not come from an empty piece: convolution_backward split along 3
    # input channels over 2x2 (2 / 1, 1 / 0) gave the bias gradient as zeros on the rank with no channel
    backward = parse_rule("__,_b->_b,_ | b:id")  # (grad_out, input) -> (grad_weight, grad_bias)
    shapes = ((4, 16), (4, 3)), ((4, 3), (16,))
    square = node_strategies(backward, *shapes, Mesh((2, 2)))
    assert ("f0", "f0") not in _choices(square) and dict(square.excluded_uneven) == {"empty_identity": 1}
    assert ("f0", "R") in _choices(square) and square.uneven >= 1  # 2, 1: uneven, no empty piece
    assert ("f0",) not in _choices(node_strategies(backward, *shapes, Mesh((4,))))  # 1, 1, 1, 0
    no_bias = node_strategies(backward, shapes[0], ((4, 3), None), Mesh((4,)))  # the output not asked for
    assert ("f0",) in _choices(no_bias) and not no_bias.excluded_uneven


def test_even_only_runtimes_get_no_uneven_strategy():
    mesh = Mesh((4,))
    found = node_strategies(parse_rule("ab,bc->ac | b:sum"), ((6, 10), (10, 7)), ((6, 7),), mesh, uneven_shards=False)
    assert _choices(found) == {("R",)} and dict(found.excluded_uneven) == {"runtime_even_only": 3}
    inputs = input_strategies(TensorSpec((6, 8), "float32"), mesh, uneven_shards=False)
    assert [st.outputs[0] for st in inputs.strategies] == [(Replicate(),), (Shard(1),)]
    graph, rules = mlp_step(6, 64, 256, layers=1)
    plan = plan_graph(graph, rules, cluster_for("h100x8", mesh), uneven_shards=False)
    assert plan.solver["uneven_strategies"] == 0 and plan.solver["excluded_uneven_runtime_even_only"] > 0
    assert plan.node_strategies["mm_0"].inputs[0] == (Replicate(),)


def test_piece_lengths_nest_in_axis_order():
    assert piece_lengths(6, [4]) == {2, 0}
    assert piece_lengths(9, [2, 4]) == {2, 1, 0}  # 5 -> 2, 2, 1, 0 (torch.chunk); 4 -> 1, 1, 1, 1
    assert piece_lengths(8, [2, 4]) == {1}


# ---------------------------------------------------------------- cost model


def test_compute_is_priced_on_the_rank_with_the_largest_pieces():
    mesh, device = Mesh((4,)), cluster_for("h100x8", Mesh((4,))).device
    rule = parse_rule("ab,bc->ac | b:sum")
    rows = strategy_from_choices(rule, (AxisChoice("factor", 0),))
    specs = (TensorSpec((6, 4096), "float32"), TensorSpec((4096, 4096), "float32"))
    assert uneven_scale(rows, specs, mesh) == pytest.approx(2 * 4 / 6)  # 2 of 6 rows where 6 / 4 = 1.5 is the even share
    even = (TensorSpec((8, 4096), "float32"), specs[1])
    assert uneven_scale(rows, even, mesh) == 1.0
    work = Work(flops=2.0 * 6 * 4096 * 4096)
    out = (TensorSpec((6, 4096), "float32"),)
    flops_s = compute_seconds(work, specs, out, rows, mesh, device)
    assert flops_s == pytest.approx(max(work.flops / 4 * (4 / 3) / device.peak_flops_per_s,
                                        (2 * 4096 * 4 + 4096 * 4096 * 4 + 2 * 4096 * 4) / device.memory_bandwidth_bytes_per_s))
    nested = strategy_from_choices(rule, (AxisChoice("factor", 0), AxisChoice("factor", 0)))
    assert uneven_scale(nested, (TensorSpec((9, 4), "float32"), TensorSpec((4, 4), "float32")), Mesh((2, 4))) == pytest.approx(2 * 8 / 9)


def test_memory_counts_the_largest_piece():
    mesh = Mesh((4,))
    assert local_nbytes(TensorSpec((6, 5), "float32"), S("(S(0))"), mesh) == 2 * 5 * 4
    assert local_nbytes(TensorSpec((1001, 64), "float32"), S("(S(0))"), Mesh((2,))) == 501 * 64 * 4


@pytest.mark.parametrize("shape,mesh_size", [((6, 5), 4), ((1001, 3), 2), ((7, 9), 4), ((8, 4), 4)])
def test_communication_is_priced_with_the_padding_the_runtime_sends(shape, mesh_size):
    """On a 1-D mesh the cost model's bytes per device equal the lowering's for the rank with the largest pieces."""
    mesh = Mesh((mesh_size,))
    cluster = cluster_for("h100x8", mesh)
    spec = TensorSpec(shape, "float32")
    shardings = [S(text) for text in ("(R)", "(S(0))", "(S(1))", "(P(sum))")]
    for source, target in itertools.product(shardings, repeat=2):
        priced = sum(c.comm_bytes for c in reshard(spec, source, target, cluster).collectives)
        lowered = sum(step.comm_bytes for step in plan_resharding(shape, 4, source, target, mesh, (0,)))
        assert priced == pytest.approx(lowered, abs=3), (source, target)  # the lowering rounds bytes down per collective
