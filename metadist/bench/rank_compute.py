"""Each rank's compute on processes that share cores, against the cost model's price of it (issue #16, part 2).

    python -m metadist.bench.rank_compute MODEL [MODEL ...] [--mesh 2x2] [--layouts plan,dp,eager] [--window-s 3]
        [--batch-size B --seq-len S] [--precision bf16|fp16] [--cluster NAME] [--out F.json]

For a built-in on N local processes (the product of ``--mesh``), three layouts of its step: MetaDist's plan (planned
as ``make bench`` plans it, on this machine's calibration for N processes), the solver's data-parallel layout, and
``eager``: the model's own step run by torch on the rank's share of the batch, as torch's DDP runs it without its
all-reduces (priced as the cost model prices DDP's compute). Each rank's lowered program runs as the runtime builds it,
with its collectives replaced by stand-ins: each call's output has its shape and values made from the rank's own
input, and nothing moves. Timed, with one intra-op thread as each rank of a local run has (median step over
``--window-s`` seconds): the first rank alone, then every rank at once, each in a forked process. Priced: the nodes' compute on one process's calibration (what the program costs alone) and on the
N-process calibration (what the planner prices). The one-process calibration times its process on every core, a rank
alone runs one thread: where ops use several threads (GPT-2 small's matmuls) ``1p`` prices a rank at half its time,
and only the N-process columns compare. Communication is left out of both sides, so the rows tell whether a
row of ``make bench`` on N processes sharing cores is mispriced in its compute or in its calls.

``--precision`` captures the step under a mixed precision policy (as ``metadist plan --precision``) for the plan and
dp layouts; torch's eager step runs as written, so ``eager`` takes no precision.

What the measured side holds beyond the priced one: the runtime's own work around its calls (packing and unpacking
coalesced calls, the stand-ins' copies, local slices) and its contiguous copies, which the cost model does not price
as compute. The "at once / alone" column is how much slower sharing the cores made the program; "priced N / priced 1"
is how much slower the N-process calibration prices it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..runtime.collectives import Collectives, _Pending

LAYOUTS = ("plan", "dp", "eager")


class StandInCollectives(Collectives):
    """Collectives that move nothing: each output has the shape the real call's has, its values taken from this rank's
    own input (an all-gather repeats it, a reduce-scatter keeps its first piece), so that the ops after it compute on
    ordinary numbers (an uninitialized buffer may hold NaNs or subnormals, which some kernels run far slower on)."""

    def _start(self, kind: str, tensor: torch.Tensor, axis: int, op: str | None = None) -> Any:
        k = self.axis_sizes[axis]
        if kind == "all_gather":
            out = tensor.repeat(k, *([1] * (tensor.dim() - 1)))
        elif kind == "reduce_scatter":
            out = tensor[: tensor.shape[0] // k].clone()
        else:  # all_reduce, all_to_all: the input's shape
            out = tensor.clone()
        return _Pending(None, out)


def rank_module(graph: Any, torch_step: Any, plan: Any, coords: tuple[int, ...]) -> tuple[Any, list[torch.Tensor]]:
    """The rank's module at ``coords`` as :class:`~metadist.runtime.step.CompiledStep` builds it (after its first-run
    probe), on stand-in collectives, and inputs of the program's local shapes (floats in [1e-3, 1.1e-2]: positive, so
    that an optimizer's second moments stay so)."""
    from ..lowering import lower
    from ..runtime.graph_module import FirstRunProbe, apply_first_run, build_rank_module
    from ..runtime.step import _cpu_transposed

    program = lower(graph, plan, coords)
    comm = StandInCollectives(("stand-in",) * plan.mesh.ndim, plan.mesh.shape)
    device = torch.device("cpu")
    module = build_rank_module(program, comm, device, torch_step.contiguous_values, transposed=_cpu_transposed(graph, device))
    generator = torch.Generator().manual_seed(0)
    inputs = []
    for program_input in program.inputs:
        dtype = getattr(torch, program_input.spec.dtype)
        if dtype.is_floating_point:
            inputs.append((torch.rand(program_input.local_shape, generator=generator) * 0.01 + 1e-3).to(dtype))
        else:
            inputs.append(torch.zeros(program_input.local_shape, dtype=dtype))
    probe = FirstRunProbe(module)
    probe.run(*inputs)
    apply_first_run(module, probe)
    return module, inputs


