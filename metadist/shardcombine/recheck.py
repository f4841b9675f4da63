"""Re-execution of a rule: every factor and partial pass re-run on real shards of fresh shapes.

DTensor cannot execute our placements in one process, so :func:`check_rule_by_execution`
re-runs each factor and partial pass of a rule here, with fresh shapes, seeded data and a
shard count of its own, recombines the pieces with this module's own code and compares
with the whole result (stated tolerances, largest difference reported).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from ..ir import Concat, Factor, Identity, PartialPass, Reduce, Rule
from .discover import UNINITIALIZED_OPS
from .executor import ExecutionRefused, OpCall, OpExecutor, kept_dims
from .oracle_report import ExecutionCheck, factor_strategy
from .shapes import standin_shapes_keeping
from .signature import op_name

__all__ = ["FRESH_SIZES", "RECHECK_RTOL", "TINY_SCALE", "check_rule_by_execution"]


#: Fresh sizes for the re-check, ascending: multiples of 4 (discovery's stand-ins are multiples of 6).
FRESH_SIZES = (8, 16, 20, 28, 32, 40, 44, 52, 56, 64)
TINY_SCALE = 1e-6
"""The second re-check draw multiplies floating inputs by this (see :func:`check_rule_by_execution`)."""
RECHECK_RTOL = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
"""Relative tolerance of the re-check per output dtype, times the largest magnitude among the whole output and
the terms recombined (other dtypes: exact)."""


def check_rule_by_execution(call: OpCall, rule: Rule, executor: OpExecutor, *, seed: int = 20261130) -> tuple[ExecutionCheck, ...]:
    """Re-run every factor and partial pass of ``rule`` on fresh shapes, data and shard counts, and recombine.

    Shapes: every distinct size > 1 maps to :data:`FRESH_SIZES` (order and equalities kept); where
    the executor cannot express the op on them (some reshapes), the node's own shapes. Shards: 4 even
    pieces where the size allows (else 2 or 3). Data: one draw at the executor's magnitudes and one
    scaled by :data:`TINY_SCALE`, so that an additive constant below float32's resolution at
    magnitude 1 (``x + 1e-8``) cannot hide in the tolerance. Recombination and tolerances are this
    module's own. A label fails if it fails on either draw.
    """
    labels = _labels(rule)
    if call.node.op.is_random or op_name(call.target) in UNINITIALIZED_OPS:
        return tuple(ExecutionCheck(label, 0, None, 0.0, "random or uninitialized output: values not comparable") for label in labels)
    results: dict[str, ExecutionCheck] = {}
    for scale in (1.0, TINY_SCALE):
        rng = np.random.default_rng(seed)
        try:
            inputs, whole = _fresh_draw(call, executor, rng, scale)
        except Exception as err:  # the op rejects fresh inputs on both shape choices: report, do not guess
            detail = f"op does not run on fresh inputs (scale {scale:g}): {type(err).__name__}: {str(err).splitlines()[0][:100]}"
            checks = [ExecutionCheck(label, 0, None, 0.0, detail) for label in labels]
        else:
            checks = [_check_factor(call, executor, factor, inputs, whole) for factor in rule.factors]
            if any(factor.halo for factor in rule.factors):
                checks = _with_halo_checks(call, executor, rule, checks, seed, scale)
            checks += [_check_pass(call, executor, rule, partial, inputs, whole, rng) for partial in rule.partial_passes]
        for check in checks:
            if scale != 1.0 and check.detail:
                check = replace(check, detail=f"{check.detail} (inputs scaled by {scale:g})")
            earlier = results.get(check.what)
            if earlier is None or (earlier.ok is None and check.ok is not None) or (earlier.ok and check.ok is False):
                results[check.what] = check
    return tuple(results[label] for label in labels)


def _with_halo_checks(call: OpCall, executor: OpExecutor, rule: Rule, checks: list, seed: int, scale: float) -> list:
    """Halo factors re-checked on the node's own shapes (their width depends on them), fresh data."""
    rng = np.random.default_rng([seed, 1])
    inputs = [x * x.dtype.type(scale) if x.dtype.kind == "f" else x for x in executor.example_inputs(call, rng, call.input_shapes)]
    whole = executor.run(call, inputs)
    return [_check_halo_factor(call, executor, factor, inputs, whole) if factor.halo else check
            for factor, check in zip(rule.factors, checks)] + checks[len(rule.factors):]


