"""Scaled dot-product attention (SDPA) ops: what their arguments mean, so discovery runs them soundly.

PyTorch's ``scaled_dot_product_attention`` lowers to one fused kernel per backend, each with its
backward: ``_scaled_dot_product_flash_attention_for_cpu`` on the CPU, and the GPU-only
``_scaled_dot_product_flash_attention``, ``_scaled_dot_product_efficient_attention`` and
``_scaled_dot_product_cudnn_attention``. Their shapes, with ``g = H / Hk`` query heads per key/value
head (grouped-query attention; ``g = 1`` for plain multi-head attention)::

    query (B, H, L, E)   key (B, Hk, S, E)   value (B, Hk, S, Ev)   mask: broadcasts to (B, H, L, S)
    out, grad_out (B, H, L, Ev)   logsumexp (B, H, L)  [efficient: (B, H, ceil(L/32)*32); cudnn: (B, H, L, 1)]

Query head ``h`` attends with key/value head ``h // g`` (``repeat_interleave`` semantics).

Three things here keep discovery of these ops sound and cheap:

1. **Shape validation** (:func:`shape_error`). The CPU kernels trust their inputs: given a key
   split on the batch dim and a whole query, ``_scaled_dot_product_flash_attention_for_cpu_backward``
   corrupts memory, and its meta kernel does not object. Executors call this check before running
   any candidate pieces, so such candidates are refused, not run.
2. **Stand-in shapes** (:func:`standin_shapes`) that keep what the op's meaning depends on: size-1
   (broadcast) dims, ``L == S`` or not (a causal mask is aligned top-left), and ``H`` a multiple of
   ``Hk`` (the generic stand-ins keep the order of sizes, not their ratios).
3. **Proportional candidates** (:func:`proportional_candidates`). Splitting the query heads and
   the key/value heads into the same number of contiguous pieces, in proportion ``g : 1``, keeps
   every query head with its key/value head. ShardCombine's generic candidates pair dims of equal
   size only, so this candidate is added here; like every candidate it becomes a factor only if
   execution on the pieces recombines. A factor whose dims differ in size is *proportional*
   (:meth:`metadist.ir.rule.Factor.size`): plans split it evenly only.

The GPU kernels cannot run on a CPU. Their rules are stated by an equivalence
(:func:`cpu_equivalent`, :func:`gpu_rule_from_cpu`): with ``dropout_p = 0`` each computes the same
function as the CPU kernel (softmax(q k^T * scale + mask) v, and its gradients), so a batch or heads
factor of the CPU kernel, found by execution, holds for the GPU kernel too. Only batch and heads
factors are carried over: they leave every other argument (``max_q``, ``max_k``) and the padded
logsumexp layouts unchanged. The GPU-only outputs (``rng_state``/philox seed and offset, the empty
debug mask) carry nothing with ``dropout_p = 0`` (the backward reads them only to regenerate a
dropout mask) and are replicated. With ``dropout_p > 0`` the kernels draw their dropout mask from
global positions, so they get no rule (the forward is a random op, drawn whole on every rank by the
lowering; the backward is replicated). The DTensor oracle checks these rules against DTensor's own
SDPA strategies, and a GPU test re-runs them on the real kernels.

Framework-free: ops are named by string, arguments are MetaIR arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..ir import Concat, Factor, Identity, MetaOp, Node, Rule, TensorSpec, Value, ValueRef
from .executor import OpCall
from .shapes import STANDIN_SIZES
from .signature import op_name

__all__ = [
    "ATTENTION_OPS",
    "AttentionSchema",
    "CPU_BACKWARD",
    "CPU_FORWARD",
    "GPU_ATTENTION_OPS",
    "consistent_candidates",
    "cpu_equivalent",
    "dropout_free",
    "gpu_rule_from_cpu",
    "is_attention",
    "proportional_candidates",
    "shape_error",
    "standin_shapes",
    "tensor_roles",
]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class AttentionSchema:
    """The arguments and outputs of one SDPA op, by name, in schema order."""

    arguments: tuple[str, ...]
    outputs: tuple[str, ...]
    backward: bool
    gpu: bool
    logsumexp: str = "plain"
    """Layout of the logsumexp: ``plain`` (B, H, L), ``padded`` (B, H, ceil(L/32)*32, or 0), ``column`` (B, H, L, 1)."""


CPU_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu"
CPU_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward"

ATTENTION_OPS: dict[str, AttentionSchema] = {
    CPU_FORWARD: AttentionSchema(
        ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"), ("out", "logsumexp"), False, False),
    CPU_BACKWARD: AttentionSchema(
        ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"),
        ("grad_query", "grad_key", "grad_value"), True, False),
    "aten._scaled_dot_product_flash_attention": AttentionSchema(
        ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"),
        ("out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset",
         "debug_attn_mask"), False, True),
    "aten._scaled_dot_product_flash_attention_backward": AttentionSchema(
        ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
         "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale"),
        ("grad_query", "grad_key", "grad_value"), True, True),
    "aten._scaled_dot_product_efficient_attention": AttentionSchema(
        ("query", "key", "value", "attn_mask", "compute_log_sumexp", "dropout_p", "is_causal", "scale"),
        ("out", "logsumexp", "philox_seed", "philox_offset"), False, True, "padded"),
    "aten._scaled_dot_product_efficient_attention_backward": AttentionSchema(
        ("grad_out", "query", "key", "value", "attn_mask", "out", "logsumexp", "philox_seed", "philox_offset",
         "dropout_p", "grad_input_mask", "is_causal", "scale"),
        ("grad_query", "grad_key", "grad_value", "grad_attn_mask"), True, True, "padded"),
    "aten._scaled_dot_product_cudnn_attention": AttentionSchema(
        ("query", "key", "value", "attn_mask", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask",
         "scale"),
        ("out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset",
         "debug_attn_mask"), False, True, "column"),
    "aten._scaled_dot_product_cudnn_attention_backward": AttentionSchema(
        ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_mask",
         "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"),
        ("grad_query", "grad_key", "grad_value"), True, True, "column"),
}
"""The SDPA family (op names without overload). The bias input of the GPU kernels (``attn_bias``) is
called ``attn_mask`` here, as on the CPU: it is the same additive mask."""

GPU_ATTENTION_OPS = frozenset(name for name, schema in ATTENTION_OPS.items() if schema.gpu)

#: Semantic dims of each tensor role, (B, H, L, S, E, Ev) symbols; ``Hk`` is the key/value heads.
_ROLE_DIMS: dict[str, tuple[str, ...]] = {
    "query": ("B", "H", "L", "E"), "key": ("B", "Hk", "S", "E"), "value": ("B", "Hk", "S", "Ev"),
    "out": ("B", "H", "L", "Ev"), "grad_out": ("B", "H", "L", "Ev"), "logsumexp": ("B", "H", "L"),
}
_MASK_DIMS = ("B", "H", "L", "S")

#: Only these tensor roles may appear (others, such as variable-length ``cum_seq_q``, are refused).
_KNOWN_ROLES = frozenset(_ROLE_DIMS) | {"attn_mask", "philox_seed", "philox_offset"}


def is_attention(target: str) -> bool:
    """Whether ``target`` (any overload) is an op of the SDPA family."""
    return op_name(target) in ATTENTION_OPS


def schema_of(target: str) -> AttentionSchema:
    return ATTENTION_OPS[op_name(target)]


def _named_arguments(node: Node) -> list[tuple[str, Any]]:
    """The node's arguments with their schema names (positional by position, keyword by key)."""
    names = schema_of(node.op.target).arguments
    if len(node.args) > len(names):
        raise ValueError(f"{node.op.target} takes {len(names)} arguments, the node passes {len(node.args)}")
    return list(zip(names, node.args)) + list(node.kwargs)


