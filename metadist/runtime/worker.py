"""The per-rank entry point that ``metadist run`` launches through torchrun.

Each rank, as a recipe: read the torchrun environment, set up the device
mesh, load the workload, capture its step, make the plan (every rank makes
it deterministically, then all ranks prove they hold the same one), lower
it, run K steps, report loss, time and bytes per collective; with
``--check``, compare with the same steps on a single device.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ir import Mesh
from ..ir.pipeline import PP_AXIS
from ..files import write_atomically
from ..progress import PhaseTimes
from .build import bytes_from_mib
from .env import read_torchrun_env
from .setup import setup_device_mesh, teardown

__all__ = ["WorkerConfig", "main", "parse_args"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What one run does; the same on every rank."""

    model: str
    """Built-in workload name or path/to/file.py[:function]."""
    mesh: Mesh
    """The device mesh; its size must equal the world size."""
    steps: int
    """Training steps to run."""
    plan: str
    """``solver`` (default), ``replicate``, a baseline (``dp``, ``zero2``, ``zero3``, ``megatron``) or a plan JSON file."""
    memory_budget_bytes: int | None
    """Per-device memory budget for the solver; None for no budget."""
    check: bool
    """Compare against the same steps on a single device."""
    seed: int
    """Seed of the random ops (dropout), the same on every rank and in the reference."""
    timeout_s: float
    """Bound on the rendezvous and every collective: a failed rank makes the others exit, never hang."""
    optimizer: str
    """Built-in workloads only: adamw, adam or sgd."""
    cluster: str | None
    """Cost model cluster preset or file for the solver (None: ``cpu-gloo`` on CPU)."""
    check_shapes: bool = False
    """Run the rank program op by op, checking local shapes and naming a failing node (slower)."""
    compile_backend: str | None = None
    """Run the rank program through ``torch.compile`` with this backend; None runs it as is."""
    device: str | None = None
    """Built-in workloads only: build the model on this device (``meta``: each rank materialises only its shards)."""
    init_seed: int = 0
    """Seed of a meta-device model's initialisation (the same on every rank and in the reference)."""
    bucket_cap_bytes: int | None = None
    """Cap of a coalesced collective (None: the default, 0: no coalescing)."""
    overlap: bool = True
    """Issue each collective early and wait for it right before its first reader (False: wait at once)."""
    checkpoint_dir: str | None = None
    """Save checkpoints here and resume from the newest complete one (a restarted group continues from it)."""
    checkpoint_every: int = 0
    """Save every this many steps (and after the last); 0 with a checkpoint folder: only after the last."""
    summary_path: str | None = None
    """Rank 0 writes the run's :class:`metadist.runtime.summary.RunSummary` here as JSON (None: nowhere)."""
    expert_capacity_factor: float | None = None
    """Mixture-of-experts layers: slots per expert as a factor of the even share (None: dropless)."""
    precision: str | None = None
    """``fp32``, ``bf16`` or ``fp16`` (a mixed precision policy, :mod:`metadist.ir.precision`); None: as written."""
    reduce_dtype: str | None = "default"
    """The policy's gradient reduce dtype (``default``: float32 for mixed policies)."""
    loss_scaling: bool = True
    """With ``fp16``: scale the loss with a ``torch.amp.GradScaler`` (False shows the underflow warning)."""
    microbatches: int | None = None
    """With a ``pp`` mesh axis: microbatches per step (None: the pp degree, or the most below it that divide the batch)."""
    schedule: str | None = None
    """With a ``pp`` mesh axis: ``gpipe`` or ``1f1b`` (None: 1f1b)."""


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog="python -m metadist.runtime.worker")
    parser.add_argument("model")
    parser.add_argument("--mesh", default="")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--plan", default="solver")
    parser.add_argument("--memory-gb", type=float, default=None)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--cluster", default=None)
    parser.add_argument("--check-shapes", action="store_true")
    parser.add_argument("--compile-backend", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--init-seed", type=int, default=0)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--summary-json", default=None)
    parser.add_argument("--expert-capacity-factor", type=float, default=None)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--reduce-dtype", default="default")
    parser.add_argument("--no-loss-scaling", action="store_true")
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--schedule", default=None, choices=("gpipe", "1f1b"))
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    world_size = read_torchrun_env().world_size
    mesh = Mesh.parse(args.mesh) if args.mesh else Mesh((world_size,))
    return WorkerConfig(
        model=args.model, mesh=mesh, steps=args.steps, plan=args.plan,
        memory_budget_bytes=None if args.memory_gb is None else int(args.memory_gb * 1e9),
        check=args.check, seed=args.seed, timeout_s=args.timeout_s, optimizer=args.optimizer,
        cluster=args.cluster, check_shapes=args.check_shapes,
        compile_backend=args.compile_backend, device=args.device, init_seed=args.init_seed,
        bucket_cap_bytes=bytes_from_mib(args.bucket_cap_mb),
        overlap=not args.no_overlap, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        summary_path=args.summary_json,
        expert_capacity_factor=args.expert_capacity_factor,
        precision=args.precision, reduce_dtype=args.reduce_dtype, loss_scaling=not args.no_loss_scaling,
        microbatches=args.microbatches, schedule=args.schedule,
    )


