"""Activation recomputation as a graph rewrite: which layers may recompute, and the graph that does.

A **layer** is a repeated layer as :mod:`.shrink` labels it (the nodes reading one layer's state, and the
unlabelled nodes after them). Its **forward** is its labelled nodes up to the loss. Of what its forward
makes, the values the backward reads are **saved**; those also read by another layer's forward (the
layer's output, the next layer's input) are **kept** as they are, the checkpoint boundary
``torch.utils.checkpoint`` keeps too. Recomputing the layer means:

* its forward nodes that the other saved values depend on are **cloned** (``<name>.rc``, outputs
  ``<value>.rc``), in their order, just before the first backward node reading one of them;
* every backward read of a saved value reads the clone instead, so the original dies at its last forward
  reader and the memory it held between the layer's forward and its backward is free;
* clones read the originals of the layer's kept values, of values made outside the layer, and of its
  **random ops**: a random op is never cloned, its draws are kept (they are saved), so a recomputed layer
  replays exactly the numbers its forward drew, and the step computes what one device computes.

The rewrite is deterministic in the graph and the chosen layers, so a plan records the layers
(``Plan.recompute``) and a run rewrites the graph it captured the same way before lowering it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..ir import Graph, Node, Role, Value, ValueRef
from ..ir.graph import Arg
from .shrink import layer_runs

__all__ = ["CLONE_SUFFIX", "RecomputeLayer", "apply_recompute", "loss_position", "recompute_layers"]

CLONE_SUFFIX = ".rc"
"""Appended to the name of a recomputed node and of each value it makes."""


@dataclass(frozen=True)
class RecomputeLayer:
    """One layer that may recompute its forward before its backward."""

    layer: int
    cloned: tuple[str, ...]
    """Its forward nodes recomputed, in graph order."""
    saved: tuple[str, ...]
    """The values whose backward reads go to the clones (their originals die after the forward)."""
    insert_before: str
    """The first backward node reading one of them: the clones run just before it."""
    kept: tuple[str, ...]
    """The layer's values the backward still reads as they are: its boundary and its random draws."""


def loss_position(graph: Graph) -> int:
    """The position of the last node making a loss output; -1 without one."""
    position_of = {node.name: index for index, node in enumerate(graph.nodes)}
    producers = [graph.producer(out.name) for out in graph.outputs_by_role(Role.LOSS)]
    positions = [position_of[node.name] for node in producers if node is not None]
    return max(positions) if positions else -1


def recompute_layers(graph: Graph) -> tuple[RecomputeLayer, ...]:
    """The layers of ``graph`` that can recompute (see the module docstring), in layer order.

    A step without a loss output, without repeated layers, or whose layers' backward reads nothing the
    forward could recompute has none; nor is a layer whose forward ends with the loss offered (its backward starts
    at once: nothing to free). Layers a ``torch.utils.checkpoint`` already recomputes are not offered again: their
    backward reads only their inputs, which stay.
    """
    loss = loss_position(graph)
    if loss < 0:
        return ()
    forward: dict[int, list[int]] = {}
    for label, positions in layer_runs(graph, follow_state_copies=True):
        inside = [p for p in positions if p <= loss]
        if inside:
            forward.setdefault(label, []).extend(inside)
    position_of = {node.name: index for index, node in enumerate(graph.nodes)}
    layers = []
    for label in sorted(forward):
        found = _layer(graph, label, sorted(forward[label]), position_of, loss)
        if found is not None:
            layers.append(found)
    return tuple(layers)


