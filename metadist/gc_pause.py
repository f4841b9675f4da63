"""Python's cyclic garbage collector paused while a phase builds a large, long-lived object graph.

Capturing a step and planning it allocate millions of small objects (fx nodes, fake tensors, MetaIR
nodes, the problem's tables) that mostly live to the end of the phase. The collector, triggered by
allocation counts, traverses all of them again and again: on ``metadist plan llama-7b --mesh 8x8`` its
14 full collections and ~3,700 younger ones took about 3 s of ~16 s. Paused, the phase's cyclic garbage
waits until the collector runs again after it (the peak resident memory there grew by ~50 MiB, 8%).
Results never depend on it: collection only frees memory.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["PAUSE", "gc_paused"]

PAUSE = True
"""False: :func:`gc_paused` leaves the collector as it is (``metadist.bench.plan_gc --collector-on`` compares so)."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection off for the block (or the decorated call), as it was after it (process-wide:
    other threads run without it meanwhile too).

    Nests: an inner pause leaves the collector off, the outermost turns it back on. A collector the
    caller turned off stays off.
    """
    if not PAUSE or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
