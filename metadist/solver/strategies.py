"""Strategies: the per-axis choices of one node, enumerated jointly over all mesh axes.

On every mesh axis a node takes one factor of its rule, or replicates, or lets a
``Partial`` input pass through (a ``PartialPass`` of the rule). Choices are enumerated
jointly (two axes may take the same factor: its dims are split over both). A joint choice
whose split does not divide a dim evenly is excluded and counted. A node without a rule can
only replicate. Graph inputs choose a sharding: each axis replicates or shards one dim.

An affine factor (``Factor.partial_inputs``, e.g. addmm's ``k`` with the bias) puts those
inputs ``Partial(sum)`` on the axes that take it (:func:`metadist.ir.plan.strategy_from_choices`);
a replicated producer reaches that for free (the lowering's ``zero_partial``).

A halo factor (``Concat(dim, halo=h)``: convolution and pooling split along a spatial dim) is
planned like a plain split, on one axis at most, where every piece is at least ``h`` wide and
its output trims are whole; the halo exchange before the node is priced with its compute
(:func:`metadist.cost.comm.halo_exchange_seconds`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from ..ir import Mesh, Replicate, Rule, Shard, TensorSpec
from ..ir.rule import halo_trim
from ..ir.plan import REPLICATE, AxisChoice, NodeStrategy, PlanError, strategy_from_choices
from .errors import SolverError


@dataclass(frozen=True)
class StrategySet:
    """The valid strategies of one node (or graph input) and how many were excluded."""

    strategies: tuple[NodeStrategy, ...]
    excluded_indivisible: int = 0
    excluded_inexpressible: int = 0
    """Joint choices a plan cannot express (block-cyclic recombination; one halo factor on two axes)."""


def replicated_strategy(n_inputs: int, output_present: Sequence[bool], mesh: Mesh) -> NodeStrategy:
    """Every axis replicates: all inputs and outputs ``Replicate()``."""
    replicated = tuple(Replicate() for _ in range(mesh.ndim))
    return NodeStrategy(
        choices=(REPLICATE,) * mesh.ndim,
        inputs=(replicated,) * n_inputs,
        outputs=tuple(replicated if present else None for present in output_present),
    )


def _axis_options(rule: Rule) -> list[AxisChoice]:
    options = [REPLICATE]
    options += [AxisChoice("factor", index) for index in range(len(rule.factors))]
    options += [AxisChoice("partial", item.input, item.op) for item in rule.partial_passes]
    return options


def _divides(rule: Rule, choices: tuple[AxisChoice, ...], mesh: Mesh, input_shapes, output_shapes) -> bool:
    pieces: dict[int, int] = {}
    for axis, choice in enumerate(choices):
        if choice.kind == "factor":
            pieces[choice.index] = pieces.get(choice.index, 1) * mesh.shape[axis]
    for index, count in pieces.items():
        factor = rule.factors[index]
        sizes = [input_shapes[slot][dim] for slot, dim in enumerate(factor.inputs) if dim is not None]
        sizes += [
            output_shapes[slot][combine.dim]
            for slot, combine in enumerate(factor.outputs)
            if combine is not None and hasattr(combine, "dim") and output_shapes[slot] is not None
        ]
        if any(size % count for size in sizes):
            return False
        if factor.halo and not _halo_fits(factor, count, input_shapes, output_shapes):
            return False
    return True


def _halo_fits(factor, count: int, input_shapes, output_shapes) -> bool:
    """Every piece is at least the halo wide and every output trim ``h * m / n`` is whole."""
    size = factor.size(tuple(input_shapes))
    if size // count < factor.halo:
        return False
    return all(
        halo_trim(factor.halo, size, output_shapes[slot][combine.dim]) is not None
        for slot, combine in enumerate(factor.outputs)
        if combine is not None and output_shapes[slot] is not None
    )


def node_strategies(
    rule: Rule | None,
    input_shapes: tuple[tuple[int, ...], ...],
    output_shapes: tuple[tuple[int, ...] | None, ...],
    mesh: Mesh,
) -> StrategySet:
    """All valid joint strategies of a node with ``rule`` on ``mesh`` (replicate-all first)."""
    if rule is None:
        return StrategySet((replicated_strategy(len(input_shapes), [s is not None for s in output_shapes], mesh),))
    if len(rule.input_ranks) != len(input_shapes) or len(rule.output_ranks) != len(output_shapes):
        raise SolverError(
            f"rule {rule} has {len(rule.input_ranks)} inputs and {len(rule.output_ranks)} outputs but the node reads "
            f"{len(input_shapes)} tensors and makes {len(output_shapes)}; the rule does not belong to this node "
            "(discover the rules for this graph again)"
        )
    strategies, excluded, inexpressible = [], 0, 0
    for choices in itertools.product(_axis_options(rule), repeat=mesh.ndim):
        if not _divides(rule, choices, mesh, input_shapes, output_shapes):
            excluded += 1
            continue
        try:
            strategies.append(strategy_from_choices(rule, choices))
        except PlanError:  # chunk recombination, a halo factor on two axes: counted, reported, not planned
            inexpressible += 1
    if not strategies:
        strategies.append(replicated_strategy(len(input_shapes), [s is not None for s in output_shapes], mesh))
    return StrategySet(tuple(strategies), excluded, inexpressible)


def input_strategies(spec: TensorSpec, mesh: Mesh, allowed: frozenset | None = None) -> StrategySet:
    """Shardings a graph input may start the step in: each axis replicates or shards one dim."""
    options = [Replicate()] + [Shard(dim) for dim in range(spec.rank)]
    strategies, excluded = [], 0
    for sharding in itertools.product(options, repeat=mesh.ndim):
        if allowed is not None and sharding not in allowed:
            continue
        pieces = [1] * spec.rank
        for axis, placement in enumerate(sharding):
            if isinstance(placement, Shard):
                pieces[placement.dim] *= mesh.shape[axis]
        if any(size % count for size, count in zip(spec.shape, pieces)):
            excluded += 1
            continue
        strategies.append(NodeStrategy(choices=(), inputs=(), outputs=(tuple(sharding),)))
    if not strategies:
        replicated = tuple(Replicate() for _ in range(mesh.ndim))
        strategies.append(NodeStrategy(choices=(), inputs=(), outputs=(replicated,)))
    return StrategySet(tuple(strategies), excluded)
