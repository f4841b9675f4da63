"""Matmuls of a step's own local shapes, timed on this machine (issue #16, part 2).

A CPU's bfloat16 and float16 matmul kernels run at rates that depend on the shape as much as on the FLOPs and the
layout: on this project's 2-core machine, one thread, gpt2-tiny's bfloat16 step (batch 16 x 64) has a row-major
``[1024, 64] x [64, 256]`` at 2.6 GFLOP/s and a ``[1024, 1000] x [1000, 64]`` at 2.1, where the row-major curve measured
on square matmuls (``Device.matmul_curves``) gives 1.1 and 1.0; and a ``[1024, 64] x [64, 1000]`` with its second
operand transposed at 3.7 GFLOP/s where the ``nt`` curve gives 7.0. Priced on the curves, that step came out at 1.52x
its time (413 ms against 271, ``python -m metadist.bench.op_costs gpt2-tiny --batch-size 16 --seq-len 64 --precision
bf16``), and the bench's bfloat16 rows at 0.63-0.83 measured over predicted. float32 matmuls ran at one rate whatever
their layout or aspect there (61-67 GFLOP/s a thread) and kept the curves up to the forty-ninth session.

float32 matmuls are now timed by shape too (:data:`TIMED_DTYPES`): on a later 2-core machine (AMD EPYC, 1 MiB of L2 a
core) a one-thread float32 matmul of llama-tiny's shapes ran 1.24-1.87x its square-curve price (45-74 GFLOP/s, the
64-wide ones slowest) and mixtral-mini's ``bmm``s 1.07-1.57x, and inside llama-tiny's rank program its plan's
float32 matmuls ran at about 1.5x their price where the timed bfloat16 ones ran at theirs (planning notes, fiftieth
session).

So a step planned on this machine's calibrated cluster times each matmul it may run, once per
local shape (:func:`matmul_keys`: every split of its dims over the mesh axes, as the largest piece's shape), in its
layout, one thread, one process at a time, and the cost model prices such a node at its measured seconds
(:meth:`~.cluster.Device.measured_matmul_s`) times the calibration's sustained slowdown. The times are cached per
machine and torch version beside the calibration (:func:`table_path`) and only missing shapes are timed: on the
bench page of 2026-12-07 (operands cycled, :data:`COLD_POOL_BYTES`) the first bfloat16 plan timed gpt2-tiny's on 2x2
in 4.1 s, mixtral-mini's in 8.3, once. A matmul whose curve price exceeds :data:`LONGEST_TIMED_S`, or any past
:data:`TIMING_BUDGET_S` of timing in one call, keeps its curve price (the log says how many).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Iterator

from ..ir import Graph, Mesh, Node
from .cluster import Cluster, MatmulKey
from .compute import _BATCHED, Work, compute_dtype, node_work
from .timed_shapes import (cached_table_path, local_cuts, one_thread_seconds, read_times, time_within_budget,
                           with_timed, write_times)

__all__ = ["NARROW_DTYPES", "TIMED_DTYPES", "narrow_matmuls", "matmul_keys", "table_path", "load_table",
           "with_measured_matmuls", "time_matmul"]

NARROW_DTYPES = ("bfloat16", "float16")
"""The narrow dtypes: their CPU matmul kernels' rates depend on the layout most (the runtime reads a narrow matmul's
``nt``/``tn`` operand layout from the capture, :mod:`metadist.runtime.graph_module`)."""

TIMED_DTYPES = ("float32", *NARROW_DTYPES)
"""The dtypes whose matmuls are timed by shape (module docstring: float32's too, since the fiftieth session)."""

LONGEST_TIMED_S = 0.5
"""A matmul the curves price above this (one call, before the slowdown) is not timed: it keeps its curve price."""

TIMING_BUDGET_S = 60.0
"""Seconds of timing one call of :func:`with_measured_matmuls` spends at most; the shapes left keep their curve price
and are timed by a later call."""

TABLE_FORMAT = "metadist-matmul-times"
TABLE_VERSION = 1


def narrow_matmuls(graph: Graph, dtypes: Iterable[str] = NARROW_DTYPES) -> Iterator[tuple[Node, Work, str]]:
    """(node, its work, its compute dtype) of each matmul of ``graph`` (a node with two matmul operands) that computes
    in one of ``dtypes``."""
    wanted = frozenset(dtypes)
    for node in graph.nodes:
        work = node_work(graph, node)
        if work.operands is None:
            continue
        dtype = compute_dtype([graph.value(name).spec for name in node.input_names],
                              [value.spec for value in node.output_values])
        if dtype in wanted:
            yield node, work, dtype


def matmul_keys(graph: Graph, mesh: Mesh, dtypes: Iterable[str] = TIMED_DTYPES) -> dict[MatmulKey, float]:
    """Each local matmul shape the step's matmuls in ``dtypes`` may run on ``mesh``, with its FLOPs.

    A key is ``(dtype, layout, batch, m, k, n)`` (``batch`` 0 for a plain matmul): the largest piece's shape for every
    way of giving each mesh axis to one of the matmul's dims (batch, rows, contraction, columns) or to none, as a
    strategy's shardings of its operands cut them (:func:`~.compute.local_matmul_key` reads the same from a strategy).
    """
    keys: dict[MatmulKey, float] = {}
    for node, work, dtype in narrow_matmuls(graph, dtypes):
        first, second = (graph.value(node.input_names[i]).spec.shape for i in work.operands)
        if len(first) < 2 or len(second) < 2:
            continue
        batched = work.op in _BATCHED
        dims = (math.prod(first[:-2]) if batched else 0, first[-2], first[-1], second[-1])
        for local in local_cuts(dims, mesh.shape, range(0 if batched else 1, 4)):
            keys[(dtype, work.layout, *local)] = 2.0 * max(local[0], 1) * local[1] * local[2] * local[3]
    return keys


def table_path(cache_dir: Path) -> Path:
    """Where this machine's matmul times are cached (per machine and torch version, as a calibration)."""
    return cached_table_path(cache_dir, "matmul")


def load_table(path: Path) -> dict[MatmulKey, float]:
    """The cached times at ``path`` (empty when there is none). A damaged file is an error that says how to redo it."""
    return read_times(path, TABLE_FORMAT, TABLE_VERSION, "matmul",
                      lambda row: (str(row[0]), str(row[1]), *(int(size) for size in row[2:6])))


def _save_table(path: Path, table: dict[MatmulKey, float]) -> None:
    write_times(path, TABLE_FORMAT, TABLE_VERSION, table)


COLD_POOL_BYTES = 16 << 20
"""Bytes of the operand copies :func:`time_matmul` cycles through (at least two pairs, at most
:data:`COLD_POOL_PAIRS`): a step's matmul reads operands that other ops wrote since its last call, not ones its own
last call left in the core's caches (8x this project's machine's 2 MiB of L2 a core)."""

COLD_POOL_PAIRS = 256
"""The most operand pairs :func:`time_matmul` cycles through (a small matmul's pairs would fill the pool in the
thousands)."""


def time_matmul(key: MatmulKey) -> float:
    """Median seconds of one call of the matmul ``key`` names, on the CPU, one thread (as each rank of a local run),
    each call on the next of several copies of its operands (:data:`COLD_POOL_BYTES`), as a step runs it.

    Timed on one pair of operands, each call found them where its last call left them, in the core's caches:
    gpt2-tiny's bfloat16 plan on 2 processes (batch 16 x 64) ran its matmuls at 1.95x and its ``addmm`` at 2.2x the
    times so measured, inside its rank's program (up to calibration version 31); on cycled copies a ``[1000, 512] x [512,
    64]`` with its first operand transposed took 1.2-1.5x its time on one pair."""
    import itertools

    import torch

    from .calibrate_worker import _operand

    dtype_name, layout, batch, m, k, n = key
    cpu, dtype, lead = torch.device("cpu"), getattr(torch, dtype_name), (batch,) if batch else ()
    pair_bytes = (m * k + k * n) * max(batch, 1) * dtype.itemsize
    count = max(2, min(COLD_POOL_PAIRS, -(-COLD_POOL_BYTES // pair_bytes)))
    pairs = [(_operand(m, k, cpu, dtype, layout == "tn", lead), _operand(k, n, cpu, dtype, layout == "nt", lead))
             for _ in range(count)]
    cycle = itertools.cycle(pairs)
    op = torch.bmm if batch else torch.mm

    def call() -> None:
        a, b = next(cycle)
        op(a, b)

    return one_thread_seconds(call)


def with_measured_matmuls(cluster: Cluster, graph: Graph, cache_dir: Path, *, measure: bool = True,
                          announce=None) -> Cluster:
    """``cluster`` with its device pricing ``graph``'s matmuls (:data:`TIMED_DTYPES`) at their times on this machine.

    The cached times are read; with ``measure``, the shapes missing are timed first (within :data:`TIMING_BUDGET_S`)
    and the cache written (atomically). Only a calibrated CPU cluster is changed (its device has matmul curves, which
    the presets do not); on it each time is scaled by the calibration's sustained slowdown, as its rates are.
    ``announce(text)`` is told before a timing of more than a few shapes starts.
    """
    if not cluster.device.matmul_curves:
        return cluster
    keys = matmul_keys(graph, cluster.mesh)
    if not keys:
        return cluster
    path = table_path(cache_dir)
    note = (f"%d matmul shape(s) keep their curve price (priced above {LONGEST_TIMED_S:.1f} s, or past the "
            f"{TIMING_BUDGET_S:.0f} s timing budget)")
    return with_timed(cluster, keys, path, read=load_table, write=_save_table, field="matmul_seconds",
                      time_missing=lambda missing: _time_missing(missing, keys, cluster, announce, path),
                      measure=measure, skipped_note=note)


def _time_missing(missing: list[MatmulKey], keys: dict[MatmulKey, float], cluster: Cluster, announce,
                  path: Path) -> tuple[dict[MatmulKey, float], int]:
    device = cluster.device

    def curve_s(key: MatmulKey) -> float:
        dtype, layout = key[0], key[1]
        flops = keys[key]
        rate_flops = flops / key[2] if key[2] > 1 else flops
        return flops / device.flops_per_s(dtype, rate_flops, layout)

    return time_within_budget(missing, curve_s, lambda key: time_matmul(key), "matmul", announce, path)
