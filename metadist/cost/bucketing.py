"""Bucketed collectives in the cost model: which reshardings share their fixed cost, and how much.

The runtime coalesces reshards (:mod:`metadist.lowering.coalesce`): at a resharding, every
later one of the same kind, axis, op and dtype whose source already exists joins it in one
collective, up to a byte cap. Where that pays is the **update phase**: the gradients are all
made by the end of the backward pass and read one parameter after another by the optimizer,
so their reductions share one call per bucket, as DDP's do. Elsewhere (forward, backward) a
resharded value is mostly read right after it is made, and pays a call of its own.

The model, kept simple so that each edge is still priced on its own (the ILP's structure):

- **update groups**: each state output that replaces an input (an updated parameter or
  optimizer state) belongs to the group of its parameter (the output's ``source``);
- **update start** ``U``: the first node after the loss that reads a parameter or optimizer
  state input and feeds that input's group only (the optimizer's first op: ``step + 1``, a
  ``lerp`` into ``exp_avg``, ``p - lr * g``). Backward reads of parameters feed other groups
  (the gradient of the layer's input), tied ones included. Nodes from ``U`` on are the update;
- a **bucketed edge** is a value read at or after ``U`` by a node, when the value is a graph
  input or made before ``U`` (gradients, parameters gathered for the update); and the resharding
  of every graph output that replaces an input (an updated parameter or state, at the end of the
  step with all the others). An output that replaces none (the loss) is read by no node: its
  reduction runs at the end and joins the gradients' call when the plan reduces gradients in the
  same group, but a plan that replicates the whole step but the loss reduces it alone, and the
  share cannot tell the two apart: it pays :data:`LONE_OUTPUT_SHARE` of its fixed cost, a call of
  its own less a hundredth. The hundredth decides between two plans that cost the same otherwise,
  one reducing a partial of the loss inside the step (a sum before its division: a call of its own
  in any case, and one the backward may wait for) and one reducing the loss at the end, where it
  can join the gradients' call: the second;
- under mixed precision a gradient is cast to its parameter's float32 after the backward pass and
  before ``U``: a reduction on the edge into such a **cast** (a dtype conversion after the loss
  whose outputs are read only from ``U`` on) is bucketed too, as the runtime coalesces it with the
  others (a bfloat16 reduction before the cast is priced like a float32 one after it, at half the bytes);
- a bucketed collective pays the bandwidth term in full and a share
  ``fixed_share = buckets / values`` of its fixed cost (ring latencies and the link's
  per-call overhead), ``values`` being the number of distinct values on bucketed edges and
  ``buckets = ceil(their whole bytes / cap)``: if every one of them reshards, the fixed cost is
  paid once per bucket, as in the runtime. All-to-alls do not coalesce and pay in full.

The share is the search's estimate: it prices each edge on its own, before the plan is known.
Where only some of the values reshard, or they reshard by several kinds or on several axes, the
runtime makes more calls than the shares add up to: a call per bucket of each (kind, axis, reduce
op, dtype) that occurs. LLaMA-tiny at 16 x 32 tokens on 2x2 planned six coalesced calls (a
reduce-scatter, an all-reduce and an all-gather on each axis) whose fixed costs the shares priced
at under one call: 4.6 ms of calls where rank 0 spent 23.6 ms a step in them. So the step estimate
(:func:`metadist.solver.estimate.communication`) prices the coalesced calls the plan makes once the
plan is known (:meth:`Bucketing.bucketed` says which reshardings join them), and the planner
compares plans by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import Graph, Role
from ..lowering.coalesce import DEFAULT_BUCKET_CAP_BYTES

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "Bucketing", "NO_BUCKETING", "bucketing_for", "OUTPUT_CONSUMER", "update_start"]

OUTPUT_CONSUMER = ""
"""The consumer name of a graph output's edge (the end of the step)."""

LONE_OUTPUT_SHARE = 0.99
"""The fixed-cost share of the resharding of a graph output that replaces no input (see the module docstring)."""


@dataclass(frozen=True)
class Bucketing:
    """The bucketed edges of one graph and the share of fixed cost each of their collectives pays."""

    edges: frozenset[tuple[str, str]]
    """(value name, consumer node name) of every bucketed node edge."""
    fixed_share: float
    """Multiplier of a bucketed collective's fixed cost (latency and call overhead), in (0, 1]."""
    update_start: int
    """Position of the first update-phase node (``U``); ``len(graph.nodes)`` when there is none."""
    lone_outputs: frozenset[str] = frozenset()
    """Graph outputs that replace no input (the loss): their resharding pays :data:`LONE_OUTPUT_SHARE`."""
    cap_bytes: float = 0.0
    """The runtime's bucket cap (0: coalescing off, nothing bucketed)."""

    def share(self, value: str, consumer: str) -> float:
        """The fixed-cost share of the resharding of ``value`` for ``consumer`` (OUTPUT_CONSUMER: a graph output)."""
        if consumer == OUTPUT_CONSUMER:
            return LONE_OUTPUT_SHARE if value in self.lone_outputs else self.fixed_share
        if (value, consumer) in self.edges:
            return self.fixed_share
        return 1.0

    def bucketed(self, value: str, consumer: str) -> bool:
        """Whether the runtime coalesces the resharding of ``value`` for ``consumer`` with others of its kind, axis,
        reduce op and dtype (:mod:`metadist.lowering.coalesce`): a bucketed edge, or a graph output (the end of the
        step, where the loss's reduction joins the gradients' call)."""
        return self.cap_bytes > 0 and (consumer == OUTPUT_CONSUMER or (value, consumer) in self.edges)


