"""The cost model: clusters, collectives, roofline compute, liveness memory, calibration fitting."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace

import pytest

from metadist.cost import Cluster, ClusterError, Link, cluster_for, collective_seconds, load_cluster, reshard, resolve_cluster
from metadist.cost.calibrate import cluster_from_report, cluster_over_mesh, fit_link
from metadist.cost.comm import resharding_local_copies
from metadist.cost.compute import Work, compute_seconds, node_work
from metadist.cost.memory import liveness
from metadist.ir import Mesh, Partial, Replicate, Shard, TensorSpec
from metadist.ir.plan import AxisChoice, NodeStrategy, strategy_from_choices
from test_solver_helpers import mlp_step

SPEC = TensorSpec((1024, 1024), "float32")  # 4 MiB


def test_multi_node_preset_puts_inner_axes_on_the_fast_link():
    cluster = cluster_for("h100-ib", Mesh((4, 8)))
    assert cluster.link(0).name == "infiniband-ndr" and cluster.link(1).name == "nvlink4"
    assert cluster_for("h100-ib", Mesh((8,))).link(0).name == "nvlink4"
    assert cluster_for("a100x8", Mesh((2, 4))).axis_links[0].name == "nvlink3"


def test_cluster_json_round_trip_and_relayout(tmp_path):
    cluster = cluster_for("h100-ib", Mesh((2, 8)))
    path = tmp_path / "cluster.json"
    path.write_text(cluster.to_json())
    assert load_cluster(path) == cluster
    assert load_cluster(path, Mesh((4, 2))).mesh == Mesh((4, 2))
    assert resolve_cluster(str(path), Mesh((2, 8))) == cluster
    with pytest.raises(ClusterError, match="neither a preset"):
        resolve_cluster("no-such-preset", Mesh((8,)))
    with pytest.raises(ClusterError, match="one link per mesh axis"):
        Cluster(mesh=Mesh((2, 2)), device=cluster.device, axis_links=cluster.axis_links[:1])


@pytest.mark.parametrize(
    "src, dst, kind, sent_bytes",
    [
        ((Shard(0),), (Replicate(),), "all_gather", 7 * SPEC.nbytes / 8),
        ((Partial(),), (Replicate(),), "all_reduce", 2 * 7 / 8 * SPEC.nbytes),
        ((Partial(),), (Shard(1),), "reduce_scatter", 7 / 8 * SPEC.nbytes),
        ((Shard(0),), (Shard(1),), "all_to_all", 7 / 8 * SPEC.nbytes / 8),
    ],
)
def test_each_transition_uses_the_right_ring_collective(src, dst, kind, sent_bytes):
    cluster = cluster_for("h100x8", Mesh((8,)))
    moves = reshard(SPEC, src, dst, cluster).collectives
    assert [move.kind for move in moves] == [kind]
    assert moves[0].comm_bytes == pytest.approx(sent_bytes)
    link = cluster.link(0)
    assert moves[0].comm_s > sent_bytes / link.bandwidth_bytes_per_s


@pytest.mark.parametrize("src, dst, copied", [
    ((Shard(0),), (Replicate(),), [1 / 8, 1.0]),  # packed, then the gathered pieces copied out
    ((Partial(),), (Replicate(),), [1.0, 1.0]),  # packed, then the flat buffer cloned
    ((Partial(),), (Shard(1),), [1.0]),  # packed
    ((Shard(0),), (Shard(1),), []),  # never coalesced
])
def test_the_search_prices_each_collective_with_the_copies_of_a_coalesced_call(src, dst, copied):
    from metadist.cost.comm import priced_collective, resharding_collectives
    from metadist.cost.compute import copy_seconds

    cluster = cluster_for("h100x8", Mesh((8,)))
    (kind, axis, ring_bytes), = resharding_collectives(SPEC, src, dst, cluster.mesh)
    bare, _ = priced_collective(kind, ring_bytes, 8, cluster.link(axis))
    numel = SPEC.nbytes / SPEC.itemsize
    copies = sum(copy_seconds(cluster.device, SPEC.dtype, share * numel) for share in copied)
    assert reshard(SPEC, src, dst, cluster).comm_s == pytest.approx(bare + copies)
    assert bool(copies) == (kind != "all_to_all")


def test_slicing_a_replicated_value_moves_nothing_but_copies_its_piece_and_steps_follow_the_lowering():
    from metadist.cost.compute import copy_seconds

    cluster = cluster_for("h100-ib", Mesh((2, 8)))
    sliced = reshard(SPEC, (Replicate(), Replicate()), (Shard(0), Shard(1)), cluster)
    assert sliced.collectives == ()
    # the lowering slices on each axis in turn, and the runtime clones each slice (runtime.collectives.local_slice)
    pieces = [copy_seconds(cluster.device, SPEC.dtype, SPEC.numel / parts) for parts in (2, 16)]
    assert sorted(resharding_local_copies(SPEC, (Replicate(), Replicate()), (Shard(0), Shard(1)), cluster.mesh)) == \
        [SPEC.numel / 16, SPEC.numel / 2]
    assert sliced.comm_s == sliced.local_s == pytest.approx(sum(pieces))
    # an uneven value takes the lowering's own steps: the same copies of its largest pieces
    odd = TensorSpec((1023, 1024), "float32")
    assert sorted(resharding_local_copies(odd, (Replicate(), Replicate()), (Shard(0), Shard(1)), cluster.mesh)) == \
        [512 * 128.0, 512 * 1024.0]
    move = reshard(SPEC, (Partial(), Replicate()), (Replicate(), Shard(0)), cluster).collectives
    assert [m.kind for m in move] == ["all_reduce"]
    # the lowering reduces first, then slices (metadist.lowering.reshard's phases): the whole value is all-reduced
    assert move[0].comm_bytes == pytest.approx(2 * 1 / 2 * SPEC.nbytes)


def test_collective_seconds_follow_alpha_beta():
    link = cluster_for("h100x8", Mesh((8,))).link(0)
    small, _ = collective_seconds("all_reduce", 8, 8, link)
    large, _ = collective_seconds("all_reduce", 8e9, 8, link)
    assert small == pytest.approx(link.call_overhead_s + 14 * link.latency_s, rel=1e-3)
    assert large == pytest.approx(2 * 7 / 8 * 8e9 / link.bandwidth_bytes_per_s, rel=1e-2)
    assert collective_seconds("all_gather", 1e6, 1, link) == (0.0, 0.0)


def test_roofline_compute_of_a_matmul_divides_by_the_split():
    graph, _ = mlp_step(4096, 1024, 4096, layers=1)
    node = graph.node("mm_0")
    work = node_work(graph, node)
    assert work.flops == 2 * 4096 * 1024 * 4096
    cluster = cluster_for("h100x8", Mesh((8,)))
    specs = [graph.value(name).spec for name in node.input_names]
    outs = [node.outputs[0].spec]
    from test_solver_helpers import RULES
    from metadist.ir import parse_rule

    rule = parse_rule(RULES["mm"])
    whole = compute_seconds(work, specs, outs, strategy_from_choices(rule, (AxisChoice("replicate"),)), cluster.mesh, cluster.device)
    split = compute_seconds(work, specs, outs, strategy_from_choices(rule, (AxisChoice("factor", 0),)), cluster.mesh, cluster.device)
    assert whole == pytest.approx(max(work.flops / cluster.device.peak_flops_per_s, (4096 * 1024 + 1024 * 4096 + 4096 * 4096) * 4 / cluster.device.memory_bandwidth_bytes_per_s))
    assert split < whole / 4


def test_compute_is_priced_at_the_rates_of_its_dtype():
    from metadist.cost.cluster import Device

    device = Device(peak_flops_per_s=1e11, memory_bandwidth_bytes_per_s=2e10, memory_capacity_bytes=1e9,
                    peak_flops_per_s_by_dtype={"bfloat16": 4e11}, memory_bandwidth_bytes_per_s_by_dtype={"bfloat16": 1e10})
    mesh = Mesh((1,))
    replicated = NodeStrategy(choices=(AxisChoice("replicate"),), inputs=((Replicate(),),) * 2, outputs=((Replicate(),),))
    add = Work(flops=float(1 << 20))
    for dtype, bandwidth in (("float32", 2e10), ("bfloat16", 1e10), ("float16", 2e10)):  # float16: not listed
        spec = TensorSpec((1 << 20,), dtype)
        assert compute_seconds(add, [spec, spec], [spec], replicated, mesh, device) == pytest.approx(3 * spec.nbytes / bandwidth)
    mm = Work(flops=1e12)
    for dtype, flops in (("float32", 1e11), ("bfloat16", 4e11)):
        spec = TensorSpec((4, 4), dtype)
        assert compute_seconds(mm, [spec, spec], [spec], replicated, mesh, device) == pytest.approx(1e12 / flops)
    fields = {name: getattr(device, name) for name in device.__dataclass_fields__}
    as_lists = {**fields, "memory_bandwidth_bytes_per_s_by_dtype": [["bfloat16", 1e10]]}  # as a JSON document has it
    assert Device(**as_lists) == device
    with pytest.raises(ClusterError, match="positive"):
        Device(**{**fields, "memory_bandwidth_bytes_per_s_by_dtype": {"bfloat16": 0.0}})
    # measured curves: the rate at the node's own size, interpolated over log size, held at the ends
    curved = Device(**{**fields, "matmul_curves": {"bfloat16": [(1e6, 1e10), (1e8, 3e11)]},
                       "elementwise_curves": {"float32": [(1e4, 4e10), (1e7, 1e10)]}})
    assert curved.flops_per_s("bfloat16", 1e5) == 1e10 and curved.flops_per_s("bfloat16", 1e9) == 3e11
    assert curved.flops_per_s("bfloat16", 1e7) == pytest.approx(1e10 + 0.5 * (3e11 - 1e10))
    assert curved.flops_per_s("float32", 1e7) == 1e11 and curved.flops_per_s("bfloat16") == 4e11  # no curve; the peak
    small = TensorSpec((1024,), "float32")  # 12 KiB moved: near the curve's cache-resident end
    assert compute_seconds(Work(flops=1024.0), [small, small], [small], replicated, mesh, curved) == pytest.approx(
        3 * small.nbytes / 1e10)  # a cache-resident add's faster rate is not taken: the streaming rate caps it
    rising = Device(**{**fields, "elementwise_curves": {"bfloat16": [(1e4, 2e9), (1e7, 8e9)]}})
    assert rising.bandwidth_bytes_per_s("bfloat16", 1e4) == 2e9 and rising.bandwidth_bytes_per_s("bfloat16", 1e8) == 8e9
    assert 2e9 < rising.bandwidth_bytes_per_s("bfloat16", 1e5) < 8e9
    with pytest.raises(ClusterError, match="positive"):
        Device(**{**fields, "matmul_curves": {"float32": [(1e6, 0.0)]}})
    assert Cluster.from_dict(json.loads(Cluster(mesh=mesh, device=curved, axis_links=(Link(bandwidth_bytes_per_s=1e9, latency_s=0.0),)).to_json())).device == curved


def test_a_batched_matmul_runs_at_the_rate_of_one_of_its_matmuls():
    """``bmm`` runs one small matmul per batch element: its FLOPs are priced at the curve's rate for one of them (its
    local output's leading dims: a strategy that splits the batch leaves each rank fewer, of the same size)."""
    from metadist.cost.cluster import Device

    device = Device(peak_flops_per_s=1e11, memory_bandwidth_bytes_per_s=1e15, memory_capacity_bytes=1e9,
                    op_overhead_s=0.0, matmul_curves={"float32": [(2 * 64**3, 1e10), (2 * 512**3, 1e11)]})
    q, k, scores = TensorSpec((48, 64, 64), "float32"), TensorSpec((48, 64, 64), "float32"), TensorSpec((48, 64, 64), "float32")
    mesh = Mesh((2,))
    flops = 2.0 * 48 * 64**3
    replicated = NodeStrategy(choices=(AxisChoice("replicate"),), inputs=((Replicate(),), (Replicate(),)),
                              outputs=((Replicate(),),))
    split = NodeStrategy(choices=(AxisChoice("factor", 0),), inputs=((Shard(0),), (Shard(0),)), outputs=((Shard(0),),))
    bmm = Work(flops=flops, operands=(0, 1), op="bmm")
    assert compute_seconds(bmm, [q, k], [scores], replicated, mesh, device) == pytest.approx(flops / 1e10)
    assert compute_seconds(bmm, [q, k], [scores], split, mesh, device) == pytest.approx(flops / 2 / 1e10)
    # one matmul of the same FLOPs (mm) takes the rate of its own size
    mm = Work(flops=flops, operands=(0, 1), op="mm")
    assert compute_seconds(mm, [q, k], [scores], replicated, mesh, device) == pytest.approx(
        flops / device.flops_per_s("float32", flops))
    assert device.flops_per_s("float32", flops) > 3e10