def _check_halo_factor(call: OpCall, executor: OpExecutor, factor: Factor, inputs: Sequence[np.ndarray], whole: Sequence[np.ndarray | None]) -> ExecutionCheck:
    """A halo factor on even shards: windows of the zero-padded whole input, outputs trimmed and joined.

    This module's own reading of the halo contract (:mod:`metadist.ir.rule`): piece ``r`` of the input
    is ``padded[r * p : (r + 1) * p + 2h]`` of the input padded with ``h`` zeros at both ends; each
    output piece drops ``h * m / n`` elements at both ends.
    """
    label, halo = str(factor_strategy(factor)[0]), factor.halo
    size = factor.size(tuple(x.shape for x in inputs))
    outs = [(index, combine, expected) for index, (combine, expected) in enumerate(zip(factor.outputs, whole)) if combine is not None]
    shards = next((k for k in (4, 3, 2) if size % k == 0 and size // k >= halo
                   and all(expected.shape[c.dim] % k == 0 and (halo * expected.shape[c.dim]) % size == 0 for _, c, expected in outs)), None)
    if shards is None:
        return ExecutionCheck(label, 0, None, 0.0, f"halo factor of size {size}: no even split into 2, 3 or 4 pieces of at least {halo}")
    step = size // shards
    padded = [None if dim is None else np.pad(x, [(halo, halo) if d == dim else (0, 0) for d in range(x.ndim)])
              for x, dim in zip(inputs, factor.inputs)]
    pieces = []
    for shard in range(shards):
        local = [x if dim is None else np.moveaxis(np.moveaxis(p, dim, 0)[shard * step: (shard + 1) * step + 2 * halo], 0, dim)
                 for x, dim, p in zip(inputs, factor.inputs, padded)]
        try:
            pieces.append(executor.run(call, local))
        except Exception as err:  # the op rejects an extended shard although the rule says it runs there
            return ExecutionCheck(label, shards, False, math.inf, f"the op fails on a halo shard: {type(err).__name__}: {str(err)[:100]}")
    worst = 0.0
    for index, combine, expected in outs:
        trim = halo * expected.shape[combine.dim] // size
        kept = [np.moveaxis(np.moveaxis(piece[index], combine.dim, 0)[trim: piece[index].shape[combine.dim] - trim], 0, combine.dim)
                for piece in pieces]
        if any(k.shape[combine.dim] * shards != expected.shape[combine.dim] for k in kept):
            return ExecutionCheck(label, shards, False, math.inf, f"output {index}: trimmed halo pieces have the wrong size")
        dtype = call.node.outputs[index].spec.dtype  # type: ignore[union-attr]
        ok, error, detail = _recombines(Concat(combine.dim), kept, expected, dtype, _input_rtol(inputs))
        worst = max(worst, error)
        if not ok:
            return ExecutionCheck(label, shards, False, error, f"output {index} (halo {halo}): {detail}")
    return ExecutionCheck(label, shards, True, worst)


def _labels(rule: Rule) -> list[str]:
    return [str(factor_strategy(factor)[0]) for factor in rule.factors] + [
        f"pass {partial}" for partial in rule.partial_passes
    ]


def _fresh_shapes(shapes: Sequence[tuple[int, ...]], kept: Sequence[Sequence[int]] = ()) -> tuple[tuple[int, ...], ...] | None:
    if any(kept):  # dims whose real sizes the op's arguments refer to keep them (RoPE's slices of the head dim)
        try:
            return standin_shapes_keeping(shapes, kept, FRESH_SIZES)
        except ValueError:
            return None
    distinct = sorted({size for shape in shapes for size in shape if size > 1})
    if len(distinct) > len(FRESH_SIZES):
        return None
    mapping = dict(zip(distinct, FRESH_SIZES)) | {0: 0, 1: 1}
    return tuple(tuple(mapping[size] for size in shape) for shape in shapes)


def _fresh_draw(call: OpCall, executor: OpExecutor, rng: np.random.Generator, scale: float) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    errors = []
    for shapes in (_fresh_shapes(call.input_shapes, kept_dims(executor, call)), call.input_shapes):
        if shapes is None:
            continue
        try:
            inputs = [x * x.dtype.type(scale) if x.dtype.kind == "f" else x for x in executor.example_inputs(call, rng, shapes)]
            whole = executor.run(call, inputs)
            if not all(out is None or out.dtype.kind not in "fc" or np.isfinite(out).all() for out in whole):
                inputs = [np.abs(x) if x.dtype.kind == "f" else x for x in inputs]  # sqrt, log, pow...
                whole = executor.run(call, inputs)
            return inputs, whole
        except Exception as err:  # e.g. ExecutionRefused for a reshape on fresh shapes: try the real ones
            errors.append(err)
    raise errors[-1]


