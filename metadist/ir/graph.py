"""MetaIR: the framework-free graph of one training step.

A :class:`Graph` is a straight-line program. Its inputs are tensors with a
:class:`Role` (parameters, buffers, optimizer states, batch tensors, constants);
its nodes apply one framework operator (:class:`MetaOp`) to values and
non-tensor arguments; its outputs are values with a role, and each updated
state output names the input it replaces.

Everything here is frozen data and imports neither torch nor jax. Executing a
node again on concrete tensors is the frontend's job: it resolves
``MetaOp.target`` (e.g. ``"aten.mm.default"``) to its own operator.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Union

from .routing import ExpertRouting

__all__ = [
    "Arg",
    "Graph",
    "GraphInput",
    "GraphOutput",
    "IRError",
    "Literal",
    "MetaOp",
    "Node",
    "Role",
    "TensorSpec",
    "Value",
    "ValueRef",
    "DTYPE_BYTES",
]


class IRError(ValueError):
    """A graph, or a piece of one, is malformed."""


#: Bytes per element of each dtype name MetaIR knows.
DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


class Role(str, enum.Enum):
    """What a graph input or output is to the training step."""

    PARAM = "param"
    BUFFER = "buffer"
    OPTIM_STATE = "optim_state"
    GRAD = "grad"
    BATCH = "batch"
    CONSTANT = "constant"
    HYPERPARAMETER = "hyperparameter"
    """A training-loop value the user may change between steps (learning rate, betas...): a 0-dim input."""
    ACTIVATION = "activation"
    LOSS = "loss"
    METRIC = "metric"
    """A 0-dim output MetaDist computes for itself, not returned to the user (the float16 subnormal-gradient count)."""

    def __str__(self) -> str:  # prints as its plain value
        return self.value


STATE_ROLES = frozenset({Role.PARAM, Role.BUFFER, Role.OPTIM_STATE})


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (global, unsharded)."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not all(
            isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in self.shape
        ):
            raise IRError(f"TensorSpec.shape must be a tuple of non-negative ints, got {self.shape!r}")
        if self.dtype not in DTYPE_BYTES:
            raise IRError(f"unknown dtype {self.dtype!r}; MetaIR knows {sorted(DTYPE_BYTES)}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __str__(self) -> str:
        return f"{_DTYPE_SHORT.get(self.dtype, self.dtype)}[{', '.join(map(str, self.shape))}]"


_DTYPE_SHORT = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint64": "u64",
    "uint32": "u32",
    "uint16": "u16",
    "uint8": "u8",
    "bool": "b8",
}


@dataclass(frozen=True)
class Value:
    """A named tensor value of the graph."""

    name: str
    spec: TensorSpec

    def __str__(self) -> str:
        return f"%{self.name}: {self.spec}"


@dataclass(frozen=True)
class ValueRef:
    """A reference to a value, standing where a tensor sits in a node's arguments."""

    name: str

    def __str__(self) -> str:
        return f"%{self.name}"


@dataclass(frozen=True)
class Literal:
    """A framework constant that is not a plain Python scalar: a dtype, device, layout...

    ``kind`` says what it is (``"dtype"``, ``"device"``, ``"layout"``,
    ``"memory_format"``); ``value`` is its framework-neutral spelling
    (``"float32"``, ``"cpu"``, ``"strided"``, ``"contiguous_format"``).
    """

    kind: str
    value: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"


#: A node argument: a tensor reference, a scalar, a literal, or a tuple of arguments.
Arg = Union[ValueRef, Literal, int, float, bool, str, None, tuple]


@dataclass(frozen=True)
class MetaOp:
    """One framework operator, by name.

    ``target`` is ``namespace.name.overload`` for PyTorch (``aten.mm.default``)
    or the primitive name for JAX (``jax.lax.dot_general``). ``tags`` carry
    properties later stages need: ``"random"`` (the op draws random numbers),
    ``"view"`` (its output aliases an input).
    """

    target: str
    tags: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.target or not isinstance(self.target, str):
            raise IRError(f"MetaOp.target must be a non-empty string, got {self.target!r}")
        object.__setattr__(self, "tags", frozenset(self.tags))

    @property
    def is_random(self) -> bool:
        return "random" in self.tags

    @property
    def is_view(self) -> bool:
        return "view" in self.tags

    def __str__(self) -> str:
        return self.target


