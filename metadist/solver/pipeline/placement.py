"""Which stage runs each node, given where the forward pass is cut.

- **forward** nodes: the stage of the segment they fall in (a node that reads only parameters
  runs with its first reader);
- **backward** nodes, in graph order: a node that reads forward values or parameters is
  *anchored* to the last stage whose forward reads one of them (where the forward op it
  differentiates ran); it may not run later than any backward value it reads was made (the
  backward pass flows from the last stage down), so its stage is the smaller of the two. A
  node that reads only backward values (a view, a sum) runs as early as its inputs allow, then,
  in reverse order, sinks to the highest stage among its readers (and, for a gradient, its
  parameter's owner) when its inputs are no larger than its results (a view: yes; a sum of two
  gradients, or a bias gradient's reduction: no, sending the result is cheaper);
- a gradient summed from parts made on different stages (a weight tied between the first and
  the last stage) is summed after accumulation instead: each part is accumulated where it is
  made and the sum joins the update (sums commute with accumulation);
- **update** nodes run on the owner of the parameter they update: the first stage whose forward
  reads it. A stage that reads a parameter it does not own holds a copy, refreshed after each
  update. An update node that serves parameters of several stages (clipping by a global norm)
  is an error.

Floating nodes are not placed here: each stage computes those it reads (:mod:`.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ...ir import Graph, Role
from ..errors import PipelineError
from .cuts import parameter_only_stages
from .regions import Regions

__all__ = ["LINEAR_SUM_OPS", "Placement", "place_nodes"]

LINEAR_SUM_OPS = frozenset({"aten.add.Tensor", "jax.lax.add"})
"""Ops whose result is the sum of their two tensor inputs (without an ``alpha``): a gradient they make can be summed
after accumulation instead of per microbatch."""


@dataclass(frozen=True)
class Placement:
    """A stage and a phase for every placed node, who holds and who owns each state input."""

    stages: int
    stage: Mapping[str, int]
    phase: Mapping[str, str]
    """``forward``, ``backward`` or ``update``."""
    accumulated: tuple[str, ...]
    """Values accumulated over microbatches (the regions' gradients, or their parts once a sum moved to the update)."""
    holders: Mapping[str, tuple[int, ...]]
    """State input -> the stages holding it."""
    owner: Mapping[str, int]
    """State input -> the stage that updates it."""


def place_nodes(graph: Graph, regions: Regions, forward_stage: Mapping[str, int], stages: int) -> Placement:
    """Place every forward, backward and update node (see the module docstring)."""
    stage = dict(forward_stage)
    parameter_only_stages(graph, regions, stage)
    phase = {name: "forward" for name in regions.forward}
    phase.update({name: "backward" for name in regions.backward})
    phase.update({name: "update" for name in regions.update})
    holders, owner = _state_holders(graph, regions, stage)
    anchored = _place_backward(graph, regions, stage, holders, stages)
    accumulated = _sum_after_accumulation(graph, regions, stage, phase)
    _sink_backward(graph, regions, stage, phase, owner, anchored)
    _place_update(graph, regions, stage, phase, owner)
    for name, place in stage.items():
        if not 0 <= place < stages:
            raise PipelineError(f"internal: node {name!r} placed on stage {place} of {stages}")
    return Placement(stages, stage, phase, accumulated, {k: tuple(sorted(v)) for k, v in holders.items()}, owner)


def _state_holders(graph: Graph, regions: Regions, stage: dict[str, int]):
    """Holders (the stages whose forward reads a parameter) and owners (the first of them) of every state input."""
    forward = set(regions.forward)
    holders: dict[str, set[int]] = {}
    for graph_input in graph.inputs_by_role(Role.PARAM):
        name = graph_input.value.name
        holders[name] = {stage[user.name] for user in graph.users(name) if user.name in forward}
    owner = {name: min(stages) for name, stages in holders.items() if stages}
    for graph_input in graph.inputs_by_role(Role.OPTIM_STATE):
        param = graph_input.source
        if param in owner:
            owner[graph_input.value.name] = owner[param]
            holders[graph_input.value.name] = {owner[param]}
    return holders, owner


def _forward_reach(graph: Graph, regions: Regions, stage: Mapping[str, int], holders) -> dict[str, int]:
    """For each forward value and held parameter: the last stage whose forward reads it (or that makes it)."""
    forward = set(regions.forward)
    reach: dict[str, int] = {name: max(found) for name, found in holders.items() if found}
    for name in regions.forward:
        for value in graph.node(name).output_values:
            readers = [stage[user.name] for user in graph.users(value.name) if user.name in forward]
            reach[value.name] = max([stage[name], *readers])
    return reach


def _place_backward(graph, regions: Regions, stage: dict[str, int], holders, stages: int) -> set[str]:
    """Anchored nodes where their forward ran (or earlier), the others as early as their inputs allow."""
    reach = _forward_reach(graph, regions, stage, holders)
    backward = set(regions.backward)
    anchored: set[str] = set()
    for name in regions.backward:
        node = graph.node(name)
        earliest = min((stage[p.name] for p in map(graph.producer, node.input_names) if p is not None and p.name in backward),
                       default=stages - 1)
        anchors = [reach[value] for value in node.input_names if value in reach]
        if anchors:
            anchored.add(name)
        stage[name] = min(max(anchors), earliest) if anchors else earliest
    return anchored


def _sink_backward(graph, regions: Regions, stage: dict[str, int], phase, owner, anchored: set[str]) -> None:
    """Unanchored backward nodes down to where their results are read (a gradient: its parameter's owner)."""
    backward = {name for name in regions.backward if phase[name] == "backward"}
    gradient_of = {out.name: out.source.removeprefix("grad:") for out in graph.outputs_by_role(Role.GRAD)}
    for name in reversed(regions.backward):
        if name in anchored or name not in backward:
            continue
        node = graph.node(name)
        targets = [stage[user.name] for value in node.output_values for user in graph.users(value.name)
                   if user.name in backward]
        targets += [owner[gradient_of[value.name]] for value in node.output_values
                    if value.name in gradient_of and gradient_of[value.name] in owner]
        read_bytes = sum(graph.value(value).spec.nbytes for value in set(node.input_names)
                         if graph.producer(value) is not None and graph.producer(value).name in backward)
        made_bytes = sum(value.spec.nbytes for value in node.output_values)
        if targets and read_bytes <= made_bytes:  # sending its inputs down costs no more than sending its results
            stage[name] = min(stage[name], max(targets))


def _sum_after_accumulation(graph: Graph, regions: Regions, stage: dict[str, int], phase: dict[str, str]) -> tuple[str, ...]:
    """Move gradient sums whose parts come from different stages into the update; their parts are accumulated."""
    accumulated = list(regions.accumulated)
    queue = list(accumulated)
    while queue:
        value = queue.pop()
        node = graph.producer(value)
        if node is None or phase.get(node.name) != "backward" or not _is_plain_sum(node):
            continue
        parts = node.input_names
        makers = [graph.producer(part) for part in parts]
        if any(maker is None or phase.get(maker.name) != "backward" for maker in makers):
            continue
        if len({stage[maker.name] for maker in makers}) < 2:
            continue
        if any(user.name != node.name and phase.get(user.name) == "backward" for user in graph.users(value)):
            continue  # the sum is read per microbatch too
        phase[node.name] = "update"
        accumulated.remove(value)
        for part in parts:
            if part not in accumulated:
                accumulated.append(part)
                queue.append(part)
    return tuple(accumulated)


def _is_plain_sum(node) -> bool:
    return (node.op.target in LINEAR_SUM_OPS and len(node.input_names) == 2 and len(node.args) == 2
            and all(key != "alpha" or value == 1 for key, value in node.kwargs))


def _place_update(graph: Graph, regions: Regions, stage: dict[str, int], phase: Mapping[str, str], owner) -> None:
    """Each update node on the one stage whose parameters it serves."""
    update = [node.name for node in graph.nodes if phase.get(node.name) == "update"]
    serves: dict[str, set[int]] = {name: set() for name in update}
    made_by = {value.name: node.name for node in graph.nodes for value in node.output_values}
    for output in graph.outputs:
        maker = made_by.get(output.name)
        if output.replaces is not None and maker in serves:
            if output.replaces not in owner:
                raise PipelineError(f"state %{output.replaces} is updated but no stage's forward reads its parameter; "
                                    "a pipeline cannot place its update")
            serves[maker].add(owner[output.replaces])
        elif output.role is Role.GRAD and maker in serves:
            serves[maker].add(owner.get(output.source.removeprefix("grad:"), 0))
    index = {name: position for position, name in enumerate(update)}
    for name in reversed(update):
        for value in graph.node(name).input_names:
            maker = made_by.get(value)
            if maker in serves and index[maker] < index[name]:
                serves[maker] |= serves[name]
    for name in update:
        places = serves[name]
        if len(places) > 1:
            raise PipelineError(
                f"update node {name!r} ({graph.node(name).op.target}) serves parameters that live on different stages: the "
                "update combines them (gradient clipping by a global norm does). "
                "A pipeline updates each stage's parameters on their own; plan without a pp axis"
            )
        stage[name] = places.pop() if places else 0
