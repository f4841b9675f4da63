"""``metadist bench MODEL --nproc N``: every method side by side on the same model, batch and processes.

The ranks run :mod:`metadist.bench.harness`, launched like ``metadist run``'s
(:mod:`metadist.runtime.launch`): everything they write (the profiler's lines included)
goes to the run's log folder, the terminal shows the table, and a failure is one block.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..bench.results import TIMINGS
from .run import add_log_dir_argument


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark MetaDist against DDP, ZeRO-2, ZeRO-3 and Megatron-style TP",
        description="Launch N local processes (torchrun; gloo on CPU, NCCL on GPUs) that run every method on MODEL "
                    "and print step time, bytes communicated, memory and final loss side by side.",
    )
    parser.add_argument("model", help="built-in workload name, or path/to/file.py[:function]")
    parser.add_argument("--nproc", type=int, default=2, help="processes (devices) to launch (default 2)")
    parser.add_argument("--mesh", default="", help="DPxTP mesh for tp-dp and MetaDist, e.g. 2x2 (default: 1-D over all)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    parser.add_argument("--methods", default="", help="comma-separated subset of single,ddp,zero2,zero3,tp,tp-dp and "
                                                      "the metadist-* methods (default: all)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--cluster", default=None, help="cost model cluster for MetaDist's plans: a preset or a JSON "
                                                        "file from 'metadist calibrate' (default: cpu-gloo on CPU)")
    parser.add_argument("--timing", choices=TIMINGS, default=TIMINGS[0],
                        help="interleaved (default): every method built first, then one timed step of each in turn, "
                             "round by round, so that a drifting machine slows them alike (all alive at once: the sum "
                             "of their memory); sequential: each method timed after its build and freed before the next")
    parser.add_argument("--timed-alone", default=None, metavar="METHODS",
                        help="with interleaved timing, comma-separated methods timed on their own first and freed "
                             "before the others are built, so that those alive together fit in memory (default: single)")
    parser.add_argument("--out", metavar="FILE", help="also keep the result JSON in FILE")
    add_log_dir_argument(parser)
    parser.set_defaults(handler=run)


def harness_command(args: argparse.Namespace, out: str) -> list[str]:
    """The torchrun command line equivalent to the launch (to run the harness by hand)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
            "-m", "metadist.bench.harness", *harness_args(args, out)]


def harness_args(args: argparse.Namespace, out: str) -> list[str]:
    """The arguments of every rank's ``python -m metadist.bench.harness``."""
    command = [args.model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out,
               "--timing", args.timing]
    for flag, value in (("--mesh", args.mesh), ("--methods", args.methods), ("--batch-size", args.batch_size),
                        ("--seq-len", args.seq_len), ("--cluster", args.cluster)):
        if value:
            command += [flag, str(value)]
    if args.timed_alone is not None:  # '' names none: every method interleaved
        command += ["--timed-alone", args.timed_alone]
    return command


def run(args: argparse.Namespace) -> int:
    from ..bench.results import BenchRun
    from ..runtime.launch import LocalLaunch
    from .main import UsageError
    from .run import launch_and_report, log_dir

    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    console = Console(width=200)
    with tempfile.TemporaryDirectory() as folder:
        out = args.out or str(Path(folder) / "bench.json")
        launch = LocalLaunch(module="metadist.bench.harness", args=tuple(harness_args(args, out)), nproc=args.nproc,
                             log_dir=log_dir(args), name=args.model, show_rank0_stdout=False)
        console.print(f"measuring {args.model} on {args.nproc} processes ...", markup=False, highlight=False)
        outcome = launch_and_report(launch, "metadist bench")
        if not outcome.ok:
            return outcome.exit_status()
        bench = BenchRun.from_json(Path(out).read_text())
    print_bench(console, bench)
    console.print(f"logs of every rank: {outcome.run_folder}", markup=False, highlight=False)
    return 0


def print_bench(console: Console, bench: BenchRun) -> None:
    from ..bench.report import COLUMNS, method_row

    table = Table(title=f"{bench.model}: {bench.world_size} processes ({bench.backend} on {bench.device}), "
                        f"{bench.steps} timed steps")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "method" else "right")
    for result in bench.methods:
        cells = method_row(bench, result)
        if result.ok:
            table.add_row(*(cells[column] for column in COLUMNS))
    console.print(table)
    for result in bench.methods:
        if not result.ok:
            console.print(f"[yellow]{result.method}[/yellow]: {result.status}: {result.reason}")
    disagreeing = {name: diff for name, diff in bench.loss_agreement().items() if diff > bench.loss_rtol}
    if disagreeing:
        console.print(f"[red]final losses disagree with the single-device loss beyond {bench.loss_rtol:.0e}: {disagreeing}[/red]")
    else:
        console.print(f"final losses agree with the single-device loss within a relative {bench.loss_rtol:.0e}")
