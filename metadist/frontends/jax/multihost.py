"""A JAX plan run by several processes through ``jax.distributed`` (multi-host, here on one machine).

:func:`run_jax_multihost` is the launcher (``metadist run jax-mlp --nproc 2 --devices 4``):

1. it captures, discovers and plans the workload once, for a mesh of
   ``processes * local_devices`` devices, and writes the plan as JSON;
2. it starts ``processes`` Python processes (``python -m metadist.frontends.jax.multihost``),
   each with ``local_devices`` CPU devices, and a coordinator on a free localhost port;
3. each process (:func:`worker_main`) joins with ``jax.distributed.initialize``
   (cross-process CPU collectives through gloo), captures the same step, checks the
   plan was made for its graph (fingerprint), builds its shards of every input with
   ``jax.make_array_from_callback`` and runs the sharded step once; with ``check`` it
   gathers the outputs and compares them with the step on one of its own devices;
4. each process writes a JSON report; the launcher returns them. If one process
   fails, the launcher stops the others and raises with that process's error.

Nothing here opens sockets itself: the coordinator and the collectives are JAX's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ...files import write_atomically
from ...ir import Mesh
from .errors import JaxCaptureError

__all__ = ["JaxMultiHostSummary", "run_jax_multihost", "worker_main"]

log = logging.getLogger(__name__)

#: Cross-process collectives of the CPU backend (jax_cpu_collectives_implementation).
CPU_COLLECTIVES = "gloo"


@dataclass(frozen=True)
class JaxMultiHostSummary:
    """What every process of one multi-process run reported."""

    workload: str
    mesh: Mesh
    processes: int
    local_devices: int
    plan_kind: str
    planning_seconds: float
    wall_seconds: float
    reports: tuple[dict, ...]
    """One report per process (process id order): loss, XLA collectives, times and the check."""

    @property
    def passed(self) -> bool | None:
        """Whether every process's check passed (None without ``check``)."""
        checks = [report.get("check") for report in self.reports]
        return None if any(check is None for check in checks) else all(check["passed"] for check in checks)

    def to_text(self) -> str:
        first = self.reports[0]
        lines = [
            f"{self.workload} on mesh {self.mesh} ({self.plan_kind} plan): {self.processes} processes x "
            f"{self.local_devices} CPU devices (jax.distributed, {CPU_COLLECTIVES} collectives)",
            f"  planning {self.planning_seconds:.2f} s | processes {self.wall_seconds:.2f} s wall | XLA compile "
            f"{first['compile_seconds']:.2f} s | step {first['run_seconds'] * 1e3:.1f} ms (process 0)",
            "  XLA collectives " + ", ".join(f"{kind} {count}" for kind, count in first["xla_collectives"].items()),
        ]
        for report in self.reports:
            check = report.get("check")
            if check is None:
                lines.append(f"  process {report['process_id']}: loss {report['loss']:.6f}")
                continue
            verdict = "PASSED" if check["passed"] else "FAILED"
            lines.append(
                f"  process {report['process_id']}: check {verdict}: loss {check['loss_sharded']:.6f} (sharded) vs "
                f"{check['loss_single']:.6f} (1 device); max |diff| params {check['max_abs_diff_params']:.2e}, "
                f"optimizer state {check['max_abs_diff_state']:.2e} (worst: {check['worst_output']})"
            )
        return "\n".join(lines) + "\n"


def run_jax_multihost(spec: str, *, processes: int, local_devices: int, mesh: Mesh | str | None = None,
                      check: bool = True, db: Any = None, cluster: str | None = None, baseline: str | None = None,
                      plan: Any = None, rendezvous_timeout_s: float = 120.0,
                      run_timeout_s: float = 900.0) -> JaxMultiHostSummary:
    """Plan ``spec`` (a JAX built-in name or model file) here, then run it on ``processes`` local processes.

    ``plan`` (a :class:`~metadist.ir.plan.Plan` for the step's graph) skips planning.
    """
    from ...workloads import load_workload
    from .cli_support import _mesh, plan_jax

    if processes < 2:
        raise JaxCaptureError(f"a multi-process run needs at least 2 processes, got {processes}; use run_jax for one")
    if local_devices < 1:
        raise JaxCaptureError(f"each process needs at least 1 device, got {local_devices}")
    total = processes * local_devices
    mesh = _mesh(mesh, total)
    if mesh.size != total:
        raise JaxCaptureError(f"the mesh {mesh} has {mesh.size} devices, but {processes} processes x {local_devices} "
                              f"devices make {total}; pass a mesh of {total} devices")
    started = time.perf_counter()
    if plan is None:
        planned = plan_jax(spec, mesh, db=db, cluster=cluster, baseline=baseline)
        plan, name, plan_kind = planned.plan, planned.workload.name, baseline or "ilp"
    else:
        name, plan_kind = load_workload(spec).name, "given"
        if plan.mesh.size != total:
            raise JaxCaptureError(f"the given plan's mesh {plan.mesh} has {plan.mesh.size} devices, but {processes} "
                                  f"processes x {local_devices} devices make {total}")
    planning_seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="metadist-jax-multihost-") as folder:
        plan_path = Path(folder) / "plan.json"
        write_atomically(plan_path, plan.to_json())
        coordinator = f"127.0.0.1:{_free_port()}"
        reports_paths = [Path(folder) / f"report{process}.json" for process in range(processes)]
        commands = [
            [sys.executable, "-m", "metadist.frontends.jax.multihost", spec, "--plan", str(plan_path),
             "--coordinator", coordinator, "--processes", str(processes), "--process-id", str(process),
             "--report", str(reports_paths[process]), "--rendezvous-timeout-s", str(int(rendezvous_timeout_s))]
            + (["--check"] if check else [])
            for process in range(processes)
        ]
        started = time.perf_counter()
        _run_all(commands, _worker_env(local_devices), run_timeout_s)
        wall_seconds = time.perf_counter() - started
        reports = tuple(json.loads(path.read_text()) for path in reports_paths)
    summary = JaxMultiHostSummary(name or spec, plan.mesh, processes, local_devices, plan_kind, planning_seconds,
                                  wall_seconds, reports)
    log.info("%s", summary.to_text())
    return summary


