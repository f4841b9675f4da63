"""Compute cost: roofline time of one node's LOCAL work under a strategy.

FLOPs are estimated per op family from the node's global shapes (matmuls, convolutions,
attention); everything else is priced by the bytes it reads and writes. The local work of a
strategy divides the FLOPs by the number of devices the iteration space is split over (the
axes that take a factor), and counts the bytes of the local shards the strategy reads and
writes. Time is ``max(flops / peak_flops_per_s, bytes / memory_bandwidth_bytes_per_s)``, the peak and the bandwidth
being the device's for the node's **compute dtype** (its first floating input's, else its first output's): bfloat16
and float16 matmuls run at about twice the float32 (TF32) rate on GPUs, and their bytes are half; on a CPU their
kernels run at other rates again. A calibrated device also prices by size (``Device.matmul_curves``,
``Device.elementwise_curves``: measured per dtype by ``metadist calibrate``): a node's rates are the ones measured
at its local FLOPs and bytes (a batched matmul's FLOPs per batch element: it runs that many small matmuls). A matmul
also takes at least its larger operand's local bytes at the rate a matmul of few rows passes over it
(``Device.matmul_stream_bytes_per_s_by_dtype``): a skinny matmul (8 rows against a 4096-square float32 weight on this
project's machine: 8 GFLOP/s, against 70 for a square one of the same FLOPs) is priced by it.
Ops whose kernels compute more than they move (``exp``, ``tanh``, ``log``, softmax, layer norm and their backwards,
``gelu``, random draws...) run far below the elementwise roofline on a CPU: a float32 ``tanh`` took 3.5-3.6 ns an
element on this project's machine, where its bytes at the measured bandwidth take 0.2. A calibrated device measures
such ops' seconds per output element (``Device.op_element_seconds``, per dtype: a bfloat16 ``tanh`` ran 5.5x a
float32 one), and a node of one is priced at least at its compute dtype's rate on its local output elements. View
ops alias their input and cost no work, and an allocation (``empty``...) writes none. A copy of a transposed operand
into a row-major tensor (a gradient laid out as its weight, ``.contiguous()`` of a transposed view) reads it across
its rows and is priced at its measured seconds per element (:func:`relayouts`), or at its time in its local shape
where the device timed it (``Device.relayout_seconds``, :mod:`.relayout_times`). A random op costs its whole output
on every rank whatever its strategy (every rank draws the whole tensor and keeps its slice, so that the shards hold
what one device would draw), at its measured seconds per element where the device has them (a dropout mask's
``bernoulli`` draws far slower than its bytes move). Every node, views included, also pays the device's fixed
``op_overhead_s`` (dispatch: a few microseconds per op on a CPU process; 0 on the GPU presets).

Uneven splits (``torch.chunk`` pieces) are priced on the rank with the largest pieces, which
the others wait for: a factor of size ``n`` cut into ``m`` pieces does ``ceil(n / m) / n`` of the
work there instead of ``1 / m`` (:func:`uneven_scale`), and the shards' bytes are the largest
pieces' (:func:`~.sharding.local_nbytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..ir import Graph, Mesh, Node, Shard, TensorSpec
from ..ir.plan import NodeStrategy
from .attention_times import attention_call
from .cluster import Device
from .sharding import largest_local_shape, local_nbytes

Shapes = Sequence[tuple[int, ...]]


@dataclass(frozen=True)
class Work:
    """The global work of one node."""

    flops: float
    """Floating-point operations of the whole (unsharded) node."""
    is_view: bool = False
    """The output aliases an input: no work, no bytes."""
    operands: tuple[int, int] | None = None
    """A matmul's two operands (positions among the node's inputs): it takes at least its larger operand's local
    bytes at the device's matmul stream rate (:meth:`~.cluster.Device.matmul_stream_s`)."""
    draws_whole: bool = False
    """A random op: every rank draws the whole output and keeps its slice (the torch runtime's
    :func:`metadist.runtime.random_ops.draw_random`, so that each shard holds the values one device would draw), so
    its work and the bytes it writes are the whole node's under any strategy."""
    op: str = ""
    """The op's name (:func:`op_name`): a device that measured this op's seconds per output element
    (:meth:`~.cluster.Device.element_seconds`) prices the node at least at that rate."""
    attention: Any = None
    """A fused attention call (:class:`~.attention_times.AttentionCall`: where its query, key, value and mask are among
    the node's inputs): a device that timed its local shapes (:meth:`~.cluster.Device.measured_attention_s`) prices
    the node at that time."""
    allocates: bool = False
    """An allocation (``empty``, ``new_empty_strided``...): it writes nothing, so it costs only the fixed cost of an op
    (a dead ``new_empty_strided`` of Mixtral's step, 4 MiB, took 0.03 ms where its bytes priced 0.54)."""
    relayout: bool = False
    """A copy into a row-major tensor of an operand whose last two dims are swapped (:func:`relayouts`): it reads
    one operand across its rows, at the device's measured seconds per element of such a copy
    (``Device.element_seconds(RELAYOUT)``), or at the time the device measured for its local shape
    (``Device.relayout_seconds``): a 2-D transpose runs a blocked kernel, any other a strided copy whose rate depends
    on the operand's row stride (one thread on this project's machine, float32, the transposed view of a row-major
    ``[1024, 1024]``: 0.4 ns an element; of ``[8, 128, 1024]`` or ``[1, 128, 1024]``: 1.9; of ``[8, 128, 1000]``: 0.4)."""
    layout: str = ""
    """A matmul's operand layout (:func:`matmul_layout`): ``"nt"`` (its second operand a transposed view, as a
    linear layer's forward reads its weight), ``"tn"`` (its first, as a weight's gradient reads the activations) or
    ``""`` (both row-major, or both transposed, or not known). A device prices it on the curve measured in that
    layout where it has one (:meth:`~.cluster.Device.flops_per_s`)."""


