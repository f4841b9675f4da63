"""The runtime's own costs in the cost model: per-node cost from a captured step, a collective's in-step cost
(``Link.sync_s``), torch DDP priced as it runs, and the calibration cache's versions."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from metadist.cost import cluster_for
from metadist.cost.calibrate import (
    CALIBRATION_FORMAT, IN_STEP_COLLECTIVE_BYTES, calibration_path, cluster_from_report, collective_sync_s, eager_op_overhead,
    load_calibration, runtime_op_overhead,
)
from metadist.cost.cluster import ClusterError, Link
from metadist.cost.comm import collective_seconds
from metadist.cost.memory import liveness
from metadist.ir import Mesh
from metadist.solver import baseline_plan, plan_graph
from metadist.solver.baselines import dtensor_seconds, fsdp_unit_bytes, torch_ddp_estimate, torch_fsdp_estimate, torch_tp_estimate
from test_solver_helpers import mlp_step


def _figures(**extra) -> dict:
    return {"peak_flops_per_s": 1e11, "memory_bandwidth_bytes_per_s": 1e10, "op_overhead_s": 5e-6, **extra}


def test_per_node_costs_come_from_the_timed_captured_and_eager_steps():
    # 200 nodes whose rooflines sum to 1 ms: a 7 ms captured step costs 30 us a node, a 3 ms eager one 10 us
    figures = _figures(captured_step_s=7e-3, captured_nodes=200.0, captured_roofline_s=1e-3, eager_step_s=3e-3)
    assert runtime_op_overhead(figures) == pytest.approx(30e-6)
    assert eager_op_overhead(figures) == pytest.approx(10e-6)
    # an older report (no captured step) keeps the chain of tiny ops' figure; no eager figure is 0 (not measured)
    assert runtime_op_overhead(_figures()) == 5e-6 and eager_op_overhead(_figures()) == 0.0
    # a step faster than its rooflines is no negative cost
    assert runtime_op_overhead(_figures(captured_step_s=1e-4, captured_nodes=10.0, captured_roofline_s=1e-3)) == 0.0
    with pytest.raises(ClusterError, match="metadist calibrate"):
        runtime_op_overhead(_figures(captured_step_s=1e-3, captured_nodes=0.0, captured_roofline_s=0.0))


def test_sync_cost_is_the_in_step_collective_less_its_isolated_price():
    link = Link(bandwidth_bytes_per_s=1e9, latency_s=50e-6, call_overhead_s=100e-6, reduce_scatter_as_all_reduce=True)
    isolated, _ = collective_seconds("all_reduce", IN_STEP_COLLECTIVE_BYTES, 2, link)
    assert collective_sync_s(isolated + 700e-6, link, 2) == pytest.approx(700e-6)
    assert collective_sync_s(isolated / 2, link, 2) == 0.0  # never negative
    assert collective_sync_s(None, link, 2) == 0.0 and collective_sync_s(1.0, link, 1) == 0.0
    # the report's figures reach the cluster: every link carries its sync cost, the device both per-node costs
    report = {"backend": "gloo", "memory_capacity_bytes": 1e9,
              "measurements": [{"axis": 0, "op": "all_reduce", "bytes": b, "seconds": 1e-4 + b / 1e9} for b in (4096, 1 << 20)],
              "device": _figures(captured_step_s=7e-3, captured_nodes=200.0, captured_roofline_s=1e-3, eager_step_s=3e-3,
                                 in_step_collective_s=2e-3)}
    cluster = cluster_from_report(report, Mesh((2,)))
    assert cluster.device.op_overhead_s == pytest.approx(30e-6) and cluster.device.eager_op_overhead_s == pytest.approx(10e-6)
    fitted, _ = collective_seconds("all_reduce", IN_STEP_COLLECTIVE_BYTES, 2, replace(cluster.link(0), sync_s=0.0))
    assert cluster.link(0).sync_s == pytest.approx(2e-3 - fitted)


def test_every_collective_pays_the_sync_cost_per_call_and_a_bucket_its_share():
    link = Link(bandwidth_bytes_per_s=1e9, latency_s=10e-6, call_overhead_s=100e-6)
    synced = replace(link, sync_s=1e-3)
    for kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
        plain, sent = collective_seconds(kind, 1 << 16, 4, link)
        assert collective_seconds(kind, 1 << 16, 4, synced) == (pytest.approx(plain + 1e-3), sent)
    bucketed = collective_seconds("all_reduce", 1 << 16, 4, synced, fixed_share=0.25)[0]
    assert bucketed == pytest.approx(collective_seconds("all_reduce", 1 << 16, 4, link, fixed_share=0.25)[0] + 0.25e-3)
    measured = replace(synced, kind_costs=(("all_gather", 300e-6, 2e8),))  # a per-kind measured cost pays it too
    assert collective_seconds("all_gather", 1 << 16, 4, measured)[0] == pytest.approx(300e-6 + 1e-3 + 3 * (1 << 16) / 2e8)
    with pytest.raises(ClusterError):
        replace(link, sync_s=-1.0)


def _synced(preset: str, mesh: Mesh, sync_s: float, op_overhead_s: float = 0.0):
    cluster = cluster_for(preset, mesh)
    return replace(cluster, device=replace(cluster.device, op_overhead_s=op_overhead_s),
                   axis_links=tuple(replace(link, sync_s=sync_s) for link in cluster.axis_links))


def test_the_ilp_objective_equals_the_estimate_with_the_sync_cost_and_avoids_what_it_prices():
    graph, rules = mlp_step(64, 32, 64, layers=2)
    cluster = _synced("cpu-gloo", Mesh((2,)), sync_s=2e-3, op_overhead_s=20e-6)
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))
    assert plan.solver["objective_s"] == pytest.approx(plan.estimate["step_s"], rel=1e-6)
    # the sync cost moves the plan: with it, this small step makes no more collective calls than without it
    free = plan_graph(graph, rules, _synced("cpu-gloo", Mesh((2,)), sync_s=0.0, op_overhead_s=20e-6), memory_budget_bytes=float("inf"))
    calls = sum(plan.estimate["collectives_by_kind"].values())
    assert calls <= sum(free.estimate["collectives_by_kind"].values())
    assert plan.estimate["comm_s"] >= 0 and plan.estimate["step_s"] > free.estimate["step_s"] - 1e-12


def test_torch_ddp_is_priced_as_eager_compute_and_one_all_reduce_per_bucket():
    from metadist.cost.compute import copy_seconds

    graph, rules = mlp_step(64, 32, 64, layers=2)
    cluster = _synced("cpu-gloo", Mesh((2,)), sync_s=1e-3, op_overhead_s=30e-6)
    cluster = replace(cluster, device=replace(cluster.device, eager_op_overhead_s=10e-6))
    dp = baseline_plan(graph, rules, cluster, "dp").estimate
    grads = sum(item.value.spec.nbytes for item in graph.inputs if item.role.value == "param")
    priced = torch_ddp_estimate(graph, cluster, dp)
    one, sent = collective_seconds("all_reduce", grads, 2, cluster.link(0))
    assert priced["collectives_by_kind"] == {"all_reduce": 1} and priced["comm_s"] == pytest.approx(one)
    assert priced["compute_s"] == pytest.approx(dp["compute_s"] - len(graph.nodes) * 20e-6)
    # each gradient copied into its bucket (divided as it goes) and the reduced bucket copied back
    copies = 2 * copy_seconds(cluster.device, "float32", grads / 4)
    assert priced["copy_s"] == pytest.approx(copies) and copies > 2 * cluster.device.op_overhead_s
    assert priced["step_s"] == pytest.approx(priced["compute_s"] + one + copies)
    assert sum(priced["comm_bytes_by_axis"].values()) == pytest.approx(sent)
    # buckets of a cap the user gave: each closed once it holds the cap, a parameter never split (4 of 8 KiB here)
    assert torch_ddp_estimate(graph, cluster, dp, bucket_cap_bytes=grads / 3)["collectives_by_kind"] == {"all_reduce": 2}
    assert torch_ddp_estimate(graph, cluster, dp, bucket_cap_bytes=grads / 8)["collectives_by_kind"] == {"all_reduce": 4}


def test_torch_ddp_buckets_start_with_torchs_first_bucket_of_one_mib_and_never_split_a_parameter():
    """From its second step DDP reduces in buckets rebuilt in the gradients' ready order (the last parameter's first):
    with the default cap, a first bucket of 1 MiB (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``) then 25 MiB ones,
    each closed once it holds its limit. bert-tiny's 2.2 MiB of gradients made 2 calls on the bench, where one was
    priced; gpt2-small's 13, where ceil(bytes / cap) priced 19."""
    from metadist.solver.baselines import DDP_FIRST_BUCKET_BYTES, ddp_buckets

    mib = 1024.0 * 1024.0
    assert DDP_FIRST_BUCKET_BYTES == mib
    assert ddp_buckets([0.5 * mib, 0.7 * mib, 0.6 * mib], 25 * mib, mib) == pytest.approx([1.3 * mib, 0.5 * mib])
    assert ddp_buckets([147 * mib] + [9 * mib] * 8, 25 * mib, mib) == [9 * mib, 27 * mib, 27 * mib, 9 * mib + 147 * mib]
    assert ddp_buckets([0.1 * mib], 25 * mib, mib) == [0.1 * mib] and ddp_buckets([], 25 * mib, mib) == []
    graph, rules = mlp_step(64, 512, 512, layers=3)  # six 1 MiB weights
    cluster = _synced("cpu-gloo", Mesh((2,)), sync_s=1e-3, op_overhead_s=30e-6)
    dp = baseline_plan(graph, rules, cluster, "dp").estimate
    assert torch_ddp_estimate(graph, cluster, dp)["collectives_by_kind"] == {"all_reduce": 2}  # 1 MiB, then 5 MiB
    assert torch_ddp_estimate(graph, cluster, dp, bucket_cap_bytes=25 * mib)["collectives_by_kind"] == {"all_reduce": 1}


