"""Halo exchange: the lowering of a node whose strategy takes a halo factor.

A halo factor (``Concat(dim, halo=h)``, :mod:`metadist.ir.rule`) on mesh axis ``a``
(``NodeStrategy.halos[a] == h``) lowers, on each rank, to

1. for every input sharded ``Shard(d)`` on ``a``: a :class:`Reshard` with one
   ``halo_exchange`` step that extends the local piece by ``h`` elements of ``d`` on each
   side, taken from the neighbours on axis ``a`` (coordinates ``c - 1`` and ``c + 1``), zeros
   where there is none (the global borders). The runtime all-gathers every rank's first and
   last ``h`` elements (``2h`` slices), so a rank sends ``(k-1) 2h`` slices, counted as an
   all-gather of that buffer;
2. the op, unchanged, on the extended pieces (its local output is ``2t`` longer on the
   output's dim, ``t = h * m / n``);
3. for every output sharded ``Shard(d)`` on ``a``: a :class:`Reshard` with one local
   ``halo_trim`` step that drops ``t`` elements at each end.

The exchanges and trims are :class:`Reshard` instructions with step kinds outside
:data:`~.reshard.COLLECTIVE_KINDS`, so coalescing and overlap leave them where they stand;
:meth:`~.program.RankProgram.predicted_comm` counts ``halo_exchange`` steps.

The halo's neighbours must hold the adjacent pieces of the dim: the dim is sharded by the
halo axis alone (:func:`metadist.ir.plan.strategy_from_choices` refuses two axes taking one
halo factor; another axis sharding the same dim is refused here), in equal pieces (uneven
pieces are refused here; the solver never plans them).
"""

from __future__ import annotations

import math
from typing import Sequence

from ..ir import Mesh, Shard, TensorSpec
from ..ir.rule import halo_trim
from .errors import LoweringError
from .reshard import ReshardStep, comm_bytes

__all__ = ["HALO_STEP_KINDS", "halo_exchange_step", "halo_trim_step"]

#: Step kinds of halo lowering: the exchange communicates, the trim is local.
HALO_STEP_KINDS = ("halo_exchange", "halo_trim")


def halo_exchange_step(spec: TensorSpec, sharding: tuple, local_in: tuple[int, ...], axis: int, halo: int, mesh: Mesh,
                       coords: Sequence[int], what: str) -> ReshardStep:
    """The ``halo_exchange`` step that extends a local piece of ``spec`` by ``halo`` on each side along its dim on ``axis``."""
    placement = sharding[axis]
    if not isinstance(placement, Shard):  # pragma: no cover - callers pass sharded inputs only
        raise LoweringError(f"{what}: a halo exchange needs the input sharded on mesh axis {axis}")
    dim = placement.dim
    others = [a for a, p in enumerate(sharding) if p == placement and a != axis]
    if others:
        raise LoweringError(
            f"{what}: dim {dim} is sharded over mesh axes {[mesh.axis_names[a] for a in [axis, *others]]}, but a halo "
            f"exchange on axis {mesh.axis_names[axis]!r} needs that axis alone to split dim {dim}. Plan again"
        )
    if spec.shape[dim] % mesh.shape[axis]:
        raise LoweringError(
            f"{what}: dim {dim} ({spec.shape[dim]}) is split unevenly over mesh axis {mesh.axis_names[axis]!r} "
            f"({mesh.shape[axis]}), and halo exchanges need equal pieces. Plan again (the solver splits halo dims evenly)"
        )
    if local_in[dim] < halo:
        raise LoweringError(f"{what}: local pieces of dim {dim} ({local_in[dim]}) are narrower than the halo ({halo})")
    local_out = tuple(size + 2 * halo if d == dim else size for d, size in enumerate(local_in))
    k = mesh.shape[axis]
    border_bytes = math.prod(local_in) // local_in[dim] * 2 * halo * spec.itemsize
    return ReshardStep(
        kind="halo_exchange", axis=axis, axis_size=k, dim=dim, split_dim=None, op=None, coordinate=coords[axis],
        local_shape_in=tuple(local_in), local_shape_out=local_out,
        comm_bytes=comm_bytes("halo_exchange", k, border_bytes, border_bytes * k),
    )


def halo_trim_step(local_out: tuple[int, ...], dim: int, axis: int, halo: int, factor_size: int, output_size: int,
                   mesh: Mesh, coords: Sequence[int], what: str) -> ReshardStep:
    """The ``halo_trim`` step from the op's extended local output to its ``local_out`` piece."""
    trim = halo_trim(halo, factor_size, output_size)
    if trim is None:
        raise LoweringError(f"{what}: a halo of {halo} on a dim of {factor_size} trims {halo} * {output_size} / "
                            f"{factor_size} elements, not a whole number; plan again")
    extended = tuple(size + 2 * trim if d == dim else size for d, size in enumerate(local_out))
    return ReshardStep(
        kind="halo_trim", axis=axis, axis_size=mesh.shape[axis], dim=dim, split_dim=None, op=None, coordinate=coords[axis],
        local_shape_in=extended, local_shape_out=tuple(local_out), comm_bytes=0,
    )