def test_an_op_that_computes_more_than_it_moves_is_priced_at_its_measured_rate_per_element():
    """``tanh``, ``exp``, softmax and the like run far below the elementwise roofline on a CPU: a calibrated device's
    seconds per element price them (on the local output), a floor under the roofline, beyond the per-op overhead."""
    from metadist.cost.calibrate import cluster_from_report
    from metadist.cost.cluster import Device

    device = Device(peak_flops_per_s=1e11, memory_bandwidth_bytes_per_s=2e10, memory_capacity_bytes=1e9,
                    op_overhead_s=4e-6, op_element_seconds={"tanh": 3e-9, "exp": 1e-12})
    spec = TensorSpec((8, 1 << 16), "float32")
    replicated = NodeStrategy(choices=(AxisChoice("replicate"),), inputs=((Replicate(),),), outputs=((Replicate(),),))
    split = NodeStrategy(choices=(AxisChoice("factor", 0),), inputs=((Shard(0),),), outputs=((Shard(0),),))
    mesh = Mesh((2,))
    tanh, exp, neg = (Work(flops=float(spec.numel), op=name) for name in ("tanh", "exp", "neg"))
    assert compute_seconds(tanh, [spec], [spec], replicated, mesh, device) == pytest.approx(4e-6 + spec.numel * 3e-9)
    assert compute_seconds(tanh, [spec], [spec], split, mesh, device) == pytest.approx(4e-6 + spec.numel / 2 * 3e-9)
    roofline = 2 * spec.nbytes / 2e10  # exp's measured rate is below its bytes' time: the roofline stands
    assert compute_seconds(exp, [spec], [spec], replicated, mesh, device) == pytest.approx(4e-6 + roofline)
    assert compute_seconds(neg, [spec], [spec], replicated, mesh, device) == pytest.approx(4e-6 + roofline)  # not measured
    assert device.element_seconds("tanh") == 3e-9 and device.element_seconds("neg") == 0.0
    # a node in a narrow dtype is priced at that dtype's figure where one was timed (version 30), else float32's
    narrow = replace(device, op_element_seconds={"tanh": 3e-9, "tanh@bfloat16": 15e-9})
    half = TensorSpec(spec.shape, "bfloat16")
    assert compute_seconds(tanh, [half], [half], replicated, mesh, narrow) == pytest.approx(4e-6 + spec.numel * 15e-9)
    assert compute_seconds(tanh, [spec], [spec], replicated, mesh, narrow) == pytest.approx(4e-6 + spec.numel * 3e-9)
    assert narrow.element_seconds("tanh", "float16") == 3e-9 and narrow.element_seconds("exp", "bfloat16") == 0.0
    # a captured node's work names its op; the figures survive a cluster JSON and come from the calibration report
    graph, _ = mlp_step(8, 16, 32)
    assert node_work(graph, graph.node("relu_1")).op == "relu" and node_work(graph, graph.node("mm_0")).op == "mm"
    fields = {name: getattr(device, name) for name in device.__dataclass_fields__}
    assert Device(**{**fields, "op_element_seconds": [["exp", 1e-12], ["tanh", 3e-9]]}) == device
    one_axis = Cluster(mesh=mesh, device=device, axis_links=(Link(bandwidth_bytes_per_s=1e9, latency_s=0.0),))
    assert Cluster.from_dict(json.loads(one_axis.to_json())).device.element_seconds("tanh") == 3e-9
    # a random draw (a dropout mask's bernoulli) is priced at its rate per element on the whole output: every rank
    # draws the whole tensor whatever its strategy (the torch runtime's draw_random)
    drawing = replace(device, op_element_seconds={"bernoulli": 12e-9})
    bernoulli = Work(flops=float(spec.numel), draws_whole=True, op="bernoulli")
    assert compute_seconds(bernoulli, [spec], [spec], split, mesh, drawing) == pytest.approx(4e-6 + spec.numel * 12e-9)
    assert compute_seconds(bernoulli, [spec], [spec], replicated, mesh, drawing) == pytest.approx(4e-6 + spec.numel * 12e-9)
    with pytest.raises(ClusterError, match="per element"):
        Device(**{**fields, "op_element_seconds": {"tanh": -1e-9}})
    report = {"backend": "gloo", "memory_capacity_bytes": 1e9, "measurements": [],
              "device": {"peak_flops_per_s": 1e11, "memory_bandwidth_bytes_per_s": 2e10, "op_overhead_s": 4e-6,
                         "op_element_s:tanh": 3e-9, "op_element_s:_log_softmax": 7e-10}}
    assert cluster_from_report(report, mesh).device.op_element_seconds == (("_log_softmax", 7e-10), ("tanh", 3e-9))


