"""Rewrite the shape-carrying arguments of one node for its local shards.

Most ops need nothing: they read shapes from their inputs. Ops that carry
sizes in their arguments get the local sizes (view/reshape/expand sizes,
factory sizes); ``arange`` on a sharded dim starts at this rank's offset;
ops that index into a dim (slice, select, narrow, pad, slice/select
backward) must see that dim unsharded unless they take all of it; split,
layer norm and convolution backward follow the same rewrites ShardCombine's
executor applied when it found their rules (so a rule means here what it
meant there). Random ops are handled apart (see
:mod:`.program`): they draw the global tensor and keep this rank's slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..ir import Mesh, Node, Shard, TensorSpec
from .errors import LoweringError
from .shapes import contiguous_strides, shard_offset

__all__ = ["NodeContext", "rewrite_node_args"]


@dataclass(frozen=True)
class NodeContext:
    """What rewriting one node needs: its shardings and shapes, global and local."""

    node: Node
    input_specs: tuple[TensorSpec, ...]
    input_shardings: tuple[tuple, ...]
    input_local_shapes: tuple[tuple[int, ...], ...]
    output_specs: tuple[TensorSpec | None, ...]
    output_shardings: tuple[tuple | None, ...]
    output_local_shapes: tuple[tuple[int, ...] | None, ...]
    mesh: Mesh
    coords: tuple[int, ...]


Rewrite = Callable[[NodeContext, list, dict], tuple[str, list, dict]]


def _replace_arg(position: int) -> Rewrite:
    """The size argument at ``position`` becomes the local output shape."""

    def rewrite(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
        args[position] = tuple(ctx.output_local_shapes[0])
        return ctx.node.op.target, args, kwargs

    return rewrite


def _reshape(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    """view/reshape: the size is the local output shape, which must hold the local input's elements.

    With uneven pieces (``torch.chunk``), a reshape that merges or splits a sharded dim has no
    local counterpart: ``chunk(6, 4)`` rows of a ``(6, 3)`` tensor are not ``chunk(18, 4)`` rows
    of its ``(18,)`` view. The solver never plans that; a plan that does is refused here.
    """
    local_in, local_out = ctx.input_local_shapes[0], ctx.output_local_shapes[0]
    if math.prod(local_in) != math.prod(local_out):
        raise LoweringError(
            f"node {ctx.node.name!r} ({ctx.node.op.target}) reshapes {ctx.input_specs[0].shape} -> {ctx.output_specs[0].shape}, "
            f"but on this rank its input piece {local_in} and output piece {local_out} hold different numbers of elements: "
            "the plan splits a dim unevenly that the reshape merges or splits. Plan again (the solver splits such dims "
            "evenly or not at all), or make the dim a multiple of the mesh axes that split it"
        )
    args[1] = tuple(local_out)
    return ctx.node.op.target, args, kwargs


def _empty_strided(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    args[0] = tuple(ctx.output_local_shapes[0])
    args[1] = contiguous_strides(args[0])
    return ctx.node.op.target, args, kwargs


def _arange(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    sharding = ctx.output_shardings[0]
    if not any(isinstance(placement, Shard) for placement in sharding):
        return ctx.node.op.target, args, kwargs
    target = ctx.node.op.target
    if target == "aten.arange.default":
        start, step = 0, 1
    elif target == "aten.arange.start":
        start, step = args[0], 1
    elif target == "aten.arange.start_step":
        start, step = args[0], args[2]
    else:
        raise LoweringError(f"node {ctx.node.name!r}: {target} on a sharded dim is not supported; replicate it")
    spec = ctx.output_specs[0]
    offset = shard_offset(spec.shape, sharding, ctx.mesh, ctx.coords, 0)
    length = ctx.output_local_shapes[0][0]
    return "aten.arange.start_step", [start + offset * step, start + (offset + length) * step, step], kwargs


def _indexing(dim_position: int, full: Callable[[list, int], bool]) -> Rewrite:
    """Ops that index into one dim: fine unless that dim is sharded and the op does not take all of it."""

    def rewrite(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
        spec, sharding = ctx.input_specs[0], ctx.input_shardings[0]
        dim = args[dim_position] if len(args) > dim_position else 0
        dim = dim + spec.rank if dim < 0 else dim
        axes = [axis for axis, placement in enumerate(sharding) if placement == Shard(dim)]
        if axes and not full(args, spec.shape[dim]):
            names = ", ".join(repr(ctx.mesh.axis_names[axis]) for axis in axes)
            raise LoweringError(
                f"node {ctx.node.name!r} ({ctx.node.op.target}) indexes into dim {dim} of %{ctx.node.input_names[0]}, "
                f"which the plan shards over mesh axis {names}: the op needs that dim whole. "
                "Plan with a rule that replicates this input's dim (the rule database may be stale)"
            )
        return ctx.node.op.target, args, kwargs

    return rewrite


def _slice_is_full(args: list, size: int) -> bool:
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    return (start in (None, 0)) and (end is None or end >= size) and step == 1


def _never_full(args: list, size: int) -> bool:
    return False


def _backward_sizes(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    """slice_backward/select_backward: ``input_sizes`` is the output's shape; its indexed dim must be whole."""
    spec, sharding = ctx.output_specs[0], ctx.output_shardings[0]
    dim = args[2] % spec.rank
    if any(placement == Shard(dim) for placement in sharding):
        raise LoweringError(
            f"node {ctx.node.name!r} ({ctx.node.op.target}) writes into dim {dim}, which the plan shards: "
            "the op needs that dim whole. Plan with a rule that keeps it whole"
        )
    args[1] = tuple(ctx.output_local_shapes[0])
    return ctx.node.op.target, args, kwargs


