"""ShardCombine's op executor for JAX: the same discovery code finds rules for JAX primitives.

:class:`JaxOpExecutor` implements ShardCombine's ``OpExecutor`` protocol
(``metadist.shardcombine.executor``): it runs one MetaIR node's primitive on
numpy arrays standing for its tensor inputs (possibly pieces of them, with the
shape-carrying params rewritten by :mod:`.shapes`), and draws example inputs
whose values suit the op (positive operands for ``sqrt``/``log``/``pow``,
in-range indices for ``gather``/``scatter``, several distinct integers
elsewhere). Rules go to the rule database under framework ``"jax"``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ...ir import Graph, Node, TensorSpec, Value, ValueRef
from ...shardcombine.executor import ExecutionRefused, OpCall
from .execute import bind_node
from .params import decode_params, encode_param
from .primitives import PREFIX
from .shapes import ShapeRewriteError, rewritten_params

__all__ = ["FRAMEWORK", "JaxOpExecutor", "discover_jax_rules"]

log = logging.getLogger(__name__)

FRAMEWORK = "jax"

#: Primitives whose first operand (all operands for pow/rem) must be positive.
_POSITIVE_OPERANDS = {"sqrt": (0,), "rsqrt": (0,), "log": (0,), "log1p": (0,), "pow": (0, 1), "div": (1,),
                      "rem": (1,), "lgamma": (0,), "digamma": (0,), "cbrt": (0,)}

#: Largest integer drawn for a non-index integer operand (exclusive): small, but never only 0/1.
_INTEGER_RANGE = 7


@dataclass(frozen=True)
class JaxOpExecutor:
    """Runs JAX primitives for ShardCombine (implements ``metadist.shardcombine.executor.OpExecutor``)."""

    raw_params: Mapping[str, dict] | None = None
    """``JaxStep.raw_params``: equation params kept aside by the capture (usually empty)."""
    framework: str = FRAMEWORK
    """Part of the rule database key."""
    framework_version: str = field(default_factory=lambda: _jax_version())
    """The JAX version: rules are stored per version."""
    _adapted: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    """:meth:`adapt`'s answers (the call, or the refusal) by call and shapes: discovery runs one op on the same
    piece shapes many times, and deriving the output specs traces the primitive (``jax.eval_shape``)."""

    def worker_env(self) -> dict[str, str]:
        """The environment of a discovery worker process (:mod:`metadist.shardcombine.pool`): JAX on the CPU only, as
        :meth:`run` runs every op there (a worker must not claim an accelerator's memory)."""
        return {"JAX_PLATFORMS": "cpu"}

    def __getstate__(self) -> dict:
        return {"raw_params": self.raw_params, "framework": self.framework, "framework_version": self.framework_version}

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_adapted", {})

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Discovery of one op: JAX's traceback filtering off, restored after.

        Discovery expects many executions to fail (pieces an op refuses); JAX filters the traceback of each error
        it raises, which cost ~13 ms an error, 13 of the 160 s that discovering GPT-2's ops took.
        """
        import jax

        before = jax.config.jax_traceback_filtering
        jax.config.update("jax_traceback_filtering", "off")
        try:
            yield
        finally:
            jax.config.update("jax_traceback_filtering", before)

    def adapt(self, call: OpCall, shapes: Sequence[tuple[int, ...]]) -> OpCall:
        """The same op written for inputs of ``shapes``: shape-carrying params rewritten, output specs re-derived."""
        shapes = tuple(tuple(shape) for shape in shapes)
        if shapes == tuple(spec.shape for spec in call.input_specs):
            return call
        key = (call, shapes)
        if key not in self._adapted:
            try:
                self._adapted[key] = self._adapt(call, list(shapes))
            except ExecutionRefused as err:
                self._adapted[key] = err
        answer = self._adapted[key]
        if isinstance(answer, ExecutionRefused):
            raise ExecutionRefused(str(answer))
        return answer

    def _adapt(self, call: OpCall, shapes: list[tuple[int, ...]]) -> OpCall:
        node = call.node
        name = node.op.target.removeprefix(PREFIX)
        params = self._params(call)
        old_outputs = [value.spec.shape if value is not None else () for value in node.outputs]
        try:
            override = rewritten_params(name, params, list(call.input_shapes), shapes, old_outputs)
            out_specs = self._output_specs(call, shapes, override)
        except (ShapeRewriteError, TypeError, ValueError) as err:
            raise ExecutionRefused(f"{node.op.target} on shapes {shapes}: {err}") from err
        kwargs = tuple((key, encode_param(override[key], f"{node.name} param {key}") if key in override else arg)
                       for key, arg in node.kwargs)
        outputs = tuple(None if value is None else Value(value.name, spec) for value, spec in zip(node.outputs, out_specs))
        specs = tuple(TensorSpec(shape, spec.dtype) for shape, spec in zip(shapes, call.input_specs))
        return OpCall(Node(node.name, node.op, node.args, kwargs, outputs), specs)

    def run(self, call: OpCall, inputs: Sequence[np.ndarray]) -> list[np.ndarray | None]:
        """Run the op with ``inputs`` in place of its tensor inputs; one entry per node output."""
        import jax

        call = self.adapt(call, [tuple(np.shape(array)) for array in inputs])
        with jax.default_device(_cpu()):
            arrays = [jax.numpy.asarray(array, dtype=spec.dtype) for array, spec in zip(inputs, call.input_specs)]
            results = bind_node(call.node, arrays, raw_params=self._raw(call))
        return [None if value is None else _to_numpy(result) for value, result in zip(call.node.outputs, results)]

    def example_inputs(self, call: OpCall, rng: np.random.Generator, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        """Seeded inputs of ``shapes``: mixed-sign floats (positive where the op needs it), in-range indices."""
        node = call.node
        name = node.op.target.removeprefix(PREFIX)
        positive = _POSITIVE_OPERANDS.get(name, ())
        positions = _tensor_positions(node)
        shapes = [tuple(shape) for shape in shapes]
        arrays = []
        for index, (spec, shape) in enumerate(zip(call.input_specs, shapes)):
            bound = _index_bound(node, positions[index], shapes)
            arrays.append(_draw(rng, shape, np.dtype(spec.dtype), positive=positions[index] in positive, index_bound=bound))
        return arrays

    # -- helpers -------------------------------------------------------------
    def _raw(self, call: OpCall) -> Mapping[str, dict] | None:
        return self.raw_params if self.raw_params and call.node.name in self.raw_params else None

    def _params(self, call: OpCall) -> dict[str, Any]:
        raw = self._raw(call)
        if raw is not None:
            return dict(raw[call.node.name])
        dtypes = tuple(np.dtype(spec.dtype) for spec in call.input_specs)
        return decode_params(call.node.op.target.removeprefix(PREFIX), call.node.kwargs, dtypes)

    def _output_specs(self, call: OpCall, shapes: list[tuple[int, ...]], override: dict) -> list[TensorSpec | None]:
        import jax

        structs = [jax.ShapeDtypeStruct(shape, spec.dtype) for shape, spec in zip(shapes, call.input_specs)]
        raw = self._raw(call)
        results = jax.eval_shape(lambda *arrays: bind_node(call.node, arrays, raw_params=raw, param_override=override),
                                 *structs)
        return [None if value is None else TensorSpec(tuple(result.shape), value.spec.dtype)
                for value, result in zip(call.node.outputs, results)]


def _to_numpy(result: Any) -> np.ndarray:
    array = np.asarray(result)
    if array.dtype.name == "bfloat16":  # numpy has no bfloat16: it travels as float32
        array = array.astype(np.float32)
    return array


def _tensor_positions(node: Node) -> list[int]:
    """The operand position of each tensor input (operands include scalar literals)."""
    return [position for position, arg in enumerate(node.args) if isinstance(arg, ValueRef)]


def _index_bound(node: Node, operand: int, shapes: list[tuple[int, ...]]) -> int | None:
    """For an index operand (gather/scatter indices), the exclusive bound that keeps every index in range."""
    primitive = node.op.target.removeprefix("jax.lax.")
    if operand != 1 or not (primitive == "gather" or primitive.startswith("scatter")):
        return None
    kwargs = dict(node.kwargs)
    params = decode_params(primitive, (("dimension_numbers", kwargs["dimension_numbers"]),), (np.float32,))
    numbers = params["dimension_numbers"]
    index_map = numbers.start_index_map if primitive == "gather" else numbers.scatter_dims_to_operand_dims
    return max(1, min(shapes[0][dim] for dim in index_map)) if index_map else 1


def _draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, *, positive: bool,
          index_bound: int | None) -> np.ndarray:
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        high = index_bound if index_bound is not None else _INTEGER_RANGE
        low = 0 if (index_bound is not None or np.issubdtype(dtype, np.unsignedinteger) or positive) else -2
        return rng.integers(low, max(high, low + 1), size=shape).astype(dtype)
    if positive:
        return rng.uniform(0.5, 2.0, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@functools.lru_cache(maxsize=1)
def _jax_version() -> str:
    import jax

    return jax.__version__


@functools.lru_cache(maxsize=1)
def _cpu() -> Any:
    import jax

    return jax.devices("cpu")[0]


def discover_jax_rules(graph: Graph, *, raw_params: Any = None, db: Any = None) -> Any:
    """Discover (or look up) the rule of every node of a captured JAX graph with ShardCombine."""
    from ...shardcombine import graph_rules

    return graph_rules(graph, JaxOpExecutor(raw_params), db=db)
