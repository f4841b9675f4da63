"""A run's summary as data: what ``metadist run --summary-json PATH`` writes (rank 0).

The figures a table of runs needs (the model zoo's ``docs/models.md``): parameters, the
seconds of each compile phase, the ops that ran replicated for want of a rule, the losses,
and the check against one device with its largest differences. It is written before a
failed check raises, so a failed comparison still reports how far off it was.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["COMPILE_PHASES", "CheckSummary", "RunSummary", "UnruledOp", "read_summary", "unruled_ops"]

COMPILE_PHASES = ("capture", "discovery", "solve", "lowering")
"""The phases whose seconds add up to a run's compile time (rank 0's: it alone discovers and solves)."""


@dataclass(frozen=True)
class UnruledOp:
    """An op some nodes of the step ran replicated, having no rule."""

    op: str
    nodes: int
    reason: str
    """One reason, the first met (all nodes of one op and signature share it)."""


@dataclass(frozen=True, kw_only=True)
class CheckSummary:
    """The comparison with one device (``--check``)."""

    passed: bool
    tensors: int
    """Compared tensors: every step's loss, the last step's gradients, the final state."""
    max_abs: float
    """The largest absolute difference over every compared tensor."""
    max_rel: float
    """The largest relative difference over elements above ``atol``."""
    worst: str
    """The tensor that failed, or the one with the largest relative difference."""
    excused: int
    """Noise-dominated parameter elements excused (see :mod:`metadist.runtime.check`)."""


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """One run of ``metadist run``, as rank 0 saw it."""

    model: str
    mesh: tuple[int, ...]
    parameters: int
    losses: tuple[float, ...]
    phase_seconds: Mapping[str, float]
    """Own seconds of each phase rank 0 went through (``capture``, ``discovery``...)."""
    unruled: tuple[UnruledOp, ...]
    """Ops that ran replicated without a rule (factories, which the lowering creates, are left out)."""
    check: CheckSummary | None

    @property
    def compile_s(self) -> float:
        """Capture, discovery, solve and lowering on rank 0."""
        return sum(self.phase_seconds.get(name, 0.0) for name in COMPILE_PHASES)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> RunSummary:
        data = json.loads(text)
        check = data.pop("check")
        return cls(
            model=data["model"], mesh=tuple(data["mesh"]), parameters=data["parameters"],
            losses=tuple(data["losses"]), phase_seconds=dict(data["phase_seconds"]),
            unruled=tuple(UnruledOp(**item) for item in data["unruled"]),
            check=None if check is None else CheckSummary(**check),
        )


def read_summary(path: str | Path) -> RunSummary:
    return RunSummary.from_json(Path(path).read_text())


def unruled_ops(plan, graph) -> tuple[UnruledOp, ...]:
    """The plan's nodes without a rule, by op, leaving out factories (nodes that read no tensor)."""
    found: dict[str, UnruledOp] = {}
    for name, item in plan.solver.get("nodes_without_rule", {}).items():
        if not graph.node(name).input_names:
            continue
        op = item.get("op", "?")
        known = found.get(op)
        found[op] = UnruledOp(op, 1, item["reason"]) if known is None else UnruledOp(op, known.nodes + 1, known.reason)
    return tuple(sorted(found.values(), key=lambda unruled: (-unruled.nodes, unruled.op)))


def largest(values) -> float:
    """The largest of ``values``, NaN if any is NaN (Python's ``max`` answers by the order they come in)."""
    values = list(values)
    return math.nan if any(math.isnan(value) for value in values) else max(values)


def check_summary(report) -> CheckSummary:
    """The figures of a :class:`metadist.runtime.check.CheckReport`."""
    worst = report.worst()
    return CheckSummary(
        passed=report.ok, tensors=len(report.differences),
        max_abs=largest(difference.max_abs for difference in report.differences),
        max_rel=largest(difference.max_rel for difference in report.differences),
        worst=worst.name, excused=sum(difference.excused for difference in report.differences),
    )