def _mm_flops(ins: Shapes, outs: Shapes) -> float:  # [M, K] x [K, N]
    return 2.0 * math.prod(outs[0]) * ins[-2][-1]


def _bmm_flops(ins: Shapes, outs: Shapes) -> float:  # [B, M, K] x [B, K, N]
    return 2.0 * math.prod(outs[0]) * ins[-2][-1]


def _conv_flops(ins: Shapes, outs: Shapes) -> float:  # weight [C_out, C_in / groups, *kernel]
    return 2.0 * math.prod(outs[0]) * math.prod(ins[1][1:])


def _conv_backward_flops(ins: Shapes, outs: Shapes) -> float:  # grad_out, input, weight
    return 4.0 * math.prod(ins[0]) * math.prod(ins[2][1:])


def _attention_flops(ins: Shapes, outs: Shapes) -> float:  # q [B, H, L, D], k [B, H, S, D]
    query, key = ins[0], ins[1]
    return 4.0 * math.prod(query[:-1]) * key[-2] * query[-1]


def _attention_backward_flops(ins: Shapes, outs: Shapes) -> float:  # grad_out, q [B, H, L, D], k [B, H, S, D]
    return 2.5 * _attention_flops(ins[1:], outs)  # recomputes the scores, then three matmuls of their size


#: The operands (input positions) of matmul ops, by op name.
_OPERANDS: dict[str, tuple[int, int]] = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}

#: Batched matmuls: a call runs one small matmul per batch element, at the rate of a matmul of that size.
_BATCHED = frozenset({"bmm", "baddbmm"})

#: FLOP formulas by op name (the target without namespace and overload: ``aten.mm.default`` -> ``mm``).
_FLOPS: dict[str, Callable[[Shapes, Shapes], float]] = {
    "mm": _mm_flops,
    "addmm": _mm_flops,
    "bmm": _bmm_flops,
    "baddbmm": _bmm_flops,
    "convolution": _conv_flops,
    "convolution_backward": _conv_backward_flops,
    "_scaled_dot_product_efficient_attention": _attention_flops,
    "_scaled_dot_product_flash_attention": _attention_flops,
    "_scaled_dot_product_flash_attention_for_cpu": _attention_flops,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _attention_backward_flops,
}


