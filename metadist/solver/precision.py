"""The reduce dtype of a precision policy, as a constraint on the solver's reshardings.

A mixed precision policy states the dtype gradients are reduced in across devices (FSDP2's
``reduce_dtype``). In the captured graph a parameter's gradient is computed in the compute dtype
(``bfloat16``: the weight-gradient matmul gives a ``Partial(sum)`` piece per device when the batch is
split) and then cast to the parameter's float32; the cast passes ``Partial(sum)`` through, so the
reduction may run before the cast (bfloat16, half the bytes) or after it (float32). The policy
decides: every resharding that reduces a ``Partial`` axis of a **gradient-shaped value** (a floating
value after the loss whose shape is a parameter's, or its transpose) in a dtype other than
``reduce_dtype`` is forbidden, priced :data:`FORBIDDEN_S`, which the ILP excludes.

The shape test is deliberately broad: an activation gradient that happens to have a parameter's shape
is held to the reduce dtype too, which costs bytes, never accuracy.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..ir import Graph, Partial, Role

__all__ = ["FORBIDDEN_S", "reduces_partial", "restricted_values"]

FORBIDDEN_S = math.inf
"""The price of a resharding the policy forbids; the ILP fixes every variable carrying it to 0."""


def restricted_values(graph: Graph, reduce_dtype: str | None) -> frozenset[str]:
    """Gradient-shaped floating values after the loss whose dtype is not ``reduce_dtype`` (None: no restriction)."""
    if reduce_dtype is None:
        return frozenset()
    shapes = set()
    for graph_input in graph.inputs_by_role(Role.PARAM):
        shape = graph_input.value.spec.shape
        shapes.add(shape)
        if len(shape) == 2:
            shapes.add(shape[::-1])
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    losses = [graph.producer(out.name) for out in graph.outputs_by_role(Role.LOSS)]
    loss_position = max((position[node.name] for node in losses if node is not None), default=-1)
    restricted = set()
    for node in graph.nodes[loss_position + 1:]:
        for value in node.output_values:
            spec = value.spec
            if spec.dtype.startswith(("float", "bfloat")) and spec.dtype != reduce_dtype and spec.shape in shapes:
                restricted.add(value.name)
    return frozenset(restricted)


def reduces_partial(src: Sequence, dst: Sequence) -> bool:
    """Whether moving from ``src`` to ``dst`` reduces a ``Partial`` axis (an all-reduce or a reduce-scatter)."""
    return any(isinstance(a, Partial) and not isinstance(b, Partial) for a, b in zip(src, dst))
