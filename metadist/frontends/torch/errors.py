"""Errors of the PyTorch frontend."""

from __future__ import annotations


class CaptureError(RuntimeError):
    """The training step cannot be captured; the message says what, why, and how to fix it."""