def _shard_count(size: int) -> int | None:
    return next((count for count in (4, 2, 3) if count <= size and size % count == 0), None)


def _check_factor(call: OpCall, executor: OpExecutor, factor: Factor, inputs: Sequence[np.ndarray], whole: Sequence[np.ndarray | None]) -> ExecutionCheck:
    strategy, plain = factor_strategy(factor)
    label = str(strategy)
    if not plain:
        return ExecutionCheck(label, 0, None, 0.0, "block-cyclic/halo factor: not re-checked")
    size = factor.size(tuple(x.shape for x in inputs))
    shards = _shard_count(size)
    if shards is None:
        return ExecutionCheck(label, 0, None, 0.0, f"factor size {size} splits into no 2, 3 or 4 even pieces")
    if any(inputs[index].dtype.kind != "f" for index in factor.partial_inputs):
        return ExecutionCheck(label, shards, None, 0.0, "an affine factor with a non-floating Partial input: not re-checked")
    worst = 0.0
    # An affine factor's Partial(sum) inputs are cut as the lowering cuts them (the value on shard 0,
    # zeros elsewhere) and into random terms as large as the value (as a Partial producer would).
    for cut in ("first shard", "random terms") if factor.partial_inputs else ("",):
        terms = {index: _sum_terms(inputs[index], shards, cut, np.random.default_rng([index, shards])) for index in factor.partial_inputs}
        pieces = []
        for shard in range(shards):
            local = [
                terms[index][shard] if index in terms else x if dim is None else np.array_split(x, shards, axis=dim)[shard]
                for index, (x, dim) in enumerate(zip(inputs, factor.inputs))
            ]
            try:
                pieces.append(executor.run(call, local))
            except ExecutionRefused as err:
                return ExecutionCheck(label, shards, None, 0.0, f"the executor cannot express the op on a shard: {err}")
            except Exception as err:  # the op rejects a shard although the rule says it runs there
                return ExecutionCheck(label, shards, False, math.inf, f"the op fails on a shard: {type(err).__name__}: {str(err)[:100]}")
        for index, (combine, expected) in enumerate(zip(factor.outputs, whole)):
            if combine is None or expected is None:
                continue
            dtype = call.node.outputs[index].spec.dtype  # type: ignore[union-attr]
            ok, error, detail = _recombines(combine, [piece[index] for piece in pieces], expected, dtype, _input_rtol(inputs))
            worst = max(worst, error)
            if not ok:
                where = f" (Partial inputs as {cut})" if cut else ""
                return ExecutionCheck(label, shards, False, error, f"output {index}{where}: {detail}")
    return ExecutionCheck(label, shards, True, worst)


def _sum_terms(value: np.ndarray, shards: int, cut: str, rng: np.random.Generator) -> list[np.ndarray]:
    """``shards`` terms adding up to ``value``: the value then zeros, or random terms as large as the value."""
    if cut == "first shard":
        return [value] + [np.zeros_like(value) for _ in range(shards - 1)]
    magnitude = np.abs(value) + 0.1 * float(np.max(np.abs(value), initial=0.0))
    terms = [(rng.standard_normal(value.shape) * magnitude).astype(value.dtype) for _ in range(shards - 1)]
    return terms + [(value - sum(terms)).astype(value.dtype)]


def _input_rtol(inputs: Sequence[np.ndarray]) -> float:
    """The loosest re-check tolerance among the floating inputs (0 if none)."""
    return max([RECHECK_RTOL.get(str(x.dtype), 0.0) for x in inputs], default=0.0)


def _recombines(combine: Any, pieces: list[np.ndarray | None], expected: np.ndarray, dtype: str, input_rtol: float) -> tuple[bool, float, str]:
    """Recombine per-shard outputs and compare with the whole output: (ok, largest difference, why not)."""
    if any(piece is None for piece in pieces):
        return False, math.inf, "a shard produced no output"
    arrays = [np.asarray(piece) for piece in pieces]
    if isinstance(combine, Concat):
        try:
            got = np.concatenate(arrays, axis=combine.dim)
        except ValueError as err:
            return False, math.inf, f"pieces do not concatenate along dim {combine.dim}: {err}"
        return _compare(got, expected, dtype, arrays, input_rtol)
    if any(array.shape != expected.shape for array in arrays):
        return False, math.inf, f"piece shapes {[a.shape for a in arrays]} differ from the whole {expected.shape}"
    if isinstance(combine, Identity):
        results = [_compare(array, expected, dtype, arrays, input_rtol) for array in arrays]
        worst = max(result[1] for result in results)
        return all(result[0] for result in results), worst, "a shard's output differs from the whole"
    stacked = np.stack([array.astype(np.float64) if array.dtype.kind == "f" else array for array in arrays])
    got = stacked.sum(axis=0) if combine.op == "sum" else stacked.max(axis=0) if combine.op == "max" else stacked.min(axis=0)
    return _compare(got, expected, dtype, arrays, input_rtol)


