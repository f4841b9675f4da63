"""ShardCombine: discover an op's SPMD rule by executing it on shards.

For one op call, :func:`discover`

1. picks shapes to run on: small stand-in shapes (:mod:`.shapes`) where the
   executor can express the op on them (dims whose real sizes the op's arguments
   refer to, :func:`.executor.kept_dims`, keep them), else the real shapes when they are small;
2. draws seeded inputs (several draws) and runs the op on the whole inputs; an op
   whose two runs on the same inputs differ, or whose outputs are not finite, has
   no rule (a reason says why);
3. enumerates candidate factors: for each size, every assignment of a dim of that
   size (or none: replicated) to each tensor input. Size-1 dims (broadcasting)
   never carry a factor;
4. for each candidate, splits the inputs into 2 and into 3 pieces (uneven where
   the op allows it), runs the op on each piece, and infers how every output
   recombines (:mod:`.combine`). A candidate becomes a :class:`Factor` only if
   the same recombination holds for every draw and every shard count;
   A candidate that fails only because some unsplit (replicated) inputs are
   added in once per shard gets a second chance as an *affine* factor: those
   inputs are given as ``Partial(sum)`` pieces instead (:func:`_affine_factor`);
   For windowed ops (:data:`~.signature.HALO_OPS`), a candidate that recombines no
   other way gets a third chance as a *halo* factor, searched on the real shapes:
   pieces extended by their neighbours' border elements (:mod:`.halo`);
5. finds the :class:`PartialPass` entries: an input whose value is split into
   random parts that add up to it (``sum``), or whose elementwise max/min is it
   (``max``/``min``), passes through if the outputs on the parts reduce to the
   whole output; and the joint passes, sets of inputs split so together
   (:func:`_joint_passes`, ``sum`` only).

The attention (SDPA) family (:mod:`.attention`) gets stand-in shapes that keep its meaning, a
proportional candidate for grouped-query heads, and candidates whose pieces are not valid
attention shapes are dropped before any execution; its GPU-only kernels take the CPU kernel's
batch and heads factors by equivalence. An executor may run kernels in an isolated worker
(:mod:`.isolation`): a crash or hang there refuses that execution like any other error.

Soundness comes first: a wrong rule silently corrupts training, a missing factor
only costs speed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import ContextManager, Sequence

import numpy as np

from ..ir.rule import Combine, Concat, Factor, Identity, PartialPass, Reduce, Rule
from . import attention
from .combine import check_combine, close, coarser_dtype, infer_combine, tolerance_for
from .executor import ExecutionRefused, OpCall, OpExecutor, kept_dims
from .halo import halo_factor
from .shapes import piece_sizes, standin_reshape, standin_shapes, standin_shapes_keeping
from .signature import HALO_OPS, op_name

__all__ = ["DiscoveryConfig", "NoRule", "discover", "candidate_factors", "random_op_rule", "is_random_like"]

log = logging.getLogger(__name__)

#: Ops whose output is uninitialized memory: like random ops, only their shape is defined.
UNINITIALIZED_OPS = frozenset({"aten.empty_like", "aten.empty", "aten.new_empty", "aten.empty_strided", "aten.new_empty_strided"})

#: Reshape ops: their stand-in shapes keep the dim groups (see :func:`.shapes.standin_reshape`).
RESHAPE_OPS = frozenset({"aten.view", "aten._unsafe_view", "aten.reshape"})


class NoRule(Exception):
    """The op gets no rule; ``reason`` says why (stored and reported, never skipped silently)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class DiscoveryConfig:
    """How hard discovery tries; the defaults are the soundness floor."""

    seeds: tuple[int, ...] = (0, 1, 2)
    """One input draw per seed; every factor must recombine on all of them (at least two)."""
    small_scale: float = 1e-3
    """The last draw's float inputs are scaled by this, so small additive constants show."""
    shard_counts: tuple[int, ...] = (2, 3)
    """Every factor must recombine for each shard count (at least two)."""
    max_candidates: int = 4096
    """Ops with more candidate factors than this get no rule (the reason says so)."""
    real_shape_budget: int = 1 << 22
    """Run on real shapes (when stand-ins are impossible) only up to this many input elements."""

    def __post_init__(self) -> None:
        if len(set(self.seeds)) < 2 or len(set(self.shard_counts)) < 2 or min(self.shard_counts) < 2:
            raise ValueError("discovery needs at least two seeds and at least two shard counts >= 2")


