"""Wall time of a whole ``metadist run``, the command a user types, phase by phase (issue #16, part 5).

    python -m metadist.bench.wholerun_bench [--runs 4] [--tree DIR ...] [MODEL] [--nproc 2] [--steps 2]

Runs ``python -m metadist.cli.main run MODEL --nproc N --steps S --check`` as a new process, ``--runs`` times, and
prints each run's wall seconds: before the ranks start (Python, torch and MetaDist's imports in the command, up to the
launcher log's first line), rank 0's phases (from ``--summary-json``), and the rest (rendezvous, the check's gathering
and comparison, the command's exit). With several ``--tree`` (checkouts of this project, e.g. main and a branch) the
runs alternate between them, so that the medians and their ratio are measured side by side on a machine whose speed
varies by the hour; the first tree is the one the others are compared with. Every run must pass its check.
Each tree's ``metadist`` package is byte-compiled first, as ``make setup`` leaves it (where PYTHONDONTWRITEBYTECODE
is set, an uncompiled tree compiles its sources again in every process: about a second of a short run).
The default model is the issue's: ``examples/gpt_85m.py`` (12 layers, hidden 768, batch 4 x 128, SGD).
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

DEFAULT_MODEL = "examples/gpt_85m.py"
TARGET_S = 20.0
"""The issue's figure for the default model: at most 20 s of wall time on this 2-core machine."""


@dataclass(frozen=True)
class WholeRun:
    tree: str
    wall_s: float
    before_ranks_s: float
    phases: dict
    load_average: float

    @property
    def rest_s(self) -> float:
        return self.wall_s - self.before_ranks_s - sum(self.phases.values())


def run_once(tree: Path, model: str, nproc: int, steps: int, timeout_s: float) -> WholeRun:
    """One ``metadist run --check`` of ``model`` with ``tree``'s MetaDist, timed; raises if it fails."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="wholerun-") as folder:
        summary, logs = Path(folder) / "summary.json", Path(folder) / "runs"
        command = [sys.executable, "-m", "metadist.cli.main", "run", model, "--nproc", str(nproc), "--steps", str(steps),
                   "--check", "--summary-json", str(summary), "--log-dir", str(logs)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        started = time.time()
        result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall = time.time() - started
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command[1:])}` in {tree} failed ({result.returncode}):\n"
                               f"{(result.stdout + result.stderr)[-3000:]}")
        if "check: PASS" not in result.stdout:
            raise RuntimeError(f"the run in {tree} did not print its check's PASS:\n{result.stdout[-3000:]}")
        phases = json.loads(summary.read_text())["phase_seconds"]
        first_log = next(logs.glob("*/launcher.log")).read_text().splitlines()[0]
        ranks_started = datetime.datetime.strptime(first_log[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return WholeRun(str(tree), wall, ranks_started - started, phases, load)


def measure(trees: list[Path], model: str, nproc: int, steps: int, runs: int, timeout_s: float,
            console: Console) -> list[WholeRun]:
    """``runs`` runs per tree, alternating between the trees, each line printed as it comes."""
    results = []
    for index in range(runs):
        for tree in trees:
            result = run_once(tree, model, nproc, steps, timeout_s)
            results.append(result)
            console.print(f"run {index + 1}/{runs} {tree}: {result.wall_s:.1f} s (load {result.load_average:.1f})")
    return results


def report(results: list[WholeRun], trees: list[Path], console: Console) -> None:
    """Per tree, the median of each part of the runs (a row each), then the walls against the issue's figure."""
    names: list[str] = []
    for result in results:
        names += [name for name in result.phases if name not in names]
    table = Table(title="metadist run: median seconds over the runs (rank 0's phases)")
    table.add_column("part")
    for tree in trees:
        table.add_column(tree.name or str(tree), justify="right")
    by_tree = {tree: [result for result in results if result.tree == str(tree)] for tree in trees}
    rows = [("wall", lambda r: r.wall_s), ("before the ranks", lambda r: r.before_ranks_s),
            *((name, lambda r, name=name: r.phases.get(name, 0.0)) for name in names), ("rest", lambda r: r.rest_s)]
    for label, value in rows:
        table.add_row(label, *(f"{statistics.median(value(r) for r in by_tree[tree]):.2f}" for tree in trees))
    console.print(table)
    first = None
    for tree in trees:
        walls = [result.wall_s for result in by_tree[tree]]
        median = statistics.median(walls)
        first = median if first is None else first
        under = sum(wall <= TARGET_S for wall in walls)
        console.print(f"{tree}: walls {', '.join(f'{wall:.1f}' for wall in walls)} s; median {median:.1f} s "
                      f"(x{median / first:.2f} of the first tree); {under} of {len(walls)} at most {TARGET_S:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model file (default {DEFAULT_MODEL})")
    parser.add_argument("--tree", action="append", type=Path, default=None,
                        help="a checkout of this project to measure (repeat to compare; default: this one)")
    parser.add_argument("--runs", type=int, default=4, help="runs per tree (default 4)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run (default 600)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    trees = [tree.resolve() for tree in (args.tree or [Path(__file__).resolve().parents[2]])]
    for tree in trees:
        if not (tree / "metadist" / "__init__.py").is_file():
            parser.error(f"--tree {tree} is not a checkout of this project (no metadist/__init__.py)")
        if args.model.endswith(".py") and not Path(args.model).is_absolute() and not (tree / args.model).is_file():
            parser.error(f"{args.model} is not in {tree}; pass an absolute path")
    console = Console()
    for tree in trees:  # as `make setup` leaves a checkout: no tree pays for compiling its sources in every process
        compileall.compile_dir(str(tree / "metadist"), quiet=1)
    results = measure(trees, args.model, args.nproc, args.steps, args.runs, args.timeout_s, console)
    report(results, trees, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
