"""Overlap: issue each collective as early as its sources allow, wait for it right before its first reader.

A rank program as lowered (and coalesced) runs every collective to completion where it stands,
so communication never overlaps computation. :func:`schedule_overlap` splits each collective
instruction into its *issue* (the instruction itself, where it now stands) and a :class:`Wait`
(where its results become readable), and places the two:

- **issue**: right after the last of its sources is defined (after the op that makes it, after
  the wait of the collective that makes it, or at the start of the program for inputs), e.g. a bucket of gradients right after the backward op
  that makes its last member, so that the reduction runs while the backward pass goes on, as
  DDP's buckets do;
- **wait**: right before the first instruction that reads one of its results (an op, a
  synchronous reshard, the issue of another collective, or the program's outputs at the end).

Local ops keep their order; only collectives move. Collectives are issued in one order that
depends only on the program's structure, which is the same on every rank (coordinates change
shapes and slices, never which collectives run or where), so the ranks of every process group
issue them in the same order.

**Memory bound.** A collective in flight holds its buffers (the packed input and the output) from
its issue to its wait. At most ``in_flight_cap_bytes`` of buffers (:func:`~.program.buffer_bytes`
of every member) are in flight at once: a collective that would pass the cap is issued later, when
earlier ones have been waited on, or right before its first reader needs it (it is then issued
even over the cap, alone or not, since the program cannot go on without it).

**Which collectives.** A :class:`CoalescedReshard`, and a :class:`Reshard` with exactly one
collective (its local steps run before the issue and after the wait). A reshard with several
collectives (coalescing off leaves multi-axis reshards whole) runs where it stands, synchronously.

**Chains.** The stages of a multi-axis reshard (``x -> x~0.0 -> x~0``) are collectives reading
collectives: the second stage is issued right after the first's wait, which is right before the
second needs it, so only the first stage of a chain overlaps computation.

Bytes and calls do not change: the same collectives run, in another place.
"""

from __future__ import annotations

from typing import Iterator

from ..ir import ValueRef
from .program import CoalescedReshard, Instruction, LocalOp, RankProgram, Reshard, Wait, buffer_bytes
from .reshard import COLLECTIVE_KINDS

__all__ = ["DEFAULT_IN_FLIGHT_CAP_BYTES", "in_flight_cap_for", "is_async", "schedule_overlap"]

DEFAULT_IN_FLIGHT_CAP_BYTES = 50 * 1024 * 1024
"""Most bytes of collective buffers in flight when coalescing is off (two default 25 MiB buckets)."""


def in_flight_cap_for(bucket_cap_bytes: int) -> int:
    """The in-flight cap that goes with a bucket cap: two buckets (one filling while one is on the wire)."""
    return 2 * bucket_cap_bytes if bucket_cap_bytes > 0 else DEFAULT_IN_FLIGHT_CAP_BYTES


def is_async(item: Instruction) -> bool:
    """Whether ``item`` can be issued and waited for apart: a bucket, or a reshard with one collective."""
    if isinstance(item, CoalescedReshard):
        return True
    if isinstance(item, Reshard):
        return sum(step.kind in COLLECTIVE_KINDS for step in item.steps) == 1
    return False


def schedule_overlap(program: RankProgram, in_flight_cap_bytes: int = DEFAULT_IN_FLIGHT_CAP_BYTES) -> RankProgram:
    """``program`` with its collectives issued early and waited for late (see the module docstring).

    A program that already holds :class:`Wait` instructions is returned as it is.
    """
    if any(isinstance(item, Wait) for item in program.instructions):
        return program
    schedule = _Schedule(program, in_flight_cap_bytes)
    return type(program)(program.graph_name, program.mesh, program.coords, program.inputs, schedule.run(), program.outputs)