@dataclass(frozen=True)
class _Draw:
    inputs: tuple[np.ndarray, ...]
    whole: tuple[np.ndarray | None, ...]


def is_random_like(call: OpCall) -> bool:
    """Random ops (tagged ``random``) and ops returning uninitialized memory."""
    return call.node.op.is_random or op_name(call.target) in UNINITIALIZED_OPS


def discover(
    call: OpCall, executor: OpExecutor, shapes: Sequence[tuple[int, ...]] | None = None, config: DiscoveryConfig = DiscoveryConfig()
) -> Rule:
    """The rule of one op call, by execution; raises :class:`NoRule` with a reason.

    ``shapes`` are the input shapes to run on (default: stand-ins, see module doc).
    """
    if not call.input_specs:
        raise NoRule("no tensor inputs: a factory is created replicated, or created sharded by the lowering")
    if attention.is_attention(call.target) and attention.schema_of(call.target).gpu:
        return _gpu_attention_rule(call, executor, config)
    if is_random_like(call):
        return random_op_rule(call)
    with _session(executor):
        work, draws = _prepare(call, executor, shapes, config)
        candidates = candidate_factors(work.input_shapes, config.max_candidates)
        if attention.is_attention(call.target):
            candidates += attention.proportional_candidates(work, work.input_shapes)
            candidates = attention.consistent_candidates(work, candidates)
        found = {combo: _try_factor(work, executor, draws, combo, config) for combo in candidates}
        if op_name(call.target) in HALO_OPS:
            _halo_factors(call, executor, work, draws, found, config)
        factors = [factor for factor in found.values() if factor is not None]
        factors = prune_dominated(factors)
        passes = _partial_passes(work, executor, draws, config)
    return Rule(
        input_ranks=tuple(spec.rank for spec in call.input_specs),
        output_ranks=tuple(None if value is None else value.spec.rank for value in call.node.outputs),
        factors=tuple(factors),
        partial_passes=tuple(passes),
    )


def _gpu_attention_rule(call: OpCall, executor: OpExecutor, config: DiscoveryConfig) -> Rule:
    """A GPU-only SDPA kernel's rule, stated from the CPU kernel's rule (:mod:`.attention`), or NoRule."""
    outcome = attention.gpu_rule_from_cpu(call, lambda cpu_call: discover(cpu_call, executor, config=config))
    if isinstance(outcome, str):
        raise NoRule(outcome)
    return outcome


def _halo_factors(call: OpCall, executor: OpExecutor, work: OpCall, draws: list[_Draw], found: dict, config: DiscoveryConfig) -> None:
    """Halo factors for the candidates that found no factor, searched on the op's real shapes (:mod:`.halo`).

    The halo width depends on the kernel's size, which stand-in shapes change; so the search runs on
    the real shapes (their own seeded draws), up to ``config.real_shape_budget`` input elements.
    """
    if work.input_shapes != call.input_shapes:
        if sum(int(np.prod(s)) for s in call.input_shapes) > config.real_shape_budget:
            log.info("%s: inputs too large for a halo search on real shapes; no halo factors", call.target)
            return
        try:
            draws = [_draw(call, executor, seed, position, config) for position, seed in enumerate(config.seeds)]
        except NoRule:
            raise
        except Exception as err:  # the op does not run on its real shapes here: no halo factors, said in the log
            log.info("%s: no halo search, the op does not run on its real shapes: %s", call.target, err)
            return
    for combo in [c for c, factor in found.items() if factor is None]:
        found[combo] = halo_factor(call, executor, draws, combo, config.shard_counts)


def _session(executor: OpExecutor) -> ContextManager:
    """The executor's optional ``session()`` context (e.g. single-threaded kernels), else nothing."""
    session = getattr(executor, "session", None)
    return session() if callable(session) else contextlib.nullcontext()


