"""Peak memory per rank, measured the same way for every method.

On a GPU the CUDA caching allocator counts it: ``torch.cuda.max_memory_allocated`` over the
measured step, less what was allocated before the method was built.

On the CPU there is no allocator counter, so the harness runs the method's build and its first
steps under ``torch.profiler`` with ``profile_memory=True``: every allocation and free of the
c10 CPU allocator is an event with its signed size. Summing them in time order from the start of
tracking gives the bytes the method holds at every instant (parameters or their shards,
gradients, optimizer states, communication buckets, activations). Two figures come out:

- ``state_bytes``: held when the measured step starts (what persists between steps),
- ``peak_bytes``: the most held at any instant of the measured step.

Memory outside the c10 allocator (gloo's own buffers, Python objects) is not counted; frees of
blocks allocated before tracking began (the source model) are not counted either, which is
right: the source model is not part of the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .comm_count import MEMORY_EVENT, TraceEvent


@dataclass(frozen=True)
class MemoryPeak:
    """Memory of one rank around one measured step."""

    state_bytes: int
    """Bytes held when the step starts."""
    peak_bytes: int
    """Most bytes held at any instant of the step."""
    source: str
    """``cpu-profiler`` (allocation events) or ``cuda-allocator`` (max_memory_allocated)."""


def cpu_memory_peak(events: Sequence[TraceEvent], start_ns: int, end_ns: int) -> MemoryPeak:
    """Running sum of CPU allocation events; the level at ``start_ns`` and its maximum up to ``end_ns``."""
    level = 0
    state = None
    peak = 0
    allocations = sorted((e for e in events if e.name == MEMORY_EVENT and e.device == "cpu"), key=lambda e: e.start_ns)
    for event in allocations:
        if event.start_ns > end_ns:
            break
        if state is None and event.start_ns >= start_ns:
            state = level
            peak = level
        level += event.nbytes
        if state is not None:
            peak = max(peak, level)
    if state is None:  # nothing allocated or freed during the step
        state = peak = level
    return MemoryPeak(state_bytes=int(state), peak_bytes=int(peak), source="cpu-profiler")
