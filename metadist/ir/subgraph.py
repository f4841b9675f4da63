"""A piece of a graph as a graph of its own: some of its nodes, the values they read from outside as inputs.

A pipeline stage (and each phase of it: forward, backward, update) is planned and lowered as
such a piece. Inputs keep the role the value had in the whole graph when it was a graph input;
a value made by a node outside the piece enters with the role its caller gives (an activation
received from another stage, a drawn random tensor, an accumulated gradient).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from .graph import Graph, GraphInput, GraphOutput, IRError, Role

__all__ = ["extract"]


def extract(
    graph: Graph,
    nodes: Iterable[str],
    outputs: Sequence[GraphOutput],
    *,
    roles: Mapping[str, Role] | None = None,
    inputs: Sequence[str] = (),
    name: str = "",
) -> Graph:
    """The graph of ``nodes`` (kept in ``graph``'s order) with ``outputs``.

    Its inputs are ``inputs`` (in that order; values the nodes need not read may be listed, to be passed
    through as outputs), followed by every other value the nodes read but do not make, in the order of
    ``graph``'s inputs and then of their producers. ``roles`` gives the role of inputs that are not graph
    inputs of ``graph`` (default: activation).
    """
    wanted = set(nodes)
    unknown = wanted.difference(node.name for node in graph.nodes)
    if unknown:
        raise IRError(f"cannot extract nodes {sorted(unknown)[:3]}: graph {graph.name!r} has no such nodes")
    kept = [node for node in graph.nodes if node.name in wanted]
    made = {value.name for node in kept for value in node.output_values}
    needed = list(dict.fromkeys(inputs))
    listed = set(needed)
    for node in kept:
        for value_name in node.input_names:
            if value_name not in made and value_name not in listed:
                listed.add(value_name)
                needed.append(value_name)
    for output in outputs:
        if output.name not in made and output.name not in listed:
            listed.add(output.name)
            needed.append(output.name)
    originals = {graph_input.value.name: graph_input for graph_input in graph.inputs}
    explicit = list(dict.fromkeys(inputs))
    rest = [value for value in needed if value not in set(explicit)]
    order = {graph_input.value.name: index for index, graph_input in enumerate(graph.inputs)}
    position = {value.name: len(order) + index for index, node in enumerate(graph.nodes) for value in node.output_values}
    rest.sort(key=lambda value: order.get(value, position.get(value, -1)))
    new_inputs = []
    for value_name in explicit + rest:
        original = originals.get(value_name)
        if original is not None and (roles is None or value_name not in roles):
            new_inputs.append(original)
        else:
            role = (roles or {}).get(value_name, Role.ACTIVATION)
            new_inputs.append(GraphInput(graph.value(value_name), role, value_name))
    return Graph(inputs=tuple(new_inputs), nodes=tuple(kept), outputs=tuple(outputs), name=name or graph.name)
