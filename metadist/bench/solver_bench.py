"""Solver benchmark: problem size and solve time, and the plan next to the classic baselines.

Run as ``python -m metadist.bench.solver_bench [--models gpt2-small,gpt2-xl,llama-7b]
[--meshes 8,2x4,8x8] [--cluster h100-ib] [--json FILE]``. For every model it reports the seconds
of capture (a deep model on 4 of its layers, expanded) and of discovery (the rule database's
hits and misses) with the count of nodes left without a rule, and for every mesh the nodes before and after shrinking, ILP variables and
constraints, problem build, ILP build and solve seconds, the MIP gap, the end-to-end total, and
the estimated step time of the plan next to data parallel, ZeRO-2, ZeRO-3 and Megatron TP, all
priced by the same cost model. Seconds are wall-clock with the process's CPU seconds next to
them (on a shared machine the CPU seconds are what the work costs). (Reference: PyTorch's
autoparallel reports 35-60 s for LLaMA-3-8B on a 64-GPU 2-D mesh.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from ..cost import resolve_cluster
from ..files import write_atomically
from ..ir import Mesh
from ..solver import BASELINES, SolverError, baseline_plan, plan_graph

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("gpt2-small", "gpt2-xl", "llama-7b")
DEFAULT_MESHES = ("8", "2x4", "8x8")


def bench_one(graph, rules, mesh: Mesh, cluster_spec: str | None, time_limit_s: float, baselines: bool,
              memory_budget_bytes: float | None = None) -> dict[str, Any]:
    """Plan one graph on one mesh (``memory_budget_bytes``: None for the device's capacity); with ``baselines``, estimate the four baselines too."""
    cluster = resolve_cluster(cluster_spec, mesh)
    started, started_cpu = time.perf_counter(), time.process_time()
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=memory_budget_bytes, time_limit_s=time_limit_s)
    row: dict[str, Any] = {"mesh": "x".join(map(str, mesh.shape)), "plan_total_s": time.perf_counter() - started,
                           "plan_total_cpu_s": time.process_time() - started_cpu}
    keys = ("graph_nodes", "units_after_merging", "classes_after_tying", "classes_with_choices", "variables", "constraints",
            "problem_build_s", "build_s", "solve_s", "mip_gap", "status", "method", "excluded_indivisible_strategies")
    row.update({key: plan.solver.get(key) for key in keys})
    row["step_s"] = {"metadist": plan.estimate["step_s"]}
    row["memory_bytes_peak"] = {"metadist": plan.estimate["memory_bytes_peak"]}
    for kind in BASELINES if baselines else ():
        try:
            other = baseline_plan(graph, rules, cluster, kind, time_limit_s)
        except SolverError as err:
            logger.warning("baseline %s failed on mesh %s: %s", kind, row["mesh"], err)
            continue
        row["step_s"][kind] = other.estimate["step_s"]
        row["memory_bytes_peak"][kind] = other.estimate["memory_bytes_peak"]
    return row


def _seconds(since: tuple[float, float]) -> tuple[float, float]:
    return time.perf_counter() - since[0], time.process_time() - since[1]


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def capture(model: str, rules_db: str | None):
    """Graph, rules and timings ``{phase: (wall s, CPU s)}`` of a workload (the rule database caches discovery across runs)."""
    from ..api import capture_and_discover
    from ..frontends.jax.workload import JaxWorkload
    from ..workloads import load_workload

    started = _now()
    workload = load_workload(model)
    timings = {"load": _seconds(started)}
    if isinstance(workload, JaxWorkload):
        started = _now()
        graph, rules = capture_and_discover(workload, rules_db)
        timings["capture+discovery"] = _seconds(started)
        return graph, rules, timings
    from ..frontends.torch.discovery import TorchExecutor
    from ..frontends.torch.repeat import capture_repeated
    from ..shardcombine.api import rules_from_database

    started = _now()
    optimizer = workload.optimizer(workload.model.parameters())
    graph = capture_repeated(workload.train_step(), workload.model, optimizer, workload.batch, name=workload.name or model)
    timings["capture"] = _seconds(started)
    started = _now()
    rules = rules_from_database(graph, TorchExecutor(), rules_db)
    timings["discovery"] = _seconds(started)
    return graph, rules, timings


def print_rows(console: Console, model: str, rows: list[dict[str, Any]]) -> None:
    size = Table(title=f"{model}: problem size and seconds (plan total: wall / CPU)")
    for column in ("mesh", "nodes", "units", "classes", "variables", "constraints", "problem s", "ILP build s", "solve s",
                   "plan total s", "gap", "method"):
        size.add_column(column, justify="right")
    for row in rows:
        size.add_row(row["mesh"], str(row["graph_nodes"]), str(row["units_after_merging"]), str(row["classes_after_tying"]),
                     str(row["variables"]), str(row["constraints"]), f"{row['problem_build_s']:.2f}", f"{row['build_s']:.2f}",
                     f"{row['solve_s']:.2f}", f"{row['plan_total_s']:.2f} / {row['plan_total_cpu_s']:.2f}",
                     "-" if row["mip_gap"] is None else f"{row['mip_gap']:.2g}", str(row["method"]))
    console.print(size)
    step = Table(title=f"{model}: estimated step time (ms) and peak memory per device (GiB)")
    step.add_column("mesh")
    for kind in ("metadist", *BASELINES):
        step.add_column(kind, justify="right")
    for row in rows:
        cells = [
            f"{row['step_s'][k] * 1e3:.2f} / {row['memory_bytes_peak'][k] / 2**30:.1f}" if k in row["step_s"] else "-"
            for k in ("metadist", *BASELINES)
        ]
        step.add_row(row["mesh"], *cells)
    console.print(step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--meshes", default=",".join(DEFAULT_MESHES))
    parser.add_argument("--cluster", help="preset or cluster JSON (default h100-ib)")
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--memory-gb", type=float, help="per-device budget in GB (inf: none); default the device's capacity")
    parser.add_argument("--rules-db", help="rule database file (default: the user cache)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console, results = Console(width=160), {}
    for model in args.models.split(","):
        graph, rules, timings = capture(model, args.rules_db)
        phases = ", ".join(f"{phase} {wall:.2f} s (CPU {cpu:.2f} s)" for phase, (wall, cpu) in timings.items())
        unruled = len(getattr(rules, "missing", {}))
        console.print(f"{model}: {len(graph.nodes)} nodes, {unruled} without a rule; {phases}")
        budget = None if args.memory_gb is None else args.memory_gb * 1e9
        rows = [bench_one(graph, rules, Mesh.parse(text), args.cluster, args.time_limit, not args.no_baselines, budget)
                for text in args.meshes.split(",")]
        for row in rows:
            row["front_s"] = {phase: list(seconds) for phase, seconds in timings.items()}
            row["nodes_without_rule"] = unruled
            row["load_average_1min"] = os.getloadavg()[0]  # on a shared machine, wall seconds stretch with it
        print_rows(console, model, rows)
        results[model] = rows
    if args.json:
        command = "python -m metadist.bench.solver_bench " + " ".join(argv if argv is not None else sys.argv[1:])
        write_atomically(args.json, json.dumps({"command": command, "cpu_count": os.cpu_count(), "models": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