def run_worker(config: WorkerConfig, phase_times: PhaseTimes | None = None) -> int:
    """The recipe; returns the exit status. ``phase_times`` (a listener of this rank's phases) feeds the summary."""
    from ..frontends.torch.repeat import capture_repeated_step
    from ..gc_pause import freeze_survivors
    from ..ir.plan import Plan, graph_fingerprint
    from ..progress import enter
    from .build import StepOptions, compile_captured, read_plan_source
    from .report import Reporter

    env = read_torchrun_env()
    reporter = Reporter(enabled=env.rank == 0)
    if PP_AXIS in config.mesh.axis_names:
        from .pipeline_worker import run_pipeline_worker

        return run_pipeline_worker(config, env, reporter, phase_times)
    if config.microbatches is not None or config.schedule is not None:
        from .errors import RunInputError

        raise RunInputError("--microbatches and --schedule go with a mesh with a pp axis (e.g. --mesh pp=2,dp=2)")
    enter("setup")
    device_mesh = setup_device_mesh(config.mesh, env, timeout_s=config.timeout_s)
    enter("load")
    workload = _load_workload(config)
    parameters = sum(parameter.numel() for parameter in workload.model.parameters())
    optimizer = workload.optimizer(workload.model.parameters())
    policy = _policy(config)
    train_step = _train_step(config, workload, policy, device_mesh)
    start = _one_start(workload, optimizer, device_mesh)
    reporter.note(start.describe())
    if config.precision is not None:
        reporter.note(f"precision {policy.describe()}" + ("; loss scaled by a GradScaler" if _scales_loss(config, policy) else ""))
    plan_source = read_plan_source(config.plan)
    freeze_survivors()  # the model, optimizer and modules live to the end: later full collections skip them
    enter("capture")
    # a deep model's step is captured on 4 of its layers and expanded (frontends.torch.repeat), as `metadist plan` does
    torch_step = capture_repeated_step(train_step, workload.model, optimizer, workload.batch, keep_grads=config.check,
                              name=workload.name or "step", precision=policy,
                              expert_capacity_factor=config.expert_capacity_factor)
    compare_grads = config.check
    def planned_graph(graph):  # the graph a plan file was made for: the capture, rewritten for its recomputation
        if not (isinstance(plan_source, Plan) and plan_source.recompute):
            return graph
        from ..solver.recompute import apply_recompute

        return apply_recompute(graph, plan_source.recompute)

    if config.check and isinstance(plan_source, Plan) and plan_source.graph_fingerprint != graph_fingerprint(planned_graph(torch_step.graph)):
        # perhaps made for the step without gradient outputs (e.g. by `metadist plan`): try that graph
        without_grads = capture_repeated_step(train_step, workload.model, optimizer, workload.batch,
                                              name=workload.name or "step", precision=policy,
                                              expert_capacity_factor=config.expert_capacity_factor)
        if plan_source.graph_fingerprint == graph_fingerprint(planned_graph(without_grads.graph)):
            torch_step, compare_grads = without_grads, False
            reporter.note("the plan file is for the step without gradient outputs: --check compares the loss, "
                          "parameters, buffers and optimizer state, not the gradients, and so excuses no parameter "
                          "whose gradient is rounding noise (see metadist/runtime/check.py)")
    for record in torch_step.graph.routing:  # mixture of experts: what the captured graph computes, stated
        reporter.note(f"expert routing {record.describe()}")
    options = StepOptions(plan=plan_source, memory_budget_bytes=config.memory_budget_bytes, cluster=config.cluster,
                          check_shapes=config.check_shapes, compile_backend=config.compile_backend, init_seed=config.init_seed,
                          bucket_cap_bytes=config.bucket_cap_bytes, overlap=config.overlap)
    compiled, plan_hash = compile_captured(torch_step, config.mesh, device_mesh, options)
    plan = compiled.plan
    log.info("rank %d: captured %d nodes, plan %s", env.rank, len(torch_step.graph.nodes), plan_hash)
    enter("reference run", quiet=not config.check)
    # the step as captured above (with its gradients) runs on one device, unless a GradScaler needs its own
    reused = torch_step if compare_grads and torch_step.scaler is None else None
    reference = reference_on_rank_zero(config, env, lambda: _reference(
        config, workload, _train_step(config, workload, policy, device_mesh), policy, reused))
    reporter.plan(plan, plan_hash, compiled.program)
    torch.manual_seed(config.seed)
    compiled.prepare(workload.model, optimizer, workload.batch)
    checkpointer, start, reference = _resume(config, workload.model, optimizer, reporter, reference,
                                             compiled.torch_step.scaler)
    losses = []
    for step in range(start, config.steps):
        enter(f"step {step}", quiet=True)
        started = time.perf_counter()
        loss = compiled(workload.model, optimizer, workload.batch)
        losses.append(float(loss))
        reporter.step(step, losses[-1], time.perf_counter() - started)
        if compiled.precision_warning and step == start:
            reporter.note(f"warning: {compiled.precision_warning}")
        if checkpointer is not None and ((step + 1) % checkpointer.every == 0 or step + 1 == config.steps):
            checkpointer.save(step + 1, workload.model, optimizer, scaler=compiled.torch_step.scaler)
            reporter.note(f"checkpoint {checkpointer.path(step + 1)}")
    enter("report", quiet=True)
    if not losses:
        reporter.note(f"the newest checkpoint is at step {start} of --steps {config.steps}: nothing left to run "
                      "(raise --steps to train further)")
        return 0
    reporter.comm(compiled.comm_records(), compiled.program.predicted_comm(), len(losses))
    reporter.solver_estimate(plan, compiled.comm_records(), len(losses), dist.get_backend())
    report = None
    if reference is not None:
        # the whole tensors on rank 0 alone, which compares them one at a time: each piece sent there once
        replicas = compiled.replica_disagreements()  # collective: every rank's copies of its replicated pieces
        report = compare_on_rank_zero(reference, losses, compiled.state_one_by_one(),
                                      compiled.grads_one_by_one() if compare_grads else None, reporter, replicas)
    if config.summary_path is not None and env.rank == 0:
        _write_summary(config, workload, parameters, plan, torch_step.graph, losses, report, phase_times)
    if report is not None:
        report.raise_if_failed()
    return 0


