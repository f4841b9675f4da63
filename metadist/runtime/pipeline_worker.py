"""The rank recipe of ``metadist run --mesh pp=...``: plan the pipeline, run its stages, check them.

Each rank: the device mesh (a mesh with only ``pp`` gets a 1-device ``stage`` axis, the stages'
sub-mesh), the workload and one starting state (rank 0's), the step captured on one microbatch
with raw gradients, the pipeline plan (rank 0 plans, every rank receives it as JSON and proves it
holds the same one), this rank's :class:`~metadist.runtime.pipeline.PipelineStep`, K steps, and
with ``--check`` the comparison with one device (loss, accumulated gradients, updated parameters
and optimizer state). What a pipeline run does not support yet is refused before anything runs.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..files import write_atomically
from ..ir import Mesh
from ..ir.pipeline import PP_AXIS, PipelinePlan
from .errors import RunInputError

__all__ = ["default_microbatches", "pipeline_device_mesh", "pipeline_plan", "run_pipeline_worker"]


def default_microbatches(pp: int, global_batch: int) -> int:
    """``pp`` microbatches, or the most that divide the batch below that."""
    return max(d for d in range(1, min(pp, global_batch) + 1) if global_batch % d == 0)


def pipeline_device_mesh(mesh: Mesh) -> Mesh:
    """The mesh the device mesh is made of: ``mesh``, or with only ``pp``, a 1-device ``stage`` axis after it."""
    return mesh if len(mesh.shape) > 1 else Mesh((mesh.shape[0], 1), (PP_AXIS, "stage"))


def refuse_unsupported(config: Any) -> None:
    """One error naming every option a pipeline run does not take yet."""
    unsupported = [flag for flag, on in (
        ("--precision/--reduce-dtype", config.precision is not None or config.reduce_dtype not in ("default", None)),
        ("--expert-capacity-factor", config.expert_capacity_factor is not None),
        ("--compile", config.compile_backend is not None), ("--check-shapes", config.check_shapes),
        ("--plan " + str(config.plan), config.plan != "solver"),
    ) if on]
    if unsupported:
        raise RunInputError(f"a pipeline run (a mesh with a pp axis) does not support {', '.join(unsupported)} yet; "
                            "leave them out, or run on a mesh without a pp axis")


def run_pipeline_worker(config: Any, env: Any, reporter: Any, phase_times: Any = None) -> int:
    from ..frontends.torch.repeat import capture_repeated, capture_repeated_step
    from ..frontends.torch.materialize import has_meta_tensors, materialize
    from ..frontends.torch.microbatch import batch_size_of, first_microbatch
    from ..gc_pause import freeze_survivors
    from ..progress import enter
    from .pipeline import PipelineStep
    from .setup import check_same_everywhere, setup_device_mesh
    from .worker import (_load_workload, _one_start, _policy, _reference, _resume, _train_step, compare_on_rank_zero,
                         reference_on_rank_zero)

    refuse_unsupported(config)
    enter("setup")
    device_mesh = setup_device_mesh(pipeline_device_mesh(config.mesh), env, timeout_s=config.timeout_s)
    enter("load")
    workload = _load_workload(config)
    if has_meta_tensors(workload.model):  # the values one device gets (the reference's too), whole on every rank
        materialize(workload.model, seed=config.init_seed)
        reporter.note(f"pipeline: the meta-device model is materialised whole on every rank (seed {config.init_seed}, the "
                      "values one device gets); each stage then runs on its own shards, but the whole model stays")
    optimizer = workload.optimizer(workload.model.parameters())
    policy = _policy(config)
    reporter.note(_one_start(workload, optimizer, device_mesh).describe())
    pp = config.mesh.shape[config.mesh.axis_index(PP_AXIS)]
    global_batch = batch_size_of(workload.batch)
    microbatches = config.microbatches or default_microbatches(pp, global_batch)
    freeze_survivors()  # the model, optimizer and modules live to the end: later full collections skip them
    enter("capture")
    microbatch = first_microbatch(workload.batch, microbatches)  # a clear error when the count does not divide it
    torch_step = capture_repeated_step(workload.train_step(), workload.model, optimizer, microbatch,
                                       name=workload.name or "step", raw_grads=True)
    whole = None
    if any(node.op.is_random for node in torch_step.graph.nodes):
        whole = capture_repeated(workload.train_step(), workload.model, optimizer, workload.batch,
                                 name=workload.name or "step")
    plan = pipeline_plan(torch_step, config.mesh, microbatches, cluster=config.cluster, schedule=config.schedule,
                         memory_budget_bytes=config.memory_budget_bytes)
    plan_hash = check_same_everywhere(plan.decisions_hash(), "pipeline plan")
    schedule = config.schedule or plan.schedule
    reporter.note(f"pipeline plan {plan_hash}: {pp} stages on {config.mesh}, sub-mesh {plan.sub_mesh}, {microbatches} "
                  f"microbatches of {global_batch // microbatches}, schedule {schedule}; "
                  + "; ".join(f"stage {s.index}: {len(s.forward) + len(s.backward) + len(s.update)} nodes, "
                              f"{len(s.owned)} state tensors" for s in plan.stages))
    estimate = plan.estimate
    if "step_s" in estimate:
        reporter.note(f"estimate ({estimate.get('cluster', 'cost model')}): step {estimate['step_s'] * 1e3:.2f} ms, "
                      f"bubble {estimate['bubble_fraction']:.0%}, "
                      f"{estimate.get('p2p_bytes_per_microbatch', 0.0) / 1e6:.3f} MB between stages per microbatch")
    from ..config import settings_from_env

    enter("lowering")
    step = PipelineStep(torch_step, plan, device_mesh, whole_graph=whole, bucket_cap_bytes=config.bucket_cap_bytes,
                        overlap=config.overlap, schedule=schedule, keep_host_memory=settings_from_env().keeps_host_memory)
    enter("reference run", quiet=not config.check)
    reference = reference_on_rank_zero(config, env, lambda: _reference(
        config, workload, _train_step(config, workload, policy, device_mesh), policy))
    torch.manual_seed(config.seed)
    checkpointer, start, reference = _resume(config, workload.model, optimizer, reporter, reference)
    losses = []
    for index in range(start, config.steps):
        enter(f"step {index}", quiet=True)
        started = time.perf_counter()
        loss = step(workload.model, optimizer, workload.batch)
        losses.append(float(loss))
        reporter.step(index, losses[-1], time.perf_counter() - started)
        if checkpointer is not None and ((index + 1) % checkpointer.every == 0 or index + 1 == config.steps):
            step.write_back(workload.model, optimizer, workload.batch)  # whole tensors: loads under any plan
            checkpointer.save(index + 1, workload.model, optimizer)
            reporter.note(f"checkpoint {checkpointer.path(index + 1)}")
    enter("report", quiet=True)
    if not losses:
        reporter.note(f"the newest checkpoint is at step {start} of --steps {config.steps}: nothing left to run")
        return 0
    records = step.comm.records.values()
    reporter.note(f"rank 0 per step: {step.sent_bytes / len(losses) / 1e6:.3f} MB sent point to point to other stages; "
                  f"{sum(r.count for r in records) / len(losses):g} collectives moving "
                  f"{sum(r.bytes for r in records) / len(losses) / 1e6:.3f} MB on its stage's sub-mesh")
    report = None
    if reference is not None:
        # one whole tensor at a time, from each stage's lead to rank 0 (every rank runs both streams to their end)
        replicas = step.replica_disagreements()  # collective: each stage's copies of its replicated pieces
        report = compare_on_rank_zero(reference, losses, step.state_one_by_one(workload.model, optimizer, workload.batch),
                                      step.grads_one_by_one(), reporter, replicas)
    if config.summary_path is not None and env.rank == 0:
        from .summary import RunSummary, UnruledOp, check_summary, unruled_ops

        unruled: dict[str, UnruledOp] = {}
        for stage in plan.stages:  # every stage plan's nodes without a rule, by op
            for item in unruled_ops(stage.plan, torch_step.graph):
                known = unruled.get(item.op)
                unruled[item.op] = item if known is None else UnruledOp(item.op, known.nodes + item.nodes, known.reason)
        summary = RunSummary(
            model=workload.name or config.model, mesh=config.mesh.shape,
            parameters=sum(p.numel() for p in workload.model.parameters()), losses=tuple(losses),
            phase_seconds=dict(phase_times.seconds) if phase_times is not None else {},
            unruled=tuple(sorted(unruled.values(), key=lambda u: (-u.nodes, u.op))),
            check=None if report is None else check_summary(report),
        )
        write_atomically(config.summary_path, summary.to_json())
    if report is not None:
        report.raise_if_failed()
    return 0


def pipeline_plan(torch_step: Any, mesh: Mesh, microbatches: int, *, cluster: str | None = None,
                  schedule: str | None = None, memory_budget_bytes: float | None = None) -> PipelinePlan:
    """Rank 0 discovers the rules and plans the pipeline; every rank receives its plan as JSON (or rank 0's error)."""
    import torch.distributed as dist

    from ..progress import phase
    from .plan_source import broadcast_text

    text, failure = "", None
    if dist.get_rank() == 0:
        from ..cost.cluster import resolve_cluster
        from ..frontends.torch.discovery import TorchExecutor
        from ..shardcombine.api import rules_from_database
        from ..solver.pipeline import plan_pipeline

        cluster = cluster if cluster is not None or torch.cuda.is_available() else "cpu-gloo"
        try:
            rules = rules_from_database(torch_step.graph, TorchExecutor())
            with phase("solve"):
                plan = plan_pipeline(torch_step.graph, rules, resolve_cluster(cluster, mesh),
                                     microbatches=microbatches, schedule=schedule or "1f1b",
                                     loss_divisor=torch_step.loss_divisor, memory_budget_bytes=memory_budget_bytes)
            text = plan.to_json()
        except Exception as error:  # every rank stops with rank 0's reason (re-raised below), not a lost connection
            failure = error
            text = _FAILED + f"{type(error).__name__}: {error}"
    with phase("pipeline planning", quiet=True):  # rank 0's failure is every rank's, in this phase
        text = broadcast_text(text)
        if failure is not None:
            raise failure
        if text.startswith(_FAILED):
            from ..solver import errors

            kind, _, message = text[len(_FAILED):].partition(": ")
            same = getattr(errors, kind, None)  # the solver's error types: the same error as rank 0's
            if isinstance(same, type) and issubclass(same, Exception):
                error = same.__new__(same)  # its message as is (its own __init__ may take other arguments)
                Exception.__init__(error, message)
                raise error
            raise RunInputError(f"rank 0 could not plan the pipeline: {kind}: {message}")
    return PipelinePlan.from_json(text)


_FAILED = "\x00failed\x00"
"""Marks rank 0's planning failure in the broadcast text (a plan's JSON never starts so)."""
