"""An independent oracle for discovered rules: PyTorch DTensor's own sharding strategies, and re-execution.

``metadist rules verify`` checks ShardCombine's rules two ways:

1. **Against DTensor.** DTensor registers, for most aten ops, the placements it accepts on one
   mesh axis (``torch.distributed.tensor``: the sharding propagator's single-dim strategies,
   else its op strategy functions). :class:`DTensorOracle` asks them for the node's shapes on
   a 1-D mesh of a single-process *fake* process group (nothing is launched, nothing is sent)
   and maps each strategy (input placements -> output placements) onto factor notation:
   ``Shard(d)`` inputs and ``Shard``/``Partial``/``Replicate`` outputs are one factor
   (``Concat``/``Reduce``/``Identity``); ``Partial(sum)`` inputs next to ``Shard`` inputs with
   ``Partial(sum)`` outputs are an affine factor (addmm's ``k`` with the bias partial); a single
   ``Partial`` input with every other input replicated is a partial pass. The comparison counts agreements, strategies only we find,
   and strategies only DTensor has, each with the reason when one is known (DTensor's
   strategy needs several ``Partial`` inputs at once, ``Partial(avg)``, a size-1 dim...).

2. **By execution.** DTensor cannot execute our placements in one process, so every factor and
   partial pass of our rule is re-run here on real shards of fresh shapes and seeded data, with
   a shard count of its own choosing, recombined by this module's own code, and compared with
   the whole result (stated tolerances, largest difference reported). A rule that fails is
   *wrong*. DTensor-only strategies that factor notation can express get the same re-check, so
   the report tells a ShardCombine gap (the strategy holds) from a DTensor bug (it fails).

Nothing here runs at import: :class:`DTensorOracle` starts the fake process group when it is
entered and destroys it (if it started it) when it exits.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..ir import Concat, Factor, Graph, Identity, Literal, Node, PartialPass, Reduce, Rule, RuleError, ValueRef
from .discover import UNINITIALIZED_OPS, DiscoveryConfig
from .errors import OracleError
from .executor import ExecutionRefused, OpCall, OpExecutor, op_call
from .signature import op_name, signature_of

__all__ = [
    "DTensorOracle",
    "ExecutionCheck",
    "OpReport",
    "OracleReport",
    "SignatureComparison",
    "Strategy",
    "StrategyFinding",
    "check_rule_by_execution",
    "compare_node",
    "rule_strategies",
    "verify_graph",
    "merge_reports",
]

logger = logging.getLogger(__name__)

REPLICATE = "R"
MAX_PLACEMENT_COMBINATIONS = 512
"""Past this many input-placement combinations an op strategy function is offered all placements at once."""


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True, order=True)
class Strategy:
    """One placement strategy on one mesh axis, in DTensor's words: ``S(d)``, ``R``, ``P(op)`` (``None``: no tensor)."""

    inputs: tuple[str, ...]
    outputs: tuple[str | None, ...]

    def __str__(self) -> str:
        return f"{', '.join(self.inputs)} -> {', '.join('-' if out is None else out for out in self.outputs)}"

    @property
    def partial_inputs(self) -> tuple[int, ...]:
        return tuple(index for index, placement in enumerate(self.inputs) if placement.startswith("P("))

    @property
    def is_trivial(self) -> bool:
        """All inputs replicated: every op has it, it says nothing."""
        return all(placement == REPLICATE for placement in self.inputs)


@dataclass(frozen=True)
class StrategyFinding:
    """A strategy one side has and the other lacks, with why (when known)."""

    strategy: Strategy
    reason: str


@dataclass(frozen=True)
class ExecutionCheck:
    """One factor (or partial pass) of our rule, re-run on real shards and recombined."""

    what: str
    """The factor as a strategy (``S(0), R -> S(0)``), or ``pass 0:sum``."""
    shards: int
    ok: bool | None
    """True: recombined output matches; False: the rule is wrong; None: not checkable here (see detail)."""
    max_abs_error: float
    detail: str = ""


