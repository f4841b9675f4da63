"""Relayout copies of a step's own local shapes, timed on this machine (issue #16, part 2).

A relayout copies an operand whose last two dims are swapped against its row-major base into a row-major tensor
(:func:`~.compute.relayouts`: a gradient laid out as its weight, ``.contiguous()`` of a transposed view). torch runs a
2-D one with a blocked transpose kernel and any other as a strided copy, whose rate depends on the operand's row
stride far more than on its bytes. On this project's 2-core machine, one thread, float32, the transposed view of a
row-major ``[1024, 1024]`` copied at 0.42 ns an element (the calibration's relayout figure), of ``[8, 128, 1024]`` at
1.9 (a row stride of 4 KiB: each read of a column lands in the same cache sets), of ``[8, 128, 512]`` at 1.15, of
``[8, 128, 1000]`` at 0.38. mixtral-mini's bfloat16 step lays out its experts' float32 weight gradients so: four copies
priced 1.45 ms in all took 4.9 (``python -m metadist.bench.op_costs mixtral-mini --precision bf16 --nproc 4``), the
largest single misprice of its replicated plan.

So a step planned on this machine's calibrated cluster times each relayout it may run, once per local shape
(:func:`relayout_keys`: every way of giving each mesh axis to one of the operand's dims, or to none, as the largest
piece's shape), in its dtypes, one thread, one process at a time, each call on the next of several copies of its
operand (:data:`~.matmul_times.COLD_POOL_BYTES`), and the cost model prices such a node at its measured seconds
(:meth:`~.cluster.Device.measured_relayout_s`) times the calibration's sustained slowdown. The times are cached per
machine and torch version beside the calibration (:func:`table_path`), as the matmuls' are, and only missing shapes
are timed. A copy whose per-element price exceeds :data:`~.matmul_times.LONGEST_TIMED_S`, whose operand exceeds
:data:`LARGEST_TIMED_BYTES`, or any past
:data:`~.matmul_times.TIMING_BUDGET_S` of timing in one call, keeps its per-element price (the log says how many).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from ..ir import DTYPE_BYTES, Graph, Mesh
from .cluster import Cluster, RelayoutKey, relayout_key_of
from .compute import RELAYOUT, relayouts
from .timed_shapes import (cached_table_path, local_cuts, one_thread_seconds, read_times, time_within_budget,
                           with_timed, write_times)

__all__ = ["relayout_keys", "table_path", "load_table", "with_measured_relayouts", "time_relayout"]

TABLE_FORMAT = "metadist-relayout-times"
TABLE_VERSION = 1

LARGEST_TIMED_BYTES = 256 << 20
"""A relayout whose local operand holds more bytes than this is not timed (its copies would take their own multiple
of it in memory): it keeps its per-element price."""


def relayout_keys(graph: Graph, mesh: Mesh) -> dict[RelayoutKey, float]:
    """Each local relayout copy the step may run on ``mesh``, with its elements.

    A key is ``(dtype read, dtype written, shape)``: the shape of the copy's transposed operand, its largest piece for
    every way of giving each mesh axis to one of its dims or to none, as a strategy's sharding of the operand cuts it
    (:func:`~.compute.local_relayout_key` reads the same from a strategy)."""
    keys: dict[RelayoutKey, float] = {}
    for node in graph.nodes:
        if not node.output_values or not relayouts(graph, node):
            continue
        spec = graph.value(node.input_names[0]).spec
        written = node.output_values[0].spec.dtype
        for local in local_cuts(spec.shape, mesh.shape, range(spec.rank)):
            keys[(spec.dtype, written, local)] = float(math.prod(local))
    return keys


def table_path(cache_dir: Path) -> Path:
    """Where this machine's relayout times are cached (per machine and torch version, as a calibration)."""
    return cached_table_path(cache_dir, "relayout")


def load_table(path: Path) -> dict[RelayoutKey, float]:
    """The cached times at ``path`` (empty when there is none). A damaged file is an error that says how to redo it."""
    return read_times(path, TABLE_FORMAT, TABLE_VERSION, "relayout", relayout_key_of)


def _save_table(path: Path, table: dict[RelayoutKey, float]) -> None:
    write_times(path, TABLE_FORMAT, TABLE_VERSION, table)


def time_relayout(key: RelayoutKey) -> float:
    """Median seconds of one relayout copy ``key`` names, on the CPU, one thread (as each rank of a local run): the
    transposed view of a row-major operand copied into a row-major tensor of the dtype written (``clone``, or
    ``_to_copy`` where the dtype changes, as the runtime runs them), each call on the next of several copies of the
    operand (:data:`~.matmul_times.COLD_POOL_BYTES`), as a step reads one that other ops wrote."""
    import torch

    from .matmul_times import COLD_POOL_BYTES, COLD_POOL_PAIRS

    read, written, shape = key
    if len(shape) < 2:
        raise ValueError(f"a relayout swaps its operand's last two dims: shape {shape} has fewer than 2")
    source, target = getattr(torch, read), getattr(torch, written)
    generator = torch.Generator().manual_seed(0)
    nbytes = max(math.prod(shape), 1) * source.itemsize
    count = max(2, min(COLD_POOL_PAIRS, -(-COLD_POOL_BYTES // nbytes)))
    operands = [torch.randn(*shape[:-2], shape[-1], shape[-2], generator=generator).to(source).transpose(-1, -2)
                for _ in range(count)]
    cycle = itertools.cycle(operands)
    if source == target:
        def call() -> None:
            torch.ops.aten.clone.default(next(cycle), memory_format=torch.contiguous_format)
    else:
        def call() -> None:
            torch.ops.aten._to_copy.default(next(cycle), dtype=target, memory_format=torch.contiguous_format)

    return one_thread_seconds(call)


def with_measured_relayouts(cluster: Cluster, graph: Graph, cache_dir: Path, *, measure: bool = True,
                            announce=None) -> Cluster:
    """``cluster`` with its device pricing ``graph``'s relayout copies at their times on this machine.

    The cached times are read; with ``measure``, the shapes missing are timed first (within the timing budget) and the
    cache written (atomically). Only a calibrated CPU cluster is changed (its device has matmul curves, which the
    presets do not); on it each time is scaled by the calibration's sustained slowdown, as its rates are.
    ``announce(text)`` is told before a timing of more than a few shapes starts."""
    if not cluster.device.matmul_curves:
        return cluster
    keys = relayout_keys(graph, cluster.mesh)
    if not keys:
        return cluster
    path = table_path(cache_dir)
    device = cluster.device

    def priced_s(key: RelayoutKey) -> float:  # the per-element price the node keeps where it is not timed
        if keys[key] * DTYPE_BYTES[key[0]] > LARGEST_TIMED_BYTES:
            return math.inf  # past the longest timed call: not timed
        return device.element_seconds(RELAYOUT, key[0]) * keys[key]

    def time_missing(missing: list[RelayoutKey]) -> tuple[dict[RelayoutKey, float], int]:
        return time_within_budget(missing, priced_s, lambda key: time_relayout(key), "relayout", announce, path)

    note = "%d relayout shape(s) keep their per-element price (priced above the longest timed call, or past the budget)"
    return with_timed(cluster, keys, path, read=load_table, write=_save_table, field="relayout_seconds",
                      time_missing=time_missing, measure=measure, skipped_note=note)
