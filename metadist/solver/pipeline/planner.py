"""Plan a pipeline: cut the microbatch graph into stages, shard each stage on its sub-mesh, price the schedule.

:func:`plan_pipeline` takes the step captured on **one microbatch** (``capture_step(...,
raw_grads=True)``) and a cluster whose mesh has a ``pp`` axis, and returns a
:class:`~metadist.ir.pipeline.PipelinePlan`:

1. the regions of the step (:mod:`.regions`) and the cuts that balance the stages' seconds, the
   activation sends over the ``pp`` axis's link priced in (:mod:`.partition`);
2. each stage's graph (forward, backward and update of its nodes) planned by the same ILP as a
   whole step (:func:`~metadist.solver.plan_graph`) on the sub-mesh, the mesh without ``pp``;
   the memory budget each stage plan gets leaves room for the activations the schedule keeps in
   flight (below), and is tightened and solved again when the schedule's peak breaks it;
3. the pipeline estimate (:func:`pipeline_estimate`): each stage's per-microbatch forward and
   backward seconds and once-per-step update seconds (compute and the sub-mesh's collectives, the
   same cost model), the point-to-point sends between stages, the schedule's step time and its
   bubble, each stage's peak memory with the microbatches in flight.

The schedules (:data:`~metadist.ir.pipeline.SCHEDULES`): **GPipe** runs every microbatch's
forward, then every backward: stage ``i`` keeps ``m`` microbatches' saved activations.
**1F1B** (non-interleaved) alternates one forward and one backward after a warm-up: stage ``i``
of ``p`` keeps at most ``min(m, p - i)``. Both take the same time in this model (the same
bubble: ``p - 1`` stage slots at the start and at the end), so 1F1B wins whenever memory
matters, and ties otherwise.

Step time: with ``F_i``, ``B_i`` a stage's seconds per microbatch (sends included) and ``U_i``
its update, the forward/backward part takes ``sum_i (F_i + B_i) + (m - 1) * max_i (F_i + B_i)``
(the first microbatch crosses every stage both ways; the slowest stage paces the others) and the
update ``max_i U_i`` after it, plus the once-per-step gradient and parameter transfers between
stages. The **bubble fraction** is the share of device time idle in the forward/backward part:
``1 - m * sum_i (F_i + B_i) / (p * T_fb)``; it counts imbalance between stages as well as the
fill and drain (``(p - 1) / (m + p - 1)`` for equal stages).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from ...cost import OUTPUT_CONSUMER, Cluster, Link, bucketing_for, local_nbytes, reshard
from ...ir import Graph, Mesh
from ...ir.pipeline import PP_AXIS, SCHEDULES, PipelinePlan, Stage, sub_mesh
from ...ir.plan import Plan, graph_fingerprint
from ...ir.stage_graphs import stage_graph
from ..errors import InfeasibleBudgetError, PipelineError
from ..estimate import Assignment, node_compute_s, value_shardings
from ..planner import plan_graph, split_rules
from ..problem import final_output_sharding
from .partition import Partition, partition
from .regions import split_regions

logger = logging.getLogger(__name__)

__all__ = ["StageFigures", "in_flight", "pipeline_cluster", "pipeline_estimate", "plan_pipeline", "point_to_point_s"]

MAX_MEMORY_ROUNDS = 3
"""How many times a stage plan is solved again with a tighter budget when the schedule's in-flight activations break it."""


def pipeline_cluster(cluster: Cluster) -> tuple[Cluster, Link]:
    """The cluster one stage is planned on (the mesh without ``pp``, its links) and the ``pp`` axis's link."""
    mesh = cluster.mesh
    if PP_AXIS not in mesh.axis_names:
        raise PipelineError(f"mesh {mesh} has no {PP_AXIS!r} axis; name one axis pp (e.g. pp=2,dp=2) to plan a pipeline")
    axis = mesh.axis_index(PP_AXIS)
    links = tuple(link for index, link in enumerate(cluster.axis_links) if index != axis)
    stage_mesh = sub_mesh(mesh)
    if not links:
        links = (cluster.axis_links[axis],)  # the 1-device stand-in axis: never used for a collective
    return replace(cluster, mesh=stage_mesh, axis_links=links), cluster.axis_links[axis]