class _Schedule:
    """Fixed instructions in order; collectives issued eagerly under the cap and waited for lazily."""

    def __init__(self, program: RankProgram, cap: int) -> None:
        self.program, self.cap = program, cap
        self.collectives = [index for index, item in enumerate(program.instructions) if is_async(item)]
        self.producer: dict[str, int] = {}
        for index in self.collectives:
            for target in targets(program.instructions[index]):
                self.producer[target] = index
        self.ready = {program_input.name for program_input in program.inputs}
        self.pending = list(self.collectives)  # not yet issued, in program order
        self.in_flight: dict[int, int] = {}  # issued, not yet waited for: index -> buffer bytes
        self.out: list[Instruction] = []

    def run(self) -> tuple[Instruction, ...]:
        instructions = self.program.instructions
        self._issue_ready()
        for item in instructions:
            if is_async(item):
                continue
            for name in reads(item):
                self._ensure(name)
            self.out.append(item)
            self.ready.update(defines(item))
            self._issue_ready()
        for output in self.program.outputs:
            self._ensure(output.value)
        for index in list(self.pending):  # results nobody reads (the lowering makes none): run them all the same
            self._issue(index)
        for index in list(self.in_flight):
            self._wait(index)
        return tuple(self.out)

    def _issue_ready(self) -> None:
        """Issue, in program order, every pending collective whose sources are defined and that fits the cap."""
        for index in list(self.pending):
            item = self.program.instructions[index]
            if not all(source in self.ready for source in sources(item)):
                continue
            if self.in_flight and sum(self.in_flight.values()) + held_bytes(item) > self.cap:
                continue
            self._issue(index)

    def _ensure(self, name: str) -> None:
        """Make ``name`` readable: wait for the collective that defines it (issuing it first if need be)."""
        if name in self.ready:
            return
        index = self.producer[name]
        if index in self.pending:
            for source in sources(self.program.instructions[index]):
                self._ensure(source)  # a wait may issue this collective already
            if index in self.pending:
                self._issue(index)
        self._wait(index)

    def _issue(self, index: int) -> None:
        item = self.program.instructions[index]
        self.pending.remove(index)
        self.in_flight[index] = held_bytes(item)
        self.out.append(item)

    def _wait(self, index: int) -> None:
        item = self.program.instructions[index]
        del self.in_flight[index]
        self.out.append(Wait(targets(item)))
        self.ready.update(targets(item))
        self._issue_ready()  # its results may be sources, and its buffers no longer count against the cap


def held_bytes(item: Reshard | CoalescedReshard) -> int:
    """Bytes of buffers a collective holds in flight (the larger of input and output, per member)."""
    if isinstance(item, CoalescedReshard):
        return item.buffer_bytes
    (step,) = [step for step in item.steps if step.kind in COLLECTIVE_KINDS]
    return buffer_bytes(step, item.spec.itemsize)


def sources(item: Reshard | CoalescedReshard) -> tuple[str, ...]:
    if isinstance(item, CoalescedReshard):
        return tuple(member.source for member in item.members)
    return (item.source,)


def targets(item: Reshard | CoalescedReshard) -> tuple[str, ...]:
    if isinstance(item, CoalescedReshard):
        return tuple(member.target for member in item.members)
    return (item.target,)


def reads(item: Instruction) -> tuple[str, ...]:
    """The values an instruction reads."""
    if isinstance(item, LocalOp):
        return tuple(_refs((item.args, tuple(value for _, value in item.kwargs))))
    if isinstance(item, (Reshard, CoalescedReshard)):
        return sources(item)
    return item.targets  # a Wait reads what it completes


def defines(item: Instruction) -> tuple[str, ...]:
    """The values an instruction defines (a Wait: the results it completes; an issued collective: none yet)."""
    if isinstance(item, LocalOp):
        return tuple(name for name in item.outputs if name is not None)
    if isinstance(item, Wait):
        return item.targets
    if isinstance(item, (Reshard, CoalescedReshard)):
        return targets(item)
    raise TypeError(f"unknown instruction {type(item).__name__}")


def _refs(arg) -> Iterator[str]:
    if isinstance(arg, ValueRef):
        yield arg.name
    elif isinstance(arg, (tuple, list)):
        for item in arg:
            yield from _refs(item)
    elif isinstance(arg, dict):
        for item in arg.values():
            yield from _refs(item)
