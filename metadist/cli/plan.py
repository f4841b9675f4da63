"""``metadist plan MODEL --mesh 2x4``: capture, discover rules, solve, print the plan.

Planning needs no GPU and no process group: the cluster is a description (a preset or a
JSON file from ``metadist calibrate``). The phases and their seconds go to stderr (a live
table on a terminal, plain lines otherwise); the plan goes to stdout.
"""

from __future__ import annotations

import argparse
import logging
import re

from rich.console import Console
from rich.table import Table

from ..files import write_atomically
from ..gc_pause import gc_paused
from .common import human_bytes
from .main import UsageError

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose a sharding for every tensor of a training step (ILP over the whole mesh)",
        description="Capture MODEL's training step, discover its rules, and solve for the fastest plan that fits memory.",
    )
    parser.add_argument("model", help="built-in workload name, or path/to/file.py[:function] returning a metadist.Workload")
    parser.add_argument("--mesh", help="mesh shape: 8, 2x4, or dp=2,tp=4; an axis named pp makes a pipeline (pp=2,dp=2)")
    parser.add_argument("--devices", type=int, help="instead of --mesh: a device count; the planner chooses the pp degree, "
                        "the microbatch count and the schedule with the sharding (nodes of the cluster preset's size)")
    parser.add_argument("--pp", type=int, help="with --devices: fix the pp degree (1: no pipeline)")
    parser.add_argument("--microbatches", type=int, help="with a pp axis: microbatches per step (default: the pp degree; "
                        "with --devices: searched)")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="with --mesh pp=...: the schedule")
    parser.add_argument("--cluster", help="a preset (a100x8, h100x8, h100-ib, cpu-gloo) or a cluster JSON file; default h100-ib")
    parser.add_argument("--memory-gb", type=float, help="per-device memory budget in GB (1e9 bytes); default: the device's capacity")
    parser.add_argument("--solver", choices=("ilp", "beam"), default="ilp", help="the ILP (default) or beam search")
    parser.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit in seconds; the best plan so far is kept (default 60)")
    parser.add_argument("--baselines", action="store_true", help="also estimate data parallel, ZeRO-2, ZeRO-3, Megatron TP and ZeRO-3 "
                                                                    "with every layer recomputing")
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


