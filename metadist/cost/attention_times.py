"""Fused attention of a step's own local shapes, timed on this machine (issue #16, part 2).

torch runs ``scaled_dot_product_attention`` on a CPU as one fused kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward), the default attention of HuggingFace's models. Its rate depends on the shape and the dtype far more
than a FLOP count says: on this project's 2-core machine, one thread, the forward of ``[8, 4, 64, 16]`` float32 queries
ran at 39 GFLOP/s and of ``[8, 4, 256, 64]`` at 118; the bfloat16 backward of the first at 5 (counting 2.5x the
forward's FLOPs), 20x slower than its forward. The cost model priced gpt2-tiny's bfloat16 step (batch 16 x 64, 2
processes) at 19 ms where it ran in 30-33: its two attention backwards took 10.5 ms a step, priced at 0.1.

So a step planned on this machine's calibrated cluster times each fused attention it may run, once per local shape
(:func:`attention_keys`: every way of giving each mesh axis to the batch, the heads, the query length, the key length
or the value width, or to none, as the largest piece's shapes), forward and backward, one thread, one process at a
time; the cost model prices such a node at its measured seconds (:meth:`~.cluster.Device.measured_attention_s`) times
the calibration's sustained slowdown. The times are cached per machine and torch version beside the calibration
(:func:`table_path`), as the matmuls' are (:mod:`.matmul_times`), and only missing shapes are timed. A shape
whose roofline price exceeds :data:`~.matmul_times.LONGEST_TIMED_S`, or any past
:data:`~.matmul_times.TIMING_BUDGET_S` of timing in one call, keeps its roofline price (the log says how many).

A node with a dropout probability is not timed (the fused kernel's rate with dropout was not measured): it keeps its
roofline price.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..ir import Graph, Literal, Mesh, Node, ValueRef
from ..ir.graph import _refs
from .cluster import AttentionKey, Cluster, attention_key_of
from .timed_shapes import (cached_table_path, one_thread_seconds, read_times, time_within_budget, with_timed,
                           write_times)

__all__ = ["ATTENTION_OPS", "AttentionCall", "attention_call", "attention_keys", "table_path", "load_table",
           "with_measured_attention", "time_attention"]

ATTENTION_OPS = {"_scaled_dot_product_flash_attention_for_cpu": "forward",
                 "_scaled_dot_product_flash_attention_for_cpu_backward": "backward"}
"""The fused attention ops timed by shape (:func:`~.compute.op_name`), and which way each runs."""

_POSITIONS = {"forward": (0, 1, 2), "backward": (1, 2, 3)}
"""The positions of the query, key and value among each op's arguments."""

_FLAGS = {"forward": (3, 4), "backward": (6, 7)}
"""The positions of ``dropout_p`` and ``is_causal`` among each op's arguments."""

TABLE_FORMAT = "metadist-attention-times"
TABLE_VERSION = 1

ROLES = (None, "batch", "heads", "length", "kv_length", "value_width")
"""What a mesh axis may cut in an attention's local work (:func:`attention_keys`)."""


@dataclass(frozen=True)
class AttentionCall:
    """How one fused attention node reads its operands: the positions of its query, key, value and mask among the
    node's inputs (:attr:`metadist.ir.Node.input_names`; the mask None when it has none), and whether it is causal."""

    direction: str
    """``forward`` or ``backward``."""
    query: int
    key: int
    value: int
    mask: int | None
    causal: bool


