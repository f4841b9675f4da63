"""``metadist rules``: the persistent rule database, from the command line.

    metadist rules discover MODEL [--db PATH] [--optimizer adamw|adam|sgd]
    metadist rules show OP [--db PATH]
    metadist rules stats [--db PATH]
    metadist rules export FILE.json [--db PATH]
    metadist rules verify [MODEL ...] [--db PATH]

``--db`` defaults to ``rules.sqlite`` in ``METADIST_CACHE_DIR`` (else the user's cache folder).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Importing the errors module is what lets the CLI's main print them as one-line messages (USER_ERRORS).
from ..shardcombine.errors import OracleError, RuleDatabaseError, RuleLookupError

#: The models ``metadist rules verify`` checks when none is named.
DEFAULT_VERIFY_MODELS = ("mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny")
OPTIMIZER_CHOICES = ("adamw", "adam", "sgd")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rules",
        help="discover, inspect, export and verify the persistent SPMD rule database",
        description="The rule database ShardCombine fills: one rule (or the reason for none) per op signature.",
    )
    commands = parser.add_subparsers(dest="rules_command", metavar="SUBCOMMAND")
    commands.required = True
    db_option = argparse.ArgumentParser(add_help=False)
    db_option.add_argument(
        "--db", metavar="PATH", help="the rule database file (default: rules.sqlite in METADIST_CACHE_DIR or the user cache folder)"
    )

    discover = commands.add_parser(
        "discover", parents=[db_option], help="discover the rules of a model's training step",
        description="Capture MODEL's training step and discover (or look up) the rule of every op signature.",
    )
    discover.add_argument("model", help="built-in workload name, or path/to/file.py[:function] returning a metadist.Workload")
    discover.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, help="the optimizer of the step (default: the workload's own)")
    discover.set_defaults(handler=run_discover)

    show = commands.add_parser(
        "show", parents=[db_option], help="the rules known for an op",
        description="Print the rules stored for OP (aten.mm.default, aten.mm or mm) in factor notation.",
    )
    show.add_argument("op", help="op target, e.g. aten.mm.default; aten.mm or mm match every overload")
    show.set_defaults(handler=run_show)

    stats = commands.add_parser("stats", parents=[db_option], help="what the database holds")
    stats.set_defaults(handler=run_stats)

    export = commands.add_parser("export", parents=[db_option], help="write the database as JSON")
    export.add_argument("file", metavar="FILE.json", help="where to write (atomically)")
    export.set_defaults(handler=run_export)

    verify = commands.add_parser(
        "verify", parents=[db_option], help="check our rules against PyTorch DTensor's strategies and by re-execution",
        description=(
            "Discover (or look up) the rules of each MODEL's step, compare them with the sharding strategies "
            "PyTorch DTensor registers (on a 1-D mesh of a fake process group), and re-run every factor on fresh "
            f"shapes and data. Default models: {', '.join(DEFAULT_VERIFY_MODELS)}."
        ),
    )
    verify.add_argument("models", nargs="*", metavar="MODEL", help="built-in names or model files (default: the tiny built-ins)")
    verify.add_argument("--mesh-size", type=int, default=2, help="devices on the oracle's 1-D mesh (default 2)")
    verify.add_argument("--details", action="store_true", help="list every only-ours / only-DTensor strategy, not a few per op")
    verify.set_defaults(handler=run_verify)


# ---------------------------------------------------------------------------- helpers


def make_console() -> Console:
    """A rich console; wide (140 columns) when the output goes to a file or pipe, so tables stay readable."""
    console = Console()
    return console if console.is_terminal else Console(width=140)


def open_database(path: str | None):
    """The rule database at ``path``, or at the default location."""
    from ..shardcombine.database import RuleDatabase

    if path is not None and Path(path).is_dir():
        raise RuleDatabaseError(f"--db {path!r} is a folder; pass the path of a database file, e.g. {Path(path) / 'rules.sqlite'}")
    return RuleDatabase(path)


def capture_model(spec: str, optimizer: str | None = None):
    """Load and capture one workload's training step; returns the :class:`TorchStep`."""
    from ..frontends.torch import capture_step
    from ..workloads import BUILTIN_NAMES, builtin_workload, load_workload

    if spec in BUILTIN_NAMES and optimizer is not None:
        workload = builtin_workload(spec, optimizer=optimizer)
    else:
        workload = load_workload(spec)
        if optimizer is not None:
            from ..workloads.builtin import OPTIMIZERS

            workload = dataclasses.replace(workload, optimizer=OPTIMIZERS[optimizer])
    torch_optimizer = workload.optimizer(workload.model.parameters())
    return capture_step(workload.train_step(), workload.model, torch_optimizer, workload.batch, name=workload.name or spec)