def test_a_sustained_slowdown_scales_every_rate_and_per_op_time_of_the_calibration():
    """Ranks sharing cores compute slower over a step than in the calibration's short timed calls: the measured factor
    divides every rate and multiplies every per-op time; below 1 (warm caches) or missing (an older report, a GPU) it
    changes nothing."""
    mesh = Mesh((4,))
    figures = {"peak_flops_per_s": 1e11, "memory_bandwidth_bytes_per_s": 2e10, "peak_flops_per_s_bfloat16": 3e10,
               "memory_bandwidth_bytes_per_s_bfloat16": 1e10, "matmul_curve:float32:1000": 4e10,
               "elementwise_curve:float32:4096": 5e9, "matmul_stream_bytes_per_s": 2e9, "op_overhead_s": 4e-6,
               "op_element_s:tanh": 3e-9, "captured_step_s": 1e-3, "captured_nodes": 100.0, "captured_roofline_s": 2e-4,
               "eager_step_s": 6e-4}

    def device(**extra):
        report = {"backend": "gloo", "memory_capacity_bytes": 1e9, "measurements": [], "device": {**figures, **extra}}
        return cluster_from_report(report, mesh).device

    plain, slowed = device(), device(sustained_slowdown=1.6)
    assert plain.sustained_slowdown == 1.0 and slowed.sustained_slowdown == 1.6
    assert device(sustained_slowdown=0.9) == plain
    assert slowed.peak_flops_per_s == pytest.approx(plain.peak_flops_per_s / 1.6)
    assert slowed.memory_bandwidth_bytes_per_s == pytest.approx(plain.memory_bandwidth_bytes_per_s / 1.6)
    for dtype in ("float32", "bfloat16"):
        assert slowed.flops_per_s(dtype, 1000.0) == pytest.approx(plain.flops_per_s(dtype, 1000.0) / 1.6)
        assert slowed.bandwidth_bytes_per_s(dtype, 4096.0) == pytest.approx(plain.bandwidth_bytes_per_s(dtype, 4096.0) / 1.6)
    assert slowed.matmul_stream_s("float32", 1e6) == pytest.approx(1.6 * plain.matmul_stream_s("float32", 1e6))
    assert slowed.op_overhead_s == pytest.approx(1.6 * plain.op_overhead_s) == pytest.approx(1.6 * 8e-6)
    assert slowed.eager_op_overhead_s == pytest.approx(1.6 * plain.eager_op_overhead_s) == pytest.approx(1.6 * 4e-6)
    assert slowed.element_seconds("tanh") == pytest.approx(1.6 * 3e-9)
    with pytest.raises(ClusterError, match="slowdown"):
        replace(plain, sustained_slowdown=0.5)
    # ranks that outnumber the cores (version 12): the slowdown is at least their threads per core, whatever was measured
    assert device(sustained_slowdown=1.6, core_sharing=2.0).sustained_slowdown == 2.0
    assert device(sustained_slowdown=1.6, core_sharing=2.0).op_overhead_s == pytest.approx(2 * 8e-6)
    assert device(sustained_slowdown=2.5, core_sharing=2.0).sustained_slowdown == 2.5
    assert device(core_sharing=0.5) == plain  # fewer threads than cores: no floor above 1
    # an op on a DTensor (version 13): measured alone, scaled by the slowdown as every per-op time; 0 when not measured
    assert plain.dtensor_op_overhead_s == 0.0
    assert device(dtensor_op_s=30e-6).dtensor_op_overhead_s == pytest.approx(30e-6)
    assert device(dtensor_op_s=30e-6, sustained_slowdown=1.6).dtensor_op_overhead_s == pytest.approx(1.6 * 30e-6)
    with pytest.raises(ClusterError, match="positive"):
        replace(plain, dtensor_op_overhead_s=-1e-6)
    # an op of a parallel linear on DTensors (version 32): its own figure, scaled alike
    assert plain.dtensor_module_op_overhead_s == 0.0
    assert device(dtensor_module_op_s=35e-6, sustained_slowdown=1.6).dtensor_module_op_overhead_s == pytest.approx(1.6 * 35e-6)
    with pytest.raises(ClusterError, match="positive"):
        replace(plain, dtensor_module_op_overhead_s=-1e-6)
    # what DTensor adds to each all-reduce torch's TP issues (version 34): the calling thread's CPU, scaled alike
    assert plain.dtensor_collective_overhead_s == 0.0
    assert device(dtensor_collective_s=350e-6, sustained_slowdown=1.6).dtensor_collective_overhead_s == \
        pytest.approx(1.6 * 350e-6)
    with pytest.raises(ClusterError, match="positive"):
        replace(plain, dtensor_collective_overhead_s=-1e-6)


def test_fsdp_unit_costs_are_fitted_through_two_sizes_for_the_groups_they_were_timed_over():
    """Version 14: what torch's FSDP2 added per unit at two sizes gives (fixed seconds, bytes/s) per variant, on the
    link of the axis of all the processes (the units were timed over all of them), not scaled by the slowdown;
    a variant timed at one size, or an older report, gives none. Version 27: units timed over groups of a size price
    the links of that size only."""
    figures = {"peak_flops_per_s": 1e11, "memory_bandwidth_bytes_per_s": 2e10, "sustained_slowdown": 1.5,
               "fsdp_unit_s:zero2:1000": 3e-3, "fsdp_unit_s:zero2:11000": 5e-3,
               "fsdp_unit_s:zero3:1000": 4e-3, "fsdp_unit_s:zero3:11000": 8e-3, "fsdp_unit_s:other:1000": 1.0}
    rows = [{"axis": axis, "group_size": size, "op": "all_reduce", "bytes": nbytes, "seconds": 1e-4 + nbytes * 1e-9}
            for axis, size in ((0, 4), (-1, 2)) for nbytes in (4096, 262144)]
    report = {"backend": "gloo", "world_size": 4, "memory_capacity_bytes": 1e9, "measurements": rows, "device": figures}
    link = cluster_from_report(report, Mesh((4,))).link(0)
    assert dict((variant, (fixed, rate)) for variant, fixed, rate in link.fsdp_unit_costs) == {
        "zero2": (pytest.approx(2.8e-3), pytest.approx(5e6)), "zero3": (pytest.approx(3.6e-3), pytest.approx(2.5e6))}
    assert link.fsdp_unit_cost("zero3") == (pytest.approx(3.6e-3), pytest.approx(2.5e6))
    assert link.fsdp_unit_cost("zero1") is None
    # a 2x2 mesh: the pairs' axes take their own fitted links, without the units timed over all four processes
    assert all(not link.fsdp_unit_costs for link in cluster_over_mesh(report, Mesh((2, 2))).axis_links)
    # nor does the whole link lent to an axis that has no measurements of its own carry them
    no_pairs = {**report, "measurements": [row for row in rows if row["axis"] == 0]}
    assert all(not link.fsdp_unit_costs for link in cluster_over_mesh(no_pairs, Mesh((2, 2))).axis_links)
    assert cluster_over_mesh(no_pairs, Mesh((4,))).link(0).fsdp_unit_costs == link.fsdp_unit_costs
    # version 27: the units timed over pairs too price FSDP2 over a pair axis, and only there
    pairs = {**report, "device": {**figures, "fsdp_unit_s:zero2:1000:2": 2e-3, "fsdp_unit_s:zero2:21000:2": 4e-3}}
    square = cluster_over_mesh(pairs, Mesh((2, 2)))
    for axis in (0, 1):
        assert square.link(axis).fsdp_unit_costs == (("zero2", pytest.approx(1.9e-3), pytest.approx(1e7)),)
    assert cluster_from_report(pairs, Mesh((4,))).link(0).fsdp_unit_costs == link.fsdp_unit_costs
    assert cluster_from_report(pairs, Mesh((2, 2))).link(0).fsdp_unit_costs == square.link(0).fsdp_unit_costs
    only_whole = {**pairs, "measurements": rows[:2]}  # no collectives timed on pairs: the axes lend the whole link
    assert all(not link.fsdp_unit_costs for link in cluster_over_mesh(only_whole, Mesh((2, 2))).axis_links)
    older = {**report, "device": {key: value for key, value in figures.items() if not key.startswith("fsdp")}}
    assert cluster_from_report(older, Mesh((4,))).link(0).fsdp_unit_costs == ()
    cluster = cluster_from_report(report, Mesh((4,)))
    assert Cluster.from_dict(json.loads(cluster.to_json())) == cluster
    with pytest.raises(ClusterError, match="fsdp unit costs"):
        replace(link, fsdp_unit_costs=(("zero2", 1e-3, 0.0),))