@dataclass(frozen=True)
class SignatureComparison:
    """Our rule against DTensor for one op signature (op, input shapes and dtypes, other arguments)."""

    op_target: str
    signature: str
    example_node: str
    rule_text: str
    dtensor: str
    """``"registered"``, or why DTensor could not be asked (no strategy for the op, it raised...)."""
    agreements: tuple[Strategy, ...]
    only_ours: tuple[StrategyFinding, ...]
    only_dtensor: tuple[StrategyFinding, ...]
    checks: tuple[ExecutionCheck, ...]

    @property
    def wrong(self) -> tuple[ExecutionCheck, ...]:
        return tuple(check for check in self.checks if check.ok is False)

    @property
    def dtensor_wrong(self) -> tuple[StrategyFinding, ...]:
        """DTensor-only strategies that fail the execution re-check (DTensor bugs)."""
        return tuple(finding for finding in self.only_dtensor if finding.reason.startswith(DTENSOR_WRONG))


@dataclass(frozen=True)
class OpReport:
    """Counts for one op target over all its signatures."""

    op_target: str
    signatures: int
    dtensor_registered: int
    """Signatures DTensor could answer."""
    agreements: int
    only_ours: int
    only_dtensor: int
    checks_passed: int
    checks_failed: int
    checks_skipped: int
    dtensor_wrong: int
    """DTensor-only strategies that fail the execution re-check."""
    examples: tuple[str, ...] = ()
    """A few only-ours / only-DTensor / wrong lines, with reasons, for the report."""


@dataclass(frozen=True)
class OracleReport:
    """The verification of a set of graphs' rules; counts summed over :attr:`ops`."""

    models: tuple[str, ...]
    nodes: int
    nodes_with_rule: int
    mesh_size: int
    ops: tuple[OpReport, ...]
    comparisons: tuple[SignatureComparison, ...]

    def _total(self, name: str) -> int:
        return sum(getattr(op, name) for op in self.ops)

    @property
    def signatures(self) -> int:
        return self._total("signatures")

    @property
    def dtensor_registered(self) -> int:
        return self._total("dtensor_registered")

    @property
    def agreements(self) -> int:
        return self._total("agreements")

    @property
    def only_ours(self) -> int:
        return self._total("only_ours")

    @property
    def only_dtensor(self) -> int:
        return self._total("only_dtensor")

    @property
    def checks_passed(self) -> int:
        return self._total("checks_passed")

    @property
    def checks_failed(self) -> int:
        return self._total("checks_failed")

    @property
    def checks_skipped(self) -> int:
        return self._total("checks_skipped")

    @property
    def dtensor_wrong(self) -> int:
        return self._total("dtensor_wrong")

    @property
    def wrong_rules(self) -> tuple[SignatureComparison, ...]:
        return tuple(comparison for comparison in self.comparisons if comparison.wrong)

    def only_dtensor_reasons(self) -> dict[str, int]:
        """How many only-DTensor strategies each kind of reason explains (details in parentheses dropped)."""
        counts: dict[str, int] = defaultdict(int)
        for comparison in self.comparisons:
            for finding in comparison.only_dtensor:
                counts[finding.reason.split(" (", 1)[0]] += 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))


# ---------------------------------------------------------------------------- our side


def rule_strategies(rule: Rule) -> tuple[dict[Strategy, str], dict[Strategy, str]]:
    """Our rule as one-axis strategies: ``(comparable, not_comparable)``, each strategy -> the factor's text.

    Factors with block-cyclic (``chunk``) or overlapping (``halo``) outputs have no DTensor
    placement; they land in ``not_comparable``.
    """
    comparable: dict[Strategy, str] = {}
    other: dict[Strategy, str] = {}
    for factor in rule.factors:
        strategy, plain = _factor_strategy(factor)
        (comparable if plain else other)[strategy] = str(strategy)
    for partial in rule.partial_passes:
        strategy = _pass_strategy(rule, partial)
        comparable[strategy] = f"pass {partial.input}:{partial.op}"
    return comparable, other


def _factor_strategy(factor: Factor) -> tuple[Strategy, bool]:
    inputs = tuple(
        f"S({dim})" if dim is not None else f"P({factor.partial_op})" if index in factor.partial_inputs else REPLICATE
        for index, dim in enumerate(factor.inputs)
    )
    outputs: list[str | None] = []
    plain = True
    for out in factor.outputs:
        if out is None:
            outputs.append(None)
        elif isinstance(out, Concat):
            plain = plain and out.chunk == 1 and out.halo == 0
            outputs.append(f"S({out.dim})" if out.chunk == 1 and out.halo == 0 else f"S({out.dim},chunk={out.chunk},halo={out.halo})")
        elif isinstance(out, Reduce):
            outputs.append(f"P({out.op})")
        else:
            outputs.append(REPLICATE)
    return Strategy(inputs, tuple(outputs)), plain


