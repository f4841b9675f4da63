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

The collectives of a resharding are the lowering's own steps (:func:`reshard` asks
:func:`metadist.lowering.reshard.plan_resharding`): the same kinds, order and axes as the runtime
(nested shards of one dim are gathered innermost axis first; a dim sharded on two axes that moves
to another dim is gathered, then sliced, where an all-to-all cannot do it alone), and the same
bytes, padding of uneven pieces (``torch.chunk``) included. The table above is the ring
convention each step's bytes follow.

A node whose strategy takes a halo factor (:attr:`metadist.ir.plan.NodeStrategy.halos`) first
exchanges border elements on that axis (:func:`halo_exchange_seconds`): the runtime all-gathers
each rank's ``h`` first and ``h`` last elements of the split dim (``2h`` slices), so each rank
sends ``(n-1) 2h`` slices, priced as that all-gather.

On a link whose backend carries out a reduce-scatter as an all-reduce of the whole input
(gloo: :attr:`.cluster.Link.reduce_scatter_as_all_reduce`), a reduce-scatter's bytes are counted as that
all-reduce's, and without a measured line of its own it is priced as that all-reduce:
``2 (n-1) alpha + 2 (n-1)/n B / bw``.

A calibrated link may carry measured per-kind costs (:attr:`.cluster.Link.kind_costs`: the all-gather as the
runtime carries it out, an all-to-all on gloo, whose own all-gather was several times slower per byte than its
all-reduce (:func:`metadist.runtime.collectives.start_all_gather`); gloo's reduce-scatter, slower than the all-reduce
it runs, for the copies around it); such a kind is priced ``fixed + sent / bandwidth`` with its own figures, the
bandwidth changing past the sizes where the calibration measured it change (:attr:`.cluster.Link.kind_rates_beyond`).

Every collective also pays the link's ``sync_s``: inside a step a collective waits for the slower
peer (processes that share cores drift apart while they compute), which the isolated measurements
above (all ranks leaving a barrier together) never see; the calibration measures it by issuing a
small all-reduce between compute phases as the runtime does.

Where the link measured how the wait grows with the compute before a call (:attr:`.cluster.Link.sync_by_gap`), an
estimate of a whole step prices each call's wait by the compute since the previous collective
(:func:`sync_corrections`): calls that follow each other wait little, a call after a long stretch of compute waits
the most. The search prices every call at ``sync_s``, a wait that grows with the gap and levels off is not linear in
the number of calls.

Each all-gather, all-reduce and reduce-scatter of a resharding also pays the copies the runtime makes around it in a
coalesced call (:func:`bucket_copy_seconds`: packing, an all-gather's unpacking, an all-reduce's clone); the estimate
of a lowered program prices its own copies instead (:func:`program_comm`).

A collective the runtime runs in a bucket with others (:mod:`.bucketing`) pays only
``fixed_share`` of its fixed cost (the ``alpha`` terms, ``call_overhead_s`` and ``sync_s``); the
bandwidth term is paid in full. All-to-alls are never bucketed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..ir import Shard, TensorSpec
from .cluster import Cluster, Link
from .sharding import is_divisible, local_nbytes


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
    """The collectives of one resharding, the copies its local steps make, and their total time."""

    collectives: tuple[Collective, ...] = field(default_factory=tuple)
    local_s: float = 0.0
    """The copies of its local steps (a local slice's clone, a pad, an unpad: :func:`resharding_local_copies`)."""

    @property
    def comm_s(self) -> float:
        return sum(item.comm_s for item in self.collectives) + self.local_s


NO_RESHARDING = Resharding()


def collective_seconds(kind: str, buffer_bytes: float, axis_size: int, link: Link, fixed_share: float = 1.0) -> tuple[float, float]:
    """(time, bytes sent per device) of one ring collective on ``axis_size`` devices.

    ``buffer_bytes`` is the local buffer before the collective (a shard for all-gather);
    ``fixed_share`` scales the fixed cost (latencies and call overhead) of a bucketed collective.
    """
    n = axis_size
    if n <= 1:
        return 0.0, 0.0
    _, ring_bytes = _ring(kind, buffer_bytes, n)
    return priced_collective(kind, ring_bytes, n, link, fixed_share)


