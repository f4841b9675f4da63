"""MetaDist's own rows: capture, discover, solve (ILP or beam), lower, then run the distributed step.

The compile time is split the way the pipeline is: ``capture`` (the step into MetaIR),
``discovery`` (ShardCombine's rules, from the rule database where known), ``solve`` (the
planner), ``lowering`` (the rank program and its GraphModule). Rank 0 discovers first and fills
the rule database, so the other ranks read it (as ``metadist run`` does); the discovery time
reported is rank 0's.

The cost model's estimates of the same step (MetaDist's plan and the solver's own baselines
``dp``, ``zero2``, ``zero3``, ``megatron``) come back with the rows, so the report can set the
predicted communication and time next to the measured ones. torch's DDP and FSDP2 are priced as they
run (:func:`metadist.solver.baselines.torch_ddp_estimate`: eager compute, one all-reduce per gradient
bucket; :func:`~metadist.solver.baselines.torch_fsdp_estimate`: per unit, its all-gathers and its
reduce-scatter; :func:`~metadist.solver.baselines.torch_tp_estimate`: its activations' all-reduces; each with
the ops torch runs on DTensors counted on the model, :mod:`.torch_counts`), the solver's layout's own estimate kept
as ``solver_layout_step_s``.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..workload import Workload
from .baselines import MethodUnavailable, Prepared, RankContext

log = logging.getLogger(__name__)

METADIST_METHODS = {"metadist-ilp": "ilp", "metadist-beam": "beam", "metadist-ilp-sync": "ilp", "metadist-ilp-bf16": "ilp",
                    "metadist-ilp-recompute": "ilp", "metadist-ilp-bf16-recompute": "ilp"}
"""MetaDist's rows: method -> solver. ``-sync`` runs the ILP's plan with overlap off (every collective waited
for where it is issued), next to ``metadist-ilp`` (issued early, waited for late) in the same run. ``-bf16``
captures and plans the step under the bf16 precision policy (float32 master weights and optimizer state, bf16
computation, gradients reduced in float32; :mod:`metadist.ir.precision`): its loss differs from the float32
single-device loss by bf16 rounding, not by reduction order only."""

PRECISION_OF = {"metadist-ilp-bf16": "bf16", "metadist-ilp-bf16-recompute": "bf16"}
"""Methods that run under a precision policy (the others run the step as written, in float32)."""

SYNC_METHODS = frozenset({"metadist-ilp-sync"})

RECOMPUTE_METHODS = frozenset({"metadist-ilp-recompute", "metadist-ilp-bf16-recompute"})
"""Methods whose every repeated layer recomputes its forward before its backward (full activation checkpointing,
:mod:`metadist.solver.recompute`), planned without a budget: recompute on, next to the same method with it off."""

#: solver baseline -> the measured method it stands for (on a 1-D mesh, on a 2-D mesh).
PREDICTED_AS = {"dp": ("ddp", "ddp"), "zero2": ("zero2", "zero2"), "zero3": ("zero3", "zero3"), "megatron": ("tp", "tp-dp")}


@dataclass(frozen=True)
class Planned:
    """What compiling on this rank produced, before lowering."""

    torch_step: Any
    rules: Any
    cluster: Any
    compile_s: Mapping[str, float]


def _api() -> dict[str, Any]:
    """The pipeline's entry points, or MethodUnavailable naming the missing stage."""
    try:
        from .. import __version__
        from ..cost.cluster import resolve_cluster
        from ..frontends.torch.discovery import TorchExecutor
        from ..frontends.torch.repeat import capture_repeated_step
        from ..ir import Mesh
        from ..runtime.step import CompiledStep
        from ..shardcombine.api import graph_rules
        from ..shardcombine.database import RuleDatabase
        from ..solver import baseline_plan, plan_graph
    except ImportError as err:
        raise MethodUnavailable(f"the MetaDist pipeline is not complete in this tree ({err})") from err
    return dict(version=__version__, resolve_cluster=resolve_cluster,
                capture_step=capture_repeated_step,  # as metadist run: a deep model on 4 layers, expanded
                TorchExecutor=TorchExecutor, Mesh=Mesh, CompiledStep=CompiledStep, graph_rules=graph_rules,
                RuleDatabase=RuleDatabase, baseline_plan=baseline_plan, plan_graph=plan_graph)