def _pass_strategy(rule: Rule, partial: PartialPass) -> Strategy:
    inputs = tuple(f"P({partial.op})" if index == partial.input else REPLICATE for index in range(len(rule.input_ranks)))
    outputs = tuple(None if rank is None else f"P({partial.op})" for rank in rule.output_ranks)
    return Strategy(inputs, outputs)


# ---------------------------------------------------------------------------- DTensor's side


class DTensorOracle:
    """DTensor's registered strategies for MetaIR nodes, on a 1-D mesh of a fake process group.

    Use as a context manager: entering starts ``torch.distributed`` with the ``"fake"`` backend
    (one process, ``mesh_size`` pretend ranks) unless a process group already exists; exiting
    destroys the group it started.
    """

    def __init__(self, mesh_size: int = 2) -> None:
        if mesh_size < 2:
            raise OracleError(f"the oracle's mesh needs at least 2 devices, got mesh_size={mesh_size}")
        self.mesh_size = mesh_size
        self._started = False
        self._mesh: Any = None
        self._propagator: Any = None

    def __enter__(self) -> "DTensorOracle":
        try:
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor
            from torch.testing._internal.distributed.fake_pg import FakeStore
        except ImportError as err:
            raise OracleError(
                f"the DTensor oracle needs torch.distributed with its fake process group ({err}); "
                "install a PyTorch build with distributed support"
            ) from err
        if not dist.is_available():
            raise OracleError("this PyTorch build has no torch.distributed; the DTensor oracle needs it")
        if not dist.is_initialized():
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.mesh_size)
            self._started = True
        self.mesh_size = dist.get_world_size()
        self._mesh = DeviceMesh("cpu", list(range(self.mesh_size)))
        self._propagator = DTensor._op_dispatcher.sharding_propagator
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._started:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._started = False

    def strategies(self, node: Node, graph: Graph) -> frozenset[Strategy] | str:
        """DTensor's non-trivial strategies for ``node`` on one mesh axis, or why there are none to compare."""
        if self._propagator is None:
            raise OracleError("DTensorOracle.strategies() called outside 'with DTensorOracle() as oracle:'")
        from torch.distributed.tensor._op_schema import OpSchema

        from ..frontends.torch.execute import resolve_op

        op = resolve_op(node.op.target)
        propagator = self._propagator
        single = propagator.op_single_dim_strategy_funcs.get(op)
        strategy_func = propagator.op_strategy_funcs.get(op)
        if single is None and strategy_func is None:
            return "DTensor registers no sharding strategy for this op"
        schema_info = propagator.op_to_schema_info_for_single_dim_strategy.get(op) or propagator.op_to_schema_info.get(op)
        tensor_count = len(node.input_names)
        found: set[Strategy | None] = set()
        errors: list[str] = []
        # A single-dim strategy lists every placement at once; an op strategy function answers for the
        # input placements it is offered, so it is asked once per combination (each alone, so that one
        # combination it rejects does not hide the others).
        combinations = [None] if single is not None else self._placement_combinations(node, graph)
        for combination in combinations:
            placements = iter(combination) if combination is not None else None
            args = tuple(self._schema_arg(arg, graph, placements) for arg in node.args)
            kwargs = {key: self._schema_arg(arg, graph, placements) for key, arg in node.kwargs}
            schema = OpSchema(op, args, kwargs, schema_info=schema_info)
            try:
                if single is not None:
                    raw = [tuple(row) for row in single.func(op, schema.args_meta, schema.kwargs_meta)]
                    found.update(self._from_single_dim(row, tensor_count) for row in raw)
                else:
                    found.update(self._from_op_strategy(strategy_func(schema), tensor_count))
            except Exception as err:  # DTensor's strategy code rejecting an input placement or argument
                errors.append(f"{type(err).__name__}: {str(err)[:120]}")
        if errors:
            logger.info("DTensor's strategy for %s raised for %d of %d placement combinations: %s", node.op.target, len(errors), len(combinations), errors[0])
        if len(errors) == len(combinations):
            return f"DTensor's strategy function raised {errors[0]}"
        return frozenset(strategy for strategy in found if strategy is not None and not strategy.is_trivial)

    def _placement_combinations(self, node: Node, graph: Graph) -> list[tuple[Any, ...] | None]:
        """Every combination of one placement per tensor input, or ``[None]`` (all at once) past a budget."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        choices = [
            [Replicate(), Partial("sum")] + [Shard(dim) for dim in range(graph.value(name).spec.rank)]
            for name in node.input_names
        ]
        if math.prod(len(options) for options in choices) > MAX_PLACEMENT_COMBINATIONS:
            return [None]
        return list(itertools.product(*choices))

    def _schema_arg(self, arg: Any, graph: Graph, placements: Iterator[Any] | None) -> Any:
        """One argument of the OpSchema: a tensor becomes an OpStrategy (its next placement, or all of them)."""
        from torch.distributed.tensor._op_schema import TupleStrategy

        if isinstance(arg, ValueRef):
            return self._input_strategy(graph.value(arg.name).spec, None if placements is None else next(placements))
        if isinstance(arg, tuple):
            items = [self._schema_arg(item, graph, placements) for item in arg]
            if items and all(isinstance(item, ValueRef) for item in arg):
                return TupleStrategy(tuple(items))
            return items
        if isinstance(arg, Literal):
            from ..frontends.torch.execute import materialize

            return materialize(arg, {})
        return arg

    def _input_strategy(self, spec: Any, placement: Any) -> Any:
        """An OpStrategy for one input: ``placement``, or (``None``) every one of R, P(sum), S(d) for each dim."""
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

        import torch

        shape = torch.Size(spec.shape)
        stride = tuple(math.prod(spec.shape[dim + 1 :]) for dim in range(len(spec.shape)))
        meta = TensorMeta(shape, stride, getattr(torch, spec.dtype))
        placements = [Replicate(), Partial("sum")] + [Shard(dim) for dim in range(len(shape))] if placement is None else [placement]
        return OpStrategy([OpSpec(DTensorSpec(self._mesh, (placement,), tensor_meta=meta)) for placement in placements])

    @staticmethod
    def _from_single_dim(row: tuple, tensor_count: int) -> Strategy | None:
        outputs_count = len(row) - tensor_count
        if outputs_count < 0:
            return None
        outputs = tuple(_placement_text(placement) for placement in row[:outputs_count])
        inputs = tuple(_placement_text(placement) or REPLICATE for placement in row[outputs_count:])
        return Strategy(inputs, outputs)  # type: ignore[arg-type]

    @staticmethod
    def _from_op_strategy(result: Any, tensor_count: int) -> set[Strategy]:
        from torch.distributed.tensor._op_schema import OpStrategy

        if not isinstance(result, OpStrategy):
            raise TypeError(f"a {type(result).__name__} (per-element strategies) is not compared")
        found = set()
        for spec in result.strategies:
            outputs_spec = spec.output_specs
            outputs = outputs_spec if isinstance(outputs_spec, tuple) else (outputs_spec,)
            output_texts = tuple(None if out is None else _placement_text(out.placements[0]) for out in outputs)
            input_specs = spec.input_specs if spec.input_specs is not None else [outputs_spec] * tensor_count
            input_texts = tuple(_placement_text(item.placements[0]) or REPLICATE for item in input_specs)
            found.add(Strategy(input_texts, output_texts))  # type: ignore[arg-type]
        return found


def _placement_text(placement: Any) -> str | None:
    if placement is None:
        return None
    name = type(placement).__name__
    if name == "_ShardingPlaceholder" or name == "Shard":
        return f"S({placement.dim})"
    if name == "_StridedShard":
        return f"S({placement.dim},strided={placement.split_factor})"
    if name == "Replicate":
        return REPLICATE
    if name in ("Partial", "_NormPartial", "_MaskPartial"):
        return f"P({getattr(placement, 'reduce_op', 'sum')})" if name == "Partial" else f"P({name})"
    return f"?{name}"


# ---------------------------------------------------------------------------- comparison


def compare_node(node: Node, graph: Graph, rule: Rule, oracle: DTensorOracle, executor: OpExecutor, *, seed: int = 20261130) -> SignatureComparison:
    """Compare our ``rule`` for ``node`` with DTensor's strategies, and re-check both sides' extras by execution."""
    call = op_call(graph, node)
    ours, not_comparable = rule_strategies(rule)
    checks = check_rule_by_execution(call, rule, executor, seed=seed)
    failed = {check.what for check in checks if check.ok is False}
    dtensor = oracle.strategies(node, graph)
    status = dtensor if isinstance(dtensor, str) else "registered"
    theirs = set() if isinstance(dtensor, str) else {_align(strategy, rule) for strategy in dtensor}
    absent = status if isinstance(dtensor, str) else "DTensor does not list it"
    agreements = sorted(strategy for strategy in ours if strategy in theirs)
    only_ours = [StrategyFinding(strategy, _our_reason(label, failed, absent)) for strategy, label in ours.items() if strategy not in theirs]
    only_ours += [StrategyFinding(strategy, "block-cyclic/halo pieces have no DTensor placement") for strategy in not_comparable]
    only_dtensor = [
        StrategyFinding(strategy, _dtensor_finding(strategy, call, rule, executor, seed)) for strategy in sorted(theirs - set(ours))
    ]
    return SignatureComparison(
        op_target=node.op.target,
        signature=signature_of(call).key,
        example_node=node.name,
        rule_text=rule.to_text(),
        dtensor=status,
        agreements=tuple(agreements),
        only_ours=tuple(only_ours),
        only_dtensor=tuple(only_dtensor),
        checks=checks,
    )


DTENSOR_WRONG = "WRONG in DTensor"
"""How the reason of a DTensor-only strategy that fails the execution re-check begins."""


def _dtensor_finding(strategy: Strategy, call: OpCall, rule: Rule, executor: OpExecutor, seed: int) -> str:
    """The reason for a DTensor-only strategy; one factor notation can express is also re-checked by execution."""
    reason = _dtensor_reason(strategy, call.input_shapes, rule, [spec.dtype for spec in call.input_specs])
    if reason not in (NOT_DISCOVERED, PASS_NOT_OURS):
        return reason
    try:
        as_rule = _strategy_as_rule(strategy, rule)
    except RuleError as err:
        return f"{reason}; not expressible as a factor ({err})"
    (check,) = check_rule_by_execution(call, as_rule, executor, seed=seed)
    if check.ok is False:
        return f"{DTENSOR_WRONG}: fails the execution re-check ({check.detail})"
    if check.ok is None:
        return f"{reason}; not re-checked ({check.detail})"
    small = [
        call.input_shapes[index][int(placement[2:-1])]
        for index, placement in enumerate(strategy.inputs)
        if placement.startswith("S(") and int(placement[2:-1]) < len(call.input_shapes[index])
    ]
    if reason == NOT_DISCOVERED and small and min(small) < max(DiscoveryConfig().shard_counts):
        return f"holds in the execution re-check; a dim of size {min(small)} is too small for discovery's {max(DiscoveryConfig().shard_counts)}-way split"
    return f"{reason}; holds in the execution re-check (ShardCombine missed it)"


def _strategy_as_rule(strategy: Strategy, rule: Rule) -> Rule:
    """A one-factor (or one-pass) rule that says what a DTensor strategy says."""
    partial = strategy.partial_inputs
    if partial and all(not placement.startswith("S(") for placement in strategy.inputs):
        return Rule(rule.input_ranks, rule.output_ranks, (), (PartialPass(partial[0], strategy.inputs[partial[0]][2:-1]),))
    inputs = tuple(None if placement == REPLICATE or placement.startswith("P(") else int(placement[2:-1]) for placement in strategy.inputs)
    outputs = tuple(
        None if out is None else Identity() if out == REPLICATE else Reduce(out[2:-1]) if out.startswith("P(") else Concat(int(out[2:-1]))
        for out in strategy.outputs
    )
    return Rule(rule.input_ranks, rule.output_ranks, (Factor(inputs, outputs, partial),))


def _align(strategy: Strategy, rule: Rule) -> Strategy:
    """Blank DTensor's outputs where our rule has no tensor output, so the two sides compare."""
    if len(strategy.outputs) != len(rule.output_ranks):
        return strategy
    outputs = tuple(None if rank is None else out for out, rank in zip(strategy.outputs, rule.output_ranks))
    return Strategy(strategy.inputs, outputs)


