"""Discovery time with a cold and a warm rule database (issue: ShardCombine).

    python -m metadist.bench.discovery_bench [MODEL ...]

For each model (default gpt2-small, gpt2-xl, llama-7b; large ones on the meta
device, captured with fake tensors), discovery runs twice on a fresh temporary
database: cold (every signature discovered) and warm (every signature read
back). Printed per model: ops, signatures, cold and warm seconds, and the
median and largest seconds per discovered signature. Because signatures are
keyed by op, ranks, dtypes and normalized arguments (not sizes, except for ops
that carry shapes), a bigger model of the same family needs no more discovery.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

DEFAULT_MODELS = ("gpt2-small", "gpt2-xl", "llama-7b")


def measure(model: str, db_folder: Path) -> dict:
    from ..frontends.torch import capture_step
    from ..frontends.torch.discovery import TorchExecutor
    from ..shardcombine.api import graph_rules
    from ..shardcombine.database import RuleDatabase
    from ..workloads import builtin_workload

    workload = builtin_workload(model)
    optimizer = workload.optimizer(workload.model.parameters())
    graph = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, name=model).graph
    with RuleDatabase(db_folder / f"{model}.sqlite") as db:
        cold = graph_rules(graph, TorchExecutor(), db=db)
        warm = graph_rules(graph, TorchExecutor(), db=db)
    per_signature = cold.stats.discovery_seconds
    return {
        "model": model, "ops": cold.stats.ops, "signatures": cold.stats.signatures,
        "without_rule": len(cold.missing), "cold_s": cold.stats.seconds, "warm_s": warm.stats.seconds,
        "warm_from_db": warm.stats.found_in_db,
        "median_s": statistics.median(per_signature) if per_signature else 0.0,
        "max_s": max(per_signature, default=0.0),
    }


def main(argv: list[str] | None = None) -> int:
    models = (argv if argv is not None else sys.argv[1:]) or list(DEFAULT_MODELS)
    table = Table(title="ShardCombine discovery: cold and warm rule database")
    for column in ("model", "ops", "signatures", "ops without rule", "cold s", "warm s", "median s/signature", "max s/signature"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory(prefix="metadist-discovery-bench-") as folder:
        for model in models:
            row = measure(model, Path(folder))
            table.add_row(
                row["model"], str(row["ops"]), str(row["signatures"]), str(row["without_rule"]),
                f"{row['cold_s']:.1f}", f"{row['warm_s']:.2f}", f"{row['median_s'] * 1e3:.0f} ms", f"{row['max_s']:.2f}",
            )
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