def compile_plan_inputs(workload: Workload, ctx: RankContext, api: Mapping[str, Any], model: Any, optimizer: Any,
                        precision: str | None = None) -> Planned:
    """Capture (under ``precision``, a policy name) and discover on this rank (rank 0 first), timing each stage."""
    started = time.perf_counter()
    torch_step = api["capture_step"](workload.train_step(), model, optimizer, workload.batch, name=workload.name or "step",
                                     precision=precision)
    capture_s = time.perf_counter() - started
    discovery_s = 0.0
    with api["RuleDatabase"]() as db:
        for turn in (0, 1):
            if (ctx.rank == 0) == (turn == 0):
                started = time.perf_counter()
                rules = api["graph_rules"](torch_step.graph, api["TorchExecutor"](), db=db)
                discovery_s = time.perf_counter() - started
            dist.barrier()
    cluster = _cluster_over(api["Mesh"](tuple(ctx.mesh_shape)), ctx, api)
    started = time.perf_counter()
    cluster = _with_step_matmuls(cluster, torch_step.graph, ctx)
    timing_s = time.perf_counter() - started
    compile_s = {"capture": capture_s, "discovery": discovery_s}
    if timing_s >= MATMUL_TIMING_SHOWN_S:  # the first plan of a bfloat16 step on this machine times its matmuls
        compile_s["matmul timing"] = timing_s
    return Planned(torch_step, rules, cluster, compile_s)


MATMUL_TIMING_SHOWN_S = 0.05
"""A compile stage ``matmul timing`` is reported when timing the step's matmuls (or waiting for rank 0 to) took
at least this long: the first plan of a step on a machine (:mod:`metadist.cost.matmul_times`)."""


def _with_step_matmuls(cluster: Any, graph: Any, ctx: RankContext) -> Any:
    """``cluster`` pricing the step's matmuls, its fused attention and its relayout copies at their times on this
    machine (:mod:`metadist.cost.matmul_times`, :mod:`metadist.cost.attention_times`,
    :mod:`metadist.cost.relayout_times`): timed by rank 0 while the
    others wait, then read from the cache by every rank. A cluster other than this machine's calibrated one is
    returned as it is."""
    from ..config import settings_from_env
    from ..cost.timed_shapes import with_measured_shapes

    cache_dir = settings_from_env().cache_dir

    def measured(measure: bool) -> Any:
        return with_measured_shapes(cluster, graph, cache_dir, measure=measure)

    if ctx.world_size == 1:
        return measured(True)
    timed = measured(True) if ctx.rank == 0 else None
    dist.barrier()
    return timed if timed is not None else measured(False)


def machine_cpu_cluster(mesh: Any, ctx: RankContext) -> Any:
    """The CPU cluster of ``METADIST_CPU_CLUSTER`` (default: this machine, calibrated on first use by rank 0 while the
    others wait, then read from the cache by every rank)."""
    import sys

    from ..config import settings_from_env
    from ..cost.calibrate import default_cpu_cluster

    settings = settings_from_env()

    def announce(text: str) -> None:
        print(f"metadist bench: {text}", file=sys.stderr, flush=True)

    if ctx.rank == 0:
        default_cpu_cluster(mesh, settings.cpu_cluster, settings.cache_dir, announce=announce)
    dist.barrier()
    return default_cpu_cluster(mesh, settings.cpu_cluster, settings.cache_dir)


