"""Convert a functional ATen fx graph into MetaIR."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ...ir import Graph, GraphInput, GraphOutput, Literal, MetaOp, Node, Role, TensorSpec, Value, ValueRef
from ...ir.expand import canonical_names
from ...shardcombine.attention import is_attention
from .errors import CaptureError

__all__ = ["InputSlot", "fx_to_ir", "dtype_name", "op_target", "op_tags"]

#: Ops that allocate a tensor and write nothing into it.
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default,
                torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default}

#: Ops that return their input unchanged in a functional graph; folded away.
_IDENTITY_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default}

#: Ops that read their tensor input for its shape, dtype, layout and device only; recorded as the factory they
#: amount to (the trace's shapes are static), so the value they read is not an input of theirs. The backward's seed
#: ``ones_like(loss)`` is one: read as an input, a loss that a plan leaves ``Partial`` had to be reduced before the
#: backward could start, a collective on the critical path of every data-parallel step, where as an output only it
#: is reduced at the end of the step with the gradients.
_SHAPE_ONLY_OPS = {torch.ops.aten.ones_like.default: 1, torch.ops.aten.zeros_like.default: 0,
                   torch.ops.aten.full_like.default: None, torch.ops.aten.empty_like.default: None}


@dataclass(frozen=True)
class InputSlot:
    """Where one graph input comes from in the user's program."""

    name: str
    role: Role
    kind: str
    """``param``, ``buffer``, ``state``, ``batch``, ``hyper`` (a hyperparameter of one param group) or ``constant``."""
    key: str
    """The parameter/buffer name (for a state: its parameter), the batch path, or the constant's name."""
    state_key: str = ""
    index: int = -1
    """For a batch leaf: its position in the flattened batch; for a hyperparameter: its param group."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def op_target(op: torch._ops.OpOverload) -> str:
    return f"{op.namespace}.{op._opname}.{op._overloadname}"


def op_tags(op: torch._ops.OpOverload, args: tuple = (), kwargs: dict | None = None) -> frozenset[str]:
    """``random`` for ops that draw random numbers, ``view`` for views.

    The attention (SDPA) kernels are tagged as seeded because of their dropout; called with
    ``dropout_p = 0`` they draw nothing and are not ``random`` (so they are split, not drawn whole).
    """
    tags = set()
    if torch.Tag.nondeterministic_seeded in op.tags and not _dropout_free_attention(op, args, kwargs or {}):
        tags.add("random")
    if op.is_view:
        tags.add("view")
    return frozenset(tags)


def _dropout_free_attention(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    if not is_attention(op_target(op)):
        return False
    names = [argument.name for argument in op._schema.arguments]
    if "dropout_p" not in names:
        return False
    position = names.index("dropout_p")
    value = args[position] if position < len(args) else kwargs.get("dropout_p", op._schema.arguments[position].default_value)
    return isinstance(value, (int, float)) and float(value) == 0.0


def _spec(value: Any, where: str) -> TensorSpec:
    if not isinstance(value, torch.Tensor):
        raise CaptureError(f"{where} is a {type(value).__name__}, not a tensor; MetaIR values are tensors")
    return TensorSpec(tuple(int(size) for size in value.shape), dtype_name(value.dtype))


def _encode(arg: Any, names: dict[torch.fx.Node, Any], where: str) -> Any:
    if isinstance(arg, torch.fx.Node):
        ref = names.get(arg)
        if ref is None:
            raise CaptureError(f"{where} reads {arg.name}, which produces no tensor MetaIR can name")
        return ValueRef(ref)
    if isinstance(arg, (list, tuple)):
        return tuple(_encode(item, names, where) for item in arg)
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    if isinstance(arg, torch.dtype):
        return Literal("dtype", dtype_name(arg))
    if isinstance(arg, torch.device):
        return Literal("device", arg.type)
    if isinstance(arg, torch.layout):
        return Literal("layout", str(arg).removeprefix("torch."))
    if isinstance(arg, torch.memory_format):
        return Literal("memory_format", str(arg).removeprefix("torch."))
    raise CaptureError(f"{where} has an argument of type {type(arg).__name__} ({arg!r}) that MetaIR cannot represent")


def _same_tensor_type(dst: Any, src: Any) -> bool:
    if not (isinstance(dst, torch.fx.Node) and isinstance(src, torch.fx.Node)):
        return False
    dst_val, src_val = dst.meta.get("val"), src.meta.get("val")
    return (
        isinstance(dst_val, torch.Tensor)
        and isinstance(src_val, torch.Tensor)
        and dst_val.shape == src_val.shape
        and dst_val.dtype == src_val.dtype
    )


def fx_to_ir(
    gm: torch.fx.GraphModule,
    slots: list[InputSlot],
    output_roles: list[tuple[Role, str]],
    *,
    name: str,
) -> tuple[Graph, dict[str, torch.Tensor], list[InputSlot], frozenset[str]]:
    """Convert pass 2's functional graph.

    Returns the graph, the tensor constants it reads (by input name), the
    input slots including one per constant, and the names of the values the
    trace saw as contiguous (see :data:`TorchStep.contiguous_values`).
    """
    names: dict[torch.fx.Node, Any] = {}
    inputs: list[GraphInput] = []
    slots_all = list(slots)
    constants: dict[str, torch.Tensor] = {}
    nodes: list[Node] = []
    state_outputs: list[GraphOutput] = []
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    if len(placeholders) != len(slots):
        raise CaptureError(f"internal: traced {len(placeholders)} inputs for {len(slots)} slots")
    slot_of_placeholder = {}
    for node, slot in zip(placeholders, slots):
        names[node] = slot.name
        slot_of_placeholder[node] = slot
        inputs.append(GraphInput(Value(slot.name, _spec(node.meta["val"], f"input {slot.name}")), slot.role, slot.key))

    multi_outputs: dict[torch.fx.Node, list[Value | None]] = {}
    contiguous: set[str] = set()
    unread: set[str] = set()
    output_node = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            tensor = getattr(gm, node.target)
            cname = f"const:{node.target}"
            constants[cname] = tensor
            slot = InputSlot(cname, Role.CONSTANT, "constant", cname)
            slots_all.append(slot)
            names[node] = cname
            inputs.append(GraphInput(Value(cname, _spec(tensor, f"constant {node.target}")), Role.CONSTANT, node.target))
            continue
        if node.op == "output":
            output_node = node
            continue
        if node.op != "call_function":
            raise CaptureError(f"internal: unexpected fx node {node.op} {node.target}")
        if node.target is operator.getitem:
            parent, index = node.args
            values = multi_outputs.get(parent)
            if values is None or values[index] is None:
                raise CaptureError(f"internal: {node.name} reads output {index} of {parent.name}, which MetaIR did not record")
            # Rename the parent's output to this getitem's name, then record it.
            names[node] = values[index].name
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            raise CaptureError(f"the captured graph calls {node.target}, which is not an ATen operator")
        if node.target in _IDENTITY_OPS:
            names[node] = names[node.args[0]]
            continue
        relayout = None
        if node.target is torch.ops.aten.copy.default and _same_tensor_type(node.args[0], node.args[1]):
            if not _lays_out_densely(node, node.args[1]):
                names[node] = names[node.args[1]]  # functional copy into a same-typed tensor: the source itself
                continue
            # the copy lays the source out densely (autograd's gradient layout contract): a copy each executor makes,
            # so MetaIR states it as one (the cost model prices it, the runtime runs it) and drops the fresh tensor
            relayout = (torch.ops.aten.clone.default, (node.args[1],), {"memory_format": torch.contiguous_format})
            if isinstance(node.args[0], torch.fx.Node) and node.args[0].target in _ALLOCATIONS:
                unread.add(node.args[0].name)
        if node.target is torch.ops.aten.copy_.default and node.args[0] in slot_of_placeholder:
            slot = slot_of_placeholder[node.args[0]]
            state_outputs.append(GraphOutput(names[node.args[1]], slot.role, replaces=slot.name, source=slot.key))
            continue
        target, fx_args, fx_kwargs = relayout or _as_factory(node) or (node.target, node.args, _without_none_defaults(node))
        where = f"node {node.name} ({op_target(target)})"
        args = tuple(_encode(arg, names, where) for arg in fx_args)
        kwargs = tuple((key, _encode(arg, names, where)) for key, arg in fx_kwargs.items())
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            getitem_names = {user.args[1]: user.name for user in node.users if user.target is operator.getitem}
            values = [
                None if item is None else Value(getitem_names.get(index, f"{node.name}.{index}"), _spec(item, where))
                for index, item in enumerate(val)
            ]
            multi_outputs[node] = values
            outputs = tuple(values)
            contiguous.update(v.name for v, item in zip(values, val) if v is not None and _is_contiguous(item))
        else:
            outputs = (Value(node.name, _spec(val, where)),)
            names[node] = node.name
            if _is_contiguous(val):
                contiguous.add(node.name)
        nodes.append(Node(node.name, MetaOp(op_target(target), op_tags(target, fx_args, fx_kwargs)), args, kwargs, outputs))

    assert output_node is not None
    returned = output_node.args[0]
    if len(returned) != len(output_roles):
        raise CaptureError(f"internal: {len(returned)} outputs traced for {len(output_roles)} roles")
    outputs = []
    for value, (role, source) in zip(returned, output_roles):
        outputs.append(GraphOutput(names[value], role, source=source))
    outputs.extend(state_outputs)
    if unread:  # the fresh tensors the gradient layout copies wrote into, where nothing else reads them
        read = {name for node in nodes for name in node.input_names} | {output.name for output in outputs}
        nodes = [node for node in nodes if not (node.name in unread and not any(
            value is not None and value.name in read for value in node.outputs))]
    graph = Graph(inputs=tuple(inputs), nodes=tuple(nodes), outputs=tuple(outputs), name=name)
    graph, renamed = canonical_names(graph)  # names from the op sequence alone: an expanded capture gets the same ones
    return graph, constants, slots_all, frozenset(renamed.get(value, value) for value in contiguous)


def _without_none_defaults(node: torch.fx.Node) -> dict:
    """``node``'s keyword arguments less those given as None where None is the default: the same call, written one way.

    A trace records an op called from C++ (autograd's backward formulas, functionalization's re-dispatch) with every
    keyword argument, and the same op called from Python without those left at their defaults: SDPA's CPU backward
    came with ``attn_mask=None`` from pass 2's re-trace and without it where pass 1's graph is taken as it is."""
    defaults = {arg.name for arg in node.target._schema.arguments
                if arg.kwarg_only and arg.has_default_value() and arg.default_value is None}
    return {key: value for key, value in node.kwargs.items() if not (value is None and key in defaults)}


def _as_factory(node: torch.fx.Node) -> tuple[torch._ops.OpOverload, tuple, dict] | None:
    """``ones_like``/``zeros_like``/``full_like``/``empty_like`` as ``full``/``empty`` of the traced result's shape and
    type; None for any other node (or a fill value the trace computed)."""
    if node.target not in _SHAPE_ONLY_OPS:
        return None
    val = node.meta["val"]
    factory = dict(dtype=val.dtype, layout=val.layout, device=val.device, pin_memory=False)
    shape = tuple(int(size) for size in val.shape)
    if node.target is torch.ops.aten.empty_like.default:
        return torch.ops.aten.empty.memory_format, (shape,), factory
    fill = _SHAPE_ONLY_OPS[node.target]
    if fill is None:  # full_like(input, fill_value, ...)
        fill = node.args[1] if len(node.args) > 1 else node.kwargs["fill_value"]
        if not isinstance(fill, (bool, int, float)):
            return None
    return torch.ops.aten.full.default, (shape, fill), factory


def _is_contiguous(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_contiguous()


def _lays_out_densely(copy: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether a functional ``copy`` into a fresh contiguous tensor changes its ``source``'s layout: autograd's gradient
    layout contract (a gradient laid out as its parameter; a weight gradient is often a transposed matmul result).

    MetaIR keeps such a copy as ``clone(source, memory_format=torch.contiguous_format)`` (the fresh tensor it copied
    into is left unread), so every reader reads the layout the trace's readers read, and the cost model prices the copy
    as the node it is: Mixtral's four expert-weight gradients copied so took 3.7 ms of a 64 ms step on one process,
    unpriced while the copy was a flag on the source (``python -m metadist.bench.op_costs mixtral-mini``). Without the
    copy, AdamW's updates of those weights read their transposed gradients and took 5-12x the time of a dense operand."""
    return source.op == "call_function" and _is_contiguous(copy.meta.get("val")) and not _is_contiguous(source.meta.get("val"))
