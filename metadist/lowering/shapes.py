"""Local shapes of values under a sharding, for one rank of the mesh.

MetaDist shards evenly: along every mesh axis that shards a dim, the dim's
size (after the splits of earlier axes) must be divisible by the axis size.
With even shards, every rank holds pieces of the same shape, every
all-gather/reduce-scatter/all-to-all moves equal pieces, and the pieces are
exactly what ``torch.chunk`` and DTensor produce. Uneven splits are rejected
with an error that names the value, the dim and the mesh axis.

Several axes may shard the same dim; they nest in axis order (the DTensor
convention): axis 0 splits the dim first, axis 1 splits axis 0's piece.
"""

from __future__ import annotations

from typing import Sequence

from ..ir import Mesh, Shard
from .errors import LoweringError

__all__ = ["local_shape", "shard_offset", "mesh_coordinates", "contiguous_strides"]


def mesh_coordinates(mesh: Mesh, rank: int) -> tuple[int, ...]:
    """The coordinates of ``rank`` on the mesh (row-major, as ``init_device_mesh`` lays ranks out)."""
    if not 0 <= rank < mesh.size:
        raise LoweringError(f"rank {rank} is outside the mesh {mesh} of {mesh.size} devices")
    coords = []
    for size in reversed(mesh.shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def local_shape(
    global_shape: Sequence[int], sharding: Sequence, mesh: Mesh, *, what: str = "a value"
) -> tuple[int, ...]:
    """The shape every rank holds of a tensor of ``global_shape`` laid out as ``sharding``."""
    _check_sharding(global_shape, sharding, mesh, what)
    shape = list(global_shape)
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard):
            size = mesh.shape[axis]
            if shape[placement.dim] % size:
                raise _uneven_error(what, placement.dim, shape[placement.dim], global_shape, mesh, axis)
            shape[placement.dim] //= size
    return tuple(shape)


def shard_offset(global_shape: Sequence[int], sharding: Sequence, mesh: Mesh, coords: Sequence[int], dim: int) -> int:
    """Where this rank's piece of ``dim`` starts in the global tensor."""
    local = local_shape(global_shape, sharding, mesh)
    offset, extent = 0, global_shape[dim]
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard) and placement.dim == dim:
            extent //= mesh.shape[axis]
            offset += coords[axis] * extent
    assert extent == local[dim]
    return offset


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


def _uneven_error(what: str, dim: int, size: int, global_shape: Sequence[int], mesh: Mesh, axis: int) -> LoweringError:
    return LoweringError(
        f"{what} of shape {tuple(global_shape)}: dim {dim} (size {size} at mesh axis "
        f"{mesh.axis_names[axis]!r}) cannot be split evenly over mesh axis {mesh.axis_names[axis]!r} "
        f"of size {mesh.shape[axis]}. MetaDist shards evenly: make dim {dim} a multiple of "
        f"{mesh.shape[axis]} (e.g. the batch size), or use a plan that does not split dim {dim} on that axis"
    )