ON_RANK_ZERO = object()
"""The ``--check`` reference of ranks other than 0: rank 0 runs the single-device steps and compares (one copy of the
work, not one per rank); the others take part in gathering the distributed state."""


@contextlib.contextmanager
def local_cores():
    """Rank 0's intra-op threads raised to the cores its host's ranks share, while those ranks wait for it.

    torchrun gives each of a host's N ranks ``OMP_NUM_THREADS`` threads (1 by default); during the reference run and
    the comparison the other ranks only wait (:func:`wait_for_rank_zero`, or they have finished), so rank 0 may use
    N times its threads, up to the cores it may run on. The count is restored after.
    """
    import os

    from ..config import usable_cores

    before = torch.get_num_threads()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(before, min(usable_cores(), before * local)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_on_rank_zero(config: WorkerConfig, env, run):
    """``--check``'s reference run, ``run()``, on rank 0 with its host's cores; :data:`ON_RANK_ZERO` on the other
    ranks; None without ``--check``. Every rank returns once rank 0 has it."""
    if not config.check:
        return None
    reference = ON_RANK_ZERO
    if config.checkpoint_dir is not None:
        from .checkpointer import Checkpointer

        if Checkpointer(config.checkpoint_dir).latest():  # the run resumes: it compares nothing (see _resume)
            return reference
    if env.rank == 0:
        with local_cores():
            reference = run()
    wait_for_rank_zero(config.timeout_s)
    return reference


def compare_on_rank_zero(reference, losses, state, grads, reporter, replicas=()):
    """Rank 0's comparison of the run with the reference (reported); None on the other ranks. ``replicas``: the
    values whose copies disagree across ranks (:meth:`~.step.CompiledStep.replica_disagreements`), failures too.

    ``state`` and ``grads``: whole tensors by name, gathered by every rank (collectives) before this, or
    :class:`~.check.TensorStream` of them gathered to rank 0 one at a time as it compares (collectives: every rank
    runs both to their end, the gradients first, as the comparison reads them)."""
    from .check import compare_runs, run_out

    if reference is ON_RANK_ZERO:
        run_out(grads, state)
        return None
    with local_cores():
        report = compare_runs(reference, losses, state, grads, replicas=replicas)
    reporter.check(report)
    return report


def wait_for_rank_zero(timeout_s: float) -> None:
    """Every rank waits here for rank 0's reference run, on a gloo group of its own with a day's timeout.

    The run's collectives time out after ``--timeout-s`` so a dead rank does not hang the others; a reference run may
    legitimately take longer than that, and rank 0 is alive while it runs (torchelastic ends the group if it dies).
    """
    import datetime

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(timeout_s, 24 * 3600.0)))
    dist.barrier(group=group)
    dist.destroy_process_group(group)