def backend_reduce_scatters_as_all_reduce(backend: str) -> bool:
    """Whether the torch.distributed ``backend`` carries out a reduce-scatter as an all-reduce of its whole input
    (gloo does; each rank then keeps its piece)."""
    return backend == "gloo"


def carried_kind(kind: str, reduce_scatter_as_all_reduce: bool) -> str:
    """The collective a backend carries out for ``kind``: an all-reduce for a reduce-scatter where
    ``reduce_scatter_as_all_reduce`` (:func:`backend_reduce_scatters_as_all_reduce`)."""
    return "all_reduce" if kind == "reduce_scatter" and reduce_scatter_as_all_reduce else kind


def wire_kind(kind: str, link: Link) -> str:
    """The collective the backend carries out for ``kind`` on ``link``."""
    return carried_kind(kind, link.reduce_scatter_as_all_reduce)


def carried_bytes(kind: str, ring_bytes: float, reduce_scatter_as_all_reduce: bool) -> float:
    """Bytes a rank sends for a ``kind`` that sends ``ring_bytes`` by its own ring algorithm: a reduce-scatter carried
    as an all-reduce sends the all-reduce's, twice its own."""
    return 2 * ring_bytes if carried_kind(kind, reduce_scatter_as_all_reduce) != kind else ring_bytes