def build_metadist(method: str, workload: Workload, ctx: RankContext) -> tuple[Prepared, dict[str, float], dict[str, Any]]:
    """The compiled step of ``method``; its compile times; the cost model's estimate of its plan.

    The plan is made from a planning copy of the model; the model the step trains is another copy made by
    ``Prepared.build`` inside the measured window, as every baseline makes its own, so the memory figures
    count it, the shards its first step puts in its place, and the full tensors that step frees.
    """
    from torch.distributed.device_mesh import init_device_mesh

    api = _api()
    planning_model = copy.deepcopy(workload.model).to(ctx.device)
    planned = compile_plan_inputs(workload, ctx, api, planning_model, workload.optimizer(planning_model.parameters()),
                                  PRECISION_OF.get(method))
    del planning_model
    started = time.perf_counter()
    rules, layers = planned.rules, ()
    if method in RECOMPUTE_METHODS:
        planned, rules, layers = _recomputing(planned)
    plan = _plan_on_rank_zero(lambda: api["plan_graph"](
        planned.torch_step.graph, rules, planned.cluster, memory_budget_bytes=float("inf"), solver=METADIST_METHODS[method],
        reduce_dtype=planned.torch_step.precision.reduce_dtype), ctx)
    plan = replace(plan, recompute=layers)
    solve_s = time.perf_counter() - started
    started = time.perf_counter()
    device_mesh = init_device_mesh(ctx.device.type, tuple(ctx.mesh_shape))
    from ..config import settings_from_env

    compiled = api["CompiledStep"](planned.torch_step, plan, device_mesh, metadist_version=api["version"],
                                   overlap=method not in SYNC_METHODS,
                                   keep_host_memory=settings_from_env().keeps_host_memory)
    lowering_s = time.perf_counter() - started
    batch = workload.batch
    world = ctx.world_size
    state: dict[str, Any] = {}

    def build() -> None:
        state["model"] = copy.deepcopy(workload.model).to(ctx.device)
        state["optimizer"] = workload.optimizer(state["model"].parameters())

    def step() -> torch.Tensor:
        return compiled(state["model"], state["optimizer"], batch).detach() / world

    compile_s = {**planned.compile_s, "solve": solve_s, "lowering": lowering_s}
    prepared = Prepared(method, step=step, holders=(state, compiled, device_mesh), mesh_shape=tuple(ctx.mesh_shape),
                        build=build, note=expert_placement_note(planned.torch_step.graph, plan).lstrip("; "))
    device = planned.cluster.device
    predicted = {**_program_estimate(plan.estimate, compiled.program, planned.cluster,
                                     _node_seconds(planned.torch_step.graph, plan, planned.cluster)),
                 "nodes": len(planned.torch_step.graph.nodes),
                 "op_overhead_s": device.op_overhead_s, "eager_op_overhead_s": device.eager_op_overhead_s,
                 "links": link_figures(planned.cluster)}
    routing = planned.torch_step.graph.routing
    if routing:  # the static experts' extra rows: what a baseline running the library's own experts does not compute
        from ..ir.routing import computed_over_routed

        predicted["expert_rows_over_routed"] = computed_over_routed(routing)
    return prepared, compile_s, predicted