def discover_rules(graph, db, console: Console):
    """``graph_rules`` with the PyTorch executor, its progress over op signatures shown on ``console``."""
    from ..frontends.torch.discovery import TorchExecutor
    from ..progress import ConsoleListener, listening
    from ..shardcombine.api import graph_rules

    with listening(ConsoleListener(console)):
        return graph_rules(graph, TorchExecutor(), db=db)


def matching_ops(db, name: str) -> tuple[str, ...]:
    """Op targets in ``db`` that ``name`` names: exactly, without the overload, or without the namespace."""
    targets = db.op_targets()
    if name in targets:
        return (name,)
    return tuple(
        target
        for target in targets
        if target.rsplit(".", 1)[0] == name or (target.count(".") >= 2 and target.split(".")[1] == name)
    )


# ---------------------------------------------------------------------------- subcommands


def run_discover(args: argparse.Namespace) -> int:
    console = make_console()
    with open_database(args.db) as db:
        step = capture_model(args.model, args.optimizer)
        result = discover_rules(step.graph, db, console)
        print_coverage(console, step.graph, result, db.path)
    return 0


def print_coverage(console: Console, graph, result, db_path: Path) -> None:
    stats = result.stats
    covered = len(result.rules)
    console.print(
        f"[bold]{escape(graph.name)}[/bold]: {stats.ops} ops, {stats.signatures} signatures; "
        f"{stats.found_in_db} found in the database, {stats.discovered} newly discovered in {stats.seconds:.2f} s; "
        f"{covered} of {stats.ops} ops ({100.0 * covered / max(stats.ops, 1):.1f}%) have a rule"
    )
    console.print(f"rule database: {escape(str(db_path))}")
    if not result.missing:
        console.print("every op has a rule")
        return
    table = Table(title=f"{len(result.missing)} ops without a rule")
    table.add_column("node")
    table.add_column("op")
    table.add_column("reason", overflow="fold")
    for node_name, reason in result.missing.items():
        table.add_row(escape(node_name), graph.node(node_name).op.target, escape(reason))
    console.print(table)


def run_show(args: argparse.Namespace) -> int:
    console = make_console()
    with open_database(args.db) as db:
        targets = matching_ops(db, args.op)
        if not targets:
            raise RuleLookupError(
                f"the rule database {str(db.path)!r} has no rules for op {args.op!r}; "
                "run 'metadist rules discover MODEL' on a model that uses it (with the same --db)"
            )
        for target in targets:
            entries = db.rules_for_op(target)
            table = Table(title=f"{target}: {len(entries)} signatures")
            table.add_column("signature", overflow="fold")
            table.add_column("framework")
            table.add_column("rule (factor notation) or reason", overflow="fold")
            table.add_column("discovery s", justify="right")
            for entry in entries:
                rule = entry.rule.to_text() if entry.rule is not None else f"no rule: {entry.reason}"
                seconds = "-" if entry.discovery_seconds is None else f"{entry.discovery_seconds:.3f}"
                table.add_row(escape(entry.signature_key), f"{entry.framework} {entry.framework_version}", escape(rule), seconds)
            console.print(table)
    return 0


def run_stats(args: argparse.Namespace) -> int:
    console = make_console()
    with open_database(args.db) as db:
        stats = db.stats()
    console.print(
        f"rule database {escape(stats.path)} (schema {stats.schema_version}, rule format {stats.rule_format_version}): "
        f"{stats.entries} signatures, {stats.rules} with a rule, {stats.reasons} without; "
        f"{stats.discovery_seconds:.1f} s of discovery stored"
        + (f"; {stats.stale_rows} rows of another rule format ignored" if stats.stale_rows else "")
    )
    if not stats.entries:
        console.print("the database is empty; fill it with 'metadist rules discover MODEL'")
        return 0
    frameworks = Table(title="by framework")
    for column in ("framework", "version", "rules", "no rule"):
        frameworks.add_column(column, justify="right" if column in ("rules", "no rule") else "left")
    for row in stats.by_framework:
        frameworks.add_row(row.framework, row.framework_version, str(row.rules), str(row.reasons))
    console.print(frameworks)
    ops = Table(title=f"by op ({len(stats.by_op)} ops)")
    for column in ("op", "rules", "no rule"):
        ops.add_column(column, justify="left" if column == "op" else "right")
    for row in stats.by_op:
        ops.add_row(row.op_target, str(row.rules), str(row.reasons))
    console.print(ops)
    return 0