def attention_call(node: Node) -> AttentionCall | None:
    """The fused attention call of ``node``; None when it is not one (:data:`ATTENTION_OPS`), its arguments are not as
    the op's schema lays them out, or it draws dropout."""
    from .compute import op_name

    direction = ATTENTION_OPS.get(op_name(node.op.target))
    if direction is None:
        return None
    args, kwargs = node.args, dict(node.kwargs)
    positions = _POSITIONS[direction]
    if len(args) <= positions[-1] or not all(isinstance(args[i], ValueRef) for i in positions):
        return None
    dropout_at, causal_at = _FLAGS[direction]
    dropout = _plain(args[dropout_at] if len(args) > dropout_at else kwargs.get("dropout_p", 0.0))
    causal = _plain(args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False))
    if not isinstance(dropout, (int, float)) or dropout != 0 or not isinstance(causal, bool):
        return None
    # the node's inputs are every argument's refs, then the keyword arguments' (Node.input_names)
    ordered = [*args, *(arg for _, arg in node.kwargs)]
    refs = [_refs_before(ordered, i) for i in positions]
    mask = kwargs.get("attn_mask")
    mask_at = None
    if isinstance(mask, ValueRef):
        mask_at = _refs_before(ordered, len(args) + [name for name, _ in node.kwargs].index("attn_mask"))
    elif mask is not None:
        return None
    return AttentionCall(direction, *refs, mask=mask_at, causal=causal)


def _plain(arg: Any) -> Any:
    return arg.value if isinstance(arg, Literal) else arg


def _refs_before(arguments: list, index: int) -> int:
    """The position among a node's inputs of the tensor argument at ``index`` of its ``arguments`` (its args, then its
    keyword arguments' values)."""
    return sum(1 for arg in arguments[:index] for _ in _refs(arg))


def local_key(direction: str, dtype: str, query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...],
              mask: tuple[int, ...] | None, mask_dtype: str, causal: bool) -> AttentionKey:
    """The key of one local attention call in :attr:`~.cluster.Device.attention_seconds`."""
    return (direction, dtype, tuple(query), tuple(key), tuple(value), tuple(mask) if mask is not None else (),
            mask_dtype if mask is not None else "", bool(causal))


def attention_keys(graph: Graph, mesh: Mesh) -> dict[AttentionKey, float]:
    """Each local fused attention the step may run on ``mesh``, with its forward FLOPs (the roofline's measure).

    For every way of giving each mesh axis one of :data:`ROLES` (the batch, the heads, the query length, the key
    length, the value width) or none, the largest piece's shapes: a query ``[B, H, L, D]`` cut on its batch, heads
    and length; a key ``[B, Hk, S, D]`` on its batch, heads and length; a value ``[B, Hk, S, Dv]`` on those and its
    width; a mask ``[..., L, S]`` on whichever of those dims it spans (a dim of 1 broadcasts, uncut).
    """
    keys: dict[AttentionKey, float] = {}
    for node, call in attention_nodes(graph):
        specs = [graph.value(name).spec for name in node.input_names]
        query, key, value = (specs[i] for i in (call.query, call.key, call.value))
        mask = specs[call.mask] if call.mask is not None else None
        if query.rank != 4 or key.rank != 4 or value.rank != 4 or (mask is not None and not 2 <= mask.rank <= 4):
            continue
        for assignment in itertools.product(ROLES, repeat=mesh.ndim):
            pieces = {role: 1 for role in ROLES[1:]}
            for axis, role in enumerate(assignment):
                if role is not None:
                    pieces[role] *= mesh.shape[axis]

            def cut(shape: tuple[int, ...], roles: tuple[str | None, ...]) -> tuple[int, ...]:
                """The largest piece of ``shape`` whose dims the ``roles`` name (None: uncut; a dim of 1 broadcasts)."""
                return tuple(size if role is None or size == 1 else -(-size // pieces[role])
                             for role, size in zip(roles, shape))

            local_query = cut(query.shape, ("batch", "heads", "length", None))
            local_key_shape = cut(key.shape, ("batch", "heads", "kv_length", None))
            local_value = cut(value.shape, ("batch", "heads", "kv_length", "value_width"))
            local_mask = None
            if mask is not None:
                local_mask = cut(mask.shape, ("batch", "heads", "length", "kv_length")[4 - mask.rank:])
            entry = local_key(call.direction, query.dtype, local_query, local_key_shape, local_value, local_mask,
                              mask.dtype if mask is not None else "", call.causal)
            keys[entry] = 4.0 * local_query[0] * local_query[1] * local_query[2] * local_key_shape[2] * local_query[3]
    return keys


def attention_nodes(graph: Graph) -> Iterator[tuple[Node, AttentionCall]]:
    """Each fused attention node of ``graph`` with its call."""
    for node in graph.nodes:
        call = attention_call(node)
        if call is not None:
            yield node, call


def table_path(cache_dir: Path) -> Path:
    """Where this machine's attention times are cached (per machine and torch version, as a calibration)."""
    return cached_table_path(cache_dir, "attention")


def load_table(path: Path) -> dict[AttentionKey, float]:
    """The cached times at ``path`` (empty when there is none). A damaged file is an error that says how to redo it."""
    return read_times(path, TABLE_FORMAT, TABLE_VERSION, "attention", attention_key_of)


def _save_table(path: Path, table: dict[AttentionKey, float]) -> None:
    write_times(path, TABLE_FORMAT, TABLE_VERSION, table)


def time_attention(key: AttentionKey) -> float:
    """Median seconds of one call of the fused attention ``key`` names, on the CPU, one thread (as each rank of a local
    run). A backward is timed on the forward's own output and log-sum-exp of the same operands."""
    import torch

    direction, dtype_name, query_shape, key_shape, value_shape, mask_shape, mask_dtype, causal = key
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)
    query, key_tensor, value = (torch.randn(shape, generator=generator).to(dtype)
                                for shape in (query_shape, key_shape, value_shape))
    mask = None
    if mask_shape:
        mask = (torch.rand(mask_shape, generator=generator) > 0.1 if mask_dtype == "bool"
                else torch.zeros(mask_shape).to(getattr(torch, mask_dtype)))
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if direction == "forward":
        return one_thread_seconds(lambda: forward(query, key_tensor, value, 0.0, causal, attn_mask=mask))
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, logsumexp = forward(query, key_tensor, value, 0.0, causal, attn_mask=mask)
    grad = torch.randn(out.shape, generator=generator).to(dtype)
    return one_thread_seconds(
        lambda: backward(grad, query, key_tensor, value, out, logsumexp, 0.0, causal, attn_mask=mask))


