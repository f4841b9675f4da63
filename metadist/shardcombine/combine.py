"""Recombination of per-shard outputs into the whole output, with dtype-aware tolerances.

A candidate factor passes only if, for every output, the pieces computed on the
shards recombine into the output computed on the whole inputs: concatenated along
a dim (:class:`Concat`), reduced with sum/max/min (:class:`Reduce`), or each equal
to the whole (:class:`Identity`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..ir.rule import Combine, Concat, Identity, Reduce

__all__ = ["Tolerance", "tolerance_for", "close", "recombine", "infer_combine", "check_combine"]


@dataclass(frozen=True)
class Tolerance:
    """Elementwise ``|got - want| <= rtol * (scale + |want|)``; ``scale`` is the data's magnitude (see :func:`close`).

    ``exact`` dtypes (integers, bools) must match bit for bit.
    """

    rtol: float
    exact: bool = False


_TOLERANCES = {
    "float64": Tolerance(1e-10),
    "float32": Tolerance(2e-5),
    "float16": Tolerance(4e-3),
    "bfloat16": Tolerance(3e-2),
    "float8_e4m3fn": Tolerance(2e-1),
    "float8_e5m2": Tolerance(3e-1),
    "complex64": Tolerance(2e-5),
    "complex128": Tolerance(1e-10),
}


def tolerance_for(dtype: str) -> Tolerance:
    """Tolerance of one MetaIR dtype: tight for float64, looser for half precision, exact for ints/bools."""
    return _TOLERANCES.get(dtype, Tolerance(0.0, exact=True))


def coarser_dtype(output_dtype: str, input_dtype: str) -> str:
    """The dtype a partial pass is judged in: the output's, or the partial input's where that is coarser.

    The parts of a ``bfloat16`` input add up to the whole only within ``bfloat16`` rounding, so an op that
    widens them (the ``float32`` cast a mixed-precision gradient goes through before its reduction) cannot
    reproduce the whole more closely than that: its pass is held to ``bfloat16``'s tolerance.
    """
    if tolerance_for(input_dtype).exact:
        return output_dtype
    return max((output_dtype, input_dtype), key=lambda dtype: tolerance_for(dtype).rtol)


def close(got: np.ndarray, want: np.ndarray, dtype: str, scale: float | None = None) -> bool:
    """Whether ``got`` matches ``want`` (same shape; NaN never matches).

    ``scale`` is the magnitude the error is measured against (default: the
    largest ``|want|``, at least 1), so sums of large partial terms are judged fairly.
    """
    if got.shape != want.shape:
        return False
    tol = tolerance_for(dtype)
    if tol.exact:
        return bool(np.array_equal(got, want))
    if not (np.all(np.isfinite(got)) and np.all(np.isfinite(want))):
        return False
    if scale is None:
        scale = float(np.max(np.abs(want), initial=1.0))
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return bool(np.all(diff <= tol.rtol * (scale + np.abs(want))))


def recombine(pieces: Sequence[np.ndarray], combine: Combine) -> np.ndarray:
    """Recombine per-shard pieces with one combination (Concat, Reduce or Identity)."""
    if isinstance(combine, Concat):
        if combine.chunk != 1 or combine.halo != 0:
            raise NotImplementedError("chunk/halo pieces do not concatenate as they are: halo pieces are trimmed first (.halo)")
        return np.concatenate(pieces, axis=combine.dim)
    if isinstance(combine, Reduce):
        stacked = np.stack(pieces)
        if combine.op == "sum":
            return stacked.sum(axis=0, dtype=stacked.dtype)
        return stacked.max(axis=0) if combine.op == "max" else stacked.min(axis=0)
    return pieces[0]


def check_combine(pieces: Sequence[np.ndarray], whole: np.ndarray, combine: Combine, dtype: str) -> bool:
    """Whether ``pieces`` recombine into ``whole`` with ``combine``."""
    if isinstance(combine, Identity):
        return all(close(piece, whole, dtype) for piece in pieces)
    if isinstance(combine, Concat):
        others = [s for d, s in enumerate(whole.shape) if d != combine.dim]
        if any(p.ndim != whole.ndim or [s for d, s in enumerate(p.shape) if d != combine.dim] != others for p in pieces):
            return False
        if sum(p.shape[combine.dim] for p in pieces) != whole.shape[combine.dim]:
            return False
        return close(recombine(pieces, combine), whole, dtype)
    if any(p.shape != whole.shape for p in pieces):
        return False
    scale = max(float(np.max(np.abs(p), initial=1.0)) for p in pieces) if combine.op == "sum" else None
    return close(recombine(pieces, combine), whole, dtype, scale=scale)


def _candidates(pieces: Sequence[np.ndarray], whole: np.ndarray) -> list[Combine]:
    if all(p.shape == whole.shape for p in pieces):
        return [Identity(), Reduce("sum"), Reduce("max"), Reduce("min")]
    return [Concat(dim) for dim in range(whole.ndim)]


def infer_combine(pieces: Sequence[np.ndarray | None], whole: np.ndarray | None, dtype: str) -> Combine | None | bool:
    """The combination that turns ``pieces`` into ``whole``, None for an absent output, False if none does.

    Identity is preferred over max/min (equal pieces satisfy all three) and
    reported only when every piece equals the whole.
    """
    if whole is None:
        return None if all(p is None for p in pieces) else False
    if any(p is None for p in pieces):
        return False
    for combine in _candidates(pieces, whole):  # type: ignore[arg-type]
        if check_combine(pieces, whole, combine, dtype):  # type: ignore[arg-type]
            return combine
    return False
