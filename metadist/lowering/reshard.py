"""Resharding: the collectives that move a value from one sharding to another.

:func:`plan_resharding` lists, for one value, the per-axis steps that take it
from ``source`` to ``target`` sharding on an N-D mesh. Dims sharded by several
axes nest in axis order (axis 0 outermost), so order matters; the steps run in
three phases (2 and 3 interleave, first axis first):

1. **Un-shard**, last axis first: an axis whose ``Shard(d)`` is not part of the
   longest common prefix of the axes sharding ``d`` in both shardings is
   all-gathered (or, when it is the only axis involved with either dim,
   exchanged in one all-to-all ``Shard(i) -> Shard(j)``).
2. **Reduce**, per axis: ``Partial(op) -> Replicate`` all-reduces;
   ``Partial(op) -> Shard(d)`` reduce-scatters when the axes already sharding
   ``d`` are exactly the target's axes before this one (else all-reduce, then
   slice in phase 3); ``Partial(op)`` to the same
   ``Partial(op)`` stays as it is.
3. **Shard**, first axis first: ``Replicate -> Shard(d)`` takes the rank's slice
   locally (no communication); ``Replicate -> Partial(sum)`` keeps the value on
   coordinate 0 of the axis and zeros elsewhere (``max``/``min``: nothing to do).

**Uneven pieces** (:mod:`.shapes`: ``torch.chunk`` pieces, the last ones shorter or
empty) move as DTensor moves them: collectives need equal pieces, so a ``pad`` step
first fills this rank's piece with zeros at the end of the dim up to the full chunk
``c = ceil(n / k)`` (a reduce-scatter's input: up to ``k * c``), the collective runs on
equal pieces, and an ``unpad`` step keeps the real elements (pieces are full except at
the end, so after a gather the padding is all at the end of the dim). Pad steps appear
where some group of the axis has an uneven extent (the same steps on every rank; a
rank whose piece is already full pads nothing).

``comm_bytes`` is what one rank sends (= receives) on the ring algorithms:
all-gather ``(k-1)/k`` of the gathered output, reduce-scatter ``(k-1)/k`` of
the input, all-reduce ``2(k-1)/k`` of the tensor, all-to-all ``(k-1)/k`` of the
tensor, padding included; the runtime counts executed collectives the same way.
Each step also records its shapes on the rank at coordinate 0 of every axis, the
largest on any rank (``bound_shape_in``/``bound_shape_out``): decisions that must be
the same on every rank (buckets, the in-flight cap) read those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from ..ir import Mesh, Partial, Replicate, Shard, format_sharding
from .errors import LoweringError
from .shapes import chunk_bounds, local_shape

__all__ = ["ReshardStep", "plan_resharding", "origin_collectives", "comm_bytes", "COLLECTIVE_KINDS", "PAD_KINDS"]

#: Step kinds that communicate; ``local_slice``, ``zero_partial``, ``pad`` and ``unpad`` do not.
COLLECTIVE_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")

#: Local steps around a collective on uneven pieces: zeros appended up to equal pieces, then cut off.
PAD_KINDS = ("pad", "unpad")


@dataclass(frozen=True)
class ReshardStep:
    """One step of a resharding, on one mesh axis.

    ``dim`` is the dim gathered (all_gather), scattered (reduce_scatter), sliced
    (local_slice) or gathered by an all-to-all, whose ``split_dim`` is the dim it
    scatters. ``coordinate`` is this rank's coordinate on ``axis`` (local ops).
    ``pad`` appends zeros at the end of every dim that grows from ``local_shape_in`` to
    ``local_shape_out``; ``unpad`` keeps the leading elements of every dim that shrinks.
    """

    kind: str
    axis: int
    axis_size: int
    dim: int | None
    split_dim: int | None
    op: str | None
    coordinate: int
    local_shape_in: tuple[int, ...]
    local_shape_out: tuple[int, ...]
    comm_bytes: int
    """Bytes this rank sends on the ring algorithm (0 for local steps)."""
    bound_shape_in: tuple[int, ...] | None = None
    """``local_shape_in`` on the rank at coordinate 0 of every axis: the largest on any rank (None: as local)."""
    bound_shape_out: tuple[int, ...] | None = None
    """``local_shape_out`` on the rank at coordinate 0 of every axis (None: as local)."""

    def __str__(self) -> str:
        detail = {"all_gather": f"dim {self.dim}", "reduce_scatter": f"{self.op}, dim {self.dim}",
                  "all_reduce": f"{self.op}", "all_to_all": f"dim {self.dim} -> {self.split_dim}",
                  "local_slice": f"dim {self.dim}", "zero_partial": "sum", "pad": "zeros", "unpad": "keep"}.get(self.kind)
        if self.kind in ("halo_exchange", "halo_trim"):  # the width is half the change of the dim (lowering.halo)
            width = abs(self.local_shape_out[self.dim] - self.local_shape_in[self.dim]) // 2
            detail = f"dim {self.dim}, {'halo' if self.kind == 'halo_exchange' else 'trim'} {width}"
        return f"{self.kind}(axis {self.axis}, {detail}) {list(self.local_shape_in)} -> {list(self.local_shape_out)}"

    @property
    def bound_in(self) -> tuple[int, ...]:
        return self.local_shape_in if self.bound_shape_in is None else self.bound_shape_in

    @property
    def bound_out(self) -> tuple[int, ...]:
        return self.local_shape_out if self.bound_shape_out is None else self.bound_shape_out


def comm_bytes(kind: str, axis_size: int, bytes_in: int, bytes_out: int) -> int:
    """Bytes one rank sends for a collective of ``kind`` on an axis of ``axis_size`` ranks."""
    k = axis_size
    if kind in ("all_gather", "halo_exchange"):  # a halo exchange all-gathers 2h border slices (lowering.halo)
        return bytes_out * (k - 1) // k
    if kind == "reduce_scatter":
        return bytes_in * (k - 1) // k
    if kind == "all_reduce":
        return 2 * bytes_in * (k - 1) // k
    if kind == "all_to_all":
        return bytes_in * (k - 1) // k
    return 0


def _axes_sharding(sharding: Sequence, dim: int) -> list[int]:
    # ``placement == Shard(dim)`` without building a Shard per test (dataclass equality: same class, same dim)
    return [axis for axis, placement in enumerate(sharding) if placement.__class__ is Shard and placement.dim == dim]


def _common_prefix(first: list[int], second: list[int]) -> list[int]:
    prefix = []
    for a, b in zip(first, second):
        if a != b:
            break
        prefix.append(a)
    return prefix


def _extents(size: int, axis_sizes: Sequence[int]) -> set[int]:
    """Every size a dim of ``size`` has on some rank after nested chunks over ``axis_sizes``."""
    sizes = {size}
    for parts in axis_sizes:
        sizes = {chunk_bounds(extent, parts, index)[1] for extent in sizes for index in range(parts)}
    return sizes


class _Builder:
    """Tracks the current sharding while steps are appended."""

    def __init__(self, shape, itemsize, source, mesh, coords, what) -> None:
        self.shape, self.itemsize, self.mesh, self.coords, self.what = tuple(shape), itemsize, mesh, tuple(coords), what
        self.current = list(source)
        self.steps: list[ReshardStep] = []

    def local(self, sharding) -> tuple[int, ...]:
        return local_shape(self.shape, sharding, self.mesh, self.coords, what=self.what)

    def uneven_at(self, axis: int, dim: int, sharding) -> bool:
        """Whether ``axis`` cuts ``dim`` unevenly on some rank, given the axes before it that shard ``dim`` in ``sharding``."""
        earlier = [self.mesh.shape[a] for a in _axes_sharding(sharding, dim) if a < axis]
        return any(extent % self.mesh.shape[axis] for extent in _extents(self.shape[dim], earlier))

    def emit(self, kind, axis, placement, *, dim=None, split_dim=None, op=None, padded_in=None, padded_out=None) -> None:
        """One step on ``axis`` that sets its placement; ``padded_in``/``padded_out``: the collective's equal pieces."""
        before = self.local(self.current)
        self.current[axis] = placement
        after = self.local(self.current)
        shape_in = before if padded_in is None else padded_in
        shape_out = after if padded_out is None else padded_out
        if padded_in is not None:  # on every rank, even where the piece is full: the steps never depend on coordinates
            self._append("pad", axis, before, shape_in)
        self._append(kind, axis, shape_in, shape_out, dim=dim, split_dim=split_dim, op=op)
        if padded_out is not None:
            self._append("unpad", axis, shape_out, after)

    def _append(self, kind, axis, shape_in, shape_out, *, dim=None, split_dim=None, op=None) -> None:
        nbytes_in, nbytes_out = math.prod(shape_in) * self.itemsize, math.prod(shape_out) * self.itemsize
        self.steps.append(ReshardStep(
            kind=kind, axis=axis, axis_size=self.mesh.shape[axis], dim=dim, split_dim=split_dim, op=op,
            coordinate=self.coords[axis], local_shape_in=tuple(shape_in), local_shape_out=tuple(shape_out),
            comm_bytes=comm_bytes(kind, self.mesh.shape[axis], nbytes_in, nbytes_out),
        ))

    # -- the collectives, padded where some group of the axis has an uneven extent ---------------------
    def all_gather(self, axis: int, dim: int) -> None:
        if not self.uneven_at(axis, dim, self.current):
            return self.emit("all_gather", axis, Replicate(), dim=dim)
        k, before = self.mesh.shape[axis], self.local(self.current)
        extent = self.local(_with(self.current, axis, Replicate()))[dim]
        full = -(-extent // k)
        self.emit("all_gather", axis, Replicate(), dim=dim,
                  padded_in=_resized(before, {dim: full}), padded_out=_resized(before, {dim: k * full}))

    def reduce_scatter(self, axis: int, dim: int, op: str) -> None:
        if not self.uneven_at(axis, dim, self.current):
            return self.emit("reduce_scatter", axis, Shard(dim), dim=dim, op=op)
        k, before = self.mesh.shape[axis], self.local(self.current)
        full = -(-before[dim] // k)
        self.emit("reduce_scatter", axis, Shard(dim), dim=dim, op=op,
                  padded_in=_resized(before, {dim: k * full}), padded_out=_resized(before, {dim: full}))

    def all_to_all(self, axis: int, gather_dim: int, split_dim: int) -> None:
        uneven = self.uneven_at(axis, gather_dim, self.current) or self.uneven_at(axis, split_dim, self.current)
        if not uneven:
            return self.emit("all_to_all", axis, Shard(split_dim), dim=gather_dim, split_dim=split_dim)
        k, before = self.mesh.shape[axis], self.local(self.current)
        gather_full, split_full = -(-self.shape[gather_dim] // k), -(-before[split_dim] // k)
        self.emit("all_to_all", axis, Shard(split_dim), dim=gather_dim, split_dim=split_dim,
                  padded_in=_resized(before, {gather_dim: gather_full, split_dim: k * split_full}),
                  padded_out=_resized(before, {gather_dim: k * gather_full, split_dim: split_full}))


def _with(sharding, axis: int, placement) -> list:
    changed = list(sharding)
    changed[axis] = placement
    return changed


def _resized(shape: Sequence[int], sizes: dict[int, int]) -> tuple[int, ...]:
    return tuple(sizes.get(dim, size) for dim, size in enumerate(shape))


def plan_resharding(
    global_shape: Sequence[int],
    itemsize: int,
    source: Sequence,
    target: Sequence,
    mesh: Mesh,
    coords: Sequence[int],
    *,
    what: str = "a value",
) -> tuple[ReshardStep, ...]:
    """The steps that take a tensor of ``global_shape`` from ``source`` to ``target`` sharding.

    On an axis of size 1 every placement holds the whole value (one shard, one partial term),
    so placements there are read as ``Replicate()`` and move nothing.
    """
    source, target = _on_real_axes(source, mesh), _on_real_axes(target, mesh)
    if source == target:
        return ()
    origin = (0,) * mesh.ndim
    steps = _build(global_shape, itemsize, source, target, mesh, coords, what)
    bounds = steps if tuple(coords) == origin else _build(global_shape, itemsize, source, target, mesh, origin, what)
    if [step.kind for step in steps] != [step.kind for step in bounds]:  # pragma: no cover - kinds never read coordinates
        raise LoweringError(f"internal: resharding {what} takes other steps at coordinates {tuple(coords)} than at 0")
    return tuple(replace(step, bound_shape_in=bound.local_shape_in, bound_shape_out=bound.local_shape_out)
                 for step, bound in zip(steps, bounds))


def origin_collectives(global_shape: Sequence[int], itemsize: int, source: Sequence, target: Sequence, mesh: Mesh, *,
                       what: str = "a value") -> tuple[tuple[str, int, int], ...]:
    """(kind, axis, bytes sent) of each collective step of :func:`plan_resharding` on the rank at coordinate 0.

    The same steps as ``plan_resharding(..., coords=(0,) * mesh.ndim)`` reads them, without the per-step bounds it adds
    (at the origin they are the steps' own shapes): the cost model prices tens of thousands of reshardings so.
    """
    source, target = _on_real_axes(source, mesh), _on_real_axes(target, mesh)
    if source == target:
        return ()
    steps = _build(global_shape, itemsize, source, target, mesh, (0,) * mesh.ndim, what)
    return tuple((step.kind, step.axis, step.comm_bytes) for step in steps if step.kind in COLLECTIVE_KINDS)


def even_collective_template(rank: int, source: Sequence, target: Sequence, mesh: Mesh) -> tuple[tuple[str, int, int, int], ...]:
    """The collective steps at the origin of a resharding of any even value of ``rank`` dims: (kind, axis, how many
    times the whole value is the step's local input, the same of its output), one per collective step. The placements
    name dims below ``rank`` (the caller checks).

    For a value whose every sharded dim divides evenly by its mesh axes under both shardings, the steps are
    :func:`origin_collectives`' on any such shape: the phases choose collectives from the placements alone, every
    intermediate sharding cuts each dim over a subset of the axes that one of the two cuts it over (so it is even
    too), and no piece needs padding. A step sends :func:`comm_bytes` of its local bytes, the value's bytes divided
    by those counts. Built here on the smallest even shape.
    """
    source, target = _on_real_axes(source, mesh), _on_real_axes(target, mesh)
    if source == target:
        return ()
    total, steps = _smallest_even_steps(rank, source, target, mesh)
    if any(step.kind in ("pad", "unpad") for step in steps):  # pragma: no cover - even shapes are never padded
        raise LoweringError("internal: an even resharding was padded")
    return tuple((step.kind, step.axis, total // math.prod(step.local_shape_in),
                  total // math.prod(step.local_shape_out))
                 for step in steps if step.kind in COLLECTIVE_KINDS)


def origin_local_steps(global_shape: Sequence[int], itemsize: int, source: Sequence, target: Sequence, mesh: Mesh, *,
                       what: str = "a value") -> tuple[ReshardStep, ...]:
    """The steps of :func:`plan_resharding` on the rank at coordinate 0 that are not collectives (local slices, pads,
    unpads, zeroed partials): what the rank copies beside its calls (:func:`metadist.lowering.copies.step_copies`)."""
    source, target = _on_real_axes(source, mesh), _on_real_axes(target, mesh)
    if source == target:
        return ()
    steps = _build(global_shape, itemsize, source, target, mesh, (0,) * mesh.ndim, what)
    return tuple(step for step in steps if step.kind not in COLLECTIVE_KINDS)


def even_local_template(rank: int, source: Sequence, target: Sequence, mesh: Mesh) -> tuple[int, tuple[ReshardStep, ...]]:
    """(elements, steps) of :func:`origin_local_steps` on the smallest shape of ``rank`` dims that both shardings cut
    evenly (as :func:`even_collective_template` builds it): on any even value of that rank a step's pieces are the
    same fraction of the whole."""
    source, target = _on_real_axes(source, mesh), _on_real_axes(target, mesh)
    if source == target:
        return 1, ()
    total, steps = _smallest_even_steps(rank, source, target, mesh)
    return total, tuple(step for step in steps if step.kind not in COLLECTIVE_KINDS)


def _smallest_even_steps(rank: int, source: tuple, target: tuple, mesh: Mesh) -> tuple[int, list[ReshardStep]]:
    """(elements, steps at the origin) of the resharding of the smallest shape of ``rank`` dims that both shardings
    (on the mesh's real axes) cut evenly: each dim the least common multiple of its cuts under either."""
    pieces = [1] * rank
    for sharding in (source, target):
        cuts = [1] * rank
        for axis, placement in enumerate(sharding):
            if placement.__class__ is Shard:
                cuts[placement.dim] *= mesh.shape[axis]
        pieces = [math.lcm(have, cut) for have, cut in zip(pieces, cuts)]
    return math.prod(pieces), _build(tuple(pieces), 1, source, target, mesh, (0,) * mesh.ndim, "a value")


def _build(global_shape, itemsize, source: tuple, target: tuple, mesh: Mesh, coords, what: str) -> list[ReshardStep]:
    build = _Builder(global_shape, itemsize, source, mesh, coords, what)
    build.local(source)  # reject a source or target that names a dim the value lacks before any step
    build.local(target)
    _unshard(build, source, target)
    _reduce_and_shard(build, target)
    if tuple(build.current) != target:  # pragma: no cover - the phases cover every placement pair
        raise LoweringError(
            f"internal: resharding {what} from {format_sharding(source)} to {format_sharding(target)} "
            f"ended at {format_sharding(tuple(build.current))}"
        )
    return build.steps


def _on_real_axes(sharding: Sequence, mesh: Mesh) -> tuple:
    return tuple(Replicate() if size == 1 else placement for placement, size in zip(sharding, mesh.shape))


def _unshard(build: _Builder, source: tuple, target: tuple) -> None:
    dims = {p.dim for p in source + target if isinstance(p, Shard)}
    kept: set[int] = set()
    for dim in dims:
        kept |= set(_common_prefix(_axes_sharding(source, dim), _axes_sharding(target, dim)))
    for axis in reversed(range(len(source))):
        placement = build.current[axis]
        if not isinstance(placement, Shard) or axis in kept:
            continue
        wanted = target[axis]
        if isinstance(wanted, Shard) and wanted.dim != placement.dim and _alone(source, target, axis, placement.dim, wanted.dim):
            build.all_to_all(axis, placement.dim, wanted.dim)
        else:
            build.all_gather(axis, placement.dim)


def _alone(source: tuple, target: tuple, axis: int, gather_dim: int, split_dim: int) -> bool:
    """True when ``axis`` is the only axis that shards either dim, before and after."""
    return (
        _axes_sharding(source, gather_dim) == [axis]
        and _axes_sharding(target, gather_dim) == []
        and _axes_sharding(source, split_dim) == []
        and _axes_sharding(target, split_dim) == [axis]
    )


def _reduce_and_shard(build: _Builder, target: tuple) -> None:
    """Phases 2 and 3 in one pass, first axis first: slicing early makes later reductions smaller."""
    for axis, wanted in enumerate(target):
        placement = build.current[axis]
        if placement == wanted:
            continue
        if isinstance(placement, Partial):
            nested_before = [a for a in _axes_sharding(target, wanted.dim) if a < axis] if isinstance(wanted, Shard) else None
            if isinstance(wanted, Shard) and _axes_sharding(build.current, wanted.dim) == nested_before:
                build.reduce_scatter(axis, wanted.dim, placement.op)
                continue
            build.emit("all_reduce", axis, Replicate(), op=placement.op)
        if build.current[axis] == wanted:
            continue
        if isinstance(wanted, Shard):
            build.emit("local_slice", axis, wanted, dim=wanted.dim)
        elif wanted.op == "sum":
            build.emit("zero_partial", axis, wanted, op="sum")
        else:
            build.current[axis] = wanted  # a replicated value is already a valid Partial(max/min)
