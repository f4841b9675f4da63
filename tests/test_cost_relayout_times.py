"""Relayout copies priced at their times on this machine, by local shape (:mod:`metadist.cost.relayout_times`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from test_cost_matmul_times import _cluster, _device

from metadist.cost import Cluster, ClusterError
from metadist.cost.compute import RELAYOUT, compute_seconds, local_relayout_key, node_work
from metadist.cost.relayout_times import load_table, relayout_keys, table_path, time_relayout, with_measured_relayouts
from metadist.ir import (Graph, GraphInput, GraphOutput, Literal, MetaOp, Mesh, Node, Partial, Replicate, Role, Shard,
                         TensorSpec, Value, ValueRef)
from metadist.ir.plan import AxisChoice, NodeStrategy

CONTIGUOUS = Literal("memory_format", "contiguous_format")


def _graph() -> Graph:
    """``g [8, 16, 32]`` (float32) transposed and copied row-major (a batched gradient laid out as its weight), the same
    view cast to bfloat16 row-major, and a copy of the row-major ``g`` (no relayout)."""
    view = frozenset({"view"})
    spec = TensorSpec((8, 32, 16), "float32")
    nodes = (
        Node("gt", MetaOp("aten.transpose.int", view), (ValueRef("g"), 1, 2), (), (Value("gt", spec),)),
        Node("laid", MetaOp("aten.clone.default"), (ValueRef("gt"),), (("memory_format", CONTIGUOUS),),
             (Value("laid", spec),)),
        Node("cast", MetaOp("aten._to_copy.default"), (ValueRef("gt"),),
             (("dtype", Literal("dtype", "bfloat16")), ("memory_format", CONTIGUOUS)),
             (Value("cast", TensorSpec((8, 32, 16), "bfloat16")),)),
        Node("plain", MetaOp("aten.clone.default"), (ValueRef("g"),), (("memory_format", CONTIGUOUS),),
             (Value("plain", TensorSpec((8, 16, 32), "float32")),)),
    )
    inputs = (GraphInput(Value("g", TensorSpec((8, 16, 32), "float32")), Role.BATCH),)
    return Graph(inputs, nodes, (GraphOutput("laid", Role.LOSS), GraphOutput("cast", Role.METRIC),
                                 GraphOutput("plain", Role.METRIC)), name="relayouts")


def _seconds(graph: Graph, name: str, strategy: NodeStrategy, mesh: Mesh, device) -> float:
    node = graph.node(name)
    specs = [graph.value(value).spec for value in node.input_names]
    return compute_seconds(node_work(graph, node), specs, [node.outputs[0].spec], strategy, mesh, device)


def test_the_keys_are_every_cut_of_the_transposed_operand_over_the_mesh():
    graph = _graph()
    assert [node.name for node in graph.nodes if node_work(graph, node).relayout] == ["laid", "cast"]
    keys = relayout_keys(graph, Mesh((2, 2)))
    laid = {key[2] for key in keys if key[:2] == ("float32", "float32")}
    # each of the two axes on one of the three dims or on none (the plain copy of g adds nothing)
    assert laid == {(8 // a, 32 // b, 16 // c) for a in (1, 2, 4) for b in (1, 2, 4) for c in (1, 2, 4) if a * b * c <= 4}
    assert {key[2] for key in keys if key[:2] == ("float32", "bfloat16")} == laid
    assert keys[("float32", "float32", (4, 32, 8))] == 4 * 32 * 8


def test_a_timed_relayout_is_priced_at_its_time_in_its_local_shape(tmp_path, monkeypatch):
    import metadist.cost.relayout_times as relayout_times

    timed = []

    def fake_time(key):
        timed.append(key)
        return 1e-6 * key[2][0] * key[2][1] * key[2][2] * (2 if key[1] == "bfloat16" else 1)

    monkeypatch.setattr(relayout_times, "time_relayout", fake_time)
    mesh = Mesh((2,))
    graph = _graph()
    cluster = _cluster(mesh, _device(sustained_slowdown=2.0, op_element_seconds={RELAYOUT: 1e-9}))
    priced = with_measured_relayouts(cluster, graph, tmp_path)
    keys = relayout_keys(graph, mesh)
    assert sorted(timed) == sorted(keys)
    assert load_table(table_path(tmp_path)) == {key: pytest.approx(fake_time(key)) for key in keys}  # unscaled
    timed.clear()
    assert with_measured_relayouts(cluster, graph, tmp_path) == priced and timed == []  # cached: nothing timed again
    assert with_measured_relayouts(cluster, graph, tmp_path, measure=False) == priced

    batch = NodeStrategy(choices=(AxisChoice("factor", 0),), inputs=((Shard(0),),), outputs=((Shard(0),),))
    rows = NodeStrategy(choices=(AxisChoice("factor", 0),), inputs=((Shard(2),),), outputs=((Shard(2),),))
    whole = NodeStrategy(choices=(AxisChoice("replicate"),), inputs=((Replicate(),),), outputs=((Replicate(),),))
    node = graph.node("laid")
    specs = [graph.value(name).spec for name in node.input_names]
    assert local_relayout_key(specs, [node.outputs[0].spec], rows, mesh) == ("float32", "float32", (8, 32, 8))
    assert _seconds(graph, "laid", batch, mesh, priced.device) == pytest.approx(1e-5 + 2.0 * 1e-6 * 4 * 32 * 16)
    assert _seconds(graph, "laid", whole, mesh, priced.device) == pytest.approx(1e-5 + 2.0 * 1e-6 * 8 * 32 * 16)
    assert _seconds(graph, "cast", rows, mesh, priced.device) == pytest.approx(1e-5 + 2.0 * 2e-6 * 8 * 32 * 8)
    # where the device timed nothing: the relayout's seconds per element; the plain copy is priced by its bytes
    assert _seconds(graph, "laid", whole, mesh, cluster.device) == pytest.approx(1e-5 + 1e-9 * 8 * 32 * 16)
    assert _seconds(graph, "plain", whole, mesh, priced.device) == _seconds(graph, "plain", whole, mesh, cluster.device)
    # a preset (no curves) is left as it is; the times survive a cluster document; a negative time is refused
    preset = _cluster(mesh, replace(_device(), matmul_curves=()))
    assert with_measured_relayouts(preset, graph, tmp_path) is preset
    assert Cluster.from_dict(json.loads(priced.to_json())) == priced
    with pytest.raises(ClusterError, match="positive"):
        _device(relayout_seconds=((next(iter(keys)), -1.0),))
    partial = NodeStrategy(choices=(AxisChoice("replicate"),), inputs=((Partial(),),), outputs=((Partial(),),))
    assert _seconds(graph, "laid", partial, mesh, priced.device) == pytest.approx(1e-5 + 2.0 * 1e-6 * 8 * 32 * 16)


def test_a_relayout_dearer_than_the_longest_timed_call_keeps_its_per_element_price(tmp_path, monkeypatch):
    import metadist.cost.relayout_times as relayout_times

    monkeypatch.setattr(relayout_times, "time_relayout", lambda key: pytest.fail(f"timed {key}"))
    mesh = Mesh((1,))
    cluster = _cluster(mesh, _device(op_element_seconds={RELAYOUT: 1.0}))  # a second an element: past the limit
    assert with_measured_relayouts(cluster, _graph(), tmp_path).device.relayout_seconds == ()
    # cheap, but its operand past LARGEST_TIMED_BYTES: its copies would hold that many bytes each
    monkeypatch.setattr(relayout_times, "LARGEST_TIMED_BYTES", 8 * 32 * 16 * 4 - 1)
    cheap = _cluster(mesh, _device(op_element_seconds={RELAYOUT: 1e-9}))
    assert with_measured_relayouts(cheap, _graph(), tmp_path).device.relayout_seconds == ()


def test_the_copy_is_timed_on_this_machine_as_the_runtime_runs_it():
    """The real copy, in a few small shapes: a clone and a cast of a transposed operand, each under 0.1 s."""
    for key in (("float32", "float32", (64, 32)), ("float32", "float32", (2, 64, 32)),
                ("float32", "bfloat16", (2, 64, 32)), ("bfloat16", "bfloat16", (3, 2, 16, 8))):
        assert 0 < time_relayout(key) < 0.1
    with pytest.raises(ValueError, match="last two dims"):
        time_relayout(("float32", "float32", (64,)))


def test_a_damaged_cache_says_how_to_redo_it(tmp_path):
    path = table_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ClusterError, match="delete the file"):
        load_table(path)