def _write_summary(config: WorkerConfig, workload, parameters: int, plan, graph, losses, report, phase_times) -> None:
    from .summary import RunSummary, check_summary, unruled_ops

    summary = RunSummary(
        model=workload.name or config.model, mesh=config.mesh.shape, parameters=parameters, losses=tuple(losses),
        phase_seconds=dict(phase_times.seconds) if phase_times is not None else {},
        unruled=unruled_ops(plan, graph), check=None if report is None else check_summary(report),
    )
    write_atomically(config.summary_path, summary.to_json())


def _resume(config: WorkerConfig, model, optimizer, reporter, reference, scaler=None):
    """The checkpointer of ``--checkpoint-dir``, the step to start from (its newest complete checkpoint, or 0) and the
    ``--check`` reference run, None when resumed (it compares runs from the first step).

    ``scaler``: the step's GradScaler (fp16), whose scale and growth tracker are restored too."""
    if config.checkpoint_dir is None:
        return None, 0, reference
    from .checkpointer import Checkpointer

    every = config.checkpoint_every if config.checkpoint_every > 0 else max(config.steps, 1)
    checkpointer = Checkpointer(config.checkpoint_dir, every=every)
    start = checkpointer.restore(model, optimizer, scaler=scaler)
    if start:
        reporter.note(f"resumed from {checkpointer.path(start)} (step {start} of {config.steps})")
    if start > config.steps:
        from .errors import RunInputError

        raise RunInputError(f"the newest checkpoint in {config.checkpoint_dir!r} is at step {start}, past --steps "
                            f"{config.steps}; raise --steps or use another --checkpoint-dir")
    if not start and reference is ON_RANK_ZERO and torch.distributed.get_rank() == 0:
        raise RuntimeError("internal: --check found a checkpoint to resume from, then started from the first step")
    if start and reference is not None:
        reporter.note(f"resumed at step {start}: --check compares runs from the first step, so it is skipped")
        reference = None
    return checkpointer, start, reference


