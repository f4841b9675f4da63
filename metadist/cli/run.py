"""``metadist run MODEL --nproc N``: plan and run a workload on N local processes.

The command starts N ranks of :mod:`metadist.runtime.worker` with torchelastic's
launcher (what ``torchrun --standalone`` runs; gloo on CPU, NCCL with CUDA, see
:mod:`metadist.runtime.launch`); each rank captures, plans, lowers and runs, and rank 0
shows the compile phases, the plan, each step's loss and time, bytes per collective
(measured vs predicted) and, with ``--check``, the comparison with a single-device run.
Everything else the ranks write goes to the run's log folder (``--log-dir``, default
``runs/`` in MetaDist's cache folder). If a rank fails, the others are stopped and the
terminal shows one block: the rank, its phase, the exception and the user's line (or
the signal that killed it), what to do, and the log holding the traceback. Collectives
time out after ``--timeout-s``, so nothing hangs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..gc_pause import gc_paused
from .main import UsageError

if TYPE_CHECKING:
    from ..runtime.launch import LaunchOutcome, LocalLaunch


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="plan a workload and run it on N local processes (torchrun), optionally checking it",
        description="Capture MODEL's step, plan it for the mesh, and run it distributed on N local processes.",
    )
    parser.add_argument("model", help="built-in workload name, or path/to/file.py[:function] returning a metadist.Workload")
    parser.add_argument("--nproc", type=int, default=None, help="number of processes (devices) to launch (PyTorch workloads)")
    parser.add_argument(
        "--devices", type=int, default=None,
        help="JAX workloads: number of XLA devices (CPU devices here, through XLA_FLAGS); selects the JAX route. "
        "With --nproc P > 1: devices per process, on P processes joined by jax.distributed",
    )
    parser.add_argument("--mesh", default="", help="mesh shape, e.g. 2x2 or dp=2,tp=2 (default: a 1-D mesh of --nproc)")
    parser.add_argument("--steps", type=int, default=3, help="training steps to run (default 3)")
    parser.add_argument("--memory-gb", type=float, default=None, help="per-device memory budget for the solver, in GB (1e9 bytes)")
    parser.add_argument("--check", action="store_true", help="compare loss, gradients and state with a single-device run")
    parser.add_argument(
        "--plan", default="solver",
        help="solver (default), a baseline (dp, zero2, zero3, megatron), replicate, or a plan JSON file",
    )
    parser.add_argument("--cluster", default=None, help="cost-model cluster preset or JSON file (default: cpu-gloo on CPU)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"), help="built-in workloads' optimizer")
    parser.add_argument("--seed", type=int, default=0, help="seed of random ops (dropout), the same on every rank")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on rendezvous and each collective (s)")
    parser.add_argument("--compile", metavar="BACKEND", default=None,
                        help="run each rank's program through torch.compile with BACKEND (e.g. inductor, aot_eager)")
    parser.add_argument("--check-shapes", action="store_true",
                        help="run the rank programs op by op, checking local shapes; names the node that fails (slow)")
    parser.add_argument("--meta-init", action="store_true",
                        help="build a built-in model on the meta device: each rank materialises only its shards, with the "
                             "values metadist.materialize gives on one device (large built-ins are on meta already)")
    parser.add_argument("--init-seed", type=int, default=0, help="seed of a meta-device model's initialisation")
    parser.add_argument("--no-overlap", action="store_true",
                        help="run every collective to completion where it stands (default: issue early, wait late)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="cap of one coalesced collective in MiB (default 25; 0 issues one collective per value)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save checkpoints in this folder and resume from its newest complete one")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="save a checkpoint every N steps (and after the last; default: after the last only)")
    parser.add_argument("--expert-capacity-factor", type=float, default=None, metavar="F",
                        help="mixture-of-experts layers: give each expert ceil(F * k * S / E) slots per group of S "
                             "tokens; a token past them loses that expert's share (default: dropless, the model's "
                             "own result)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole group up to N times when a rank dies or hangs past --timeout-s; with "
                             "--checkpoint-dir it resumes from the newest complete checkpoint")
    parser.add_argument("--summary-json", default=None, type=Path,
                        help="write the run's summary here as JSON: parameters, compile phase seconds, ops without a "
                             "rule, losses and, with --check, the largest differences (what python -m metadist.bench.zoo tabulates)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="with a pp mesh axis: microbatches per step (default: the pp degree, or the most below it "
                             "that divide the batch)")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default=None,
                        help="with a pp mesh axis: the pipeline schedule (default 1f1b)")
    add_precision_arguments(parser)
    parser.add_argument("--no-loss-scaling", action="store_true",
                        help="with --precision fp16: no GradScaler (gradients may underflow: MetaDist warns)")
    add_log_dir_argument(parser)
    parser.set_defaults(handler=run)


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                        help="mixed precision: float32 master weights and optimizer state, computation in bf16 or fp16 "
                             "(fp16 with a GradScaler), gradients reduced in --reduce-dtype (default: as the step is written)")
    parser.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="the dtype gradients are reduced in across devices (default fp32 with --precision bf16/fp16)")


def add_log_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-dir", default=None, type=Path,
                        help="folder that receives the run's folder of per-rank logs "
                             "(default: runs/ in MetaDist's cache folder, where the newest 20 are kept)")


def worker_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line equivalent to the launch (to run the ranks by hand)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
            "-m", "metadist.runtime.worker", *worker_args(args)]


def worker_args(args: argparse.Namespace) -> list[str]:
    """The arguments of every rank's ``python -m metadist.runtime.worker``."""
    command = [
        args.model,
        "--steps", str(args.steps), "--plan", args.plan, "--optimizer", args.optimizer,
        "--seed", str(args.seed), "--timeout-s", str(args.timeout_s),
    ]
    if args.mesh:
        command += ["--mesh", args.mesh]
    if args.memory_gb is not None:
        command += ["--memory-gb", str(args.memory_gb)]
    if args.cluster:
        command += ["--cluster", args.cluster]
    if args.check:
        command.append("--check")
    if args.compile:
        command += ["--compile-backend", args.compile]
    if args.check_shapes:
        command.append("--check-shapes")
    if getattr(args, "meta_init", False):
        command += ["--device", "meta"]
    if getattr(args, "bucket_cap_mb", None) is not None:
        command += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    if getattr(args, "no_overlap", False):
        command.append("--no-overlap")
    if getattr(args, "init_seed", 0):
        command += ["--init-seed", str(args.init_seed)]
    if getattr(args, "checkpoint_dir", None):
        command += ["--checkpoint-dir", str(Path(args.checkpoint_dir).resolve())]
    if getattr(args, "checkpoint_every", 0):
        command += ["--checkpoint-every", str(args.checkpoint_every)]
    if getattr(args, "summary_json", None):
        command += ["--summary-json", str(Path(args.summary_json).resolve())]
    if getattr(args, "expert_capacity_factor", None) is not None:
        command += ["--expert-capacity-factor", str(args.expert_capacity_factor)]
    if getattr(args, "precision", None):
        command += ["--precision", args.precision]
    if getattr(args, "reduce_dtype", None):
        command += ["--reduce-dtype", args.reduce_dtype]
    if getattr(args, "no_loss_scaling", False):
        command.append("--no-loss-scaling")
    if getattr(args, "microbatches", None) is not None:
        command += ["--microbatches", str(args.microbatches)]
    if getattr(args, "schedule", None):
        command += ["--schedule", args.schedule]
    if getattr(args, "verbose", False):
        command.append("--verbose")
    return command


