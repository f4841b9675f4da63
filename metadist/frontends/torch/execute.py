"""Execute MetaIR nodes with PyTorch: the frontend's half of the IR contract.

MetaIR names ops by string; :func:`resolve_op` turns ``"aten.mm.default"``
back into ``torch.ops.aten.mm.default``, and :func:`materialize` turns a
node's encoded arguments back into torch values.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import torch

from ...ir import Graph, IRError, Literal, Node, ValueRef

__all__ = ["resolve_op", "materialize", "execute_node", "execute_graph", "freed_after"]


@functools.lru_cache(maxsize=None)
def resolve_op(target: str) -> torch._ops.OpOverload:
    """The torch operator a MetaIR target names."""
    namespace, _, rest = target.partition(".")
    opname, _, overload = rest.rpartition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), opname)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError) as err:
        raise IRError(f"this PyTorch ({torch.__version__}) has no operator {target!r}") from err


_LITERALS = {
    "dtype": lambda value: getattr(torch, value),
    "device": torch.device,
    "layout": lambda value: getattr(torch, value),
    "memory_format": lambda value: getattr(torch, value),
}


def materialize(arg: Any, env: Mapping[str, Any]) -> Any:
    """Decode one MetaIR argument into the value torch expects."""
    if isinstance(arg, ValueRef):
        return env[arg.name]
    if isinstance(arg, Literal):
        return _LITERALS[arg.kind](arg.value)
    if isinstance(arg, tuple):
        return [materialize(item, env) for item in arg]
    return arg


def bound_call(node: Node, env: Mapping[str, Any]) -> tuple[torch._ops.OpOverload, list[Any], dict[str, Any]]:
    """The node's operator and its arguments decoded from ``env``: what :func:`execute_node` calls."""
    return (resolve_op(node.op.target), [materialize(arg, env) for arg in node.args],
            {key: materialize(arg, env) for key, arg in node.kwargs})


def node_results(node: Node, result: Any) -> tuple[Any, ...]:
    """The operator's ``result`` as one entry per node output."""
    if len(node.outputs) == 1 and not isinstance(result, (tuple, list)):
        return (result,)
    return tuple(result)


def execute_node(node: Node, env: Mapping[str, Any]) -> tuple[Any, ...]:
    """Run one node on concrete tensors; returns one entry per node output."""
    op, args, kwargs = bound_call(node, env)
    return node_results(node, op(*args, **kwargs))


def freed_after(graph: Graph) -> list[tuple[str, ...]]:
    """Per node, in graph order: the values it reads last that the graph does not return, which an interpreter
    frees after it (peak memory then follows the graph's liveness)."""
    last_use: dict[str, int] = {}
    for position, node in enumerate(graph.nodes):
        for name in node.input_names:
            last_use[name] = position
    keep = {graph_output.name for graph_output in graph.outputs}
    freed: list[list[str]] = [[] for _ in graph.nodes]
    for name, position in last_use.items():
        if name not in keep:
            freed[position].append(name)
    return [tuple(names) for names in freed]


def execute_graph(
    graph: Graph,
    inputs: Sequence[torch.Tensor],
    constants: Mapping[str, torch.Tensor] | None = None,
    *,
    contiguous_values: frozenset[str] = frozenset(),
) -> list[torch.Tensor]:
    """Interpret the graph on concrete tensors, node by node; returns the outputs in graph order.

    Values named in ``contiguous_values`` are made contiguous after the op that
    defines them (see ``TorchStep.contiguous_values``). Values are freed after
    their last use, so peak memory follows the graph's liveness.
    """
    if len(inputs) != len(graph.inputs):
        raise IRError(f"graph {graph.name!r} takes {len(graph.inputs)} inputs, got {len(inputs)}")
    env: dict[str, Any] = {graph_input.value.name: tensor for graph_input, tensor in zip(graph.inputs, inputs)}
    for node, freed in zip(graph.nodes, freed_after(graph)):
        results = execute_node(node, env)
        for value, result in zip(node.outputs, results):
            if value is not None:
                env[value.name] = result.contiguous() if value.name in contiguous_values else result
        for name in freed:
            env.pop(name, None)
    return [env[graph_output.name] for graph_output in graph.outputs]
