"""The JAX pipeline as the CLI runs it: capture -> discover -> solve -> run through XLA -> check.

``plan_jax(name, mesh)`` captures a JAX workload, finds the rule of every op
(rule database under framework ``"jax"``) and plans it; ``run_jax(name)`` also
runs the plan on JAX devices (8 CPU devices here), counts the collectives XLA
inserted next to the plan's prediction, and with ``check=True`` compares loss
and updated state with a single-device run. Both return frozen summaries whose
``to_text()`` the CLI prints.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ...ir import Mesh, Role
from ...ir.plan import Plan
from .capture import JaxStep, capture_jax
from .errors import JaxCaptureError
from .workload import JaxWorkload

__all__ = ["CheckTolerance", "JaxCheck", "JaxPlanned", "JaxRunSummary", "plan_jax", "request_cpu_devices", "run_jax"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CheckTolerance:
    """How close the sharded step must come to the single-device step (float32, one AdamW step)."""

    rtol: float = 1e-4
    """Relative tolerance on every output (summation order differs across shards)."""
    atol: float = 1e-6
    """Absolute tolerance on the loss and the optimizer state (Adam's moments hold the gradients)."""
    param_atol: float = 5e-4
    """Absolute tolerance on the parameters: half the built-ins' learning rate. Adam moves each entry by
    about ``lr * g / |g|``, so an entry whose gradient is within float noise of zero may move by up to
    ``lr`` differently in either run; the moments above check the gradients themselves."""


@dataclass(frozen=True)
class JaxCheck:
    """The sharded step against one device: largest differences and the verdict."""

    passed: bool
    loss_sharded: float
    loss_single: float
    max_abs_diff_params: float
    max_abs_diff_state: float
    worst_output: str
    """The output with the largest difference relative to its tolerance."""
    tolerance: CheckTolerance


@dataclass(frozen=True)
class JaxPlanned:
    """A captured, planned JAX workload (what ``plan_jax`` returns)."""

    workload: JaxWorkload
    step: JaxStep
    rules: Any
    """ShardCombine's ``GraphRules`` for the graph."""
    plan: Plan
    discovery_seconds: float
    solve_seconds: float


@dataclass(frozen=True)
class JaxRunSummary:
    """Times, collectives and the check of one ``run_jax``."""

    workload: str
    mesh: Mesh
    nodes: int
    capture_seconds: float
    discovery_seconds: float
    signatures: int
    signatures_from_db: int
    ops_without_rule: int
    solve_seconds: float
    plan_kind: str
    planned_collectives: Mapping[str, int] | None
    xla_collectives: Mapping[str, int]
    compile_seconds: float
    run_seconds: float
    check: JaxCheck | None = None
    extras: dict = field(default_factory=dict)

    def to_text(self) -> str:
        """A short human-readable report."""
        lines = [
            f"{self.workload} on mesh {self.mesh} ({self.plan_kind} plan), {self.nodes} ops",
            f"  capture {self.capture_seconds:.2f} s | discovery {self.discovery_seconds:.2f} s "
            f"({self.signatures} signatures, {self.signatures_from_db} from the rule database, "
            f"{self.ops_without_rule} ops without a rule) | solve {self.solve_seconds:.2f} s",
            f"  XLA compile {self.compile_seconds:.2f} s | step {self.run_seconds * 1e3:.1f} ms",
            "  collectives   " + "  ".join(f"{kind:>18}" for kind in self.xla_collectives),
            "    plan        " + "  ".join(f"{_count(self.planned_collectives, kind):>18}" for kind in self.xla_collectives),
            "    XLA         " + "  ".join(f"{count:>18}" for count in self.xla_collectives.values()),
        ]
        if self.check is not None:
            check = self.check
            verdict = "PASSED" if check.passed else "FAILED"
            lines.append(
                f"  check {verdict}: loss {check.loss_sharded:.6f} (sharded) vs {check.loss_single:.6f} (1 device); "
                f"max |diff| params {check.max_abs_diff_params:.2e}, optimizer state {check.max_abs_diff_state:.2e} "
                f"(rtol {check.tolerance.rtol:g}, atol {check.tolerance.atol:g}/{check.tolerance.param_atol:g} params; "
                f"worst: {check.worst_output})"
            )
        return "\n".join(lines) + "\n"


def request_cpu_devices(count: int) -> None:
    """Ask XLA for ``count`` host (CPU) devices; works only before jax is imported.

    The CLI calls this first thing. If jax is already imported with fewer
    devices, :func:`run_jax` explains how to restart with the flag.
    """
    if "jax" in sys.modules:
        return
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def _workload(name_or_workload: str | JaxWorkload) -> JaxWorkload:
    if isinstance(name_or_workload, JaxWorkload):
        return name_or_workload
    from ...workloads.jax_builtin import jax_builtin_workload

    return jax_builtin_workload(name_or_workload)


def plan_jax(name: str | JaxWorkload, mesh: Mesh | str | None = None, *, devices: int = 8, db: Any = None,
             cluster: str | None = None, baseline: str | None = None, memory_budget_bytes: float | None = None) -> JaxPlanned:
    """Capture, discover and plan a JAX workload (a built-in name or a :class:`JaxWorkload`).

    ``mesh`` defaults to ``devices`` devices on one axis; ``db`` is a rule database
    (a path, a ``RuleDatabase``, or None for the default one); ``cluster`` a preset name
    or cluster JSON file; ``baseline`` one of the solver's baselines instead of the ILP.
    """
    from ...cost import resolve_cluster
    from ...shardcombine import graph_rules
    from ...solver import baseline_plan, plan_graph
    from .discovery import JaxOpExecutor

    mesh = _mesh(mesh, devices)
    workload = _workload(name)
    step = capture_jax(workload)
    started = time.perf_counter()
    rules = graph_rules(step.graph, JaxOpExecutor(step.raw_params), db=_rule_db(db))
    discovery_seconds = time.perf_counter() - started
    cluster_spec = resolve_cluster(cluster, mesh)
    started = time.perf_counter()
    # even splits only: jit's in and out shardings must divide every dim (JAX refuses torch.chunk-style pieces)
    if baseline is None:
        plan = plan_graph(step.graph, rules, cluster_spec, memory_budget_bytes=memory_budget_bytes, uneven_shards=False,
                          recompute=False)  # the JAX runtime does not rewrite its graph for recomputation
    else:
        plan = baseline_plan(step.graph, rules, cluster_spec, baseline, uneven_shards=False)
    solve_seconds = time.perf_counter() - started
    log.info("planned %s on %s in %.2f s (discovery %.2f s)", workload.name, mesh, solve_seconds, discovery_seconds)
    return JaxPlanned(workload, step, rules, plan, discovery_seconds, solve_seconds)


def run_jax(name: str | JaxWorkload, devices: int = 8, check: bool = True, mesh: Mesh | str | None = None, *,
            db: Any = None, cluster: str | None = None, baseline: str | None = None,
            tolerance: CheckTolerance = CheckTolerance()) -> JaxRunSummary:
    """Plan a JAX workload, run the plan through XLA on ``devices`` devices, and (``check``) verify it."""
    request_cpu_devices(devices)
    _check_devices(_mesh(mesh, devices))
    planned = plan_jax(name, mesh, devices=devices, db=db, cluster=cluster, baseline=baseline)
    from .execute import run_graph
    from .sharded import predicted_collectives, run_sharded

    step, workload = planned.step, planned.workload
    inputs = step.graph_inputs(workload.params, workload.opt_state, workload.batch)
    sharded = run_sharded(step.graph, planned.plan, inputs, raw_params=step.raw_params)
    result = None
    if check:
        single = run_graph(step.graph, _on_one_device(inputs), raw_params=step.raw_params)
        result = compare_outputs(step, sharded.outputs, single, tolerance)
    stats = planned.rules.stats
    summary = JaxRunSummary(
        workload=workload.name or "jax-step", mesh=planned.plan.mesh, nodes=len(step.graph.nodes),
        capture_seconds=step.capture_seconds, discovery_seconds=planned.discovery_seconds,
        signatures=stats.signatures, signatures_from_db=stats.found_in_db, ops_without_rule=len(planned.rules.missing),
        solve_seconds=planned.solve_seconds, plan_kind=baseline or "ilp",
        planned_collectives=predicted_collectives(step.graph, planned.plan), xla_collectives=sharded.xla_collectives,
        compile_seconds=sharded.compile_seconds, run_seconds=sharded.run_seconds, check=result,
        extras={"estimate_comm_s": planned.plan.estimate.get("comm_s")},
    )
    log.info("%s", summary.to_text())
    return summary


def compare_outputs(step: JaxStep, sharded: list[Any], single: list[Any], tolerance: CheckTolerance) -> JaxCheck:
    """Compare the sharded step's outputs with the single-device ones, output by output."""
    worst_name, worst_ratio = "", -1.0
    max_diff = {Role.PARAM: 0.0, Role.OPTIM_STATE: 0.0}
    passed = True
    loss_sharded = loss_single = float("nan")
    for output, got, want in zip(step.graph.outputs, sharded, single):
        got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        if output.role is Role.LOSS:
            loss_sharded, loss_single = float(got), float(want)
        diff = np.abs(got - want)
        atol = tolerance.param_atol if output.role is Role.PARAM else tolerance.atol
        allowed = atol + tolerance.rtol * np.abs(want)
        ratio = float(np.max(diff / allowed)) if diff.size else 0.0
        passed = passed and ratio <= 1.0
        if output.role in max_diff and diff.size:
            max_diff[output.role] = max(max_diff[output.role], float(np.max(diff)))
        if ratio > worst_ratio:
            worst_name, worst_ratio = output.source or output.name, ratio
    return JaxCheck(passed, loss_sharded, loss_single, max_diff[Role.PARAM], max_diff[Role.OPTIM_STATE],
                    worst_name, tolerance)


# -- helpers -----------------------------------------------------------------


def _mesh(mesh: Mesh | str | None, devices: int) -> Mesh:
    if mesh is None:
        return Mesh((devices,))
    return Mesh.parse(mesh) if isinstance(mesh, str) else mesh


def _rule_db(db: Any) -> Any:
    from ...shardcombine.database import RuleDatabase

    if db is None:
        return RuleDatabase()
    if isinstance(db, (str, os.PathLike)):
        return RuleDatabase(db)
    return db


def _check_devices(mesh: Mesh) -> None:
    import jax

    count = len(jax.devices())
    if count < mesh.size:
        raise JaxCaptureError(
            f"mesh {mesh} needs {mesh.size} devices and JAX sees {count} ({jax.default_backend()}). JAX was imported "
            f"before MetaDist could ask for host devices: set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{mesh.size} in the environment before starting Python, or use a smaller mesh"
        )


def _on_one_device(inputs: list[Any]) -> list[Any]:
    import jax

    device = jax.devices()[0]
    return [jax.device_put(array, device) for array in inputs]


def _count(counts: Mapping[str, int] | None, kind: str) -> str:
    return "n/a" if counts is None else str(counts.get(kind, 0))