def _with_random_relu(graph):
    """``graph`` with its first relu tagged random: a stand-in for dropout's mask (elementwise, batch-sharded)."""
    nodes = tuple(replace(node, op=replace(node.op, tags=frozenset({"random"}))) if node.name == "relu_1" else node
                  for node in graph.nodes)
    return replace(graph, nodes=nodes)


def test_torch_fsdp_is_priced_per_unit_as_fsdp2_runs_it_and_sends_the_bytes_the_bench_measured():
    """FSDP2 per unit: its parameters all-gathered before the forward (and again before the backward under ZeRO-3),
    its gradients reduce-scattered, which gloo carries out as an all-reduce of the whole gradient. The bytes are
    those the bench measured of torch's FSDP2 (docs/bench/results): on 4 ranks, 2.25x the padded parameters for
    ZeRO-2 and 3x for ZeRO-3; on 2 ranks 1.5x and 2x."""
    graph, rules = mlp_step(64, 32, 64, layers=2)
    for world in (2, 4):
        cluster = _synced("cpu-gloo", Mesh((world,)), sync_s=1e-3, op_overhead_s=30e-6)
        cluster = replace(cluster, device=replace(cluster.device, eager_op_overhead_s=10e-6),
                          axis_links=tuple(replace(link, reduce_scatter_as_all_reduce=True) for link in cluster.axis_links))
        # two units and the root's own parameters; dim 0 padded up to a multiple of the ranks (33 rows -> 36 on 4)
        units = fsdp_unit_bytes([[((33, 16), 4), ((33,), 4)], [((64, 64), 4)], [((), 4)]], world)
        padded = 4 * (-(-33 // world) * world) * 17
        assert units == [padded, 64 * 64 * 4, world * 4.0]
        link = cluster.link(0)
        for reshard_after_forward, multiple, calls in ((False, {2: 1.5, 4: 2.25}, 1), (True, {2: 2.0, 4: 3.0}, 2)):
            zero = baseline_plan(graph, rules, cluster, "zero3" if reshard_after_forward else "zero2")
            priced = torch_fsdp_estimate(graph, cluster, zero.estimate, units, reshard_after_forward, layout_plan=zero)
            assert sum(priced["comm_bytes_by_axis"].values()) == pytest.approx(multiple[world] * sum(units))
            assert priced["collectives_by_kind"] == {"all_gather": calls * 3, "reduce_scatter": 3}
            expected = sum(calls * collective_seconds("all_gather", size / world, world, link)[0]
                           + collective_seconds("all_reduce", size, world, link)[0] for size in units)
            assert priced["comm_s"] == pytest.approx(expected)
            assert priced["compute_s"] == pytest.approx(zero.estimate["compute_s"] - len(graph.nodes) * 20e-6)
            assert priced["step_s"] == pytest.approx(priced["compute_s"] + priced["comm_s"])
    with pytest.raises(ValueError, match="one axis"):
        torch_fsdp_estimate(graph, _synced("cpu-gloo", Mesh((2, 2)), sync_s=0.0), zero.estimate, units, True)


def test_torch_fsdp_takes_its_measured_unit_costs_where_the_link_carries_them():
    """Calibration version 14: a link that carries FSDP2's measured cost per unit prices each unit at it (its
    collectives, copies and hooks together, by the unit's bytes) in place of its collectives' price; the bytes sent and
    the calls are the same, and a variant the link lacks keeps the collectives' price."""
    graph, rules = mlp_step(64, 32, 64, layers=2)
    cluster = _synced("cpu-gloo", Mesh((2,)), sync_s=1e-3, op_overhead_s=30e-6)
    units = fsdp_unit_bytes([[((64, 64), 4)], [((64, 32), 4)]], 2)
    measured = replace(cluster, axis_links=(replace(cluster.link(0), fsdp_unit_costs=(("zero2", 2e-3, 1e9),)),))
    zero = baseline_plan(graph, rules, cluster, "zero2")
    plain = torch_fsdp_estimate(graph, cluster, zero.estimate, units, False, layout_plan=zero)
    priced = torch_fsdp_estimate(graph, measured, zero.estimate, units, False, layout_plan=zero)
    assert priced["comm_s"] == pytest.approx(sum(2e-3 + size / 1e9 for size in units)) != pytest.approx(plain["comm_s"])
    assert priced["comm_bytes_by_axis"] == plain["comm_bytes_by_axis"]
    assert priced["collectives_by_kind"] == plain["collectives_by_kind"]
    assert priced["step_s"] == pytest.approx(plain["compute_s"] + priced["comm_s"])
    zero3 = baseline_plan(graph, rules, cluster, "zero3")
    assert (torch_fsdp_estimate(graph, measured, zero3.estimate, units, True, layout_plan=zero3)["comm_s"]
            == pytest.approx(torch_fsdp_estimate(graph, cluster, zero3.estimate, units, True, layout_plan=zero3)["comm_s"]))


def test_torch_fsdp_and_tp_pay_the_dtensor_cost_of_each_op_they_run_on_dtensors():
    """torch's FSDP2 runs its optimizer on DTensor parameters, its TP the parallel modules' ops too: each such op pays
    the calibrated DTensor cost on top of the eager compute; a device that did not measure it (0) adds nothing."""
    graph, rules = mlp_step(64, 32, 64, layers=2)
    cluster = _synced("cpu-gloo", Mesh((2,)), sync_s=1e-3, op_overhead_s=30e-6)
    measured = replace(cluster, device=replace(cluster.device, dtensor_op_overhead_s=40e-6))
    units = fsdp_unit_bytes([[((64, 64), 4)]], 2)
    zero = baseline_plan(graph, rules, cluster, "zero2")
    plain = torch_fsdp_estimate(graph, measured, zero.estimate, units, False, layout_plan=zero)
    priced = torch_fsdp_estimate(graph, measured, zero.estimate, units, False, layout_plan=zero, dtensor_ops=100)
    assert priced["dtensor_s"] == pytest.approx(100 * 40e-6) and plain["dtensor_s"] == 0.0
    assert priced["compute_s"] == pytest.approx(plain["compute_s"] + 100 * 40e-6)
    assert priced["step_s"] == pytest.approx(plain["step_s"] + 100 * 40e-6) and priced["comm_s"] == plain["comm_s"]
    assert torch_fsdp_estimate(graph, cluster, zero.estimate, units, False, dtensor_ops=100)["dtensor_s"] == 0.0
    assert dtensor_seconds(measured, 0) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        dtensor_seconds(measured, -1)
    with pytest.raises(ValueError, match=">= 0"):
        dtensor_seconds(measured, 0, -1)
    # a parallel module's ops: at the elementwise op's cost where the calibration did not time them, else their own
    assert dtensor_seconds(measured, 10, 5) == pytest.approx(15 * 40e-6)
    modules = replace(measured, device=replace(measured.device, dtensor_module_op_overhead_s=120e-6))
    assert dtensor_seconds(modules, 10, 5) == pytest.approx(10 * 40e-6 + 5 * 120e-6)
    # the all-reduces the parallel modules issue through DTensor: each at its own figure beyond the link's price
    assert dtensor_seconds(modules, 10, 5, collectives=3) == dtensor_seconds(modules, 10, 5)  # not measured: 0
    called = replace(modules, device=replace(modules.device, dtensor_collective_overhead_s=400e-6))
    assert dtensor_seconds(called, 10, 5, collectives=3) == pytest.approx(10 * 40e-6 + 5 * 120e-6 + 3 * 400e-6)
    with pytest.raises(ValueError, match=">= 0"):
        dtensor_seconds(called, 0, 0, collectives=-1)


def test_torch_tp_is_priced_by_its_activation_all_reduces_and_fsdp_on_the_other_axis():
    """torch's TP: one blocking all-reduce per row-wise output (forward) and column-wise input gradient (backward) on
    the last mesh axis, each paying its full fixed and in-step cost; on a 2-D mesh FSDP2 (ZeRO-2) over the first
    axis, per unit; compute at the eager per-node cost plus the DTensor ops."""
    graph, rules = mlp_step(64, 32, 64, layers=2)
    reduces = [8192.0, 8192.0, 4096.0]
    flat = _synced("cpu-gloo", Mesh((4,)), sync_s=2e-3, op_overhead_s=30e-6)
    flat = replace(flat, device=replace(flat.device, eager_op_overhead_s=10e-6, dtensor_op_overhead_s=50e-6))
    megatron = baseline_plan(graph, rules, flat, "megatron")
    priced = torch_tp_estimate(graph, flat, megatron.estimate, reduces, dtensor_ops=60, layout_plan=megatron)
    assert priced["collectives_by_kind"] == {"all_reduce": 3}
    expected = sum(collective_seconds("all_reduce", size, 4, flat.link(0))[0] for size in reduces)
    assert priced["comm_s"] == pytest.approx(expected) and expected > 3 * 2e-3  # each call pays the in-step cost
    eager = torch_ddp_estimate(graph, flat, megatron.estimate, dp_plan=megatron)["compute_s"]  # the same eager compute
    assert priced["compute_s"] == pytest.approx(eager + 60 * 50e-6) and priced["dtensor_s"] == pytest.approx(60 * 50e-6)
    assert priced["step_s"] == pytest.approx(priced["compute_s"] + priced["comm_s"])
    # the parallel modules' ops at their own calibrated cost, the optimizer's at the elementwise op's
    moduled = replace(flat, device=replace(flat.device, dtensor_module_op_overhead_s=150e-6))
    with_modules = torch_tp_estimate(graph, moduled, megatron.estimate, reduces, dtensor_ops=60, layout_plan=megatron,
                                     module_ops=20)
    assert with_modules["dtensor_s"] == pytest.approx(60 * 50e-6 + 20 * 150e-6)
    assert with_modules["compute_s"] == pytest.approx(eager + 60 * 50e-6 + 20 * 150e-6)
    # each activation all-reduce pays what DTensor adds to it in the calling thread, on the compute; a TP axis of one
    # rank issues none
    called = replace(moduled, device=replace(moduled.device, dtensor_collective_overhead_s=400e-6))
    with_calls = torch_tp_estimate(graph, called, megatron.estimate, reduces, dtensor_ops=60, layout_plan=megatron,
                                   module_ops=20)
    assert with_calls["dtensor_s"] == pytest.approx(with_modules["dtensor_s"] + len(reduces) * 400e-6)
    assert with_calls["comm_s"] == pytest.approx(with_modules["comm_s"])
    assert with_calls["step_s"] == pytest.approx(with_modules["step_s"] + len(reduces) * 400e-6)
    lone = replace(called, mesh=Mesh((4, 1)), axis_links=(called.link(0), called.link(0)))
    assert torch_tp_estimate(graph, lone, megatron.estimate, reduces, dtensor_ops=60, layout_plan=megatron,
                             module_ops=20)["dtensor_s"] == pytest.approx(with_modules["dtensor_s"])
    # 2-D (dp, tp): the all-reduces on tp's link, FSDP2's all-gather and reduce-scatter per unit on dp's
    square = _synced("cpu-gloo", Mesh((2, 2)), sync_s=1e-3, op_overhead_s=30e-6)
    square = replace(square, axis_links=(replace(square.link(0), sync_s=3e-3), square.link(1)))
    megatron2 = baseline_plan(graph, rules, square, "megatron")
    units = fsdp_unit_bytes([[((32, 64), 4)], [((64,), 4)]], 2)
    priced2 = torch_tp_estimate(graph, square, megatron2.estimate, reduces, 0, units, layout_plan=megatron2)
    assert priced2["collectives_by_kind"] == {"all_reduce": 3, "all_gather": 2, "reduce_scatter": 2}
    tp_s = sum(collective_seconds("all_reduce", size, 2, square.link(1))[0] for size in reduces)
    fsdp_s = sum(collective_seconds("all_gather", size / 2, 2, square.link(0))[0]
                 + collective_seconds("reduce_scatter", size, 2, square.link(0))[0] for size in units)
    assert priced2["comm_s"] == pytest.approx(tp_s + fsdp_s)
    dp_name, tp_name = square.mesh.axis_names
    assert priced2["comm_bytes_by_axis"][tp_name] == pytest.approx(
        sum(collective_seconds("all_reduce", size, 2, square.link(1))[1] for size in reduces))
    assert priced2["comm_bytes_by_axis"][dp_name] > 0
    with pytest.raises(ValueError, match="2-D mesh"):
        torch_tp_estimate(graph, flat, megatron.estimate, reduces, 0, units)


def test_a_random_op_costs_its_whole_draw_in_metadist_and_its_share_in_torch_ddp():
    from metadist.cost import compute_seconds, node_work
    from metadist.solver.baselines import eager_random_discount

    plain, rules = mlp_step(4096, 32, 256, layers=1)
    graph = _with_random_relu(plain)
    cluster = _synced("cpu-gloo", Mesh((2,)), sync_s=0.0, op_overhead_s=0.0)
    node = graph.node("relu_1")
    work = node_work(graph, node)
    assert work.draws_whole and not node_work(plain, plain.node("relu_1")).draws_whole
    assert work.op == "relu"  # named, so a device's measured seconds per element of the draw price it
    dp = baseline_plan(graph, rules, cluster, "dp")
    strategy = dp.node_strategies["relu_1"]
    assert any(choice.kind == "factor" for choice in strategy.choices)  # the batch is split
    specs = [graph.value(name).spec for name in node.input_names]
    outs = [node.outputs[0].spec]
    whole = compute_seconds(work, specs, outs, strategy, cluster.mesh, cluster.device)
    share = compute_seconds(replace(work, draws_whole=False), specs, outs, strategy, cluster.mesh, cluster.device)
    # every rank draws the whole output (its work and the bytes it writes); it reads its own shard of the input
    dtype_rate = cluster.device.bandwidth_bytes_per_s("float32", specs[0].nbytes / 2 + outs[0].nbytes)
    assert whole == pytest.approx(max(outs[0].numel / cluster.device.flops_per_s("float32", outs[0].numel),
                                      (specs[0].nbytes / 2 + outs[0].nbytes) / dtype_rate))
    assert share < whole
    # the MetaDist estimate pays the whole draw; torch's DDP draws each rank's share
    assert eager_random_discount(graph, dp, cluster) == pytest.approx(whole - share)
    assert eager_random_discount(plain, baseline_plan(plain, rules, cluster, "dp"), cluster) == 0.0
    # a layout planned on 2x2, priced (as the bench prices torch's DDP) on the cluster of all 4 ranks on one axis: the
    # discount is the layout's own, on its own mesh
    square = _synced("cpu-gloo", Mesh((2, 2)), sync_s=0.0, op_overhead_s=0.0)
    dp_square = baseline_plan(graph, rules, square, "dp")
    flat = _synced("cpu-gloo", Mesh((4,)), sync_s=0.0, op_overhead_s=0.0)
    assert eager_random_discount(graph, dp_square, flat) == pytest.approx(eager_random_discount(graph, dp_square, square))
    assert eager_random_discount(graph, dp_square, flat) > 0
    assert torch_ddp_estimate(graph, flat, dp_square.estimate, dp_plan=dp_square)["compute_s"] == pytest.approx(
        torch_ddp_estimate(graph, flat, dp_square.estimate)["compute_s"] - eager_random_discount(graph, dp_square, square))
    priced = torch_ddp_estimate(graph, cluster, dp.estimate, dp_plan=dp)
    assert priced["compute_s"] == pytest.approx(torch_ddp_estimate(graph, cluster, dp.estimate)["compute_s"] - (whole - share))


def test_an_older_calibration_is_measured_again_and_never_shares_a_file(tmp_path):
    path = calibration_path(tmp_path, 2)
    assert "-v" in path.name  # the version is in the file name: an older MetaDist keeps reading its own file
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "version": 1, "report": {"device": {}}}))
    assert load_calibration(path) is None  # an older version: measured again, not misread
    path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "version": 99, "report": {}}))
    with pytest.raises(ClusterError, match="metadist calibrate"):
        load_calibration(path)


