"""``metadist capture MODEL``: capture a workload's training step and summarise the graph."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from ..files import write_atomically
from .common import human_bytes, human_count


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "capture",
        help="capture a training step into MetaIR and print its summary",
        description="Capture MODEL's training step (a built-in name or path/to/file.py[:function]) into MetaIR.",
    )
    parser.add_argument("model", help="built-in workload name, or path/to/file.py[:function] returning a metadist.Workload")
    parser.add_argument("--json", metavar="FILE", help="write the graph in its versioned JSON form to FILE")
    parser.add_argument("--text", metavar="FILE", help="write the graph in its text form to FILE")
    parser.add_argument("--top", type=int, default=15, help="ops shown in the histogram (default 15)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..frontends.torch import capture_step
    from ..ir import graph_to_json
    from ..workloads import load_workload

    workload = load_workload(args.model)
    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, name=workload.name or args.model)
    graph = step.graph
    console = Console()
    print_summary(console, graph, step.capture_seconds, top=args.top)
    if args.json:
        write_atomically(args.json, graph_to_json(graph, indent=1))
        console.print(f"graph JSON written to {args.json}")
    if args.text:
        write_atomically(args.text, graph.to_text())
        console.print(f"graph text written to {args.text}")
    return 0


def print_summary(console: Console, graph, capture_seconds: float, top: int = 15) -> None:
    histogram = graph.op_histogram()
    console.print(
        f"[bold]{graph.name}[/bold]: {len(graph.nodes)} nodes, {len(graph.inputs)} inputs, "
        f"{len(graph.outputs)} outputs, {len(histogram)} distinct ops; "
        f"{human_count(graph.parameter_count())} parameters; captured in {capture_seconds:.2f} s"
    )
    for record in graph.routing:  # mixture of experts: the static dispatch the graph computes
        console.print(f"expert routing {record.describe()}", highlight=False)
    roles = Table(title="state and inputs by role")
    roles.add_column("role")
    roles.add_column("tensors", justify="right")
    roles.add_column("bytes", justify="right")
    counts: dict[str, int] = {}
    for graph_input in graph.inputs:
        counts[graph_input.role.value] = counts.get(graph_input.role.value, 0) + 1
    for role, nbytes in graph.bytes_by_role().items():
        roles.add_row(role, str(counts[role]), human_bytes(nbytes))
    console.print(roles)
    ops = Table(title=f"op histogram (top {top} of {len(histogram)})")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for target, count in histogram.most_common(top):
        ops.add_row(target, str(count))
    console.print(ops)