def test_a_collective_kind_is_priced_on_the_line_through_its_sizes_from_a_mebibyte_up():
    """Version 16: the calibration times collectives up to 32 MiB; each kind's time runs from its smallest message
    (the fixed cost) through every message of 1 MiB or more, so a kind that slows per byte at large sizes (gloo's
    all-gather of a 32 MiB shard between two processes: half the bytes/s of a 2 MiB one) is priced as it ran there,
    and past the largest at the last stretch's rate. The sizes between the smallest and 1 MiB do not bend it."""
    mib = 1 << 20

    def all_gather_s(nbytes):  # 1 GB/s up to 2 MiB, then 0.5 GB/s; a noisy 256 KiB point
        return 1e-4 + min(nbytes, 2 * mib) / 1e9 + max(nbytes - 2 * mib, 0) / 5e8 + (3e-4 if nbytes == 256 * 1024 else 0)

    rows = [{"axis": 0, "group_size": 2, "op": op, "bytes": nbytes, "seconds": seconds(nbytes)}
            for nbytes in (4096, 256 * 1024, 2 * mib, 32 * mib)
            for op, seconds in (("all_gather", all_gather_s), ("all_reduce", lambda b: 2e-4 + b / 2e9))]
    link = fit_link(rows, 2, "pair", reduce_scatter_as_all_reduce=True)
    fixed, bandwidth = link.kind_cost("all_gather")
    assert fixed == pytest.approx(1e-4) and bandwidth == pytest.approx(1e9)
    assert link.kind_rates_beyond == (("all_gather", 2.0 * mib, pytest.approx(5e8)),
                                      ("all_reduce", 2.0 * mib, pytest.approx(2e9)))
    for nbytes in (4096, 2 * mib, 16 * mib, 32 * mib, 77 * mib):  # sent bytes = the shard's, on 2 processes
        assert collective_seconds("all_gather", nbytes, 2, link)[0] == pytest.approx(all_gather_s(nbytes))
    # the all-reduce is a straight line: one rate everywhere; a reduce-scatter not timed takes its time (gloo runs it
    # as one)
    assert collective_seconds("all_reduce", 77 * mib, 2, link)[0] == pytest.approx(2e-4 + 77 * mib / 2e9)
    assert collective_seconds("reduce_scatter", 77 * mib, 2, link) == collective_seconds("all_reduce", 77 * mib, 2, link)
    # a bucketed call pays a share of the fixed cost and all of its bytes
    assert collective_seconds("all_gather", 16 * mib, 2, link, fixed_share=0.5)[0] == pytest.approx(all_gather_s(16 * mib) - 5e-5)
    # timed at small sizes only (a report before version 16): the line through its two ends, nothing beyond
    small = fit_link([row for row in rows if row["bytes"] <= 256 * 1024], 2, "pair", reduce_scatter_as_all_reduce=True)
    assert small.kind_rates_beyond == () and small.kind_cost("all_gather")[0] == pytest.approx(1e-4 - 4096 * 3e-4 / (252 * 1024))
    # a small message timed slower than a larger one below a mebibyte is priced at the larger one's time: a 4 KiB
    # all-gather at 1 ms where 256 KiB took 0.36 ms
    slow = [dict(row, seconds=1e-3) if row["op"] == "all_gather" and row["bytes"] == 4096 else row for row in rows]
    fixed, bandwidth = fit_link(slow, 2, "pair", reduce_scatter_as_all_reduce=True).kind_cost("all_gather")
    assert fixed == pytest.approx(all_gather_s(256 * 1024) - 4096 / bandwidth)
    assert bandwidth == pytest.approx((2 * mib - 4096) / (all_gather_s(2 * mib) - all_gather_s(256 * 1024)))
    assert fit_link(slow, 2, "pair", True).kind_cost("all_reduce") == link.kind_cost("all_reduce")
    assert Link(**json.loads(json.dumps({name: getattr(link, name) for name in link.__dataclass_fields__}))) == link
    with pytest.raises(ClusterError, match="kind rates beyond"):
        replace(link, kind_rates_beyond=(("all_gather", mib, 0.0),))


def test_core_sharing_counts_the_hosts_compute_threads_per_core(monkeypatch):
    torch = pytest.importorskip("torch")
    from metadist.cost.calibrate_worker import core_sharing

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert core_sharing() == pytest.approx(4 * torch.get_num_threads() / cores)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert core_sharing() == pytest.approx(torch.get_num_threads() / cores)


def test_the_sustained_slowdown_keeps_the_fastest_long_stretch_over_the_median_burst():
    """A stretch that met the machine's other work (2 processes: 1.61 from a median of 3 stretches, where the
    calibrations around it measured 0.9-1.06) is not the ranks' own sharing of the cores, which slows every stretch."""
    pytest.importorskip("torch")
    from metadist.cost.calibrate_worker import _slowdown_of

    bursts = [1.0e-6, 1.1e-6, 0.9e-6, 5e-6, 1.0e-6]  # one burst descheduled
    assert _slowdown_of(bursts, [1.6e-6, 1.62e-6, 0.95e-6, 1.7e-6, 0.97e-6]) == pytest.approx(0.95)
    # 4 processes on 2 cores: every stretch shares the cores, and the least of them still does
    assert _slowdown_of(bursts, [1.9e-6, 1.8e-6, 2.6e-6]) == pytest.approx(1.8)
    with pytest.raises(ValueError, match="at least one"):
        _slowdown_of(bursts, [])


def test_an_in_step_wait_is_priced_at_its_samples_mean_less_the_largest_few():
    """Version 33: a step pays the sum of its calls' waits. Bimodal waits (most calls find the partner ready, some find
    it descheduled for a tick) have a median in either mode by chance; their mean holds both."""
    pytest.importorskip("torch")
    from metadist.cost.calibrate_worker import WAIT_TRIM, expected_wait

    fast, slow = [0.3e-3] * 22, [3.5e-3] * 18
    hiccup = [60e-3, 70e-3, 80e-3]  # the largest 5 % of 43, rounded up: a hiccup the step's median leaves out too
    assert WAIT_TRIM == pytest.approx(0.05)
    assert expected_wait(fast + slow + hiccup) == pytest.approx((22 * 0.3e-3 + 18 * 3.5e-3) / 40)
    # the median sits in the fast mode here, and 5 samples more in the slow one move it there
    assert statistics.median(fast + slow) == pytest.approx(0.3e-3)
    assert statistics.median(fast + slow + [3.5e-3] * 5) == pytest.approx(3.5e-3)
    assert expected_wait([1e-3, 2e-3, 9e-3]) == pytest.approx(1.5e-3)  # one of 3 left out
    assert expected_wait([2e-3]) == pytest.approx(2e-3)  # the only sample is kept
    with pytest.raises(ValueError, match="at least one sample"):
        expected_wait([])