@dataclass(frozen=True)
class Node:
    """One operator application.

    ``args``/``kwargs`` hold the op's arguments in call order, with
    :class:`ValueRef` where a tensor goes. ``outputs`` has one entry per result
    of the op; an entry is ``None`` where the op returns no tensor there.
    """

    name: str
    op: MetaOp
    args: tuple[Arg, ...]
    kwargs: tuple[tuple[str, Arg], ...]
    outputs: tuple[Value | None, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", tuple((str(key), arg) for key, arg in self.kwargs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        names: list[str] = []
        for arg in self.args:
            _check_arg(arg, self.name)
            names.extend(_refs(arg))
        for _, arg in self.kwargs:
            _check_arg(arg, self.name)
            names.extend(_refs(arg))
        object.__setattr__(self, "_input_names", tuple(names))  # not a field: computed once (planners read it often)

    @property
    def input_names(self) -> tuple[str, ...]:
        """Names of the tensor values this node reads, in argument order (repeats kept)."""
        return self._input_names  # type: ignore[attr-defined]

    @property
    def output_values(self) -> tuple[Value, ...]:
        return tuple(value for value in self.outputs if value is not None)

    @property
    def memory_format(self) -> str | None:
        """The memory format a copy is told (its ``memory_format`` keyword: ``"contiguous_format"``,
        ``"preserve_format"``...); None where it is not told one."""
        return getattr(dict(self.kwargs).get("memory_format"), "value", None)

    def __str__(self) -> str:
        outs = ", ".join("_" if value is None else str(value) for value in self.outputs)
        parts = [format_arg(arg) for arg in self.args]
        parts += [f"{key}={format_arg(arg)}" for key, arg in self.kwargs]
        tags = f"  # {','.join(sorted(self.op.tags))}" if self.op.tags else ""
        return f"{outs} = {self.op.target}({', '.join(parts)}){tags}"


@dataclass(frozen=True)
class GraphInput:
    """A graph input: a value, its role, and where it comes from in the user's program."""

    value: Value
    role: Role
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))

    def __str__(self) -> str:
        source = f" {self.source!r}" if self.source else ""
        return f"{self.value} {self.role}{source}"


@dataclass(frozen=True)
class GraphOutput:
    """A graph output. ``replaces`` names the input an updated state output stands for.

    ``source`` says what the output is to the user (``"loss"``, ``"grad:fc.weight"``).
    """

    name: str
    role: Role
    replaces: str | None = None
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))

    def __str__(self) -> str:
        replaces = f" <- %{self.replaces}" if self.replaces else ""
        source = f" {self.source!r}" if self.source else ""
        return f"%{self.name} {self.role}{replaces}{source}"