def test_a_calls_wait_grows_with_the_compute_before_it_and_levels_off():
    link = Link(bandwidth_bytes_per_s=1e9, latency_s=10e-6, sync_s=5e-3, sync_by_gap=((3e-3, 5e-3), (0.3e-3, 0.5e-3)))
    assert link.sync_by_gap == ((0.3e-3, 0.5e-3), (3e-3, 5e-3))  # sorted by gap
    assert link.sync_after(0.0) == link.sync_after(0.3e-3) == pytest.approx(0.5e-3)  # the end points beyond either end
    assert link.sync_after(1.65e-3) == pytest.approx(2.75e-3)  # linear between them
    assert link.sync_after(3e-3) == link.sync_after(1.0) == pytest.approx(5e-3)
    assert Link(bandwidth_bytes_per_s=1e9, latency_s=0.0, sync_s=2e-3).sync_after(1e-6) == 2e-3  # none measured: sync_s
    with pytest.raises(ClusterError, match="sync by gap"):
        replace(link, sync_by_gap=((1e-3, -1.0),))
    # a step's calls priced by the compute before each; the first follows the last call's trailing compute
    from metadist.cost.comm import sync_corrections

    plain = Link(bandwidth_bytes_per_s=1e9, latency_s=0.0, sync_s=1e-3)
    calls = [(0.0, 1.0, link), (10e-3, 1.0, link), (0.0, 1.0, link), (1.65e-3, 1.0, plain)]
    corrections = sync_corrections(calls, trailing_s=0.1e-3)
    assert corrections == pytest.approx([0.5e-3 - 5e-3, 0.0, 0.5e-3 - 5e-3, 0.0])  # a plain link pays its sync_s
    # the trailing compute reaches the first call: after a long last stretch it waits long
    assert sync_corrections(calls, trailing_s=4e-3)[0] == pytest.approx(0.0)
    # a bucket's members are fractions of one call: four quarters after 1 ms each pay a quarter of the wait at the
    # gap their shares leave, the wait of one call at a 4 ms gap is not four calls' at 1 ms
    quarters = sync_corrections([(1e-3, 0.25, link)] * 4, trailing_s=0.0)
    gaps = [1e-3, 1e-3 * 0.75 + 1e-3, (1e-3 * 0.75 + 1e-3) * 0.75 + 1e-3]
    gaps.append(gaps[-1] * 0.75 + 1e-3)
    assert quarters == pytest.approx([0.25 * (link.sync_after(gap) - 5e-3) for gap in gaps])


