"""Calibration: launch the collective benchmark with torchrun and fit alpha-beta per mesh axis.

For every axis, each measurement of a collective on ``n`` devices moving a local buffer of
``B`` bytes gives one equation of the ring model used by :mod:`.comm`:
``seconds = call_overhead + steps * alpha + sent_bytes / bandwidth`` (``steps`` and
``sent_bytes`` as in :func:`.comm.collective_seconds`). The three are fitted by least squares
over all sizes and collectives of that axis (minimum norm where one axis size cannot tell
the overhead from alpha), and clipped to stay physical.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..ir import Mesh
from .cluster import Cluster, ClusterError, Device, Link

logger = logging.getLogger(__name__)

_STEPS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def _sent_bytes(op: str, buffer_bytes: float, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n * buffer_bytes
    if op == "all_gather":
        return (n - 1) * buffer_bytes
    return (n - 1) / n * buffer_bytes


def fit_link(measurements: list[Mapping[str, Any]], axis_size: int, name: str) -> Link:
    """Least-squares alpha (latency) and beta (1 / bandwidth) of one axis from its measurements."""
    if axis_size <= 1 or not measurements:
        return Link(bandwidth_bytes_per_s=1e12, latency_s=0.0, name=f"{name} (not measured)")
    rows = [[1.0, _STEPS[m["op"]] * (axis_size - 1), _sent_bytes(m["op"], m["bytes"], axis_size)] for m in measurements]
    seconds = np.array([m["seconds"] for m in measurements])
    (overhead, alpha, beta), *_ = np.linalg.lstsq(np.array(rows), seconds, rcond=None)
    beta = max(float(beta), 1e-15)
    return Link(bandwidth_bytes_per_s=1.0 / beta, latency_s=max(float(alpha), 0.0), call_overhead_s=max(float(overhead), 0.0), name=name)


def cluster_from_report(report: Mapping[str, Any], mesh: Mesh) -> Cluster:
    """A cluster from the worker's JSON report."""
    links = []
    for axis, size in enumerate(mesh.shape):
        rows = [m for m in report["measurements"] if m["axis"] == axis]
        links.append(fit_link(rows, size, f"{report['backend']}-{mesh.axis_names[axis]}"))
    device = Device(
        peak_flops_per_s=report["device"]["peak_flops_per_s"],
        memory_bandwidth_bytes_per_s=report["device"]["memory_bandwidth_bytes_per_s"],
        memory_capacity_bytes=float(report.get("memory_capacity_bytes") or _host_memory_bytes() / max(1, mesh.size)),
        name=report.get("device_name", ""),
    )
    return Cluster(mesh=mesh, device=device, axis_links=tuple(links), name=f"calibrated-{report['backend']}")


def _host_memory_bytes() -> float:
    try:
        pages = __import__("os").sysconf("SC_PHYS_PAGES")
        return float(pages * __import__("os").sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 8e9


def run_workers(nproc: int, mesh: Mesh, sizes: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """Launch ``nproc`` local workers with torchrun and return rank 0's report."""
    if mesh.size != nproc:
        raise ClusterError(f"mesh {mesh} has {mesh.size} devices but --nproc is {nproc}; make them agree")
    with tempfile.TemporaryDirectory(prefix="metadist-calibrate-") as folder:
        out = Path(folder) / "report.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "metadist.cost.calibrate_worker", "--mesh", "x".join(map(str, mesh.shape)), "--sizes", sizes, "--out", str(out)]
        logger.info("running %s", " ".join(command))
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
            raise ClusterError(f"the calibration workers failed (exit status {done.returncode}):\n{tail}")
        return json.loads(out.read_text())


def calibrate(nproc: int, mesh: Mesh | None = None, sizes: str = "4096,65536,1048576,4194304") -> tuple[Cluster, dict[str, Any]]:
    """Measure this machine: the fitted cluster and the raw report."""
    mesh = mesh or Mesh((nproc,))
    report = run_workers(nproc, mesh, sizes)
    return cluster_from_report(report, mesh), report
