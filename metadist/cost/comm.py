"""Communication cost: the collectives that move a value between two shardings.

Each mesh axis whose placement changes runs one collective over the devices along that axis,
priced with the alpha-beta model of that axis's link and the ring formulas
(``n`` devices on the axis, ``B`` bytes of the local buffer before the step), plus the link's
fixed ``call_overhead_s`` per collective:

=====================  ===================  =====================================================
transition             collective           time
=====================  ===================  =====================================================
Replicate -> Shard     local slice          0
Replicate -> Partial   local (zero others)  0
Shard(i) -> Replicate  all-gather           (n-1) alpha + (n-1) B / bw
Partial -> Replicate   all-reduce           2 (n-1) alpha + 2 (n-1)/n B / bw
Partial -> Shard(i)    reduce-scatter       (n-1) alpha + (n-1)/n B / bw
Shard(i) -> Shard(j)   all-to-all           (n-1) alpha + (n-1)/n B / bw
Shard(i) -> Partial    all-gather           as Shard -> Replicate
=====================  ===================  =====================================================

Uneven pieces (``torch.chunk``: the last ones shorter or empty) are priced as the runtime moves
them, padded to equal pieces: ``B`` is the largest piece (an all-gather's), or the buffer with its
scattered dim padded to a multiple of ``n`` (a reduce-scatter's, an all-to-all's).

Axes that shrink the buffer (to Shard) go first, then the gathers and all-reduces, so that
each collective moves as little as possible (the order DTensor's redistribute favours).

A node whose strategy takes a halo factor (:attr:`metadist.ir.plan.NodeStrategy.halos`) first
exchanges border elements on that axis (:func:`halo_exchange_seconds`): the runtime all-gathers
each rank's ``h`` first and ``h`` last elements of the split dim (``2h`` slices), so each rank
sends ``(n-1) 2h`` slices, priced as that all-gather.

A collective the runtime runs in a bucket with others (:mod:`.bucketing`) pays only
``fixed_share`` of its fixed cost (the ``alpha`` terms and ``call_overhead_s``); the
bandwidth term is paid in full. All-to-alls are never bucketed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..ir import Partial, Replicate, Shard, TensorSpec
from .cluster import Cluster, Link
from .sharding import local_nbytes, padded_nbytes


@dataclass(frozen=True)
class Collective:
    """One collective on one mesh axis."""

    kind: str
    """``all_gather``, ``all_reduce``, ``reduce_scatter`` or ``all_to_all``."""
    axis: int
    comm_bytes: float
    """Bytes each device sends over the axis's link."""
    comm_s: float


@dataclass(frozen=True)
class Resharding:
    """The collectives of one resharding and their total time."""

    collectives: tuple[Collective, ...] = field(default_factory=tuple)

    @property
    def comm_s(self) -> float:
        return sum(item.comm_s for item in self.collectives)


NO_RESHARDING = Resharding()


def collective_seconds(kind: str, buffer_bytes: float, axis_size: int, link: Link, fixed_share: float = 1.0) -> tuple[float, float]:
    """(time, bytes sent per device) of one ring collective on ``axis_size`` devices.

    ``buffer_bytes`` is the local buffer before the collective (a shard for all-gather);
    ``fixed_share`` scales the fixed cost (latencies and call overhead) of a bucketed collective.
    """
    n = axis_size
    if n <= 1:
        return 0.0, 0.0
    steps, sent = _ring(kind, buffer_bytes, n)
    share = 1.0 if kind == "all_to_all" else fixed_share
    return share * (link.call_overhead_s + steps * link.latency_s) + sent / link.bandwidth_bytes_per_s, sent


