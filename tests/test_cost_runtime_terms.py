"""The runtime's own costs in the cost model: per-node cost from a captured step, a collective's in-step cost
(``Link.sync_s``), torch DDP priced as it runs, and the calibration cache's versions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from metadist.cost import cluster_for
from metadist.cost.calibrate import (
    CALIBRATION_FORMAT, IN_STEP_COLLECTIVE_BYTES, calibration_path, cluster_from_report, collective_sync_s, eager_op_overhead,
    load_calibration, runtime_op_overhead,
)
from metadist.cost.cluster import ClusterError, Link
from metadist.cost.comm import collective_seconds
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
    graph, rules = mlp_step(64, 32, 64, layers=2)
    cluster = _synced("cpu-gloo", Mesh((2,)), sync_s=1e-3, op_overhead_s=30e-6)
    cluster = replace(cluster, device=replace(cluster.device, eager_op_overhead_s=10e-6))
    dp = baseline_plan(graph, rules, cluster, "dp").estimate
    grads = sum(item.value.spec.nbytes for item in graph.inputs if item.role.value == "param")
    priced = torch_ddp_estimate(graph, cluster, dp)
    one, sent = collective_seconds("all_reduce", grads, 2, cluster.link(0))
    assert priced["collectives_by_kind"] == {"all_reduce": 1} and priced["comm_s"] == pytest.approx(one)
    assert priced["compute_s"] == pytest.approx(dp["compute_s"] - len(graph.nodes) * 20e-6)
    assert priced["step_s"] == pytest.approx(priced["compute_s"] + one)
    assert sum(priced["comm_bytes_by_axis"].values()) == pytest.approx(sent)
    # buckets of the cap: the gradients split into ceil(bytes / cap) all-reduces
    assert torch_ddp_estimate(graph, cluster, dp, bucket_cap_bytes=grads / 3)["collectives_by_kind"] == {"all_reduce": 3}


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