def run_export(args: argparse.Namespace) -> int:
    if Path(args.file).is_dir():
        raise RuleDatabaseError(f"{args.file!r} is a folder; pass the path of the JSON file to write, e.g. {Path(args.file) / 'rules.json'}")
    with open_database(args.db) as db:
        count = db.export_json(args.file)
    make_console().print(f"{count} entries written to {escape(args.file)}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from ..frontends.torch.discovery import TorchExecutor
    from ..shardcombine.oracle import DTensorOracle, merge_reports, verify_graph

    models = tuple(args.models) or DEFAULT_VERIFY_MODELS
    if args.mesh_size < 2:
        raise OracleError(f"--mesh-size must be at least 2 (a 1-D mesh to shard over), got {args.mesh_size}")
    console = make_console()
    executor = TorchExecutor()
    reports = []
    with open_database(args.db) as db, DTensorOracle(args.mesh_size) as oracle:
        for model in models:
            step = capture_model(model)
            result = discover_rules(step.graph, db, console)
            reports.append(verify_graph(step.graph, result.rules, oracle, executor, model=model))
    print_report(console, merge_reports(reports), details=args.details)
    return 0


def print_report(console: Console, report: Any, details: bool = False) -> None:
    """The oracle report: totals, a table per op, the reasons DTensor-only strategies are missing, wrong rules."""
    console.print(
        f"[bold]rules verify[/bold] over {escape(', '.join(report.models))}: {report.nodes} ops, {report.nodes_with_rule} with a rule, "
        f"{report.signatures} distinct signatures compared ({report.dtensor_registered} answered by DTensor, "
        f"1-D mesh of {report.mesh_size})"
    )
    console.print(
        f"strategies: {report.agreements} agree with DTensor, {report.only_ours} only ours, {report.only_dtensor} only DTensor; "
        f"execution re-check of our rules: {report.checks_passed} passed, {report.checks_failed} failed, "
        f"{report.checks_skipped} not checkable; DTensor strategies the re-check shows wrong: {report.dtensor_wrong}"
    )
    table = Table(title="per op")
    for column in ("op", "signatures", "agree", "only ours", "only DTensor", "re-check ok", "WRONG", "unchecked", "DTensor wrong"):
        table.add_column(column, justify="left" if column == "op" else "right")
    for op in report.ops:
        table.add_row(
            op.op_target, str(op.signatures), str(op.agreements), str(op.only_ours), str(op.only_dtensor),
            str(op.checks_passed), f"[red]{op.checks_failed}[/red]" if op.checks_failed else "0", str(op.checks_skipped),
            f"[red]{op.dtensor_wrong}[/red]" if op.dtensor_wrong else "0",
        )
    console.print(table)
    reasons = Table(title="why DTensor-only strategies are not ours")
    reasons.add_column("strategies", justify="right")
    reasons.add_column("reason", overflow="fold")
    for reason, count in report.only_dtensor_reasons().items():
        reasons.add_row(str(count), escape(reason))
    console.print(reasons)
    if report.wrong_rules:
        wrong = Table(title="[red]rules the execution re-check shows wrong[/red]")
        wrong.add_column("signature", overflow="fold")
        wrong.add_column("rule")
        wrong.add_column("failing part", overflow="fold")
        for comparison in report.wrong_rules:
            for check in comparison.wrong:
                wrong.add_row(escape(comparison.signature), escape(comparison.rule_text), escape(f"{check.what}: {check.detail}"))
        console.print(wrong)
    else:
        console.print("no rule of ours failed the execution re-check")
    dtensor_wrong = [(comparison, finding) for comparison in report.comparisons for finding in comparison.dtensor_wrong]
    if dtensor_wrong:
        table = Table(title="[red]DTensor strategies the execution re-check shows wrong[/red]")
        table.add_column("signature", overflow="fold")
        table.add_column("DTensor strategy")
        table.add_column("why", overflow="fold")
        for comparison, finding in dtensor_wrong:
            table.add_row(escape(comparison.signature), str(finding.strategy), escape(finding.reason))
        console.print(table)
    if details:
        listing = Table(title="differences, signature by signature")
        listing.add_column("signature", overflow="fold")
        listing.add_column("side")
        listing.add_column("strategy")
        listing.add_column("reason", overflow="fold")
        for comparison in report.comparisons:
            for finding in comparison.only_ours:
                listing.add_row(escape(comparison.signature), "ours", str(finding.strategy), escape(finding.reason))
            for finding in comparison.only_dtensor:
                listing.add_row(escape(comparison.signature), "DTensor", str(finding.strategy), escape(finding.reason))
        console.print(listing)
