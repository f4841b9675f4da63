"""Shrinking the problem before solving: follower merging and tying repeated layers.

**Followers.** A node that reads exactly one value joins the decision unit of that value's
producer: for each of the producer's strategies it takes the value as produced where it can,
else the strategy that serves it cheapest (free slicing, or its compute plus a resharding). Elementwise
chains and views collapse into the op that feeds them, views of parameters into the
parameter's sharding choice. This is the one greedy step of the solver.

**Repeated layers.** Graph inputs whose names differ only in a layer index (``.h.3.``,
``.layers.3.``) are tied. Nodes are labelled by the layer of the inputs they read directly
(the label carries forward through unlabelled nodes), which cuts the step into runs (a
layer's forward, its backward, its optimizer updates). Runs whose nodes have identical
structural signatures (op, non-tensor arguments, shapes, templated input names, in-run
producer offsets) are tied position by position. Tied units take the same strategy; the
ILP has one set of variables per class and multiplies its costs by the class's size.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

from ..ir import Graph, Node, Replicate, ValueRef
from ..ir.graph import Arg

_LAYER_RE = re.compile(r"(?:^|[._])(\d+)(?=[._:])")


def templated_name(name: str) -> tuple[str, int | None]:
    """``transformer.h.3.mlp.c_fc.weight`` -> (``transformer.h.*.mlp.c_fc.weight``, 3)."""
    match = _LAYER_RE.search(name)
    if match is None:
        return name, None
    return name[: match.start(1)] + "*" + name[match.end(1):], int(match.group(1))


def input_template(graph_input) -> str:
    """What tying compares of a graph input's name: its templated name (:func:`templated_name`); every tensor constant
    the same (the trace numbers constants, ``const:_tensor_constant7``, so each layer's own constants, a KV cache's
    empty tensors, differ by number alone; role and spec still tell them apart)."""
    if graph_input.role.value == "constant":
        return "const:*"
    return templated_name(graph_input.value.name)[0]


def tie_inputs(graph: Graph) -> dict[str, str]:
    """Representative of each graph input: the first input with the same template, role and spec."""
    first: dict[tuple, str] = {}
    representative: dict[str, str] = {}
    for graph_input in graph.inputs:
        key = (input_template(graph_input), graph_input.role, graph_input.value.spec)
        representative[graph_input.value.name] = first.setdefault(key, graph_input.value.name)
    return representative


def layer_runs(graph: Graph, follow_state_copies: bool = False) -> list[tuple[int, list[int]]]:
    """Maximal runs of nodes with the same layer label: (label, node positions).

    A node reading state inputs of exactly one layer sets the label to that layer; one
    reading state of no layer (embeddings, final norm) clears it; other nodes keep it.
    ``follow_state_copies``: a cast or view of one layer's state counts as that layer's state (a precision
    policy casts every parameter before the forward: its readers are still the layer's).
    """
    from ..cost.bucketing import CAST_OPS

    state_roles = {"param", "optim_state", "buffer"}
    layer_of = {gi.value.name: templated_name(gi.value.name)[1] for gi in graph.inputs if gi.role.value in state_roles}
    runs: list[tuple[int, list[int]]] = []
    label: int | None = None
    for position, node in enumerate(graph.nodes):
        layers = {layer_of[name] for name in node.input_names if name in layer_of}
        if layers:
            label = layers.pop() if len(layers) == 1 else None
        distinct = set(node.input_names)
        if (follow_state_copies and (node.op.target in CAST_OPS or node.op.is_view) and len(distinct) == 1
                and next(iter(distinct)) in layer_of):
            for value in node.output_values:
                layer_of[value.name] = layer_of[next(iter(distinct))]
        if label is None:
            continue
        if runs and runs[-1][0] == label and runs[-1][1][-1] == position - 1:
            runs[-1][1].append(position)
        else:
            runs.append((label, [position]))
    return runs


def _signature(graph: Graph, node: Node, run_index: Mapping[str, int], position_in_run: int, templates: Mapping[str, str]) -> tuple:
    def arg_key(arg: Arg) -> object:
        if isinstance(arg, ValueRef):
            if arg.name in templates:
                return ("in", templates[arg.name])
            producer = graph.producer(arg.name)
            output_index = [v.name if v else None for v in producer.outputs].index(arg.name)
            if producer.name in run_index:
                return ("rel", position_in_run - run_index[producer.name], output_index)
            return ("ext", graph.value(arg.name).spec)
        if isinstance(arg, tuple):
            return tuple(arg_key(item) for item in arg)
        return arg

    return (
        node.op.target,
        tuple(arg_key(arg) for arg in node.args),
        tuple((key, arg_key(arg)) for key, arg in node.kwargs),
        tuple(v.spec if v else None for v in node.outputs),
    )


def tie_nodes(graph: Graph, min_run_length: int = 2) -> dict[str, str]:
    """Representative of each node: the node at the same position of an earlier run with the same prefix.

    A run is tied position by position to the earlier leader run sharing the longest common
    prefix of structural signatures (at least ``min_run_length``); runs that match no leader
    become leaders. First and last layers, whose runs carry extra nodes, tie on their prefix.
    Runs follow a layer's state through its casts and views (``follow_state_copies``): a backward that reads a layer's
    weights only through their transposes is one run per layer, not one run for every layer below the last (eight
    blocks of a Linear pair made 78 classes where three made 43; now both 43).
    """
    from .recompute import CLONE_SUFFIX

    templates = {gi.value.name: input_template(gi) for gi in graph.inputs}
    representative = {node.name: node.name for node in graph.nodes}
    leaders: list[tuple[list[tuple], list[str]]] = []
    for _, positions in layer_runs(graph, follow_state_copies=True):
        if len(positions) < min_run_length:
            continue
        names = [graph.nodes[p].name for p in positions]
        run_index = {name: index for index, name in enumerate(names)}
        key = [_signature(graph, graph.nodes[p], run_index, i, templates) for i, p in enumerate(positions)]
        best_length, best_names = 0, None
        for leader_key, leader_names in leaders:
            length = _common_prefix(key, leader_key)
            if length > best_length:
                best_length, best_names = length, leader_names
        if best_names is None or best_length < min_run_length:
            leaders.append((key, names))
            continue
        for name, rep in zip(names[:best_length], best_names):
            representative[name] = representative[rep]
        if best_length < len(key) and any(name.endswith(CLONE_SUFFIX) for name in names):
            # a recomputed layer's backward run starts with its forward's clones, which tie to a forward run's prefix;
            # the rest of it leads the next layers' backward runs, which would otherwise tie their clones only
            leaders.append((key, names))
    return representative


def _common_prefix(first: list, second: list) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def follower_choice(
    leader_outputs: Sequence[tuple],
    follower_inputs: Sequence[tuple | None],
    follower_compute_s: Sequence[float],
    reshard_s: Callable[[tuple, tuple], float],
) -> list[int] | None:
    """For each leader strategy's output sharding, the follower strategy that serves it.

    ``follower_inputs[t]`` is the sharding follower strategy ``t`` needs on the value (None if
    it needs different shardings in different slots). Where the follower can take the value
    exactly as produced, it does. Otherwise, where it can take it for free (sliced locally from a
    replicated axis) it picks the cheapest such strategy; otherwise it pays for the resharding that
    minimizes resharding plus compute. None when the follower has no usable strategy.

    Taking the value as produced keeps the choice with the ILP: slicing a replicated value here
    would fix, before the ILP runs, a sharding that every later reader needing the value whole
    pays a gather for (GPT-2's position ids and attention mask chains did). The leader's own
    strategies already offer the sliced layout where it is worth having (a batch input's rows).
    """
    cheapest: dict[tuple, int] = {}  # the cheapest follower strategy per input sharding
    for t, sharding in enumerate(follower_inputs):
        if sharding is not None and (sharding not in cheapest or follower_compute_s[t] < follower_compute_s[cheapest[sharding]]):
            cheapest[sharding] = t
    if not cheapest:
        return None
    choice, memo = [], {}
    for sharding in leader_outputs:
        if sharding not in memo:
            memo[sharding] = cheapest[sharding] if sharding in cheapest else _serve(sharding, cheapest, follower_compute_s, reshard_s)
        choice.append(memo[sharding])
    return choice


def _serve(produced: tuple, cheapest: Mapping[tuple, int], compute_s: Sequence[float], reshard_s) -> int:
    """The follower strategy for a sharding no strategy takes as produced: free slicing, else the cheapest resharding."""
    free = [t for needed, t in cheapest.items() if all(a == b or isinstance(a, Replicate) for a, b in zip(produced, needed))]
    if free:
        return min(free, key=lambda t: (compute_s[t], t))
    return min(cheapest.items(), key=lambda item: (reshard_s(produced, item[0]) + compute_s[item[1]], item[1]))[1]