def argument(node: Node, name: str, default: Any = None) -> Any:
    """One argument of an SDPA node by its schema name (``default`` when not passed)."""
    return next((value for key, value in _named_arguments(node) if key == name), default)


def tensor_roles(node: Node) -> tuple[str, ...]:
    """The role (schema argument name) of each tensor input, in ``node.input_names`` order."""
    roles = []
    for key, value in _named_arguments(node):
        if isinstance(value, ValueRef):
            roles.append(key)
        elif isinstance(value, tuple) and any(isinstance(item, ValueRef) for item in value):
            raise ValueError(f"{node.op.target}: argument {key!r} is a list of tensors; SDPA ops take none")
    return tuple(roles)


def dropout_free(node: Node) -> bool:
    """Whether an SDPA node draws no random numbers: its ``dropout_p`` is 0 (the default)."""
    return float(argument(node, "dropout_p", 0.0) or 0.0) == 0.0


# ----------------------------------------------------------------- shapes


def _symbols(roles: Sequence[str], shapes: Sequence[Shape], logsumexp: str) -> tuple[dict[str, int], str | None]:
    """The sizes of B, H, Hk, L, S, E, Ev read from the inputs, or the first disagreement."""
    sizes: dict[str, int] = {}
    for role, shape in zip(roles, shapes):
        dims = _ROLE_DIMS.get(role)
        if dims is None:
            continue
        if role == "logsumexp" and logsumexp != "plain":
            dims = dims[:2]
            shape = shape[:2]
        elif len(shape) != len(dims):
            return sizes, f"{role} has shape {tuple(shape)}, expected rank {len(dims)} ({', '.join(dims)})"
        for symbol, size in zip(dims, shape):
            if sizes.setdefault(symbol, size) != size:
                return sizes, f"{role} has {symbol} = {size}, another input has {symbol} = {sizes[symbol]}"
    return sizes, None