def op_name(target: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``jax.lax.dot_general`` -> ``dot_general``."""
    parts = target.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]


#: Ops that allocate their output and write nothing into it.
_ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})

RELAYOUT = "relayout"
"""The name under which a device keeps a relayout copy's seconds per element (:attr:`Work.relayout`)."""


def node_work(graph: Graph, node: Node) -> Work:
    """FLOPs of the whole node: a per-family formula, else one FLOP per output element."""
    if node.op.is_view:
        return Work(flops=0.0, is_view=True)
    ins = [graph.value(name).spec.shape for name in node.input_names]
    outs = [value.spec.shape for value in node.output_values]
    name = op_name(node.op.target)
    if name in _ALLOCATIONS:
        return Work(flops=0.0, op=name, allocates=True)
    if relayouts(graph, node):
        return Work(flops=float(sum(math.prod(shape) for shape in outs)), op=name, relayout=True)
    if node.op.is_random:
        return Work(flops=float(sum(math.prod(shape) for shape in outs)), draws_whole=True, op=name)
    formula = _FLOPS.get(name)
    if formula is not None and outs:
        operands = _OPERANDS.get(name)
        try:
            flops = formula(ins, outs)
            if not (operands and operands[1] < len(ins)):
                return Work(flops=flops, op=name, attention=attention_call(node))
            return Work(flops=flops, operands=operands, op=name,
                        layout=matmul_layout(graph, node.input_names[operands[0]], node.input_names[operands[1]]))
        except IndexError:  # an unexpected signature of a known op: fall back to the elementwise estimate
            pass
    return Work(flops=float(sum(math.prod(shape) for shape in outs)), op=name)


#: Views that keep the last dim last (a row-major tensor stays row-major, a transposed one transposed): reshaping or
#: expanding the leading dims, slicing, aliasing. A view of a transposed tensor cannot regroup its last two dims.
_LAYOUT_KEEPING_VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "alias", "unsqueeze", "squeeze", "slice", "select", "narrow", "split",
    "split_with_sizes", "unbind", "detach", "lift_fresh", "_reshape_alias",
})

#: Copies that keep their input's strides unless told a memory format (``memory_format=torch.preserve_format``).
_LAYOUT_PRESERVING_COPIES = frozenset({"clone", "_to_copy"})


def matmul_layout(graph: Graph, first: str, second: str) -> str:
    """``"nt"``, ``"tn"`` or ``""``: which of a matmul's two operands reaches it as a transposed view.

    A CPU's low-precision kernels run at rates an order of magnitude apart by layout (bfloat16 on this project's
    machine, single thread, 512-wide: 1.3 GFLOP/s row-major by row-major, 5.6 with the second operand transposed, 18
    with the first; float32 at 61-67 in every layout). A linear layer's forward reads its weight transposed
    (``t`` then ``mm``), its weight's gradient reads the activations transposed, its input's gradient reads both
    row-major. Both transposed (``"tt"``) ran at the row-major rate and is priced so (``""``).
    """
    flags = (_transposed(graph, first), _transposed(graph, second))
    return {(False, True): "nt", (True, False): "tn"}.get(flags, "")


def relayouts(graph: Graph, node: Node) -> bool:
    """Whether ``node`` copies a transposed operand into a row-major tensor: a ``clone`` or ``_to_copy`` told
    ``memory_format=torch.contiguous_format`` (``.contiguous()``, ``.to(..., memory_format=...)``, and the gradient
    layout copies of :func:`metadist.frontends.torch.to_ir._lays_out_densely`) whose input's last two dims are swapped
    (:func:`_transposed`). A copy that keeps its input's layout moves it straight, at its bytes' price."""
    if op_name(node.op.target) not in _LAYOUT_PRESERVING_COPIES or not node.input_names:
        return False
    return node.memory_format == "contiguous_format" and _transposed(graph, node.input_names[0])


def _transposed(graph: Graph, value: str) -> bool:
    """Whether ``value`` is a view whose last two dims are swapped against its row-major base: walked back through
    the views (and stride-preserving copies) that made it to a value some op wrote (row-major, as the runtime's
    kernels write) or a graph input (row-major, as a parameter or batch is); a transposition of the last two dims
    flips the answer. Any other regrouping of the last dims (a permutation moving another dim last, a strided view)
    ends the walk: such an operand is priced as row-major."""
    flipped = False
    for _ in range(64):  # a chain of views is short; the bound only guards a malformed graph
        node = graph.producer(value)
        if node is None or not node.input_names:
            return flipped
        name = op_name(node.op.target)
        if name in _LAYOUT_PRESERVING_COPIES:
            if node.memory_format not in (None, "preserve_format"):
                return flipped  # contiguous_format or channels_last: written row-major in its last dim
        elif not node.op.is_view:
            return flipped
        elif name not in _LAYOUT_KEEPING_VIEWS:
            swap = _swaps_last_two(graph, node, name)
            if swap is None:
                return flipped
            flipped ^= swap
        value = node.input_names[0]
    return flipped


def _swaps_last_two(graph: Graph, node: Node, name: str) -> bool | None:
    """For ``t``, ``transpose`` and ``permute``: True when the view swaps its input's last two dims, False when it
    keeps the last dim last and the one before it, None when it moves another dim into one of them (or another view)."""
    rank = graph.value(node.input_names[0]).spec.rank
    if rank < 2:
        return False
    last = {rank - 2, rank - 1}
    if name in ("t", "transpose"):
        if name == "t":
            return True
        dims = [arg for arg in node.args[1:3] if isinstance(arg, int)]
        if len(dims) != 2:
            return None
        moved = {dim % rank for dim in dims}
        if moved == last:
            return True
        return False if not moved & last else None
    if name == "permute":
        dims = next((arg for arg in node.args[1:] if isinstance(arg, tuple)), None)
        if dims is None or len(dims) != rank:
            return None
        tail = tuple(dim % rank for dim in dims[-2:])
        if tail == (rank - 2, rank - 1):
            return False
        return True if tail == (rank - 1, rank - 2) else None
    return None