def _report_with_waits(short_s: float, long_s: float, pair_short_s: float | None = None) -> dict:
    rows = [{"axis": 0, "op": "all_reduce", "bytes": b, "seconds": 1e-4 + b / 1e9} for b in (4096, 1 << 20)]
    rows += [{"axis": -1, "group_size": 2, "op": "all_reduce", "bytes": b, "seconds": 0.5e-4 + b / 1e9} for b in (4096, 1 << 20)]
    device = _figures(compute_phase_short_s=0.25e-3, compute_phase_s=2.8e-3, in_step_collective_short_s=short_s,
                      in_step_collective_s=long_s, **{"in_step_collective_s:2": 6e-3})
    if pair_short_s is not None:
        device["in_step_collective_short_s:2"] = pair_short_s
    return {"backend": "gloo", "memory_capacity_bytes": 1e9, "world_size": 4, "measurements": rows, "device": device}


def test_the_calibration_prices_waits_by_gap_where_the_short_phases_wait_is_much_shorter():
    from metadist.cost.calibrate import cluster_over_mesh

    cluster = cluster_from_report(_report_with_waits(0.6e-3, 9e-3), Mesh((4,)))
    link = cluster.link(0)
    isolated = collective_seconds("all_reduce", IN_STEP_COLLECTIVE_BYTES, 4, replace(link, sync_s=0.0, sync_by_gap=()))[0]
    assert link.sync_s == pytest.approx(9e-3 - isolated)
    assert [value for point in link.sync_by_gap for value in point] == pytest.approx([0.25e-3, 0.6e-3 - isolated, 2.8e-3, 9e-3 - isolated])
    # a 2x2 mesh's pairs take their groups' figures, short and long
    square = cluster_over_mesh(_report_with_waits(0.6e-3, 9e-3, pair_short_s=1e-3), Mesh((2, 2)))
    pair = square.link(0)
    pair_isolated = collective_seconds("all_reduce", IN_STEP_COLLECTIVE_BYTES, 2, replace(pair, sync_s=0.0, sync_by_gap=()))[0]
    assert [value for point in pair.sync_by_gap for value in point] == pytest.approx([0.25e-3, 1e-3 - pair_isolated, 2.8e-3, 6e-3 - pair_isolated])
    # no short figure for the groups (or a calibration before version 18): every call pays sync_s
    assert cluster_over_mesh(_report_with_waits(0.6e-3, 9e-3), Mesh((2, 2))).link(0).sync_by_gap == ()
    # waits alike after either phase (2 processes: 0.09 and 0.22 ms) are no curve: no second search for noise
    assert cluster_from_report(_report_with_waits(isolated + 0.09e-3, isolated + 0.22e-3), Mesh((4,))).link(0).sync_by_gap == ()
    assert cluster_from_report(_report_with_waits(isolated + 3e-3, isolated + 5e-3), Mesh((4,))).link(0).sync_by_gap == ()


