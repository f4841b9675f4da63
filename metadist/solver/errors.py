"""Errors of the solver that the CLI reports as the user's (no traceback)."""

from __future__ import annotations

import math

from ..cost.cluster import ClusterError


class SolverError(ValueError):
    """The solver cannot plan this graph with these inputs; the message says why and what to change."""


class InfeasibleBudgetError(SolverError):
    """No plan fits the per-device memory budget."""

    def __init__(self, budget_bytes: float, minimum_bytes: float | None, detail: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        if minimum_bytes is None:
            need = "the smallest feasible footprint could not be computed"
            fix = "Raise --memory-gb"
        else:
            need = f"the smallest footprint any plan reaches is {minimum_bytes / 1e9:.4g} GB per device"
            fix = f"Raise --memory-gb to at least {math.ceil(minimum_bytes / 1e6) / 1e3:.3f}"
        super().__init__(
            f"no plan fits the memory budget of {budget_bytes / 1e9:.4g} GB (1e9 bytes) per device: {need}. "
            f"{fix}, use more devices, or shrink the batch{detail}"
        )


class PipelineError(SolverError):
    """A step, a mesh or pipeline settings that cannot be made a pipeline; the message says what fits."""


USER_ERRORS = (SolverError, ClusterError)
