"""Sizes of values under a sharding: the local shard one device holds."""

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


def local_nbytes(spec: TensorSpec, sharding: Sequence | None, mesh: Mesh) -> float:
    """Bytes of the local shard of ``spec`` under ``sharding`` (ceil per sharded dim)."""
    if sharding is None:
        return float(spec.nbytes)
    shape = list(spec.shape)
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard) and placement.dim < len(shape):
            shape[placement.dim] = math.ceil(shape[placement.dim] / mesh.shape[axis])
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