def in_flight(schedule: str, stages: int, index: int, microbatches: int) -> int:
    """How many microbatches' saved activations stage ``index`` holds at once under ``schedule``."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages - index)
    raise PipelineError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")


def point_to_point_s(nbytes: float, link: Link) -> float:
    """Seconds of one send of ``nbytes`` between neighbouring stages (every rank sends its own piece at once)."""
    if nbytes <= 0:
        return 0.0
    return link.call_overhead_s + link.latency_s + nbytes / link.bandwidth_bytes_per_s


@dataclass(frozen=True)
class StageFigures:
    """What one stage's plan costs, per phase, on one device of its sub-mesh."""

    forward_s: float
    """Seconds of one microbatch's forward phase (compute and the sub-mesh's collectives)."""
    backward_s: float
    update_s: float
    """Seconds of the update, once per step."""
    memory_bytes: float
    """The stage plan's peak (one microbatch through forward, backward and update)."""
    saved_bytes: float
    """Bytes per device one microbatch keeps from its forward for its backward (activations in flight)."""
    send_up_bytes: float
    """Bytes per device sent to the next stage per microbatch (forward)."""
    send_down_bytes: float
    """Bytes per device sent to the previous stage per microbatch (backward)."""

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def stage_figures(graph: Graph, stage: Stage, plan: Plan, cluster: Cluster) -> StageFigures:
    """Per-phase seconds and the bytes that matter to the schedule, from one stage plan (its graph: ``graph``)."""
    assignment = Assignment(plan.node_strategies, plan.input_shardings)
    phase = {name: "forward" for name in stage.forward}
    phase.update({name: "backward" for name in stage.backward})
    phase.update({name: "update" for name in stage.update})
    seconds = {"forward": 0.0, "backward": 0.0, "update": 0.0}
    for node in graph.nodes:
        seconds[phase[node.name]] += node_compute_s(graph, node.name, plan.node_strategies[node.name], cluster)
    produced = value_shardings(graph, assignment)
    bucketing = bucketing_for(graph)
    cache: dict[tuple, float] = {}

    def reshard_s(name: str, src, dst, consumer: str) -> float:
        spec = graph.value(name).spec
        key = (spec, src, dst, bucketing.share(name, consumer))
        if key not in cache:
            cache[key] = reshard(spec, src, dst, cluster, key[3]).comm_s
        return cache[key]

    for node in graph.nodes:
        strategy = plan.node_strategies[node.name]
        for name, needed in zip(node.input_names, strategy.inputs):
            seconds[phase[node.name]] += reshard_s(name, produced[name], needed, node.name)
    maker_phase = {value.name: phase[node.name] for node in graph.nodes for value in node.output_values}
    for output in graph.outputs:
        src = produced[output.name]
        dst = plan.input_shardings[output.replaces] if output.replaces else final_output_sharding(src)
        seconds[maker_phase.get(output.name, "update")] += reshard_s(output.name, src, dst, OUTPUT_CONSUMER)

    def local(names: Sequence[str], shardings: Mapping[str, tuple]) -> float:
        return sum(local_nbytes(graph.value(name).spec, shardings.get(name), cluster.mesh) for name in dict.fromkeys(names))

    final = {name: final_output_sharding(sharding) for name, sharding in produced.items()}
    return StageFigures(
        forward_s=seconds["forward"], backward_s=seconds["backward"], update_s=seconds["update"],
        memory_bytes=float(plan.estimate["memory_bytes_peak"]), saved_bytes=local(stage.saved, produced),
        send_up_bytes=local(stage.forward_send, final), send_down_bytes=local(stage.backward_send, final),
    )