def _ring(kind: str, buffer_bytes: float, n: int) -> tuple[int, float]:
    """(latency steps, bytes sent per device) of a ring collective."""
    if kind == "all_gather":
        return n - 1, (n - 1) * buffer_bytes
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * buffer_bytes
    if kind in ("reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n * buffer_bytes
    raise ValueError(f"unknown collective {kind!r}")


def _collective_kind(src, dst) -> str | None:
    if src == dst or isinstance(src, Replicate):
        return None  # unchanged, or a free local slice / zeroing
    if isinstance(src, Shard):
        return "all_to_all" if isinstance(dst, Shard) else "all_gather"
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            return "reduce_scatter"
        return "all_reduce"
    raise ValueError(f"unknown placement {src!r}")


def reshard(spec: TensorSpec, src: Sequence, dst: Sequence, cluster: Cluster, fixed_share: float = 1.0) -> Resharding:
    """The collectives that move a value of ``spec`` from sharding ``src`` to ``dst``.

    ``fixed_share``: the share of each collective's fixed cost paid when it runs bucketed (1: alone).
    """
    if tuple(src) == tuple(dst):
        return NO_RESHARDING
    mesh = cluster.mesh
    current = list(src)
    shrinking = [axis for axis in range(mesh.ndim) if src[axis] != dst[axis] and isinstance(dst[axis], Shard)]
    growing = [axis for axis in range(mesh.ndim) if src[axis] != dst[axis] and not isinstance(dst[axis], Shard)]
    collectives = []
    for axis in shrinking + growing:
        kind = _collective_kind(current[axis], dst[axis])
        buffer_bytes = _buffer_bytes(kind, spec, current, dst[axis], mesh, axis)
        current[axis] = dst[axis]
        if kind is None:
            continue
        seconds, sent = collective_seconds(kind, buffer_bytes, mesh.shape[axis], cluster.link(axis), fixed_share)
        collectives.append(Collective(kind=kind, axis=axis, comm_bytes=sent, comm_s=seconds))
    return Resharding(tuple(collectives))


def _buffer_bytes(kind: str | None, spec: TensorSpec, current: Sequence, wanted, mesh, axis: int) -> float:
    """The local buffer a collective starts from, padded as the runtime pads uneven pieces.

    An all-gather's input is the largest piece (every piece is padded to it); a reduce-scatter's
    and an all-to-all's scattered dim is padded up to a multiple of the axis size.
    """
    if kind in ("reduce_scatter", "all_to_all") and isinstance(wanted, Shard):
        return padded_nbytes(spec, current, mesh, wanted.dim, mesh.shape[axis])
    return local_nbytes(spec, current, mesh)


def halo_exchange_bytes(spec: TensorSpec, sharding: Sequence, axis: int, halo: int, mesh) -> float:
    """The buffer one rank contributes to the halo exchange of ``spec`` on ``axis``: ``2 * halo`` slices of its dim."""
    placement = sharding[axis]
    if not isinstance(placement, Shard) or mesh.shape[axis] <= 1:
        return 0.0
    local = local_nbytes(spec, sharding, mesh)
    extent = spec.shape[placement.dim]
    for other, item in enumerate(sharding):
        if item == placement:
            extent //= mesh.shape[other]
    return local / max(extent, 1) * 2 * halo


def halo_exchange_seconds(input_specs: Sequence[TensorSpec], strategy, cluster: Cluster) -> tuple[float, float]:
    """(seconds, bytes sent per device) of the halo exchanges before a node under ``strategy`` (0 without halos)."""
    seconds = sent = 0.0
    mesh = cluster.mesh
    for axis, halo in enumerate(getattr(strategy, "halos", ()) or ()):
        if not halo:
            continue
        for spec, sharding in zip(input_specs, strategy.inputs):
            buffer_bytes = halo_exchange_bytes(spec, sharding, axis, halo, mesh)
            if buffer_bytes:
                step_s, step_bytes = collective_seconds("all_gather", buffer_bytes, mesh.shape[axis], cluster.link(axis))
                seconds, sent = seconds + step_s, sent + step_bytes
    return seconds, sent