def _our_reason(label: str, failed: set[str], why_absent: str) -> str:
    if label in failed:
        return f"WRONG: fails the execution re-check; {why_absent}"
    return f"holds in the execution re-check; {why_absent}"


def _dtensor_reason(strategy: Strategy, input_shapes: Sequence[tuple[int, ...]], rule: Rule, input_dtypes: Sequence[str] = ()) -> str:
    """Why ShardCombine's factor notation has no factor for a DTensor strategy, when the strategy shows it."""
    if len(strategy.inputs) != len(rule.input_ranks) or len(strategy.outputs) != len(rule.output_ranks):
        return f"DTensor counts {len(strategy.inputs)} inputs/{len(strategy.outputs)} outputs, the rule {len(rule.input_ranks)}/{len(rule.output_ranks)}"
    placements = strategy.inputs + tuple(out for out in strategy.outputs if out is not None)
    if any(placement.startswith("P(") and placement not in ("P(sum)", "P(max)", "P(min)") for placement in placements):
        return "uses Partial(avg) or another reduction MetaDist does not model"
    if any("strided" in placement or placement.startswith("?") for placement in placements):
        return "uses a strided or special placement"
    partial = strategy.partial_inputs
    sharded = [index for index, placement in enumerate(strategy.inputs) if placement.startswith("S(")]
    if len(partial) > 1 and not sharded:
        return "needs several Partial inputs at once (a partial pass has one Partial input, the others replicated)"
    if partial and sharded:
        ops = {strategy.inputs[index] for index in partial} | {out for out in strategy.outputs if out is not None}
        if ops != {"P(sum)"}:
            return "mixes a Partial input with Shard inputs, not as an affine factor (Partial(sum) inputs and outputs only)"
        if input_dtypes and any(not input_dtypes[index].startswith(("float", "bfloat", "complex")) for index in partial):
            return "a Partial integer input (discovery looks for affine factors of floating inputs only)"
    if partial and not sharded and input_dtypes and not input_dtypes[partial[0]].startswith(("float", "bfloat", "complex")):
        return "a Partial integer input (discovery looks for partial passes of floating inputs only)"
    if partial and not sharded:
        op = strategy.inputs[partial[0]]
        if any(out is not None and out != op for out in strategy.outputs):
            return f"a {op} input giving non-{op} outputs (not a pass-through)"
        return PASS_NOT_OURS
    for index in sharded:
        dim = int(strategy.inputs[index][2:-1])
        if dim < len(input_shapes[index]) and input_shapes[index][dim] < 2:
            return "shards a size-1 dim: nothing to split in this signature"
    if any(out is not None and out.startswith("P(") for out in strategy.outputs) and not sharded:
        return "Partial output from replicated inputs"
    return NOT_DISCOVERED


