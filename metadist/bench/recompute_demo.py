"""Recomputation inside the search, shown: a budget no plan meets without it, and what the ILP does there.

    python -m metadist.bench.recompute_demo --model gpt2-medium --mesh 4 --memory-gb 12 --out docs/bench/recompute_demo.json

The cost model only (the cluster preset the CLI takes by default; nothing runs): the step is captured on the meta
device as ``metadist plan`` captures it, then

- the smallest per-device footprint of any plan without recomputation, and with every repeated layer free to
  recompute (the ILP's minimum-memory mode, with and without the keep/recompute variables);
- MetaDist's plan for the budget (``plan_graph``: recomputation offered because no plan fits without it);
- the solver baselines (``dp``, ``zero2``, ``zero3``, ``megatron``) and ``zero3+recompute`` (ZeRO-3 with every
  layer recomputing, full activation checkpointing), each planned without a budget, with their peak memory.

The same figures come out of ``metadist plan MODEL --mesh 4 --memory-gb X --baselines``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time

from ..files import write_atomically

log = logging.getLogger(__name__)


def study(model: str, mesh_text: str, memory_gb: float, cluster_spec: str | None = None) -> dict:
    from ..api import capture_and_discover
    from ..cost.cluster import resolve_cluster
    from ..ir import Mesh
    from ..solver import baseline_plan, plan_graph
    from ..solver.ilp import ShardingILP
    from ..solver.planner import _peaks_after_recompute, smallest_memory_bytes
    from ..solver.problem import build_problem, with_peaks
    from ..solver.recompute import recompute_layers, recompute_terms

    mesh = Mesh.parse(mesh_text)
    cluster = resolve_cluster(cluster_spec, mesh)
    started = time.perf_counter()
    graph, rules = capture_and_discover(model)
    capture_s = time.perf_counter() - started
    problem = build_problem(graph, rules.rules, cluster)
    candidates = recompute_layers(graph)
    every = tuple(layer.layer for layer in candidates)
    without = smallest_memory_bytes(problem)
    problem = with_peaks(problem, tuple(sorted({*problem.peaks, *_peaks_after_recompute(graph, every)})))
    with_recompute = ShardingILP(problem, None, minimize_memory=True,
                                 recompute=recompute_terms(problem, candidates)).solve().objective_s
    started = time.perf_counter()
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=memory_gb * 1e9)
    solve_s = time.perf_counter() - started
    plans = {"metadist": plan}
    for kind in ("dp", "zero2", "zero3", "megatron"):
        plans[kind] = baseline_plan(graph, rules, cluster, kind)
    plans["zero3+recompute"] = baseline_plan(graph, rules, cluster, "zero3", recompute=True)
    budget = memory_gb * 1e9
    rows = [{"plan": name, "step_s": p.estimate["step_s"], "compute_s": p.estimate["compute_s"],
             "comm_s": p.estimate["comm_s"], "memory_bytes": p.estimate["memory_bytes_peak"],
             "fits": p.estimate["memory_bytes_peak"] <= budget, "recomputed_layers": len(p.recompute)}
            for name, p in plans.items()]
    return {"model": model, "mesh": mesh_text, "cluster": cluster.name, "memory_budget_bytes": budget,
            "layers": len(candidates), "smallest_without_recompute_bytes": without,
            "smallest_with_recompute_bytes": with_recompute, "capture_s": capture_s, "solve_s": solve_s,
            "recomputed": list(plan.recompute), "rows": rows}


def markdown(result: dict) -> list[str]:
    """The study as lines of a Markdown section (no heading)."""
    gb = 1e9
    lines = [
        f"Budget {result['memory_budget_bytes'] / gb:.4g} GB (1e9 bytes) per device, {result['model']} on mesh "
        f"{result['mesh']} (`{result['cluster']}` preset). Smallest footprint of any plan without recomputation: "
        f"{result['smallest_without_recompute_bytes'] / gb:.2f} GB; with each of the {result['layers']} layers free "
        f"to recompute: {result['smallest_with_recompute_bytes'] / gb:.2f} GB. MetaDist recomputes "
        f"{len(result['recomputed'])} of {result['layers']} layers ({', '.join(map(str, result['recomputed']))}); "
        f"solved in {result['solve_s']:.1f} s.", "",
        "| plan | est. step ms | compute ms | communication ms | peak memory/device | fits the budget | recomputed layers |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['plan']} | {row['step_s'] * 1e3:.3f} | {row['compute_s'] * 1e3:.3f} | {row['comm_s'] * 1e3:.3f} | "
                     f"{row['memory_bytes'] / gb:.2f} GB | {'yes' if row['fits'] else 'no'} | {row['recomputed_layers'] or 'none'} |")
    ours = next(row for row in result["rows"] if row["plan"] == "metadist")
    full = next(row for row in result["rows"] if row["plan"] == "zero3+recompute")
    lines += ["", f"MetaDist's estimated step is {full['step_s'] / ours['step_s']:.2f}x faster than ZeRO-3 with full "
                  "recomputation, the plan that fits without a search; no plan without recomputation fits."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.recompute_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--mesh", default="4")
    parser.add_argument("--memory-gb", type=float, default=12.0)
    parser.add_argument("--cluster", default=None)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = study(args.model, args.mesh, args.memory_gb, args.cluster)
    result["command"] = shlex.join(["python", "-m", "metadist.bench.recompute_demo", *(argv if argv is not None else sys.argv[1:])])
    print("\n".join(markdown(result)))
    if args.out:
        write_atomically(args.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