@gc_paused()  # a short process building large object graphs: the collector would traverse them again and again
def run(args: argparse.Namespace) -> int:
    from ..cost import resolve_cluster
    from ..ir import Mesh
    from ..solver import baseline_plan, explain, plan_graph
    from ..solver.recompute import recompute_layers

    from ..api import capture_and_discover
    from ..progress import ConsoleListener, enter, listening

    from ..ir.pipeline import PP_AXIS
    from .main import UsageError

    if args.expert_capacity_factor is not None and not args.expert_capacity_factor > 0:
        raise UsageError(f"--expert-capacity-factor must be positive (leave it out for dropless experts), "
                         f"got {args.expert_capacity_factor}")
    if (args.mesh is None) == (args.devices is None):
        raise UsageError("give either --mesh (a fixed mesh) or --devices N (the planner chooses the pipeline and mesh)")
    if args.devices is not None or PP_AXIS in Mesh.parse(args.mesh).axis_names:
        for flag, value in (("--precision", args.precision), ("--reduce-dtype", args.reduce_dtype),
                            ("--expert-capacity-factor", args.expert_capacity_factor)):
            if value is not None:
                raise UsageError(f"{flag} is not supported with pipeline planning yet (--devices or a pp axis): "
                                 f"plan with a mesh without a pp axis, or leave {flag} out")
        return run_pipeline(args)
    if args.pp is not None or args.microbatches is not None:
        raise UsageError("--pp and --microbatches go with --devices N or a mesh with a pp axis (--mesh pp=2,dp=2)")
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
        # why each node got its strategy is worked out only where it is shown or kept (--explain, --json)
        plan = plan_graph(graph, rules, cluster, memory_budget_bytes=budget, solver=args.solver, time_limit_s=args.time_limit,
                          reduce_dtype=reduce_dtype, explain=bool(args.explain or args.json))
        plans = {"metadist": plan}
        if args.baselines:
            enter("baselines")
            plans.update({kind: baseline_plan(graph, rules, cluster, kind, args.time_limit, reduce_dtype=reduce_dtype,
                                              explain=False)
                          for kind in ("dp", "zero2", "zero3", "megatron")})
            if recompute_layers(graph):  # full activation checkpointing, as ZeRO-3 users switch it on
                plans["zero3+recompute"] = baseline_plan(graph, rules, cluster, "zero3", args.time_limit,
                                                         reduce_dtype=reduce_dtype, recompute=True, explain=False)
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
def run_pipeline(args: argparse.Namespace) -> int:
    """``--devices N`` (search pp, microbatches, schedule) or ``--mesh pp=...`` (one pipeline plan)."""
    from ..cost import resolve_cluster
    from ..frontends.torch.microbatch import MicrobatchGraphs, first_microbatch
    from ..ir import Mesh
    from ..progress import ConsoleListener, enter, listening
    from ..solver.pipeline import plan_pipeline, search_pipeline
    from ..workloads import load_workload
    from .main import UsageError

    budget = None if args.memory_gb is None else args.memory_gb * 1e9
    console = Console()
    with listening(ConsoleListener(Console(stderr=True))):
        enter("capture")
        workload = load_workload(args.model)
        if not hasattr(workload, "train_step"):
            raise UsageError("pipeline planning takes PyTorch workloads; plan JAX workloads without a pp axis")
        graphs = MicrobatchGraphs(workload, args.rules_db)
        enter("solve")
        if args.devices is not None:
            if args.devices < 1:
                raise UsageError(f"--devices must be at least 1, got {args.devices}")
            from ..cost.cluster import PRESETS

            preset = args.cluster or "h100-ib"
            if preset not in PRESETS:
                raise UsageError("--devices takes a cluster preset (its node size lays out the meshes); got " + repr(preset))
            result = search_pipeline(graphs, args.devices, lambda mesh: resolve_cluster(preset, mesh),
                                     global_batch=graphs.global_batch, per_node=PRESETS[preset].devices_per_node,
                                     pp_degrees=None if args.pp is None else [args.pp],
                                     microbatches=None if args.microbatches is None else [args.microbatches],
                                     memory_budget_bytes=budget, time_limit_s=args.time_limit)
            chosen = None if result.chosen is None else result.chosen.plan
        else:
            mesh = Mesh.parse(args.mesh)
            pp = mesh.shape[mesh.axis_index("pp")]
            # default: pp microbatches, or the most that divide the batch below that (the pp degree is checked on the graph)
            microbatches = args.microbatches or max(d for d in range(1, min(pp, graphs.global_batch) + 1)
                                                    if graphs.global_batch % d == 0)
            first_microbatch(workload.batch, microbatches)  # a clear error when the count does not divide the batch
            graph, rules, divisor = graphs(microbatches, True)
            chosen = plan_pipeline(graph, rules, resolve_cluster(args.cluster, mesh), microbatches=microbatches,
                                   schedule=args.schedule, loss_divisor=divisor, memory_budget_bytes=budget,
                                   time_limit_s=args.time_limit)
            result = None
    if result is not None:
        console.print(result.explain(), markup=False, highlight=False)
    else:
        print_pipeline(console, chosen)
    if args.json and chosen is not None:
        write_atomically(args.json, chosen.to_json(indent=1))
        console.print(f"plan JSON written to {args.json}")
    return 0 if chosen is not None else 1


def print_pipeline(console: Console, plan) -> None:
    """A pipeline plan: the cuts, each stage's figures, the schedule's step time and bubble."""
    e = plan.estimate
    table = Table(title=f"pipeline of {plan.graph_name} on mesh {plan.mesh}: {plan.microbatches} microbatches, "
                        f"{plan.schedule}, cuts after {', '.join(e['cut_values'])}")
    for column in ("stage", "forward nodes", "forward ms/mb", "backward ms/mb", "update ms", "in flight", "peak memory",
                   "sends up/mb", "status"):
        table.add_column(column, justify="right")
    for stage, figures in zip(plan.stages, e["stages"]):
        table.add_row(str(stage.index), str(len(stage.forward)), f"{figures['forward_s'] * 1e3:.4g}",
                      f"{figures['backward_s'] * 1e3:.4g}", f"{figures['update_s'] * 1e3:.4g}", str(figures["in_flight"]),
                      human_bytes(figures["memory_bytes_peak"]), human_bytes(figures["send_up_bytes"]),
                      str(stage.plan.solver.get("status", "")))
    console.print(table)
    console.print(f"estimated step {e['step_s'] * 1e3:.4g} ms (forward/backward {e['forward_backward_s'] * 1e3:.4g} ms, "
                  f"update {e['update_s'] * 1e3:.4g} ms, transfers between stages {e['stage_transfers_s'] * 1e3:.4g} ms); "
                  f"bubble {e['bubble_fraction']:.1%} (fill and drain alone {e['ideal_bubble_fraction']:.1%}); "
                  f"peak {human_bytes(e['memory_bytes_peak'])} per device on stage {e['memory_peak_stage']}; "
                  f"solved in {plan.solver['solve_s']:.3g} s", markup=False, highlight=False)


