"""Do the ranks that should hold the same piece of a value hold the same numbers? (``--check``, every plan.)

A value replicated over a mesh axis is computed, or received, whole on each rank of that axis, and a check compares
one copy (the first device's): a rank whose copy drifted would go unseen until the drift spread to what the check
reads (the zoo's ConvNeXt on 2x2: a rank given an empty piece of the patch embedding's input channels computed a zero
bias gradient, and its replicated bias drifted from the others'). :func:`replica_disagreements` compares every copy.

Each rank fingerprints, per value piece with a replicated axis, the float64 sum of its elements, of their absolute
values and of every third element (which moves when elements are permuted); the fingerprints are gathered once, and
the copies of one piece (the same scope, value and coordinates on the value's other axes) are held to ``tolerance``
times the piece's absolute sum. Copies made by the same kernels on the same inputs agree exactly; the bound leaves
room for a kernel whose reduction order follows the shape of an operand the value does not depend on. Two copies that
are both NaN at the same fingerprint agree (the comparison with the single-device run says what is wrong there).
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Sequence

import torch
import torch.distributed as dist

from ..ir import Replicate, Shard

REPLICA_TOLERANCE = 1e-5
"""How far two copies of a replicated piece may differ, relative to the piece's absolute sum."""

Item = tuple  # (key, local piece, sharding over the mesh the coordinates name)


def replica_disagreements(items: Sequence[Item], coords: Sequence[int], scope: Hashable = "",
                          tolerance: float = REPLICA_TOLERANCE) -> list[tuple[str, float, int]]:
    """The values among ``items`` whose copies disagree across the ranks that hold the same piece, ``(key, relative
    difference, rank)`` of the worst copy of each (collective over every process; every rank gets the answer).

    ``items``: this rank's ``(key, local piece, sharding)``, one per key (a gradient keyed ``grad:NAME``); ``coords``: this rank's coordinates on the mesh the
    shardings name; ``scope``: what the coordinates are relative to (a pipeline stage's index: each stage's sub-mesh
    compares its own ranks; every rank of one scope must list the same keys)."""
    keys = [key for key, *_ in items]
    if len(set(keys)) != len(keys):
        raise ValueError(f"replica_disagreements needs one item per key; repeated: "
                         f"{sorted({key for key in keys if keys.count(key) > 1})}")
    kept = [(key, local, sharding) for key, local, sharding in items
            if any(isinstance(placement, Replicate) for placement in sharding)
            and all(isinstance(placement, (Shard, Replicate)) for placement in sharding)
            and local.is_floating_point()]
    rows = []
    for _, local, _ in kept:
        flat = local.detach().reshape(-1)  # summed in float64 as it is read, without a float64 copy
        rows.append(torch.stack([flat.sum(dtype=torch.float64), torch.linalg.vector_norm(flat, 1, dtype=torch.float64),
                                 flat[::3].sum(dtype=torch.float64)]))
    prints = torch.stack(rows).tolist() if rows else []  # one host transfer for every piece
    mine = [(scope, key, tuple(c for c, placement in zip(coords, sharding) if not isinstance(placement, Replicate)),
             tuple(fingerprint)) for (key, _, sharding), fingerprint in zip(kept, prints)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    first: dict[tuple, tuple[float, ...]] = {}
    worst: dict[str, tuple[float, int]] = {}
    for rank, entries in enumerate(gathered):
        for entry_scope, key, group, fingerprint in entries:
            lead = first.setdefault((entry_scope, key, group), fingerprint)
            difference = _difference(fingerprint, lead)
            if not difference <= tolerance and not difference <= worst.get(key, (0.0, -1))[0]:
                worst[key] = (difference, rank)
    return [(key, difference, rank) for key, (difference, rank) in worst.items()]


def _difference(mine: tuple[float, ...], theirs: tuple[float, ...]) -> float:
    """The largest difference of two fingerprints over the larger absolute sum (0 when equal, NaN where equal; inf
    when one is NaN or infinite where the other is not)."""
    if all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(mine, theirs)):
        return 0.0
    scale = max(abs(mine[1]), abs(theirs[1]))
    if not math.isfinite(scale) or any(not math.isfinite(a - b) for a, b in zip(mine, theirs)):
        return math.inf
    return max(abs(a - b) for a, b in zip(mine, theirs)) / scale if scale > 0 else math.inf
