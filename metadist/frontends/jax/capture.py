"""Capture a whole JAX training step (loss, gradients, optax update) as one MetaIR graph.

The recipe:

1. :meth:`JaxWorkload.train_step` is traced with ``jax.make_jaxpr`` on the
   workload's params, optimizer state and batch: one jaxpr for the whole step.
2. Nested jaxprs (``jit``/``pjit``, ``custom_jvp_call``, ``custom_vjp_call``,
   ``remat``, ``closed_call``) are inlined, so the graph is flat; their
   constants become constant inputs (scalars become literal arguments).
3. Every remaining equation is a node: ``MetaOp("jax.lax.<primitive>")``, its
   operands as arguments (:class:`ValueRef` for tensors, a ``jax.scalar``
   literal for jaxpr literals) and its params as keyword arguments
   (:mod:`.params`).
4. Inputs take their role and name from the pytree paths (``params.wte``,
   ``opt_state.0.mu.wte``, ``batch.input_ids``); the step's outputs are the
   loss and the new params and optimizer state, each naming the input it replaces.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ...ir import Graph, GraphInput, GraphOutput, MetaOp, Node, Role, TensorSpec, Value, ValueRef
from ...ir.graph import DTYPE_BYTES
from .errors import JaxCaptureError
from .params import decode_params, decode_scalar, dtype_name, encode_params, encode_scalar
from .primitives import op_tags, op_target, register_primitive
from .workload import JaxWorkload

__all__ = ["JaxStep", "capture_jax", "capture_step"]

log = logging.getLogger(__name__)

#: Call-like primitives whose body is inlined, and the param that holds the body.
INLINED = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr", "checkpoint": "jaxpr",
}

_ROLE_OF_PART = {"params": Role.PARAM, "opt_state": Role.OPTIM_STATE, "batch": Role.BATCH}


@dataclass(frozen=True)
class JaxStep:
    """A captured JAX step and what the JAX frontend needs to run it again.

    ``graph`` is the framework-free MetaIR; ``constants`` holds the arrays of its
    ``constant`` inputs; ``in_tree``/``out_tree`` rebuild the user's pytrees.
    """

    graph: Graph
    constants: dict[str, np.ndarray]
    in_tree: Any
    """Treedef of ``(params, opt_state, batch)``."""
    out_tree: Any
    """Treedef of ``(loss, params, opt_state)``."""
    capture_seconds: float
    raw_params: dict[str, dict] = field(default_factory=dict)
    """Equation params that did not round-trip through MetaIR, by node name (empty for the built-ins)."""

    def graph_inputs(self, params: Any, opt_state: Any, batch: Any) -> list[Any]:
        """The arrays for the graph's inputs, in graph order."""
        import jax

        leaves, tree = jax.tree_util.tree_flatten((params, opt_state, batch))
        if tree != self.in_tree:
            raise JaxCaptureError(
                "the params/opt_state/batch pytrees differ from the captured ones; capture the step again "
                f"for this structure (captured {self.in_tree}, got {tree})"
            )
        return list(leaves) + [self.constants[graph_input.value.name] for graph_input in self.graph.inputs[len(leaves):]]

    def unflatten_outputs(self, outputs: Sequence[Any]) -> tuple[Any, Any, Any]:
        """``(loss, new_params, new_opt_state)`` from the graph's outputs."""
        import jax

        return jax.tree_util.tree_unflatten(self.out_tree, list(outputs))


def capture_jax(workload: JaxWorkload, *, name: str | None = None) -> JaxStep:
    """Capture the training step of ``workload`` (see :class:`JaxWorkload`) as a :class:`JaxStep`."""
    return capture_step(workload.train_step(), workload.params, workload.opt_state, workload.batch,
                        name=name or (workload.name or "step").replace("-", "_"))


