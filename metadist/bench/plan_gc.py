"""Where the garbage collector's time goes in one ``metadist plan`` command (issue #16, search scale).

    python -m metadist.bench.plan_gc [MODEL] [MESH] [--collector-on]

Runs ``metadist plan MODEL --mesh MESH`` (default ``llama-7b`` on ``8x8``) in this process and prints
its wall and CPU seconds, each generation's collections and seconds (``gc.callbacks``), the seconds
of the longest collection and the peak resident memory. ``--collector-on`` keeps the collector running
through the command (``metadist.gc_pause.PAUSE = False``), for a side-by-side comparison.
The plan itself goes to /dev/null.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import resource
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama-7b")
    parser.add_argument("mesh", nargs="?", default="8x8")
    parser.add_argument("--collector-on", action="store_true", help="do not pause the collector (the tree before the pause)")
    args = parser.parse_args(argv)

    counts, seconds, longest, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0], [0.0]

    def tally(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        elapsed = time.perf_counter() - started[0]
        counts[info["generation"]] += 1
        seconds[info["generation"]] += elapsed
        longest[0] = max(longest[0], elapsed)

    from metadist import gc_pause
    from metadist.cli.main import main as cli_main

    gc_pause.PAUSE = not args.collector_on

    gc.callbacks.append(tally)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            status = cli_main(["plan", args.model, "--mesh", args.mesh])
    finally:
        gc.callbacks.remove(tally)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"metadist plan {args.model} --mesh {args.mesh} (collector {'on' if args.collector_on else 'paused'}): "
          f"{wall:.2f} s wall, {cpu:.2f} s CPU; collections per generation {counts}, "
          f"seconds {[round(s, 2) for s in seconds]} (total {sum(seconds):.2f}, longest {longest[0]:.2f}); "
          f"peak RSS {peak_mib:.0f} MiB")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
