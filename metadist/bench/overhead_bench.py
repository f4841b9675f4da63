"""Single-process overhead of MetaDist's compiled step against the eager step (issue: run).

    python -m metadist.bench.overhead_bench [MODEL ...] [--steps N]

One process, a 1-device mesh over gloo: every step of the same model and batch
is timed as (a) the user's eager step, (b) the captured graph interpreted node
by node on one device (``TorchStep.run``), and (c) MetaDist's compiled rank
program (``metadist.compile`` with ``mesh=(1,)``). Medians over N steps after
one warm-up step, measured side by side in this run; the ratios are what to quote.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

DEFAULT_MODELS = ("mlp", "gpt2-tiny", "llama-tiny", "bert-tiny")


def _single_process_env() -> None:
    """The torchrun variables for a world of one, so ``metadist.compile`` can set up its mesh."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def _median_ms(run, steps: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure(model: str, steps: int) -> dict:
    import metadist
    from metadist.frontends.torch import capture_step
    from metadist.workloads import builtin_workload

    workload = builtin_workload(model)
    plain = workload.train_step()
    eager_model, graph_model, compiled_model = workload.model, copy.deepcopy(workload.model), copy.deepcopy(workload.model)
    eager_opt = workload.optimizer(eager_model.parameters())
    graph_opt = workload.optimizer(graph_model.parameters())
    compiled_opt = workload.optimizer(compiled_model.parameters())
    captured = capture_step(plain, graph_model, graph_opt, workload.batch)
    compiled = metadist.compile(plain, mesh=(1,), plan="solver", cluster="cpu-gloo")
    return {
        "model": model,
        "eager_ms": _median_ms(lambda: plain(eager_model, eager_opt, workload.batch), steps),
        "graph_ms": _median_ms(lambda: captured.run(graph_model, graph_opt, workload.batch), steps),
        "compiled_ms": _median_ms(lambda: compiled(compiled_model, compiled_opt, workload.batch), steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.overhead_bench")
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    _single_process_env()
    table = Table(title=f"one process: median step time over {args.steps} steps (ms) and ratio to eager")
    for column in ("model", "eager", "captured graph (interpreted)", "ratio", "compiled (mesh 1)", "ratio"):
        table.add_column(column, justify="right")
    for model in args.models:
        row = measure(model, args.steps)
        table.add_row(row["model"], f"{row['eager_ms']:.2f}", f"{row['graph_ms']:.2f}",
                      f"{row['graph_ms'] / row['eager_ms']:.2f}x", f"{row['compiled_ms']:.2f}",
                      f"{row['compiled_ms'] / row['eager_ms']:.2f}x")
    Console(width=140).print(table)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
