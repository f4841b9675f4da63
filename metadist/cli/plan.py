"""``metadist plan MODEL --mesh 2x4``: capture, discover rules, solve, print the plan.

Planning needs no GPU and no process group: the cluster is a description (a preset or a
JSON file from ``metadist calibrate``). The phases and their seconds go to stderr (a live
table on a terminal, plain lines otherwise); the plan goes to stdout.
"""

from __future__ import annotations

import argparse
import logging

from rich.console import Console
from rich.table import Table

from .common import human_bytes, write_atomically
from .main import UsageError

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose a sharding for every tensor of a training step (ILP over the whole mesh)",
        description="Capture MODEL's training step, discover its rules, and solve for the fastest plan that fits memory.",
    )
    parser.add_argument("model", help="built-in workload name, or path/to/file.py[:function] returning a metadist.Workload")
    parser.add_argument("--mesh", required=True, help="mesh shape: 8, 2x4, or dp=2,tp=4")
    parser.add_argument("--cluster", help="a preset (a100x8, h100x8, h100-ib, cpu-gloo) or a cluster JSON file; default h100-ib")
    parser.add_argument("--memory-gb", type=float, help="per-device memory budget in GB (1e9 bytes); default: the device's capacity")
    parser.add_argument("--solver", choices=("ilp", "beam"), default="ilp", help="the ILP (default) or beam search")
    parser.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit in seconds; the best plan so far is kept (default 60)")
    parser.add_argument("--baselines", action="store_true", help="also estimate data parallel, ZeRO-2, ZeRO-3 and Megatron TP")
    parser.add_argument("--rules-db", help="rule database file (default: the user cache)")
    parser.add_argument("--expert-capacity-factor", type=float, default=None, metavar="F",
                        help="mixture-of-experts layers: ceil(F * k * S / E) slots per expert and group of S tokens "
                             "(default: dropless); pass the same to 'metadist run --plan FILE'")
    parser.add_argument("--json", metavar="FILE", help="write the plan JSON to FILE")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                        help="plan the step under a mixed precision policy: float32 master weights and optimizer state, "
                             "computation in bf16 or fp16, gradients reduced in --reduce-dtype (default: as written)")
    parser.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="the dtype gradients are reduced in across devices (default fp32 with --precision bf16/fp16)")
    parser.add_argument("--explain", metavar="NODE", action="append", default=[], help="explain why NODE got its strategy (repeatable)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..cost import resolve_cluster
    from ..ir import Mesh
    from ..solver import baseline_plan, explain, plan_graph

    from ..api import capture_and_discover
    from ..progress import ConsoleListener, enter, listening

    if args.expert_capacity_factor is not None and not args.expert_capacity_factor > 0:
        raise UsageError(f"--expert-capacity-factor must be positive (leave it out for dropless experts), "
                         f"got {args.expert_capacity_factor}")
    mesh = Mesh.parse(args.mesh)
    cluster = resolve_cluster(args.cluster, mesh)
    policy = _policy(args)
    reduce_dtype = None if policy is None else policy.reduce_dtype
    budget = None if args.memory_gb is None else args.memory_gb * 1e9
    with listening(ConsoleListener(Console(stderr=True))):  # the phases on stderr: stdout keeps the plan
        enter("capture")
        graph, rules = capture_and_discover(args.model, args.rules_db, policy,  # marks "discovery"
                                            expert_capacity_factor=args.expert_capacity_factor)
        enter("solve")
        plan = plan_graph(graph, rules, cluster, memory_budget_bytes=budget, solver=args.solver, time_limit_s=args.time_limit,
                          reduce_dtype=reduce_dtype)
        plans = {"metadist": plan}
        if args.baselines:
            enter("baselines")
            plans.update({kind: baseline_plan(graph, rules, cluster, kind, args.time_limit, reduce_dtype=reduce_dtype)
                          for kind in ("dp", "zero2", "zero3", "megatron")})
    console = Console()
    print_plan(console, graph, plan)
    if args.baselines:
        print_comparison(console, plans)
    for name in args.explain:
        console.print(explain(plan, name), markup=False)
    if args.json:
        write_atomically(args.json, plan.to_json(indent=1))
        console.print(f"plan JSON written to {args.json}")
    return 0


def _policy(args: argparse.Namespace):
    """The precision policy of ``--precision``/``--reduce-dtype`` (None: the step as written)."""
    from ..ir import PrecisionPolicy

    if args.precision is None and args.reduce_dtype is None:
        return None
    return PrecisionPolicy.named(args.precision or "fp32", args.reduce_dtype or "default")


def _sharding(sharding) -> str:
    return "(" + ", ".join(str(p) for p in sharding) + ")"


def print_plan(console: Console, graph, plan) -> None:
    """Parameters with their shardings, the estimate, the solver's statistics."""
    from ..ir import Role

    states: dict[str, list[str]] = {}
    for graph_input in graph.inputs_by_role(Role.OPTIM_STATE):
        states.setdefault(graph_input.source, []).append(_sharding(plan.input_shardings[graph_input.value.name]))
    table = Table(title=f"parameters of {graph.name} on mesh {plan.mesh}")
    for column in ("parameter", "shape", "sharding", "optimizer states"):
        table.add_column(column, overflow="fold")
    for graph_input in graph.inputs_by_role(Role.PARAM):
        name = graph_input.value.name
        table.add_row(name, str(graph_input.value.spec), _sharding(plan.input_shardings[name]),
                      " ".join(sorted(set(states.get(graph_input.source, [])))))
    console.print(table)
    print_estimate(console, plan)
    print_solver(console, plan)


def print_estimate(console: Console, plan) -> None:
    e = plan.estimate
    table = Table(title=f"estimate per step (cluster {e.get('cluster', '')})")
    table.add_column("term")
    table.add_column("value", justify="right")
    table.add_row("step time", f"{e['step_s'] * 1e3:.3f} ms")
    table.add_row("  compute", f"{e['compute_s'] * 1e3:.3f} ms")
    for axis, seconds in e["comm_s_by_axis"].items():
        table.add_row(f"  communication on {axis}", f"{seconds * 1e3:.3f} ms ({human_bytes(e['comm_bytes_by_axis'][axis])} sent)")
    table.add_row("collectives", ", ".join(f"{kind} x{count}" for kind, count in e["collectives_by_kind"].items()) or "none")
    table.add_row("peak memory per device", f"{human_bytes(e['memory_bytes_peak'])} at {e['memory_peak_node']}")
    for role, nbytes in e["memory_bytes_by_role"].items():
        table.add_row(f"  {role}", human_bytes(nbytes))
    budget = e.get("memory_budget_bytes")
    table.add_row("memory budget", "none" if budget is None else human_bytes(budget))
    console.print(table)


def print_solver(console: Console, plan) -> None:
    s = plan.solver
    keys = ("solver", "graph_nodes", "units_after_merging", "classes_after_tying", "classes_with_choices", "variables",
            "constraints", "problem_build_s", "build_s", "solve_s", "status", "method", "mip_gap", "excluded_indivisible_strategies")
    console.print("solver: " + ", ".join(f"{key}={s[key]}" for key in keys if key in s), markup=False)
    unruled = s.get("nodes_without_rule", {})
    if unruled:
        seconds = sum(item["compute_s"] for item in unruled.values())
        console.print(f"{len(unruled)} node(s) without a rule run replicated ({seconds * 1e3:.3f} ms of compute); "
                      "see plan.solver['nodes_without_rule']", markup=False)


def print_comparison(console: Console, plans) -> None:
    table = Table(title="the plan next to the baselines (same cost model)")
    for column in ("plan", "step", "compute", "communication", "peak memory"):
        table.add_column(column, justify="right")
    for name, plan in plans.items():
        e = plan.estimate
        table.add_row(name, f"{e['step_s'] * 1e3:.3f} ms", f"{e['compute_s'] * 1e3:.3f} ms", f"{e['comm_s'] * 1e3:.3f} ms",
                      human_bytes(e["memory_bytes_peak"]))
    console.print(table)