NOT_DISCOVERED = "not discovered by ShardCombine"
PASS_NOT_OURS = "partial pass-through not in our rule"


# ---------------------------------------------------------------------------- execution re-check

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
            checks += [_check_pass(call, executor, rule, partial, inputs, whole, rng) for partial in rule.partial_passes]
        for check in checks:
            if scale != 1.0 and check.detail:
                check = replace(check, detail=f"{check.detail} (inputs scaled by {scale:g})")
            earlier = results.get(check.what)
            if earlier is None or (earlier.ok is None and check.ok is not None) or (earlier.ok and check.ok is False):
                results[check.what] = check
    return tuple(results[label] for label in labels)


def _labels(rule: Rule) -> list[str]:
    return [str(_factor_strategy(factor)[0]) for factor in rule.factors] + [
        f"pass {partial.input}:{partial.op}" for partial in rule.partial_passes
    ]


def _fresh_shapes(shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...] | None:
    distinct = sorted({size for shape in shapes for size in shape if size > 1})
    if len(distinct) > len(FRESH_SIZES):
        return None
    mapping = dict(zip(distinct, FRESH_SIZES)) | {0: 0, 1: 1}
    return tuple(tuple(mapping[size] for size in shape) for shape in shapes)


def _fresh_draw(call: OpCall, executor: OpExecutor, rng: np.random.Generator, scale: float) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    errors = []
    for shapes in (_fresh_shapes(call.input_shapes), call.input_shapes):
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
    strategy, plain = _factor_strategy(factor)
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