def pipeline_estimate(
    figures: Sequence[StageFigures],
    microbatches: int,
    schedule: str,
    pp_link: Link,
    transfer_bytes: Sequence[float] = (),
) -> dict[str, Any]:
    """The schedule's step time, bubble and per-stage memory (see the module docstring).

    ``transfer_bytes``: bytes per device of each once-per-step gradient or parameter transfer between stages.
    """
    stages = len(figures)
    if microbatches < 1:
        raise PipelineError(f"a pipeline runs at least 1 microbatch, got {microbatches}")
    up = [point_to_point_s(f.send_up_bytes, pp_link) for f in figures]
    down = [point_to_point_s(f.send_down_bytes, pp_link) for f in figures]
    slot = [f.forward_s + f.backward_s + up[i] + down[i] for i, f in enumerate(figures)]
    forward_backward_s = sum(slot) + (microbatches - 1) * max(slot)
    update_s = max(f.update_s for f in figures)
    transfers_s = sum(point_to_point_s(nbytes, pp_link) for nbytes in transfer_bytes)
    busy = microbatches * sum(f.forward_s + f.backward_s for f in figures)
    bubble = 1.0 - busy / (stages * forward_backward_s) if forward_backward_s > 0 else 0.0
    memory = [f.memory_bytes + (in_flight(schedule, stages, i, microbatches) - 1) * f.saved_bytes
              for i, f in enumerate(figures)]
    compute_s = sum(f.forward_s + f.backward_s for f in figures) * microbatches + sum(f.update_s for f in figures)
    return {
        "step_s": forward_backward_s + update_s + transfers_s,
        "forward_backward_s": forward_backward_s,
        "update_s": update_s,
        "stage_transfers_s": transfers_s,
        "bubble_fraction": bubble,
        "ideal_bubble_fraction": (stages - 1) / (microbatches + stages - 1),
        "microbatches": microbatches,
        "schedule": schedule,
        "stages": [dict(f.to_dict(), slot_s=slot[i], send_up_s=up[i], send_down_s=down[i], memory_bytes_peak=memory[i],
                        in_flight=in_flight(schedule, stages, i, microbatches)) for i, f in enumerate(figures)],
        "memory_bytes_peak": max(memory),
        "memory_peak_stage": max(range(stages), key=memory.__getitem__),
        "p2p_bytes_per_microbatch": sum(f.send_up_bytes + f.send_down_bytes for f in figures),
        "transfer_bytes_per_step": float(sum(transfer_bytes)),
        "device_seconds": compute_s,
    }


def plan_pipeline(
    graph: Graph,
    rules: Any,
    cluster: Cluster,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    loss_divisor: str | None = None,
    memory_budget_bytes: float | None = None,
    solver: str = "ilp",
    time_limit_s: float = 60.0,
    the_partition: Partition | None = None,
    stage_planner: Any = None,
) -> PipelinePlan:
    """Plan ``graph`` (one microbatch, gradients marked) as a pipeline on ``cluster`` (its mesh has a ``pp`` axis).

    ``microbatches``: how many microbatches a step runs (the caller captured ``graph`` on one of them);
    ``memory_budget_bytes``: per device, None for the device's capacity, ``inf`` for none. A stage that cannot fit
    raises :class:`InfeasibleBudgetError` naming the stage. ``stage_planner(graph, rules, cluster, budget)``: plans each
    stage instead of the ILP (a hand layout such as Megatron's TP, for comparisons); default :func:`plan_graph`.
    """
    from ... import __version__

    started = time.perf_counter()
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise PipelineError(f"--microbatches must be at least 1, got {microbatches}")
    stage_cluster, pp_link = pipeline_cluster(cluster)
    stages = cluster.mesh.shape[cluster.mesh.axis_index(PP_AXIS)]
    regions = split_regions(graph, loss_divisor)
    cut = the_partition if the_partition is not None else partition(graph, regions, stages, cluster, pp_link, microbatches=microbatches)
    cut_s = time.perf_counter() - started
    budget = cluster.device.memory_capacity_bytes if memory_budget_bytes is None else memory_budget_bytes
    rule_map, missing = split_rules(rules)
    planned, figures, solve_s = [], [], []
    for stage in cut.layout.stages:
        graph_s = stage_graph(graph, stage, regions.loss, cut.layout.transfers)
        stage_rules = {name: rule_map[name] for name in stage_rules_names(graph_s, rule_map)}
        stage_missing = {name: reason for name, reason in missing.items() if name in {n.name for n in graph_s.nodes}}
        began = time.perf_counter()
        plan, figure = _plan_stage(graph_s, stage, _StageRules(stage_rules, stage_missing), stage_cluster, budget, schedule,
                                   stages, microbatches, solver, time_limit_s, stage_planner)
        solve_s.append(time.perf_counter() - began)
        planned.append(replace(stage, plan=plan))
        figures.append(figure)
    transfer_bytes = _transfer_bytes(graph, cut, planned, stage_cluster.mesh)
    figures_all = pipeline_estimate(figures, microbatches, schedule, pp_link, transfer_bytes)
    figures_all.update(cluster=cluster.name, memory_budget_bytes=None if budget == float("inf") else float(budget),
                       cut_positions=list(cut.positions), cut_values=[_crossing(cut, p) for p in cut.positions],
                       max_stages=cut.candidates.max_stages)
    return PipelinePlan(
        graph_name=graph.name, graph_fingerprint=graph_fingerprint(graph), metadist_version=__version__,
        mesh=cluster.mesh, microbatches=microbatches, schedule=schedule, loss=regions.loss, loss_divisor=loss_divisor,
        stages=tuple(planned), transfers=cut.layout.transfers, grads=dict(cut.layout.grads), estimate=figures_all,
        solver={"kind": "pipeline", "cut_s": round(cut_s, 4), "stage_solve_s": [round(s, 4) for s in solve_s],
                "solve_s": round(time.perf_counter() - started, 4),
                "stage_status": [stage.plan.solver.get("status", "") for stage in planned]},
    )


