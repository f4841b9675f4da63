"""The model zoo under ``--check``: every zoo model on every mesh; writes ``docs/models.md``.

    python -m metadist.bench.zoo [--models qwen2,t5] [--meshes 2,2x2] [--steps 3] [--docs docs]
    python -m metadist.bench.zoo --render-only     # rewrite docs/models.md from docs/zoo/results.json

Each (model, mesh) is one ``metadist run zoo:NAME --nproc N --mesh M --steps 3 --check`` on local
gloo processes, launched as the command launches it, with rank 0 writing its run summary
(:mod:`metadist.runtime.summary`). A run that fails is one row with one line: the phase, the
exception and its first line (or the signal). Results are kept in ``docs/zoo/results.json``
(rows of a partial run replace the same rows of the file); the page is written from that file
(:mod:`.zoo_report`).

The rule database starts empty for the run (a temporary cache folder, unless ``--cache-dir``), so
compile seconds are those of a new user: discovery of the signatures no earlier row met, rows in
the order of :data:`metadist.workloads.zoo.MODELS`, each model on the meshes in the order given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..files import write_atomically
from ..ir import Mesh
from ..runtime.summary import RunSummary

log = logging.getLogger(__name__)

DEFAULT_MESHES = ("2", "2x2")
"""The meshes every zoo model trains on."""

RESULTS_FILE = Path("zoo") / "results.json"
"""Where the figures go, under the docs folder."""


@dataclass(frozen=True, kw_only=True)
class ZooRun:
    """One model on one mesh."""

    model: str
    """The zoo model's short name."""
    mesh: tuple[int, ...]
    parameters: int
    passed: bool
    """Trained every step and matched one device within the check's tolerance."""
    wall_s: float
    """The launch's wall time: processes, import, compile, reference run, steps."""
    summary: RunSummary | None
    """Rank 0's summary; None when the run stopped before writing it."""
    failure: str | None
    """One line on what stopped it; None when it passed."""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["summary"] = None if self.summary is None else json.loads(self.summary.to_json())
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ZooRun:
        summary = data["summary"]
        return cls(model=data["model"], mesh=tuple(data["mesh"]), parameters=data["parameters"],
                   passed=data["passed"], wall_s=data["wall_s"],
                   summary=None if summary is None else RunSummary.from_json(json.dumps(summary)),
                   failure=data["failure"])


def run_one(model: str, mesh: Mesh, *, steps: int, log_dir: Path, timeout_s: float) -> ZooRun:
    """Launch ``metadist run zoo:MODEL --check`` on ``mesh`` and read what it left."""
    from ..runtime.launch import LocalLaunch, launch_local

    summary_path = log_dir / f"{model}-{'x'.join(map(str, mesh.shape))}.summary.json"
    summary_path.unlink(missing_ok=True)
    args = (f"zoo:{model}", "--mesh", "x".join(map(str, mesh.shape)), "--steps", str(steps), "--check",
            "--timeout-s", str(timeout_s), "--summary-json", str(summary_path))
    started = time.perf_counter()
    outcome = launch_local(LocalLaunch(module="metadist.runtime.worker", args=args, nproc=mesh.size,
                                       log_dir=log_dir, name=f"zoo-{model}", show_rank0_stdout=False))
    wall_s = time.perf_counter() - started
    summary = RunSummary.from_json(summary_path.read_text()) if summary_path.exists() else None
    failure = None if outcome.ok else failure_line(outcome)
    passed = outcome.ok and summary is not None and summary.check is not None and summary.check.passed
    if outcome.ok and not passed:
        failure = "the run finished without a passing check in its summary"
    log.info("zoo:%s on %s: %s in %.1f s%s", model, mesh.shape, "pass" if passed else "FAIL", wall_s,
             f" ({failure})" if failure else "")
    return ZooRun(model=model, mesh=mesh.shape, parameters=parameter_count(model), passed=passed, wall_s=round(wall_s, 2), summary=summary,
                  failure=failure)


def parameter_count(model: str) -> int:
    """Parameters of the zoo model, counted on a model built on the meta device (no memory)."""
    from ..workloads.zoo import zoo_workload

    return zoo_workload(model, device="meta").extras["params"]


def failure_line(outcome) -> str:
    """The root cause of a failed launch in one line: phase, exception type and first line, or the signal."""
    cause = outcome.root_cause()
    during = f"{cause.phase}: " if cause.phase else ""
    if cause.exception is not None:
        first = cause.exception.message.strip().splitlines()[0] if cause.exception.message.strip() else ""
        return public_text(f"{during}{cause.exception.type}: {first}")
    what = f"killed by {cause.signal_name}" if cause.signal_name else f"exited with status {cause.exitcode}"
    return f"{during}rank {cause.rank} {what}"


