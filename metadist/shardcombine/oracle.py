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
   ``Partial`` input with every other input replicated is a partial pass, several ``Partial(sum)`` inputs so a joint
   pass. The comparison counts agreements, strategies only we find,
   and strategies only DTensor has, each with the reason when one is known (DTensor's
   strategy needs several ``Partial(max)`` inputs at once, ``Partial(avg)``, a size-1 dim...).

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
from typing import Any, Iterator, Mapping, Sequence

from ..ir import Concat, Factor, Graph, Identity, Literal, Node, PartialPass, Reduce, Rule, RuleError, ValueRef
from .discover import DiscoveryConfig
from .errors import OracleError
from .executor import OpCall, OpExecutor, op_call
from .oracle_report import (
    DTENSOR_WRONG,
    REPLICATE,
    ExecutionCheck,
    OpReport,
    OracleReport,
    SignatureComparison,
    Strategy,
    StrategyFinding,
    merge_reports,
    report_of,
    rule_strategies,
)
from .recheck import check_rule_by_execution
from .signature import signature_of

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

MAX_PLACEMENT_COMBINATIONS = 512
"""Past this many input-placement combinations an op strategy function is offered all placements at once."""


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
    outcome = {check.what: check for check in checks}
    dtensor = oracle.strategies(node, graph)
    status = dtensor if isinstance(dtensor, str) else "registered"
    theirs = set() if isinstance(dtensor, str) else {_align(strategy, rule) for strategy in dtensor}
    ours = _blank_unplaced(ours, theirs)
    absent = status if isinstance(dtensor, str) else "DTensor does not list it"
    agreements = sorted(strategy for strategy in ours if strategy in theirs)
    only_ours = [StrategyFinding(strategy, _our_reason(outcome.get(label), absent)) for strategy, label in ours.items() if strategy not in theirs]
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
        ops = {strategy.inputs[index][2:-1] for index in partial}
        if len(partial) > 1 and ops == {"sum"}:  # P(sum) in several inputs at once: a joint pass
            return Rule(rule.input_ranks, rule.output_ranks, (), (PartialPass(partial[0], "sum", partial[1:]),))
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


def _blank_unplaced(ours: dict[Strategy, str], theirs: set[Strategy]) -> dict[Strategy, str]:
    """Our ``R`` outputs blanked where DTensor places nothing in any strategy (the GPU attention kernels'
    philox seed and offset): a replicated scalar against no placement is no disagreement about splitting."""
    if not theirs:
        return ours
    width = len(next(iter(theirs)).outputs)
    unplaced = {p for p in range(width) if all(len(s.outputs) == width and s.outputs[p] is None for s in theirs)}
    if not unplaced:
        return ours
    blanked = {}
    for strategy, label in ours.items():
        if len(strategy.outputs) == width:
            strategy = Strategy(strategy.inputs, tuple(None if p in unplaced and out == REPLICATE else out
                                                       for p, out in enumerate(strategy.outputs)))
        blanked[strategy] = label
    return blanked


def _our_reason(check: ExecutionCheck | None, why_absent: str) -> str:
    if check is not None and check.ok is False:
        return f"WRONG: fails the execution re-check; {why_absent}"
    if check is None or check.ok is None:
        return f"not re-checked here ({check.detail if check else 'no check'}); {why_absent}"
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
    if len(partial) > 1 and not sharded and {strategy.inputs[index] for index in partial} != {"P(sum)"}:
        return "needs several Partial inputs at once, not all Partial(sum) (a joint partial pass is Partial(sum) only)"
    if partial and sharded:
        ops = {strategy.inputs[index] for index in partial} | {out for out in strategy.outputs if out is not None}
        if ops != {"P(sum)"}:
            return "mixes a Partial input with Shard inputs, not as an affine factor (Partial(sum) inputs and outputs only)"
        if input_dtypes and any(not input_dtypes[index].startswith(("float", "bfloat", "complex")) for index in partial):
            return "a Partial integer input (discovery looks for affine factors of floating inputs only)"
    if partial and not sharded and input_dtypes and any(not input_dtypes[index].startswith(("float", "bfloat", "complex"))
                                                        for index in partial):
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
    return report_of((model or graph.name,), len(graph.nodes), len(rules), oracle.mesh_size, seen.values())