def _ring(kind: str, buffer_bytes: float, n: int) -> tuple[int, float]:
    """(latency steps, bytes sent per device) of a ring collective."""
    if kind == "all_gather":
        return n - 1, (n - 1) * buffer_bytes
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * buffer_bytes
    if kind in ("reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n * buffer_bytes
    raise ValueError(f"unknown collective {kind!r}")


def reshard(spec: TensorSpec, src: Sequence, dst: Sequence, cluster: Cluster, fixed_share: float = 1.0) -> Resharding:
    """The collectives that move a value of ``spec`` from sharding ``src`` to ``dst``, as the runtime runs them.

    The steps are the lowering's own (:func:`metadist.lowering.reshard.plan_resharding`, on the rank at coordinate 0,
    which holds the largest pieces): the same collectives, in the same order, on the same axes, with the same bytes
    (padding of uneven pieces included). ``fixed_share``: the share of each collective's fixed cost paid when it runs
    bucketed (1: alone).
    """
    src, dst = tuple(src), tuple(dst)
    if src == dst:
        return NO_RESHARDING
    from .compute import copy_seconds

    mesh = cluster.mesh
    collectives = []
    for kind, axis, comm_bytes in resharding_collectives(spec, src, dst, mesh):
        seconds, sent = priced_collective(kind, comm_bytes, mesh.shape[axis], cluster.link(axis), fixed_share)
        seconds += bucket_copy_seconds(kind, comm_bytes, mesh.shape[axis], spec.dtype, cluster)
        collectives.append(Collective(kind=kind, axis=axis, comm_bytes=sent, comm_s=seconds))
    local_s = sum(copy_seconds(cluster.device, spec.dtype, elements)
                  for elements in resharding_local_copies(spec, src, dst, mesh))
    return Resharding(tuple(collectives), local_s)


def resharding_local_copies(spec: TensorSpec, src: tuple, dst: tuple, mesh) -> tuple[float, ...]:
    """The elements of each copy the local steps of the lowering's resharding make on the rank at 0 (a local slice's
    clone, a pad's zeros and piece, an unpad that is not a view: :func:`metadist.lowering.copies.step_copies`), as the
    program's copies are priced (:func:`program_comm`). The search prices them with the collectives: on mixtral-mini's
    bfloat16 step on 2x2 (4 processes on this project's 2 cores) the local slices of a plan came to 4.7 ms a step that
    no price held. Kept per key as :func:`resharding_collectives` keeps its steps; an even value's from the shape-free
    template of its rank and shardings."""
    from ..lowering.copies import step_copies
    from ..lowering.reshard import even_local_template, origin_local_steps

    key = (spec.shape, spec.itemsize, tuple(src), tuple(dst), mesh)
    copies = _LOCAL_COPIES.get(key)
    if copies is None:
        numel = math.prod(spec.shape)
        if numel and is_divisible(spec, key[2], mesh) and is_divisible(spec, key[3], mesh):
            template_key = (spec.rank, key[2], key[3], mesh)
            template = _LOCAL_TEMPLATES.get(template_key)
            if template is None:
                total, steps = even_local_template(spec.rank, key[2], key[3], mesh)
                template = tuple(total // elements for step in steps for elements in step_copies(step) if elements)
                if len(_LOCAL_TEMPLATES) >= _STEPS_KEPT:
                    _LOCAL_TEMPLATES.clear()
                _LOCAL_TEMPLATES[template_key] = template
            copies = tuple(numel / pieces for pieces in template)
        else:
            steps = origin_local_steps(spec.shape, spec.itemsize, key[2], key[3], mesh, what=f"a {spec} value")
            copies = tuple(float(elements) for step in steps for elements in step_copies(step))
        if len(_LOCAL_COPIES) >= _STEPS_KEPT:
            _LOCAL_COPIES.clear()
        _LOCAL_COPIES[key] = copies
    return copies


def bucket_copy_seconds(kind: str, ring_bytes: float, axis_size: int, dtype: str, cluster: Cluster) -> float:
    """The copies the runtime makes around a collective of ``kind`` that sends ``ring_bytes`` when it runs in a
    coalesced call (:func:`metadist.lowering.copies.coalesced_copies`): the member packed into the call's flat buffer,
    and an all-gather's gathered pieces copied out of it, an all-reduce's buffer cloned. The search cannot tell which
    reshards will share a call (the runtime joins every later one of the same kind and axis whose source exists:
    parameters gathered at a step's start, gradients reduced at its end), so it prices each such collective as one
    member of a call; a collective alone copies one buffer less, or none. An all-to-all (never coalesced) is priced
    without copies here.

    On mixtral-mini's 2x2 plans (4 processes on this project's 2 cores, one calibration), the search priced no copies
    and took a plan gathering 20 MB of parameters in two calls (its program's copies priced 12.8 ms a step), which ran
    117 ms against DDP's 100; priced with them it takes the expert-parallel plan of 14 small calls (copies 1.6 ms),
    which ran 79 ms against DDP's 95, and its recomputing plan ran 91 ms where the gathering one had run 138."""
    from ..ir import DTYPE_BYTES
    from .compute import copy_seconds

    n = axis_size
    if n <= 1 or ring_bytes <= 0 or kind not in ("all_gather", "all_reduce", "reduce_scatter"):
        return 0.0
    item = DTYPE_BYTES[dtype]
    if kind == "all_gather":
        piece = ring_bytes / (n - 1) / item
        return copy_seconds(cluster.device, dtype, piece) + copy_seconds(cluster.device, dtype, n * piece)
    if kind == "all_reduce":
        return 2 * copy_seconds(cluster.device, dtype, ring_bytes * n / (2 * (n - 1)) / item)
    return copy_seconds(cluster.device, dtype, ring_bytes * n / (n - 1) / item)


def resharding_collectives(spec: TensorSpec, src: tuple, dst: tuple, mesh) -> tuple[tuple[str, int, int], ...]:
    """(kind, axis, ring bytes sent per rank) of each collective step of the lowering's resharding, on the rank at 0.

    The steps depend only on the shape, item size, both shardings and the mesh, so they are planned once per such
    key and kept (:data:`_STEPS`, at most :data:`_STEPS_KEPT` keys): a planning pass asks for the same few thousand
    reshardings tens of thousands of times (every repeated layer, every baseline's estimate). A value both shardings
    cut evenly takes its steps from a template shared by every shape of its rank (:func:`_even_steps`), with the bytes
    of its own shape. A resharding the lowering rejects raises each time it is asked (errors are not kept).
    """
    key = (spec.shape, spec.itemsize, tuple(src), tuple(dst), mesh)
    steps = _STEPS.get(key)
    if steps is None:
        steps = _even_steps(spec, key[2], key[3], mesh)
        if steps is None:
            from ..lowering.reshard import origin_collectives

            steps = origin_collectives(spec.shape, spec.itemsize, src, dst, mesh, what=f"a {spec} value")
        if len(_STEPS) >= _STEPS_KEPT:
            _STEPS.clear()
        _STEPS[key] = steps
    return steps


def _even_steps(spec: TensorSpec, src: tuple, dst: tuple, mesh) -> tuple[tuple[str, int, int], ...] | None:
    """The steps of a value that both shardings cut evenly, from the shape-free template of its rank and shardings
    (:func:`metadist.lowering.reshard.even_collective_template`, kept in :data:`_TEMPLATES`); None otherwise (an
    uneven or empty value, or a placement naming a dim the value lacks: the lowering's own steps say so)."""
    from ..lowering.reshard import comm_bytes, even_collective_template

    numel = math.prod(spec.shape)
    if not numel or not (is_divisible(spec, src, mesh) and is_divisible(spec, dst, mesh)):
        return None
    template_key = (spec.rank, src, dst, mesh)
    template = _TEMPLATES.get(template_key)
    if template is None:
        template = even_collective_template(spec.rank, src, dst, mesh)
        if len(_TEMPLATES) >= _STEPS_KEPT:
            _TEMPLATES.clear()
        _TEMPLATES[template_key] = template
    total = numel * spec.itemsize
    return tuple((kind, axis, comm_bytes(kind, mesh.shape[axis], total // pieces_in, total // pieces_out))
                 for kind, axis, pieces_in, pieces_out in template)


_STEPS_KEPT = 1 << 17
_STEPS: dict[tuple, tuple[tuple[str, int, int], ...]] = {}
_TEMPLATES: dict[tuple, tuple[tuple[str, int, int, int], ...]] = {}
"""Shape-free steps of even reshardings by (rank, source, target, mesh): LLaMA-7B on 8x8 asks for ~15,000 distinct
(shape, source, target) reshardings of far fewer such keys."""
_LOCAL_COPIES: dict[tuple, tuple[float, ...]] = {}
_LOCAL_TEMPLATES: dict[tuple, tuple[int, ...]] = {}
""":func:`resharding_local_copies` by (shape, item size, source, target, mesh), and its even values' templates by
(rank, source, target, mesh): each copy's elements as a fraction (1 / pieces) of the whole value."""


def priced_collective(kind: str, ring_bytes: float, axis_size: int, link: Link, fixed_share: float = 1.0) -> tuple[float, float]:
    """(time, bytes sent) of a collective that sends ``ring_bytes`` per rank on the ring algorithm of ``kind``.

    On a link that runs a reduce-scatter as an all-reduce (gloo) it sends that all-reduce's bytes; it takes its own
    measured time where the link has a line for the kind (:attr:`.cluster.Link.kind_costs`), else the all-reduce's.
    """
    n = axis_size
    if n <= 1:
        return 0.0, 0.0
    wire = wire_kind(kind, link)
    sent = carried_bytes(kind, ring_bytes, link.reduce_scatter_as_all_reduce)
    share = 1.0 if kind == "all_to_all" else fixed_share
    priced = kind if link.kind_cost(kind) is not None else wire
    measured = link.kind_cost(priced)
    if measured is not None:
        return share * (measured[0] + link.sync_s) + link.kind_transfer_seconds(priced, sent), sent
    steps = 2 * (n - 1) if wire == "all_reduce" else n - 1
    return share * (link.call_overhead_s + link.sync_s + steps * link.latency_s) + sent / link.bandwidth_bytes_per_s, sent


def fixed_seconds(kind: str, axis_size: int, link: Link) -> float:
    """The fixed cost of one call of ``kind`` over ``axis_size`` ranks on ``link``, whatever its size: what a
    coalesced call pays once (its launch, ring latencies, ``sync_s``); 0 on an axis of one rank."""
    return priced_collective(kind, 0.0, axis_size, link)[0]


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


def sync_corrections(calls: Sequence[tuple[float, float, Link]], trailing_s: float) -> list[float]:
    """What each call's wait comes to beyond the ``sync_s`` its price holds, the wait priced by the compute before it.

    ``calls``: in the order a step runs them, (compute seconds since the previous call, the call's share of its fixed
    cost, its link). ``trailing_s``: the compute after the last call, which the next step's first call follows (the
    step runs in a loop). A call's gap is the compute since the previous call; a bucketed collective's member (share
    ``f`` < 1) is a fraction of one call: it pays ``f`` of the wait at its gap and leaves ``1 - f`` of that gap to the
    next. A link without :attr:`.cluster.Link.sync_by_gap` gets 0 (its calls pay ``sync_s`` each).
    """
    corrections, carry = [], float(trailing_s)
    for before, share, link in calls:
        gap = carry + before
        corrections.append(share * (link.sync_after(gap) - link.sync_s) if link.sync_by_gap else 0.0)
        carry = gap * (1.0 - share)
    return corrections


def waits_by_gap(cluster: Cluster) -> bool:
    """Whether any of the cluster's links prices a call's wait by the compute before it."""
    return any(link.sync_by_gap for link in cluster.axis_links)


def program_comm(program, cluster: Cluster, node_seconds: Mapping[str, float] | None = None) -> dict:
    """The communication of a lowered rank program (:class:`metadist.lowering.program.RankProgram`), priced call by
    call as it runs: a coalesced reshard is one call, paying its fixed cost once and its members' bytes; every other
    collective step (a halo exchange as the all-gather it is) one call of its own.

    The solver prices each resharding on its own and shares a bucket's fixed cost by an estimate (``fixed_share``:
    :mod:`.bucketing`); the lowered program knows the buckets, so this is the figure a step is predicted at. Returns
    ``comm_s_by_axis``, ``comm_bytes_by_axis`` (by mesh axis name) and ``collectives_by_kind`` (calls), as the
    solver's estimate does.

    ``node_seconds`` (graph node name -> its compute seconds): with it, on a link that measured
    :attr:`.cluster.Link.sync_by_gap`, each call's wait is priced by the compute the program runs since the previous
    call (:func:`sync_corrections`).

    ``copy_s``: the copies the runtime makes around the program's reshards beside the collectives' own transfers
    (:func:`metadist.lowering.copies.program_copies`: an all-reduce's functional clone, a coalesced call's packing and
    an all-gather's unpacking, local slices), each priced as a copy of its elements on the cluster's device
    (:func:`.compute.copy_seconds`). The calibration times each collective on a buffer already laid out for it.
    """
    from ..lowering.copies import program_copies
    from .compute import copy_seconds

    names = cluster.mesh.axis_names
    seconds = {name: 0.0 for name in names}
    sent_bytes = {name: 0.0 for name in names}
    calls: dict[str, int] = {}
    ordered = list(program.collective_calls())
    for kind, axis, ring_bytes in ordered:
        priced_kind = "all_gather" if kind == "halo_exchange" else kind
        step_s, sent = priced_collective(priced_kind, ring_bytes, cluster.mesh.shape[axis], cluster.link(axis))
        seconds[names[axis]] += step_s
        sent_bytes[names[axis]] += sent
        calls[kind] = calls.get(kind, 0) + 1
    if node_seconds is not None and waits_by_gap(cluster):
        gaps = program.compute_between_calls(node_seconds)
        waits = [(before, 1.0, cluster.link(axis)) for before, (_, axis, _) in zip(gaps, ordered)]
        for (_, axis, _), correction in zip(ordered, sync_corrections(waits, gaps[-1])):
            seconds[names[axis]] += correction
    copy_s = sum(copy_seconds(cluster.device, dtype, elements) for dtype, elements in program_copies(program))
    return {"comm_s_by_axis": seconds, "comm_bytes_by_axis": sent_bytes, "collectives_by_kind": dict(sorted(calls.items())),
            "copy_s": copy_s}