def timed_s(step: Any, window_s: float) -> float:
    """The median of ``step()`` over ``window_s`` seconds (at least 3 calls), after two untimed calls."""
    for _ in range(2):
        step()
    steps, started = [], time.perf_counter()
    while time.perf_counter() - started < window_s or len(steps) < 3:
        began = time.perf_counter()
        step()
        steps.append(time.perf_counter() - began)
    return statistics.median(steps)


@dataclass(frozen=True)
class Lowered:
    """A plan's layout of the captured step (what :func:`_runner` lowers on each rank)."""

    graph: Any
    torch_step: Any
    plan: Any


@dataclass(frozen=True)
class Eager:
    """torch's own step of the workload, each rank on its share of the batch (:func:`eager_step`)."""

    workload: Any


def eager_step(workload: Any, parts: int, index: int) -> Any:
    """The model's own step on data-parallel rank ``index`` of ``parts``, as torch's DDP runs it less its all-reduces:
    its own copy of the model and optimizer, its rows of the batch (a function of no arguments)."""
    import copy

    from .baselines import local_batch

    model = copy.deepcopy(workload.model)
    optimizer = workload.optimizer(model.parameters())
    batch = local_batch(workload.batch, parts, index)
    train_step = workload.train_step()
    return lambda: train_step(model, optimizer, batch)


