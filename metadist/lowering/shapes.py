"""Local shapes and offsets of values under a sharding, for one rank of the mesh.

MetaDist cuts a sharded dim as ``torch.chunk`` and DTensor do: ``m`` pieces of
``c = ceil(n / m)`` elements each, except at the end, where one piece may be
shorter and the last ones empty (``n = 6`` over ``m = 4``: pieces of 2, 2, 2, 0;
``n = 1001`` over 2: 501, 500). Piece ``r`` starts at ``min(r * c, n)``. When ``m``
divides ``n`` every piece is ``n / m`` (the even case), and every rank holds the
same shape; otherwise local shapes depend on the rank's coordinates.

Several axes may shard the same dim; they nest in axis order (the DTensor
convention): axis 0 cuts the dim first, axis 1 cuts axis 0's piece (so ``n = 9``
over axes of 2 and 4 gives pieces 2, 2, 1, 0 | 1, 1, 1, 1). This is what DTensor's
``compute_local_shape_and_global_offset`` computes, so shards convert to DTensors
and DCP reshards them by their global offsets.

The largest piece is the one at coordinate 0 of every axis
(:func:`max_local_shape`): it is what collectives pad every piece to, and what the
cost model prices.
"""

from __future__ import annotations

from typing import Sequence

from ..ir import Mesh, Shard
from .errors import LoweringError

__all__ = [
    "chunk_bounds", "local_bounds", "local_shape", "max_local_shape", "is_even", "shard_offset", "mesh_coordinates",
    "contiguous_strides",
]


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` when a dim of ``size`` is cut into ``parts`` as ``torch.chunk`` does."""
    if parts < 1 or not 0 <= index < parts:
        raise LoweringError(f"piece {index} of {parts}: a dim is cut into at least 1 piece, numbered 0 to parts - 1")
    full = -(-size // parts)  # ceil(size / parts)
    start = min(index * full, size)
    return start, min(full, size - start)


def piece_lengths(size: int, axis_sizes: Sequence[int]) -> set[int]:
    """Every piece length of a dim of ``size`` cut by ``torch.chunk`` over nested axes of ``axis_sizes``."""
    lengths = {size}
    for parts in axis_sizes:
        lengths = {chunk_bounds(extent, parts, index)[1] for extent in lengths for index in range(parts)}
    return lengths


def mesh_coordinates(mesh: Mesh, rank: int) -> tuple[int, ...]:
    """The coordinates of ``rank`` on the mesh (row-major, as ``init_device_mesh`` lays ranks out)."""
    if not 0 <= rank < mesh.size:
        raise LoweringError(f"rank {rank} is outside the mesh {mesh} of {mesh.size} devices")
    coords = []
    for size in reversed(mesh.shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def local_bounds(
    global_shape: Sequence[int], sharding: Sequence, mesh: Mesh, coords: Sequence[int], *, what: str = "a value"
) -> tuple[tuple[int, int], ...]:
    """Per dim, ``(offset, length)`` of the piece the rank at ``coords`` holds (nested chunks, axis order)."""
    _check_sharding(global_shape, sharding, mesh, what)
    if len(coords) != mesh.ndim:
        raise LoweringError(f"{what}: coordinates {tuple(coords)} do not name a device of the {mesh.ndim}-axis mesh {mesh}")
    bounds = [(0, size) for size in global_shape]
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard):
            offset, length = bounds[placement.dim]
            start, piece = chunk_bounds(length, mesh.shape[axis], coords[axis])
            bounds[placement.dim] = (offset + start, piece)
    return tuple(bounds)


def local_shape(
    global_shape: Sequence[int], sharding: Sequence, mesh: Mesh, coords: Sequence[int] | None = None, *, what: str = "a value"
) -> tuple[int, ...]:
    """The shape the rank at ``coords`` holds of a tensor of ``global_shape`` laid out as ``sharding``.

    Without ``coords`` the sharding must be even (every rank holds the same shape); an uneven one
    is an error that names the value, the dim and the mesh axis.
    """
    if coords is None:
        _check_sharding(global_shape, sharding, mesh, what)
        _require_even(global_shape, sharding, mesh, what)
        coords = (0,) * mesh.ndim
    return tuple(length for _, length in local_bounds(global_shape, sharding, mesh, coords, what=what))


def max_local_shape(global_shape: Sequence[int], sharding: Sequence, mesh: Mesh, *, what: str = "a value") -> tuple[int, ...]:
    """The largest local shape of any rank, dim by dim (the rank at coordinate 0 of every axis holds it)."""
    return local_shape(global_shape, sharding, mesh, (0,) * mesh.ndim, what=what)


def is_even(global_shape: Sequence[int], sharding: Sequence, mesh: Mesh) -> bool:
    """Whether every rank holds the same shape: each sharded dim is a multiple of the product of its axes."""
    pieces = [1] * len(global_shape)
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard) and placement.dim < len(global_shape):
            pieces[placement.dim] *= mesh.shape[axis]
    return all(size % count == 0 for size, count in zip(global_shape, pieces))


def shard_offset(global_shape: Sequence[int], sharding: Sequence, mesh: Mesh, coords: Sequence[int], dim: int) -> int:
    """Where the piece of ``dim`` held by the rank at ``coords`` starts in the global tensor."""
    return local_bounds(global_shape, sharding, mesh, coords)[dim][0]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of ``shape``."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _check_sharding(global_shape: Sequence[int], sharding: Sequence, mesh: Mesh, what: str) -> None:
    if len(sharding) != mesh.ndim:
        raise LoweringError(
            f"{what} has a sharding of {len(sharding)} placements on a {mesh.ndim}-axis mesh {mesh}; "
            "a sharding has one placement per mesh axis"
        )
    for placement in sharding:
        if isinstance(placement, Shard) and placement.dim >= len(global_shape):
            raise LoweringError(
                f"{what} of shape {tuple(global_shape)} is sharded on dim {placement.dim}, which it does not have"
            )


def _require_even(global_shape: Sequence[int], sharding: Sequence, mesh: Mesh, what: str) -> None:
    shape = list(global_shape)
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard):
            size, dim = mesh.shape[axis], placement.dim
            if shape[dim] % size:
                raise LoweringError(
                    f"{what} of shape {tuple(global_shape)}: dim {dim} (size {shape[dim]} at mesh axis "
                    f"{mesh.axis_names[axis]!r}) is split unevenly over mesh axis {mesh.axis_names[axis]!r} of size "
                    f"{size}, so its local shape differs between ranks: give the rank's coordinates "
                    "(local_shape(..., coords)) or max_local_shape for the largest piece"
                )
            shape[dim] //= size
