"""Sizes of values under a sharding: the local shard one device holds (the largest, where pieces are uneven)."""

from __future__ import annotations

import math
from typing import Sequence

from ..ir import Mesh, Shard, TensorSpec


def shard_divisor(sharding: Sequence, mesh: Mesh) -> int:
    """Into how many pieces a sharding cuts a tensor (Replicate and Partial do not cut)."""
    divisor = 1
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard):
            divisor *= mesh.shape[axis]
    return divisor


def largest_local_shape(spec: TensorSpec, sharding: Sequence, mesh: Mesh) -> list[int]:
    """The largest local shard of ``spec`` under ``sharding``: ``ceil`` per sharded dim, nested in axis order.

    Uneven dims are cut as ``torch.chunk`` cuts them; the rank at coordinate 0 of every axis holds
    this shape, and the collectives pad every other piece to it.
    """
    shape = list(spec.shape)
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard) and placement.dim < len(shape):
            shape[placement.dim] = -(-shape[placement.dim] // mesh.shape[axis])
    return shape


def local_nbytes(spec: TensorSpec, sharding: Sequence | None, mesh: Mesh) -> float:
    """Bytes of the (largest) local shard of ``spec`` under ``sharding`` (ceil per sharded dim)."""
    if sharding is None:
        return float(spec.nbytes)
    return float(math.prod(largest_local_shape(spec, sharding, mesh)) * spec.itemsize)


def padded_nbytes(spec: TensorSpec, sharding: Sequence, mesh: Mesh, dim: int, parts: int) -> float:
    """Bytes of the largest local shard with ``dim`` padded up to a multiple of ``parts`` (a reduce-scatter's
    or an all-to-all's input on uneven pieces, as the runtime pads it)."""
    shape = largest_local_shape(spec, sharding, mesh)
    shape[dim] = -(-shape[dim] // parts) * parts
    return float(math.prod(shape) * spec.itemsize)


def is_divisible(spec: TensorSpec, sharding: Sequence, mesh: Mesh) -> bool:
    """Whether every sharded dim splits evenly over the axes that shard it."""
    pieces = [1] * spec.rank
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard):
            if placement.dim >= spec.rank:
                return False
            pieces[placement.dim] *= mesh.shape[axis]
    return all(size % count == 0 for size, count in zip(spec.shape, pieces))