def _sharding(sharding) -> str:
    return "(" + ", ".join(str(p) for p in sharding) + ")"


def print_plan(console: Console, graph, plan) -> None:
    """Parameters with their shardings (repeated layers' alike parameters on one row), the estimate, the solver's
    statistics."""
    from ..ir import Role

    states: dict[str, list[str]] = {}
    for graph_input in graph.inputs_by_role(Role.OPTIM_STATE):
        states.setdefault(graph_input.source, []).append(_sharding(plan.input_shardings[graph_input.value.name]))
    rows = [(graph_input.value.name, (str(graph_input.value.spec), _sharding(plan.input_shardings[graph_input.value.name]),
                                      " ".join(sorted(set(states.get(graph_input.source, []))))))
            for graph_input in graph.inputs_by_role(Role.PARAM)]
    table = Table(title=f"parameters of {graph.name} on mesh {plan.mesh}")
    for column in ("parameter", "shape", "sharding", "optimizer states"):
        table.add_column(column, overflow="fold")
    for name, cells in layer_rows(rows):
        table.add_row(name, *cells)
    console.print(table)
    print_estimate(console, plan)
    print_solver(console, plan)


_LAYER_INDEX = re.compile(r"^(.*?\.)(\d+)(\..*)$")


def layer_rows(rows: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """``(name, cells)`` rows with the parameters of numbered layers that show the same cells on one row.

    A name's first numbered component is its layer (``model.layers.7.mlp.up_proj.weight``); the names that differ only
    there and show the same cells become one row, ``model.layers.{0-31}.mlp.up_proj.weight``, at the place of the first.
    LLaMA-7B's 291 parameters take 12 rows where its 32 layers are sharded alike; a layer sharded otherwise keeps a row
    of its own (``{0-30}`` and ``{31}``).
    """
    groups: dict[tuple, list[int]] = {}
    order: list[tuple] = []
    for name, cells in rows:
        match = _LAYER_INDEX.match(name)
        key = (name, None, cells) if match is None else (match.group(1), match.group(3), cells)
        if key not in groups:
            groups[key] = []
            order.append(key)
        if match is not None:
            groups[key].append(int(match.group(2)))
    result = []
    for key in order:
        head, tail, cells = key
        indices = groups[key]
        if tail is None:
            result.append((head, cells))
        elif len(indices) == 1:
            result.append((f"{head}{indices[0]}{tail}", cells))
        else:
            result.append((f"{head}{{{_ranges(indices)}}}{tail}", cells))
    return result


def _ranges(indices: list[int]) -> str:
    """``0-3,5,7-9`` for [0, 1, 2, 3, 5, 7, 8, 9]."""
    runs: list[list[int]] = []
    for index in sorted(set(indices)):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


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
    recompute = getattr(plan, "recompute", ())
    table.add_row("recomputed layers", ", ".join(map(str, recompute)) if recompute else "none")
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
    if s.get("recompute"):
        r = s["recompute"]
        console.print(f"recompute: no plan fits the budget without it; the ILP chose layers {r['ilp_layers']} of "
                      f"{len(r['candidates'])}, the plan recomputes layers {r['layers']}", markup=False)
    unruled = s.get("nodes_without_rule", {})
    if unruled:
        seconds = sum(item["compute_s"] for item in unruled.values())
        console.print(f"{len(unruled)} node(s) without a rule run replicated ({seconds * 1e3:.3f} ms of compute); "
                      "see plan.solver['nodes_without_rule']", markup=False)


def print_comparison(console: Console, plans) -> None:
    table = Table(title="the plan next to the baselines (same cost model)")
    for column in ("plan", "step", "compute", "communication", "peak memory", "recomputed layers"):
        table.add_column(column, justify="right")
    for name, plan in plans.items():
        e = plan.estimate
        table.add_row(name, f"{e['step_s'] * 1e3:.3f} ms", f"{e['compute_s'] * 1e3:.3f} ms", f"{e['comm_s'] * 1e3:.3f} ms",
                      human_bytes(e["memory_bytes_peak"]), str(len(plan.recompute)) if plan.recompute else "none")
    console.print(table)
