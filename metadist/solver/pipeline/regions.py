"""The regions of a captured step that a pipeline runs differently: per microbatch, or once per step.

The step is captured on one microbatch, with each parameter's gradient marked where autograd
accumulates it (the graph's ``grad`` outputs, before any clipping or the optimizer). Then:

- the **microbatch region** is every node the loss or a marked gradient depends on; it runs once
  per microbatch. Its **forward** part is what the loss depends on, the **backward** part the rest;
- the **update region** is every other node (the optimizer: everything computed from optimizer
  state or hyperparameters); it runs once per step, on the accumulated gradients;
- **accumulated values** are the marked gradients: the only values the update may read from the
  microbatch region. Each microbatch's are weighted and summed (see :attr:`Regions.loss_divisor`);
- **floating** nodes read nothing but the batch, constants, read-only buffers and hyperparameters
  (masks, position ids, the optimizer's scalar factors): every stage that needs them computes them;
- **random** nodes (dropout masks) are drawn whole for the full batch once per step, in graph order,
  as one device draws them, and each microbatch reads its slice.

Anything else crossing from the microbatch region into the update (a gradient clipped by a norm
over all parameters, a user output) makes :func:`split_regions` raise a :class:`PipelineError`
saying what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import Graph, Role
from ...lowering.program import SHAPE_ONLY_RANDOM_OPS
from ..errors import PipelineError

__all__ = ["ANYWHERE_ROLES", "Regions", "split_regions"]

ANYWHERE_ROLES = frozenset({Role.BATCH, Role.CONSTANT, Role.HYPERPARAMETER, Role.BUFFER})
"""Graph inputs every stage has: the batch (every rank receives it), constants, hyperparameters and read-only
buffers (each stage that reads one holds its own copy)."""


@dataclass(frozen=True)
class Regions:
    """Node names by region, in graph order, and the values that tie the regions together."""

    forward: tuple[str, ...]
    """Microbatch nodes the loss depends on (not floating, not random)."""
    backward: tuple[str, ...]
    """The other microbatch nodes (not floating, not random)."""
    update: tuple[str, ...]
    """Update nodes (not floating)."""
    floating: tuple[str, ...]
    """Nodes computed wherever they are read (see the module docstring)."""
    random: tuple[str, ...]
    """Random nodes of the microbatch region, drawn whole once per step."""
    accumulated: tuple[str, ...]
    """The marked gradients, in graph output order."""
    loss: str
    """The loss value (the step's one ``loss`` output)."""
    loss_divisor: str | None
    """The value the loss is a mean over (a count of targets), or None: each microbatch's gradients are then
    weighted by its divisor over the sum of all of them (None: 1 / microbatches)."""
    anywhere: frozenset[str]
    """Values every stage has or computes: anywhere inputs, random and floating outputs."""
    batch_dependent: frozenset[str]
    """Anywhere values that differ per microbatch: batch inputs, random outputs, floating values computed from them."""
    parameter_only: frozenset[str] = frozenset()
    """Forward nodes that read parameters and nothing that differs per microbatch (a weight's transpose): they run
    on the stage of their first reader, never on the other side of a cut from it."""

    @property
    def microbatch(self) -> frozenset[str]:
        return frozenset(self.forward) | frozenset(self.backward)


def split_regions(graph: Graph, loss_divisor: str | None = None) -> Regions:
    """The regions of ``graph`` (captured with its accumulated gradients marked as ``grad`` outputs)."""
    loss = _the_loss(graph)
    accumulated = tuple(output.name for output in graph.outputs_by_role(Role.GRAD))
    if not accumulated:
        raise PipelineError(
            "the captured step marks no gradients: a pipeline needs the step captured with raw_grads=True "
            "(each parameter's gradient as autograd accumulates it)"
        )
    _refuse_updated_buffers(graph)
    microbatch = _ancestors(graph, [loss, *accumulated])
    forward_all = _ancestors(graph, [loss])
    anywhere = {gi.value.name for gi in graph.inputs if gi.role in ANYWHERE_ROLES}
    batch = {gi.value.name for gi in graph.inputs if gi.role is Role.BATCH}
    random, floating, batch_dependent = [], [], set(batch)
    for node in graph.nodes:
        if node.op.is_random:
            _check_random(node, microbatch)
            random.append(node.name)
            anywhere.update(value.name for value in node.output_values)
            batch_dependent.update(value.name for value in node.output_values)
        elif all(name in anywhere for name in node.input_names):
            floating.append(node.name)
            anywhere.update(value.name for value in node.output_values)
            if batch_dependent.intersection(node.input_names):
                batch_dependent.update(value.name for value in node.output_values)
    fixed = set(random) | set(floating)
    forward, parameter_only = _sink_parameter_views(
        graph, [n.name for n in graph.nodes if n.name in forward_all and n.name not in fixed], anywhere - batch_dependent)
    backward = tuple(n.name for n in graph.nodes if n.name in microbatch and n.name not in forward_all and n.name not in fixed)
    update = tuple(n.name for n in graph.nodes if n.name not in microbatch and n.name not in fixed)
    regions = Regions(forward, backward, update, tuple(floating), tuple(random), accumulated, loss, loss_divisor,
                      frozenset(anywhere), frozenset(batch_dependent), parameter_only)
    _check_update_reads(graph, regions)
    return regions


def _sink_parameter_views(graph: Graph, forward: list[str], fixed_values: set[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    """The forward order with each node that reads only parameters (a weight's transpose) and values the same for
    every microbatch (``fixed_values``) moved right before its first reader, so that a cut never falls between a
    weight and its use."""
    params = {gi.value.name for gi in graph.inputs if gi.role is Role.PARAM}
    of_params: set[str] = set()
    for name in forward:
        node = graph.node(name)
        if node.input_names and all(v in params or v in fixed_values or v in of_params for v in node.input_names):
            of_params.update(value.name for value in node.output_values)
    sunk = [name for name in forward if graph.node(name).output_values
            and all(value.name in of_params for value in graph.node(name).output_values)]
    order = [name for name in forward if name not in set(sunk)]
    for name in reversed(sunk):
        readers = {user.name for value in graph.node(name).output_values for user in graph.users(value.name)}
        first = next((index for index, other in enumerate(order) if other in readers), len(order))
        order.insert(first, name)
    return tuple(order), frozenset(sunk)


def _the_loss(graph: Graph) -> str:
    losses = graph.outputs_by_role(Role.LOSS)
    others = graph.outputs_by_role(Role.ACTIVATION)
    if len(losses) != 1 or others:
        raise PipelineError(
            f"a pipeline runs the step per microbatch and returns the loss; this step returns {len(losses)} loss(es) "
            f"and {len(others)} other tensor(s). Return exactly one scalar loss (other results cannot be combined "
            "across microbatches)"
        )
    return losses[0].name


def _refuse_updated_buffers(graph: Graph) -> None:
    roles = {gi.value.name: gi.role for gi in graph.inputs}
    updated = [out.replaces for out in graph.outputs if out.replaces and roles[out.replaces] is Role.BUFFER]
    if updated:
        raise PipelineError(
            f"the step updates buffers ({', '.join(updated[:3])}), such as batch-norm statistics: per microbatch they "
            "would be updated from each microbatch alone, in schedule order. Plan without a pp axis, or use a model "
            "without running statistics (layer norm)"
        )


def _ancestors(graph: Graph, values: list[str]) -> set[str]:
    """Names of the nodes the ``values`` depend on (their producers included)."""
    found: set[str] = set()
    stack = [graph.producer(name) for name in values]
    while stack:
        node = stack.pop()
        if node is None or node.name in found:
            continue
        found.add(node.name)
        stack.extend(graph.producer(name) for name in node.input_names)
    return found


def _check_random(node, microbatch: set[str]) -> None:
    if node.name not in microbatch:
        raise PipelineError(f"random node {node.name!r} ({node.op.target}) is part of the update; a pipeline draws random "
                            "tensors of the forward and backward passes only")
    if node.op.target not in SHAPE_ONLY_RANDOM_OPS:
        raise PipelineError(
            f"random node {node.name!r} ({node.op.target}) reads its input's values; a pipeline draws each random tensor "
            "whole for the full batch, which it can only do for ops that read shapes alone (dropout masks). Remove "
            "the op, or plan without a pp axis"
        )


def _check_update_reads(graph: Graph, regions: Regions) -> None:
    """The update reads from the microbatch region only accumulated gradients and batch-free floating values."""
    microbatch = regions.microbatch
    made_in = {value.name: node.name for node in graph.nodes for value in node.output_values}
    allowed = set(regions.accumulated)
    for name in regions.update:
        for value in graph.node(name).input_names:
            producer = made_in.get(value)
            if value in regions.batch_dependent:
                raise _update_reads_error(name, value, "depends on the batch")
            if producer in microbatch and value not in allowed:
                raise _update_reads_error(name, value, "is computed per microbatch and is not a gradient")


def _update_reads_error(node: str, value: str, why: str) -> PipelineError:
    return PipelineError(
        f"the update (node {node!r}) reads %{value}, which {why}: a pipeline runs the update once on the gradients "
        "accumulated over microbatches. Gradient clipping by a global norm and updates that read forward values "
        "are not supported with a pp axis yet; plan without one"
    )