def _layer(graph: Graph, label: int, positions: list[int], position_of: dict[str, int], loss: int) -> RecomputeLayer | None:
    """Layer ``label`` whose forward is the nodes at ``positions``, or None when recomputing it frees nothing."""
    if positions[-1] == loss:
        return None  # the layer computes the loss: its backward starts at once, recomputing it would free nothing
    names = [graph.nodes[p].name for p in positions]
    mine = set(names)
    graph_outputs = {out.name for out in graph.outputs}
    kept, saved = set(), []
    for name in names:
        node = graph.node(name)
        for value in node.output_values:
            readers = graph.users(value.name)
            backward = [r for r in readers if position_of[r.name] > loss]
            if not backward:
                continue
            boundary = value.name in graph_outputs or any(r.name not in mine and position_of[r.name] <= loss for r in readers)
            if boundary or node.op.is_random:
                kept.add(value.name)
            else:
                saved.append(value.name)
    if not saved:
        return None
    needed: set[str] = set()
    stack = [graph.producer(name).name for name in saved]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        for read in graph.node(name).input_names:
            producer = graph.producer(read)
            if producer is None or producer.name not in mine or read in kept or producer.op.is_random:
                continue
            stack.append(producer.name)
    cloned = tuple(name for name in names if name in needed)
    read_later = tuple(v.name for name in cloned for v in graph.node(name).output_values  # the backward's reads to move
                       if any(position_of[r.name] > loss for r in graph.users(v.name)))
    first = min(position_of[r.name] for v in read_later for r in graph.users(v) if position_of[r.name] > loss)
    return RecomputeLayer(label, cloned, read_later, graph.nodes[first].name, tuple(sorted(kept)))


def _renamed(arg: Arg, names: dict[str, str]) -> Arg:
    if isinstance(arg, ValueRef):
        return ValueRef(names.get(arg.name, arg.name))
    if isinstance(arg, tuple):
        return tuple(_renamed(item, names) for item in arg)
    return arg


def _with_inputs(node: Node, names: dict[str, str], name: str | None = None, suffix: str = "") -> Node:
    outputs = tuple(None if v is None else Value(v.name + suffix, v.spec) for v in node.outputs)
    return Node(name or node.name, node.op, tuple(_renamed(a, names) for a in node.args),
                tuple((k, _renamed(a, names)) for k, a in node.kwargs), outputs)


def apply_recompute(graph: Graph, layers: Iterable[int]) -> Graph:
    """``graph`` with the given layers recomputing their forward before their backward (module docstring).

    An unknown layer, or one that cannot recompute, is an error naming those that can.
    """
    wanted = sorted(set(layers))
    if not wanted:
        return graph
    found = {layer.layer: layer for layer in recompute_layers(graph)}
    unknown = [layer for layer in wanted if layer not in found]
    if unknown:
        raise ValueError(f"layers {unknown} of graph {graph.name!r} cannot recompute: the layers that can are {sorted(found)}")
    before: dict[str, list[RecomputeLayer]] = {}
    redirect: dict[str, str] = {}  # original value -> clone, for backward readers
    for layer in wanted:
        before.setdefault(found[layer].insert_before, []).append(found[layer])
    loss = loss_position(graph)
    nodes: list[Node] = []
    for position, node in enumerate(graph.nodes):
        for layer in before.get(node.name, ()):
            inner: dict[str, str] = {}
            for name in layer.cloned:
                original = graph.node(name)
                clone = _with_inputs(original, inner, name + CLONE_SUFFIX, CLONE_SUFFIX)
                nodes.append(clone)
                for value in original.output_values:
                    inner[value.name] = value.name + CLONE_SUFFIX
            redirect.update({value: inner[value] for value in layer.saved})
        nodes.append(node if position <= loss else _with_inputs(node, redirect))
    return Graph(graph.inputs, tuple(nodes), graph.outputs, graph.name, graph.routing)


# -- the ILP's terms -----------------------------------------------------------------


@dataclass(frozen=True)
class RecomputeTerms:
    """What recomputing each layer costs and frees, per class strategy, for :class:`~metadist.solver.ilp.ShardingILP`.

    ``seconds[i][c][s]``: the forward compute of layer ``layers[i]``'s cloned nodes of class ``c`` under
    strategy ``s``; ``freed[k][i][c][s]``: the bytes its originals no longer hold at the problem's peak ``k``.
    A class with one strategy appears with one entry (a constant of the layer's binary variable).
    """

    layers: tuple[int, ...]
    seconds: tuple[dict[int, tuple[float, ...]], ...]
    freed: tuple[tuple[dict[int, tuple[float, ...]], ...], ...]


