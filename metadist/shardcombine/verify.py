"""Check a rule against the op on given inputs: the test that every rule (discovered or derived) must pass.

:func:`check_factor` splits the inputs as a factor says, runs the op on the
pieces, recombines the outputs as the factor says and compares with the op on
the whole inputs (an affine factor's ``Partial(sum)`` inputs are cut into parts that
add up to them, both the lowering's way, value on shard 0 and zeros elsewhere, and
randomly); :func:`check_partial_pass` does the same for a
:class:`PartialPass`. Both return a :class:`Mismatch` (what went wrong, the
largest difference) or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..ir.rule import Concat, Factor, PartialPass, halo_trim
from .combine import check_combine, close, coarser_dtype, recombine
from .discover import affine_parts, split_value
from .halo import extend_piece, trim_piece
from .executor import OpCall, OpExecutor
from .shapes import piece_sizes

__all__ = ["Mismatch", "check_factor", "check_partial_pass", "split_inputs"]


@dataclass(frozen=True)
class Mismatch:
    """Why a rule did not hold on some inputs."""

    output: int
    """The output that did not recombine (-1: the op did not run)."""
    detail: str
    max_abs_diff: float = float("nan")

    def __str__(self) -> str:
        return f"output {self.output}: {self.detail} (largest difference {self.max_abs_diff:.3g})"


def split_inputs(
    inputs: Sequence[np.ndarray], factor: Factor, shards: int, uneven: bool = False, split: str = "zero", seed: int = 0
) -> list[list[np.ndarray]]:
    """The per-shard inputs of a factor: split where the factor sits, whole elsewhere.

    A proportional factor's dims are cut in proportion to their sizes (:meth:`Factor.size`).
    An affine factor's ``partial_inputs`` are cut into ``shards`` parts that add up to them,
    the ``split`` way (see :func:`.discover.affine_parts`: ``zero``, ``random``, ``alternating``).
    """
    rng = np.random.default_rng(seed)
    parts = {index: affine_parts(np.asarray(inputs[index]), shards, split, rng) for index in factor.partial_inputs}
    shapes = tuple(tuple(x.shape) for x in inputs)
    size = factor.size(shapes)
    ratios = [1 if d is None else shapes[index][d] // size for index, d in enumerate(factor.inputs)]
    sizes = piece_sizes(size, shards, uneven)
    if sizes is None:
        raise ValueError(f"cannot split a dim of size {size} into {shards} pieces")
    bounds = np.cumsum([0] + sizes)
    if factor.halo and min(sizes) < factor.halo:
        raise ValueError(f"pieces {sizes} are shorter than the halo {factor.halo}")
    return [
        [
            parts[index][k] if index in parts else x if d is None
            else extend_piece(x, d, int(bounds[k]), int(bounds[k + 1]), factor.halo) if factor.halo
            else np.take(x, np.arange(bounds[k] * ratio, bounds[k + 1] * ratio), axis=d)
            for index, (x, d, ratio) in enumerate(zip(inputs, factor.inputs, ratios))
        ]
        for k in range(shards)
    ]


def check_factor(
    call: OpCall, executor: OpExecutor, factor: Factor, inputs: Sequence[np.ndarray], shards: int, uneven: bool = False,
    seed: int = 0,
) -> Mismatch | None:
    """Whether ``factor`` holds on ``inputs`` split ``shards`` ways (an affine factor: for every way to cut its partial inputs)."""
    whole = executor.run(call, inputs)
    for split in ("zero", "random", "alternating") if factor.partial_inputs else ("zero",):
        mismatch = _check_split(call, executor, factor, inputs, whole, shards, uneven, split, seed)
        if mismatch is not None:
            return mismatch
    return None


def _check_split(call, executor, factor, inputs, whole, shards, uneven, split, seed) -> Mismatch | None:
    try:
        per_shard = [executor.run(call, piece) for piece in split_inputs(inputs, factor, shards, uneven, split, seed)]
    except Exception as err:  # the op does not run on the pieces: the rule fails here
        return Mismatch(-1, f"the op does not run on the pieces: {err}")
    for index, (want, combine) in enumerate(zip(whole, factor.outputs)):
        pieces = [outputs[index] for outputs in per_shard]
        if combine is None or want is None:
            if combine is not None or want is not None:
                return Mismatch(index, "the output exists on one side only")
            continue
        dtype = call.node.outputs[index].spec.dtype  # type: ignore[union-attr]
        if isinstance(combine, Concat) and combine.halo:
            trim = halo_trim(combine.halo, factor.size(tuple(tuple(np.shape(x)) for x in inputs)), want.shape[combine.dim])
            if trim is None or any(p is None or p.shape[combine.dim] < 2 * trim for p in pieces):
                return Mismatch(index, f"halo pieces cannot be trimmed by {combine.halo} * m / n")
            pieces = [trim_piece(p, combine.dim, trim) for p in pieces]
            combine = Concat(combine.dim)
        if not check_combine(pieces, want, combine, dtype):
            cut = f" (partial inputs {list(factor.partial_inputs)} cut the {split} way)" if factor.partial_inputs else ""
            return Mismatch(index, f"pieces do not recombine with {combine}{cut}", _max_diff(pieces, want, combine))
    return None


def check_partial_pass(
    call: OpCall, executor: OpExecutor, partial: PartialPass, inputs: Sequence[np.ndarray], shards: int, seed: int = 0
) -> Mismatch | None:
    """Whether a ``Partial(op)`` of one input (of each input of a joint pass), split into random parts, reduces to the
    whole output."""
    whole = executor.run(call, inputs)
    rng = np.random.default_rng(seed)
    parts = {index: split_value(np.asarray(inputs[index]), partial.op, shards, rng) for index in partial.inputs}
    results = []
    for shard in range(shards):
        trial = list(inputs)
        for index, pieces in parts.items():
            trial[index] = pieces[shard]
        results.append(executor.run(call, trial))
    for index, want in enumerate(whole):
        if want is None:
            continue
        stacked = np.stack([outputs[index] for outputs in results])
        reduce = {"sum": np.sum, "max": np.max, "min": np.min}[partial.op]
        got = reduce(stacked, axis=0)
        dtype = call.node.outputs[index].spec.dtype  # type: ignore[union-attr]
        for source in partial.inputs:
            dtype = coarser_dtype(dtype, call.input_specs[source].dtype)
        scale = float(np.max(np.abs(stacked), initial=1.0)) if partial.op == "sum" else None
        if not close(got, want, dtype, scale=scale):
            return Mismatch(index, f"Partial({partial.op}) parts do not reduce to the whole", float(np.max(np.abs(got - want))))
    return None


def _max_diff(pieces, want, combine) -> float:
    try:
        got = recombine(pieces, combine)
        return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    except ValueError:
        return float("nan")