def _one_start(workload, optimizer, device_mesh):
    """Every rank takes rank 0's model, optimizer state and batch (each rank ran the model file itself).

    The model and optimizer as ``metadist.compile`` does (the compiled step then finds nothing left to send);
    the batch because a workload's batch is the global batch by contract.
    """
    import torch.utils._pytree as pytree

    from .start_state import broadcast_start_state, broadcast_storages, check_same_structure
    from .step import _device_of

    check_same_structure(workload.model, optimizer)
    report = broadcast_start_state(workload.model, optimizer, _device_of(device_mesh))
    leaves = [leaf for leaf in pytree.tree_flatten(workload.batch)[0]
              if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"]
    broadcast_storages(leaves, _device_of(device_mesh))
    return report


def _load_workload(config: WorkerConfig):
    from ..workloads import builtin_workload, load_workload
    from ..workloads.builtin import BUILTINS
    from ..workloads.zoo import PREFIX as ZOO_PREFIX, zoo_workload

    if config.model in BUILTINS:
        return builtin_workload(config.model, optimizer=config.optimizer, device=config.device)
    if config.model.startswith(ZOO_PREFIX):
        return zoo_workload(config.model, optimizer=config.optimizer, device=config.device)
    if config.device is not None:
        from .errors import RunInputError

        raise RunInputError(f"--device applies to built-in workloads; {config.model!r} builds its own model")
    return load_workload(config.model)


def _reference(config: WorkerConfig, workload, train_step, policy, captured=None):
    from .check import reference_run

    return reference_run(train_step, workload.model, workload.optimizer, workload.batch, steps=config.steps, seed=config.seed,
                         init_seed=config.init_seed, precision=policy, expert_capacity_factor=config.expert_capacity_factor,
                         captured=captured)


def _policy(config: WorkerConfig):
    from ..ir import PrecisionPolicy

    if config.precision is None:
        return PrecisionPolicy() if config.reduce_dtype in ("default", None) else PrecisionPolicy.named("fp32", config.reduce_dtype)
    return PrecisionPolicy.named(config.precision, config.reduce_dtype)


def _scales_loss(config: WorkerConfig, policy) -> bool:
    return policy.needs_loss_scaling and config.loss_scaling


def _train_step(config: WorkerConfig, workload, policy, device_mesh):
    """The workload's step; under fp16 with a GradScaler of its own (each call: a fresh scaler, for the reference too)."""
    if not _scales_loss(config, policy):
        return workload.train_step()
    return workload.train_step(scaler=torch.amp.GradScaler(device_mesh.device_type))


def main(argv: list[str] | None = None) -> int:
    """Run one rank; a failure exits 2 (bad input) or 1, so that torchrun stops the other ranks.

    The failure is recorded in torchelastic's error file with MetaDist's reading of it
    (:func:`metadist.runtime.failure.run_rank`, which ``metadist run`` turns into one block)
    and its traceback goes to stderr, this rank's log under ``metadist run``. Each phase the
    rank enters is kept in its phase file; rank 0 shows the compile phases on its stdout.
    """
    from .failure import run_rank

    phase_times = PhaseTimes()
    try:
        return run_rank(lambda: run_worker(parse_args(argv), phase_times), show_phases=True, listeners=(phase_times,))
    finally:
        teardown()


if __name__ == "__main__":
    from metadist.runtime.setup import exit_process

    exit_process(main())  # not sys.exit: see exit_process (torch 2.13 gloo can abort at exit)
