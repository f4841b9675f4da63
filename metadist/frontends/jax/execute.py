"""Execute MetaIR nodes with JAX: the frontend's half of the IR contract.

:func:`bind_node` applies a node's primitive (``primitive.bind``) to arrays
in place of its tensor inputs, rebuilding the params from its kwargs;
:func:`interpret` runs a whole graph, node by node, and is traced by
``jax.jit`` to reproduce the captured step in one XLA program. A ``constrain``
hook lets the sharded runtime pin each node's outputs to a sharding.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

from ...ir import Graph, IRError, Literal, Node, ValueRef
from .params import SCALAR_KIND, decode_params, decode_scalar
from .primitives import resolve_primitive

__all__ = ["bind_node", "interpret", "jit_graph", "run_graph"]

#: ``constrain(node, outputs) -> outputs``: called on each node's results while interpreting.
Constrain = Callable[[Node, list[Any]], list[Any]]


def operand_args(node: Node, tensors: Sequence[Any]) -> list[Any]:
    """The node's operands: ``tensors`` (in ``node.input_names`` order) where it reads a value, scalars elsewhere."""
    supplied = iter(tensors)
    operands = []
    for arg in node.args:
        if isinstance(arg, ValueRef):
            operands.append(next(supplied))
        elif isinstance(arg, Literal) and arg.kind == SCALAR_KIND:
            operands.append(decode_scalar(arg))
        else:
            raise IRError(f"node {node.name} ({node.op}) has operand {arg!r}, which is not a JAX operand")
    return operands


def bind_node(node: Node, tensors: Sequence[Any], *, raw_params: Mapping[str, dict] | None = None,
              param_override: Mapping[str, Any] | None = None) -> list[Any]:
    """Run one node on arrays standing for its tensor inputs; one result per node output.

    ``raw_params`` are the equation params the capture kept aside (``JaxStep.raw_params``);
    ``param_override`` replaces some params (a shape-carrying param rewritten for smaller inputs).
    """
    primitive = resolve_primitive(node.op.target)
    operands = operand_args(node, tensors)
    if raw_params is not None and node.name in raw_params:
        params = dict(raw_params[node.name])
    else:
        dtypes = tuple(getattr(operand, "dtype", None) for operand in operands)
        params = _decoded_params(primitive.name, node.kwargs, dtypes)
    if param_override:
        params.update(param_override)
    result = primitive.bind(*operands, **params)
    return list(result) if primitive.multiple_results else [result]


def _decoded_params(name: str, kwargs: tuple, dtypes: tuple) -> dict[str, Any]:
    try:
        return dict(_cached_params(name, kwargs, dtypes))
    except TypeError:  # an unhashable decoded dtype: decode without the cache
        return decode_params(name, kwargs, dtypes)


@functools.lru_cache(maxsize=4096)
def _cached_params(name: str, kwargs: tuple, dtypes: tuple) -> tuple[tuple[str, Any], ...]:
    return tuple(decode_params(name, kwargs, dtypes).items())


def interpret(graph: Graph, inputs: Sequence[Any], *, raw_params: Mapping[str, dict] | None = None,
              constrain: Constrain | None = None) -> list[Any]:
    """Run ``graph`` on ``inputs`` (graph input order); returns its outputs in graph order.

    Works on concrete arrays (op by op) and on tracers (inside ``jax.jit``).
    """
    if len(inputs) != len(graph.inputs):
        raise IRError(f"graph {graph.name!r} takes {len(graph.inputs)} inputs, got {len(inputs)}")
    env: dict[str, Any] = {graph_input.value.name: array for graph_input, array in zip(graph.inputs, inputs)}
    for node in graph.nodes:
        results = bind_node(node, [env[name] for name in node.input_names], raw_params=raw_params)
        if constrain is not None:
            results = constrain(node, results)
        for value, result in zip(node.outputs, results):
            if value is not None:
                env[value.name] = result
    return [env[graph_output.name] for graph_output in graph.outputs]


def jit_graph(graph: Graph, *, raw_params: Mapping[str, dict] | None = None, constrain: Constrain | None = None,
              **jit_options: Any) -> Callable[..., tuple[Any, ...]]:
    """``jax.jit`` of the interpreter over ``graph``: called with the graph's inputs as positional arrays."""
    import jax

    def step(*inputs: Any) -> tuple[Any, ...]:
        return tuple(interpret(graph, inputs, raw_params=raw_params, constrain=constrain))

    return jax.jit(step, **jit_options)


def run_graph(graph: Graph, inputs: Sequence[Any], *, raw_params: Mapping[str, dict] | None = None) -> list[Any]:
    """Run the whole graph on one device as one jitted XLA program."""
    return list(jit_graph(graph, raw_params=raw_params)(*inputs))