def _check_pass(call: OpCall, executor: OpExecutor, rule: Rule, partial: PartialPass, inputs: Sequence[np.ndarray], whole: Sequence[np.ndarray | None], rng: np.random.Generator) -> ExecutionCheck:
    """Split one input into partial terms (adding up, or elementwise max/min), run each, reduce the outputs."""
    label = f"pass {partial.input}:{partial.op}"
    value = inputs[partial.input]
    if value.dtype.kind != "f":
        return ExecutionCheck(label, 0, None, 0.0, "non-floating input: not re-checked")
    shards = 4
    if partial.op == "sum":
        magnitude = np.abs(value) + 0.1 * float(np.max(np.abs(value), initial=0.0))  # terms as large as the value
        terms = [(rng.standard_normal(value.shape) * magnitude).astype(value.dtype) for _ in range(shards - 1)]
        terms.append(value - sum(terms))
    else:  # each term at most (least) the value, one term holding it, element by element
        owner = rng.integers(0, shards, value.shape)
        sign = -1.0 if partial.op == "max" else 1.0
        step = max(float(np.max(np.abs(value), initial=0.0)), float(np.finfo(value.dtype).tiny))
        terms = [np.where(owner == k, value, value + sign * step * rng.uniform(0.1, 1.0, value.shape)).astype(value.dtype) for k in range(shards)]
    try:
        pieces = [executor.run(call, [term if index == partial.input else x for index, x in enumerate(inputs)]) for term in terms]
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