def _normalized_shape(position: int, source: int) -> Rewrite:
    """Layer norm (and its backward): ``normalized_shape`` follows the input's local trailing dims."""

    def rewrite(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
        count = len(args[position])
        local = ctx.input_local_shapes[source]
        args[position] = tuple(local[len(local) - count:])
        return ctx.node.op.target, args, kwargs

    return rewrite


def _conv_backward(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    """convolution_backward: ``bias_sizes`` is the weight's local output channels."""
    if args[3] is not None:
        args[3] = (ctx.input_local_shapes[2][0],)
    return ctx.node.op.target, args, kwargs


def _embedding_backward(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    """embedding_dense_backward: ``num_weights`` is the output's rows; they must not be sharded."""
    if any(placement == Shard(0) for placement in ctx.output_shardings[0]):
        raise LoweringError(f"node {ctx.node.name!r}: embedding backward with its vocabulary rows sharded is not supported")
    return ctx.node.op.target, args, kwargs


def _split(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    """split: on a sharded dim, the same number of pieces, each ``local / count`` (as the rule was found)."""
    global_shape, local = ctx.input_specs[0].shape, ctx.input_local_shapes[0]
    dim = (args[2] if len(args) > 2 else 0) % len(global_shape)
    if global_shape[dim] != local[dim]:
        count = -(-global_shape[dim] // args[1])
        if global_shape[dim] % args[1] or local[dim] % count:
            raise _split_error(ctx, dim)
        args[1] = local[dim] // count
    return ctx.node.op.target, args, kwargs


def _split_with_sizes(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    """split_with_sizes: on a sharded dim, sizes scale with the dim (as the rule was found)."""
    global_shape, local = ctx.input_specs[0].shape, ctx.input_local_shapes[0]
    dim = (args[2] if len(args) > 2 else 0) % len(global_shape)
    if global_shape[dim] != local[dim]:
        scaled = [size * local[dim] / global_shape[dim] for size in args[1]]
        if any(value != int(value) for value in scaled):
            raise _split_error(ctx, dim)
        args[1] = tuple(int(value) for value in scaled)
    return ctx.node.op.target, args, kwargs


def _split_error(ctx: NodeContext, dim: int) -> LoweringError:
    return LoweringError(
        f"node {ctx.node.name!r} ({ctx.node.op.target}) splits dim {dim}, sharded to local size "
        f"{ctx.input_local_shapes[0][dim]}, into pieces that have no local counterpart; replicate that dim"
    )


def _pad(ctx: NodeContext, args: list, kwargs: dict) -> tuple[str, list, dict]:
    spec, sharding = ctx.input_specs[0], ctx.input_shardings[0]
    pads = args[1]
    for index in range(0, len(pads), 2):
        dim = spec.rank - 1 - index // 2
        if (pads[index] or pads[index + 1]) and any(p == Shard(dim) for p in sharding):
            raise LoweringError(
                f"node {ctx.node.name!r} pads dim {dim}, which the plan shards; padding needs that dim whole"
            )
    return ctx.node.op.target, args, kwargs


_REWRITES: dict[str, Rewrite] = {
    "aten.view.default": _reshape,
    "aten.reshape.default": _reshape,
    "aten._unsafe_view.default": _reshape,
    "aten.expand.default": _replace_arg(1),
    "aten.full.default": _replace_arg(0),
    "aten.zeros.default": _replace_arg(0),
    "aten.ones.default": _replace_arg(0),
    "aten.empty.memory_format": _replace_arg(0),
    "aten.empty.default": _replace_arg(0),
    "aten.new_ones.default": _replace_arg(1),
    "aten.new_zeros.default": _replace_arg(1),
    "aten.new_empty.default": _replace_arg(1),
    "aten.new_full.default": _replace_arg(1),
    "aten.empty_strided.default": _empty_strided,
    "aten.arange.default": _arange,
    "aten.arange.start": _arange,
    "aten.arange.start_step": _arange,
    "aten.slice.Tensor": _indexing(1, _slice_is_full),
    "aten.select.int": _indexing(1, _never_full),
    "aten.narrow.default": _indexing(1, _never_full),
    "aten.split.Tensor": _split,
    "aten.split_with_sizes.default": _split_with_sizes,
    "aten.constant_pad_nd.default": _pad,
    "aten.slice_backward.default": _backward_sizes,
    "aten.select_backward.default": _backward_sizes,
    "aten.native_layer_norm.default": _normalized_shape(1, 0),
    "aten.native_layer_norm_backward.default": _normalized_shape(2, 1),
    "aten.convolution_backward.default": _conv_backward,
    "aten.embedding_dense_backward.default": _embedding_backward,
}


def rewrite_node_args(ctx: NodeContext, args: Sequence[Any], kwargs: dict) -> tuple[str, tuple, dict]:
    """The node's target and arguments for its local shards (tensor references already renamed)."""
    rewrite = _REWRITES.get(ctx.node.op.target)
    if rewrite is None:
        return ctx.node.op.target, tuple(args), kwargs
    target, new_args, new_kwargs = rewrite(ctx, list(args), dict(kwargs))
    return target, tuple(new_args), new_kwargs