def test_waits_by_gap_are_placed_at_the_compute_a_step_prices_for_their_phases_where_ranks_share_cores():
    """Ranks sharing cores (4 on 2: every rate halved, ``sustained_slowdown`` 2) are priced at twice a free core's
    compute, while the calibration's phases of a few milliseconds ran within a turn, at a free core's speed: a point's
    gap is its phase's seconds as a step prices them, so that a call after 2.8 ms of priced compute (1.4 ms of a free
    core's) waits what the calibration's call after 1.4 ms did, not what its call after 2.8 did."""
    from metadist.cost.calibrate import cluster_over_mesh

    report = _report_with_waits(0.6e-3, 9e-3, pair_short_s=1e-3)
    report["device"]["core_sharing"] = 2.0
    link = cluster_from_report(report, Mesh((4,))).link(0)
    bare = replace(link, sync_s=0.0, sync_by_gap=())
    isolated = collective_seconds("all_reduce", IN_STEP_COLLECTIVE_BYTES, 4, bare)[0]
    assert [value for point in link.sync_by_gap for value in point] == pytest.approx(
        [0.5e-3, 0.6e-3 - isolated, 5.6e-3, 9e-3 - isolated])
    assert link.sync_after(2.8e-3) == pytest.approx(0.6e-3 + (9e-3 - 0.6e-3) * (2.3 / 5.1) - isolated)
    assert link.sync_s == pytest.approx(9e-3 - isolated)  # the search's flat price is unchanged
    pair = cluster_over_mesh(report, Mesh((2, 2))).link(0)
    assert [point[0] for point in pair.sync_by_gap] == pytest.approx([0.5e-3, 5.6e-3])