def shape_error(call: OpCall, shapes: Sequence[Shape] | None = None) -> str | None:
    """Why the SDPA op cannot run on inputs of ``shapes`` (default: the call's own), or None if it can.

    Checks what the CPU kernels take on trust: one batch size, one head size ``E`` for query and
    key, one key/value length and head count, query heads a multiple of key/value heads, grad_out
    and out shaped like the output, logsumexp like (B, H, L) (or the GPU layouts), and a mask that
    broadcasts to (B, H, L, S).
    """
    schema = schema_of(call.target)
    shapes = tuple(tuple(s) for s in (shapes if shapes is not None else call.input_shapes))
    try:
        roles = tensor_roles(call.node)
    except ValueError as err:
        return str(err)
    unknown = sorted(set(roles) - _KNOWN_ROLES)
    if unknown:
        return f"{call.target}: tensor arguments {unknown} (variable-length attention) are not supported"
    sizes, error = _symbols(roles, shapes, schema.logsumexp)
    if error:
        return f"{call.target}: {error}"
    if any(symbol not in sizes for symbol in ("B", "H", "Hk", "L", "S", "E", "Ev")):
        return f"{call.target}: query, key and value must all be given"
    if sizes["Hk"] == 0 or sizes["H"] % sizes["Hk"]:
        return f"{call.target}: {sizes['H']} query heads are not a multiple of {sizes['Hk']} key/value heads"
    for role, shape in zip(roles, shapes):
        if role == "attn_mask" and not _broadcasts(shape, tuple(sizes[symbol] for symbol in _MASK_DIMS)):
            return f"{call.target}: attn_mask of shape {shape} does not broadcast to (B, H, L, S) = " \
                   f"{tuple(sizes[symbol] for symbol in _MASK_DIMS)}"
    return None


def _broadcasts(shape: Shape, target: Shape) -> bool:
    if len(shape) > len(target):
        return False
    return all(size in (1, want) for size, want in zip(reversed(shape), reversed(target)))


def standin_shapes(call: OpCall) -> tuple[Shape, ...] | None:
    """Small input shapes with the call's meaning: size-1 dims, ``L == S`` or not, ``E == Ev`` or not, ``H / Hk > 1`` or not.

    Batch and key/value heads become 6, query heads 6 or 12 (grouped), so 2 and 3 pieces split
    both in proportion; lengths 12 (and 18), head sizes 18 (and 24). Sizes of different dims may
    coincide: candidates pairing such dims are refused by :func:`shape_error` or by execution.
    None where the call's own shapes are not valid SDPA shapes.
    """
    if shape_error(call) is not None:
        return None
    schema = schema_of(call.target)
    roles = tensor_roles(call.node)
    real, _ = _symbols(roles, call.input_shapes, schema.logsumexp)
    base = STANDIN_SIZES[0]
    small = {"B": base, "Hk": base, "H": base if real["H"] == real["Hk"] else 2 * base, "L": 2 * base,
             "S": 2 * base if real["S"] == real["L"] else 3 * base if real["S"] > real["L"] else base,
             "E": 3 * base, "Ev": 3 * base if real["Ev"] == real["E"] else 4 * base}
    if real["Hk"] == 1 and real["H"] > 1:
        small["H"] = base
    small.update({symbol: size for symbol, size in real.items() if size <= 1})
    return tuple(_standin(role, shape, small, schema.logsumexp) for role, shape in zip(roles, call.input_shapes))


