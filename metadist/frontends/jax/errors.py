"""Errors of the JAX frontend."""

from __future__ import annotations


class JaxCaptureError(RuntimeError):
    """A JAX step cannot be captured or executed; the message says what, why, and how to fix it."""
