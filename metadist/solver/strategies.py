"""Strategies: the per-axis choices of one node, enumerated jointly over all mesh axes.

On every mesh axis a node takes one factor of its rule, or replicates, or lets a
``Partial`` input pass through (a ``PartialPass`` of the rule). Choices are enumerated
jointly (two axes may take the same factor: its dims are split over both). A node without a
rule can only replicate. Graph inputs choose a sharding: each axis replicates or shards one dim.

**Uneven splits.** A split that a dim's size does not divide cuts it as ``torch.chunk`` and
DTensor do (:mod:`metadist.lowering.shapes`: pieces of ``ceil(n / m)``, the last ones shorter or
empty). ShardCombine checks every factor on uneven pieces where the op runs on them, so a
factor whose dims all have the same size ``n`` (every input and ``Concat`` output it occupies)
keeps its meaning on chunk pieces: each piece of each of those tensors is the same range of
``n``. A joint choice with an uneven split is excluded, and counted by reason
(:data:`UNEVEN_REASONS`), when

- ``sizes_differ``: the factor occupies dims of different sizes (a reshape merging or splitting
  the split dim, ``split``, ``cat`` along it, a strided window): chunk pieces of one size are
  not the pieces of the other, and no local rewrite of the op's arguments makes them so;
- ``halo``: a halo factor (its exchange needs equal pieces, at least the halo wide);
- ``empty_max_min``: a factor that reduces with ``max``/``min`` would run on an empty piece
  (the kernels refuse an empty reduction);
- ``empty_identity``: a factor with an output every piece computes whole (:class:`~metadist.ir.rule.Identity`)
  would run on an empty piece. ShardCombine verifies a rule on non-empty pieces only, and a kernel given an empty
  input may skip the work its other outputs need: ``convolution_backward`` split along 3 input channels over 2x2
  (pieces 2 / 1, 1 / 0) returned a bias gradient of zeros on the rank with no channel, which the plan took as the
  whole gradient (ConvNeXt's patch embedding, on one rank of four, whose replicated parameters then drifted from
  the others' from the second step on).

Graph inputs may start in any uneven sharding (a batch of 6 over 4 devices: rows 2, 2, 2, 0).

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
import math
from dataclasses import dataclass
from typing import Sequence

from ..ir import Mesh, Replicate, Rule, Shard, TensorSpec
from ..ir.rule import Concat, Identity, Reduce, halo_trim
from ..lowering.shapes import is_even, piece_lengths
from ..ir.plan import REPLICATE, AxisChoice, NodeStrategy, PlanError, strategy_from_choices
from .errors import SolverError


#: Why a joint choice with an uneven split is excluded (see the module docstring).
UNEVEN_REASONS = {
    "sizes_differ": "the factor occupies dims of different sizes (a reshape, split or cat of the split dim): "
                    "torch.chunk pieces of one are not pieces of the other",
    "halo": "a halo factor needs equal pieces, each at least as wide as the halo, with whole output trims",
    "empty_max_min": "a max/min reduction would run on an empty piece",
    "empty_identity": "an output every piece computes whole would come from an empty piece",
    "runtime_even_only": "the plan is for a runtime that takes even shards only (JAX's in and out shardings)",
}


@dataclass(frozen=True)
class StrategySet:
    """The valid strategies of one node (or graph input) and how many were excluded."""

    strategies: tuple[NodeStrategy, ...]
    excluded_uneven: tuple[tuple[str, int], ...] = ()
    """Joint choices with an uneven split that are excluded: ``(reason, count)`` per reason of :data:`UNEVEN_REASONS`."""
    excluded_inexpressible: int = 0
    """Joint choices a plan cannot express (block-cyclic recombination; one halo factor on two axes)."""
    uneven: int = 0
    """Strategies kept that split some dim unevenly."""

    @property
    def excluded_indivisible(self) -> int:
        """All excluded joint choices with an uneven split."""
        return sum(count for _, count in self.excluded_uneven)


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
    options += [AxisChoice("partial", item.input, item.op, item.joint) for item in rule.partial_passes]
    return options


def _split_check(rule: Rule, choices: tuple[AxisChoice, ...], mesh: Mesh, input_shapes, output_shapes) -> str:
    """``"even"``, ``"uneven"`` (plannable, some split uneven), or the reason (:data:`UNEVEN_REASONS`) it is excluded."""
    axes_of: dict[int, list[int]] = {}
    for axis, choice in enumerate(choices):
        if choice.kind == "factor":
            axes_of.setdefault(choice.index, []).append(mesh.shape[axis])
    verdict = "even"
    for index, axis_sizes in axes_of.items():
        factor = rule.factors[index]
        sizes = _occupied_sizes(factor, input_shapes, output_shapes)
        count = math.prod(axis_sizes)
        if all(size % count == 0 for size in sizes):
            if factor.halo and not _halo_fits(factor, count, input_shapes, output_shapes):
                return "halo"
            continue
        if factor.halo:
            return "halo"
        if len(set(sizes)) != 1:
            return "sizes_differ"
        if 0 in piece_lengths(sizes[0], axis_sizes):
            if any(isinstance(out, Reduce) and out.op != "sum" for out in factor.outputs):
                return "empty_max_min"
            if any(isinstance(out, Identity) and output_shapes[slot] is not None for slot, out in enumerate(factor.outputs)):
                return "empty_identity"
        verdict = "uneven"
    return verdict


def _occupied_sizes(factor, input_shapes, output_shapes) -> list[int]:
    """The global sizes of every dim the factor occupies: in its inputs, and in its Concat outputs."""
    sizes = [input_shapes[slot][dim] for slot, dim in enumerate(factor.inputs) if dim is not None]
    sizes += [
        output_shapes[slot][combine.dim]
        for slot, combine in enumerate(factor.outputs)
        if isinstance(combine, Concat) and output_shapes[slot] is not None
    ]
    return sizes


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
    uneven_shards: bool = True,
) -> StrategySet:
    """All valid joint strategies of a node with ``rule`` on ``mesh`` (replicate-all first).

    ``uneven_shards``: False excludes every uneven split (reason ``runtime_even_only``).
    """
    if rule is None:
        return StrategySet((replicated_strategy(len(input_shapes), [s is not None for s in output_shapes], mesh),))
    if len(rule.input_ranks) != len(input_shapes) or len(rule.output_ranks) != len(output_shapes):
        raise SolverError(
            f"rule {rule} has {len(rule.input_ranks)} inputs and {len(rule.output_ranks)} outputs but the node reads "
            f"{len(input_shapes)} tensors and makes {len(output_shapes)}; the rule does not belong to this node "
            "(discover the rules for this graph again)"
        )
    strategies, excluded, inexpressible, uneven = [], {}, 0, 0
    for choices in itertools.product(_axis_options(rule), repeat=mesh.ndim):
        verdict = _split_check(rule, choices, mesh, input_shapes, output_shapes)
        if verdict == "uneven" and not uneven_shards:
            verdict = "runtime_even_only"
        if verdict not in ("even", "uneven"):
            excluded[verdict] = excluded.get(verdict, 0) + 1
            continue
        try:
            strategies.append(strategy_from_choices(rule, choices))
        except PlanError:  # chunk recombination, a halo factor on two axes: counted, reported, not planned
            inexpressible += 1
            continue
        uneven += verdict == "uneven"
    if not strategies:
        strategies.append(replicated_strategy(len(input_shapes), [s is not None for s in output_shapes], mesh))
    return StrategySet(tuple(strategies), tuple(sorted(excluded.items())), inexpressible, uneven)


def input_strategies(spec: TensorSpec, mesh: Mesh, allowed: frozenset | None = None, uneven_shards: bool = True) -> StrategySet:
    """Shardings a graph input may start the step in: each axis replicates or shards one dim (evenly, or not
    unless ``uneven_shards`` is False)."""
    options = [Replicate()] + [Shard(dim) for dim in range(spec.rank)]
    strategies, uneven, refused = [], 0, 0
    for sharding in itertools.product(options, repeat=mesh.ndim):
        if allowed is not None and sharding not in allowed:
            continue
        even = is_even(spec.shape, sharding, mesh)
        if not even and not uneven_shards:
            refused += 1
            continue
        strategies.append(NodeStrategy(choices=(), inputs=(), outputs=(tuple(sharding),)))
        uneven += not even
    if not strategies:
        replicated = tuple(Replicate() for _ in range(mesh.ndim))
        strategies.append(NodeStrategy(choices=(), inputs=(), outputs=(replicated,)))
    return StrategySet(tuple(strategies), (("runtime_even_only", refused),) if refused else (), uneven=uneven)