def is_jax_route(args: argparse.Namespace) -> bool:
    """JAX built-ins (``jax-*``) and any model given with ``--devices`` run through XLA in this process."""
    return args.devices is not None or args.model.startswith("jax-")


def run_jax_route(args: argparse.Namespace) -> int:
    """Plan a JAX workload and run it through XLA shardings on ``--devices`` devices.

    With ``--nproc P --devices D`` (P > 1) it runs on P processes of D CPU devices each
    through ``jax.distributed`` (:mod:`metadist.frontends.jax.multihost`).
    """
    devices = args.devices if args.devices is not None else (args.nproc or 8)
    if devices < 1:
        raise UsageError(f"--devices must be at least 1, got {devices}")
    if args.nproc is not None and args.devices is not None and args.nproc != 1:
        return run_jax_multihost_route(args)
    from ..frontends.jax.cli_support import request_cpu_devices

    request_cpu_devices(devices)  # before anything imports jax, the user's model file included
    from ..frontends.jax.cli_support import run_jax
    from ..workloads import load_workload

    baseline = None if args.plan == "solver" else args.plan
    summary = run_jax(load_workload(args.model), devices=devices, check=args.check, mesh=args.mesh or None,
                      cluster=args.cluster, baseline=baseline)
    print(summary.to_text())
    if summary.check is not None and not summary.check.passed:
        print("metadist run: error: the sharded JAX run differs from the single-device run beyond tolerance", file=sys.stderr)
        return 1
    return 0