@dataclass(frozen=True)
class Graph:
    """A whole training step as one functional graph."""

    inputs: tuple[GraphInput, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[GraphOutput, ...]
    name: str = "step"
    routing: tuple[ExpertRouting, ...] = ()
    """The static dispatch of each experts layer (data-dependent routing, stated: :mod:`.routing`)."""
    _index: Mapping[str, Any] = field(default=None, repr=False, compare=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "routing", tuple(self.routing))
        object.__setattr__(self, "_index", self._build_index())

    # -- construction checks -------------------------------------------------
    def _build_index(self) -> dict[str, Any]:
        values: dict[str, Value] = {}
        producer: dict[str, str | None] = {}
        nodes: dict[str, Node] = {}
        for graph_input in self.inputs:
            name = graph_input.value.name
            if name in values:
                raise IRError(f"graph input %{name} is defined twice")
            values[name] = graph_input.value
            producer[name] = None
        for node in self.nodes:
            if node.name in nodes:
                raise IRError(f"node {node.name!r} is defined twice")
            nodes[node.name] = node
            for ref in node.input_names:
                if ref not in values:
                    raise IRError(
                        f"node {node.name!r} ({node.op.target}) reads %{ref} before it is defined; "
                        "nodes must be in topological order"
                    )
            for value in node.output_values:
                if value.name in values:
                    raise IRError(f"value %{value.name} is defined twice (again by node {node.name!r})")
                values[value.name] = value
                producer[value.name] = node.name
        input_names = {graph_input.value.name for graph_input in self.inputs}
        for graph_output in self.outputs:
            if graph_output.name not in values:
                raise IRError(f"graph output %{graph_output.name} is not defined by any input or node")
            if graph_output.replaces is not None and graph_output.replaces not in input_names:
                raise IRError(
                    f"graph output %{graph_output.name} replaces %{graph_output.replaces}, which is not a graph input"
                )
        users: dict[str, list[str]] = {name: [] for name in values}
        for node in self.nodes:
            for ref in dict.fromkeys(node.input_names):
                users[ref].append(node.name)
        return {"values": values, "producer": producer, "nodes": nodes, "users": users}

    # -- lookups -------------------------------------------------------------
    def value(self, name: str) -> Value:
        try:
            return self._index["values"][name]
        except KeyError:
            raise IRError(f"no value %{name} in graph {self.name!r}") from None

    def node(self, name: str) -> Node:
        try:
            return self._index["nodes"][name]
        except KeyError:
            raise IRError(f"no node {name!r} in graph {self.name!r}") from None

    def producer(self, value_name: str) -> Node | None:
        """The node that defines a value, or None for a graph input."""
        node_name = self._index["producer"][value_name]
        return None if node_name is None else self._index["nodes"][node_name]

    def users(self, value_name: str) -> tuple[Node, ...]:
        """The nodes that read a value, in graph order."""
        return tuple(self._index["nodes"][name] for name in self._index["users"][value_name])

    def inputs_by_role(self, role: Role | str) -> tuple[GraphInput, ...]:
        role = Role(role)
        return tuple(graph_input for graph_input in self.inputs if graph_input.role is role)

    def outputs_by_role(self, role: Role | str) -> tuple[GraphOutput, ...]:
        role = Role(role)
        return tuple(graph_output for graph_output in self.outputs if graph_output.role is role)

    def iter_values(self) -> Iterator[Value]:
        return iter(self._index["values"].values())

    # -- summaries -----------------------------------------------------------
    def op_histogram(self) -> Counter[str]:
        return Counter(node.op.target for node in self.nodes)

    def bytes_by_role(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for graph_input in self.inputs:
            totals[graph_input.role.value] = totals.get(graph_input.role.value, 0) + graph_input.value.spec.nbytes
        return totals

    def parameter_count(self) -> int:
        return sum(graph_input.value.spec.numel for graph_input in self.inputs_by_role(Role.PARAM))

    # -- text form -----------------------------------------------------------
    def to_text(self) -> str:
        """A stable, line-oriented text form, for reading and for golden tests."""
        lines = [f"graph {self.name} ({len(self.inputs)} inputs, {len(self.nodes)} nodes, {len(self.outputs)} outputs)"]
        lines += [f"  in  {graph_input}" for graph_input in self.inputs]
        lines += [f"  {node.name}: {node}" for node in self.nodes]
        lines += [f"  out {graph_output}" for graph_output in self.outputs]
        lines += [f"  routing {record.describe()}" for record in self.routing]
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_text()


def _check_arg(arg: Arg, node_name: str) -> None:
    if isinstance(arg, (ValueRef, Literal, bool, int, float, str)) or arg is None:
        return
    if isinstance(arg, tuple):
        for item in arg:
            _check_arg(item, node_name)
        return
    raise IRError(
        f"node {node_name!r} has an argument of type {type(arg).__name__} ({arg!r}); "
        "MetaIR arguments are ValueRef, Literal, int, float, bool, str, None or tuples of these"
    )


def _refs(arg: Arg) -> Iterator[str]:
    if isinstance(arg, ValueRef):
        yield arg.name
    elif isinstance(arg, tuple):
        for item in arg:
            yield from _refs(item)


def format_arg(arg: Arg) -> str:
    """Print one argument the way the text form shows it."""
    if isinstance(arg, tuple):
        return "[" + ", ".join(format_arg(item) for item in arg) + "]"
    if isinstance(arg, float):
        return repr(arg)
    if isinstance(arg, str):
        return repr(arg)
    return str(arg)
