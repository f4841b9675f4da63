"""Coalescing: run several reshards of a rank program as one collective (bucketing).

A collective has a fixed cost whatever its size (a launch, a synchronisation, ring latencies);
on gloo between CPU processes that cost dominates a small model's step. DDP and FSDP bucket
gradients for that reason; :func:`coalesce` does the same for every resharding of a
:class:`~metadist.lowering.program.RankProgram`.

**Stages.** A :class:`Reshard` with several collectives (e.g. ``(S(0), S(0)) -> (R, R)``
gathers on axis 1, then on axis 0) is first split into a chain of reshards with one collective
each, through intermediate values named ``<target>.<stage>`` (the steps and their order are
unchanged, so is what moves). Each stage is then a candidate on its own: the axis-1 gathers of
many values can share one call, and their axis-0 gathers the next.

**Candidates.** A :class:`Reshard` whose steps hold exactly one collective, of a kind in
:data:`COALESCIBLE_KINDS`, and any number of local steps (``local_slice``, ``zero_partial``)
before or after it; all-to-alls stay one call each. A member's local steps run on its own,
before (``pre``) and after (``post``) the shared collective.

**Key.** Members of one bucket share the collective's kind, mesh axis, reduce op and dtype;
their dims may differ (the runtime packs a flat per-rank layout).

**Rule** (always correct, the same on every rank). The instructions are walked in order. At a
candidate that is not yet in a bucket, a bucket opens with it; later candidates of the same key,
in program order, join it if their source is already defined at this point, until the bucket
would pass ``bucket_cap_bytes``. The bucket runs where its first member stood, which is before
the first instruction that reads any member's target (each member stood before its own first
reader, and the first member stands before them all); every source is defined there. Members
pulled forward are skipped where they stood. So a bucket is the reshards that *could* run now,
taken in the order the program needs them: gradients all reduced at the first optimizer op
form one bucket (as DDP's), a ZeRO-3 forward gathers the next ``bucket_cap_bytes`` of
parameters at once (as FSDP's prefetch). The cap bounds the extra memory held: targets pulled
forward hold at most ``bucket_cap_bytes`` per bucket before their readers run.

Every rank computes the same buckets: the walk depends only on the instruction structure and
on sizes read on the rank with the largest pieces (:func:`~.program.buffer_bytes`), which are the
same on every rank even where pieces are uneven. A collective on uneven pieces carries its
``pad`` step in ``pre`` and its ``unpad`` step in ``post``, so the shared collective always moves
equal pieces.

**Shared collectives.** Before bucketing, :func:`share_collectives` runs each identical
collective step on the same source once: when one value is resharded to two targets, both
chains may start with the same collective (e.g. ``(S(0), S(0)) -> (R, R)`` and
``-> (S(0), R)`` both gather on axis 1 first). Stages with the same source and the same steps
up to and including their collective (kind, axis, op, dims, shapes) compute the same value; the
first keeps its collective, later ones read its result and keep only their local steps after it
(a reshard with no steps is an alias).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Iterator

from ..ir import Partial, Replicate, Shard
from .program import BucketMember, CoalescedReshard, Instruction, LocalOp, RankProgram, Reshard, buffer_bytes
from .reshard import COLLECTIVE_KINDS, PAD_KINDS, ReshardStep

__all__ = ["COALESCIBLE_KINDS", "DEFAULT_BUCKET_CAP_BYTES", "coalesce", "coalescible_step", "share_collectives",
           "split_stages"]

#: Collective kinds that coalesce; all-to-all stays one call per value.
COALESCIBLE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024
"""Most bytes of local buffers in one bucket (DDP's default bucket, 25 MiB); 0 turns coalescing off."""


def coalescible_step(steps: Iterable[ReshardStep]) -> int | None:
    """Index of the one coalescible collective among ``steps`` when all others are local; else None."""
    steps = tuple(steps)
    collectives = [index for index, step in enumerate(steps) if step.kind in COLLECTIVE_KINDS]
    if len(collectives) != 1 or steps[collectives[0]].kind not in COALESCIBLE_KINDS:
        return None
    return collectives[0]


def coalesce(program: RankProgram, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> RankProgram:
    """``program`` with its single-collective reshards run in buckets (see the module docstring).

    ``bucket_cap_bytes`` <= 0 returns the program unchanged. A bucket of one stays a plain Reshard.
    """
    if bucket_cap_bytes <= 0:
        return program
    return replace(program, instructions=tuple(_bucketed(program, bucket_cap_bytes)))


def split_stages(reshard: Reshard) -> tuple[Reshard, ...]:
    """``reshard`` as a chain of reshards with at most one collective each (itself if it has one or none).

    Local steps before the first collective go with it; local steps after a collective go with it.
    """
    cuts = [index for index, step in enumerate(reshard.steps) if step.kind in COLLECTIVE_KINDS]
    if len(cuts) <= 1:
        return (reshard,)
    starts = []
    for cut in cuts[1:]:  # a collective's pad step (uneven pieces) goes with it, so stages hold unpadded values
        while cut > 0 and reshard.steps[cut - 1].kind == "pad":
            cut -= 1
        starts.append(cut)
    bounds = [0] + starts + [len(reshard.steps)]
    stages, source, sharding = [], reshard.source, tuple(reshard.source_sharding)
    for number, (start, end) in enumerate(zip(bounds, bounds[1:])):
        steps = reshard.steps[start:end]
        last = number == len(cuts) - 1
        after = tuple(reshard.target_sharding) if last else _after(sharding, steps)
        target = reshard.target if last else f"{reshard.target}.{number}"
        stages.append(Reshard(source, target, reshard.spec, sharding, after, steps))
        source, sharding = target, after
    return tuple(stages)


def _after(sharding: tuple, steps: Iterable[ReshardStep]) -> tuple:
    """The sharding after ``steps`` (each sets the placement of its axis, as :mod:`.reshard` builds them)."""
    current = list(sharding)
    for step in steps:
        if step.kind in ("all_gather", "all_reduce"):
            current[step.axis] = Replicate()
        elif step.kind in ("reduce_scatter", "local_slice"):
            current[step.axis] = Shard(step.dim)
        elif step.kind == "all_to_all":
            current[step.axis] = Shard(step.split_dim)
        elif step.kind == "zero_partial":
            current[step.axis] = Partial("sum")
        elif step.kind in PAD_KINDS:
            continue  # padding for a collective on uneven pieces: the sharding is unchanged
        else:
            raise ValueError(f"unknown resharding step kind {step.kind!r}")
    return tuple(current)


def share_collectives(instructions: Iterable[Instruction]) -> list[Instruction]:
    """``instructions`` (reshards split into stages) with each identical collective on one source run once.

    A stage is a reshard with exactly one collective; two stages are the same collective when they
    read the same value (through aliases made here) with the same steps up to and including the
    collective. The first of them runs it (into ``<target>.c`` when local steps follow, which then
    run on their own); each later one becomes a local reshard from that result: its own steps
    after the collective, or none (an alias, so that the next stages of both chains can be shared).
    """
    alias: dict[str, str] = {}
    first: dict[tuple, int] = {}  # key -> slot of its first stage
    holder: dict[tuple, str] = {}  # key -> the value that holds the collective's result, once shared
    slots: list[list[Instruction]] = []
    for item in instructions:
        key = _shared_key(item, alias)
        if key is None:
            slots.append([item])
            continue
        if key not in first:
            first[key] = len(slots)
            slots.append([item])
            continue
        position = len(key[1]) - 1
        if key not in holder:  # the first duplicate: split the first stage after its collective if need be
            original = slots[first[key]][0]
            if original.steps[position + 1:]:
                holder[key] = f"{original.target}.c"
                slots[first[key]] = _split_after(original, position, holder[key])
            else:
                holder[key] = original.target
        middle = _after(item.source_sharding, item.steps[:position + 1])
        rest = item.steps[position + 1:]
        slots.append([Reshard(holder[key], item.target, item.spec, middle, item.target_sharding, rest)])
        if not rest:
            alias[item.target] = holder[key]
    return [instruction for slot in slots for instruction in slot]


def _split_after(reshard: Reshard, position: int, middle_name: str) -> list[Reshard]:
    """``reshard`` as its steps up to ``position`` (into ``middle_name``) and a local reshard of the rest."""
    middle = _after(reshard.source_sharding, reshard.steps[:position + 1])
    return [Reshard(reshard.source, middle_name, reshard.spec, reshard.source_sharding, middle, reshard.steps[:position + 1]),
            Reshard(middle_name, reshard.target, reshard.spec, middle, reshard.target_sharding, reshard.steps[position + 1:])]


def _shared_key(item: Instruction, alias: dict[str, str]) -> tuple | None:
    """(source, steps up to and including the collective) of a reshard with exactly one collective; else None."""
    if not isinstance(item, Reshard):
        return None
    positions = [index for index, step in enumerate(item.steps) if step.kind in COLLECTIVE_KINDS]
    if len(positions) != 1:
        return None
    return (alias.get(item.source, item.source), item.steps[:positions[0] + 1])


def _bucketed(program: RankProgram, cap: int) -> Iterator[Instruction]:
    instructions = share_collectives(stage for item in program.instructions
                                     for stage in (split_stages(item) if isinstance(item, Reshard) else (item,)))
    members: dict[int, BucketMember] = {}
    by_key: dict[tuple, list[int]] = {}
    for index, item in enumerate(instructions):
        if isinstance(item, Reshard):
            member = _as_member(item)
            if member is not None:
                members[index] = member
                by_key.setdefault(_key(member), []).append(index)
    order = {index: position for same_key in by_key.values() for position, index in enumerate(same_key)}
    defined = {program_input.name for program_input in program.inputs}
    done: set[int] = set()
    for index, item in enumerate(instructions):
        if index in done:
            continue
        if index not in members:
            yield item
            defined.update(_defines(item))
            continue
        later = by_key[_key(members[index])][order[index] + 1:]
        bucket = _fill(index, later, members, defined, done, cap)
        done.update(bucket)
        defined.update(members[i].target for i in bucket)
        if len(bucket) == 1:
            yield item
            continue
        first = members[bucket[0]]
        yield CoalescedReshard(first.collective.kind, first.collective.axis, first.collective.op, first.spec.dtype,
                               tuple(members[i] for i in bucket))


def _fill(index: int, same_key_later: list[int], members: dict[int, BucketMember], defined: set[str], done: set[int],
          cap: int) -> list[int]:
    """The bucket opened at ``index``: it, then later same-key candidates whose sources are defined, up to ``cap``."""
    member = members[index]
    bucket, total = [index], buffer_bytes(member.collective, member.spec.itemsize)
    for later in same_key_later:
        if later in done or members[later].source not in defined:
            continue
        size = buffer_bytes(members[later].collective, members[later].spec.itemsize)
        if total + size > cap:
            break
        bucket.append(later)
        total += size
    return bucket


def _as_member(reshard: Reshard) -> BucketMember | None:
    position = coalescible_step(reshard.steps)
    if position is None:
        return None
    return BucketMember(reshard.source, reshard.target, reshard.spec, reshard.source_sharding, reshard.target_sharding,
                        reshard.steps[:position], reshard.steps[position], reshard.steps[position + 1:])


def _key(member: BucketMember) -> tuple:
    step = member.collective
    return (step.kind, step.axis, step.op, member.spec.dtype)


def _defines(item: Instruction) -> tuple[str, ...]:
    if isinstance(item, LocalOp):
        return tuple(name for name in item.outputs if name is not None)
    if isinstance(item, CoalescedReshard):
        return tuple(member.target for member in item.members)
    return (item.target,)