def test_ranks_with_a_core_each_take_the_wait_after_a_long_stretch_of_compute_as_a_third_point():
    """Version 21: 2 gloo processes on 2 cores waited alike after 0.24 and 2.7 ms of compute (0.31 and 0.45 ms) and
    longer after 9 ms (1.2): the two short points alone were no curve, so every call paid the 2.7 ms point's wait,
    where a 12-layer GPT's calls after 5-40 ms of compute were blocked ~1.5 ms beyond their price."""
    def report(long_phase_s: float | None, long_wait_s: float | None, **device) -> dict:
        report = _report_with_waits(0.31e-3, 0.45e-3)
        report["world_size"] = 2
        if long_phase_s is not None:
            report["device"].update(compute_phase_long_s=long_phase_s, in_step_collective_long_s=long_wait_s)
        report["device"].update(device)
        return report

    flat = cluster_from_report(report(None, None), Mesh((2,))).link(0)
    assert flat.sync_by_gap == ()  # alike after either short phase: every call pays sync_s
    link = cluster_from_report(report(9e-3, 1.2e-3), Mesh((2,))).link(0)
    isolated = collective_seconds("all_reduce", IN_STEP_COLLECTIVE_BYTES, 2, replace(link, sync_s=0.0, sync_by_gap=()))[0]
    assert link.sync_s == pytest.approx(0.45e-3 - isolated)  # the search's flat price is still the 2.8 ms point's
    assert [value for point in link.sync_by_gap for value in point] == pytest.approx(
        [0.25e-3, 0.31e-3 - isolated, 2.8e-3, 0.45e-3 - isolated, 9e-3, 1.2e-3 - isolated])
    assert link.sync_after(20e-3) == pytest.approx(1.2e-3 - isolated)  # beyond the last point, its wait
    assert link.sync_after(5.9e-3) == pytest.approx((0.45e-3 + 1.2e-3) / 2 - isolated)
    # a long phase that waited less than the shorter one (noise) waits as long as it: the drift does not shrink
    noisy = cluster_from_report(report(9e-3, 0.1e-3, in_step_collective_short_s=0.1e-3, in_step_collective_s=2e-3), Mesh((2,)))
    assert noisy.link(0).sync_by_gap[-1] == pytest.approx((9e-3, 2e-3 - isolated))
    # a long phase no longer than the 2.8 ms one is no point of its own
    assert cluster_from_report(report(2e-3, 1.2e-3), Mesh((2,))).link(0).sync_by_gap == ()


def test_the_long_phase_is_timed_only_where_every_rank_has_a_core():
    from metadist.cost.calibrate_worker import (IN_STEP_LONG_PHASE_OPS, IN_STEP_PHASE_OPS, IN_STEP_SHORT_PHASE_OPS,
                                                _in_step_phases)

    assert _in_step_phases(False, 15) == ((IN_STEP_PHASE_OPS, "", 15), (IN_STEP_SHORT_PHASE_OPS, "_short", 15),
                                        (IN_STEP_LONG_PHASE_OPS, "_long", 5))
    assert _in_step_phases(False, 4)[-1] == (IN_STEP_LONG_PHASE_OPS, "_long", 3)
    # 4 processes on 2 cores: the scheduler's turns bound the drift, and the long phase's wait (23 ms a call after
    # 11 ms) is not what a step's calls wait
    assert _in_step_phases(True, 15) == ((IN_STEP_PHASE_OPS, "", 15), (IN_STEP_SHORT_PHASE_OPS, "_short", 15))


def _gapped(cluster, short_gap: float, short_wait: float, long_gap: float, long_wait: float):
    return replace(cluster, axis_links=tuple(replace(link, sync_s=long_wait, sync_by_gap=((short_gap, short_wait), (long_gap, long_wait)))
                                             for link in cluster.axis_links))


def test_the_estimate_prices_each_calls_wait_by_the_compute_in_node_order_before_it():
    from metadist.solver.estimate import estimate

    graph, rules = mlp_step(64, 32, 64, layers=3)
    long_calls = _synced("cpu-gloo", Mesh((2, 2)), sync_s=5e-3, op_overhead_s=20e-6)
    short_calls = _synced("cpu-gloo", Mesh((2, 2)), sync_s=0.5e-3, op_overhead_s=20e-6)
    for kind in ("dp", "megatron"):
        plan = baseline_plan(graph, rules, long_calls, kind)
        assignment = SimpleNamespace(node_strategies=plan.node_strategies, input_shardings=plan.input_shardings)
        lives = liveness(graph)

        def step_s(cluster) -> float:
            return estimate(graph, assignment, cluster, lives)["step_s"]

        long_s, short_s = step_s(long_calls), step_s(short_calls)
        assert long_s > short_s
        # every gap before the curve's near end: each call waits short, as at a flat short wait; past a far end of a
        # nanosecond, every call after some compute waits long (calls with nothing between them wait short)
        assert step_s(_gapped(long_calls, 10.0, 0.5e-3, 20.0, 5e-3)) == pytest.approx(short_s)
        assert short_s < step_s(_gapped(long_calls, 1e-9, 0.5e-3, 2e-9, 5e-3)) <= long_s
        # gaps of about a node's compute: some calls follow others closely, some come after a stretch of compute
        compute_s = estimate(graph, assignment, long_calls, lives)["compute_s"]
        between = step_s(_gapped(long_calls, 0.0, 0.5e-3, compute_s / 4, 5e-3))
        assert short_s < between < long_s


