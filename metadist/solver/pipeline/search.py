"""Choose the pipeline degree, the microbatch count and the schedule together with each stage's sharding.

:func:`search_pipeline` is given a device count (or a mesh whose ``pp`` axis is left free) and
plans every candidate with the same machinery and cost model:

- ``pp = 1``: the whole step on all devices, one ILP (:func:`~metadist.solver.plan_graph`);
- each ``pp`` that divides the devices and the cuttable layer boundaries allow, with each
  microbatch count ``m`` from ``pp`` up (``pp``, ``2 pp``, ``4 pp``... while ``m`` divides the
  global batch): the step captured on one microbatch, cut, each stage planned on the sub-mesh
  (:func:`.planner.plan_pipeline`, budgeted for 1F1B's in-flight activations), then both
  schedules priced on those stage plans (GPipe holds ``m`` microbatches per stage, 1F1B at most
  ``pp - i``; their times agree in this model, so GPipe is chosen only where it ties and fits).

Candidates are planned in the order of a lower bound on their step time (the step's compute split
perfectly over every device, stretched by the pipeline's fill and drain); one whose bound is no
better than the fastest fitting plan found so far is not planned (it is listed, with the bound).
The fastest candidate that fits the memory budget wins; ties go to less memory. The result keeps
every candidate's figures (:meth:`PipelineSearch.explain` prints them with the reason for the
choice: bubble fraction, per-stage seconds and memory, bytes sent between stages).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ...cost import Cluster
from ...ir import Graph, Mesh
from ...ir.pipeline import PP_AXIS, PipelinePlan
from ...ir.plan import Plan
from ..errors import InfeasibleBudgetError, PipelineError, SolverError
from ..planner import plan_graph
from .cuts import cut_candidates, node_seconds
from .planner import pipeline_cluster, pipeline_estimate, plan_pipeline, stage_figures
from .regions import split_regions

logger = logging.getLogger(__name__)

__all__ = ["Candidate", "PipelineSearch", "check_pipeline_mesh", "microbatch_counts", "search_pipeline", "stage_mesh_shape"]


@dataclass(frozen=True)
class Candidate:
    """One (pp, microbatches, schedule, mesh) point of the search, as the cost model prices it."""

    pp: int
    microbatches: int
    schedule: str
    mesh: Mesh
    step_s: float | None = None
    memory_bytes: float | None = None
    bubble_fraction: float = 0.0
    fits: bool = False
    error: str = ""
    plan: PipelinePlan | Plan | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return "no pipeline" if self.pp == 1 else f"pp={self.pp} m={self.microbatches} {self.schedule}"


@dataclass(frozen=True)
class PipelineSearch:
    """Every candidate and the chosen one (None when nothing fits)."""

    devices: int
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    budget_bytes: float | None
    search_s: float

    def explain(self) -> str:
        """Why the chosen candidate won, in words and a table."""
        lines = []
        budget = "no budget" if self.budget_bytes is None else f"{self.budget_bytes / 1e9:.4g} GB per device"
        if self.chosen is None:
            lines.append(f"nothing fits {budget} on {self.devices} devices; the candidates:")
        else:
            c = self.chosen
            lines.append(f"chosen: {c.label} on mesh {c.mesh} ({self.devices} devices): estimated step "
                         f"{c.step_s:.4g} s, peak {c.memory_bytes / 1e9:.4g} GB per device (budget: {budget})")
            if isinstance(c.plan, PipelinePlan):
                e = c.plan.estimate
                lines.append(f"  bubble {e['bubble_fraction']:.1%} of device time in the forward/backward part "
                             f"(fill and drain alone: {e['ideal_bubble_fraction']:.1%}); cuts after "
                             f"{', '.join('%' + v for v in e['cut_values'])}; {e['p2p_bytes_per_microbatch'] / 1e6:.4g} MB "
                             f"per device sent between stages per microbatch, {e['transfer_bytes_per_step'] / 1e6:.4g} MB "
                             "of gradients and tied parameters once per step")
                for index, stage in enumerate(e["stages"]):
                    lines.append(f"  stage {index}: forward {stage['forward_s'] * 1e3:.4g} ms + backward "
                                 f"{stage['backward_s'] * 1e3:.4g} ms per microbatch, update {stage['update_s'] * 1e3:.4g} ms, "
                                 f"{stage['in_flight']} microbatch(es) in flight, peak {stage['memory_bytes_peak'] / 1e9:.4g} GB")
            others = [o for o in self.candidates if o is not c and o.fits and o.step_s is not None]
            if others:
                best = min(others, key=lambda o: (o.step_s, o.memory_bytes))
                lines.append(f"  the next best that fits: {best.label} on mesh {best.mesh}, step x{best.step_s / c.step_s:.3f}")
            unfit = [o for o in self.candidates if not o.fits and o.step_s is not None and o.step_s < c.step_s]
            if unfit:
                lines.append(f"  {len(unfit)} faster candidate(s) do not fit the memory budget")
        lines.append(f"{'candidate':<24} {'mesh':<22} {'step s':>10} {'bubble':>7} {'memory GB':>10}  fits")
        for o in sorted(self.candidates, key=lambda o: (o.pp, o.microbatches, o.schedule)):
            step = "-" if o.step_s is None else f"{o.step_s:.4g}"
            memory = "-" if o.memory_bytes is None else f"{o.memory_bytes / 1e9:.4g}"
            fits = "yes" if o.fits else ("no" + (f": {o.error}" if o.error else ""))
            lines.append(f"{o.label:<24} {str(o.mesh):<22} {step:>10} {o.bubble_fraction:>7.1%} {memory:>10}  {fits}")
        lines.append(f"search: {len(self.candidates)} candidates in {self.search_s:.3g} s")
        return "\n".join(lines)


def stage_mesh_shape(devices: int, per_node: int) -> tuple[int, ...]:
    """The sub-mesh of ``devices`` devices: one axis inside a node, a second across nodes when they do not fit one."""
    if devices <= per_node or devices % per_node:
        return (devices,)
    return (devices // per_node, per_node)


def pipeline_mesh(pp: int, devices: int, per_node: int) -> Mesh:
    """``pp`` outermost (across nodes: only activations cross it), the sub-mesh inside."""
    if pp == 1:
        shape = stage_mesh_shape(devices, per_node)
        return Mesh(shape, ("dp",) if len(shape) == 1 else ("node", "gpu"))
    inner = stage_mesh_shape(devices // pp, per_node)
    names = ("gpu",) if len(inner) == 1 else ("node", "gpu")
    return Mesh((pp, *inner), (PP_AXIS, *names))


def check_pipeline_mesh(devices: int, pp: int) -> None:
    """A clear error when ``pp`` does not divide ``devices``."""
    if pp < 1:
        raise PipelineError(f"the pp degree must be at least 1, got {pp}")
    if devices % pp:
        fits = [d for d in range(1, devices + 1) if devices % d == 0]
        raise PipelineError(f"pp={pp} does not divide the {devices} devices: each stage needs the same number of devices; "
                            f"pp degrees that fit: {', '.join(map(str, fits))}")


def microbatch_counts(global_batch: int, pp: int, most: int = 4) -> list[int]:
    """``pp, 2 pp, 4 pp...`` (at most ``most`` counts) that divide ``global_batch``."""
    counts, m = [], pp
    while m <= global_batch and len(counts) < most:
        if global_batch % m == 0:
            counts.append(m)
        m *= 2
    return counts


def search_pipeline(
    graph_for: Callable[[int, bool], tuple[Graph, Any, str | None]],
    devices: int,
    cluster_for: Callable[[Mesh], Cluster],
    *,
    global_batch: int,
    per_node: int = 8,
    pp_degrees: Sequence[int] | None = None,
    microbatches: Sequence[int] | None = None,
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 60.0,
    most_microbatch_counts: int = 3,
) -> PipelineSearch:
    """Plan every candidate (see the module docstring) and choose.

    ``graph_for(microbatches, raw_grads)``: the step captured on one of ``microbatches`` microbatches (the whole batch
    for 1) with its rules and loss divisor; ``cluster_for(mesh)``: the cost model's cluster on a mesh.
    ``pp_degrees``: the degrees to try (default: every divisor of ``devices`` the step can be cut into);
    ``microbatches``: the counts to try (default: :func:`microbatch_counts`).
    """
    started = time.perf_counter()
    first, _, divisor = graph_for(1, True)
    max_stages = cut_candidates(first, split_regions(first, divisor)).max_stages
    if pp_degrees is None:
        pp_degrees = [d for d in range(1, devices + 1) if devices % d == 0 and d <= max_stages]
    for pp in pp_degrees:
        check_pipeline_mesh(devices, pp)
        if pp > max_stages:
            raise PipelineError(f"pp={pp} needs {pp - 1} cuts, but this step can be cut into at most {max_stages} stages "
                                "(one activation alone crosses only at layer boundaries); use a smaller pp degree")
    points = []
    for pp in pp_degrees:
        counts = [1] if pp == 1 else (
            list(microbatches) if microbatches is not None else microbatch_counts(global_batch, pp, most_microbatch_counts))
        for m in counts:
            if global_batch % m:
                raise PipelineError(f"{m} microbatches do not divide the batch of {global_batch}; counts that fit: "
                                    f"{', '.join(str(d) for d in range(1, global_batch + 1) if global_batch % d == 0)}")
            points.append((pp, m))
    bound = _lower_bounds(first, divisor, cluster_for(pipeline_mesh(1, devices, per_node)), devices)
    points.sort(key=lambda point: bound(*point))
    candidates: list[Candidate] = []
    for pp, m in points:
        mesh = pipeline_mesh(pp, devices, per_node)
        fitting = [c.step_s for c in candidates if c.fits]
        if fitting and bound(pp, m) >= min(fitting):
            candidates.append(Candidate(pp, m, "-" if pp == 1 else "1f1b", mesh, error=(
                f"not planned: no plan of it can beat {min(fitting):.4g} s (its compute alone, split perfectly over "
                f"{devices} devices with its bubble, takes {bound(pp, m):.4g} s)")))
            continue
        began = time.perf_counter()
        if pp == 1:
            candidates.append(_whole(graph_for, mesh, cluster_for(mesh), memory_budget_bytes, time_limit_s))
        else:
            candidates.extend(_pipelined(graph_for, pp, m, mesh, cluster_for(mesh), memory_budget_bytes, time_limit_s))
        logger.info("pipeline search: pp=%d m=%d on %s planned in %.1f s: %s", pp, m, mesh, time.perf_counter() - began,
                    candidates[-1])
    fitting = [c for c in candidates if c.fits]
    chosen = min(fitting, key=lambda c: (c.step_s, c.memory_bytes, c.schedule != "1f1b")) if fitting else None
    budget = cluster_for(pipeline_mesh(1, devices, per_node)).device.memory_capacity_bytes \
        if memory_budget_bytes is None else memory_budget_bytes
    return PipelineSearch(devices, tuple(candidates), chosen, None if budget == float("inf") else budget,
                          time.perf_counter() - started)


def _lower_bounds(graph: Graph, divisor: str | None, cluster: Cluster, devices: int):
    """``bound(pp, m)``: seconds no plan of that point can beat (see :func:`search_pipeline`).

    The whole batch's forward and backward seconds on one device (roofline, ``graph`` holds the whole batch as one
    microbatch) split perfectly over every device and stretched by the fill and drain, ``(m + pp - 1) / m``, plus
    the update split perfectly. A stage's sharded node is never faster than the whole node over the devices
    sharing it, and a microbatch's never faster than its share of the batch's, so no plan beats it.
    """
    regions = split_regions(graph, divisor)
    update, drawn = set(regions.update), set(regions.random)  # drawn values enter a stage's plan as inputs: left out
    per_step = per_microbatch = 0.0
    for node in graph.nodes:
        if node.name in drawn:
            continue
        seconds = node_seconds(graph, node.name, cluster)
        if node.name in update:
            per_step += seconds
        else:
            per_microbatch += seconds

    def bound(pp: int, m: int) -> float:
        return (per_microbatch * (m + pp - 1) / m + per_step) / devices

    return bound


def _whole(graph_for, mesh: Mesh, cluster: Cluster, budget, time_limit_s) -> Candidate:
    graph, rules, _ = graph_for(1, False)
    try:
        plan = plan_graph(graph, rules, cluster, memory_budget_bytes=budget, time_limit_s=time_limit_s, recompute=False)
    except InfeasibleBudgetError as error:
        return Candidate(1, 1, "-", mesh, memory_bytes=error.minimum_bytes, error="no plan fits the budget")
    except SolverError as error:  # e.g. the smallest footprint not found within the time limit
        return Candidate(1, 1, "-", mesh, error=str(error))
    e = plan.estimate
    return Candidate(1, 1, "-", mesh, step_s=e["step_s"], memory_bytes=e["memory_bytes_peak"],
                     fits=plan.solver.get("memory_budget_exceeded_bytes", 0.0) == 0.0, plan=plan)


def _pipelined(graph_for, pp: int, m: int, mesh: Mesh, cluster: Cluster, budget, time_limit_s) -> list[Candidate]:
    graph, rules, divisor = graph_for(m, True)
    try:
        plan = plan_pipeline(graph, rules, cluster, microbatches=m, schedule="1f1b", loss_divisor=divisor,
                             memory_budget_bytes=budget, time_limit_s=time_limit_s)
    except InfeasibleBudgetError as error:
        need = "" if error.minimum_bytes is None else f" (a stage needs at least {error.minimum_bytes / 1e9:.4g} GB)"
        return [Candidate(pp, m, "1f1b", mesh, memory_bytes=error.minimum_bytes, error="no stage plan fits" + need)]
    except SolverError as error:
        return [Candidate(pp, m, "1f1b", mesh, error=str(error))]
    limit = plan.estimate["memory_budget_bytes"]
    result = [_candidate(pp, m, mesh, plan, limit)]
    stage_cluster, pp_link = pipeline_cluster(cluster)
    figures = [stage_figures(_stage_graph(graph, plan, stage), stage, stage.plan, stage_cluster) for stage in plan.stages]
    gpipe = pipeline_estimate(figures, m, "gpipe", pp_link)
    gpipe_plan = _with_schedule(plan, "gpipe", gpipe)
    result.append(_candidate(pp, m, mesh, gpipe_plan, limit))
    return result


def _stage_graph(graph: Graph, plan: PipelinePlan, stage):
    from ...ir.stage_graphs import stage_graph

    return stage_graph(graph, stage, plan.loss, plan.transfers)


def _with_schedule(plan: PipelinePlan, schedule: str, figures: dict) -> PipelinePlan:
    from dataclasses import replace

    keep = {key: plan.estimate[key] for key in ("cluster", "memory_budget_bytes", "cut_positions", "cut_values", "max_stages")}
    figures = dict(figures, step_s=plan.estimate["step_s"] - plan.estimate["forward_backward_s"] - plan.estimate["update_s"]
                   + figures["forward_backward_s"] + figures["update_s"], stage_transfers_s=plan.estimate["stage_transfers_s"],
                   transfer_bytes_per_step=plan.estimate["transfer_bytes_per_step"], **keep)
    return replace(plan, schedule=schedule, estimate=figures)


def _candidate(pp: int, m: int, mesh: Mesh, plan: PipelinePlan, budget: float | None) -> Candidate:
    e = plan.estimate
    fits = budget is None or e["memory_bytes_peak"] <= budget * (1 + 1e-9)
    return Candidate(pp, m, plan.schedule, mesh, step_s=e["step_s"], memory_bytes=e["memory_bytes_peak"],
                     bubble_fraction=e["bubble_fraction"], fits=fits,
                     error="" if fits else f"stage {e['memory_peak_stage']} needs {e['memory_bytes_peak'] / 1e9:.4g} GB",
                     plan=plan)