def public_text(text: str) -> str:
    """``text`` without the folders of this machine: paths start at the package (``transformers/...``) or
    at the repository (``tests/...``), so the page can be committed."""
    import re

    repository = Path(__file__).resolve().parents[2]
    text = text.replace(f"{repository}{os.sep}", "")
    return re.sub(r"(?:/[^\s:()'\"/]+)*/(?:site|dist)-packages/", "", text)


def run_zoo(models: list[str], meshes: list[Mesh], *, steps: int, log_dir: Path, timeout_s: float,
            on_run: Callable[[ZooRun], None] | None = None) -> list[ZooRun]:
    """Each model on each mesh, in order; ``on_run`` sees every row as it is done."""
    runs = []
    for model in models:
        for mesh in meshes:
            runs.append(run_one(model, mesh, steps=steps, log_dir=log_dir, timeout_s=timeout_s))
            if on_run is not None:
                on_run(runs[-1])
    return runs


def merge_results(old: list[ZooRun], new: list[ZooRun]) -> list[ZooRun]:
    """``old`` with the rows of ``new`` replacing the same (model, mesh), in zoo order."""
    from ..workloads.zoo import MODELS

    rows = {(run.model, run.mesh): run for run in old}
    rows.update({(run.model, run.mesh): run for run in new})
    order = {model.name: index for index, model in enumerate(MODELS)}
    return sorted(rows.values(), key=lambda run: (order.get(run.model, len(order)), len(run.mesh), run.mesh))


def read_results(path: Path) -> tuple[list[ZooRun], dict]:
    """The rows and the run facts kept in a results file (none if it does not exist)."""
    if not path.exists():
        return [], {}
    data = json.loads(path.read_text())
    return [ZooRun.from_dict(row) for row in data["runs"]], data.get("facts", {})


def write_results(path: Path, runs: list[ZooRun], facts: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"facts": facts, "runs": [run.to_dict() for run in runs]}, indent=1) + "\n")


def machine_facts(wall_s: float, command: str) -> dict:
    import torch
    import transformers

    from .. import __version__

    return {
        "command": command,
        "wall_s": round(wall_s, 1),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "metadist": __version__,
    }


def main(argv: list[str] | None = None) -> int:
    from ..workloads.zoo import ZOO, lookup_zoo
    from .zoo_report import write_page

    parser = argparse.ArgumentParser(prog="python -m metadist.bench.zoo", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    parser.add_argument("--meshes", default=",".join(DEFAULT_MESHES), help="comma-separated meshes (default 2,2x2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--docs", type=Path, default=Path("docs"), help="folder of models.md and zoo/results.json")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="MetaDist cache folder (rule database, run logs); default: a new temporary one")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on each collective of a run")
    parser.add_argument("--render-only", action="store_true", help="rewrite models.md from the results file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results_path = args.docs / RESULTS_FILE
    old, facts = read_results(results_path)
    if not args.render_only:
        models = [lookup_zoo(name).name for name in args.models.split(",") if name] or list(ZOO)
        meshes = [Mesh.parse(text) for text in args.meshes.split(",") if text]
        started = time.perf_counter()
        done: list[ZooRun] = []

        def keep(run: ZooRun) -> None:  # rows are written as they finish: a stopped run keeps what it did
            done.append(run)
            write_results(results_path, merge_results(old, done), facts)

        with _cache_folder(args.cache_dir) as cache_dir:
            runs = run_zoo(models, meshes, steps=args.steps, log_dir=cache_dir / "runs", timeout_s=args.timeout_s,
                           on_run=keep)
        if set(models) == set(ZOO) and [mesh.shape for mesh in meshes] == [Mesh.parse(m).shape for m in DEFAULT_MESHES]:
            facts = machine_facts(time.perf_counter() - started, f"python -m metadist.bench.zoo --steps {args.steps}")
        old = merge_results(old, runs)
        write_results(results_path, old, facts)
    page = write_page(args.docs / "models.md", old, facts)
    print(f"wrote {page}")
    return 0


class _cache_folder:
    """``METADIST_CACHE_DIR`` for the ranks: the given folder, or a temporary one removed afterwards."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.temporary: tempfile.TemporaryDirectory | None = None
        self.previous = os.environ.get("METADIST_CACHE_DIR")

    def __enter__(self) -> Path:
        from ..config import CACHE_DIR_ENV

        if self.folder is None:
            self.temporary = tempfile.TemporaryDirectory(prefix="metadist-zoo-")
            self.folder = Path(self.temporary.name)
        self.folder.mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_DIR_ENV] = str(self.folder.resolve())
        return self.folder

    def __exit__(self, *exc) -> None:
        from ..config import CACHE_DIR_ENV

        if self.previous is None:
            os.environ.pop(CACHE_DIR_ENV, None)
        else:
            os.environ[CACHE_DIR_ENV] = self.previous
        if self.temporary is not None:
            self.temporary.cleanup()


if __name__ == "__main__":
    sys.exit(main())