def _without_names(arg: Arg) -> Arg:
    """``arg`` with every value reference in it blanked: alike nodes of two layers read values of other names, and
    their price depends on the values' specs only (keyed beside)."""
    if isinstance(arg, ValueRef):
        return None
    if isinstance(arg, tuple):
        return tuple(_without_names(item) for item in arg)
    return arg


def recompute_terms(problem, candidates: tuple[RecomputeLayer, ...]) -> RecomputeTerms:
    """Price recomputing each candidate layer on ``problem`` (its graph is the graph without recomputation).

    Freed bytes come from liveness: a value a clone makes again is freed at a peak where it lives in the
    graph and neither it nor its clone lives, at the same node, in the graph with every candidate recomputing (layers free
    disjoint values, so one rewrite serves all); a value a clone reads (a random draw, the layer's input) that lives
    at a peak only because the clone reads it counts negatively. The seconds are the clones' compute; the reshards between
    clones are not priced here (the plan of the rewritten graph prices them, :func:`plan_graph`).
    """
    from ..cost import liveness, local_nbytes
    from .estimate import node_compute_s
    from .problem import _output_sharding, _producer_of

    graph, mesh = problem.graph, problem.cluster.mesh
    rewritten = apply_recompute(graph, [layer.layer for layer in candidates])
    new_position = {node.name: index for index, node in enumerate(rewritten.nodes)}
    old_lives = {life.name: life for life in problem.liveness.values}
    new_lives = {life.name: life for life in liveness(rewritten).values}

    def mapped(position: int) -> int:
        if position < 0:
            return position
        if position >= len(graph.nodes):
            return len(rewritten.nodes)
        return new_position[graph.nodes[position].name]

    cache: dict[tuple, float] = {}
    seconds_by_layer, freed_by_peak = [], [[] for _ in problem.peaks]
    for layer in candidates:
        seconds: dict[int, list[float]] = {}
        for name in layer.cloned:
            unit_index, member = problem.member_unit[name]
            unit, c = problem.units[unit_index], problem.unit_class[unit_index]
            row = seconds.setdefault(c, [0.0] * len(unit.strategies))
            node = graph.node(name)
            alike = (node.op, _without_names(node.args), _without_names(node.kwargs),
                     tuple(graph.value(v).spec for v in node.input_names))
            for s, strategies in enumerate(unit.strategies):
                key = (alike, strategies[member])
                price = cache.get(key)
                if price is None:
                    price = cache[key] = node_compute_s(graph, name, strategies[member], problem.cluster)
                row[s] += price
        seconds_by_layer.append({c: tuple(row) for c, row in seconds.items()})
        values = [v.name for name in layer.cloned for v in graph.node(name).output_values]
        cloned = set(values)
        read = dict.fromkeys(name for node in layer.cloned for name in graph.node(node).input_names if name not in cloned)
        for k, peak in enumerate(problem.peaks):
            freed: dict[int, list[float]] = {}
            there = mapped(peak)

            def add(value: str, sign: float) -> None:
                spec = old_lives[value].spec
                unit_index, member, output = _producer_of(graph, value, problem.member_unit)
                unit = problem.units[unit_index]
                row = freed.setdefault(problem.unit_class[unit_index], [0.0] * len(unit.strategies))
                for s in range(len(unit.strategies)):
                    row[s] += sign * local_nbytes(spec, _output_sharding(unit, s, member, output), mesh)

            for value in values:
                old, new, clone = old_lives[value], new_lives[value], new_lives[value + CLONE_SUFFIX]
                if (old.holds_memory and old.start <= peak <= old.end and not new.start <= there <= new.end
                        and not clone.start <= there <= clone.end):
                    add(value, 1.0)  # freed: neither it nor its clone lives there any more
            for value in read:
                old, new = old_lives[value], new_lives[value]
                if new.holds_memory and new.start <= there <= new.end and not old.start <= peak <= old.end:
                    add(value, -1.0)  # held longer: a clone reads it (a random draw, the layer's input)
            freed_by_peak[k].append({c: tuple(row) for c, row in freed.items()})
    return RecomputeTerms(tuple(layer.layer for layer in candidates), tuple(seconds_by_layer),
                          tuple(tuple(per_layer) for per_layer in freed_by_peak))