@pytest.mark.parametrize("dims, kept", [((64, 512, 2048), "short waits"), ((256, 64, 256), "long waits")])
def test_a_plan_on_waits_by_gap_is_the_cheaper_of_the_searches_at_long_and_short_waits(dims, kept):
    from metadist.solver.estimate import estimate

    graph, rules = mlp_step(*dims, layers=2)
    base = _synced("cpu-gloo", Mesh((4,)), sync_s=0.0, op_overhead_s=20e-6)
    cluster = _gapped(base, 0.2e-3, 0.3e-3, 3e-3, 6e-3)
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))
    report = plan.solver["short_waits"]
    # wide layers: the search at the short wait splits them (6 calls, all-reducing activations) and the estimate,
    # with most calls right after another, prices that lower; narrow ones: its extra calls are not worth it
    assert report["kept"] == kept and report["step_s"] != pytest.approx(report["step_s_at_long_waits"])
    assert plan.estimate["step_s"] == pytest.approx(min(report["step_s"], report["step_s_at_long_waits"]))
    # the plan's figure is its estimate on the cluster as calibrated (the second search's per-call price is not in it)
    assignment = SimpleNamespace(node_strategies=plan.node_strategies, input_shardings=plan.input_shardings)
    assert estimate(graph, assignment, cluster, liveness(graph))["step_s"] == pytest.approx(plan.estimate["step_s"])
    # the estimate, not the objective, prices the plan: the baselines were compared, and say why (the waits, or the
    # plan being the search's at whole calls: the plan's coalesced calls cost more than the objective's shares of them)
    reason = plan.solver["baselines_reason"]
    assert plan.solver["baselines_checked"]
    assert "wait by the compute before it" in reason or reason.startswith("the plan is the second search's, at whole calls")
    assert all(seconds is None or seconds >= plan.estimate["step_s"] * (1 - 1e-9) for seconds in plan.solver["baselines_checked"].values())
    # the explanation's costs are the ones the search that chose the plan saw, and it says which
    from metadist.solver import explain

    noted = "every collective at its link's short wait" in explain(plan, next(iter(plan.solver["explain"])))
    assert noted == (kept == "short waits")
    # a cluster without the curve searches once, as before
    flat = plan_graph(graph, rules, replace(base, axis_links=tuple(replace(link, sync_s=6e-3) for link in base.axis_links)),
                      memory_budget_bytes=float("inf"))
    assert "short_waits" not in flat.solver


@pytest.mark.parametrize("caller_limit_s", [60.0, 3.0])
def test_the_search_at_short_waits_runs_within_its_own_time_limit(monkeypatch, caller_limit_s):
    from metadist.solver import ilp as ilp_module, planner

    graph, rules = mlp_step(64, 512, 2048, layers=2)
    cluster = _gapped(_synced("cpu-gloo", Mesh((4,)), sync_s=0.0, op_overhead_s=20e-6), 0.2e-3, 0.3e-3, 3e-3, 6e-3)
    limits: list[float] = []
    starts: list = []
    solve = ilp_module.ShardingILP.solve

    def recorded(self, time_limit_s=60.0, start=None):
        limits.append(time_limit_s)
        starts.append((self.problem, start))
        return solve(self, time_limit_s, start)

    kept = []
    searched = planner._searched_at_short_waits

    def second_search(problem, solution, *args):
        kept.append(solution.choice)
        return searched(problem, solution, *args)

    monkeypatch.setattr(ilp_module.ShardingILP, "solve", recorded)
    monkeypatch.setattr(planner, "_searched_at_short_waits", second_search)
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"), time_limit_s=caller_limit_s)
    # the first search gets the caller's limit; the later ones (at whole calls where the plan's coalesced calls cost
    # more than their shares, then at short waits), refinements the estimate may reject, at most their own
    expected = min(caller_limit_s, planner.SHORT_WAIT_SEARCH_S)
    later = 1 + ("step_s" in plan.solver.get("whole_calls", {}))
    assert limits[0] == caller_limit_s and limits[1:] == [expected] * later
    # each later search starts from the plan it refines, carried into its problem: stopped by its limit, it ends no
    # dearer; the one at short waits from the plan kept before it
    (first, none), (second, start) = starts[0], starts[-1]
    assert none is None and all(given is not None and set(given) == set(problem.classes) for problem, given in starts[1:])
    assert planner.assignment_from(second, start) == planner.assignment_from(first, kept[0])
    assert plan.solver["short_waits"]["time_limit_s"] == expected


def test_a_lowered_programs_calls_are_priced_by_the_compute_the_program_runs_before_each():
    from metadist.cost.comm import program_comm
    from metadist.lowering.program import LocalOp, lower

    graph, rules = mlp_step(64, 32, 64, layers=3)
    cluster = _synced("cpu-gloo", Mesh((2, 2)), sync_s=5e-3, op_overhead_s=20e-6)
    plan = baseline_plan(graph, rules, cluster, "megatron")
    program = lower(graph, plan, (0, 0), bucket_cap_bytes=0)
    seconds = {node.name: 1e-4 * (index + 1) for index, node in enumerate(graph.nodes)}
    gaps = program.compute_between_calls(seconds)
    calls = list(program.collective_calls())
    assert len(calls) >= 2 and len(gaps) == len(calls) + 1
    ran = sum(seconds[item.node] for item in program.instructions if isinstance(item, LocalOp))
    assert sum(gaps) == pytest.approx(ran)
    flat = program_comm(program, cluster, seconds)["comm_s_by_axis"]
    assert flat == pytest.approx(program_comm(program, cluster)["comm_s_by_axis"])  # no curve: every call pays sync_s
    # a curve reaching its long wait at 1 ms: each call after at least that much compute pays it, the others less,
    # by what sync_corrections says of the program's own gaps (the first after the last call's trailing compute)
    curved = _gapped(cluster, 0.0, 0.5e-3, 1e-3, 5e-3)
    priced = program_comm(program, curved, seconds)["comm_s_by_axis"]
    expected = dict(flat)
    carry = gaps[-1]
    for (_, axis, _), before in zip(calls, gaps):
        expected[cluster.mesh.axis_names[axis]] += curved.link(axis).sync_after(carry + before) - 5e-3
        carry = 0.0
    assert priced == pytest.approx(expected)
    assert sum(priced.values()) < sum(flat.values())
    # without the node seconds the program's calls pay sync_s each, as before
    assert program_comm(program, curved)["comm_s_by_axis"] == pytest.approx(flat)