def split_degree(strategy: NodeStrategy, mesh: Mesh) -> int:
    """How many pieces the node's iteration space is cut into: product of the axes taking a factor."""
    degree = 1
    for axis, choice in enumerate(strategy.choices):
        if choice.kind == "factor":
            degree *= mesh.shape[axis]
    return degree


def uneven_scale(strategy: NodeStrategy, input_specs: Sequence[TensorSpec], mesh: Mesh) -> float:
    """How much more than ``1 / split_degree`` of the work the rank with the largest pieces does (1.0 when even).

    Per factor (the axes taking one factor index), from the first input that carries it: a dim of
    size ``n`` cut over those axes (nested, axis order) has a largest piece ``p``; the factor's scale is
    ``p * count / n``. Exactly 1.0 for every even split.
    """
    axes_of: dict[int, list[int]] = {}
    for axis, choice in enumerate(strategy.choices):
        if choice.kind == "factor":
            axes_of.setdefault(choice.index, []).append(axis)
    scale = 1.0
    for axes in axes_of.values():
        size = _factor_size(strategy, input_specs, axes[0])
        if not size:
            continue
        largest, count = size, 1
        for axis in axes:
            largest, count = -(-largest // mesh.shape[axis]), count * mesh.shape[axis]
        if largest * count != size:
            scale *= largest * count / size
    return scale


def _factor_size(strategy: NodeStrategy, input_specs: Sequence[TensorSpec], axis: int) -> int | None:
    """The global size of the dim that ``axis``'s factor splits, read from the first input sharded on that axis."""
    for spec, sharding in zip(input_specs, strategy.inputs):
        placement = sharding[axis]
        if isinstance(placement, Shard) and placement.dim < spec.rank:
            return spec.shape[placement.dim]
    return None


def compute_seconds(
    work: Work,
    input_specs: Sequence[TensorSpec],
    output_specs: Sequence[TensorSpec | None],
    strategy: NodeStrategy,
    mesh: Mesh,
    device: Device,
) -> float:
    """Roofline time of the node's local work under ``strategy`` (seconds), on the rank with the largest pieces."""
    if work.is_view or work.allocates:
        return device.op_overhead_s
    dtype = compute_dtype(input_specs, output_specs)
    if work.attention is not None and device.attention_seconds:
        measured = device.measured_attention_s(local_attention_key(work.attention, input_specs, strategy, mesh))
        if measured is not None:  # timed on this machine in its local shapes (:mod:`.attention_times`)
            return device.op_overhead_s + measured
    if work.operands is not None and device.matmul_seconds:
        measured = device.measured_matmul_s(local_matmul_key(work, input_specs, strategy, mesh, dtype))
        if measured is not None:  # timed on this machine in its local shape (:mod:`.matmul_times`)
            return device.op_overhead_s + measured
    if work.relayout and device.relayout_seconds:
        key = local_relayout_key(input_specs, output_specs, strategy, mesh)
        measured = device.measured_relayout_s(key) if key is not None else None
        if measured is not None:  # timed on this machine in its local shape (:mod:`.relayout_times`)
            return device.op_overhead_s + measured
    flops = work.flops
    if not work.draws_whole:
        flops /= split_degree(strategy, mesh)
        if strategy.choices:
            flops *= uneven_scale(strategy, input_specs, mesh)
    input_bytes = [local_nbytes(spec, sharding, mesh) for spec, sharding in zip(input_specs, strategy.inputs)]
    memory_bytes = sum(input_bytes)
    memory_bytes += sum(
        spec.nbytes if work.draws_whole else local_nbytes(spec, sharding, mesh)
        for spec, sharding in zip(output_specs, strategy.outputs)
        if spec is not None and sharding is not None
    )
    roofline = max(flops / device.flops_per_s(dtype, _rate_flops(work, flops, output_specs, strategy, mesh), work.layout),
                   memory_bytes / device.bandwidth_bytes_per_s(dtype, memory_bytes))
    if work.operands is not None and device.matmul_stream_bytes_per_s_by_dtype:
        roofline = max(roofline, device.matmul_stream_s(dtype, max(input_bytes[i] for i in work.operands), work.layout))
    per_element = device.element_seconds(RELAYOUT if work.relayout else work.op, dtype) if work.op else 0.0
    if per_element:  # an op whose kernel computes more than it moves (exp, tanh, softmax): its measured rate
        roofline = max(roofline, per_element * sum(
            (spec.nbytes if work.draws_whole else local_nbytes(spec, sharding, mesh)) / spec.itemsize
            for spec, sharding in zip(output_specs, strategy.outputs) if spec is not None and sharding is not None))
    return device.op_overhead_s + roofline


def local_matmul_key(work: Work, input_specs: Sequence[TensorSpec], strategy: NodeStrategy, mesh: Mesh,
                     dtype: str) -> tuple | None:
    """The key of a matmul node's local work under ``strategy`` in :attr:`~.cluster.Device.matmul_seconds`:
    ``(dtype, layout, batch, m, k, n)`` of the largest pieces of its two operands (``batch`` 0 unless batched); None
    for operands of fewer than 2 dims."""
    first, second = (largest_local_shape(input_specs[i], strategy.inputs[i], mesh) for i in work.operands)
    if len(first) < 2 or len(second) < 2:
        return None
    batch = math.prod(first[:-2]) if work.op in _BATCHED else 0
    return (dtype, work.layout, batch, first[-2], first[-1], second[-1])


def local_relayout_key(input_specs: Sequence[TensorSpec], output_specs: Sequence[TensorSpec | None],
                       strategy: NodeStrategy, mesh: Mesh) -> tuple | None:
    """The key of a relayout copy's local work under ``strategy`` in :attr:`~.cluster.Device.relayout_seconds`:
    ``(dtype read, dtype written, shape)``, the largest piece of its transposed operand; None where the strategy
    gives the operand no sharding or the copy writes nothing."""
    if not input_specs or not output_specs or output_specs[0] is None or not strategy.inputs \
            or strategy.inputs[0] is None:
        return None
    return (input_specs[0].dtype, output_specs[0].dtype,
            tuple(largest_local_shape(input_specs[0], strategy.inputs[0], mesh)))


def local_attention_key(call: Any, input_specs: Sequence[TensorSpec], strategy: NodeStrategy, mesh: Mesh) -> tuple:
    """The key of a fused attention node's local call under ``strategy`` in
    :attr:`~.cluster.Device.attention_seconds`: the largest pieces of its query, key, value and mask."""
    from .attention_times import local_key

    def local(position: int) -> tuple[int, ...]:
        return largest_local_shape(input_specs[position], strategy.inputs[position], mesh)

    mask = local(call.mask) if call.mask is not None else None
    return local_key(call.direction, input_specs[call.query].dtype, local(call.query), local(call.key),
                     local(call.value), mask, input_specs[call.mask].dtype if call.mask is not None else "", call.causal)


def _rate_flops(work: Work, flops: float, output_specs: Sequence[TensorSpec | None], strategy: NodeStrategy,
                mesh: Mesh) -> float:
    """The FLOPs whose rate on the device's curve prices the node: a batched matmul's per batch element (its local
    output's leading dims), as it runs that many small matmuls (GPT-2's attention scores, 48 matmuls of 128 x 64 x 128
    a call, ran at 0.6x the rate of one matmul of the call's FLOPs on this project's machine); the node's own else."""
    if work.op not in _BATCHED or not output_specs or output_specs[0] is None or not strategy.outputs \
            or strategy.outputs[0] is None:
        return flops
    local = largest_local_shape(output_specs[0], strategy.outputs[0], mesh)
    batches = math.prod(local[:-2])
    return flops / batches if batches > 1 else flops


_FLOATING = ("float", "bfloat")


def compute_dtype(input_specs: Sequence[TensorSpec], output_specs: Sequence[TensorSpec | None]) -> str:
    """The dtype a node computes in: its first floating input's, else its first floating output's (float32 if none)."""
    for spec in (*input_specs, *output_specs):
        if spec is not None and spec.dtype.startswith(_FLOATING):
            return spec.dtype
    return "float32"


def copy_seconds(device: Device, dtype: str, elements: float) -> float:
    """One straight copy of ``elements`` elements of ``dtype`` (read once, written once), priced as a layout-keeping
    ``clone`` node is: the op's fixed cost and its bytes at the device's elementwise rate for that many bytes."""
    from ..ir import DTYPE_BYTES

    moved = 2.0 * elements * DTYPE_BYTES[dtype]
    return device.op_overhead_s + moved / device.bandwidth_bytes_per_s(dtype, moved)
