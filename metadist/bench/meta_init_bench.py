"""Memory of state initialisation per rank: a model built whole on each rank against a meta-device model.

    python -m metadist.bench.meta_init_bench [--model gpt2-small] [--nproc 4] [--plan zero3]

Launches ``--nproc`` gloo ranks twice, side by side in this run: (a) every rank
builds the model with real weights and the step slices its shards from the
full tensors; (b) every rank builds the model on the meta device and the step
materialises one module at a time, keeping only its shards. Each rank compiles
the step (``metadist.compile`` with ``--plan``) and takes its state without
running a step (``prepare``). Printed per mode: the state bytes one rank holds,
the full state, and each rank's peak resident memory (``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

MARK = "META-INIT-BENCH "


def rank_main(model_name: str, mode: str, plan: str) -> None:
    """One rank: build, compile, take the state; print one JSON line."""
    import torch.distributed as dist

    import metadist
    from metadist.workloads import builtin_workload

    started = time.perf_counter()
    workload = builtin_workload(model_name, device="meta" if mode == "meta" else "cpu")
    model = workload.model
    optimizer = workload.optimizer(model.parameters())
    step = metadist.compile(workload.train_step(), plan=plan, timeout_s=600)
    step.prepare(model, optimizer, workload.batch)
    shards = step.sharded_state_dict()
    local = sum(t.to_local().numel() * t.to_local().element_size() for t in shards.values())
    full = sum(t.numel() * t.element_size() for t in shards.values())
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(MARK + json.dumps({"rank": dist.get_rank(), "mode": mode, "local_bytes": local, "full_bytes": full,
                             "peak_rss_mib": peak_mib, "seconds": time.perf_counter() - started}), flush=True)
    dist.destroy_process_group()


def launch(model_name: str, mode: str, plan: str, nproc: int) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "metadist.bench.meta_init_bench", "--rank-main", "--model", model_name, "--mode", mode, "--plan", plan]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(f"the {mode} run failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return [json.loads(line[len(MARK):]) for line in result.stdout.splitlines() if line.startswith(MARK)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.meta_init_bench")
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--plan", default="zero3", help="solver, dp, zero2, zero3 or megatron")
    parser.add_argument("--mode", choices=("real", "meta"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(args.model, args.mode, args.plan)
        return 0
    table = Table(title=f"{args.model}, {args.nproc} gloo ranks, plan {args.plan}: state initialisation per rank")
    for column in ("init", "state held per rank", "full state", "peak RSS per rank (max over ranks)", "time (max)"):
        table.add_column(column, justify="right")
    for mode in ("real", "meta"):
        rows = launch(args.model, mode, args.plan, args.nproc)
        mib = 1 << 20
        table.add_row(
            "whole model on every rank" if mode == "real" else "meta, shards only",
            f"{max(r['local_bytes'] for r in rows) / mib:.0f} MiB", f"{rows[0]['full_bytes'] / mib:.0f} MiB",
            f"{max(r['peak_rss_mib'] for r in rows):.0f} MiB", f"{max(r['seconds'] for r in rows):.1f} s",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    from metadist.runtime.setup import exit_process

    exit_process(main())  # not sys.exit: see exit_process (torch 2.13 gloo can abort at exit)
