"""Halo factors: splitting windowed ops (convolution, pooling, padding) along a spatial dim.

A halo factor ``Concat(dim, halo=h)`` (meaning: :mod:`metadist.ir.rule`) extends every split
input piece by ``h`` elements on each side, taken from the neighbouring pieces and zero beyond
the global borders, runs the op unchanged, and trims ``t = h * m / n`` output elements at each
end of each piece before concatenating. :func:`halo_factor` finds the smallest such ``h`` by
execution, for a candidate split that did not recombine as a plain ``Concat``:

- widths ``1..MAX_HALO`` are tried in order; a width is accepted only if, for every seeded draw,
  every shard count and both uneven (1:2:3...) and even pieces, every output's trimmed pieces
  concatenate into the whole output (dtype tolerances of :mod:`.combine`);
- pieces are cut in units ``u`` (``1`` first) so that each maps to whole output elements (a
  stride-2 convolution needs even pieces); every piece is at least ``h`` long;
- only ops in :data:`~.signature.HALO_OPS` are searched, on their real shapes (their key holds
  concrete sizes, since the width depends on the kernel's size).

A too-small width fails on some piece's border rows, so the width found is the smallest that
holds on every draw; a larger one would also be correct and only cost more exchange.

**Block-cyclic factors (``chunk``) are not discovered.** In the built-in workloads the ops
whose split would be block-cyclic are reshapes that merge a sharded dim with a following dim
(``view [B, T, C] -> [B*T, C]`` split on ``T``; the attention-head merge ``[B, T, H, D] ->
[B, T, H*D]`` split on ``D``) and the fused-qkv ``split`` on a sharded hidden dim. Their
useful splits are already plain factors (the leading dim of a merge; the heads of a head
merge; ``split`` scales with its sizes), and a chunked output could only be consumed by an op
that splits the same way, which no built-in workload offers; so no chunk factor is searched.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np

from ..ir.rule import Concat, Factor, halo_trim
from .combine import close
from .executor import OpCall, OpExecutor
from .shapes import piece_sizes

__all__ = ["MAX_HALO", "extend_piece", "halo_factor", "halo_piece_bounds", "trim_piece"]

log = logging.getLogger(__name__)

#: Widest halo searched (elements on each side).
MAX_HALO = 4


def extend_piece(x: np.ndarray, dim: int, start: int, stop: int, halo: int) -> np.ndarray:
    """``x[start - halo : stop + halo]`` along ``dim``, zeros where that falls outside ``x``."""
    n = x.shape[dim]
    lo, hi = max(start - halo, 0), min(stop + halo, n)
    core = np.take(x, np.arange(lo, hi), axis=dim)
    pad = [(0, 0)] * x.ndim
    pad[dim] = (lo - (start - halo), (stop + halo) - hi)
    return np.pad(core, pad, mode="constant", constant_values=0)


def trim_piece(piece: np.ndarray, dim: int, trim: int) -> np.ndarray:
    """``piece`` without ``trim`` elements at each end of ``dim``."""
    return np.take(piece, np.arange(trim, piece.shape[dim] - trim), axis=dim)


def halo_piece_bounds(size: int, count: int, uneven: bool, unit: int, halo: int) -> list[int] | None:
    """Bounds ``[0, b_1, ..., size]`` of ``count`` pieces in multiples of ``unit``, each >= ``halo``; None if impossible."""
    if size % unit:
        return None
    sizes = piece_sizes(size // unit, count, uneven)
    if sizes is None or min(sizes) * unit < halo:
        return None
    return [0] + [int(b) for b in np.cumsum([s * unit for s in sizes])]


def _units(size: int, outputs: Sequence[np.ndarray | None]) -> list[int]:
    """Piece units to try: 1, then ``n / gcd(n, m)`` for every output dim size ``m`` (stride-s ops need multiples of s)."""
    units = {1} | {size // math.gcd(size, m) for out in outputs if out is not None for m in out.shape if m > 0}
    return sorted(u for u in units if u <= size // 2)


def halo_factor(call: OpCall, executor: OpExecutor, draws: Sequence, combo: tuple, shard_counts: Sequence[int]) -> Factor | None:
    """The smallest-width halo factor for the split ``combo``, or None (see the module docstring).

    ``draws`` hold ``inputs`` and ``whole`` (the op on the whole inputs), as discovery's draws do.
    """
    if not any(value is not None for value in call.node.outputs):
        return None
    size = next(draws[0].inputs[i].shape[d] for i, d in enumerate(combo) if d is not None)
    dtypes = [None if value is None else value.spec.dtype for value in call.node.outputs]
    for unit in _units(size, draws[0].whole):
        for halo in range(1, MAX_HALO + 1):
            dims = _holds(call, executor, draws, combo, shard_counts, size, unit, halo, dtypes)
            if dims is not None:
                outputs = tuple(None if dim is None else Concat(dim, halo=halo) for dim in dims)
                return Factor(tuple(combo), outputs)
    return None


def _holds(call, executor, draws, combo, shard_counts, size, unit, halo, dtypes) -> list[int | None] | None:
    """The output concat dims if width ``halo`` recombines on every draw, count and piece layout; else None."""
    dims: list[int | None] | None = None
    for count in shard_counts:
        layouts = {tuple(b) for uneven in (True, False) if (b := halo_piece_bounds(size, count, uneven, unit, halo))}
        if not layouts:
            return None  # this shard count cannot be checked: the width is not established
        for bounds in sorted(layouts):
            for draw in draws:
                per_output = _run_extended(call, executor, draw.inputs, combo, list(bounds), halo)
                if per_output is None:
                    return None
                if dims is None:
                    dims = [_infer_dim(pieces, whole, list(bounds), halo, dtype)
                            for pieces, whole, dtype in zip(per_output, draw.whole, dtypes)]
                    if any(d is False for d in dims):
                        return None
                for pieces, whole, dim, dtype in zip(per_output, draw.whole, dims, dtypes):
                    if not _recombines(pieces, whole, dim, list(bounds), halo, dtype):
                        return None
    return dims


def _run_extended(call, executor, inputs, combo, bounds, halo):
    results = []
    try:
        for k in range(len(bounds) - 1):
            piece = [x if d is None else extend_piece(x, d, bounds[k], bounds[k + 1], halo) for x, d in zip(inputs, combo)]
            results.append(executor.run(call, piece))
    except Exception as err:  # the op rejects the extended pieces: no halo factor this way
        log.debug("%s halo %d split %s: %s", call.target, halo, combo, err)
        return None
    return [list(outputs) for outputs in zip(*results)]


def _infer_dim(pieces, whole, bounds, halo, dtype):
    """The output dim along which trimmed pieces concatenate to ``whole``; None for an absent output, False if none."""
    if whole is None:
        return None if all(p is None for p in pieces) else False
    for dim in range(whole.ndim):
        if _recombines(pieces, whole, dim, bounds, halo, dtype):
            return dim
    return False


def _recombines(pieces, whole, dim, bounds, halo, dtype) -> bool:
    if whole is None or dim is None:
        return whole is None and dim is None and all(p is None for p in pieces)
    if any(p is None or p.ndim != whole.ndim for p in pieces):
        return False
    n, m = bounds[-1], whole.shape[dim]
    trim = halo_trim(halo, n, m)
    if trim is None:
        return False
    trimmed = []
    for k, piece in enumerate(pieces):
        want, rest = divmod((bounds[k + 1] - bounds[k]) * m, n)
        if rest or piece.shape[dim] != want + 2 * trim:
            return False
        trimmed.append(trim_piece(piece, dim, trim))
    if any([s for d, s in enumerate(p.shape) if d != dim] != [s for d, s in enumerate(whole.shape) if d != dim] for p in trimmed):
        return False
    return close(np.concatenate(trimmed, axis=dim), whole, dtype)