def test_fsdp2s_units_are_timed_over_every_group_size_a_mesh_axis_of_the_processes_can_have():
    """Version 27: besides all the processes, each smaller axis size of the calibrated mesh and each other divisor."""
    pytest.importorskip("torch")
    from metadist.cost.calibrate_worker import fsdp_group_sizes

    assert fsdp_group_sizes(2, [2]) == []
    assert fsdp_group_sizes(4, [4]) == fsdp_group_sizes(4, [2, 2]) == [2]
    assert fsdp_group_sizes(8, [8]) == fsdp_group_sizes(8, [2, 4]) == [2, 4]
    assert fsdp_group_sizes(8, [2, 2, 2]) == [2, 4]
    assert fsdp_group_sizes(6, [6]) == [2, 3]


def test_the_calibration_keeps_the_slowest_ranks_figure_of_each_kind():
    """Times and slowdowns: the largest over the ranks; rates: the smallest. Up to version 25 the FSDP2 unit figures
    were taken for rates, so the fastest rank's time priced torch's FSDP2 rows."""
    pytest.importorskip("torch")
    from metadist.cost.calibrate_worker import slower_when_larger

    seconds = ["op_overhead_s", "captured_step_s", "captured_roofline_s", "eager_step_s", "dtensor_op_s",
               "dtensor_module_op_s", "dtensor_collective_s", "sustained_slowdown", "core_sharing", "compute_phase_s", "in_step_collective_s", "in_step_collective_s:2", "in_step_collective_short_s:2",
               "in_step_collective_long_s", "op_element_s:tanh", "fsdp_unit_s:zero2:262144",
               "fsdp_unit_s:zero3:33547264", "fsdp_unit_s:zero2:262144:2"]
    rates = ["peak_flops_per_s", "peak_flops_per_s_bfloat16", "memory_bandwidth_bytes_per_s",
             "matmul_stream_bytes_per_s_float16@nt", "matmul_curve:float32:524288", "elementwise_curve:float32:49152"]
    assert [key for key in seconds if not slower_when_larger(key)] == []
    assert [key for key in rates if slower_when_larger(key)] == []


def _layout_graph():
    """Matmuls whose operands reach them through views: ``t``, ``transpose``, ``permute``, leading-dim views, copies."""
    from metadist.ir import Graph, GraphInput, GraphOutput, Literal, MetaOp, Node, Role, Value, ValueRef

    view = frozenset({"view"})

    def node(name, target, shape, *args, tags=frozenset(), **kwargs):
        return Node(name, MetaOp(target, tags), args, tuple(kwargs.items()), (Value(name, TensorSpec(shape, "bfloat16")),))

    nodes = (
        node("wt", "aten.t.default", (16, 32), ValueRef("w"), tags=view),  # a linear layer's weight, read transposed
        node("fwd", "aten.mm.default", (8, 32), ValueRef("x"), ValueRef("wt")),  # nt
        node("xt", "aten.t.default", (16, 8), ValueRef("x"), tags=view),
        node("wgrad", "aten.mm.default", (16, 32), ValueRef("xt"), ValueRef("fwd")),  # tn
        node("wtt", "aten.t.default", (32, 16), ValueRef("wt"), tags=view),  # transposed twice: row-major again
        node("igrad", "aten.mm.default", (8, 16), ValueRef("fwd"), ValueRef("wtt")),  # nn
        node("yt", "aten.t.default", (8, 32), ValueRef("y"), tags=view),
        node("both", "aten.mm.default", (16, 32), ValueRef("xt"), ValueRef("yt")),  # tt: priced row-major
        # attention's scores: k [2, 4, 8, 16] -> transpose(-2, -1) -> a leading-dim view -> bmm
        node("kt", "aten.transpose.int", (2, 4, 16, 8), ValueRef("k"), -2, -1, tags=view),
        node("kt3", "aten.view.default", (8, 16, 8), ValueRef("kt"), (8, 16, 8), tags=view),
        node("q3", "aten.view.default", (8, 8, 16), ValueRef("k"), (8, 8, 16), tags=view),
        node("scores", "aten.bmm.default", (8, 8, 8), ValueRef("q3"), ValueRef("kt3")),  # nt
        # a head permutation keeps the last dim last; a contiguous copy of a transposed view is row-major
        node("heads", "aten.permute.default", (2, 8, 4, 16), ValueRef("k"), (0, 2, 1, 3), tags=view),
        node("kc", "aten.clone.default", (2, 4, 16, 8), ValueRef("kt"), memory_format=Literal("memory_format", "contiguous_format")),
        node("kp", "aten.clone.default", (2, 4, 16, 8), ValueRef("kt")),  # preserve_format: still transposed
        node("perm", "aten.permute.default", (2, 4, 16, 8), ValueRef("k"), (0, 1, 3, 2), tags=view),
        node("odd", "aten.permute.default", (2, 16, 8, 4), ValueRef("k"), (0, 3, 2, 1), tags=view),
    )
    inputs = (GraphInput(Value("x", TensorSpec((8, 16), "bfloat16")), Role.BATCH),
              GraphInput(Value("w", TensorSpec((32, 16), "bfloat16")), Role.PARAM, "w"),
              GraphInput(Value("y", TensorSpec((32, 8), "bfloat16")), Role.BATCH),
              GraphInput(Value("k", TensorSpec((2, 4, 8, 16), "bfloat16")), Role.BATCH))
    return Graph(inputs, nodes, (GraphOutput("wgrad", Role.LOSS),), name="layouts")


def test_a_matmul_knows_which_operand_reaches_it_transposed():
    from metadist.cost.compute import _transposed, matmul_layout

    graph = _layout_graph()
    layouts = {name: node_work(graph, graph.node(name)).layout for name in ("fwd", "wgrad", "igrad", "both", "scores")}
    assert layouts == {"fwd": "nt", "wgrad": "tn", "igrad": "", "both": "", "scores": "nt"}
    assert [_transposed(graph, name) for name in ("x", "wt", "wtt", "kt", "kt3", "heads", "kc", "kp", "perm", "odd")] == \
        [False, True, False, True, True, False, False, True, True, False]
    assert matmul_layout(graph, "x", "x") == "" and node_work(graph, graph.node("kt")).layout == ""  # a view: no work


def test_a_low_precision_matmul_is_priced_on_the_curve_of_its_layout():
    """A CPU's bfloat16 kernels run a transposed operand several times faster than row-major by row-major: a device
    with a curve (and a stream rate) measured in the matmul's layout prices it there; without one, row-major's."""
    from metadist.cost.cluster import Device

    device = Device(peak_flops_per_s=6e10, memory_bandwidth_bytes_per_s=2e10, memory_capacity_bytes=1e9,
                    matmul_curves={"bfloat16": [(1e6, 1e9), (1e8, 1.3e9)], "bfloat16@nt": [(1e6, 4e9), (1e8, 6e9)],
                                   "bfloat16@tn": [(1e6, 1.5e10), (1e8, 1.8e10)]},
                    matmul_stream_bytes_per_s_by_dtype={"bfloat16": 3e7, "bfloat16@nt": 1e9})
    assert device.flops_per_s("bfloat16", 1e8) == 1.3e9 and device.flops_per_s("bfloat16", 1e8, "") == 1.3e9
    assert device.flops_per_s("bfloat16", 1e8, "nt") == 6e9 and device.flops_per_s("bfloat16", 1e6, "tn") == 1.5e10
    assert device.flops_per_s("float32", 1e8, "nt") == 6e10  # no float32 curve at all: its peak
    assert device.matmul_stream_s("bfloat16", 3e7) == pytest.approx(1.0)
    assert device.matmul_stream_s("bfloat16", 3e7, "nt") == pytest.approx(0.03)
    assert device.matmul_stream_s("bfloat16", 3e7, "tn") == pytest.approx(1.0)  # not measured in tn: row-major's
    graph = _layout_graph()
    mesh = Mesh((1,))
    device = replace(device, matmul_stream_bytes_per_s_by_dtype=())  # these tiny matmuls' price: their FLOPs
    seconds = {}
    for name in ("fwd", "wgrad", "igrad"):
        node = graph.node(name)
        work = node_work(graph, node)
        specs = [graph.value(value).spec for value in node.input_names]
        replicated = NodeStrategy(choices=(AxisChoice("replicate"),), inputs=tuple((Replicate(),) for _ in specs),
                                  outputs=((Replicate(),),))
        seconds[name] = compute_seconds(work, specs, [node.outputs[0].spec], replicated, mesh, device) / work.flops
    # per FLOP: the weight's gradient (tn) cheapest, the input's (row-major) dearest
    assert seconds["wgrad"] < seconds["fwd"] < seconds["igrad"]