def _compare(got: np.ndarray, expected: np.ndarray, dtype: str, terms: Sequence[np.ndarray], input_rtol: float) -> tuple[bool, float, str]:
    if got.shape != expected.shape:
        return False, math.inf, f"recombined shape {got.shape} differs from the whole {expected.shape}"
    rtol = RECHECK_RTOL.get(dtype)
    if rtol is not None:  # a float64 output of float32 inputs is only as precise as float32
        rtol = max(rtol, input_rtol)
    if rtol is None:
        equal = bool(np.array_equal(got.astype(expected.dtype), expected))
        return equal, 0.0 if equal else math.inf, "differs from the whole result (exact dtype)"
    got64, expected64 = got.astype(np.float64), expected.astype(np.float64)
    if not (np.isfinite(got64).all() and np.isfinite(expected64).all()):
        same = bool(np.array_equal(got64, expected64, equal_nan=True))
        return same, 0.0 if same else math.inf, "non-finite values differ"
    error = float(np.max(np.abs(got64 - expected64), initial=0.0))
    scale = max([float(np.max(np.abs(expected64), initial=0.0))] + [float(np.max(np.abs(t), initial=0.0)) for t in terms])
    return error <= rtol * scale, error, f"differs from the whole result by {error:.3g} (tolerance {rtol * scale:.3g})"


def _pass_terms(value: np.ndarray, op: str, shards: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``shards`` terms of ``value`` that reduce to it with ``op``."""
    if op == "sum":
        magnitude = np.abs(value) + 0.1 * float(np.max(np.abs(value), initial=0.0))  # terms as large as the value
        terms = [(rng.standard_normal(value.shape) * magnitude).astype(value.dtype) for _ in range(shards - 1)]
        return terms + [value - sum(terms)]
    # each term at most (least) the value, one term holding it, element by element
    owner = rng.integers(0, shards, value.shape)
    sign = -1.0 if op == "max" else 1.0
    step = max(float(np.max(np.abs(value), initial=0.0)), float(np.finfo(value.dtype).tiny))
    return [np.where(owner == k, value, value + sign * step * rng.uniform(0.1, 1.0, value.shape)).astype(value.dtype) for k in range(shards)]


def _check_pass(call: OpCall, executor: OpExecutor, rule: Rule, partial: PartialPass, inputs: Sequence[np.ndarray], whole: Sequence[np.ndarray | None], rng: np.random.Generator) -> ExecutionCheck:
    """Split one input (each input of a joint pass) into partial terms (adding up, or elementwise max/min), run the op
    on each shard's terms, reduce the outputs."""
    label = f"pass {partial}"
    if any(inputs[index].dtype.kind != "f" for index in partial.inputs):
        return ExecutionCheck(label, 0, None, 0.0, "non-floating input: not re-checked")
    shards = 4
    terms_of = {index: _pass_terms(inputs[index], partial.op, shards, rng) for index in partial.inputs}
    try:
        pieces = [executor.run(call, [terms_of[index][k] if index in terms_of else x for index, x in enumerate(inputs)])
                  for k in range(shards)]
    except Exception as err:  # the op rejects a term (a domain error): the pass claims it runs
        return ExecutionCheck(label, shards, False, math.inf, f"the op fails on a partial term: {type(err).__name__}: {str(err)[:100]}")
    worst = 0.0
    for index, expected in enumerate(whole):
        if rule.output_ranks[index] is None or expected is None:
            continue
        dtype = call.node.outputs[index].spec.dtype  # type: ignore[union-attr]
        ok, error, detail = _recombines(Reduce(partial.op), [piece[index] for piece in pieces], expected, dtype, _input_rtol(inputs))
        worst = max(worst, error)
        if not ok:
            return ExecutionCheck(label, shards, False, error, f"output {index}: {detail}")
    return ExecutionCheck(label, shards, True, worst)
