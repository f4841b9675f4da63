"""Memory per device by liveness over one training step.

Positions are graph order: graph inputs exist from position -1, the value a node produces
from the node's position; a value lives until its last reader (graph outputs, and state
that is never replaced, until the end of the step). A view aliases its base and adds no
bytes; its readers keep the base alive. A replaced state input (a parameter the optimizer
updates) is freed after its last reader, because its update takes its place.

Every live value is counted at its local size under its sharding, so the memory at a
position is linear in the solver's choices; the solver puts one budget constraint at each
of a few **peaks**: the positions where the whole-tensor footprint peaks (local maxima of
the curve with every value replicated).

Each value has a category for the memory breakdown: ``param``, ``optim_state``, ``grad``
(a backward value read by the optimizer: by a node computed from optimizer state), ``activation`` (made in the
forward pass and kept for the backward pass), ``batch``, ``buffer``, ``constant`` and
``transient`` (everything else).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Graph, Role, TensorSpec


@dataclass(frozen=True)
class ValueLife:
    """When one value holds memory, and what it is."""

    name: str
    spec: TensorSpec
    start: int
    end: int
    category: str
    holds_memory: bool
    """False for views (their bytes belong to the base)."""


@dataclass(frozen=True)
class Liveness:
    """Live ranges of every value of a graph, and the positions to constrain."""

    values: tuple[ValueLife, ...]
    peaks: tuple[int, ...]
    """Positions (node indices, -1 for the step's start) where the memory budget is checked."""
    replicated_bytes_at_peaks: tuple[float, ...]

    def live_at(self, position: int) -> tuple[ValueLife, ...]:
        return tuple(life for life in self.values if life.holds_memory and life.start <= position <= life.end)


def _alias_roots(graph: Graph) -> dict[str, str]:
    roots: dict[str, str] = {graph_input.value.name: graph_input.value.name for graph_input in graph.inputs}
    for node in graph.nodes:
        base = roots.get(node.input_names[0]) if node.op.is_view and node.input_names else None
        for value in node.output_values:
            roots[value.name] = base if base is not None else value.name
    return roots


def _categories(graph: Graph, loss_position: int) -> dict[str, str]:
    categories = {graph_input.value.name: graph_input.role.value for graph_input in graph.inputs}
    optim_inputs = {graph_input.value.name for graph_input in graph.inputs_by_role(Role.OPTIM_STATE)}
    for position, node in enumerate(graph.nodes):
        category = "activation" if position <= loss_position else "transient"
        for value in node.output_values:
            categories[value.name] = category
    tainted = set(optim_inputs)  # values computed from optimizer state: the optimizer's own work
    for node in graph.nodes:
        if tainted.intersection(node.input_names):
            tainted.update(value.name for value in node.output_values)
            for name in node.input_names:
                if name not in tainted and categories.get(name) == "transient":
                    categories[name] = "grad"
    roles = {graph_input.value.name: graph_input.role.value for graph_input in graph.inputs}
    for graph_output in graph.outputs:
        if graph_output.replaces is not None:
            categories[graph_output.name] = roles[graph_output.replaces]
    return categories


def liveness(graph: Graph, peak_count: int = 6) -> Liveness:
    """Live ranges of all values and the ``peak_count`` positions to check the budget at."""
    end_of_step = len(graph.nodes)
    position_of = {node.name: index for index, node in enumerate(graph.nodes)}
    loss_outputs = graph.outputs_by_role(Role.LOSS)
    loss_position = max(
        (position_of[graph.producer(out.name).name] for out in loss_outputs if graph.producer(out.name)), default=end_of_step
    )
    roots = _alias_roots(graph)
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in node.input_names:
            last_use[roots[name]] = index
    for graph_output in graph.outputs:
        last_use[roots[graph_output.name]] = end_of_step
    replaced = {out.replaces for out in graph.outputs if out.replaces}
    for graph_input in graph.inputs:
        if graph_input.role in (Role.PARAM, Role.BUFFER, Role.OPTIM_STATE) and graph_input.value.name not in replaced:
            last_use[graph_input.value.name] = end_of_step
    categories = _categories(graph, loss_position)
    lives = [
        ValueLife(gi.value.name, gi.value.spec, -1, last_use.get(gi.value.name, -1), categories[gi.value.name], True)
        for gi in graph.inputs
    ]
    for index, node in enumerate(graph.nodes):
        for value in node.output_values:
            own = roots[value.name] == value.name
            end = max(index, last_use.get(value.name, index)) if own else index
            lives.append(ValueLife(value.name, value.spec, index, end, categories[value.name], own))
    peaks, loads = _peaks(lives, end_of_step, peak_count)
    return Liveness(values=tuple(lives), peaks=peaks, replicated_bytes_at_peaks=loads)


def _peaks(lives: list[ValueLife], end_of_step: int, peak_count: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    delta = [0.0] * (end_of_step + 3)
    for life in lives:
        if life.holds_memory:
            delta[life.start + 1] += life.spec.nbytes
            delta[life.end + 2] -= life.spec.nbytes
    curve, running = [], 0.0
    for position in range(-1, end_of_step + 1):
        running += delta[position + 1]
        curve.append((running, position))
    local_maxima = [
        (load, position)
        for index, (load, position) in enumerate(curve)
        if load >= (curve[index - 1][0] if index else 0.0) and load >= (curve[index + 1][0] if index + 1 < len(curve) else 0.0)
    ]
    spacing = max(1, (end_of_step + 2) // (2 * peak_count))
    chosen: list[tuple[float, int]] = []
    for load, position in sorted(local_maxima, key=lambda item: (-item[0], item[1])):
        if all(abs(position - other) >= spacing for _, other in chosen):
            chosen.append((load, position))
        if len(chosen) == peak_count:
            break
    chosen.sort(key=lambda item: item[1])
    return tuple(position for _, position in chosen), tuple(load for load, _ in chosen)