# ---------------------------------------------------------------------------- whole graphs


def verify_graph(
    graph: Graph,
    rules: Mapping[str, Rule],
    oracle: DTensorOracle,
    executor: OpExecutor,
    *,
    seed: int = 20261130,
    model: str = "",
) -> OracleReport:
    """Compare the rule of every distinct op signature in ``graph`` (``rules``: node name -> rule)."""
    seen: dict[str, SignatureComparison] = {}
    for node in graph.nodes:
        rule = rules.get(node.name)
        if rule is None:
            continue
        key = signature_of(op_call(graph, node)).key
        if key not in seen:
            seen[key] = compare_node(node, graph, rule, oracle, executor, seed=seed)
    return _report((model or graph.name,), len(graph.nodes), len(rules), oracle.mesh_size, seen.values())


def merge_reports(reports: Iterable[OracleReport]) -> OracleReport:
    """One report over several graphs; a signature shared by two graphs is counted once."""
    reports = list(reports)
    if not reports:
        raise OracleError("there are no reports to merge: verify at least one model")
    seen: dict[str, SignatureComparison] = {}
    for report in reports:
        for comparison in report.comparisons:
            seen.setdefault(comparison.signature, comparison)
    return _report(
        tuple(model for report in reports for model in report.models),
        sum(report.nodes for report in reports),
        sum(report.nodes_with_rule for report in reports),
        reports[0].mesh_size,
        seen.values(),
    )


def _report(models: tuple[str, ...], nodes: int, nodes_with_rule: int, mesh_size: int, comparisons: Iterable[SignatureComparison]) -> OracleReport:
    by_op: dict[str, list[SignatureComparison]] = defaultdict(list)
    for comparison in comparisons:
        by_op[comparison.op_target].append(comparison)
    ops = []
    for op_target in sorted(by_op):
        group = by_op[op_target]
        checks = [check for comparison in group for check in comparison.checks]
        examples: list[str] = []
        for comparison in group:
            examples += [f"wrong: {check.what} ({check.detail}, max error {check.max_abs_error:.3g})" for check in comparison.wrong]
            examples += [f"only ours: {finding.strategy} ({finding.reason})" for finding in comparison.only_ours]
            examples += [f"only DTensor: {finding.strategy} ({finding.reason})" for finding in comparison.only_dtensor]
        ops.append(
            OpReport(
                op_target=op_target,
                signatures=len(group),
                dtensor_registered=sum(comparison.dtensor == "registered" for comparison in group),
                agreements=sum(len(comparison.agreements) for comparison in group),
                only_ours=sum(len(comparison.only_ours) for comparison in group),
                only_dtensor=sum(len(comparison.only_dtensor) for comparison in group),
                checks_passed=sum(check.ok is True for check in checks),
                checks_failed=sum(check.ok is False for check in checks),
                checks_skipped=sum(check.ok is None for check in checks),
                dtensor_wrong=sum(len(comparison.dtensor_wrong) for comparison in group),
                examples=tuple(dict.fromkeys(examples))[:6],
            )
        )
    ordered = tuple(sorted(comparisons, key=lambda comparison: (comparison.op_target, comparison.signature)))
    return OracleReport(models, nodes, nodes_with_rule, mesh_size, tuple(ops), ordered)