def test_a_transposed_copy_is_priced_per_element_and_an_allocation_writes_nothing():
    """A copy of a transposed view into a row-major tensor (``.contiguous()``, a gradient laid out as its weight) reads
    across rows: priced at the device's measured seconds per element of a relayout (calibration version 24); a copy
    that keeps the layout at its bytes; an allocation at the fixed cost of an op alone, whatever its size."""
    from metadist.cost.cluster import Device
    from metadist.cost.compute import RELAYOUT
    from metadist.ir import GraphInput, Graph, MetaOp, Node, Role, Value, ValueRef

    graph = _layout_graph()
    device = Device(peak_flops_per_s=1e12, memory_bandwidth_bytes_per_s=1e12, memory_capacity_bytes=1e9,
                    op_overhead_s=1e-6, op_element_seconds={RELAYOUT: 1e-9, "tanh": 5e-9})
    mesh = Mesh((1,))

    def seconds(graph, name):
        node = graph.node(name)
        specs = [graph.value(value).spec for value in node.input_names]
        replicated = NodeStrategy(choices=(AxisChoice("replicate"),), inputs=tuple((Replicate(),) for _ in specs),
                                  outputs=((Replicate(),),))
        return compute_seconds(node_work(graph, node), specs, [node.outputs[0].spec], replicated, mesh, device)

    elements = 2 * 4 * 16 * 8
    assert node_work(graph, graph.node("kc")).relayout and not node_work(graph, graph.node("kp")).relayout
    assert seconds(graph, "kc") == pytest.approx(1e-6 + elements * 1e-9)
    assert seconds(graph, "kp") == pytest.approx(1e-6 + 2 * elements * 2 / 1e12)  # its bytes in and out
    empty = Node("fresh", MetaOp("aten.new_empty_strided.default"), (ValueRef("x"), (4096, 4096), (4096, 1)), (),
                 (Value("fresh", TensorSpec((4096, 4096), "float32")),))
    alloc = Graph(inputs=(GraphInput(Value("x", TensorSpec((8, 16), "float32")), Role.BATCH),), nodes=(empty,),
                  outputs=())
    assert node_work(alloc, empty).allocates
    assert seconds(alloc, "fresh") == pytest.approx(1e-6)  # 64 MiB allocated, none of it written


def test_a_skinny_matmul_takes_its_large_operand_at_the_stream_rate():
    from metadist.cost.cluster import Device

    graph, _ = mlp_step(8, 4096, 4096, layers=1)
    node = graph.node("mm_0")  # [8, 4096] @ [4096, 4096]
    work = node_work(graph, node)
    assert work.operands == (0, 1)
    plain = Device(peak_flops_per_s=1e11, memory_bandwidth_bytes_per_s=2e10, memory_capacity_bytes=1e9)
    streaming = Device(peak_flops_per_s=1e11, memory_bandwidth_bytes_per_s=2e10, memory_capacity_bytes=1e9,
                       matmul_stream_bytes_per_s_by_dtype={"float32": 2e9})
    mesh = Mesh((2,))
    specs = [graph.value(name).spec for name in node.input_names]
    outs = [node.outputs[0].spec]
    from test_solver_helpers import RULES
    from metadist.ir import parse_rule

    rule = parse_rule(RULES["mm"])
    replicated = strategy_from_choices(rule, (AxisChoice("replicate"),))
    weight = 4096 * 4096 * 4
    roofline = max(work.flops / 1e11, (8 * 4096 * 2 * 4 + weight) / 2e10)
    assert compute_seconds(work, specs, outs, replicated, mesh, plain) == pytest.approx(roofline)
    assert compute_seconds(work, specs, outs, replicated, mesh, streaming) == pytest.approx(weight / 2e9)  # 10x more
    # split on the weight's columns, each rank passes over its half of it
    cols = strategy_from_choices(rule, (AxisChoice("factor", 2),))
    assert compute_seconds(work, specs, outs, cols, mesh, streaming) == pytest.approx(weight / 2 / 2e9)
    # a square matmul of the same operand is priced by its FLOPs; a dtype without a stream rate has no floor
    square, _ = mlp_step(4096, 4096, 4096, layers=1)
    big = square.node("mm_0")
    big_specs = [square.value(name).spec for name in big.input_names]
    assert compute_seconds(node_work(square, big), big_specs, [big.outputs[0].spec], replicated, mesh, streaming) == \
        pytest.approx(2 * 4096**3 / 1e11)
    assert streaming.matmul_stream_s("bfloat16", weight) == 0.0
    assert Device(**{name: getattr(streaming, name) for name in streaming.__dataclass_fields__}) == streaming
    with pytest.raises(ClusterError, match="positive"):
        Device(peak_flops_per_s=1e11, memory_bandwidth_bytes_per_s=2e10, memory_capacity_bytes=1e9,
               matmul_stream_bytes_per_s_by_dtype={"float32": 0.0})


def test_liveness_categories_and_peaks():
    graph, _ = mlp_step(256, 64, 128, layers=2)
    lives = liveness(graph)
    by_name = {life.name: life for life in lives.values}
    assert by_name["layers.0.w1"].category == "param" and by_name["layers.0.w1:momentum"].category == "optim_state"
    assert by_name["mm_0"].category == "activation"  # kept for the backward pass
    assert by_name["mm_0"].end > by_name["sum_6"].start
    grads = [life for life in lives.values if life.category == "grad"]
    assert len(grads) == 4  # one gradient per weight, read by the momentum update
    assert lives.peaks and max(lives.replicated_bytes_at_peaks) > 0


def test_gloo_reduce_scatter_is_priced_by_its_own_measurements_with_the_all_reduce_bytes():
    """gloo runs a reduce-scatter as an all-reduce of a copy of its input, then copies its piece out: on this project's
    machine it took 1.2-1.4x the all-reduce's time at 32 MiB (2 and 4 processes), 3x at 1 MiB. Timed, it is priced on
    its own line; its bytes stay the all-reduce's; a link without its line prices it as the all-reduce."""
    mib = 1 << 20

    def all_reduce_s(nbytes):
        return 3e-4 + nbytes / 1.4e9

    def reduce_scatter_s(nbytes):  # the all-reduce plus a copy of the input at 3 GB/s
        return 4e-4 + nbytes / 1.4e9 + nbytes / 3e9

    rows = [{"axis": 0, "group_size": 2, "op": op, "bytes": nbytes, "seconds": seconds(nbytes)}
            for nbytes in (4096, 2 * mib, 32 * mib)
            for op, seconds in (("all_reduce", all_reduce_s), ("reduce_scatter", reduce_scatter_s))]
    link = fit_link(rows, 2, "pair", reduce_scatter_as_all_reduce=True)
    for nbytes in (4096, 2 * mib, 32 * mib, 64 * mib):
        rs_seconds, rs_sent = collective_seconds("reduce_scatter", nbytes, 2, link)
        ar_seconds, ar_sent = collective_seconds("all_reduce", nbytes, 2, link)
        assert rs_seconds == pytest.approx(reduce_scatter_s(nbytes)) and ar_seconds == pytest.approx(all_reduce_s(nbytes))
        assert rs_sent == ar_sent == nbytes  # 2 (n-1)/n of the buffer on 2 processes: the all-reduce gloo runs
    # the rows of a faster reduce-scatter do not make the all-reduce faster (each kind keeps its own line)
    fast = [dict(row, seconds=row["seconds"] / 2) if row["op"] == "reduce_scatter" else row for row in rows]
    assert collective_seconds("all_reduce", 32 * mib, 2, fit_link(fast, 2, "pair", True))[0] == pytest.approx(all_reduce_s(32 * mib))
    untimed = fit_link([row for row in rows if row["op"] == "all_reduce"], 2, "pair", reduce_scatter_as_all_reduce=True)
    assert collective_seconds("reduce_scatter", 32 * mib, 2, untimed) == collective_seconds("all_reduce", 32 * mib, 2, untimed)


