"""Single-process overhead of MetaDist's compiled step against the eager step (issue: run).

    python -m metadist.bench.overhead_bench [MODEL ...] [--steps N] [--out docs/bench/overhead.json]

One process, a 1-device mesh over gloo: every step of the same model and batch
is timed as (a) the user's eager step, (b) the captured graph interpreted node
by node on one device (``TorchStep.run``), (c) MetaDist's compiled rank program
(``metadist.compile`` with ``mesh=(1,)``) built with one node per op, and (d) the
same program as ``metadist.compile`` builds it, its small elementwise ops batched
into ``_foreach`` calls (:mod:`metadist.runtime.batching`). Medians over N steps
after one warm-up step, measured side by side in this run; the ratios are what to quote.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

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


def _median_ms(runs: dict, steps: int) -> dict[str, float]:
    """Median milliseconds of each run, the runs interleaved step by step (a change of load hits all alike)."""
    for run in runs.values():
        run()  # warm-up
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(steps):
        for key, run in runs.items():
            started = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - started)
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def measure(model: str, steps: int) -> dict:
    import metadist
    from metadist.frontends.torch import capture_step
    from metadist.workloads import builtin_workload

    workload = builtin_workload(model)
    plain = workload.train_step()
    eager_model, graph_model = workload.model, copy.deepcopy(workload.model)
    compiled_model, unbatched_model = copy.deepcopy(workload.model), copy.deepcopy(workload.model)
    eager_opt = workload.optimizer(eager_model.parameters())
    graph_opt = workload.optimizer(graph_model.parameters())
    compiled_opt = workload.optimizer(compiled_model.parameters())
    unbatched_opt = workload.optimizer(unbatched_model.parameters())
    captured = capture_step(plain, graph_model, graph_opt, workload.batch)
    compiled = metadist.compile(plain, mesh=(1,), plan="solver", cluster="cpu-gloo")
    unbatched = metadist.compile(plain, mesh=(1,), plan="solver", cluster="cpu-gloo")
    unbatched.prepare(unbatched_model, unbatched_opt, workload.batch)
    _one_node_per_op(unbatched.compiled)
    return {"model": model, **_median_ms({
        "eager_ms": lambda: plain(eager_model, eager_opt, workload.batch),
        "graph_ms": lambda: captured.run(graph_model, graph_opt, workload.batch),
        "unbatched_ms": lambda: unbatched(unbatched_model, unbatched_opt, workload.batch),
        "compiled_ms": lambda: compiled(compiled_model, compiled_opt, workload.batch),
    }, steps)}


def _one_node_per_op(step) -> None:
    """Rebuild a compiled step's rank module without batching its small ops (what ran before batching)."""
    from metadist.runtime.graph_module import build_rank_module

    step.module = build_rank_module(step.program, step.comm, step.device, step.torch_step.contiguous_values, batch=False)
    step._forward = step.module


def markdown(data: dict) -> list[str]:
    """The overhead table of ``docs/benchmarks.md`` from the JSON ``--out`` wrote."""
    from .report import markdown_table

    header = ("model", "eager ms", "interpreted graph", "compiled, one node per op", "compiled (batched)")
    rows = [[row["model"], f"{row['eager_ms']:.2f}"] + [f"{row[key]:.2f} ({row[key] / row['eager_ms']:.2f}x)"
                                                        for key in ("graph_ms", "unbatched_ms", "compiled_ms")]
            for row in data["rows"]]
    return [markdown_table(header, rows), "", f"Load average (1 min, 2 cores) at the end: {data['load_average_1min']:.1f}."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.overhead_bench")
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON (docs/benchmarks.md renders it)")
    args = parser.parse_args(argv)
    _single_process_env()
    table = Table(title=f"one process: median step time over {args.steps} steps (ms) and ratio to eager")
    for column in ("model", "eager", "captured graph (interpreted)", "ratio", "compiled, one node per op", "ratio",
                   "compiled (mesh 1)", "ratio"):
        table.add_column(column, justify="right")
    rows = []
    for model in args.models:
        row = measure(model, args.steps)
        rows.append(row)
        cells = [row["model"], f"{row['eager_ms']:.2f}"]
        for key in ("graph_ms", "unbatched_ms", "compiled_ms"):
            cells += [f"{row[key]:.2f}", f"{row[key] / row['eager_ms']:.2f}x"]
        table.add_row(*cells)
    Console(width=140).print(table)
    if args.out is not None:
        from ..files import write_atomically

        command = " ".join(["python -m metadist.bench.overhead_bench", *args.models, "--steps", str(args.steps),
                            "--out", str(args.out)])
        write_atomically(args.out, json.dumps({"format": "metadist.overhead", "command": command, "steps": args.steps,
                                               "load_average_1min": os.getloadavg()[0], "rows": rows}, indent=1) + "\n")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

