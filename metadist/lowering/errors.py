"""Errors of the lowering."""

from __future__ import annotations


class LoweringError(ValueError):
    """A plan cannot be lowered to per-rank programs; the message says what, why and how to fix it."""
