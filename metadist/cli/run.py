"""``metadist run MODEL --nproc N``: plan and run a workload on N local processes via torchrun.

The command launches ``python -m torch.distributed.run --standalone
--nproc-per-node N -m metadist.runtime.worker ...`` (gloo on CPU, NCCL with
CUDA) and returns its exit status; each rank captures, plans, lowers and runs
(:mod:`metadist.runtime.worker`), and rank 0 prints the plan, each step's loss
and time, bytes per collective (measured vs predicted) and, with ``--check``,
the comparison with a single-device run. If one rank fails, torchrun stops the
others; collectives time out after ``--timeout-s``, so nothing hangs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from .main import UsageError


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
    parser.set_defaults(handler=run)


def worker_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line that runs every rank."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        "-m", "metadist.runtime.worker", args.model,
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
    mesh = Mesh.parse(args.mesh) if args.mesh else Mesh((args.nproc,))
    if mesh.size != args.nproc:
        raise UsageError(
            f"the mesh {mesh} has {mesh.size} devices but --nproc is {args.nproc}; "
            f"pass --nproc {mesh.size} or a mesh of {args.nproc} devices"
        )
    completed = subprocess.run(worker_command(args), check=False)
    if completed.returncode != 0:
        print(
            f"metadist run: error: the distributed run failed (torchrun exit status {completed.returncode}); "
            "the failing rank's message is above",
            file=sys.stderr,
        )
    return completed.returncode
