"""Errors of the PyTorch runtime. ``USER_ERRORS`` lists those the CLI reports as bad input."""

from __future__ import annotations

from ..lowering.errors import LoweringError


class RuntimeSetupError(RuntimeError):
    """The distributed environment is missing or does not fit the mesh; the message says how to fix it."""


class CheckError(AssertionError):
    """A distributed run differs from the single-device run beyond the stated tolerances."""


class LocalOpError(RuntimeError):
    """A local op of a rank program failed or made an unexpected shape (a lowering or rule bug)."""


class RunInputError(ValueError):
    """The model, batch or state given to a compiled step does not fit what was captured and planned."""


USER_ERRORS = (RuntimeSetupError, CheckError, RunInputError, LoweringError)