def run_jax_multihost_route(args: argparse.Namespace) -> int:
    """``--nproc P --devices D`` for a JAX workload: P local processes joined by jax.distributed."""
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    from ..frontends.jax.errors import JaxCaptureError
    from ..frontends.jax.multihost import run_jax_multihost

    baseline = None if args.plan == "solver" else args.plan
    try:
        summary = run_jax_multihost(args.model, processes=args.nproc, local_devices=args.devices,
                                    mesh=args.mesh or None, check=args.check, cluster=args.cluster, baseline=baseline,
                                    rendezvous_timeout_s=args.timeout_s)
    except JaxCaptureError as err:
        print(f"metadist run: error: {err}", file=sys.stderr)
        return 2
    print(summary.to_text())
    if summary.passed is False:
        print("metadist run: error: the multi-process JAX run differs from the single-device run beyond tolerance",
              file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from ..ir import Mesh

    if is_jax_route(args):
        return run_jax_route(args)
    if args.nproc is None:
        raise UsageError("--nproc N is required for PyTorch workloads (the number of processes to launch)")
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.bucket_cap_mb is not None and args.bucket_cap_mb < 0:
        raise UsageError(f"--bucket-cap-mb must be 0 (no coalescing) or more, got {args.bucket_cap_mb}")
    if args.checkpoint_every < 0 or args.max_restarts < 0:
        raise UsageError("--checkpoint-every and --max-restarts take 0 or more")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise UsageError("--checkpoint-every needs --checkpoint-dir (where to save)")
    if args.expert_capacity_factor is not None and not args.expert_capacity_factor > 0:
        raise UsageError(f"--expert-capacity-factor must be positive (leave it out for dropless experts), "
                         f"got {args.expert_capacity_factor}")
    if args.max_restarts and not args.checkpoint_dir:
        print("metadist run: note: --max-restarts without --checkpoint-dir restarts from the first step", file=sys.stderr)
    mesh = Mesh.parse(args.mesh) if args.mesh else Mesh((args.nproc,))
    if "pp" in mesh.axis_names:
        if args.microbatches is not None and args.microbatches < 1:
            raise UsageError(f"--microbatches must be at least 1, got {args.microbatches}")
    elif args.microbatches is not None or args.schedule is not None:
        raise UsageError("--microbatches and --schedule go with a mesh with a pp axis (e.g. --mesh pp=2 or pp=2,dp=2)")
    if mesh.size != args.nproc:
        raise UsageError(
            f"the mesh {mesh} has {mesh.size} devices but --nproc is {args.nproc}; "
            f"pass --nproc {mesh.size} or a mesh of {args.nproc} devices"
        )
    # the ranks are forks of a fork server (LocalLaunch.fork), started before this process imports torch so that the
    # two imports run side by side; a machine with CUDA spawns its ranks and leaves the server idle
    from ..forking import start_fork_server

    start_fork_server("metadist.runtime.worker", args.nproc)
    with gc_paused():  # torch's import (metadist.runtime's): the collector would traverse its objects as they come
        from ..runtime.launch import LocalLaunch

    outcome = launch_and_report(LocalLaunch(module="metadist.runtime.worker", args=tuple(worker_args(args)),
                                            nproc=args.nproc, log_dir=log_dir(args), name=args.model,
                                            max_restarts=args.max_restarts, fork=True), "metadist run")
    if outcome.ok:
        if outcome.restarts:
            print(f"the group was restarted {outcome.restarts} time(s) and finished; each attempt's logs are in "
                  f"{outcome.run_folder}")
        print(f"logs of every rank: {outcome.run_folder}")
    return outcome.exit_status()


def log_dir(args: argparse.Namespace) -> Path:
    """``--log-dir``, or ``runs/`` in the cache folder (pruned to the newest runs)."""
    from ..config import settings_from_env
    from ..runtime.launch import default_log_dir, prune_runs

    if args.log_dir is not None:
        return args.log_dir
    folder = default_log_dir(settings_from_env().cache_dir)
    if folder.is_dir():
        prune_runs(folder)
    return folder


def launch_and_report(launch: LocalLaunch, command: str) -> LaunchOutcome:
    """Run ``launch``; if it fails, print its one block to stderr."""
    from ..runtime.launch import failure_block, launch_local

    outcome = launch_local(launch)
    if not outcome.ok:
        print(failure_block(outcome, command), file=sys.stderr)
    return outcome
