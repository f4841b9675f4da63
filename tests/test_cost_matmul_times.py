"""Matmuls priced at their times on this machine, by local shape (:mod:`metadist.cost.matmul_times`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from metadist.cost import Cluster, ClusterError, Link
from metadist.cost.cluster import Device
from metadist.cost.compute import compute_seconds, local_matmul_key, node_work
from metadist.cost.matmul_times import load_table, matmul_keys, table_path, with_measured_matmuls
from metadist.ir import Graph, GraphInput, GraphOutput, MetaOp, Mesh, Node, Replicate, Role, Shard, TensorSpec, Value, ValueRef
from metadist.ir.plan import AxisChoice, NodeStrategy


def _graph(dtype: str = "bfloat16") -> Graph:
    """``x [64, 16] @ w.t()`` (w [32, 16]: a linear layer's forward, ``nt``), then ``y @ v`` row-major, then a batched
    matmul ``a [4, 8, 16] @ b [4, 16, 8]``."""
    view = frozenset({"view"})

    def node(name, target, shape, *args, tags=frozenset()):
        return Node(name, MetaOp(target, tags), args, (), (Value(name, TensorSpec(shape, dtype)),))

    nodes = (
        node("wt", "aten.t.default", (16, 32), ValueRef("w"), tags=view),
        node("fwd", "aten.mm.default", (64, 32), ValueRef("x"), ValueRef("wt")),
        node("out", "aten.mm.default", (64, 8), ValueRef("fwd"), ValueRef("v")),
        node("scores", "aten.bmm.default", (4, 8, 8), ValueRef("a"), ValueRef("b")),
    )
    inputs = (GraphInput(Value("x", TensorSpec((64, 16), dtype)), Role.BATCH),
              GraphInput(Value("w", TensorSpec((32, 16), dtype)), Role.PARAM, "w"),
              GraphInput(Value("v", TensorSpec((32, 8), dtype)), Role.PARAM, "v"),
              GraphInput(Value("a", TensorSpec((4, 8, 16), dtype)), Role.BATCH),
              GraphInput(Value("b", TensorSpec((4, 16, 8), dtype)), Role.BATCH))
    return Graph(inputs, nodes, (GraphOutput("out", Role.LOSS), GraphOutput("scores", Role.METRIC)), name="matmuls")


def _device(**changes) -> Device:
    device = Device(peak_flops_per_s=6e10, memory_bandwidth_bytes_per_s=2e10, memory_capacity_bytes=1e9,
                    matmul_curves={"bfloat16": [(1e3, 1e9), (1e8, 1.3e9)], "float32": [(1e3, 5e10), (1e8, 6e10)]},
                    op_overhead_s=1e-5)
    return replace(device, **changes)


def _cluster(mesh: Mesh, device: Device) -> Cluster:
    return Cluster(mesh=mesh, device=device, axis_links=tuple(Link(bandwidth_bytes_per_s=1e9, latency_s=1e-5)
                                                              for _ in mesh.shape), name="calibrated-gloo")


def test_the_keys_are_every_split_of_each_matmul_over_the_mesh_axes():
    graph = _graph()
    keys = matmul_keys(graph, Mesh((2, 2)))
    fwd = {key[2:] for key in keys if key[1] == "nt"}
    # [64, 16] x [16, 32]: each of the two axes on rows, contraction, columns or none (ceil of uneven pieces)
    assert fwd == {(0, m, k, n) for m in (64, 32, 16) for k in (16, 8, 4) for n in (32, 16, 8)
                   if (64 // m) * (16 // k) * (32 // n) <= 4}
    batched = {key[2:] for key in keys if key[2] > 0}
    assert (4, 8, 16, 8) in batched and (1, 8, 16, 8) in batched and (2, 4, 16, 8) in batched
    assert keys[("bfloat16", "nt", 0, 64, 16, 32)] == 2.0 * 64 * 16 * 32
    assert keys[("bfloat16", "", 4, 8, 16, 8)] == 2.0 * 4 * 8 * 16 * 8
    assert all(key[0] == "bfloat16" for key in keys)
    # float32's matmuls are timed by shape too (their rate depends on it on some machines), at the same splits
    in_float32 = matmul_keys(_graph("float32"), Mesh((2, 2)))
    assert {key[1:] for key in in_float32} == {key[1:] for key in keys} and all(key[0] == "float32" for key in in_float32)
    assert matmul_keys(_graph("float32"), Mesh((2, 2)), dtypes=("bfloat16",)) == {}


def test_a_timed_matmul_is_priced_at_its_time_and_the_rest_on_the_curves():
    graph = _graph()
    mesh = Mesh((2,))
    node = graph.node("fwd")
    work = node_work(graph, node)
    specs = [graph.value(name).spec for name in node.input_names]
    rows = NodeStrategy(choices=(AxisChoice("factor", 0),), inputs=((Shard(0),), (Replicate(),)), outputs=((Shard(0),),))
    columns = NodeStrategy(choices=(AxisChoice("factor", 1),), inputs=((Replicate(),), (Shard(1),)), outputs=((Shard(1),),))
    assert local_matmul_key(work, specs, rows, mesh, "bfloat16") == ("bfloat16", "nt", 0, 32, 16, 32)
    assert local_matmul_key(work, specs, columns, mesh, "bfloat16") == ("bfloat16", "nt", 0, 64, 16, 16)
    device = _device(matmul_seconds=((("bfloat16", "nt", 0, 32, 16, 32), 0.25),))
    out = [node.outputs[0].spec]
    assert compute_seconds(work, specs, out, rows, mesh, device) == pytest.approx(0.25 + 1e-5)
    on_curve = compute_seconds(work, specs, out, columns, mesh, device)
    assert on_curve == pytest.approx(compute_seconds(work, specs, out, columns, mesh, _device()))
    assert on_curve < 1e-3
    scores = graph.node("scores")
    batch = NodeStrategy(choices=(AxisChoice("factor", 0),), inputs=((Shard(0),), (Shard(0),)), outputs=((Shard(0),),))
    assert local_matmul_key(node_work(graph, scores), [graph.value(name).spec for name in scores.input_names], batch, mesh,
                            "bfloat16") == ("bfloat16", "", 2, 8, 16, 8)


def test_the_measured_times_survive_a_cluster_document_and_are_validated():
    mesh = Mesh((2,))
    cluster = _cluster(mesh, _device(matmul_seconds=((("bfloat16", "", 0, 8, 8, 8), 0.5),)))
    again = Cluster.from_dict(json.loads(cluster.to_json()))
    assert again.device.measured_matmul_s(("bfloat16", "", 0, 8, 8, 8)) == 0.5
    assert again == cluster
    with pytest.raises(ClusterError, match="positive"):
        _device(matmul_seconds=((("bfloat16", "", 0, 8, 8, 8), -1.0),))


def test_missing_shapes_are_timed_once_cached_and_scaled_by_the_slowdown(tmp_path, monkeypatch):
    import metadist.cost.matmul_times as matmul_times

    timed = []

    def fake_time(key):
        timed.append(key)
        return 1e-3 * key[3]  # a figure per shape, to find again

    monkeypatch.setattr(matmul_times, "time_matmul", fake_time)
    mesh = Mesh((2,))
    graph = _graph()
    cluster = _cluster(mesh, _device(sustained_slowdown=2.0))
    priced = with_measured_matmuls(cluster, graph, tmp_path)
    keys = matmul_keys(graph, mesh)
    assert sorted(timed) == sorted(keys)
    assert dict(priced.device.matmul_seconds) == {key: pytest.approx(2.0 * 1e-3 * key[3]) for key in keys}
    assert load_table(table_path(tmp_path)) == {key: pytest.approx(1e-3 * key[3]) for key in keys}  # cached unscaled
    timed.clear()
    assert with_measured_matmuls(cluster, graph, tmp_path) == priced and timed == []  # nothing timed again
    # a rank that only reads (measure=False) gets what is cached; a preset (no curves) is left as it is
    assert with_measured_matmuls(cluster, graph, tmp_path, measure=False) == priced
    preset = _cluster(mesh, replace(_device(), matmul_curves=()))
    assert with_measured_matmuls(preset, graph, tmp_path) is preset
    timed.clear()
    in_float32 = with_measured_matmuls(cluster, _graph("float32"), tmp_path)  # its own keys: timed, the rest kept
    assert sorted(timed) == sorted(matmul_keys(_graph("float32"), mesh)) and all(key[0] == "float32" for key in timed)
    assert dict(in_float32.device.matmul_seconds) == {key: pytest.approx(2.0 * 1e-3 * key[3]) for key in timed}


def test_a_matmul_too_long_for_the_curves_is_not_timed(tmp_path, monkeypatch):
    import metadist.cost.matmul_times as matmul_times

    monkeypatch.setattr(matmul_times, "time_matmul", lambda key: pytest.fail(f"timed {key}"))
    mesh = Mesh((1,))
    slow = _cluster(mesh, _device(matmul_curves={"bfloat16": [(1.0, 1.0)]}))  # 1 FLOP/s: every matmul takes hours
    assert dict(with_measured_matmuls(slow, _graph(), tmp_path).device.matmul_seconds) == {}


def test_a_damaged_cache_says_how_to_redo_it(tmp_path):
    path = table_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ClusterError, match="delete the file"):
        with_measured_matmuls(_cluster(Mesh((1,)), _device()), _graph(), tmp_path)


def test_a_matmul_is_timed_in_its_layout():
    pytest.importorskip("torch")
    from metadist.cost.matmul_times import time_matmul

    for key in (("bfloat16", "", 0, 16, 8, 4), ("bfloat16", "nt", 0, 16, 8, 4), ("bfloat16", "tn", 2, 16, 8, 4)):
        assert 0 < time_matmul(key) < 1.0


def test_a_matmul_is_timed_on_cycled_copies_of_its_operands_as_a_step_runs_it(monkeypatch):
    """Each call reads the next of several operand pairs (their bytes at least the pool's, or the most pairs), never
    the pair its last call left in the caches; every pair is in the timed layout."""
    torch = pytest.importorskip("torch")
    from metadist.cost import calibrate_worker, matmul_times

    seen = []
    real_mm = torch.mm

    def fake_per_call(call, device, budget_s=0.004):
        for _ in range(600):
            call()
        return 1e-3

    monkeypatch.setattr(calibrate_worker, "_per_call_seconds", fake_per_call)
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append((a, b)) or real_mm(a, b))
    assert matmul_times.time_matmul(("bfloat16", "nt", 0, 64, 32, 16)) == 1e-3
    pairs = {(a.data_ptr(), b.data_ptr()) for a, b in seen}
    assert len(pairs) == matmul_times.COLD_POOL_PAIRS  # 6 KiB a pair: the pool stops at the most pairs
    assert all(a.shape == (64, 32) and b.shape == (32, 16) and a.is_contiguous() and not b.is_contiguous()
               for a, b in seen)
    assert all(seen[i][0].data_ptr() != seen[i + 1][0].data_ptr() for i in range(len(seen) - 1))
    seen.clear()
    matmul_times.time_matmul(("float32", "", 0, 2048, 2048, 1))  # 16 MiB a pair: two pairs all the same, cycled
    assert len({a.data_ptr() for a, _ in seen}) == 2 and len(seen) == 600
