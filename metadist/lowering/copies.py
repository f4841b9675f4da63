"""The copies a rank's runtime makes around its reshards, beside what the collectives themselves move (issue #16, part 2).

The calibration times each collective alone on a buffer that is already laid out for it
(:mod:`metadist.cost.calibrate_worker`); the runtime (:mod:`metadist.runtime.collectives`) also copies, on the calling
rank, before and after the call:

- an all-reduce clones its input (it is functional: the input stays as it was);
- an all-gather along a dim other than 0 concatenates the gathered pieces along that dim; a reduce-scatter along a dim
  other than 0 lays its pieces out row by row first; an all-to-all stacks its pieces unless it splits dim 0, and
  concatenates what it received unless it gathers dim 0;
- a coalesced call (:mod:`.coalesce`) of several members packs them into one flat buffer (``pack_flat``,
  ``pack_for_reduce_scatter``), and a coalesced all-gather copies each member out of the gathered rows
  (``unpack_all_gather``: a member's pieces are not contiguous in them); the unpacked members of an all-reduce and
  a reduce-scatter are views;
- a local slice, a halo's trim, a pad and an unpad write their output anew (a pad its zeros, then the piece); a halo
  exchange packs the border slices it sends and joins them to the piece; a ``zero_partial`` writes zeros on every
  rank but coordinate 0.

On this project's 2-core machine mixtral-mini's bfloat16 plan on 2x2 gathers 20 MB of parameters a step in two
coalesced calls: packing and unpacking them took 11 ms of a rank's 46 ms step alone, priced nothing before
(``python -m metadist.bench.rank_compute mixtral-mini --layouts plan --precision bf16``, profiled by op).

:func:`program_copies` lists each such copy of a :class:`~.program.RankProgram` as ``(dtype, elements)``, read on the
rank with the largest pieces (as the program's buffers are), for the cost model to price
(:func:`metadist.cost.comm.program_comm`).
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

from .program import CoalescedReshard, RankProgram, Reshard
from .reshard import ReshardStep

__all__ = ["step_copies", "coalesced_copies", "program_copies"]


def step_copies(step: ReshardStep) -> list[int]:
    """The elements of each copy the runtime makes to run ``step`` on its own (not in a coalesced call), beside the
    collective's own transfer: empty where the step is a view or moves nothing locally."""
    n_in, n_out = math.prod(step.bound_in), math.prod(step.bound_out)
    kind = step.kind
    if kind == "all_reduce":
        return [n_in]
    if kind == "all_gather":
        return [n_out] if step.dim != 0 else []
    if kind == "reduce_scatter":
        return [n_in] if step.dim != 0 else []
    if kind == "all_to_all":
        return ([n_in] if step.split_dim != 0 else []) + ([n_out] if step.dim != 0 else [])
    if kind in ("local_slice", "halo_trim"):
        return [n_out]
    if kind == "unpad":  # the leading elements, copied unless they are a contiguous view
        return [] if _leading_block_is_contiguous(step.bound_in, step.bound_out) else [n_out]
    if kind == "pad":  # zeros of the padded shape, then the piece copied into them (on the ranks whose piece is short:
        return [n_out, n_in]  # the step is there because some rank's is; the largest piece bounds what it copies)
    if kind == "halo_exchange":  # the 2h border slices sent, the zeros at an end, the extended tensor (laid out again
        width = step.bound_in[step.dim]  # when dim is not the first)
        halo = (step.bound_out[step.dim] - width) // 2
        row = n_in // width if width else 0
        return [2 * halo * row, halo * row, n_out] + ([n_out] if step.dim != 0 else [])
    if kind == "zero_partial":
        return [n_out] if step.coordinate != 0 else []
    raise ValueError(f"unknown resharding step kind {kind!r}")


def coalesced_copies(item: CoalescedReshard) -> list[int]:
    """The elements of each copy the runtime makes to run a coalesced call: its members' local steps before and after
    it, packing the members into one buffer, the all-reduce's clone of that buffer and a coalesced all-gather's
    unpacking (one copy per member)."""
    copies = [elements for member in item.members for step in member.pre for elements in step_copies(step)]
    collectives = [member.collective for member in item.members]
    if len(item.members) == 1:  # packed and unpacked as views: the collective's own copies
        copies += step_copies(collectives[0])
    else:
        packed = sum(math.prod(step.bound_in) for step in collectives)
        if item.kind == "reduce_scatter":  # each member's rows laid out (unless scattered on dim 0), then joined
            copies += [math.prod(step.bound_in) for step in collectives if step.dim != 0]
        copies.append(packed)  # pack_flat / pack_for_reduce_scatter: torch.cat of the members
        if item.kind == "all_reduce":
            copies.append(packed)  # the functional all-reduce clones the packed buffer
        elif item.kind == "all_gather":
            copies += [math.prod(step.bound_out) for step in collectives]  # each member out of the gathered rows
    return copies + [elements for member in item.members for step in member.post for elements in step_copies(step)]


def _leading_block_is_contiguous(shape: Sequence[int], kept: Sequence[int]) -> bool:
    """Whether the leading ``kept`` elements of every dim of a row-major ``shape`` are one contiguous block: every dim
    after the first one cut is whole, and every dim before it holds one element."""
    cut = [dim for dim, (have, want) in enumerate(zip(shape, kept)) if want < have]
    if not cut:
        return True
    first = cut[0]
    return all(kept[dim] == shape[dim] for dim in range(first + 1, len(shape))) and all(
        kept[dim] == 1 for dim in range(first))


def program_copies(program: RankProgram) -> Iterator[tuple[str, int]]:
    """``(dtype, elements)`` of each copy ``program``'s runtime makes around its reshards, in program order."""
    for item in program.instructions:
        if isinstance(item, CoalescedReshard):
            for elements in coalesced_copies(item):
                yield item.dtype, elements
        elif isinstance(item, Reshard):
            for step in item.steps:
                for elements in step_copies(step):
                    yield item.spec.dtype, elements