def _collective_rows(alpha: float, bandwidth: float, overhead: float, n: int, reduce_scatter_as_all_reduce: bool) -> list[dict]:
    """Synthetic calibration rows of a ring backend (one that runs reduce-scatter as an all-reduce, as gloo does)."""
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        wire = "all_reduce" if op == "reduce_scatter" and reduce_scatter_as_all_reduce else op
        for nbytes in (4096, 65536, 1 << 20, 1 << 22):
            steps = (2 if wire == "all_reduce" else 1) * (n - 1)
            sent = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1}.get(wire, (n - 1) / n) * nbytes
            rows.append({"axis": 0, "op": op, "bytes": nbytes, "seconds": overhead + steps * alpha + sent / bandwidth})
    return rows


def test_fit_link_recovers_alpha_and_beta():
    truth_alpha, truth_bandwidth = 20e-6, 1e9
    link = fit_link(_collective_rows(truth_alpha, truth_bandwidth, 0.0, 4, False), 4, "test")
    assert link.bandwidth_bytes_per_s == pytest.approx(truth_bandwidth, rel=1e-3)
    assert link.latency_s + link.call_overhead_s / 3 == pytest.approx(truth_alpha, rel=0.2)
    assert not link.reduce_scatter_as_all_reduce


def test_gloo_fit_prices_reduce_scatter_as_all_reduce():
    rows = _collective_rows(20e-6, 1e9, 300e-6, 4, True)
    report = {"backend": "gloo", "measurements": rows, "memory_capacity_bytes": 1e9,
              "device": {"peak_flops_per_s": 1e11, "memory_bandwidth_bytes_per_s": 1e10, "op_overhead_s": 5e-6}}
    cluster = cluster_from_report(report, Mesh((4,)))
    link = cluster.link(0)
    assert link.reduce_scatter_as_all_reduce and link.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-3)
    assert cluster.device.op_overhead_s == 5e-6
    # the fitted model prices each measured collective as measured, reduce-scatters included
    for row in rows:
        seconds, _ = collective_seconds(row["op"], row["bytes"], 4, link)
        assert seconds == pytest.approx(row["seconds"], rel=1e-3)
    rs_seconds, rs_bytes = collective_seconds("reduce_scatter", 1 << 20, 4, link)
    ar_seconds, ar_bytes = collective_seconds("all_reduce", 1 << 20, 4, link)
    assert (rs_seconds, rs_bytes) == (ar_seconds, ar_bytes) == (pytest.approx(ar_seconds), 1.5 * (1 << 20))
    # a backend with a true ring reduce-scatter sends half that
    ring = Link(bandwidth_bytes_per_s=1e9, latency_s=0.0)
    assert collective_seconds("reduce_scatter", 1 << 20, 4, ring)[1] == 0.75 * (1 << 20)


def test_cost_solver_and_pipeline_planning_import_no_framework():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'jax'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import metadist.cost, metadist.solver, metadist.cost.calibrate\n"
        "import metadist.solver.pipeline, metadist.ir.pipeline, metadist.ir.stage_graphs\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.distributed