def link_figures(cluster: Any) -> dict[str, dict[str, Any]]:
    """Per mesh axis, the calibrated figures a plan's calls were priced with: the in-step wait (``sync_s`` and its
    points by the compute before a call), each kind's fixed seconds, and the bandwidth. Kept in the result file, so
    that a row priced far from its time can be traced to the calibration it was priced on."""
    return {name: {"sync_s": link.sync_s, "sync_by_gap": [list(point) for point in link.sync_by_gap],
                   "kind_fixed_s": {kind: fixed for kind, fixed, _ in link.kind_costs},
                   "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s}
            for name, link in zip(cluster.mesh.axis_names, cluster.axis_links)}


def _plan_on_rank_zero(solve: Any, ctx: RankContext) -> Any:
    """Rank 0's plan on every rank, as ``metadist run`` plans: one solve, not one per rank.

    Four ranks solving at once on two cores took four times a solve's CPU (LLaMA-tiny bf16 with every layer
    recomputed, 2x2: its 33 s relaxation ran past the 60 s limit), and a solve stopped by its time limit could leave
    the ranks on different plans.
    """
    from ..runtime.plan_source import broadcast_plan

    if ctx.world_size == 1:
        return solve()
    return broadcast_plan(solve() if ctx.rank == 0 else None)


def _recomputing(planned: Planned) -> tuple[Planned, Any, tuple[int, ...]]:
    """``planned`` with every repeated layer recomputing, the rules of the clones, and the layers."""
    from types import SimpleNamespace

    from ..runtime.build import with_recompute
    from ..solver.planner import recomputed_rules
    from ..solver.recompute import recompute_layers

    layers = tuple(layer.layer for layer in recompute_layers(planned.torch_step.graph))
    if not layers:
        raise MethodUnavailable("the model has no repeated layer that can recompute")
    torch_step = with_recompute(planned.torch_step, layers)
    rules, without = recomputed_rules(torch_step.graph, planned.rules.rules)
    missing = dict(planned.rules.missing)
    missing.update({name: missing.get(name.removesuffix(".rc"), "no rule given") for name in without})
    return replace(planned, torch_step=torch_step), SimpleNamespace(rules=rules, missing=missing), layers


def expert_placement_note(graph: Any, plan: Any) -> str:
    """For a graph with experts layers: how the plan placed their stacked expert weights (``""`` otherwise)."""
    placements = set()
    for record in graph.routing:
        for weight in ("gate_up_proj", "down_proj", "up_proj"):
            sharding = plan.input_shardings.get(f"{record.module}.{weight}")
            if sharding is not None:
                placements.add(tuple(str(placement) for placement in sharding))
    if not placements:
        return ""
    axes = sorted({axis for sharding in placements for axis, text in enumerate(sharding) if text == "S(0)"})
    mode = (f"sharded on the experts dim over mesh axes {axes} (expert parallelism)" if axes
            else "not sharded on the experts dim (no expert parallelism)")
    listing = ", ".join("(" + ", ".join(sharding) + ")" for sharding in sorted(placements))
    return f"; expert weights {listing}: {mode}"


def predict_baselines(workload: Workload, ctx: RankContext) -> dict[str, dict[str, Any]]:
    """The cost model's estimate of each solver baseline, keyed by the measured method it stands for. torch's DDP
    and FSDP2 (``ddp``, ``zero2``, ``zero3``) are priced as they run, over all ranks on one axis (as the harness runs
    them whatever the mesh; their layouts solved on that axis too), and torch's TP (``tp``, ``tp-dp``) on the mesh,
    the solver's layout's own estimate kept as ``solver_layout_step_s``."""
    from ..solver.baselines import fsdp_unit_bytes, torch_ddp_estimate, torch_fsdp_estimate
    from .torch_counts import eager_optimizer_ops

    api = _api()
    model = copy.deepcopy(workload.model)
    optimizer = workload.optimizer(model.parameters())
    planned = compile_plan_inputs(workload, ctx, api, model, optimizer)
    two_d = len(ctx.mesh_shape) == 2
    graph = planned.torch_step.graph
    # DDP and FSDP2 run over all ranks on one axis whatever the mesh: their layouts are solved there too (on 2x2 the
    # solver's dp layout replicated mixtral-mini's experts across an axis, ~60 ms of compute DDP never runs)
    flat = planned.cluster if not two_d else _with_step_matmuls(_cluster_over(api["Mesh"]((ctx.world_size,)), ctx, api),
                                                               graph, ctx)
    units = fsdp_unit_bytes(_fsdp_units(model), ctx.world_size)
    fsdp_dtensor_ops = eager_optimizer_ops(workload, model.parameters())  # FSDP2's update runs on DTensors: both ZeRO rows
    predictions: dict[str, dict[str, Any]] = {}
    for kind, (one_d_name, two_d_name) in PREDICTED_AS.items():
        name = two_d_name if two_d else one_d_name
        try:
            over = flat if kind in ("dp", "zero2", "zero3") else planned.cluster
            plan = api["baseline_plan"](graph, planned.rules, over, kind)
        except ValueError as err:  # the solver's errors are ValueErrors with a message
            predictions[name] = {"error": str(err)}
            continue
        if kind == "dp":  # torch's DDP is measured: priced as it runs (eager compute, bucketed gradient all-reduces)
            priced = torch_ddp_estimate(graph, flat, plan.estimate, dp_plan=plan)
        elif kind in ("zero2", "zero3"):  # torch's FSDP2, one unit per block and the root
            priced = torch_fsdp_estimate(graph, flat, plan.estimate, units, reshard_after_forward=kind == "zero3",
                                         layout_plan=plan, dtensor_ops=fsdp_dtensor_ops)
        else:  # torch's tensor parallelism (with FSDP2 on the data-parallel axis of a 2-D mesh)
            priced = _torch_tp_priced(workload, ctx, model, graph, planned.cluster, plan)
            if isinstance(priced, str):
                predictions[name] = {"error": priced}
                continue
        layout = _estimate_summary(plan.estimate)
        predictions[name] = layout if priced is None else (
            _estimate_summary(priced) | {"solver_layout_step_s": layout["step_s"]})
    return predictions


def _torch_tp_priced(workload: Workload, ctx: RankContext, model: Any, graph: Any, cluster: Any, plan: Any) -> dict[str, Any] | str:
    """torch's Megatron-style TP as the harness runs it (``tp`` on a 1-D mesh, ``tp-dp`` on a 2-D one), priced by
    :func:`metadist.solver.baselines.torch_tp_estimate` from counts on ``model`` (:mod:`.torch_counts`); a string
    says why the model has no TP plan at this degree."""
    from ..solver.baselines import fsdp_unit_bytes, torch_tp_estimate
    from .baselines import _family, local_batch, shard_units
    from .torch_counts import tensor_parallel_counts
    from .tp_plans import TensorParallelUnavailable, megatron_plan

    two_d = len(ctx.mesh_shape) == 2
    tp = ctx.mesh_shape[-1] if two_d else ctx.world_size
    try:
        tp_plan = megatron_plan(model, _family(workload), tp)
    except TensorParallelUnavailable as err:
        return str(err)
    batch = local_batch(workload.batch, ctx.mesh_shape[0], 0) if two_d else workload.batch
    counts = tensor_parallel_counts(workload, model, tp_plan, tp, batch, [*shard_units(model), model], with_fsdp=two_d)
    units = fsdp_unit_bytes(counts.local_units, ctx.mesh_shape[0]) if two_d else ()
    return torch_tp_estimate(graph, cluster, plan.estimate, counts.activation_reduces, counts.optimizer_dtensor_ops,
                             units, layout_plan=plan, module_ops=counts.module_dtensor_ops)


def _cluster_over(mesh: Any, ctx: RankContext, api: Mapping[str, Any]) -> Any:
    """The cluster the bench prices ``mesh`` with (every rank calls it: the calibration waits for rank 0)."""
    if ctx.cluster is None and ctx.device.type == "cpu":
        return machine_cpu_cluster(mesh, ctx)
    return api["resolve_cluster"](ctx.cluster, mesh)


def _fsdp_units(model: Any) -> list[list[tuple[tuple[int, ...], int]]]:
    """The (shape, item size) of each parameter of each unit the harness's FSDP2 baselines wrap
    (:func:`.baselines.shard_units`, then the root with every parameter no unit holds), each parameter once."""
    from .baselines import shard_units

    seen: set[int] = set()
    units = []
    for unit in [*shard_units(model), model]:
        mine = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in mine)
        units.append([(tuple(p.shape), p.element_size()) for p in mine])
    return units