def _runner(layout: Any, coords: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """What one step of ``layout`` is on the rank at ``coords`` (a function of no arguments)."""
    if isinstance(layout, Eager):
        index = 0
        for coordinate, size in zip(coords, shape):
            index = index * size + coordinate
        return eager_step(layout.workload, math.prod(shape), index)
    graph, torch_step, plan = layout.graph, layout.torch_step, layout.plan
    module, inputs = rank_module(graph, torch_step, plan, coords)
    return lambda: module(*inputs)


def _rank_worker(layout: Any, coords: tuple[int, ...], shape: tuple[int, ...], window_s: float, barrier: Any,
                 results: Any) -> None:
    torch.set_num_threads(1)
    try:
        step = _runner(layout, coords, shape)
        step()
        barrier.wait()
        results.put((coords, timed_s(step, window_s), None))
    except BaseException as error:  # the parent reports it: a worker's traceback alone would lose which rank
        barrier.abort()
        results.put((coords, None, f"{type(error).__name__}: {error}"))


def at_once_s(layout: Any, shape: tuple[int, ...], window_s: float) -> dict[tuple[int, ...], float]:
    """Every rank's median step of ``layout`` (:class:`Lowered` or :class:`Eager`) on a mesh of ``shape``,
    every rank running at once, each in a forked process."""
    import itertools

    return forked_s(layout, shape, window_s, list(itertools.product(*(range(size) for size in shape))))


def alone_s(layout: Any, shape: tuple[int, ...], window_s: float) -> float:
    """The first rank's median step of ``layout`` on a mesh of ``shape``, alone on the machine, in a forked process
    as :func:`at_once_s` runs each rank, so that the two columns differ by the sharing alone. Timed in this process
    instead, mixtral-mini's ranks (its plan in bfloat16, torch's eager step) ran 2.54-2.69x as long at once as
    alone; both forked, 2.33-2.38x (the bfloat16 plan alone: 36.7 ms forked, 33.3 in the parent, one run each)."""
    return forked_s(layout, shape, window_s, [(0,) * len(shape)])[(0,) * len(shape)]


def forked_s(layout: Any, shape: tuple[int, ...], window_s: float,
             ranks: list[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
    """The median step of ``layout`` on each of ``ranks`` (coordinates on a mesh of ``shape``), all at once, each in
    a forked process."""
    import torch.multiprocessing as mp

    context = mp.get_context("fork")
    barrier, results = context.Barrier(len(ranks)), context.Queue()
    workers = [context.Process(target=_rank_worker, args=(layout, coords, shape, window_s, barrier, results))
               for coords in ranks]
    for worker in workers:
        worker.start()
    import queue

    got: list[tuple] = []
    while len(got) < len(workers):
        try:
            got.append(results.get(timeout=1.0))
        except queue.Empty:  # a rank killed outright (a signal, memory) never reports: name it rather than wait
            reported = {coords for coords, _, _ in got}
            dead = [f"rank {coords}: exit code {worker.exitcode}" for coords, worker in zip(ranks, workers)
                    if coords not in reported and worker.exitcode not in (None, 0)]
            if dead:
                for worker in workers:
                    worker.kill()
                raise RuntimeError("a rank's process died: " + "; ".join(dead)) from None
    for worker in workers:
        worker.join()
    failed = [f"rank {coords}: {error}" for coords, _, error in got if error is not None]
    if failed:
        raise RuntimeError("a rank's step failed: " + "; ".join(failed))
    return {coords: seconds for coords, seconds, _ in got}


def _clusters(graph: Any, mesh: Any, cluster_name: str | None = None) -> tuple[Any, Any]:
    """The cluster for ``mesh``'s processes and the same cluster with one process's device figures (both pricing the
    step's measured matmuls and attention): ``cluster_name`` (a preset or a calibrated JSON file), or by default this
    machine's calibration (``METADIST_CPU_CLUSTER``), calibrating first where not cached."""
    from ..config import settings_from_env
    from ..cost.calibrate import default_cpu_cluster
    from ..cost.timed_shapes import with_measured_shapes
    from ..ir import Mesh

    settings = settings_from_env()
    if cluster_name is not None:
        settings = replace(settings, cpu_cluster=cluster_name)

    def announce(text: str) -> None:
        print(f"rank_compute: {text}", file=sys.stderr, flush=True)

    def measured(cluster: Any) -> Any:
        return with_measured_shapes(cluster, graph, settings.cache_dir)

    shared = measured(default_cpu_cluster(mesh, settings.cpu_cluster, settings.cache_dir, announce=announce))
    alone = measured(default_cpu_cluster(Mesh((1,)), settings.cpu_cluster, settings.cache_dir, announce=announce))
    return shared, replace(shared, device=alone.device)


def _precision_refused(precision: str | None, layouts: tuple[str, ...]) -> str | None:
    """Why ``precision`` cannot go with ``layouts`` (None where it can): torch's eager step runs as written."""
    if precision is not None and "eager" in layouts:
        return ("--precision applies to the plan and dp layouts (torch's eager step runs as written): "
                "pass --layouts plan,dp")
    return None


def measure(model: str, mesh_shape: tuple[int, ...], layouts: tuple[str, ...], window_s: float,
            cluster_name: str | None = None, precision: str | None = None, batch_size: int | None = None,
            seq_len: int | None = None) -> dict[str, Any]:
    """The rows of one model: per layout, its compute priced alone and shared, and timed alone and at once;
    ``precision``: a mixed precision policy's name for the plan and dp layouts (not for ``eager``)."""
    refused = _precision_refused(precision, layouts)
    if refused:
        raise ValueError(refused)
    from ..frontends.torch.discovery import TorchExecutor
    from ..frontends.torch.repeat import capture_repeated_step
    from ..ir import Mesh
    from ..runtime.host_memory import keep_freed_host_memory_as_set
    from ..shardcombine.api import graph_rules
    from ..shardcombine.database import RuleDatabase
    from ..solver import baseline_plan, plan_graph
    from ..solver.baselines import _eager_compute_s
    from ..solver.estimate import node_compute_s
    from ..workloads import builtin_workload
    from .baselines import disable_dropout

    torch.set_num_threads(1)
    # as a compiled step on CPU runs (freed memory reused, not unmapped), before the forks: every rank inherits it
    keep_freed_host_memory_as_set()
    # real weights (the eager layout runs the model itself), at the bench entry's batch where given
    workload = builtin_workload(model, device="cpu", batch_size=batch_size, seq_len=seq_len)
    disable_dropout(workload.model)  # as the bench runs every method
    torch_step = capture_repeated_step(workload.train_step(), workload.model, workload.optimizer(workload.model.parameters()),
                                       workload.batch, name=model, precision=precision)
    graph = torch_step.graph
    with RuleDatabase() as db:
        rules = graph_rules(graph, TorchExecutor(), db=db)
    mesh = Mesh(mesh_shape)
    shared, alone = _clusters(graph, mesh, cluster_name)
    rows, dp = [], None
    for layout in layouts:
        if layout == "plan":
            plan = plan_graph(graph, rules, shared, memory_budget_bytes=float("inf"), solver="ilp",
                              reduce_dtype=torch_step.precision.reduce_dtype)
        else:  # dp and eager (priced as the dp layout run eagerly) share one solve
            dp = plan = dp if dp is not None else baseline_plan(graph, rules, shared, "dp")

        def priced_s(cluster: Any) -> float:
            nodes_s = sum(node_compute_s(graph, name, strategy, cluster) for name, strategy in plan.node_strategies.items())
            if layout == "eager":  # as the cost model prices torch DDP's compute: the dp layout's, run eagerly
                return _eager_compute_s(graph, cluster, {"compute_s": nodes_s}, plan)
            return nodes_s

        running = Eager(workload) if layout == "eager" else Lowered(graph, torch_step, plan)
        alone_time = alone_s(running, mesh.shape, window_s)
        together = at_once_s(running, mesh.shape, window_s)
        replicated = None if layout == "eager" else sum(all(choice.kind == "replicate" for choice in strategy.choices)
                                                        for strategy in plan.node_strategies.values())
        rows.append({"model": model, "layout": layout, "nodes": len(plan.node_strategies), "replicated_nodes": replicated,
                     "priced_alone_s": priced_s(alone), "alone_s": alone_time, "priced_shared_s": priced_s(shared),
                     "at_once_s": statistics.median(together.values()), "at_once_min_s": min(together.values()),
                     "at_once_max_s": max(together.values())})
    return {"model": model, "mesh": list(mesh_shape), "precision": precision, "rows": rows}


def table(results: list[dict[str, Any]], processes: int) -> Any:
    from rich.table import Table

    out = Table(title=f"each rank's compute, collectives stood in for: alone and {processes} processes at once on "
                      f"{os.cpu_count()} cores (ms)",
                caption=f"repl.: nodes replicated; 1p, {processes}p: priced on one process's calibration and on "
                        f"{processes} processes'; ratios: measured over priced, at once over alone, {processes}p over 1p")
    for column in ("model", "layout", "repl.", "1p", "alone", "ratio", f"{processes}p", "at once", "ratio",
                   "at once / alone", f"{processes}p / 1p"):
        out.add_column(column, justify="right")
    for result in results:
        for row in result["rows"]:
            ms = {key: 1e3 * value for key, value in row.items() if key.endswith("_s")}
            replicated = "-" if row["replicated_nodes"] is None else f"{row['replicated_nodes']}/{row['nodes']}"
            layout = row["layout"] + (f" ({result['precision']})" if result.get("precision") else "")
            out.add_row(row["model"], layout, replicated,
                        f"{ms['priced_alone_s']:.1f}", f"{ms['alone_s']:.1f}", f"{row['alone_s'] / row['priced_alone_s']:.2f}",
                        f"{ms['priced_shared_s']:.1f}",
                        f"{ms['at_once_s']:.1f}",
                        f"{row['at_once_s'] / row['priced_shared_s']:.2f}", f"{row['at_once_s'] / row['alone_s']:.2f}",
                        f"{row['priced_shared_s'] / row['priced_alone_s']:.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from .harness import parse_mesh

    parser = argparse.ArgumentParser(prog="python -m metadist.bench.rank_compute", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="built-in models (metadist models lists them)")
    parser.add_argument("--mesh", default="2x2", help="mesh of local processes, e.g. 2x2 or 4 (default 2x2)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--window-s", type=float, default=3.0, help="seconds each timing runs steps for (default 3)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the built-ins' batch size (their default if not given; the bench's gpt2-small: 4)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="the built-ins' sequence length (their default if not given; the bench's gpt2-small: 128)")
    parser.add_argument("--precision", choices=("bf16", "fp16"), default=None,
                        help="capture the step under this mixed precision policy (plan and dp layouts only)")
    parser.add_argument("--cluster", default=None, help="cost model cluster: preset or calibrated JSON file (default: "
                        "this machine, calibrated for the mesh's processes and for one)")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    layouts = tuple(name.strip() for name in args.layouts.split(",") if name.strip())
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        parser.error(f"--layouts {args.layouts!r}: choose among {', '.join(LAYOUTS)}")
    if args.window_s <= 0:
        parser.error("--window-s must be positive")
    refused = _precision_refused(args.precision, layouts)
    if refused:
        parser.error(refused)
    try:
        mesh = parse_mesh(args.mesh)
    except ValueError as error:
        parser.error(str(error))
    if not mesh:
        parser.error("--mesh is empty: give the processes' mesh, e.g. 2x2 or 4")
    console = Console()
    results = []
    for model in args.models:
        started = time.perf_counter()
        results.append(measure(model, mesh, layouts, args.window_s, args.cluster, args.precision, args.batch_size,
                               args.seq_len))
        console.print(f"{model}: {time.perf_counter() - started:.0f} s")
    console.print(table(results, math.prod(mesh)))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        temporary = args.out.with_name(args.out.name + ".partial")
        temporary.write_text(json.dumps({"cores": os.cpu_count(), "results": results}, indent=1))
        temporary.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
