"""Capture time and real memory for large built-ins (issue: foundation).

    python -m metadist.bench.capture_bench [MODEL ...]

Each model is captured in a fresh subprocess, so memory figures do not mix.
Reported per model: nodes, parameters, seconds to build the (meta-device)
model, seconds to capture, and the process's resident memory before capture
and at its peak (the difference is what capture itself needed).
"""

from __future__ import annotations

import json
import subprocess
import sys

from rich.console import Console
from rich.table import Table

DEFAULT_MODELS = ("gpt2-small", "gpt2-xl", "llama-7b")

_WORKER = """
import json, resource, sys, time
from metadist.workloads import builtin_workload
from metadist.frontends.torch import capture_step

def rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")

name = sys.argv[1]
started = time.perf_counter()
workload = builtin_workload(name)
optimizer = workload.optimizer(workload.model.parameters())
built = time.perf_counter() - started
before = rss_mib()
step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, name=name)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"model": name, "nodes": len(step.graph.nodes), "params": step.graph.parameter_count(),
                  "build_s": built, "capture_s": step.capture_seconds, "rss_before_mib": before, "peak_rss_mib": peak}))
"""


def measure(model: str) -> dict:
    result = subprocess.run([sys.executable, "-c", _WORKER, model], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"capturing {model} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    models = (argv if argv is not None else sys.argv[1:]) or list(DEFAULT_MODELS)
    table = Table(title="capture: time and real memory (one process per model)")
    for column in ("model", "params", "nodes", "build s", "capture s", "RSS before MiB", "peak RSS MiB", "capture MiB"):
        table.add_column(column, justify="right")
    for model in models:
        row = measure(model)
        table.add_row(
            row["model"], f"{row['params'] / 1e9:.2f}B", str(row["nodes"]), f"{row['build_s']:.1f}",
            f"{row['capture_s']:.1f}", f"{row['rss_before_mib']:.0f}", f"{row['peak_rss_mib']:.0f}",
            f"{row['peak_rss_mib'] - row['rss_before_mib']:.0f}",
        )
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