def _node_seconds(graph: Any, plan: Any, cluster: Any) -> dict[str, float]:
    """Each planned node's compute seconds on ``cluster`` under its strategy."""
    from ..solver.estimate import node_compute_s

    return {name: node_compute_s(graph, name, strategy, cluster) for name, strategy in plan.node_strategies.items()}


def _program_estimate(estimate: Mapping[str, Any], program: Any, cluster: Any,
                      node_seconds: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The plan's step as its lowered rank program runs it: the solver's compute, and the program's collective calls
    each priced once (:func:`metadist.cost.comm.program_comm`: a bucket pays one call's fixed cost, where the solver
    shares it by an estimate), each call's wait priced by the program's compute before it where the cluster measured
    that (``node_seconds``), and the copies the runtime makes around the calls (``copy_s``: packing, unpacking, an
    all-reduce's clone, local slices); the solver's own figure kept as ``solver_step_s``."""
    from ..cost.comm import program_comm

    summary = _estimate_summary(estimate)
    comm = program_comm(program, cluster, node_seconds)
    comm_s = sum(comm["comm_s_by_axis"].values())
    return summary | {"step_s": summary["compute_s"] + comm_s + comm["copy_s"], "comm_s": comm_s, "copy_s": comm["copy_s"],
                      "comm_bytes": float(sum(comm["comm_bytes_by_axis"].values())),
                      "collectives_by_kind": comm["collectives_by_kind"], "solver_step_s": summary["step_s"]}


def _estimate_summary(estimate: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of a plan estimate that the report compares with measurements."""
    def number(key: str) -> float | None:
        value = estimate.get(key)
        return None if value is None else float(value)

    return {
        "step_s": number("step_s"),
        "compute_s": number("compute_s"),
        "comm_s": number("comm_s"),
        "comm_bytes": float(sum(estimate.get("comm_bytes_by_axis", {}).values())),
        "memory_bytes": number("memory_bytes_peak"),
        "collectives_by_kind": dict(estimate.get("collectives_by_kind", {})),
        "cluster": str(estimate.get("cluster", "")),
    } | ({"dtensor_s": float(estimate["dtensor_s"])} if "dtensor_s" in estimate else {}) \
      | ({"copy_s": float(estimate["copy_s"])} if "copy_s" in estimate else {})