def random_op_rule(call: OpCall) -> Rule:
    """The rule of a random (or uninitialized-memory) op whose outputs have its inputs' shape.

    Such an op cannot be checked value by value: each shard draws its own numbers.
    Every dim is a factor with ``Concat``: drawing independently on each piece of an
    elementwise-shaped tensor gives the same distribution as drawing on the whole,
    which is all the single-device program promises. Exact agreement with a
    single-device run is the lowering's job (random ops made consistent there).
    """
    shape = call.input_specs[0].shape
    outputs = [value for value in call.node.outputs]
    if any(spec.shape != shape for spec in call.input_specs) or any(
        value is not None and value.spec.shape != shape for value in outputs
    ):
        raise NoRule("random op whose outputs do not have its inputs' shape: no rule can be checked by execution")
    factors = [
        Factor(tuple(dim for _ in call.input_specs), tuple(None if value is None else Concat(dim) for value in outputs))
        for dim, size in enumerate(shape)
        if size > 1
    ]
    return Rule(
        input_ranks=tuple(spec.rank for spec in call.input_specs),
        output_ranks=tuple(None if value is None else value.spec.rank for value in outputs),
        factors=tuple(factors),
    )


def candidate_factors(shapes: Sequence[tuple[int, ...]], limit: int = 4096) -> list[tuple[int | None, ...]]:
    """Every assignment of a dim (or None) to each input, per size > 1; at least one dim each."""
    candidates: list[tuple[int | None, ...]] = []
    for size in sorted({s for shape in shapes for s in shape if s > 1}):
        options = [[None] + [d for d, s in enumerate(shape) if s == size] for shape in shapes]
        count = int(np.prod([len(option) for option in options]))
        if len(candidates) + count > limit:
            raise NoRule(f"more than {limit} candidate factors (input shapes {list(shapes)}); raise max_candidates")
        candidates += [combo for combo in itertools.product(*options) if any(d is not None for d in combo)]
    return candidates


def prune_dominated(factors: Sequence[Factor]) -> list[Factor]:
    """Drop factors another factor subsumes: it splits the same dims and more inputs, with the same outputs.

    They arise where an input does not affect the outputs (batch norm's running
    statistics in training): splitting it or not recombines alike. A factor whose
    outputs are all ``Identity`` is dropped when a factor splitting the same dims exists.
    """

    def subsumes(big: Factor, small: Factor) -> bool:
        same_dims = all(d is None or d == big.inputs[i] for i, d in enumerate(small.inputs))
        trivial = all(out is None or isinstance(out, Identity) for out in small.outputs)
        same_partials = big.partial_inputs == small.partial_inputs
        return big != small and same_dims and same_partials and (big.outputs == small.outputs or trivial)

    return [f for f in factors if not any(subsumes(other, f) for other in factors)]


# ----------------------------------------------------------------- preparing the draws


def _shape_options(call: OpCall, executor: OpExecutor, shapes, config: DiscoveryConfig) -> list[tuple[str, tuple]]:
    if shapes is not None:
        return [("given", tuple(tuple(s) for s in shapes))]
    real = call.input_shapes
    if attention.is_attention(call.target):
        standin = attention.standin_shapes(call)
        if standin is None:
            raise NoRule(f"not valid attention shapes: {attention.shape_error(call)}")
    elif op_name(call.target) in RESHAPE_OPS and call.node.outputs[0] is not None:
        standin = (standin_reshape(real[0], call.node.outputs[0].spec.shape),) + standin_shapes(real[1:])
    elif any(kept := kept_dims(executor, call)):
        standin = standin_shapes_keeping(real, kept)
    else:
        standin = standin_shapes(real)
    options = [("stand-in", standin)]
    if sum(int(np.prod(s)) for s in real) <= config.real_shape_budget and standin != real:
        options.append(("real", real))
    return options


