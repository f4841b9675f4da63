"""Calibration: launch the collective benchmark with torchrun and fit alpha-beta per mesh axis.

For every axis, each measurement of a collective on ``n`` devices moving a local buffer of
``B`` bytes gives one equation of the ring model used by :mod:`.comm`:
``seconds = call_overhead + steps * alpha + sent_bytes / bandwidth`` (``steps`` and
``sent_bytes`` as in :func:`.comm.collective_seconds`). The three are fitted by least squares
of the relative error over all sizes and collectives of that axis (minimum norm where one axis size cannot tell
the overhead from alpha), and clipped to stay physical. On gloo a reduce-scatter is an all-reduce
of its input (:attr:`.cluster.Link.reduce_scatter_as_all_reduce`) and is fitted as one there; its own measured line
(:func:`_kind_lines`) prices it, with the all-reduce's bytes.

The device figures (matmul FLOP/s, elementwise bytes/s, the fixed seconds of one op) are measured
on every process at once, as a training step computes, and the slowest process's are kept. On CPU
the fixed seconds of one op come from a small captured step run by the runtime
(:func:`runtime_op_overhead`), and each link's ``sync_s`` from an all-reduce issued between compute
phases (:func:`collective_sync_s`).

**Launches.** Where the processes outnumber the host's cores, the calibration launches its workers
:data:`SHARED_CORE_LAUNCHES` times and keeps each figure's median over the launches (:func:`merge_reports`): which
processes share a core is settled by the scheduler anew in each launch, and one launch's figures could be far off
(:func:`default_launches`).

**Cache.** :func:`machine_cluster` measures this machine the first time a CPU run or benchmark
plans on it (one progress line; 15 s on 2 processes, 2 minutes on 4 (three launches), on this project's 2-core
machine) and keeps the report in ``<cache dir>/calibration/``, keyed by a fingerprint of the machine (processor
model, core count, memory; no host name), the torch version, the backend and the process count; ``metadist
calibrate`` measures again and replaces it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..ir import Mesh
from .cluster import Cluster, ClusterError, Device, Link
from .comm import backend_reduce_scatters_as_all_reduce, carried_kind

logger = logging.getLogger(__name__)

_STEPS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


QUICK_SIZES = "4096,262144,2097152,33554432"
"""Message sizes of the automatic calibration (bytes): short enough to run on first use, and as large as a large
model's shards and buckets (gloo's all-gather of a 32 MiB shard ran at half the bytes/s of a 2 MiB one)."""

FULL_SIZES = "4096,65536,1048576,4194304,33554432"
"""Message sizes of ``metadist calibrate`` (bytes)."""


def _sent_bytes(op: str, buffer_bytes: float, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n * buffer_bytes
    if op == "all_gather":
        return (n - 1) * buffer_bytes
    return (n - 1) / n * buffer_bytes


def fit_link(measurements: list[Mapping[str, Any]], axis_size: int, name: str, reduce_scatter_as_all_reduce: bool = False) -> Link:
    """Least-squares alpha (latency) and beta (1 / bandwidth) of one axis from its measurements.

    ``reduce_scatter_as_all_reduce``: the backend runs a reduce-scatter as an all-reduce (gloo); it is fitted as one.
    """
    if axis_size <= 1 or not measurements:
        return Link(bandwidth_bytes_per_s=1e12, latency_s=0.0, name=f"{name} (not measured)",
                    reduce_scatter_as_all_reduce=reduce_scatter_as_all_reduce)

    def wire(op: str) -> str:
        return carried_kind(op, reduce_scatter_as_all_reduce)

    rows = [[1.0, _STEPS[wire(m["op"])] * (axis_size - 1), _sent_bytes(wire(m["op"]), m["bytes"], axis_size)] for m in measurements]
    seconds = np.array([m["seconds"] for m in measurements])
    weight = 1.0 / np.maximum(seconds, 1e-9)  # relative errors: small messages count as much as large ones
    (overhead, alpha, beta), *_ = np.linalg.lstsq(np.array(rows) * weight[:, None], seconds * weight, rcond=None)
    beta = max(float(beta), 1e-15)
    costs, beyond = _kind_lines(measurements, axis_size, wire)
    return Link(bandwidth_bytes_per_s=1.0 / beta, latency_s=max(float(alpha), 0.0), call_overhead_s=max(float(overhead), 0.0), name=name,
                reduce_scatter_as_all_reduce=reduce_scatter_as_all_reduce, kind_costs=costs, kind_rates_beyond=beyond)


LINE_BUFFER_BYTES = 1 << 20
"""Message sizes from which the measured line of a collective kind goes through every size the calibration timed
(:func:`_kind_lines`); the smaller sizes only set its fixed cost."""


def _kind_lines(measurements: list[Mapping[str, Any]], axis_size: int, wire) -> tuple[tuple, tuple]:
    """Per collective kind with two sizes or more, the measured line of its time against the bytes it sends: ``(kind, fixed
    seconds, bandwidth)`` (:attr:`.cluster.Link.kind_costs`) and ``(kind, sent bytes, bandwidth past them)``
    (:attr:`.cluster.Link.kind_rates_beyond`).

    The line runs from the smallest message through each message of :data:`LINE_BUFFER_BYTES` or more (through the
    largest, where none is that large): the fixed cost is the smallest message's time less its bytes' share, and each
    stretch between two of those messages moves its bytes at their difference over their times' difference. The
    sizes between the smallest and a mebibyte, where the fixed cost dominates and the timings are noisiest, do not
    bend it; where one of them ran faster than the smallest, the smallest is taken at that time (a message of fewer
    bytes does not take longer; the slower time was a slow draw of the scheduler: on 4 processes sharing 2 cores a
    calibration timed a pair's all-gather at 1.46 ms for 4 KiB and 0.65 ms for 256 KiB, and priced a beam plan's 42
    all-gathers at 1.46 ms each before their waits). Each kind asked for has its own line, its bytes those of the
    collective the backend carries out (``wire``): a reduce-scatter that gloo runs as an all-reduce sends that
    all-reduce's bytes, but copies its input and its piece too, and ran 1.2-1.4x the all-reduce's time at 32 MiB on
    this project's machine (2 and 4 processes), so it is priced by its own measurements, not the all-reduce's.
    """
    by_kind: dict[str, dict[float, tuple[float, float]]] = {}
    for m in measurements:
        kind = m["op"]
        sent = _sent_bytes(wire(kind), m["bytes"], axis_size)
        best = by_kind.setdefault(kind, {})
        best[sent] = min((m["seconds"], m["bytes"]), best.get(sent, (m["seconds"], m["bytes"])))
    costs, beyond = [], []
    for kind, best in sorted(by_kind.items()):
        if len(best) < 2:
            continue
        sizes = sorted(best)
        through = [sent for sent in sizes[1:] if best[sent][1] >= LINE_BUFFER_BYTES] or sizes[-1:]
        line = [sizes[0], *through]
        # a message takes no longer than a larger one of its kind: the smallest's time is the fastest below the line
        smallest_s = min(best[sent][0] for sent in sizes if sent < line[1])
        costs.append((kind, *_through_ends({sizes[0]: smallest_s, line[1]: best[line[1]][0]})))
        for start, end in zip(line[1:], line[2:]):
            beyond.append((kind, start, _through_ends({sent: best[sent][0] for sent in (start, end)})[1]))
    return tuple(costs), tuple(beyond)


def _through_ends(points: Mapping[float, float]) -> tuple[float, float]:
    """(fixed seconds, bytes/s) of the line through the smallest and the largest of ``points`` ({bytes: seconds}, at
    least two): the fixed cost is the smallest's time less its bytes' share, the rate the largest's bytes over its time
    beyond that (at most 1e15 bytes/s, and the fixed cost at least 0, where the points fall)."""
    (small, small_s), (large, large_s) = min(points.items()), max(points.items())
    per_byte = max((large_s - small_s) / (large - small), 1e-15)
    return max(small_s - small * per_byte, 0.0), 1.0 / per_byte


def eager_op_overhead(figures: Mapping[str, float]) -> float:
    """Seconds per captured node that the same step costs when torch runs it eagerly (``eager_step_s``), beyond the
    rooflines: what a baseline running the model itself (torch DDP, FSDP) pays per node of the captured graph. 0
    without the figure."""
    if "eager_step_s" not in figures or "captured_nodes" not in figures:
        return 0.0
    return max((float(figures["eager_step_s"]) - float(figures["captured_roofline_s"])) / float(figures["captured_nodes"]), 0.0)


def runtime_op_overhead(figures: Mapping[str, float]) -> float:
    """Seconds per node the runtime spends beyond the rooflines, from the worker's device figures.

    With a timed captured step (``captured_step_s`` over ``captured_nodes`` nodes whose rooflines sum to
    ``captured_roofline_s``): ``(step - rooflines) / nodes``, the fixed cost every node of a real rank program pays
    (dispatch, casts of scalar operands, layout copies). Without one (a GPU, or an older report): the chain of tiny
    ops' ``op_overhead_s``.
    """
    if "captured_step_s" not in figures:
        return float(figures.get("op_overhead_s", 0.0))
    nodes = float(figures["captured_nodes"])
    if nodes <= 0:
        raise ClusterError(f"the calibration's captured step has {nodes} nodes; run `metadist calibrate` again")
    return max((float(figures["captured_step_s"]) - float(figures["captured_roofline_s"])) / nodes, 0.0)


IN_STEP_COLLECTIVE_BYTES = 4096
"""The buffer of the all-reduce the worker issues between compute phases (``in_step_collective_s``)."""


def sustained_slowdown(figures: Mapping[str, float]) -> float:
    """How much slower the processes compute over a step than in the calibration's short timed calls (at least 1; 1
    without the figures: a GPU, or an older report). Every rate the worker measured is divided by it and every per-op
    time multiplied: processes that share cores take turns on them, which a call shorter than a turn does not see.

    The larger of the measured ``sustained_slowdown`` and ``core_sharing`` (the host's compute threads per core,
    :func:`metadist.cost.calibrate_worker.core_sharing`): ranks that outnumber the cores cannot all compute at once,
    whatever the short bursts caught (4 ranks on 2 cores: the measured figure 1.55-1.88, the sharing 2, an eager DDP
    step of gpt2-tiny with every rank computing 2.2x as long as alone)."""
    return max(float(figures.get("sustained_slowdown", 1.0)), float(figures.get("core_sharing", 1.0)), 1.0)


def collective_sync_s(in_step_s: float | None, link: Link, axis_size: int) -> float:
    """A collective's cost inside a step beyond what the isolated measurements priced (the link's ``sync_s``).

    ``in_step_s`` (the report's ``in_step_collective_s``, or ``in_step_collective_s:SIZE`` for groups of SIZE) is
    what a small all-reduce added to a compute phase, as the runtime issues one mid-step; less the link's own price
    of that all-reduce (fitted from collectives timed as all ranks leave a barrier together), the rest is the wait
    for the slower peer. 0 without the figure or on one device.
    """
    if axis_size <= 1 or in_step_s is None:
        return 0.0
    from .comm import collective_seconds

    isolated, _ = collective_seconds("all_reduce", IN_STEP_COLLECTIVE_BYTES, axis_size, link)
    return max(float(in_step_s) - isolated, 0.0)


SYNC_GAP_MATTERS = 0.5
"""A link's wait is priced by the gap before each call (:attr:`.cluster.Link.sync_by_gap`) only where the wait after
the short compute phase is under this fraction of the wait after the long one, and shorter by at least
:data:`SYNC_GAP_MIN_S`."""
SYNC_GAP_MIN_S = 0.5e-3
"""On 2 gloo processes the waits after the short and the long phase were 0.09 and 0.22 ms: a difference that moves no
plan would only add a second search to every plan (on 4 processes sharing 2 cores: 0.3 and 5.6 ms among the 4,
0.5 and 5.6 in pairs)."""


def sync_by_gap(figures: Mapping[str, Any], link: Link, axis_size: int, group: str = "", *,
                slowdown: float) -> tuple[tuple[float, float], ...]:
    """The (compute gap, wait) points of a link (:attr:`.cluster.Link.sync_by_gap`): the waits of the in-step
    all-reduce after the short and the long compute phase (``in_step_collective_short_s`` and
    ``in_step_collective_s``, with ``group`` ``:SIZE`` for groups of SIZE; :func:`collective_sync_s`), at the
    phases' measured seconds, and after the longest phase where it was timed (``in_step_collective_long_s``, version
    21: ranks with a core each drift apart over a model's stretches of compute), its wait at least the long phase's.
    Empty without the figures (a calibration before version 18, one device) or where the short wait is not under
    :data:`SYNC_GAP_MATTERS` of the last point's and :data:`SYNC_GAP_MIN_S` shorter.

    A point's gap is its phase's measured seconds times ``slowdown`` (:func:`sustained_slowdown` of the same figures,
    required: a caller that left it out would bring the unit error below back): the gaps it is
    looked up with are a step's priced compute, which that factor scales (ranks that share cores take turns over a
    step), while a phase of a few milliseconds ran within one turn, at a free core's speed (on 4 processes sharing
    this project's 2 cores: 1,200 tiny ops in 2.14 ms, 1.8 us an op, where one rank alone runs them at 1.5). Looked up
    with the priced gaps at the phases' own seconds, mlp's ILP plan (one call after 2.05 ms of compute priced, about
    1 ms of a free core's) was priced at the wait after 2 ms of a free core's compute: 10.2 ms a step, where it
    ran 7.6-7.9."""
    needed = ("compute_phase_short_s", "compute_phase_s", f"in_step_collective_short_s{group}", f"in_step_collective_s{group}")
    if axis_size <= 1 or any(figures.get(key) is None for key in needed):
        return ()
    short_gap, long_gap, short, long = (float(figures[key]) for key in needed)
    short_gap, long_gap = short_gap * slowdown, long_gap * slowdown
    short_wait, long_wait = collective_sync_s(short, link, axis_size), collective_sync_s(long, link, axis_size)
    points = [(short_gap, short_wait), (long_gap, long_wait)]
    longest = (figures.get("compute_phase_long_s"), figures.get(f"in_step_collective_long_s{group}"))
    if None not in longest and float(longest[0]) * slowdown > long_gap:
        points.append((float(longest[0]) * slowdown,
                       max(collective_sync_s(float(longest[1]), link, axis_size), long_wait)))
    last_wait = points[-1][1]
    if not short_wait < SYNC_GAP_MATTERS * last_wait or last_wait - short_wait < SYNC_GAP_MIN_S or not short_gap < long_gap:
        return ()
    return tuple(points)


def cluster_from_report(report: Mapping[str, Any], mesh: Mesh) -> Cluster:
    """A cluster from the worker's JSON report."""
    links = []
    figures = report["device"]
    slowdown = sustained_slowdown(figures)
    for axis, size in enumerate(mesh.shape):
        rows = [m for m in report["measurements"] if m["axis"] == axis]
        link = fit_link(rows, size, f"{report['backend']}-{mesh.axis_names[axis]}", backend_reduce_scatters_as_all_reduce(report["backend"]))
        links.append(replace(link, sync_s=collective_sync_s(figures.get("in_step_collective_s"), link, size),
                             sync_by_gap=sync_by_gap(figures, link, size, slowdown=slowdown),
                             fsdp_unit_costs=fsdp_unit_costs(figures,
                                                             None if size == report.get("world_size") else size)))

    def rates(values: Mapping[str, float]) -> dict[str, float]:
        return {key: value / slowdown for key, value in values.items()}

    def curves(kind: str) -> dict[str, list[tuple[float, float]]]:
        return {dtype: [(size, rate / slowdown) for size, rate in points] for dtype, points in _curves(figures, kind).items()}

    device = Device(
        peak_flops_per_s=report["device"]["peak_flops_per_s"] / slowdown,
        memory_bandwidth_bytes_per_s=report["device"]["memory_bandwidth_bytes_per_s"] / slowdown,
        peak_flops_per_s_by_dtype=rates(_by_dtype(figures, "peak_flops_per_s_")),
        memory_bandwidth_bytes_per_s_by_dtype=rates(_by_dtype(figures, "memory_bandwidth_bytes_per_s_")),
        matmul_curves=curves("matmul_curve"), elementwise_curves=curves("elementwise_curve"),
        matmul_stream_bytes_per_s_by_dtype=rates(_stream_rates(figures)),
        op_overhead_s=runtime_op_overhead(figures) * slowdown,
        op_element_seconds={op: seconds * slowdown for op, seconds in _by_dtype(figures, "op_element_s:").items()},
        eager_op_overhead_s=eager_op_overhead(figures) * slowdown,
        dtensor_op_overhead_s=float(figures.get("dtensor_op_s", 0.0)) * slowdown,
        dtensor_module_op_overhead_s=float(figures.get("dtensor_module_op_s", 0.0)) * slowdown,
        dtensor_collective_overhead_s=float(figures.get("dtensor_collective_s", 0.0)) * slowdown,
        memory_capacity_bytes=float(report.get("memory_capacity_bytes") or _host_memory_bytes() / max(1, mesh.size)),
        name=report.get("device_name", ""),
        sustained_slowdown=slowdown,
    )
    return Cluster(mesh=mesh, device=device, axis_links=tuple(links), name=f"calibrated-{report['backend']}")


def fsdp_unit_costs(figures: Mapping[str, Any], group_size: int | None = None) -> tuple[tuple[str, float, float], ...]:
    """(variant, fixed seconds, bytes/s) of torch's FSDP2 per unit, through the smallest and the largest unit the worker
    timed (:func:`metadist.cost.calibrate_worker._fsdp_unit_seconds`), as a collective kind is fitted
    (:func:`_through_ends`): over all the processes (``fsdp_unit_s:VARIANT:BYTES``), or with ``group_size`` over
    groups of that many (``fsdp_unit_s:VARIANT:BYTES:SIZE``, version 27); nothing for a variant timed at fewer than two
    sizes. Not scaled by the sustained slowdown: every rank ran the units at once, as a step runs them."""
    by_variant: dict[str, dict[float, float]] = {}
    for key, seconds in figures.items():
        if not key.startswith("fsdp_unit_s:"):
            continue
        _, variant, nbytes, *group = key.split(":")
        if group == ([] if group_size is None else [str(group_size)]):
            by_variant.setdefault(variant, {})[float(nbytes)] = float(seconds)
    return tuple((variant, *_through_ends(points)) for variant, points in sorted(by_variant.items()) if len(points) >= 2)


def _by_dtype(figures: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """The worker's per-dtype figures (``peak_flops_per_s_bfloat16``, ...) as {dtype: figure}."""
    return {key.removeprefix(prefix): float(value) for key, value in figures.items() if key.startswith(prefix)}


def _stream_rates(figures: Mapping[str, Any]) -> dict[str, float]:
    """The worker's ``matmul_stream_bytes_per_s`` (float32) and ``matmul_stream_bytes_per_s_DTYPE`` as {dtype: rate}."""
    rates = _by_dtype(figures, "matmul_stream_bytes_per_s_")
    if "matmul_stream_bytes_per_s" in figures:
        rates["float32"] = float(figures["matmul_stream_bytes_per_s"])
    return rates


def _curves(figures: Mapping[str, Any], kind: str) -> dict[str, list[tuple[float, float]]]:
    """The worker's ``KIND:DTYPE:SIZE`` figures as {dtype: [(size, rate), ...]}."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for key, value in figures.items():
        parts = key.split(":")
        if len(parts) == 3 and parts[0] == kind:
            curves.setdefault(parts[1], []).append((float(parts[2]), float(value)))
    return curves


def _host_memory_bytes() -> float:
    try:
        pages = __import__("os").sysconf("SC_PHYS_PAGES")
        return float(pages * __import__("os").sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 8e9


SHARED_CORE_LAUNCHES = 3
"""Launches of the calibration's workers where the processes outnumber the host's cores (:func:`default_launches`).

On 4 gloo processes sharing this project's 2 cores, single launches a few minutes apart timed a pair's in-step
all-reduce at 4.5-6.6 ms, the 4 processes' at 7.1-9.8 ms, and the runtime's captured calibration step at 0.90-1.03
ms. One launch timed a pair's isolated 4 KiB all-reduce at 2.0 ms (others 0.2-0.5), which put its pairs' in-step
wait at 2.7 ms where others gave 5.1-6.2; another timed the captured step at 1.43 ms, which priced a gpt2-tiny plan
at 24.4 ms where a launch with the usual figures had priced it at 18.9 (it ran 19.4). Within a launch the scheduler
keeps which processes share a core; each launch (each benchmark or run too) settles it anew, and the median over
three launches drops one launch's outlier."""


def default_launches(nproc: int) -> int:
    """How many launches a calibration of ``nproc`` local processes takes each figure's median over:
    :data:`SHARED_CORE_LAUNCHES` where they outnumber the cores this process may run on, else 1."""
    from ..config import usable_cores

    return SHARED_CORE_LAUNCHES if nproc > usable_cores() else 1


def merge_reports(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One report from the reports of several launches of the same calibration: each device figure and each
    collective's seconds (by axis, group size, kind and bytes) is the median over the launches that measured it (a
    curve whose timing stopped at a smaller size in one launch has that size's point from the others), each
    unsupported collective is listed once, and ``launches`` says how many there were.

    The launches must agree on what they ran (backend, processes, mesh, device): anything else is an internal error."""
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    first = reports[0]
    same = ("backend", "world_size", "mesh", "device_name", "memory_capacity_bytes")
    for report in reports[1:]:
        differing = [key for key in same if report.get(key) != first.get(key)]
        if differing:
            raise ClusterError(f"internal: the calibration's launches measured different setups ({', '.join(differing)})")
    figures: dict[str, list[float]] = {}
    timings: dict[tuple, list[float]] = {}
    unsupported: dict[tuple, Mapping[str, Any]] = {}
    for report in reports:
        for key, value in report["device"].items():
            figures.setdefault(key, []).append(float(value))
        for row in report["measurements"]:
            timings.setdefault((row["axis"], row["group_size"], row["op"], row["bytes"]), []).append(float(row["seconds"]))
        for item in report.get("unsupported", ()):
            unsupported.setdefault((item["axis"], item["group_size"], item["op"]), item)
    merged = {key: first[key] for key in first if key not in ("device", "measurements", "unsupported", "launches")}
    merged["device"] = {key: statistics.median(values) for key, values in figures.items()}
    merged["measurements"] = [{"axis": axis, "group_size": size, "op": op, "bytes": nbytes, "seconds": statistics.median(values)}
                              for (axis, size, op, nbytes), values in timings.items()]
    merged["unsupported"] = list(unsupported.values())
    merged["launches"] = len(reports)
    merged["other_load_cores_by_launch"] = [report.get("other_load_cores") for report in reports]
    merged["other_load_cores"] = max((x for x in merged["other_load_cores_by_launch"] if x is not None), default=None)
    return merged


OTHER_LOAD_LIMIT_CORES = 0.25
"""Cores' worth of other work (averaged over a launch) past which a launch's figures are not trusted: the work of
other processes, and time a hypervisor took from this machine's cores (steal), beyond the cores the launch leaves
free. One process busy beside a one-process calibration on this project's 2-core machine made every float32 matmul
of the curve take 7.6 ms whatever its size (its two OpenMP threads waited on a descheduled one), and the cache kept
the figures: ``metadist plan`` then priced each small matmul 2,000x its time."""

OTHER_LOAD_RETRIES = 2
"""How many times a launch whose machine was busy (:data:`OTHER_LOAD_LIMIT_CORES`) is run again; the least busy
launch is kept and, if that one was busy too, the report says so (:func:`busy_note`)."""


def run_workers(nproc: int, mesh: Mesh, sizes: str, timeout_s: float = 600.0, launches: int | None = None,
                on_launch: Callable[[int, int], None] | None = None,
                on_busy: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Launch ``nproc`` local workers with torchrun ``launches`` times (:func:`default_launches` by default) and return
    rank 0's report, merged over the launches by :func:`merge_reports` where there are several. ``on_launch(index,
    launches)`` is told before each launch (index from 1).

    Each launch records how much other work ran on the machine meanwhile (``other_load_cores``,
    :func:`contended_cores`); a launch that other work contended is run again, up to :data:`OTHER_LOAD_RETRIES` times,
    and the least contended one kept; ``on_busy(text)`` is told each time (else the logger warns)."""
    if mesh.size != nproc:
        raise ClusterError(f"mesh {mesh} has {mesh.size} devices but --nproc is {nproc}; make them agree")
    launches = default_launches(nproc) if launches is None else launches
    if launches < 1:
        raise ClusterError(f"a calibration takes at least one launch of its workers, got {launches}; pass --launches 1 or more")
    reports = []
    for index in range(1, launches + 1):
        logger.info("calibration launch %d of %d", index, launches)
        if on_launch is not None:
            on_launch(index, launches)
        tries = [_launch_workers(nproc, mesh, sizes, timeout_s)]
        while contended_cores(tries[-1], nproc) > OTHER_LOAD_LIMIT_CORES and len(tries) <= OTHER_LOAD_RETRIES:
            text = (f"other work used {tries[-1]['other_load_cores']:.2f} cores of this machine during the calibration; "
                    f"measuring again ({len(tries)} of {OTHER_LOAD_RETRIES})")
            if on_busy is not None:
                logger.info(text)
                on_busy(text)
            else:
                logger.warning(text)
            tries.append(_launch_workers(nproc, mesh, sizes, timeout_s))
        reports.append(min(tries, key=lambda report: contended_cores(report, nproc)))
    return reports[0] if launches == 1 else merge_reports(reports)


def _launch_workers(nproc: int, mesh: Mesh, sizes: str, timeout_s: float) -> dict[str, Any]:
    """One torchrun launch of the calibration's workers: rank 0's report, with ``other_load_cores``: the cores' worth
    of other work the machine ran meanwhile (:func:`_busy_seconds`; None where it cannot be read)."""
    with tempfile.TemporaryDirectory(prefix="metadist-calibrate-") as folder:
        out = Path(folder) / "report.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "metadist.cost.calibrate_worker", "--mesh", "x".join(map(str, mesh.shape)), "--sizes", sizes, "--out", str(out)]
        logger.info("running %s", " ".join(command))
        busy, own, started = _busy_seconds(), _own_cpu_seconds(), time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=_fresh_launch_env(nproc))
        wall = time.monotonic() - started
        busy_after, own_after = _busy_seconds(), _own_cpu_seconds()
        if done.returncode != 0 or not out.exists():
            lines = (done.stderr or done.stdout).splitlines()
            errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line][-3:]  # the ranks' own errors
            tail = "\n".join(errors + lines[-15:])
            raise ClusterError(f"the calibration workers failed (exit status {done.returncode}):\n{tail}")
        report = json.loads(out.read_text())
        other = None
        if busy is not None and busy_after is not None and wall > 0:
            other = max(0.0, (busy_after - busy) - (own_after - own)) / wall
        report["other_load_cores"] = other
        return report


def _busy_seconds() -> float | None:
    """Seconds the cores this process may run on have been busy since boot (Linux's ``/proc/stat``: user, system,
    interrupts, and steal, the time a hypervisor gave them to another machine); None where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    cores = {f"cpu{core}" for core in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else None
    total = 0
    for line in lines:
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
            continue
        if cores is not None and fields[0] not in cores:
            continue
        values = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
        total += sum(values) - values[3] - values[4]
    return total / ticks


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (the launch's workers, once it returns)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def contended_cores(report: Mapping[str, Any], nproc: int) -> float:
    """The cores' worth of other work in ``report``'s launch beyond the cores it left free: its
    ``other_load_cores`` less what its ``nproc`` processes did not claim (each one OpenMP thread, or as many as
    ``OMP_NUM_THREADS`` says; one process takes every core). 0.0 where the launch did not record it."""
    from ..config import usable_cores
    from ..forking import chosen_threads

    other = report.get("other_load_cores")
    if other is None:
        return 0.0
    cores = usable_cores()
    chosen = chosen_threads()
    threads = int(chosen) if chosen.isdigit() and int(chosen) > 0 else (1 if nproc > 1 else cores)
    return max(0.0, other - max(0, cores - nproc * threads))


def busy_note(report: Mapping[str, Any], nproc: int) -> str | None:
    """One line for the user where other work contended the calibration kept (:func:`run_workers`), else None."""
    contended = contended_cores(report, nproc)  # a merged report's: its busiest launch's
    if contended <= OTHER_LOAD_LIMIT_CORES:
        return None
    return (f"other work used {contended:.2f} cores of this machine beyond what the calibration left free, in every try; "
            f"its figures may be slow. Run `metadist calibrate --nproc {nproc}` when the machine is idle")


def _fresh_launch_env(nproc: int) -> dict[str, str]:
    """This process's environment without the variables of a torchrun launch it may be part of, with those a launch
    of ``nproc`` ranks sets for them (:func:`metadist.forking.rank_environment`: one OpenMP thread per rank unless
    the user chose a number, also where ``OMP_NUM_THREADS`` is empty, which torchrun leaves as it is and torch then
    reads as a thread per core), as ``metadist run`` launches its ranks.

    A rank of ``metadist run`` or of the benchmark calibrates in a launch of its own, whose workers must not read
    the outer launch's rank, world size or rendezvous.
    """
    from ..forking import launch_environment

    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
              "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    return launch_environment(nproc, {key: value for key, value in os.environ.items()
                                      if key not in launch and not key.startswith("TORCHELASTIC_")})


def calibrate(nproc: int, mesh: Mesh | None = None, sizes: str = FULL_SIZES, launches: int | None = None,
              on_launch: Callable[[int, int], None] | None = None,
              on_busy: Callable[[str], None] | None = None) -> tuple[Cluster, dict[str, Any]]:
    """Measure this machine: the fitted cluster and the raw report (merged over ``launches``, :func:`run_workers`)."""
    mesh = mesh or Mesh((nproc,))
    report = run_workers(nproc, mesh, sizes, launches=launches, on_launch=on_launch, on_busy=on_busy)
    return cluster_from_report(report, mesh), report


# ---------------------------------------------------------------- the per-machine cache

CALIBRATION_FORMAT = "metadist.calibration"
CALIBRATION_VERSION = 34
"""2: the worker also times a captured step and a collective between compute phases (the runtime's per-node and
per-collective costs); 3: matmul FLOP/s and elementwise bytes/s at several sizes, in float32, bfloat16 and float16
(the cost model's curves); 4: the bytes/s of a few-row matmul's large operand, per dtype (skinny matmuls); 5: the seconds per element of ops that
compute more than they move (exp, tanh, softmax...: ``Device.op_element_seconds``); 6: how much slower the
processes compute over a long stretch than in short timed calls (``Device.sustained_slowdown``); 7: collectives
and the in-step all-reduce timed on groups smaller than all the processes too (an axis of 2 in a 2x2 mesh:
:func:`cluster_over_mesh`); 8: the same figures, measured again because the compiled step's per-node cost
fell (its first run takes out idle layout calls and calls ops through their Python bindings); 9: the elementwise curve
also past the last-level cache (8M elements), and seconds per element of layer norm, ``_safe_softmax`` and the random
draws (``bernoulli``, ``rand``, ``randn``); 10: bfloat16 and float16 matmuls also with either operand transposed
(``matmul_curve:DTYPE@nt``, ``@tn``: a CPU's low-precision kernels run those layouts several times faster); 11: the
runtime's captured and eager calibration steps timed one process at a time (their per-node figures swung 2-7x between
calibrations on 4 processes sharing 2 cores); 12: the host's compute threads per core (``core_sharing``), a floor
of the sustained slowdown; 13: what an op on a sharded DTensor costs beyond the same op on a plain tensor
(``dtensor_op_s``: torch's FSDP2 and tensor parallelism priced as they run); 14: what torch's FSDP2 adds per unit
of two sizes, its copies and hooks with its collectives (``fsdp_unit_s:VARIANT:BYTES``, :attr:`.cluster.Link.fsdp_unit_costs`); 15:
taken by a change since reverted (the elementwise curve to 32M elements); 16: collectives timed at 32 MiB too, and
priced on the line through the sizes timed from 1 MiB up (:attr:`.cluster.Link.kind_rates_beyond`), the workers
keeping freed host memory as the steps do, and the elementwise curve to 32M elements (version 15's point); 17: the
in-step all-reduce timed after a compute phase of about a scheduler turn (3 ms, not 0.27: the other ranks are
computing while a step's collective runs; :data:`.calibrate_worker.IN_STEP_PHASE_OPS`); 18: the in-step all-reduce
timed after the short phase too, so that a call that follows another soon is priced at the short wait
(:attr:`.cluster.Link.sync_by_gap`); 19: each in-step figure's samples taken in three rounds over all of them
(:class:`.calibrate_worker._InStepSampler`: a pair's figure timed in one stretch moved 2x between stretches); 20: a
change tried and reverted (roofline timed one process at a time), whose caches are not read; 21: the in-step
all-reduce timed after a long compute phase too where every rank has a core (:data:`.calibrate_worker.
IN_STEP_LONG_PHASE_OPS`, a third point of :attr:`.cluster.Link.sync_by_gap`), and the sustained slowdown taken from the
fastest of several long stretches (:func:`.calibrate_worker._slowdown_of`); 22: a change tried and reverted (compute
figures timed over windows), whose caches are not read; 23: where ranks share cores, the compute figures measured by one
rank alone while the others wait (:func:`.calibrate_worker._roofline_alone`), so that the slowdown applies the sharing
once; 24: the seconds per element of a relayout, a transposed operand copied into a row-major tensor
(:data:`.compute.RELAYOUT`: the gradient layout copies); 25: where the processes outnumber the cores, each figure the
median over :data:`SHARED_CORE_LAUNCHES` launches (:func:`merge_reports`); 26: FSDP2's units timed first in the
worker, and their figures the slowest rank's (the fastest's before: :func:`.calibrate_worker.slower_when_larger`;
:func:`.calibrate_worker._fsdp_unit_seconds`); 27: FSDP2's units timed over groups of each size a mesh axis of the
processes can have too (pairs of 4), which price FSDP2 over one axis of a 2-D mesh (``tp-dp``); 29: the all-gather
timed as the runtime carries it out, an all-to-all on gloo (:func:`metadist.runtime.collectives.start_all_gather`;
28 was a change tried and withdrawn, whose caches may remain); 30: FSDP2's large units (32 MiB) timed after two
untimed rounds and priced at the fastest of four rounds, not the median of three after one step each (a round whose
processes grew their heaps took page faults: :data:`.calibrate_worker.FSDP_LARGE_ROUNDS`), and the ops that compute
more than they move timed in bfloat16 and float16 too (``op_element_s:OP@DTYPE``: a bfloat16 ``tanh`` ran 5.5x a
float32 one); 31: each launch records the other work its machine ran meanwhile (``other_load_cores``) and one
that other work contended is measured again (:data:`OTHER_LOAD_LIMIT_CORES`), and a figure's samples repeat the op
as many times as the fastest of its first calls allows (:data:`.calibrate_worker.SETTLE_CALLS`): caches of older
versions may hold figures taken on a busy machine; 32: what an op of a tensor-parallel linear's forward and backward
costs on DTensors (``dtensor_module_op_s``, :func:`.calibrate_worker._dtensor_module_op_seconds`): torch's TP priced
its modules' ops at an optimizer's elementwise op's cost, a third of what they ran; and the narrow matmuls' times
(their table's path holds the version) taken on cycled copies of their operands, not on one pair warm in the caches
(:func:`.matmul_times.time_matmul`); 33: an in-step call's wait priced at its samples' mean (less the largest 5 %), not
their median (:func:`.calibrate_worker.expected_wait`: on 2 processes the waits are bimodal, and their median flipped
between the modes from one calibration to the next), and FSDP2's small units' steps likewise; the in-step rounds run
at three points of the worker's run, not back to back at its end (:class:`.calibrate_worker._InStepSampler`); 34: what
an all-reduce torch's tensor parallelism issues through DTensor costs the calling thread beyond a plain all-reduce
(``dtensor_collective_s``, :func:`.calibrate_worker._dtensor_collective_seconds`): ~0.3-0.4 ms a call on this project's
2-core machine, unpriced before. A cache of an older version is measured again, not read."""


def machine_fingerprint() -> dict[str, Any]:
    """What identifies this machine's speed: processor model, core count, memory (no host name)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"processor": model, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "memory_gib": round(_host_memory_bytes() / 2**30)}


def calibration_key(nproc: int, backend: str, torch_version: str, fingerprint: Mapping[str, Any] | None = None) -> str:
    """The cache key of a calibration: machine fingerprint, torch version, backend, process count, and the calibration
    version (a version's files never meet another's: an older MetaDist keeps reading its own)."""
    fingerprint = machine_fingerprint() if fingerprint is None else fingerprint
    text = json.dumps({"machine": fingerprint, "torch": torch_version, "backend": backend, "nproc": nproc}, sort_keys=True)
    return f"{backend}-{nproc}proc-v{CALIBRATION_VERSION}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def calibration_path(cache_dir: Path, nproc: int, backend: str = "gloo") -> Path:
    """Where this machine's calibration for ``nproc`` processes over ``backend`` is cached."""
    return Path(cache_dir) / "calibration" / f"{calibration_key(nproc, backend, _torch_version())}.json"


def _torch_version() -> str:
    """torch's version, read from its package metadata (the cost model never imports torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        raise ClusterError("torch is not installed: calibration measures this machine with torch.distributed; install torch") from None


def save_calibration(path: Path, report: Mapping[str, Any], nproc: int) -> None:
    """Write a calibration report to the cache (atomically)."""
    document = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "nproc": nproc,
                "fingerprint": machine_fingerprint(), "torch": _torch_version(), "report": dict(report)}
    from ..files import write_atomically

    write_atomically(path, json.dumps(document, indent=1))


def load_calibration(path: Path) -> dict[str, Any] | None:
    """The cached report at ``path``; None when there is none or it is of an older calibration version (measured
    again). A damaged file, or one of another format or a newer version, is an error that says how to redo it."""
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ClusterError(f"the cached calibration {path} cannot be read ({err}); delete it or run `metadist calibrate`") from None
    version = document.get("version")
    if document.get("format") == CALIBRATION_FORMAT and isinstance(version, int) and version < CALIBRATION_VERSION:
        logger.info("%s is a version %s calibration (this MetaDist writes version %s): measuring again", path, version, CALIBRATION_VERSION)
        return None
    if document.get("format") != CALIBRATION_FORMAT or version != CALIBRATION_VERSION:
        raise ClusterError(f"{path} is not a calibration of this MetaDist version; delete it or run `metadist calibrate`")
    return document["report"]


def machine_cluster(mesh: Mesh, cache_dir: Path, *, sizes: str = QUICK_SIZES, announce=None) -> Cluster:
    """This machine's calibrated gloo cluster over ``mesh``: from the cache, else measured now and cached.

    The measurement runs ``mesh.size`` processes on one axis, and times collectives on smaller groups too; each axis
    of ``mesh`` takes the link of its size (:func:`cluster_over_mesh`). ``announce(text)`` is told before a measurement
    starts.
    """
    nproc = mesh.size
    path = calibration_path(cache_dir, nproc)
    report = load_calibration(path)
    if report is None:
        launches = default_launches(nproc)
        if announce is not None:
            over = f", the median of {launches} launches (the processes outnumber the cores)" if launches > 1 else ""
            announce(f"calibrating this machine for {nproc} process(es): compute and gloo collectives, under a minute a launch on a few "
                     f"processes{over}, once; cached in {path} (`metadist calibrate --nproc {nproc}` measures again)")
        report = run_workers(nproc, Mesh((nproc,)), sizes, launches=launches, on_busy=announce)
        save_calibration(path, report, nproc)
        note = busy_note(report, nproc)
        if note is not None and announce is not None:
            announce(note)
    return cluster_over_mesh(report, mesh)


def cluster_over_mesh(report: Mapping[str, Any], mesh: Mesh) -> Cluster:
    """The cluster of a calibration of ``mesh.size`` processes on one axis, over ``mesh``.

    An axis of all the processes takes the measured axis's link. A smaller axis (2 in 2x2) takes the link fitted from
    the collectives the calibration timed on groups of its size (version 7), where it has them, with the wait its
    groups' in-step all-reduce showed (``in_step_collective_s:SIZE``): on 4 gloo processes sharing 2 cores a 4 KiB
    all-gather took 3.7 ms among the 4 and 0.5-0.6 ms between 2 alone, and a pair's in-step all-reduce 2.3 ms
    against 5.3-6.3 among 4. A 2x2 plan's collectives run between 2. Without those figures the axis takes the whole
    link, as before.
    """
    flat = cluster_from_report(report, Mesh((mesh.size,)))
    whole = flat.axis_links[0]
    links = []
    for size in mesh.shape:
        rows = [m for m in report["measurements"] if m.get("axis") == -1 and m.get("group_size") == size]
        if size == mesh.size:
            links.append(whole)
            continue
        if not rows:  # no collectives timed on groups of this size: the whole link, less FSDP2's units over all
            links.append(replace(whole, fsdp_unit_costs=()))
            continue
        link = fit_link(rows, size, f"{report['backend']}-group{size}", backend_reduce_scatters_as_all_reduce(report["backend"]))
        link = replace(link, fsdp_unit_costs=fsdp_unit_costs(report["device"], size))
        in_step = report["device"].get(f"in_step_collective_s:{size}")
        if in_step is None:  # timed alone only: the whole link's wait
            links.append(replace(link, sync_s=whole.sync_s, sync_by_gap=whole.sync_by_gap))
        else:
            links.append(replace(link, sync_s=collective_sync_s(in_step, link, size),
                                 sync_by_gap=sync_by_gap(report["device"], link, size, f":{size}",
                                                         slowdown=flat.device.sustained_slowdown)))
    return Cluster(mesh=mesh, device=flat.device, axis_links=tuple(links), name=flat.name)


def default_cpu_cluster(mesh: Mesh, cpu_cluster: str, cache_dir: Path, announce=None) -> Cluster:
    """The cluster a CPU run plans on when it names none (:attr:`metadist.config.Settings.cpu_cluster`)."""
    from .cluster import resolve_cluster

    if cpu_cluster == "calibrated":
        return machine_cluster(mesh, cache_dir, announce=announce)
    return resolve_cluster(cpu_cluster, mesh)
