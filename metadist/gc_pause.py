"""Python's cyclic garbage collector paused while a phase builds a large, long-lived object graph.

Capturing a step and planning it allocate millions of small objects (fx nodes, fake tensors, MetaIR
nodes, the problem's tables) that mostly live to the end of the phase. The collector, triggered by
allocation counts, traverses all of them again and again: on ``metadist plan llama-7b --mesh 8x8`` its
14 full collections and ~3,700 younger ones took about 3 s of ~16 s. Paused, the phase's cyclic garbage
waits until the collector runs again after it (the peak resident memory there grew by ~50 MiB, 8%).
Results never depend on it: collection only frees memory.

:func:`freeze_survivors` is the other half: once a process holds objects that live to its end (the modules a
rank imports, the model it runs), one collection frees what is garbage and the rest is moved out of the collector's
sight (``gc.freeze``), so that later full collections traverse only what came after. In ``metadist run``'s rank of
the issue's 12-layer GPT, full collections took 1.4 s a rank, traversing the ~440,000 objects of torch, transformers
and the model again and again; the fork server freezes its imports before it forks (which also keeps the children
from writing to the pages it shares with them), and each rank freezes what it holds once its model is loaded.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["PAUSE", "freeze_survivors", "gc_paused"]

PAUSE = True
"""False: :func:`gc_paused` leaves the collector as it is and :func:`freeze_survivors` freezes nothing
(``metadist.bench.plan_gc --collector-on`` compares so)."""


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


def freeze_survivors() -> int:
    """Collect once, then move every object still alive to the permanent generation, which automatic (and explicit)
    collections skip; returns how many objects were frozen.

    For a process whose objects of now live to its end: nothing that was garbage is frozen (the collection ran
    first), and what is frozen is freed by reference counting as before. Only a cycle among them that becomes
    garbage later stays (``gc.unfreeze`` hands them back). A collector the caller turned off is left off and
    nothing is frozen.
    """
    if not PAUSE or not gc.isenabled():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
