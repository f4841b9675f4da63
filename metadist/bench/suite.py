"""``make bench``: run the measured benchmarks and the scale study, then write ``docs/benchmarks.md``.

    python -m metadist.bench.suite [--nproc 4] [--models mlp,gpt2-tiny,...] [--skip-scale] [--docs docs]

The machine is calibrated again right before each entry, for the entry's process count (``metadist calibrate
--nproc N``, the figures MetaDist's plans and the predicted column are priced with): a calibration cached on
another day, or made for another entry twenty minutes earlier, may have met a machine of another speed (this
project's shared 2-core machine ran matmuls at 49 and at 94 GFLOP/s within the same hour; a 2-process calibration
at 37 GFLOP/s, then gpt-85m's step at 1.3x the speed it assumed, predicted 0.68-0.84 of every method's measured
step). ``--keep-calibration`` plans with the cached one. Each model runs in its own harness invocation (a fresh set of torchrun processes); the result
files land in ``docs/bench/results/``, the scale study in ``docs/bench/scale_study.json``, and the
page and its plots are written from them (:mod:`.report`). ``--models`` names entries by model (every entry of it:
``gpt2-tiny`` runs its 4-process entry and its two 2-process ones), by result file stem (``gpt2-tiny-4proc``,
``gpt2-tiny-2proc-bf16``) or by the stem less the process count (``gpt2-tiny-bf16``).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..forking import launch_environment
from .report import write_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuiteEntry:
    """One measured configuration."""

    model: str
    mesh: str
    """DPxTP mesh for tp-dp and MetaDist ("" for 1-D over all processes)."""
    nproc: int | None = None
    """Processes of this entry (None: the suite's ``--nproc``)."""
    steps: int | None = None
    """Timed steps of this entry (None: the suite's ``--steps``)."""
    methods: str | None = None
    """Comma-separated methods (None: all)."""
    batch: tuple[int, int] | None = None
    """(global batch size, sequence length) of a built-in (None: its defaults)."""
    timed_alone: str | None = None
    """Comma-separated methods the harness times on their own, not interleaved with the others (None: its default,
    the one-device reference): what keeps the methods alive together within the machine's memory."""
    tag: str = ""
    """What tells this entry's result file from another entry's of the same model and processes (its stem ends
    ``-TAG``)."""
    turn_steps: int | None = None
    """Consecutive steps of a timed turn (the harness's ``--turn-steps``; None: its default)."""

    @property
    def slug(self) -> str:
        """The result file's stem: the model's name (a file's stem for a model file)."""
        return Path(self.model.split(":")[0]).stem.replace("_", "-") if self.model.endswith(".py") or ".py:" in self.model else self.model

    def result_name(self, nproc: int) -> str:
        """The result file's name: ``SLUG-Nproc[-TAG].json``."""
        return f"{self.slug}-{nproc}proc{'-' + self.tag if self.tag else ''}.json"

    def chosen_by(self, wanted: set[str], nproc: int) -> bool:
        """Whether ``--models`` names this entry (of ``nproc`` processes): by its model or slug (every entry of that
        model), by its result file's stem (``SLUG-Nproc[-TAG]``) or by ``SLUG-TAG``."""
        names = {self.model, self.slug, self.result_name(nproc).removesuffix(".json")}
        if self.tag:
            names.add(f"{self.slug}-{self.tag}")
        return bool(names & wanted)


LEADING_METHODS = "single,ddp,zero2,zero3,metadist-ilp"
"""The methods of the leading (large) entries: each step takes seconds on a CPU, so the rows that inform."""

DEFAULT_ENTRIES = (
    # sizes that inform first: GPT-2 small (124M) and the 12-layer 768-wide GPT, on 2 processes
    # GPT-2 small's four distributed methods alive together took 20 of the machine's 24 GB: DDP and MetaDist, the
    # never-lose pair, are interleaved, the ZeRO stages timed on their own. 10 timed steps: single steps of one method
    # moved by +-15 % within a run, and 5-step medians of the same code by +-8 %
    # Their steps take seconds: one a turn (a barrier's few milliseconds are lost in them, four would take 4x longer)
    SuiteEntry("gpt2-small", "", nproc=2, steps=10, methods=LEADING_METHODS, batch=(4, 128),
               timed_alone="single,zero2,zero3", turn_steps=1),
    SuiteEntry("examples/gpt_85m.py", "", nproc=2, steps=10, methods=LEADING_METHODS, turn_steps=1),
    SuiteEntry("mlp", ""),
    SuiteEntry("gpt2-tiny", "2x2"),
    SuiteEntry("llama-tiny", "2x2"),
    SuiteEntry("bert-tiny", "2x2"),
    SuiteEntry("mixtral-mini", "2x2"),  # mixture of experts: expert parallelism against DP, ZeRO and TP
    # mixed precision and recomputation: MetaDist's bfloat16 and recomputing plans on 2 processes
    SuiteEntry("gpt2-tiny", "", nproc=2, methods="single,ddp,zero3,metadist-ilp,metadist-ilp-bf16", batch=(16, 64),
               tag="bf16"),
    SuiteEntry("gpt2-tiny", "", nproc=2, batch=(16, 64), tag="recompute",
               methods="metadist-ilp,metadist-ilp-recompute,metadist-ilp-bf16,metadist-ilp-bf16-recompute"),
)


def harness_argv(entry: SuiteEntry, nproc: int, steps: int, out: Path) -> list[str]:
    nproc, steps = entry.nproc or nproc, entry.steps or steps
    mesh = entry.mesh if nproc == 4 else ""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "metadist.bench.harness", entry.model, "--steps", str(steps), "--out", str(out)]
    argv += ["--warmup", "1"] if entry.steps else []
    argv += ["--methods", entry.methods] if entry.methods else []
    argv += ["--batch-size", str(entry.batch[0]), "--seq-len", str(entry.batch[1])] if entry.batch else []
    argv += ["--timed-alone", entry.timed_alone] if entry.timed_alone is not None else []
    argv += ["--turn-steps", str(entry.turn_steps)] if entry.turn_steps is not None else []
    return argv + (["--mesh", mesh] if mesh else [])


