"""Rewrite the shape-carrying params of a JAX primitive for smaller (sliced) inputs.

ShardCombine runs an op on pieces of its inputs. Most primitives infer their
output shape from their operands; a few carry shapes in their params
(``broadcast_in_dim.shape``, ``reshape.new_sizes``, ``gather.slice_sizes``,
``slice.limit_indices``, ``split.sizes``...). :func:`rewritten_params`
returns the params those primitives need for the new operand shapes, or
raises :class:`ShapeRewriteError` when the split cannot be expressed (e.g. a
slice that cuts the dim being split).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .errors import JaxCaptureError

__all__ = ["ShapeRewriteError", "rewritten_params"]

Shape = tuple[int, ...]


class ShapeRewriteError(JaxCaptureError):
    """A primitive cannot run on these input shapes (the split cuts across what its params fix)."""


def rewritten_params(name: str, params: dict[str, Any], old_inputs: Sequence[Shape], new_inputs: Sequence[Shape],
                     old_outputs: Sequence[Shape]) -> dict[str, Any]:
    """The params that change for ``new_inputs`` (empty when none do)."""
    if list(old_inputs) == list(new_inputs):
        return {}
    rewrite = _REWRITES.get(name)
    return {} if rewrite is None else rewrite(params, list(old_inputs), list(new_inputs), list(old_outputs))


def _broadcast_in_dim(params: dict, old: list[Shape], new: list[Shape], outs: list[Shape]) -> dict:
    shape = list(params["shape"])
    for in_dim, out_dim in enumerate(params["broadcast_dimensions"]):
        if old[0][in_dim] != new[0][in_dim]:
            shape[out_dim] = new[0][in_dim]
    return {"shape": tuple(shape)}


def _reshape(params: dict, old: list[Shape], new: list[Shape], outs: list[Shape]) -> dict:
    from ...shardcombine.shapes import reshape_for

    if params.get("dimensions") is not None:
        raise ShapeRewriteError("a reshape with a dimensions permutation cannot be rewritten")
    new_sizes = reshape_for(old[0], tuple(params["new_sizes"]), new[0])
    if new_sizes is None:
        raise ShapeRewriteError(f"reshape {old[0]}->{tuple(params['new_sizes'])} cannot follow its input to {new[0]}")
    return {"new_sizes": tuple(new_sizes)}


def _slice(params: dict, old: list[Shape], new: list[Shape], outs: list[Shape]) -> dict:
    starts, limits = list(params["start_indices"]), list(params["limit_indices"])
    strides = params.get("strides") or (1,) * len(starts)
    for dim, (old_size, new_size) in enumerate(zip(old[0], new[0])):
        if old_size == new_size:
            continue
        if starts[dim] != 0 or limits[dim] != old_size or strides[dim] != 1:
            raise ShapeRewriteError(f"slice cuts dim {dim} ({starts[dim]}:{limits[dim]} of {old_size}); it cannot be split")
        limits[dim] = new_size
    return {"limit_indices": tuple(limits)}


def _split(params: dict, old: list[Shape], new: list[Shape], outs: list[Shape]) -> dict:
    axis = params["axis"]
    old_size, new_size = old[0][axis], new[0][axis]
    if old_size == new_size:
        return {}
    if any(size * new_size % old_size for size in params["sizes"]):
        raise ShapeRewriteError(f"split of dim {axis} into {params['sizes']} cannot follow it to size {new_size}")
    return {"sizes": tuple(size * new_size // old_size for size in params["sizes"])}


def _slice_sizes(params: dict, old: list[Shape], new: list[Shape], outs: list[Shape]) -> dict:
    sizes = list(params["slice_sizes"])
    for dim, (old_size, new_size) in enumerate(zip(old[0], new[0])):
        if old_size != new_size and sizes[dim] == old_size:
            sizes[dim] = new_size
    return {"slice_sizes": tuple(sizes)}


_REWRITES: dict[str, Callable[[dict, list, list, list], dict]] = {
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "slice": _slice,
    "split": _split,
    "gather": _slice_sizes,
    "dynamic_slice": _slice_sizes,
}