@dataclass(frozen=True)
class _StageRules:
    """A stage's share of the step's rules, in the shape :func:`split_rules` reads."""

    rules: Mapping[str, Any]
    missing: Mapping[str, str]


def stage_rules_names(graph: Graph, rules: Mapping[str, Any]) -> list[str]:
    return [node.name for node in graph.nodes if node.name in rules]


def _crossing(cut: Partition, position: int) -> str:
    return cut.candidates.crossing[cut.candidates.positions.index(position)]


def _plan_stage(graph: Graph, stage: Stage, rules, cluster: Cluster, budget: float, schedule: str, stages: int,
                microbatches: int, solver: str, time_limit_s: float, stage_planner: Any = None) -> tuple[Plan, StageFigures]:
    """The stage's plan under a budget that leaves room for the microbatches the schedule keeps in flight."""
    extra = in_flight(schedule, stages, stage.index, microbatches) - 1
    stage_budget = budget
    best = None
    for _ in range(MAX_MEMORY_ROUNDS):
        try:
            if stage_planner is not None:
                plan = stage_planner(graph, rules, cluster, stage_budget)
            else:
                plan = plan_graph(graph, rules, cluster, memory_budget_bytes=stage_budget, solver=solver,
                                  time_limit_s=time_limit_s, recompute=False)  # stages are not rewritten for recomputation
        except InfeasibleBudgetError as error:
            if best is not None:  # a tighter budget for the activations in flight has no plan: keep the closest one
                logger.info("stage %d: no plan within %.0f bytes; keeping the smallest found", stage.index, stage_budget)
                break
            raise InfeasibleBudgetError(budget, error.minimum_bytes,
                                        f" (pipeline stage {stage.index} of {stages}: {len(stage.forward)} forward nodes; "
                                        "more stages or a larger sub-mesh give each stage less to hold)") from None
        figure = stage_figures(graph, stage, plan, cluster)
        total = figure.memory_bytes + extra * figure.saved_bytes
        if best is None or total < best[2]:
            best = (plan, figure, total)
        if budget == float("inf") or total <= budget * (1 + 1e-9) or extra == 0 or stage_planner is not None:
            return plan, figure
        stage_budget = min(stage_budget, budget - extra * figure.saved_bytes)
        if stage_budget <= 0:
            break
        logger.info("stage %d: %d microbatches in flight break the budget; solving again with %.0f bytes", stage.index,
                    extra + 1, stage_budget)
    return best[0], best[1]  # the estimate states the peak; the search marks the candidate as not fitting


def _transfer_bytes(graph: Graph, cut: Partition, stages: Sequence[Stage], mesh: Mesh) -> list[float]:
    """Bytes per device of each once-per-step transfer, in the sending stage's sharding."""
    result = []
    for transfer in cut.layout.transfers:
        plan = stages[transfer.source].plan
        sharding = plan.input_shardings.get(transfer.value)
        if sharding is None:
            maker = graph.producer(transfer.value)
            strategy = plan.node_strategies[maker.name]
            position = [value.name if value is not None else None for value in maker.outputs].index(transfer.value)
            sharding = final_output_sharding(strategy.outputs[position])
        result.append(local_nbytes(graph.value(transfer.value).spec, sharding, mesh))
    return result
