"""A step that restores the random generator's state while it is traced: replays no captured graph can hold.

``torch.utils.checkpoint`` (``preserve_rng_state=True``, its default) stashes the generator state before a
region's forward and restores it before recomputing the region in the backward, so that dropout draws the same
mask twice. A captured graph draws each random op from the generator in order at run time: the recomputed region
would draw a new mask and its gradients would silently differ from one device's. Until replays are represented in
MetaIR, capture watches ``torch.set_rng_state`` while it traces and refuses a step that restores the state and has
random ops (a checkpointed model without random ops is captured with its recomputation, exactly as it runs).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .errors import CaptureError

__all__ = ["RngRestoreWatch", "check_no_replayed_draws"]


class RngRestoreWatch:
    """Counts calls of ``torch.set_rng_state`` (and ``torch.random.set_rng_state``) while active."""

    def __init__(self) -> None:
        self.restores = 0

    @contextlib.contextmanager
    def active(self) -> Iterator["RngRestoreWatch"]:
        saved = torch.set_rng_state, torch.random.set_rng_state
        original = saved[1]

        def set_rng_state(new_state: Any) -> None:
            self.restores += 1
            original(new_state)

        torch.set_rng_state = torch.random.set_rng_state = set_rng_state
        try:
            yield self
        finally:
            torch.set_rng_state, torch.random.set_rng_state = saved


def check_no_replayed_draws(watch: RngRestoreWatch, graph: Any) -> None:
    """A CaptureError when the traced step restored the generator state and draws random numbers."""
    random = sorted({node.op.target for node in graph.nodes if node.op.is_random})
    if watch.restores and random:
        raise CaptureError(
            f"the step restores the random generator's state while it runs (torch.utils.checkpoint with "
            f"preserve_rng_state=True does, to replay dropout when it recomputes) and draws random numbers "
            f"({', '.join(random)}): a captured step cannot replay those draws yet, and its recomputed regions "
            "would differ from one device. Set the dropout probabilities to 0 in checkpointed models (or do not "
            "checkpoint them): MetaDist captures a checkpointed model without random ops, recomputation included"
        )