def test_where_ranks_share_cores_one_rank_measures_the_compute_figures_alone_and_every_rank_gets_them(tmp_path):
    """Calibration version 23: rank 0 runs the compute figures' measurement while the other ranks wait in the
    broadcast that then hands them its figures; a figure that asks every rank (``_any_rank``) answers for rank 0
    alone then, with no collective the waiting ranks would never join."""
    script = tmp_path / "alone.py"
    script.write_text(
        "import datetime, torch, torch.distributed as dist\n"
        "from metadist.cost import calibrate_worker as worker\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))\n"
        "seen = []\n"
        "def measured(device):\n"
        "    seen.append(worker._MEASURING_ALONE)\n"
        "    stop = worker._any_rank(True, device)\n"
        "    return {'peak_flops_per_s': 100.0 + dist.get_rank(), 'op_overhead_s': 1e-6, 'stopped': float(stop)}\n"
        "worker._roofline = measured\n"
        "figures = worker._roofline_alone(torch.device('cpu'))\n"
        "assert figures == {'peak_flops_per_s': 100.0, 'op_overhead_s': 1e-6, 'stopped': 1.0}, figures\n"
        "assert seen == ([True] if dist.get_rank() == 0 else []), seen\n"
        "assert not worker._MEASURING_ALONE\n"
        "assert worker._any_rank(dist.get_rank() == 1, torch.device('cpu'))  # together again: rank 1's flag reaches 0\n"
        "dist.barrier()\n"
        f"open({str(tmp_path)!r} + f'/ok{{dist.get_rank()}}', 'w').close()\n"
        # torn down together: a rank that exits holding its gloo group may abort when its peer closes first
        "dist.barrier()\n"
        "dist.destroy_process_group()\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(path.name for path in tmp_path.glob("ok*")) == ["ok0", "ok1"]  # every rank got through


@pytest.mark.distributed
def test_calibrate_measures_gloo_on_two_processes():
    from metadist.cost.calibrate import calibrate

    cluster, report = calibrate(2, Mesh((2,)), sizes="4096,262144")
    assert report["backend"] == "gloo" and report["world_size"] == 2
    assert {m["op"] for m in report["measurements"]} >= {"all_reduce", "all_gather"}
    assert cluster.link(0).bandwidth_bytes_per_s > 0
    json.loads(cluster.to_json())
    # matmuls and elementwise work measured in each narrow dtype too, as the cluster prices them
    device = cluster.device
    # every rate as measured, over how much slower the processes computed over a long stretch (at least 1; version 6)
    slowdown = device.sustained_slowdown
    assert slowdown == max(1.0, report["device"]["sustained_slowdown"], report["device"]["core_sharing"])
    assert report["device"]["core_sharing"] > 0
    # an op on a sharded DTensor costs more than on a plain tensor (version 13), priced at the slowdown
    assert report["device"]["dtensor_op_s"] > 0
    assert device.dtensor_op_overhead_s == pytest.approx(report["device"]["dtensor_op_s"] * slowdown)
    # an op of a parallel linear costs more than an elementwise one on a DTensor (version 32)
    assert report["device"]["dtensor_module_op_s"] > report["device"]["dtensor_op_s"]
    assert device.dtensor_module_op_overhead_s == pytest.approx(report["device"]["dtensor_module_op_s"] * slowdown)
    # an all-reduce torch's TP issues through DTensor costs the calling thread more than a plain one (version 34)
    assert report["device"]["dtensor_collective_s"] > 0
    assert device.dtensor_collective_overhead_s == pytest.approx(report["device"]["dtensor_collective_s"] * slowdown)
    # what torch's FSDP2 adds per unit, at two sizes (version 14), on the link of all the processes
    from metadist.cost.calibrate_worker import FSDP_UNIT_BYTES

    timed = [key.split(":")[1:] for key in report["device"] if key.startswith("fsdp_unit_s:")]
    assert sorted(variant for variant, _ in timed) == ["zero2", "zero2", "zero3", "zero3"]
    for variant in ("zero2", "zero3"):  # square units of about each size (widths the ranks divide)
        sizes = sorted(int(nbytes) for name, nbytes in timed if name == variant)
        assert all(abs(size - wanted) <= 0.01 * wanted for size, wanted in zip(sizes, FSDP_UNIT_BYTES))
    assert {variant for variant, _, _ in cluster.link(0).fsdp_unit_costs} == {"zero2", "zero3"}
    for dtype in ("bfloat16", "float16"):
        assert device.flops_per_s(dtype) == pytest.approx(report["device"][f"peak_flops_per_s_{dtype}"] / slowdown)
        assert device.bandwidth_bytes_per_s(dtype) == pytest.approx(report["device"][f"memory_bandwidth_bytes_per_s_{dtype}"] / slowdown)
        assert device.flops_per_s(dtype) > 0 and device.bandwidth_bytes_per_s(dtype) > 0
    assert Cluster.from_dict(json.loads(cluster.to_json())) == cluster
    # the in-step all-reduce after a long compute phase too, where each rank has a core (version 21)
    long_phase = {"compute_phase_long_s", "in_step_collective_long_s"}
    if report["device"]["core_sharing"] <= 1:
        assert long_phase <= set(report["device"]) and report["device"]["compute_phase_long_s"] > report["device"]["compute_phase_s"]
    else:
        assert not long_phase & set(report["device"])
    # a curve per dtype, every point measured; the narrow dtypes' matmuls also in either transposed layout (version 10)
    layouts = {"bfloat16@nt", "bfloat16@tn", "float16@nt", "float16@tn"}
    for kind, names in ((device.matmul_curves, layouts), (device.elementwise_curves, set())):
        assert {dtype for dtype, _ in kind} == {"float32", "bfloat16", "float16"} | names
        assert all(len(points) >= 1 and all(rate > 0 for _, rate in points) for _, points in kind)
    # and the rate a few-row matmul passes over its large operand, per dtype (version 4) and narrow layout (10)
    assert {dtype for dtype, _ in device.matmul_stream_bytes_per_s_by_dtype} == {"float32", "bfloat16", "float16"} | layouts
    assert device.matmul_stream_s("float32", 1.0) == pytest.approx(slowdown / report["device"]["matmul_stream_bytes_per_s"])
    # and the seconds per element of the ops that compute more than they move (version 5), and of a relayout (24)
    from metadist.cost.calibrate_worker import _element_ops
    from metadist.cost.compute import RELAYOUT
    import torch

    # each in bfloat16 and float16 too (version 30); the relayout in float32 only
    ops = set(_element_ops(torch.device("cpu")))
    assert {op for op, _ in device.op_element_seconds} == (
        ops | {RELAYOUT} | {f"{op}@{dtype}" for op in ops for dtype in ("bfloat16", "float16")})
    assert all(seconds > 0 for _, seconds in device.op_element_seconds)
    assert device.element_seconds("tanh") == pytest.approx(slowdown * report["device"]["op_element_s:tanh"])
    assert device.element_seconds("tanh", "bfloat16") == pytest.approx(
        slowdown * report["device"]["op_element_s:tanh@bfloat16"])


# ---------------------------------------------------------------- bucketed collectives


def _train_step_graph():
    """x -> f0 = x*p0 -> loss; backward: d shared by both gradients, g1 and g0 per parameter; then p - g."""
    from metadist.ir import Graph, GraphInput, GraphOutput, MetaOp, Node, Role, TensorSpec, Value, ValueRef

    f32 = TensorSpec((64,), "float32")
    mul = MetaOp("aten.mul.Tensor")

    def node(name, op, *args):
        return Node(name, op, args, (), (Value(name, f32),))

    nodes = (
        node("f0", mul, ValueRef("x"), ValueRef("p0")),
        Node("loss", MetaOp("aten.sum.default"), (ValueRef("f0"),), (), (Value("loss", TensorSpec((), "float32")),)),
        node("d", mul, ValueRef("f0"), ValueRef("p1")),  # reads p1 but feeds both gradients: backward
        node("g1", mul, ValueRef("d"), 2.0),
        node("g0", mul, ValueRef("d"), ValueRef("x")),
        node("q0", MetaOp("aten.sub.Tensor"), ValueRef("p0"), ValueRef("g0")),
        node("q1", MetaOp("aten.sub.Tensor"), ValueRef("p1"), ValueRef("g1")),
    )
    inputs = (GraphInput(Value("x", f32), Role.BATCH), GraphInput(Value("p0", f32), Role.PARAM, "p0"),
              GraphInput(Value("p1", f32), Role.PARAM, "p1"))
    outputs = (GraphOutput("loss", Role.LOSS), GraphOutput("q0", Role.PARAM, replaces="p0", source="p0"),
               GraphOutput("q1", Role.PARAM, replaces="p1", source="p1"))
    return Graph(inputs, nodes, outputs, name="toy")


def test_bucketing_finds_the_update_phase_and_shares_the_fixed_cost():
    from metadist.cost import NO_BUCKETING, OUTPUT_CONSUMER, bucketing_for
    from metadist.cost.bucketing import LONE_OUTPUT_SHARE

    graph = _train_step_graph()
    bucketing = bucketing_for(graph)
    assert bucketing.update_start == 5, "the first node that reads a parameter and feeds its own update only"
    assert bucketing.edges == {("p0", "q0"), ("g0", "q0"), ("p1", "q1"), ("g1", "q1")}
    # 4 values on bucketed edges, plus the 2 graph outputs that replace a parameter, in one bucket
    assert bucketing.fixed_share == pytest.approx(1 / 6)
    assert bucketing.share("g0", "q0") == bucketing.share("q0", OUTPUT_CONSUMER) == pytest.approx(1 / 6)
    # the loss replaces nothing: it may be alone in its call, and pays one, less a hundredth
    assert bucketing.lone_outputs == {"loss"} and bucketing.share("loss", OUTPUT_CONSUMER) == LONE_OUTPUT_SHARE == 0.99
    assert bucketing.share("f0", "d") == bucketing.share("d", "g0") == 1.0
    # a cap that holds one value per bucket: no sharing; cap 0: coalescing off
    assert bucketing_for(graph, cap_bytes=256).fixed_share == 1.0
    assert bucketing_for(graph, cap_bytes=0) == NO_BUCKETING


def test_a_bucketed_collective_pays_its_bandwidth_and_a_share_of_its_fixed_cost():
    link = Link(bandwidth_bytes_per_s=1e9, latency_s=1e-4, call_overhead_s=5e-4)
    alone, sent = collective_seconds("all_reduce", 4e6, 4, link)
    shared, shared_sent = collective_seconds("all_reduce", 4e6, 4, link, fixed_share=0.25)
    assert sent == shared_sent
    fixed = 5e-4 + 6 * 1e-4
    assert alone == pytest.approx(fixed + sent / 1e9)
    assert shared == pytest.approx(0.25 * fixed + sent / 1e9)
    # all-to-alls are never coalesced
    assert collective_seconds("all_to_all", 4e6, 4, link, fixed_share=0.25) == collective_seconds("all_to_all", 4e6, 4, link)


def test_data_parallel_estimate_prices_gradient_reductions_as_buckets():
    """The same DP assignment: with bucketing the gradient all-reduces share one fixed cost, as DDP's buckets do."""
    from metadist.cost import NO_BUCKETING, bucketing_for, cluster_for, liveness
    from metadist.ir import Mesh, Partial, Replicate, Shard
    from metadist.ir.plan import AxisChoice, NodeStrategy
    from metadist.solver.estimate import Assignment, estimate

    graph = _train_step_graph()
    cluster = cluster_for("cpu-gloo", Mesh((4,)))
    factor, r, s0, p = (AxisChoice("factor", 0),), (Replicate(),), (Shard(0),), (Partial("sum"),)
    strategies = {"f0": NodeStrategy(factor, (s0, r), (s0,)), "loss": NodeStrategy(factor, (s0,), (p,)),
                  "d": NodeStrategy(factor, (s0, r), (s0,)), "g1": NodeStrategy(factor, (s0,), (s0,)),
                  "g0": NodeStrategy(factor, (s0, s0), (p,)), "q0": NodeStrategy(factor, (r, r), (r,)),
                  "q1": NodeStrategy(factor, (r, r), (r,))}
    assignment = Assignment(strategies, {"x": s0, "p0": r, "p1": r})
    lives = liveness(graph)
    bucketed = estimate(graph, assignment, cluster, lives, bucketing_for(graph))
    alone = estimate(graph, assignment, cluster, lives, NO_BUCKETING)
    assert bucketed["comm_bytes_by_axis"] == alone["comm_bytes_by_axis"]
    assert bucketed["collectives_by_kind"] == alone["collectives_by_kind"] == {"all_gather": 1, "all_reduce": 2}
    link = cluster.link(0)
    fixed_all_reduce = link.call_overhead_s + 6 * link.latency_s
    fixed_gather = link.call_overhead_s + 3 * link.latency_s
    # g0's all-reduce is bucketed (share 1/6), and g1's gather (read by q1, made before the update) too; the loss's
    # all-reduce, an output that replaces nothing, pays 0.99 of a call: the shares the search prices
    shares = (1 / 6) * (fixed_all_reduce + fixed_gather) + 0.99 * fixed_all_reduce
    # the calls they make: the loss's all-reduce joins the gradient's (same kind, axis, op, dtype), the gather its own
    assert bucketed["coalesced_s"] == pytest.approx(fixed_all_reduce + fixed_gather - shares)
    assert alone["coalesced_s"] == 0.0
    assert alone["comm_s"] - bucketed["comm_s"] == pytest.approx(fixed_all_reduce)
