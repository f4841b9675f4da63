"""Each op of a captured step: the cost model's compute seconds against the op timed on this machine (issue #16, part 2).

    python -m metadist.bench.op_costs MODEL [MODEL ...] [--batch-size B --seq-len S] [--repeats 7] [--top 12]
        [--nproc N] [--cluster NAME] [--precision bf16|fp16] [--out F.json]

One process with the intra-op threads a one-process run has (``OMP_NUM_THREADS``, else a thread per core), as this
machine's one-process calibration measured its rates; with ``--nproc N``, one thread, as each rank of an N-process
local run has, priced on this machine's N-process calibration (give the batch a rank computes). Timed with one
thread and priced on the one-process calibration, as this tool did before, GPT-2 small's large matmuls ran at half
their price: an error of the tool's, not of the price. The step of a built-in (real weights) or a
workload file is captured, its graph run once node by node to hold every value, then each node is timed twice: alone,
its operator called ``--repeats`` times on those values, the median kept (the call only, without the interpreter's
own work; the caches warm, as the calibration times ops), and in the step, the whole graph run ``--repeats`` times in
order with each call timed once (its operands where the step before it left them in the caches). Each node's prediction
is :func:`metadist.solver.estimate.node_compute_s` under the replicated strategy on a one-device mesh of the cluster
(default: this machine as calibrated for one process, measured now if not cached). A value the runtime makes
contiguous after its op (``TorchStep.contiguous_values``) is made so here too, and the copy is a row of its own
(op ``(contiguous copy)``, predicted 0: the cost model does not price it). Printed per operator: nodes,
predicted, alone and in-step milliseconds and their ratios; then the nodes the model misprices the most in the step
by absolute difference. What it tells: which operators' prices a step's misprediction comes from, and how much of it
is the caches. ``--precision`` captures the step under a mixed precision policy (as ``metadist plan --precision``),
so that the narrow dtypes' prices can be read op by op. It does not time what a step adds between its ops (allocation, Python): the whole step's time is
``make bench``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

CONTIGUOUS_COPY = "(contiguous copy)"
"""The rows of the copies the runtime makes after an op whose output the trace saw contiguous."""


def measure(model: str, repeats: int, cluster_name: str | None, batch_size: int | None = None,
            seq_len: int | None = None, precision: str | None = None, nproc: int = 1) -> dict[str, Any]:
    """Per node of ``model``'s captured step: op, predicted and measured seconds.

    ``model``: a built-in (built on the CPU with real weights, at ``batch_size`` and ``seq_len`` when given) or a
    workload file (``path.py[:function]``), as the bench harness takes them. Each node is timed twice over:
    ``measured_s``, its op called ``repeats`` times in a row on the same values (the caches warm, as the calibration
    times ops), and ``in_step_s``, the median over ``repeats`` runs of the whole graph in order of the node's one
    call there (its operands as a step leaves them in the caches). ``precision``: a mixed precision policy's name
    (``bf16``, ``fp16``) the step is captured under; None: as written. ``nproc`` above 1: one thread, and the nodes
    priced replicated on a mesh of ``nproc`` (each rank computing all of this batch) on that many processes'
    calibration."""
    import torch

    from ..cost.calibrate import machine_cluster
    from ..cost.calibrate_worker import median_seconds
    from ..cost.cluster import resolve_cluster
    from ..config import settings_from_env
    from ..frontends.torch import capture_step
    from ..forking import chosen_threads
    from ..frontends.torch.execute import bound_call, node_results
    from ..ir import Mesh
    from ..runtime.host_memory import keep_freed_host_memory_as_set
    from ..solver.estimate import node_compute_s
    from ..solver.strategies import replicated_strategy
    from ..workloads import builtin_workload, load_workload
    from ..workloads.builtin import BUILTINS

    keep_freed_host_memory_as_set()  # as the compiled step runs on CPU: freed memory reused, not unmapped
    if nproc > 1 and not chosen_threads():
        torch.set_num_threads(1)  # as torchrun gives each of several local ranks
    mesh = Mesh((nproc,))
    cluster = (machine_cluster(mesh, settings_from_env().cache_dir, announce=lambda text: print(text, file=sys.stderr))
               if cluster_name is None else resolve_cluster(cluster_name, mesh))
    if model in BUILTINS:
        workload = builtin_workload(model, device="cpu", batch_size=batch_size, seq_len=seq_len)
    elif batch_size is not None or seq_len is not None:
        raise SystemExit(f"--batch-size and --seq-len go with a built-in model; {model!r} is a workload file")
    else:
        workload = load_workload(model)
    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, name=workload.name or model,
                        precision=precision)
    graph = step.graph
    if cluster_name is None:  # as a plan on this machine prices them: matmuls and attention at their timed shapes
        from ..cost.timed_shapes import with_measured_shapes

        cluster = with_measured_shapes(cluster, graph, settings_from_env().cache_dir)
    env: dict[str, Any] = {gi.value.name: tensor for gi, tensor in
                           zip(graph.inputs, step.gather_inputs(workload.model, optimizer, workload.batch))}
    env.update(step.constants)
    inputs = dict(env)
    with torch.no_grad():
        first = _run_in_order(graph, env, step.contiguous_values)  # once to hold every value
        rows = [{"node": name, "op": CONTIGUOUS_COPY if node is None else node.op.target, "in_step": [],
                 "predicted_s": 0.0 if node is None else node_compute_s(
                     graph, node.name, replicated_strategy(len(node.input_names),
                                                           [value is not None for value in node.outputs], mesh), cluster)}
                for name, node, _ in first]
        held = env
        for _ in range(repeats):  # the graph in order, each call timed once: the caches as a step leaves them
            env = dict(inputs)
            for row, (_, _, seconds) in zip(rows, _run_in_order(graph, env, step.contiguous_values, free=True),
                                            strict=True):
                row["in_step"].append(seconds)
        env = held
        position = iter(rows)  # then each call alone, repeated on the same values (the heap grown by the runs above)
        for node in graph.nodes:
            op, args, kwargs = bound_call(node, env)
            next(position)["measured_s"] = median_seconds(lambda: op(*args, **kwargs), repeats)
            for value, tensor in zip(node.outputs, node_results(node, op(*args, **kwargs))):
                if value is not None and value.name in step.contiguous_values and not tensor.is_contiguous():
                    next(position)["measured_s"] = median_seconds(tensor.contiguous, repeats)
    for row in rows:
        row["in_step_s"] = statistics.median(row.pop("in_step"))
    return {"model": model, "cluster": cluster.name, "repeats": repeats, "precision": precision, "nproc": nproc,
            "nodes": rows}


def _run_in_order(graph, env: dict[str, Any], contiguous_values, free: bool = False) -> list[tuple[str, Any, float]]:
    """Run ``graph``'s nodes in order on ``env`` (filled in place), each value the runtime makes contiguous after its
    op (``TorchStep.contiguous_values``) made so, as the runtime lays it out; (name, node, seconds) of each call, a
    copy's node None (op ``(contiguous copy)``: a copy the cost model does not price). ``free``: each value dropped
    from ``env`` after its last use, as the runtime frees it (the graph's outputs kept); else ``env`` holds every
    value. Held, GPT-2 small's step (one rank's batch of 2 by 128) ran 2.9x the sum of its ops timed alone: each op
    wrote into memory no op of the step had freed."""
    from ..frontends.torch.execute import bound_call, freed_after, node_results

    calls = []
    for node, freed in zip(graph.nodes, freed_after(graph) if free else [()] * len(graph.nodes)):
        op, args, kwargs = bound_call(node, env)
        started = time.perf_counter()
        result = op(*args, **kwargs)
        calls.append((node.name, node, time.perf_counter() - started))
        for value, tensor in zip(node.outputs, node_results(node, result)):
            if value is None:
                continue
            env[value.name] = tensor
            if value.name in contiguous_values and not tensor.is_contiguous():
                started = time.perf_counter()
                env[value.name] = tensor.contiguous()
                calls.append((f"{value.name}.contiguous()", None, time.perf_counter() - started))
        for name in freed:
            env.pop(name, None)
    return calls


def by_op(rows: list[dict]) -> list[dict]:
    """The rows summed per operator, the largest measured first."""
    grouped: dict[str, dict] = {}
    for row in rows:
        entry = grouped.setdefault(row["op"], {"op": row["op"], "nodes": 0, "predicted_s": 0.0, "measured_s": 0.0,
                                               "in_step_s": 0.0})
        entry["nodes"] += 1
        for key in ("predicted_s", "measured_s", "in_step_s"):
            entry[key] += row[key]
    return sorted(grouped.values(), key=lambda entry: -entry["measured_s"])


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.2f}" if predicted > 0 else "-"


def print_result(console: Console, data: dict, top: int) -> None:
    rows = data["nodes"]
    totals = {key: sum(row[key] for row in rows) for key in ("predicted_s", "measured_s", "in_step_s")}
    policy = f" under {data['precision']}" if data.get("precision") else ""
    policy += f", as one rank of {data['nproc']}" if data.get("nproc", 1) > 1 else ""
    table = Table(title=f"{data['model']}{policy}: {len(rows)} nodes, each op timed alone and in the step's order (median of "
                        f"{data['repeats']}), cost model {data['cluster']}")
    for column in ("op", "nodes", "predicted ms", "alone ms", "alone/predicted", "in step ms", "in step/predicted",
                   "share of in step"):
        table.add_column(column, justify="left" if column == "op" else "right")

    def cells(entry: dict) -> list[str]:
        return [f"{entry['predicted_s'] * 1e3:.3f}", f"{entry['measured_s'] * 1e3:.3f}",
                _ratio(entry["measured_s"], entry["predicted_s"]), f"{entry['in_step_s'] * 1e3:.3f}",
                _ratio(entry["in_step_s"], entry["predicted_s"]), f"{entry['in_step_s'] / totals['in_step_s']:.1%}"]

    for entry in sorted(by_op(rows), key=lambda entry: -entry["in_step_s"])[:top]:
        table.add_row(entry["op"], str(entry["nodes"]), *cells(entry))
    table.add_row("all", str(len(rows)), *cells(totals))
    console.print(table)
    worst = Table(title="the nodes priced furthest from their time in the step")
    for column in ("node", "op", "predicted ms", "alone ms", "in step ms", "in step/predicted"):
        worst.add_column(column, justify="left" if column in ("node", "op") else "right")
    for row in sorted(rows, key=lambda row: -abs(row["in_step_s"] - row["predicted_s"]))[:top]:
        worst.add_row(row["node"], row["op"], f"{row['predicted_s'] * 1e3:.3f}", f"{row['measured_s'] * 1e3:.3f}",
                      f"{row['in_step_s'] * 1e3:.3f}", _ratio(row["in_step_s"], row["predicted_s"]))
    console.print(worst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.op_costs", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="built-in models (metadist.workloads) or workload files (path.py)")
    parser.add_argument("--batch-size", type=int, default=None, help="a built-in's batch size (its default if not given)")
    parser.add_argument("--seq-len", type=int, default=None, help="a built-in's sequence length (its default if not given)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per node (the median is kept)")
    parser.add_argument("--top", type=int, default=12, help="operators and nodes listed")
    parser.add_argument("--cluster", default=None, help="a preset or cluster JSON (default: this machine, calibrated)")
    parser.add_argument("--precision", choices=("bf16", "fp16"), default=None,
                        help="capture the step under this mixed precision policy (default: as written)")
    parser.add_argument("--nproc", type=int, default=1, help="time and price as one rank of this many local processes "
                        "(one thread, this machine's calibration for that many; default 1: one process on every core)")
    parser.add_argument("--out", type=Path, default=None, help="also write every node's figures as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    console = Console()
    results = []
    for model in args.models:
        data = measure(model, args.repeats, args.cluster, args.batch_size, args.seq_len, args.precision, args.nproc)
        print_result(console, data, args.top)
        results.append(data)
    if args.out is not None:
        from ..files import write_atomically

        write_atomically(args.out, json.dumps(results, indent=1))
        console.print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
