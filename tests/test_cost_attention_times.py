"""Fused attention priced at its times on this machine, by local shape (:mod:`metadist.cost.attention_times`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from test_cost_matmul_times import _cluster, _device

from metadist.cost import Cluster, ClusterError
from metadist.cost.attention_times import (attention_call, attention_keys, load_table, local_key, table_path,
                                           time_attention, with_measured_attention)
from metadist.cost.compute import compute_seconds, local_attention_key, node_work
from metadist.ir import Graph, GraphInput, GraphOutput, MetaOp, Mesh, Node, Replicate, Role, Shard, TensorSpec, Value, ValueRef
from metadist.ir.plan import AxisChoice, NodeStrategy

FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
QUERY = (4, 2, 8, 4)  # [batch, heads, length, head width]


def _graph(dtype: str = "bfloat16", dropout: float = 0.0) -> Graph:
    """A masked attention forward as LLaMA's capture has it (mask ``[4, 1, 8, 8]`` as a keyword, a scale), its
    backward with the flags positional, and a causal attention without a mask."""
    spec = TensorSpec(QUERY, dtype)
    lse = TensorSpec(QUERY[:3], "float32")
    nodes = (
        Node("attn", MetaOp(FORWARD), (ValueRef("q"), ValueRef("k"), ValueRef("v"), dropout),
             (("attn_mask", ValueRef("mask")), ("scale", 0.5)), (Value("out", spec), Value("lse", lse))),
        Node("attn_bwd", MetaOp(BACKWARD),
             (ValueRef("grad"), ValueRef("q"), ValueRef("k"), ValueRef("v"), ValueRef("out"), ValueRef("lse"), 0.0, False),
             (("attn_mask", ValueRef("mask")), ("scale", 0.5)),
             (Value("gq", spec), Value("gk", spec), Value("gv", spec))),
        Node("causal", MetaOp(FORWARD), (ValueRef("q"), ValueRef("k"), ValueRef("v"), 0.0, True), (),
             (Value("out2", spec), Value("lse2", lse))),
    )
    inputs = tuple(GraphInput(Value(name, spec), Role.BATCH) for name in ("q", "k", "v", "grad")) + (
        GraphInput(Value("mask", TensorSpec((4, 1, 8, 8), dtype)), Role.BATCH),)
    return Graph(inputs, nodes, (GraphOutput("gq", Role.LOSS), GraphOutput("out2", Role.METRIC)), name="attention")


def test_the_call_names_the_query_key_value_and_mask_among_the_inputs():
    graph = _graph()
    forward, backward, causal = (attention_call(graph.node(name)) for name in ("attn", "attn_bwd", "causal"))
    assert (forward.direction, forward.query, forward.key, forward.value, forward.mask, forward.causal) == \
        ("forward", 0, 1, 2, 3, False)
    assert graph.node("attn").input_names[forward.mask] == "mask"
    assert (backward.direction, backward.query, backward.key, backward.value, backward.mask) == ("backward", 1, 2, 3, 6)
    assert graph.node("attn_bwd").input_names[backward.mask] == "mask"
    assert causal.mask is None and causal.causal
    assert attention_call(_graph(dropout=0.1).node("attn")) is None  # dropout: not timed, its roofline price stays
    assert node_work(graph, graph.node("attn_bwd")).attention == backward


def test_the_keys_are_every_cut_of_batch_heads_lengths_and_value_width_over_the_mesh():
    keys = attention_keys(_graph(), Mesh((2, 2)))
    forward = {key for key in keys if key[0] == "forward" and key[5]}
    # the unsplit call, the batch on one axis (the mask's batch with it), the heads on both (the mask's 1 stays)
    assert local_key("forward", "bfloat16", QUERY, QUERY, QUERY, (4, 1, 8, 8), "bfloat16", False) in forward
    assert local_key("forward", "bfloat16", (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), (2, 1, 8, 8), "bfloat16",
                     False) in forward
    assert local_key("forward", "bfloat16", (4, 1, 8, 4), (4, 1, 8, 4), (4, 1, 8, 4), (4, 1, 8, 8), "bfloat16",
                     False) in forward
    # the query's length on one axis, the key's on the other; the value's width on both
    assert local_key("forward", "bfloat16", (4, 2, 4, 4), (4, 2, 4, 4), (4, 2, 4, 4), (4, 1, 4, 4), "bfloat16",
                     False) in forward
    assert local_key("forward", "bfloat16", QUERY, QUERY, (4, 2, 8, 1), (4, 1, 8, 8), "bfloat16", False) in forward
    assert {key[0] for key in keys} == {"forward", "backward"}
    assert any(key[7] and not key[5] for key in keys)  # the causal call, without a mask
    assert keys[local_key("backward", "bfloat16", QUERY, QUERY, QUERY, (4, 1, 8, 8), "bfloat16", False)] == \
        4.0 * 4 * 2 * 8 * 8 * 4


def test_a_timed_attention_is_priced_at_its_time_in_its_local_shapes(tmp_path, monkeypatch):
    import metadist.cost.attention_times as attention_times

    timed = []

    def fake_time(key):
        timed.append(key)
        return 1e-3 * key[2][0] * key[2][1] * key[2][2]  # a figure per shape, to find again

    monkeypatch.setattr(attention_times, "time_attention", fake_time)
    mesh = Mesh((2,))
    graph = _graph()
    cluster = _cluster(mesh, _device(sustained_slowdown=2.0))
    priced = with_measured_attention(cluster, graph, tmp_path)
    keys = attention_keys(graph, mesh)
    assert sorted(timed) == sorted(keys)
    assert load_table(table_path(tmp_path)) == {key: pytest.approx(fake_time(key)) for key in keys}  # unscaled
    timed.clear()
    assert with_measured_attention(cluster, graph, tmp_path) == priced and timed == []  # cached: nothing timed again
    assert with_measured_attention(cluster, graph, tmp_path, measure=False) == priced

    node = graph.node("attn_bwd")
    work = node_work(graph, node)
    specs = [graph.value(name).spec for name in node.input_names]
    outs = [value.spec for value in node.output_values]
    batch = NodeStrategy(choices=(AxisChoice("factor", 0),), inputs=((Shard(0),),) * 7, outputs=((Shard(0),),) * 3)
    whole = NodeStrategy(choices=(AxisChoice("replicate"),), inputs=((Replicate(),),) * 7, outputs=((Replicate(),),) * 3)
    assert local_attention_key(work.attention, specs, batch, mesh) == local_key(
        "backward", "bfloat16", (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), (2, 1, 8, 8), "bfloat16", False)
    assert compute_seconds(work, specs, outs, batch, mesh, priced.device) == pytest.approx(1e-5 + 2.0 * 1e-3 * 2 * 2 * 8)
    assert compute_seconds(work, specs, outs, whole, mesh, priced.device) == pytest.approx(1e-5 + 2.0 * 1e-3 * 4 * 2 * 8)
    # the same node on a device that timed nothing: its roofline, 2.5 forwards' FLOPs at the bfloat16 curve
    roofline = compute_seconds(work, specs, outs, whole, mesh, cluster.device)
    assert roofline >= 2.5 * 4.0 * 4 * 2 * 8 * 8 * 4 / 1.3e9
    # a preset (no curves) is left as it is; the times survive a cluster document
    preset = _cluster(mesh, replace(_device(), matmul_curves=()))
    assert with_measured_attention(preset, graph, tmp_path) is preset
    assert Cluster.from_dict(json.loads(priced.to_json())) == priced
    with pytest.raises(ClusterError, match="positive"):
        _device(attention_seconds=((next(iter(keys)), -1.0),))


def test_the_kernel_is_timed_forward_and_backward_on_this_machine():
    """The real kernel, in a few small shapes: a backward takes longer than its forward, a masked call runs."""
    forward = local_key("forward", "float32", (2, 2, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), (2, 1, 16, 16), "float32",
                        False)
    backward = ("backward", *forward[1:])
    causal = local_key("backward", "bfloat16", (2, 2, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), None, "", True)
    seconds = [time_attention(key) for key in (forward, backward, causal)]
    assert all(0 < value < 0.1 for value in seconds)
    assert seconds[1] > seconds[0]


def test_a_damaged_cache_says_how_to_redo_it(tmp_path):
    path = table_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ClusterError, match="delete the file"):
        load_table(path)


def test_a_captured_llama_prices_its_attention_by_its_local_calls():
    """LLaMA's default attention (SDPA) as the capture records it: every fused call is read, forward and backward."""
    from metadist.frontends.torch import capture_step
    from metadist.workloads import builtin_workload

    workload = builtin_workload("llama-tiny", device="cpu")
    step = capture_step(workload.train_step(), workload.model, workload.optimizer(workload.model.parameters()),
                        workload.batch, name="llama-tiny")
    graph = step.graph
    calls = [attention_call(node) for node in graph.nodes if "scaled_dot_product" in node.op.target]
    assert len(calls) == 4 and all(call is not None for call in calls)
    assert sorted(call.direction for call in calls) == ["backward", "backward", "forward", "forward"]
    keys = attention_keys(graph, Mesh((2,)))
    batch, heads, length, width = graph.value(next(node for node in graph.nodes if "scaled_dot_product" in
                                                   node.op.target).input_names[0]).spec.shape
    assert any(key[2] == (batch // 2, heads, length, width) for key in keys)