def _standin(role: str, shape: Shape, small: dict[str, int], logsumexp: str) -> Shape:
    if role == "attn_mask":
        dims = _MASK_DIMS[len(_MASK_DIMS) - len(shape):]
        return tuple(1 if size == 1 else small[symbol] for symbol, size in zip(dims, shape))
    dims = _ROLE_DIMS.get(role)
    if dims is None:
        return shape  # philox seed and offset: scalars
    if role == "logsumexp" and logsumexp == "column":
        return (small["B"], small["H"], small["L"], 1)
    if role == "logsumexp" and logsumexp == "padded":
        return (small["B"], small["H"], -(-small["L"] // 32) * 32 if shape[2] else 0)
    return tuple(small[symbol] for symbol in dims)


def proportional_candidates(call: OpCall, shapes: Sequence[Shape]) -> list[tuple[int | None, ...]]:
    """The grouped-query heads candidate: every input's heads dim (query heads H, key/value heads Hk).

    Only when ``H != Hk`` and both exceed 1; a mask joins with its heads dim when it has one of size H.
    Equal-size candidates (``g = 1``) come from the generic enumeration.
    """
    roles = tensor_roles(call.node)
    sizes, error = _symbols(roles, shapes, schema_of(call.target).logsumexp)
    if error or sizes.get("Hk", 1) <= 1 or sizes.get("H") == sizes.get("Hk"):
        return []
    combo: list[int | None] = []
    for role, shape in zip(roles, shapes):
        if role in _ROLE_DIMS:
            combo.append(1)
        elif role == "attn_mask" and len(shape) >= 3 and shape[len(shape) - 3] == sizes["H"]:
            combo.append(len(shape) - 3)
        else:
            combo.append(None)
    return [tuple(combo)]


def consistent_candidates(call: OpCall, candidates: Sequence[tuple[int | None, ...]]) -> list[tuple[int | None, ...]]:
    """The candidates whose pieces are valid SDPA shapes (:func:`shape_error` on a 2-way split).

    A candidate that splits one input's batch dim but not another's gives pieces no SDPA kernel
    takes: it is refused here, before any execution (and before discovery's affine retries). Piece
    sizes do not matter: a split dim's pieces are smaller than the whole, so a dim split on one
    input and whole on another disagrees whatever the pieces are.
    """
    kept = []
    for combo in candidates:
        sizes = [call.input_shapes[index][dim] for index, dim in enumerate(combo) if dim is not None]
        smallest = min(sizes)
        if smallest < 2 or any(size % smallest for size in sizes):
            continue
        shapes = [
            shape if dim is None else shape[:dim] + (shape[dim] * (smallest // 2) // smallest,) + shape[dim + 1:]
            for shape, dim in zip(call.input_shapes, combo)
        ]
        if shape_error(call, shapes) is None:
            kept.append(combo)
    return kept


# ----------------------------------------------------------------- GPU kernels by equivalence


@dataclass(frozen=True)
class Equivalent:
    """The CPU call computing what a GPU SDPA call computes, and how their tensors correspond."""

    call: OpCall
    """The CPU kernel's call (forward or backward), on the GPU call's tensors."""
    inputs: tuple[int | None, ...]
    """For each GPU tensor input, its CPU input (None: philox seed/offset, replicated)."""
    outputs: tuple[int | str | None, ...]
    """For each GPU output: its CPU output, ``"replicated"`` (seed, offset, empty debug mask) or None (absent)."""


def cpu_equivalent(call: OpCall) -> Equivalent | str:
    """The CPU kernel's call equivalent to a GPU SDPA call, or why there is none (a str)."""
    node, schema = call.node, schema_of(call.target)
    error = shape_error(call)
    if error:
        return error
    if not dropout_free(node):
        return ("dropout inside a fused GPU attention kernel draws its mask by global position; pieces would draw "
                "other masks, so the op stays whole (replicated)")
    if argument(node, "return_debug_mask", False):
        return "return_debug_mask=True: the debug attention mask is not modelled"
    roles = tensor_roles(node)
    grad_mask = argument(node, "grad_input_mask", None)
    if schema.backward and "attn_mask" in roles and grad_mask is not None and bool(grad_mask[3]):
        return "the gradient of the attention bias is asked for; its recombination is not stated for the GPU kernels"
    specs = dict(zip(roles, call.input_specs))
    order = ("grad_out", "query", "key", "value", "out", "logsumexp") if schema.backward else ("query", "key", "value")
    cpu_specs = [specs[role] for role in order]
    if schema.backward:
        batch, heads, length = specs["query"].shape[:3]
        cpu_specs[-1] = TensorSpec((batch, heads, length), specs["logsumexp"].dtype)
    kwargs: list[tuple[str, Any]] = []
    cpu_roles = list(order)
    if "attn_mask" in specs:
        cpu_specs.append(specs["attn_mask"])
        cpu_roles.append("attn_mask")
        kwargs.append(("attn_mask", ValueRef(f"#{len(cpu_specs) - 1}")))
    kwargs.append(("scale", argument(node, "scale", None)))
    args = tuple(ValueRef(f"#{index}") for index in range(len(order))) + (0.0, bool(argument(node, "is_causal", False)))
    target = (CPU_BACKWARD if schema.backward else CPU_FORWARD) + ".default"
    output_map = _output_map(call, schema)
    if isinstance(output_map, str):
        return f"{call.target}: {output_map}"
    outputs = _cpu_outputs(call, schema, specs)
    cpu_node = Node(f"{node.name}.cpu", MetaOp(target), args, tuple(kwargs), outputs)
    inputs = tuple(cpu_roles.index(role) if role in cpu_roles else None for role in roles)
    return Equivalent(OpCall(cpu_node, tuple(cpu_specs)), inputs, output_map)


def _cpu_outputs(call: OpCall, schema: AttentionSchema, specs: dict[str, TensorSpec]) -> tuple[Value, ...]:
    if schema.backward:
        return tuple(Value(f"{call.node.name}.cpu.{role}", specs[role]) for role in ("query", "key", "value"))
    query, value = specs["query"].shape, specs["value"].shape
    out = TensorSpec(query[:3] + value[3:], specs["query"].dtype)
    lse_dtype = "float64" if specs["query"].dtype == "float64" else "float32"
    return (Value(f"{call.node.name}.cpu.out", out), Value(f"{call.node.name}.cpu.lse", TensorSpec(query[:3], lse_dtype)))


_CPU_OUTPUT = {"out": 0, "logsumexp": 1, "grad_query": 0, "grad_key": 1, "grad_value": 2}


def _output_map(call: OpCall, schema: AttentionSchema) -> tuple[int | str | None, ...] | str:
    mapped: list[int | str | None] = []
    for name, value in zip(schema.outputs, call.node.outputs):
        if value is None:
            mapped.append(None)
        elif name in _CPU_OUTPUT:
            mapped.append(_CPU_OUTPUT[name])
        elif name in ("philox_seed", "philox_offset", "debug_attn_mask"):
            mapped.append("replicated")
        else:
            return f"output {name!r} is a tensor (variable-length attention); no equivalence states it"
    return tuple(mapped)


def gpu_rule_from_cpu(call: OpCall, discover_cpu: Callable[[OpCall], Rule]) -> Rule | str:
    """The rule of a GPU SDPA call: the batch and heads factors of its CPU equivalent's rule, mapped back.

    ``discover_cpu`` finds the CPU call's rule by execution (it may raise discovery's ``NoRule``).
    Returns the rule, or the reason there is none (a str).
    """
    equivalent = cpu_equivalent(call)
    if isinstance(equivalent, str):
        return equivalent
    cpu_rule = discover_cpu(equivalent.call)
    cpu_roles = tensor_roles(equivalent.call.node)
    factors = []
    for factor in cpu_rule.factors:
        semantic = _batch_or_heads(factor, cpu_roles, equivalent.call.input_shapes)
        if semantic is None:
            continue
        inputs = tuple(None if cpu is None else factor.inputs[cpu] for cpu in equivalent.inputs)
        outputs = tuple(
            None if target is None else Identity() if target == "replicated" else factor.outputs[target]  # type: ignore[index]
            for target in equivalent.outputs
        )
        factors.append(Factor(inputs, outputs))
    return Rule(
        input_ranks=tuple(spec.rank for spec in call.input_specs),
        output_ranks=tuple(None if value is None else value.spec.rank for value in call.node.outputs),
        factors=tuple(factors),
    )


def _batch_or_heads(factor: Factor, roles: Sequence[str], shapes: Sequence[Shape]) -> str | None:
    """``"B"`` or ``"H"`` when the factor splits every split input on that semantic dim and concatenates
    every output along it (dims 0 and 1 of every output), else None."""
    semantic = set()
    for role, shape, dim in zip(roles, shapes, factor.inputs):
        if dim is None:
            continue
        if role == "attn_mask":
            semantic.add(_MASK_DIMS[len(_MASK_DIMS) - len(shape) + dim])
        else:
            symbol = _ROLE_DIMS[role][dim]
            semantic.add("H" if symbol == "Hk" else symbol)
    if len(semantic) != 1 or not semantic <= {"B", "H"} or factor.partial_inputs:
        return None
    symbol = semantic.pop()
    dim = 0 if symbol == "B" else 1
    if any(out is not None and out != Concat(dim) for out in factor.outputs):
        return None
    return symbol