def _prepare(call: OpCall, executor: OpExecutor, shapes, config: DiscoveryConfig) -> tuple[OpCall, list[_Draw]]:
    errors = []
    for label, option in _shape_options(call, executor, shapes, config):
        try:
            work = executor.adapt(call, option) if option != call.input_shapes else call
            draws = [_draw(work, executor, seed, position, config) for position, seed in enumerate(config.seeds)]
            if _has_scalar_floats(work):  # one more draw with scalars of magnitude above 1 (see _condition)
                draws.append(_draw(work, executor, config.seeds[0] + 1000, len(config.seeds), config))
            return work, draws
        except NoRule:
            raise
        except Exception as err:  # the op cannot run on these shapes; try the next option
            errors.append(f"{label} shapes {list(option)}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    if not errors:
        raise NoRule("the op's inputs are too large for real-shape discovery and have no stand-in shapes")
    raise NoRule("the op does not run for discovery: " + "; ".join(errors))


def _draw(call: OpCall, executor: OpExecutor, seed: int, position: int, config: DiscoveryConfig) -> _Draw:
    """One seeded draw; the ``position``-th draw flips the sign of tiny float inputs and may shrink magnitudes.

    Tiny inputs (a scalar step size) alternate sign between draws so that a
    monotonicity seen on one sign only is never taken for a rule; the last draw
    is scaled by ``config.small_scale`` so that small additive constants (an
    ``eps``) cannot hide inside the tolerance of a sum.
    """
    rng = np.random.default_rng(seed)
    inputs = tuple(_condition(x, position, config) for x in executor.example_inputs(call, rng, call.input_shapes))
    whole = tuple(executor.run(call, inputs))
    if not _finite(whole):
        inputs, whole = _positive_retry(call, executor, inputs)
    again = executor.run(call, inputs)
    if any(not _same(a, b) for a, b in zip(whole, again)):
        raise NoRule("non-deterministic: two runs on the same inputs differ")
    return _Draw(inputs, whole)


def _positive_retry(call: OpCall, executor: OpExecutor, inputs: tuple) -> tuple[tuple, tuple]:
    """Make float inputs positive (``sqrt``, ``log``, ``pow``), one input at a time before all at once.

    Keeping the other inputs mixed in sign keeps the draw as informative as possible
    (``pow(x, y)`` with ``x > 0`` still sees negative ``y``).
    """
    floats = [i for i, x in enumerate(inputs) if x.dtype.kind == "f"]
    for chosen in [[i] for i in floats] + [floats]:
        trial = tuple(np.abs(x) if i in chosen else x for i, x in enumerate(inputs))
        whole = tuple(executor.run(call, trial))
        if _finite(whole):
            return trial, whole
    raise NoRule("the op gives non-finite outputs on drawn inputs, even on positive ones")


def _has_scalar_floats(call: OpCall) -> bool:
    """Whether the op reads a tiny floating input (a step size, a weight: fewer than 4 elements)."""
    return any(spec.dtype.startswith(("float", "bfloat")) and int(np.prod(spec.shape)) < 4 for spec in call.input_specs)


def _condition(x: np.ndarray, position: int, config: DiscoveryConfig) -> np.ndarray:
    """Tiny float inputs alternate sign by draw; the draw after the seeds' draws (ops with such inputs only)
    gives them magnitudes in [1.5, 4.5]: a property that holds only for scalars below 1 (``lerp`` is monotone
    in its start only while its weight is below 1) must not pass as a rule."""
    if x.dtype.kind != "f":
        return x
    if x.size < 4 and position == len(config.seeds):
        return (np.abs(x) * 3.0).astype(x.dtype)
    if x.size < 4:
        x = np.abs(x) * (1.0 if position % 2 == 0 else -1.0)
    if position == len(config.seeds) - 1 and config.small_scale != 1.0:
        x = x * config.small_scale
    return x.astype(x.dtype)


def _finite(outputs) -> bool:
    return all(out is None or out.dtype.kind not in "fc" or bool(np.all(np.isfinite(out))) for out in outputs)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


# ----------------------------------------------------------------- factors


def _try_factor(call: OpCall, executor: OpExecutor, draws: list[_Draw], combo, config: DiscoveryConfig) -> Factor | None:
    """The factor ``combo`` if every draw and shard count recombines (plainly, else as an affine factor), else None."""
    return _plain_factor(call, executor, draws, combo, config) or _affine_factor(call, executor, draws, combo, config)


def _plain_factor(call: OpCall, executor: OpExecutor, draws: list[_Draw], combo, config: DiscoveryConfig) -> Factor | None:
    """The factor ``combo`` with every unsplit input replicated, if every draw and shard count recombines."""
    dtypes = [None if value is None else value.spec.dtype for value in call.node.outputs]
    combines: list[Combine | None] | None = None
    for count in config.shard_counts:
        for draw in draws:
            per_output = _run_pieces(call, executor, draw.inputs, combo, count)
            if per_output is None:
                return None
            if combines is None:
                inferred = [infer_combine(pieces, whole, dtype or "float32") for pieces, whole, dtype in zip(per_output, draw.whole, dtypes)]
                if any(item is False for item in inferred):
                    return None
                combines = inferred  # type: ignore[assignment]
                continue
            for pieces, whole, combine, dtype in zip(per_output, draw.whole, combines, dtypes):
                if combine is None:
                    if whole is not None or any(p is not None for p in pieces):
                        return None
                elif whole is None or any(p is None for p in pieces) or not check_combine(pieces, whole, combine, dtype):
                    return None
    return Factor(tuple(combo), tuple(combines or ()))


def _run_pieces(call: OpCall, executor: OpExecutor, inputs, combo, count: int, parts=None):
    """Per output, the list of per-shard results; None if the op cannot run split this way.

    ``parts`` (input -> one array per shard) replaces unsplit inputs shard by shard. A proportional
    candidate (split dims of different sizes, each a multiple of the smallest) cuts every dim into
    pieces in proportion to its size.
    """
    parts = parts or {}
    ratios = _proportions(inputs, combo)
    if ratios is None:
        return None
    size = min(inputs[i].shape[d] for i, d in enumerate(combo) if d is not None)
    for uneven in (True, False):
        sizes = piece_sizes(size, count, uneven)
        if sizes is None:
            return None
        bounds = np.cumsum([0] + sizes)
        results = []
        try:
            for k in range(count):
                piece = [x if d is None else np.take(x, np.arange(bounds[k] * r, bounds[k + 1] * r), axis=d)
                         for x, d, r in zip(inputs, combo, ratios)]
                for index, values in parts.items():
                    piece[index] = values[k]
                results.append(executor.run(call, piece))
        except ExecutionRefused as err:
            log.debug("%s split %s into %s refused: %s", call.target, combo, sizes, err)
            continue
        except Exception as err:  # the op rejects these pieces: try even pieces, then give up
            log.debug("%s split %s into %s: %s", call.target, combo, sizes, err)
            continue
        return [list(outputs) for outputs in zip(*results)]
    return None


def _proportions(inputs, combo) -> list[int] | None:
    """Per input, its split dim's size over the smallest split dim's (1 where unsplit); None if one does not divide."""
    sizes = [x.shape[d] for x, d in zip(inputs, combo) if d is not None]
    smallest = min(sizes)
    if smallest < 1 or any(size % smallest for size in sizes):
        return None
    return [1 if d is None else x.shape[d] // smallest for x, d in zip(inputs, combo)]


# ----------------------------------------------------------------- affine factors

#: At most this many unsplit inputs are considered as Partial(sum) candidates (their subsets are tried).
MAX_AFFINE_INPUTS = 3

#: The ways a Partial(sum) input is cut into per-shard parts; an affine factor must hold for all of them.
AFFINE_SPLITS = ("zero", "random", "alternating")


def _affine_factor(call: OpCall, executor: OpExecutor, draws: list[_Draw], combo, config: DiscoveryConfig) -> Factor | None:
    """``combo`` with some unsplit floating inputs as ``Partial(sum)``, if that recombines with ``sum`` everywhere.

    ``addmm(bias, x, w)`` split along ``k`` gives ``bias + x_k @ w_k`` per shard: summing adds
    the bias once per shard. With the bias as ``Partial(sum)`` the shards' outputs add up to
    the whole. The smallest set of such inputs that works is taken; it must hold for every
    draw, every shard count and every way of cutting the inputs into parts
    (:data:`AFFINE_SPLITS`: the value on shard 0 and zeros elsewhere, as the lowering's
    ``Replicate -> Partial(sum)`` does; random parts; parts of alternating sign), with every
    output recombining as ``Reduce(sum)``. Only ``sum``: a ``max``/``min`` analogue would need
    the op to be monotone in the split dims too, which discovery does not establish.
    """
    outputs = [value for value in call.node.outputs if value is not None]
    if not outputs or any(tolerance_for(value.spec.dtype).exact for value in outputs):
        return None
    unsplit = [i for i, d in enumerate(combo) if d is None and not tolerance_for(call.input_specs[i].dtype).exact]
    if not unsplit or len(unsplit) > MAX_AFFINE_INPUTS:
        return None
    subsets = [s for size in range(1, len(unsplit) + 1) for s in itertools.combinations(unsplit, size)]
    for subset in subsets:
        if all(
            _affine_holds(call, executor, draw, combo, subset, count, split, seed)
            for split in AFFINE_SPLITS
            for count in config.shard_counts
            for seed, draw in enumerate(draws)
        ):
            outputs_combine = tuple(None if value is None else Reduce("sum") for value in call.node.outputs)
            return Factor(tuple(combo), outputs_combine, subset)
    return None


def affine_parts(x: np.ndarray, count: int, split: str, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` parts of ``x`` that add up to it: ``zero`` (x on part 0, zeros elsewhere), ``random``, ``alternating``.

    Random and alternating parts are as large as the data (not as large as 1), so that the
    tolerance of the sum stays tight on small-magnitude draws.
    """
    if split == "zero":
        return [x] + [np.zeros_like(x) for _ in range(count - 1)]
    magnitude = np.abs(x) + 0.25 * float(np.max(np.abs(x), initial=0.0))
    if split == "random":
        parts = [rng.normal(0.0, 1.0, x.shape) * magnitude for _ in range(count - 1)]
    elif split == "alternating":
        parts = [(1.0 if k % 2 == 0 else -1.0) * rng.uniform(0.5, 1.5, x.shape) * magnitude for k in range(count - 1)]
    else:
        raise ValueError(f"unknown split {split!r}: expected one of {AFFINE_SPLITS}")
    parts = [p.astype(x.dtype) for p in parts]
    return parts + [(x - sum(parts)).astype(x.dtype)]


def _affine_holds(call: OpCall, executor: OpExecutor, draw: _Draw, combo, subset, count: int, split: str, seed: int) -> bool:
    rng = np.random.default_rng([seed, count, AFFINE_SPLITS.index(split), *subset])
    parts = {index: affine_parts(draw.inputs[index], count, split, rng) for index in subset}
    per_output = _run_pieces(call, executor, draw.inputs, combo, count, parts)
    if per_output is None:
        return False
    for pieces, whole, value in zip(per_output, draw.whole, call.node.outputs):
        if value is None:
            if whole is not None or any(p is not None for p in pieces):
                return False
        elif whole is None or any(p is None for p in pieces) or not check_combine(pieces, whole, Reduce("sum"), value.spec.dtype):
            return False
    return True


# ----------------------------------------------------------------- partial passes


def _partial_passes(call: OpCall, executor: OpExecutor, draws: list[_Draw], config: DiscoveryConfig) -> list[PartialPass]:
    outputs = [value for value in call.node.outputs if value is not None]
    if not outputs or any(tolerance_for(value.spec.dtype).exact for value in outputs):
        return []
    passes = []
    for index, spec in enumerate(call.input_specs):
        if tolerance_for(spec.dtype).exact:
            continue
        for op in ("sum", "max", "min"):
            if all(
                _passes(call, executor, draw, index, op, count, seed)
                for count in config.shard_counts
                for seed, draw in enumerate(draws)
            ):
                passes.append(PartialPass(index, op))
    return passes + _joint_passes(call, executor, draws, config, passes)


MAX_JOINT_INPUTS = 4
"""A joint partial pass is sought among an op's float inputs when it has at most this many."""


def _joint_passes(call: OpCall, executor: OpExecutor, draws: list[_Draw], config: DiscoveryConfig,
                  single: list[PartialPass]) -> list[PartialPass]:
    """The largest sets of two or more float inputs that the op is linear in jointly: each cut into parts that add up
    to it (each way of :data:`AFFINE_SPLITS`, the lowering's own first), the op run on the k-th parts of all of them,
    the outputs add up to the whole output on every draw and shard count. Every set of the largest size that holds
    is a pass (``addmm(bias, x, w)``: ``0+1:sum`` and ``0+2:sum``).

    ``add``, ``sub``, ``cat`` and ``where``'s two branches are; a sum of two ``Partial(sum)`` gradients then stays
    ``Partial(sum)`` and is reduced once. An input the op is linear in alone (``single``) is left out: an op linear
    in it alone and jointly with another does not read the other.
    """
    alone = {partial.input for partial in single if partial.op == "sum"}
    floats = [index for index, spec in enumerate(call.input_specs) if not tolerance_for(spec.dtype).exact and index not in alone]
    if not 2 <= len(floats) <= MAX_JOINT_INPUTS:
        return []
    for size in range(len(floats), 1, -1):
        found = [PartialPass(subset[0], "sum", subset[1:]) for subset in itertools.combinations(floats, size)
                 if all(_joint_holds(call, executor, draw, subset, count, split, seed)
                        for split in AFFINE_SPLITS for count in config.shard_counts for seed, draw in enumerate(draws))]
        if found:
            return found
    return []


def _joint_holds(call: OpCall, executor: OpExecutor, draw: _Draw, subset: tuple[int, ...], count: int, split: str,
                 seed: int) -> bool:
    if not _vanishes_at_zero(call, executor, draw, subset):  # a linear op maps zeros to zeros (x + y + 1 is not)
        return False
    rng = np.random.default_rng([seed, count, AFFINE_SPLITS.index(split), *subset])
    return _parts_recombine(call, executor, draw, {index: affine_parts(draw.inputs[index], count, split, rng) for index in subset}, "sum")


def _vanishes_at_zero(call: OpCall, executor: OpExecutor, draw: _Draw, indices: tuple[int, ...]) -> bool:
    """A linear op maps zero inputs (those at ``indices``) to exactly zero outputs (``x + eps`` does not)."""
    inputs = [np.zeros_like(x) if index in indices else x for index, x in enumerate(draw.inputs)]
    try:
        outputs = executor.run(call, inputs)
    except Exception as err:  # e.g. a division by the zeroed input
        log.debug("%s with inputs %s zeroed: %s", call.target, list(indices), err)
        return False
    return all(out is None or not np.any(out) for out in outputs)


def split_value(x: np.ndarray, op: str, count: int, rng: np.random.Generator, crossing: bool = False) -> list[np.ndarray]:
    """Random parts of ``x`` that reduce to it with ``op`` (sum: add up; max/min: elementwise).

    For max/min, each element has one owner part holding it; the other parts hold
    a value below it (above, for min): by a fraction of ``|x|`` (same sign as ``x``),
    or with ``crossing`` by an absolute amount (often across zero). An op passes
    only if both kinds recombine, so a monotonicity on one side of zero is not enough.
    """
    if op == "sum":
        parts = [rng.normal(0.0, 1.0, x.shape) * (np.abs(x) + 0.5) for _ in range(count - 1)]
        parts = [p.astype(x.dtype) for p in parts]
        return parts + [x - sum(parts)]
    owner = rng.integers(0, count, size=x.shape)
    sign = -1.0 if op == "max" else 1.0
    parts = []
    for k in range(count):
        delta = rng.uniform(0.5, 2.0, x.shape) if crossing else np.abs(x) * rng.uniform(0.1, 0.9, x.shape)
        parts.append(np.where(owner == k, x, x + sign * delta).astype(x.dtype))
    return parts


def _passes(call: OpCall, executor: OpExecutor, draw: _Draw, index: int, op: str, count: int, seed: int) -> bool:
    if op == "sum" and not _vanishes_at_zero(call, executor, draw, (index,)):
        return False
    for crossing in (False, True) if op != "sum" else (False,):
        rng = np.random.default_rng([seed, index, count, ("sum", "max", "min").index(op), crossing])
        if not _parts_recombine(call, executor, draw, {index: split_value(draw.inputs[index], op, count, rng, crossing)}, op):
            return False
    return True


def _parts_recombine(call: OpCall, executor: OpExecutor, draw: _Draw, parts: dict[int, list[np.ndarray]], op: str) -> bool:
    """The op run on the k-th part of every input in ``parts`` (the others whole), for each k: the outputs reduce
    with ``op`` to the whole output."""
    results = []
    try:
        for k in range(len(next(iter(parts.values())))):
            results.append(executor.run(call, [parts[index][k] if index in parts else x for index, x in enumerate(draw.inputs)]))
    except Exception as err:  # the op rejects the parts (e.g. a domain error): no pass
        log.debug("%s partial %s of inputs %s: %s", call.target, op, list(parts), err)
        return False
    for position, whole in enumerate(draw.whole):
        pieces = [outputs[position] for outputs in results]
        if whole is None:
            if any(p is not None for p in pieces):
                return False
            continue
        dtype = call.node.outputs[position].spec.dtype  # type: ignore[union-attr]
        for index in parts:
            dtype = coarser_dtype(dtype, call.input_specs[index].dtype)
        if any(p is None or p.shape != whole.shape for p in pieces):
            return False
        stacked = np.stack(pieces)
        if op == "sum":
            scale = float(np.max(np.abs(stacked), initial=1.0))
            if not close(stacked.sum(axis=0), whole, dtype, scale=scale):
                return False
        elif not close(stacked.max(axis=0) if op == "max" else stacked.min(axis=0), whole, dtype):
            return False
    return True