def calibrate_argv(nproc: int) -> list[str]:
    """``metadist calibrate --nproc N``: measures this machine now and replaces its cached calibration."""
    return [sys.executable, "-m", "metadist.cli.main", "calibrate", "--nproc", str(nproc)]


def harness_env(nproc: int) -> dict[str, str]:
    """The environment of a harness launch of ``nproc`` ranks: this process's, with the variables ``metadist run``
    sets for its ranks (:func:`metadist.forking.launch_environment`). torchrun passes an ``OMP_NUM_THREADS`` set to an
    empty string on as it is, and each rank would then run a thread per core where a ``metadist run`` rank runs one:
    the page would time other programs than the ones the plans were priced for."""
    return launch_environment(nproc)


def _run(argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Run one step of the suite; a failure is logged and the suite goes on with the next."""
    log.info("running: %s", shlex.join(argv))
    completed = subprocess.run(argv, check=False, env=env)
    if completed.returncode != 0:
        log.error("benchmark step failed with exit status %d: %s", completed.returncode, shlex.join(argv))
    return completed.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.suite", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default=",".join(entry.slug for entry in DEFAULT_ENTRIES))
    parser.add_argument("--skip-scale", action="store_true", help="keep the existing scale study file")
    parser.add_argument("--skip-measure", action="store_true", help="keep the existing result files")
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    parser.add_argument("--keep-calibration", action="store_true",
                        help="plan with this machine's cached calibration instead of measuring it again first")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    results = args.docs / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    scale_path = args.docs / "bench" / "scale_study.json"
    wanted = set(args.models.split(","))
    commands = []
    if not args.skip_measure:
        entries = [entry for entry in DEFAULT_ENTRIES if entry.chosen_by(wanted, entry.nproc or args.nproc)]
        for entry in entries:
            nproc = entry.nproc or args.nproc
            if not args.keep_calibration:
                _run(calibrate_argv(nproc))
            _run(harness_argv(entry, args.nproc, args.steps, results / entry.result_name(nproc)),
                 env=harness_env(nproc))
    scale_argv = [sys.executable, "-m", "metadist.bench.scale_study", "--out", str(scale_path), "-v"]
    commands.append(shlex.join(["python", *scale_argv[1:]]))
    if not args.skip_scale:
        _run(scale_argv)
    report = write_report(results, args.docs / "benchmarks.md", scale_path,
                          commands=["make bench  # = python -m metadist.bench.suite", *commands])
    log.info("wrote %s", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