def capture_step(train_step: Any, params: Any, opt_state: Any, batch: Any, *, name: str = "step") -> JaxStep:
    """Capture ``train_step(params, opt_state, batch) -> (loss, new_params, new_opt_state)``."""
    import jax

    started = time.perf_counter()
    try:
        closed, out_shapes = jax.make_jaxpr(train_step, return_shape=True)(params, opt_state, batch)
    except JaxCaptureError:
        raise
    except Exception as err:  # the user's step failed to trace: keep the cause chained
        raise JaxCaptureError(f"the JAX training step failed while being traced: {type(err).__name__}: {err}") from err
    paths_and_leaves, in_tree = jax.tree_util.tree_flatten_with_path((params, opt_state, batch))
    out_tree = jax.tree_util.tree_structure(out_shapes)
    _check_outputs(out_shapes, params, opt_state)
    builder = _GraphBuilder()
    for (path, leaf), var in zip(paths_and_leaves, closed.jaxpr.invars):
        source = _path_name(path)
        builder.add_input(var, source, _ROLE_OF_PART[source.split(".")[0]], source)
    outvars = builder.inline(closed.jaxpr, list(closed.jaxpr.invars), closed.consts, top=True)
    graph = builder.finish(outvars, [_path_name(path) for path, _ in paths_and_leaves], name)
    elapsed = time.perf_counter() - started
    log.info("captured %s: %d nodes, %d inputs in %.2f s", name, len(graph.nodes), len(graph.inputs), elapsed)
    return JaxStep(graph=graph, constants=builder.constants, in_tree=in_tree, out_tree=out_tree,
                   capture_seconds=elapsed, raw_params=builder.raw_params)


class _GraphBuilder:
    """Walks a jaxpr (inlining nested ones) and collects MetaIR inputs and nodes."""

    def __init__(self) -> None:
        self.inputs: list[GraphInput] = []
        self.nodes: list[Node] = []
        self.constants: dict[str, np.ndarray] = {}
        self.raw_params: dict[str, dict] = {}
        self.env: dict[Any, Any] = {}  # jaxpr Var -> ValueRef or scalar Literal
        self.counts: dict[str, int] = {}

    def add_input(self, var: Any, name: str, role: Role, source: str) -> None:
        self.inputs.append(GraphInput(Value(name, _spec(var.aval, f"input {name}")), role, source))
        self.env[var] = ValueRef(name)

    def constant(self, value: Any) -> Any:
        """A closed-over constant: a literal argument if scalar, else a constant input."""
        array = np.asarray(value)
        if array.ndim == 0:
            return encode_scalar(array, array.dtype)
        return self.constant_input(array)

    def constant_input(self, array: np.ndarray) -> ValueRef:
        """A constant graph input holding ``array`` (its value lives in ``JaxStep.constants``)."""
        name = f"const{len(self.constants)}"
        self.constants[name] = array
        self.inputs.append(GraphInput(Value(name, _spec(array, f"constant {name}")), Role.CONSTANT, name))
        return ValueRef(name)

    def read(self, atom: Any) -> Any:
        from jax.extend.core import Literal as JaxprLiteral

        if isinstance(atom, JaxprLiteral):
            return self.constant(np.asarray(atom.val, dtype=atom.aval.dtype))
        return self.env[atom]

    def inline(self, jaxpr: Any, invars: Sequence[Any], consts: Sequence[Any], *, top: bool = False) -> list[Any]:
        """Emit the nodes of ``jaxpr`` (with consts bound); returns its outputs as arguments."""
        for var, const in zip(jaxpr.constvars, consts):
            self.env[var] = self.constant(const)
        if not top:
            for inner, outer in zip(jaxpr.invars, invars):
                self.env[inner] = outer
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in INLINED:
                self._inline_call(eqn)
            else:
                self._emit(eqn)
        return [self.read(var) for var in jaxpr.outvars]

    def _inline_call(self, eqn: Any) -> None:
        body = _body_of(eqn)
        inner = body.jaxpr if hasattr(body, "consts") else body
        consts = body.consts if hasattr(body, "consts") else ()
        operands = [self.read(var) for var in eqn.invars]
        results = self.inline(inner, operands, consts)
        for var, result in zip(eqn.outvars, results):
            self.env[var] = result

    def _emit(self, eqn: Any) -> None:
        primitive = eqn.primitive
        register_primitive(primitive)
        base = primitive.name.replace("-", "_")
        index = self.counts.get(base, 0)
        self.counts[base] = index + 1
        node_name = base if index == 0 else f"{base}_{index}"
        where = f"equation {node_name} ({primitive.name})"
        _check_supported(eqn, where)
        args = tuple(self.read(var) for var in eqn.invars)
        kwargs = encode_params(primitive.name, eqn.params, where)
        if len(eqn.outvars) == 1:
            names = [node_name]
        else:
            names = [f"{node_name}.{position}" for position in range(len(eqn.outvars))]
        outputs = tuple(Value(out_name, _spec(var.aval, where)) for out_name, var in zip(names, eqn.outvars))
        node = Node(node_name, MetaOp(op_target(primitive), op_tags(primitive)), args, kwargs, outputs)
        self._keep_raw_params(node, eqn)
        self.nodes.append(node)
        for var, out_name in zip(eqn.outvars, names):
            self.env[var] = ValueRef(out_name)

    def _keep_raw_params(self, node: Node, eqn: Any) -> None:
        """Keep the equation params where decoding the node's kwargs does not give them back."""
        dtypes = tuple(getattr(var.aval, "dtype", None) for var in eqn.invars)
        decoded = decode_params(eqn.primitive.name, node.kwargs, dtypes)
        if not _same_params(decoded, dict(eqn.params)):
            log.warning("params of %s do not round-trip through MetaIR; keeping them in JaxStep.raw_params", node.name)
            self.raw_params[node.name] = dict(eqn.params)

    def finish(self, outvars: list[Any], input_sources: list[str], name: str) -> Graph:
        state_inputs = [graph_input for graph_input in self.inputs if graph_input.role is not Role.CONSTANT]
        state_inputs = [graph_input for graph_input in state_inputs if graph_input.role is not Role.BATCH]
        outputs = [GraphOutput(self._output_name(outvars[0]), Role.LOSS, source="loss")]
        for graph_input, arg in zip(state_inputs, outvars[1:]):
            outputs.append(GraphOutput(self._output_name(arg), graph_input.role, replaces=graph_input.value.name,
                                       source=graph_input.source))
        return Graph(inputs=tuple(self.inputs), nodes=tuple(self.nodes), outputs=tuple(outputs), name=name)

    def _output_name(self, arg: Any) -> str:
        if isinstance(arg, ValueRef):
            return arg.name
        return self.constant_input(decode_scalar(arg)).name  # a constant result: a constant input stands for it