NO_BUCKETING = Bucketing(frozenset(), 1.0, 0)
"""Every collective pays its whole fixed cost (coalescing off)."""


def bucketing_for(graph: Graph, cap_bytes: float = DEFAULT_BUCKET_CAP_BYTES) -> Bucketing:
    """The bucketed edges of ``graph`` under the runtime's coalescing with ``cap_bytes`` (<= 0: none)."""
    if cap_bytes <= 0:
        return NO_BUCKETING
    start = update_start(graph)
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    edges: set[tuple[str, str]] = set()
    values: dict[str, int] = {}
    for index, node in enumerate(graph.nodes[start:], start):
        for name in node.input_names:
            producer = graph.producer(name)
            if producer is None or position[producer.name] < start:
                edges.add((name, node.name))
                values[name] = graph.value(name).spec.nbytes
    for node in _gradient_casts(graph, start, position):
        for name in node.input_names:
            edges.add((name, node.name))
            values[name] = graph.value(name).spec.nbytes
    lone = set()
    for graph_output in graph.outputs:
        if graph_output.replaces is None:
            lone.add(graph_output.name)
        else:
            values[graph_output.name] = graph.value(graph_output.name).spec.nbytes
    lone -= set(values)  # also read by the update (on a bucketed edge): it takes the share there
    if not values:
        return Bucketing(frozenset(edges), 1.0, start, frozenset(lone), float(cap_bytes))
    buckets = max(1, math.ceil(sum(values.values()) / cap_bytes))
    return Bucketing(frozenset(edges), min(1.0, buckets / len(values)), start, frozenset(lone), float(cap_bytes))


CAST_OPS = frozenset({"aten._to_copy.default", "prims.convert_element_type.default"})
"""Dtype conversions (a mixed-precision gradient's cast back to its parameter's dtype)."""


def _gradient_casts(graph: Graph, start: int, position: dict[str, int]):
    """Casts after the loss and before ``start`` whose outputs are read only by update-phase nodes."""
    loss = _loss_position(graph, position)
    for node in graph.nodes[loss + 1:start]:
        if node.op.target not in CAST_OPS:
            continue
        users = [user for value in node.output_values for user in graph.users(value.name)]
        if users and all(position[user.name] >= start for user in users):
            yield node


def _loss_position(graph: Graph, position: dict[str, int]) -> int:
    loss_names = {graph_output.name for graph_output in graph.outputs if graph_output.role is Role.LOSS}
    return max((position[graph.producer(name).name] for name in loss_names if graph.producer(name) is not None), default=-1)


def update_start(graph: Graph) -> int:
    """The first node after the loss that reads a state input and feeds that input's update group only."""
    group_bit: dict[str, int] = {}
    input_bit: dict[str, int] = {}
    feeds: dict[str, int] = {}  # value name -> bit set of the update groups it feeds
    for graph_output in graph.outputs:
        if graph_output.replaces is not None:
            bit = group_bit.setdefault(graph_output.source or graph_output.replaces, 1 << len(group_bit))
            input_bit[graph_output.replaces] = bit
            feeds[graph_output.name] = feeds.get(graph_output.name, 0) | bit
    node_feeds = [0] * len(graph.nodes)
    for index in reversed(range(len(graph.nodes))):
        node = graph.nodes[index]
        bits = 0
        for value in node.output_values:
            bits |= feeds.get(value.name, 0)
        node_feeds[index] = bits
        for name in node.input_names:
            feeds[name] = feeds.get(name, 0) | bits
    loss_names = {graph_output.name for graph_output in graph.outputs if graph_output.role is Role.LOSS}
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    loss_position = max((position[graph.producer(name).name] for name in loss_names if graph.producer(name) is not None),
                        default=-1)
    state = {graph_input.value.name for graph_input in graph.inputs if graph_input.role in (Role.PARAM, Role.OPTIM_STATE)}
    for index in range(loss_position + 1, len(graph.nodes)):
        node = graph.nodes[index]
        for name in node.input_names:
            if name in state and name in input_bit and node_feeds[index] == input_bit[name]:
                return index
    return len(graph.nodes)
