"""Capture a whole JAX training step (loss, gradients, optax update) as one MetaIR graph.

The recipe:

1. :meth:`JaxWorkload.train_step` is traced with ``jax.make_jaxpr`` on the
   workload's params, optimizer state and batch: one jaxpr for the whole step.
2. Nested jaxprs (``jit``/``pjit``, ``custom_jvp_call``, ``custom_vjp_call``,
   ``remat``, ``closed_call``) are inlined, so the graph is flat; their
   constants become constant inputs (scalars become literal arguments).
   Control flow is expanded (:mod:`.control_flow`): ``scan`` unrolled,
   ``cond`` computed on every branch and selected, ``while`` unrolled when its
   trip count is static. Typed PRNG keys are carried as their uint32 key data
   (:mod:`.keys`).
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

from ...ir import Graph, GraphInput, GraphOutput, Literal, MetaOp, Node, Role, TensorSpec, Value, ValueRef
from ...ir.graph import DTYPE_BYTES
from .control_flow import CONTROL_FLOW
from .errors import JaxCaptureError
from .keys import is_key, key_data_aval, rewrite_key_equation, touches_keys
from .params import SCALAR_KIND, decode_params, decode_scalar, dtype_name, encode_params, encode_scalar
from .primitives import RANDOM_PRIMITIVES, op_tags, op_target, register_primitive
from .workload import JaxWorkload

__all__ = ["JaxStep", "capture_jax", "capture_step"]

log = logging.getLogger(__name__)

#: Call-like primitives whose body is inlined, and the param that holds the body.
INLINED = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr", "checkpoint": "jaxpr",
}

#: Primitives that return uninitialized memory; the capture writes zeros instead (any value is correct).
UNINITIALIZED = frozenset({"empty", "empty2"})

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
        leaves = [jax.random.key_data(leaf) if is_key(leaf) else leaf for leaf in leaves]  # keys travel as key data
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
    if any(is_key(var.aval) for var in closed.jaxpr.outvars):
        raise JaxCaptureError("the step returns a typed PRNG key among its new params or optimizer state; MetaIR "
                              "carries keys as their data only: keep jax.random.key_data(key) in the state instead")
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
        self.env: dict[Any, Any] = {}  # jaxpr Var -> ValueRef, scalar Literal, or a lazy control-flow value
        self.counts: dict[str, int] = {}
        self.specs: dict[str, TensorSpec] = {}
        self.index_cache: dict[tuple, Any] = {}  # (value name, index) -> value[index], shared by unrolled scans

    def add_input(self, var: Any, name: str, role: Role, source: str) -> None:
        spec = _spec(key_data_aval(var.aval, f"input {name}"), f"input {name}")
        self.inputs.append(GraphInput(Value(name, spec), role, source))
        self.specs[name] = spec
        self.env[var] = ValueRef(name)

    def constant(self, value: Any) -> Any:
        """A closed-over constant: a literal argument if scalar, else a constant input."""
        if is_key(value):
            import jax

            value = jax.random.key_data(value)
        array = np.asarray(value)
        if array.ndim == 0:
            return encode_scalar(array, array.dtype)
        return self.constant_input(array)

    def constant_input(self, array: np.ndarray) -> ValueRef:
        """A constant graph input holding ``array`` (its value lives in ``JaxStep.constants``)."""
        name = f"const{len(self.constants)}"
        self.constants[name] = array
        spec = _spec(array, f"constant {name}")
        self.inputs.append(GraphInput(Value(name, spec), Role.CONSTANT, name))
        self.specs[name] = spec
        return ValueRef(name)

    def read_raw(self, atom: Any) -> Any:
        """What a jaxpr atom stands for; may be a lazy control-flow value (see :mod:`.control_flow`)."""
        from jax.extend.core import Literal as JaxprLiteral

        if isinstance(atom, JaxprLiteral):
            return self.constant(np.asarray(atom.val, dtype=atom.aval.dtype))
        return self.env[atom]

    def resolve(self, arg: Any) -> Any:
        """A ValueRef or scalar Literal for ``arg``, emitting the nodes of a lazy value."""
        while hasattr(arg, "materialize"):
            arg = arg.materialize(self)
        return arg

    def read(self, atom: Any) -> Any:
        return self.resolve(self.read_raw(atom))

    def physical_aval(self, aval: Any) -> Any:
        """The aval a graph value of jaxpr aval ``aval`` has (typed keys become their key data)."""
        return key_data_aval(aval)

    def aval_of(self, arg: Any) -> Any:
        """A ``ShapeDtypeStruct`` for a resolved argument."""
        import jax

        if isinstance(arg, ValueRef):
            spec = self.specs[arg.name]
            return jax.ShapeDtypeStruct(spec.shape, jax.numpy.dtype(spec.dtype))
        scalar = decode_scalar(arg)
        return jax.ShapeDtypeStruct(scalar.shape, scalar.dtype)

    def trace_inline(self, function: Any, args: Sequence[Any]) -> list[Any]:
        """Trace ``function(*arrays) -> list`` on the avals of ``args`` and inline it on ``args``."""
        import jax

        args = [self.resolve(arg) for arg in args]
        closed = jax.make_jaxpr(function)(*[self.aval_of(arg) for arg in args])
        return self.inline(closed.jaxpr, args, closed.consts)

    def inline(self, jaxpr: Any, invars: Sequence[Any], consts: Sequence[Any], *, top: bool = False) -> list[Any]:
        """Emit the nodes of ``jaxpr`` (with consts bound); returns its outputs as (possibly lazy) arguments."""
        for var, const in zip(jaxpr.constvars, consts):
            self.env[var] = self.constant(const)
        if not top:
            for inner, outer in zip(jaxpr.invars, invars):
                self.env[inner] = outer
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in INLINED:
                self._inline_call(eqn)
            elif name in CONTROL_FLOW:
                CONTROL_FLOW[name](self, eqn)
            elif touches_keys(eqn):
                rewrite_key_equation(self, eqn)
            elif name in UNINITIALIZED:
                self._zeros(eqn)
            else:
                self._emit(eqn)
        return [self.read_raw(var) for var in jaxpr.outvars]

    def _inline_call(self, eqn: Any) -> None:
        body = _body_of(eqn)
        inner = body.jaxpr if hasattr(body, "consts") else body
        consts = body.consts if hasattr(body, "consts") else ()
        operands = [self.read_raw(var) for var in eqn.invars]
        results = self.inline(inner, operands, consts)
        for var, result in zip(eqn.outvars, results):
            self.env[var] = result

    def _emit(self, eqn: Any) -> None:
        primitive = eqn.primitive
        args = tuple(self.read(var) for var in eqn.invars)
        if self._fold(eqn, args):
            return
        register_primitive(primitive)
        base = primitive.name.replace("-", "_")
        index = self.counts.get(base, 0)
        self.counts[base] = index + 1
        node_name = base if index == 0 else f"{base}_{index}"
        where = f"equation {node_name} ({primitive.name})"
        _check_supported(eqn, where)
        kwargs = encode_params(primitive.name, eqn.params, where)
        if len(eqn.outvars) == 1:
            names = [node_name]
        else:
            names = [f"{node_name}.{position}" for position in range(len(eqn.outvars))]
        outputs = tuple(Value(out_name, _spec(var.aval, where)) for out_name, var in zip(names, eqn.outvars))
        node = Node(node_name, MetaOp(op_target(primitive), op_tags(primitive)), args, kwargs, outputs)
        self._keep_raw_params(node, eqn)
        self.nodes.append(node)
        for var, value in zip(eqn.outvars, outputs):
            self.env[var] = ValueRef(value.name)
            self.specs[value.name] = value.spec

    def _zeros(self, eqn: Any) -> None:
        """Uninitialized memory (``empty2``: the residual of a ``cond`` branch not taken) is zeros here."""
        import jax.numpy as jnp

        for var in eqn.outvars:
            aval = var.aval
            if aval.shape == ():
                self.env[var] = encode_scalar(np.zeros((), aval.dtype), aval.dtype)
            else:
                (self.env[var],) = self.trace_inline(lambda: [jnp.zeros(aval.shape, aval.dtype)], [])

    def _fold(self, eqn: Any, args: tuple) -> bool:
        """Fold an equation on scalar literals into literal results; False if it cannot.

        Loop counters of unrolled scans and the indices computed from them become constants this way, so
        a ``cond`` on them inlines one branch and indexing with them is static.
        """
        if (eqn.primitive.name in RANDOM_PRIMITIVES or eqn.effects or not args
                or not all(isinstance(arg, Literal) and arg.kind == SCALAR_KIND for arg in args)
                or not all(getattr(var.aval, "shape", None) == () for var in eqn.outvars)):
            return False
        import jax

        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            results = eqn.primitive.bind(*[decode_scalar(arg) for arg in args], **eqn.params)
        results = results if eqn.primitive.multiple_results else [results]
        for var, result in zip(eqn.outvars, results):
            self.env[var] = encode_scalar(np.asarray(result), var.aval.dtype)
        return True

    def _keep_raw_params(self, node: Node, eqn: Any) -> None:
        """Keep the equation params where decoding the node's kwargs does not give them back."""
        dtypes = tuple(getattr(var.aval, "dtype", None) for var in eqn.invars)
        decoded = decode_params(eqn.primitive.name, node.kwargs, dtypes)
        if not _same_params(decoded, dict(eqn.params)):
            log.warning("params of %s do not round-trip through MetaIR; keeping them in JaxStep.raw_params", node.name)
            self.raw_params[node.name] = dict(eqn.params)

    def finish(self, outvars: list[Any], input_sources: list[str], name: str) -> Graph:
        outvars = [self.resolve(arg) for arg in outvars]
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
        nested = isinstance(value, (Jaxpr, ClosedJaxpr)) or (
            isinstance(value, tuple) and any(isinstance(item, (Jaxpr, ClosedJaxpr)) for item in value))
        if nested and key not in ("update_jaxpr",):
            raise JaxCaptureError(
                f"{where} carries a nested jaxpr ({key}), which the JAX frontend cannot flatten: it expands "
                f"{', '.join(sorted(CONTROL_FLOW))} and inlines {', '.join(sorted(INLINED))}, and nothing else. "
                "Rewrite this part of the step with those (e.g. a Python for loop or lax.scan)"
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
    except TypeError as err:  # extended dtypes other than PRNG keys (which travel as key data) are not numpy dtypes
        raise JaxCaptureError(f"{where} has the extended dtype {aval.dtype}, which MetaIR cannot represent; "
                              "only numpy dtypes and PRNG keys are supported: pass plain arrays instead") from err
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