def test_torchs_calls_wait_by_the_compute_spread_evenly_between_them():
    """Where a link measured the wait by the compute before a call, torch's DDP, FSDP2 and TP calls each wait at
    ``compute_s / calls`` (their calls spread evenly over the step, :func:`spread_waits`): TP's many calls on a tiny
    model pay short waits, DDP's one bucket the long one; FSDP2's measured units hold their own waits."""
    from metadist.solver.baselines import spread_waits

    graph, rules = mlp_step(64, 32, 64, layers=2)
    reduces = [8192.0] * 6
    flat = _synced("cpu-gloo", Mesh((2, 2)), sync_s=5e-3, op_overhead_s=30e-6)
    flat = replace(flat, device=replace(flat.device, eager_op_overhead_s=10e-6))
    megatron = baseline_plan(graph, rules, flat, "megatron")
    units = fsdp_unit_bytes([[((32, 64), 4)], [((64,), 4)]], 2)
    long_only = torch_tp_estimate(graph, flat, megatron.estimate, reduces, 0, units, layout_plan=megatron)
    calls = sum(long_only["collectives_by_kind"].values())
    assert calls == 6 + 2 * 2
    gap = long_only["compute_s"] / calls
    # a curve from 1 ms at no gap to 5 ms at 4 gaps: the wait at one gap is 2 ms, 3 ms less than the long one
    curved = _gapped(flat, 0.0, 1e-3, 4 * gap, 5e-3)
    priced = torch_tp_estimate(graph, curved, megatron.estimate, reduces, 0, units, layout_plan=megatron)
    assert priced["comm_s"] == pytest.approx(long_only["comm_s"] - calls * 3e-3)
    assert priced["compute_s"] == pytest.approx(long_only["compute_s"])
    assert priced["step_s"] == pytest.approx(priced["compute_s"] + priced["comm_s"])
    # fewer calls over the same compute wait longer: with the last 4 reduces gone, 6 calls at 1.67 gaps
    fewer = torch_tp_estimate(graph, curved, megatron.estimate, reduces[:2], 0, units, layout_plan=megatron)
    fewer_long = torch_tp_estimate(graph, flat, megatron.estimate, reduces[:2], 0, units, layout_plan=megatron)
    assert fewer["comm_s"] == pytest.approx(fewer_long["comm_s"] - 6 * (5e-3 - (1e-3 + 4e-3 * (calls / 6) / 4)))
    # DDP's one bucket follows the whole step's compute: the long wait, as without the curve
    one_axis = _gapped(_synced("cpu-gloo", Mesh((4,)), sync_s=5e-3, op_overhead_s=30e-6), 0.0, 1e-3, 4 * gap, 5e-3)
    one_axis_long = replace(one_axis, axis_links=(replace(one_axis.link(0), sync_by_gap=()),))  # every call at the long wait
    dp = baseline_plan(graph, rules, one_axis, "dp")
    assert torch_ddp_estimate(graph, one_axis, dp.estimate, dp_plan=dp)["comm_s"] == pytest.approx(
        torch_ddp_estimate(graph, one_axis_long, dp.estimate, dp_plan=dp)["comm_s"])
    # FSDP2's measured units: no call repriced; unmeasured, each of its 4 calls (2 units) is
    zero = baseline_plan(graph, rules, one_axis, "zero2")
    measured = replace(one_axis, axis_links=(replace(one_axis.link(0), fsdp_unit_costs=(("zero2", 2e-3, 1e9),)),))
    assert torch_fsdp_estimate(graph, measured, zero.estimate, units, False, layout_plan=zero)["comm_s"] == pytest.approx(
        sum(2e-3 + size / 1e9 for size in units))
    plain = torch_fsdp_estimate(graph, one_axis_long, zero.estimate, units, False, layout_plan=zero)
    assert plain["collectives_by_kind"] == {"all_gather": 2, "reduce_scatter": 2}
    zero_curved = _gapped(one_axis_long, 0.0, 1e-3, plain["compute_s"], 5e-3)  # one call a quarter of the way: 2 ms
    spread = torch_fsdp_estimate(graph, zero_curved, zero.estimate, units, False, layout_plan=zero)
    assert spread["comm_s"] == pytest.approx(plain["comm_s"] - 4 * 3e-3)
    assert spread_waits(1.0, 3, []) == 0.0
    with pytest.raises(ValueError, match="waiting calls"):
        spread_waits(1.0, 1, [one_axis.link(0)] * 2)


def test_fsdp_units_large_ones_priced_at_the_fastest_round_after_warm_up_rounds(tmp_path, monkeypatch):
    # FSDP2's chains on one gloo process, with scripted step times: a small unit's figure is the mean of its rounds
    # less the slowest (version 33, expected_wait), a large one's the fastest (version 30), each less the unsharded
    # chain's, over the chain's units
    import torch.distributed as dist

    from metadist.cost import calibrate_worker as worker

    small, large = 1 << 12, 1 << 14
    monkeypatch.setattr(worker, "FSDP_UNIT_BYTES", (small, large))
    monkeypatch.setattr(worker, "FSDP_LARGE_BYTES", large)
    repeats = 5
    # per round: plain, zero2, zero3 (ms); the large size's second round took page faults
    script = {small: [(1, 4, 5), (1, 5, 9), (2, 6, 7), (1, 40, 6), (3, 5, 8)],
              large: [(10, 50, 70), (30, 300, 400), (11, 52, 75), (12, 51, 72)]}
    assert len(script[large]) == worker.FSDP_LARGE_ROUNDS
    timed = [seconds / 1e3 for nbytes in (small, large) for round_ in script[nbytes] for seconds in round_]
    calls = []
    steps = []

    def scripted(run, repeats_):
        assert repeats_ == 1
        run()
        calls.append(1)
        return timed[len(calls) - 1]

    monkeypatch.setattr(worker, "median_seconds", scripted)
    real_chain = worker._fsdp_chain

    def counted_chain(width):
        model = real_chain(width)
        model.register_forward_hook(lambda *_: steps.append(width))
        return model

    monkeypatch.setattr(worker, "_fsdp_chain", counted_chain)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        figures = worker._fsdp_unit_seconds(1, repeats)
    finally:
        dist.destroy_process_group()
    assert len(calls) == len(timed)  # every scripted time used, no more
    widths = sorted(set(steps))
    # the large chains: two untimed rounds of each variant before the four timed ones; the small: two steps each
    assert steps.count(widths[1]) == 3 * (worker.FSDP_LARGE_WARMUP_ROUNDS + worker.FSDP_LARGE_ROUNDS)
    assert steps.count(widths[0]) == 3 * (2 + repeats)
    units = worker.FSDP_UNITS
    plain = (1 + 1 + 2 + 1) / 4  # the 3 ms round left out
    assert figures[f"fsdp_unit_s:zero2:{widths[0] ** 2 * 4}"] == pytest.approx((5 - plain) / 1e3 / units)  # not 40
    assert figures[f"fsdp_unit_s:zero3:{widths[0] ** 2 * 4}"] == pytest.approx((6.5 - plain) / 1e3 / units)
    assert figures[f"fsdp_unit_s:zero2:{widths[1] ** 2 * 4}"] == pytest.approx((50 - 10) / 1e3 / units)
    assert figures[f"fsdp_unit_s:zero3:{widths[1] ** 2 * 4}"] == pytest.approx((70 - 10) / 1e3 / units)
