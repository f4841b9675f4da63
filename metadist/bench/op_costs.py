"""Each op of a captured step: the cost model's compute seconds against the op timed on this machine (issue #16, part 2).

    python -m metadist.bench.op_costs MODEL [MODEL ...] [--repeats 7] [--top 12] [--cluster NAME] [--out F.json]

One process with one intra-op thread (as each rank of a local run has). The step of a built-in is captured, its
graph run once node by node to hold every value, then each node is timed alone: its operator called ``--repeats``
times on those values, the median kept (the call only, without the interpreter's own work). Each node's prediction
is :func:`metadist.solver.estimate.node_compute_s` under the replicated strategy on a one-device mesh of the cluster
(default: this machine as calibrated for one process, measured now if not cached). A value the runtime makes
contiguous after its op (``TorchStep.contiguous_values``) is made so here too, and the copy is a row of its own
(op ``(contiguous copy)``, predicted 0: the cost model does not price it). Printed per operator: nodes,
predicted and measured milliseconds, and measured/predicted; then the nodes the model misprices the most by
absolute difference. What it tells: which operators' prices a step's misprediction comes from. It does not
time what a step adds around its ops (memory traffic between ops, allocation, Python): the whole step's time
is ``make bench``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

CONTIGUOUS_COPY = "(contiguous copy)"
"""The rows of the copies the runtime makes after an op whose output the trace saw contiguous."""


def measure(model: str, repeats: int, cluster_name: str | None) -> dict[str, Any]:
    """Per node of ``model``'s captured step: op, predicted and measured seconds."""
    import torch

    from ..cost.calibrate import machine_cluster
    from ..cost.calibrate_worker import median_seconds
    from ..cost.cluster import resolve_cluster
    from ..config import settings_from_env
    from ..frontends.torch import capture_step
    from ..frontends.torch.execute import bound_call, node_results
    from ..ir import Mesh
    from ..solver.estimate import node_compute_s
    from ..solver.strategies import replicated_strategy
    from ..workloads import builtin_workload

    torch.set_num_threads(1)
    mesh = Mesh((1,))
    cluster = (machine_cluster(mesh, settings_from_env().cache_dir, announce=lambda text: print(text, file=sys.stderr))
               if cluster_name is None else resolve_cluster(cluster_name, mesh))
    workload = builtin_workload(model)
    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, name=model)
    graph = step.graph
    env: dict[str, Any] = {gi.value.name: tensor for gi, tensor in
                           zip(graph.inputs, step.gather_inputs(workload.model, optimizer, workload.batch))}
    env.update(step.constants)
    rows = []
    with torch.no_grad():
        for node in graph.nodes:
            op, args, kwargs = bound_call(node, env)
            outputs = node_results(node, op(*args, **kwargs))
            strategy = replicated_strategy(len(node.input_names), [value is not None for value in node.outputs], mesh)
            rows.append({"node": node.name, "op": node.op.target,
                         "predicted_s": node_compute_s(graph, node.name, strategy, cluster),
                         "measured_s": median_seconds(lambda: op(*args, **kwargs), repeats)})
            for value, tensor in zip(node.outputs, outputs):
                if value is None:
                    continue
                env[value.name] = tensor
                if value.name in step.contiguous_values and not tensor.is_contiguous():
                    # the runtime lays it out as the trace did, after its op (TorchStep.contiguous_values): a copy
                    # the cost model does not price
                    env[value.name] = tensor.contiguous()
                    rows.append({"node": f"{value.name}.contiguous()", "op": CONTIGUOUS_COPY, "predicted_s": 0.0,
                                 "measured_s": median_seconds(tensor.contiguous, repeats)})
    return {"model": model, "cluster": cluster.name, "repeats": repeats, "nodes": rows}


def by_op(rows: list[dict]) -> list[dict]:
    """The rows summed per operator, the largest measured first."""
    grouped: dict[str, dict] = {}
    for row in rows:
        entry = grouped.setdefault(row["op"], {"op": row["op"], "nodes": 0, "predicted_s": 0.0, "measured_s": 0.0})
        entry["nodes"] += 1
        entry["predicted_s"] += row["predicted_s"]
        entry["measured_s"] += row["measured_s"]
    return sorted(grouped.values(), key=lambda entry: -entry["measured_s"])


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.2f}" if predicted > 0 else "-"


def print_result(console: Console, data: dict, top: int) -> None:
    rows = data["nodes"]
    predicted, measured = sum(row["predicted_s"] for row in rows), sum(row["measured_s"] for row in rows)
    table = Table(title=f"{data['model']}: {len(rows)} nodes, each op timed alone (median of {data['repeats']}), "
                        f"cost model {data['cluster']}")
    for column in ("op", "nodes", "predicted ms", "measured ms", "measured/predicted", "share of measured"):
        table.add_column(column, justify="left" if column == "op" else "right")
    for entry in by_op(rows)[:top]:
        table.add_row(entry["op"], str(entry["nodes"]), f"{entry['predicted_s'] * 1e3:.3f}", f"{entry['measured_s'] * 1e3:.3f}",
                      _ratio(entry["measured_s"], entry["predicted_s"]), f"{entry['measured_s'] / measured:.1%}")
    table.add_row("all", str(len(rows)), f"{predicted * 1e3:.3f}", f"{measured * 1e3:.3f}", _ratio(measured, predicted), "100%")
    console.print(table)
    worst = Table(title="the nodes priced furthest from their time")
    for column in ("node", "op", "predicted ms", "measured ms", "measured/predicted"):
        worst.add_column(column, justify="left" if column in ("node", "op") else "right")
    for row in sorted(rows, key=lambda row: -abs(row["measured_s"] - row["predicted_s"]))[:top]:
        worst.add_row(row["node"], row["op"], f"{row['predicted_s'] * 1e3:.3f}", f"{row['measured_s'] * 1e3:.3f}",
                      _ratio(row["measured_s"], row["predicted_s"]))
    console.print(worst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.op_costs", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="built-in models (metadist.workloads)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per node (the median is kept)")
    parser.add_argument("--top", type=int, default=12, help="operators and nodes listed")
    parser.add_argument("--cluster", default=None, help="a preset or cluster JSON (default: this machine, calibrated)")
    parser.add_argument("--out", type=Path, default=None, help="also write every node's figures as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    console = Console()
    results = []
    for model in args.models:
        data = measure(model, args.repeats, args.cluster)
        print_result(console, data, args.top)
        results.append(data)
    if args.out is not None:
        from ..cli.common import write_atomically

        write_atomically(args.out, json.dumps(results, indent=1))
        console.print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