def _worker_env(local_devices: int) -> dict[str, str]:
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in flag]
    flags.append(f"--xla_force_host_platform_device_count={local_devices}")
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")


def _free_port() -> int:
    """A TCP port free now on localhost, for JAX's coordinator (JAX itself listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_all(commands: Sequence[list[str]], env: dict[str, str], timeout_s: float) -> None:
    """Run the processes together; if one fails or time runs out, stop the others and raise its error."""
    workers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for command in commands]
    deadline = time.monotonic() + timeout_s
    failed: tuple[int, str] | None = None
    try:
        while any(worker.poll() is None for worker in workers):
            for process, worker in enumerate(workers):
                if worker.poll() not in (None, 0) and failed is None:
                    failed = (process, f"exit status {worker.returncode}")
            if failed is not None:
                break
            if time.monotonic() > deadline:
                failed = (-1, f"no result within {timeout_s:.0f} s")
                break
            time.sleep(0.2)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        outputs = [worker.communicate() for worker in workers]
    if failed is None:
        failed = next(((process, f"exit status {worker.returncode}") for process, worker in enumerate(workers)
                       if worker.returncode != 0), None)
    if failed is not None:
        process, why = failed
        shown = process if process >= 0 else 0
        raise JaxCaptureError(
            f"the multi-process JAX run failed: process {process if process >= 0 else 'all'}: {why}. "
            f"Its stderr ends with:\n{outputs[shown][1][-3000:]}"
        )


# -- one process -------------------------------------------------------------------


def worker_main(argv: Sequence[str] | None = None) -> int:
    """One process of a multi-process run (started by :func:`run_jax_multihost`)."""
    args = _parse(argv)
    import jax

    started = time.perf_counter()
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes,
                               process_id=args.process_id, initialization_timeout=args.rendezvous_timeout_s)
    rendezvous_seconds = time.perf_counter() - started
    try:
        report = _run_one_process(args)
    finally:
        stopping = time.perf_counter()
        jax.distributed.shutdown()
        log.info("process %d: rendezvous %.2f s, shutdown %.2f s, total %.2f s", args.process_id, rendezvous_seconds,
                    time.perf_counter() - stopping, time.perf_counter() - started)
    report["rendezvous_seconds"] = rendezvous_seconds
    write_atomically(args.report, json.dumps(report))
    return 0  # a failed check is in the report; the launcher turns it into the exit status


def _run_one_process(args: argparse.Namespace) -> dict:
    import dataclasses

    import jax
    from jax.experimental import multihost_utils

    from ...ir.plan import Plan, graph_fingerprint
    from ...workloads import load_workload
    from .capture import capture_jax
    from .cli_support import CheckTolerance, compare_outputs
    from .execute import run_graph
    from .sharded import run_sharded
    from .workload import JaxWorkload

    workload = load_workload(args.spec)
    if not isinstance(workload, JaxWorkload):
        raise JaxCaptureError(f"{args.spec!r} is not a JAX workload; multi-process runs through jax.distributed "
                              "take JAX workloads only (PyTorch workloads use metadist run --nproc without --devices)")
    step = capture_jax(workload)
    plan = Plan.from_json(Path(args.plan).read_text())
    if plan.graph_fingerprint != graph_fingerprint(step.graph):
        raise JaxCaptureError(f"process {args.process_id} captured another graph than the one planned (fingerprint "
                              f"{graph_fingerprint(step.graph)} vs {plan.graph_fingerprint}); the step is not "
                              "deterministic across processes")
    inputs = step.graph_inputs(workload.params, workload.opt_state, workload.batch)
    run = run_sharded(step.graph, plan, inputs, raw_params=step.raw_params, devices=jax.devices())
    gathered = [multihost_utils.process_allgather(output, tiled=True) for output in run.outputs]
    report: dict[str, Any] = {
        "process_id": jax.process_index(), "process_count": jax.process_count(),
        "global_devices": jax.device_count(), "local_devices": jax.local_device_count(),
        "loss": float(gathered[0]), "xla_collectives": run.xla_collectives,
        "compile_seconds": run.compile_seconds, "run_seconds": run.run_seconds, "check": None,
    }
    if args.check:
        device = jax.local_devices()[0]
        single = run_graph(step.graph, [jax.device_put(array, device) for array in inputs], raw_params=step.raw_params)
        check = compare_outputs(step, gathered, single, CheckTolerance())
        report["check"] = {key: value for key, value in dataclasses.asdict(check).items() if key != "tolerance"}
    return report


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m metadist.frontends.jax.multihost",
                                     description="One process of a multi-process MetaDist JAX run.")
    parser.add_argument("spec", help="JAX built-in name or path/to/file.py[:function]")
    parser.add_argument("--plan", required=True, help="plan JSON made for the step's graph")
    parser.add_argument("--coordinator", required=True, help="host:port of jax.distributed's coordinator")
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--report", required=True, help="where this process writes its JSON report")
    parser.add_argument("--rendezvous-timeout-s", type=int, default=120)
    parser.add_argument("--check", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(worker_main())