def _body_of(eqn: Any) -> Any:
    key = INLINED[eqn.primitive.name]
    body = eqn.params.get(key) if key else None
    if body is None:
        for value in eqn.params.values():
            if hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns"):
                body = value
                break
    if body is None:
        raise JaxCaptureError(f"internal: {eqn.primitive.name} carries no jaxpr to inline (params {sorted(eqn.params)})")
    return body


def _check_supported(eqn: Any, where: str) -> None:
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for key, value in eqn.params.items():
        if isinstance(value, (Jaxpr, ClosedJaxpr)) and key not in ("update_jaxpr",):
            raise JaxCaptureError(
                f"{where} carries a nested jaxpr ({key}): control flow such as scan, cond and while_loop is not "
                "supported by the JAX frontend yet. Unroll the loop in Python (a for loop over layers), or use "
                "jnp.where instead of lax.cond"
            )


def _check_outputs(out_shapes: Any, params: Any, opt_state: Any) -> None:
    import jax

    if not (isinstance(out_shapes, tuple) and len(out_shapes) == 3):
        raise JaxCaptureError("the training step must return (loss, new_params, new_opt_state)")
    loss, new_params, new_opt_state = out_shapes
    if getattr(loss, "shape", None) != ():
        raise JaxCaptureError(f"the step's loss must be a scalar, got shape {getattr(loss, 'shape', None)}")
    for part, new, old in (("params", new_params, params), ("opt_state", new_opt_state, opt_state)):
        if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(old):
            raise JaxCaptureError(f"the step's new {part} have another pytree structure than the {part} it was given")


def _spec(aval: Any, where: str) -> TensorSpec:
    try:
        dtype = dtype_name(aval.dtype)
    except TypeError as err:  # extended dtypes (PRNG keys) are not numpy dtypes
        raise JaxCaptureError(f"{where} has dtype {aval.dtype}, which MetaIR cannot represent; "
                              "pass raw uint32 keys (jax.random.key_data) instead of typed keys") from err
    if dtype not in DTYPE_BYTES:
        raise JaxCaptureError(f"{where} has dtype {dtype}, which MetaIR does not know (it knows {sorted(DTYPE_BYTES)})")
    return TensorSpec(tuple(int(size) for size in aval.shape), dtype)


def _path_name(path: tuple) -> str:
    """``params.blocks.0.attn.w_qkv`` from a pytree key path (the first key names the part)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    parts[0] = ("params", "opt_state", "batch")[int(parts[0])]
    return ".".join(parts)


def _same_params(decoded: dict, original: dict) -> bool:
    if decoded.keys() != original.keys():
        return False
    for key, value in original.items():
        if key == "update_jaxpr":
            if str(value) != str(decoded[key]):
                return False
        elif key == "update_consts":
            if len(value) != len(decoded[key]):
                return False
        elif decoded[key] != value or type(decoded[key]) is not type(value):
            return False
    return True
