"""Measured: a pipeline (pp) against data parallelism (dp) on the same processes, side by side.

    python -m metadist.bench.pipeline_run --model llama-tiny --nproc 2 --steps 12 --microbatches 4

Runs ``metadist run MODEL --nproc N --mesh pp=N`` (the given microbatch count, 1F1B) and
``--mesh dp=N`` (the ILP's plan for the whole step) one after the other, each with ``--check``
and ``--summary-json``, and prints each run's median step seconds (the first step, which
compiles and places the state, left out), the ratio and whether the check passed. The runs
alternate ``--repeats`` times and the medians are over every repeat's steps, so a machine
busy with other work weighs on both alike. ``--out FILE`` records the comparison as a row of FILE
(JSON; the row of the same model, process count and microbatch count is replaced), from which
``docs/benchmarks.md`` renders its pipeline section (:func:`markdown`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["main", "markdown", "measure", "record"]


def measure(model: str, mesh: str, nproc: int, steps: int, extra: list[str]) -> tuple[list[float], bool]:
    """Step seconds after the first, and whether --check passed, of one run."""
    with tempfile.TemporaryDirectory() as folder:
        summary = Path(folder) / "summary.json"
        command = [sys.executable, "-m", "metadist.cli.main", "run", model, "--nproc", str(nproc), "--mesh", mesh,
                   "--steps", str(steps), "--check", "--summary-json", str(summary), *extra]
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0 or not summary.is_file():
            raise SystemExit(f"{' '.join(command[2:])} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        data = json.loads(summary.read_text())
    seconds = [data["phase_seconds"][f"step {i}"] for i in range(1, steps)]
    return seconds, bool(data["check"]["passed"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.pipeline_run", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None,
                        help="record the row in this JSON file (e.g. docs/bench/pipeline_run.json, which the page renders)")
    args = parser.parse_args(argv)
    runs = {f"pp={args.nproc} (1f1b, {args.microbatches} microbatches)":
            (f"pp={args.nproc}", ["--microbatches", str(args.microbatches), "--schedule", "1f1b"]),
            f"dp={args.nproc} (ILP plan, no pipeline)": (f"dp={args.nproc}", [])}
    seconds = {label: [] for label in runs}
    passed = {label: True for label in runs}
    for _ in range(args.repeats):
        for label, (mesh, extra) in runs.items():
            got, ok = measure(args.model, mesh, args.nproc, args.steps, extra)
            seconds[label] += got
            passed[label] &= ok
    print(f"{args.model} on {args.nproc} processes (gloo, CPU), {args.steps - 1} steps x {args.repeats} repeats each")
    medians = {label: statistics.median(values) for label, values in seconds.items()}
    for label, median in medians.items():
        print(f"  {label:<40} median step {median * 1e3:8.1f} ms   check {'PASS' if passed[label] else 'FAIL'}")
    pp, dp = medians.values()
    print(f"  pp / dp step time: {pp / dp:.2f}")
    if args.out is not None:
        (pp_passed, dp_passed) = passed.values()
        row = {"model": args.model, "nproc": args.nproc, "microbatches": args.microbatches, "steps": args.steps,
               "repeats": args.repeats, "pp_ms": pp * 1e3, "dp_ms": dp * 1e3, "pp_passed": pp_passed, "dp_passed": dp_passed,
               "load_average_1min": os.getloadavg()[0],
               "command": "python -m metadist.bench.pipeline_run " + " ".join(
                   f"--{k} {getattr(args, k)}" for k in ("model", "nproc", "steps", "microbatches", "repeats")) +
                   f" --out {args.out}"}
        record(args.out, row)
        print(f"  recorded in {args.out}")
    return 0 if all(passed.values()) else 1


def record(path: Path, row: dict) -> None:
    """Add ``row`` to the rows of the JSON file at ``path`` (the row of the same model, processes and microbatches is
    replaced), written whole or not at all."""
    from ..files import write_atomically

    rows = json.loads(path.read_text())["rows"] if path.is_file() else []
    key = (row["model"], row["nproc"], row["microbatches"])
    rows = [r for r in rows if (r["model"], r["nproc"], r["microbatches"]) != key] + [row]
    rows.sort(key=lambda r: (r["model"], r["nproc"], r["microbatches"]))
    write_atomically(path, json.dumps({"format": "metadist.pipeline_run", "rows": rows}, indent=1) + "\n")


def markdown(data: dict) -> list[str]:
    """The recorded rows as the lines of a markdown table and the commands that measured them."""
    lines = ["```bash", *(row["command"] for row in data["rows"]), "```", "",
             "| model | processes | microbatches | pp median step | dp median step | pp / dp | check | load (1 min) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        check = "PASS" if row["pp_passed"] and row["dp_passed"] else "FAIL"
        lines.append(f"| {row['model']} | {row['nproc']} | {row['microbatches']} | {row['pp_ms']:.1f} ms | "
                     f"{row['dp_ms']:.1f} ms | {row['pp_ms'] / row['dp_ms']:.2f} | {check} | {row['load_average_1min']:.1f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