def with_measured_attention(cluster: Cluster, graph: Graph, cache_dir: Path, *, measure: bool = True,
                            announce=None) -> Cluster:
    """``cluster`` with its device pricing ``graph``'s fused attention at its times on this machine.

    The cached times are read; with ``measure``, the shapes missing are timed first (within the timing budget) and the
    cache written (atomically). Only a calibrated CPU cluster is changed (its device has matmul curves, which the
    presets do not); on it each time is scaled by the calibration's sustained slowdown, as its rates are.
    ``announce(text)`` is told before a timing of more than a few shapes starts.
    """
    if not cluster.device.matmul_curves:
        return cluster
    keys = attention_keys(graph, cluster.mesh)
    if not keys:
        return cluster
    path = table_path(cache_dir)
    note = ("%d attention shape(s) keep their roofline price (priced above the longest timed call, refused by torch, "
            "or past the timing budget)")
    return with_timed(cluster, keys, path, read=load_table, write=_save_table, field="attention_seconds",
                      time_missing=lambda missing: _time_missing(missing, keys, cluster, announce, path),
                      measure=measure, skipped_note=note)


def _time_missing(missing: list[AttentionKey], keys: dict[AttentionKey, float], cluster: Cluster, announce,
                  path: Path) -> tuple[dict[AttentionKey, float], int]:
    device = cluster.device

    def roofline_s(key: AttentionKey) -> float:  # a backward does about 2.5 forwards' work
        return keys[key] * (2.5 if key[0] == "backward" else 1.0) / device.flops_per_s(key[1], keys[key])

    return time_within_budget(missing, roofline_s, lambda key: time_attention(key), "attention", announce, path,
                              refused=(RuntimeError,))
