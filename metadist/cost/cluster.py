"""The cluster the cost model prices a plan on: a mesh, one link per mesh axis, one device kind.

A :class:`Cluster` is frozen data. Presets describe common machines; :func:`cluster_for`
builds one for a given mesh (a multi-node preset puts the innermost axes that fit in one
node on the fast intra-node link and the others on the slow inter-node link).
``metadist calibrate`` measures this machine and writes a cluster JSON that
:func:`load_cluster` reads back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ..ir import Mesh

CLUSTER_FORMAT = "metadist.cluster"
CLUSTER_FORMAT_VERSION = 1

MatmulKey = tuple
"""A local matmul's shape as :attr:`Device.matmul_seconds` keys it: ``(dtype, layout, batch, m, k, n)``."""

AttentionKey = tuple
"""A local fused attention call as :attr:`Device.attention_seconds` keys it: ``(direction, dtype, query shape, key shape,
value shape, mask shape or (), mask dtype or "", causal)`` (:func:`metadist.cost.attention_times.local_key`)."""

RelayoutKey = tuple
"""A local relayout copy as :attr:`Device.relayout_seconds` keys it: ``(dtype read, dtype written, shape)``, the shape the
copy's transposed operand has (:func:`metadist.cost.compute.local_relayout_key`)."""


class ClusterError(ValueError):
    """A cluster description is malformed or does not fit the mesh."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """The link devices along one mesh axis talk over (alpha-beta model)."""

    bandwidth_bytes_per_s: float
    """Bus bandwidth one device sees in a ring collective (beta = 1 / bandwidth)."""
    latency_s: float
    """Per-message latency of one ring step (alpha)."""
    call_overhead_s: float = 0.0
    """Fixed cost of launching and synchronizing one collective, whatever its size."""
    name: str = ""
    """What the link is (``nvlink``, ``infiniband``, ``gloo-loopback``...)."""
    reduce_scatter_as_all_reduce: bool = False
    """The backend carries out a reduce-scatter as an all-reduce of the whole input, then keeps its piece (gloo):
    it sends an all-reduce's bytes, and takes an all-reduce's time unless :attr:`kind_costs` measured its own."""
    sync_s: float = 0.0
    """What a collective costs beyond its own fixed cost when the step runs it between compute phases: the wait for
    the slower peer (processes sharing cores drift apart while they compute; measured by ``metadist calibrate``).
    Paid per call, as the fixed cost is (a bucketed collective pays its share); 0 for the presets. This is the
    price the search puts on every call; where :attr:`sync_by_gap` is measured, an estimate of a whole step prices each
    call's wait by the compute before it instead."""
    sync_by_gap: tuple[tuple[float, float], ...] = ()
    """Measured (compute seconds since the previous collective, wait seconds) points, gaps ascending: the wait grows
    with the compute before a call (processes that share cores drift apart the longer they compute: on 4 gloo
    processes sharing 2 cores a 4 KiB all-reduce between 2 of them waited about 0.5 ms after 0.25 ms of compute and
    2 ms after 3 ms), so calls that follow each other wait little. :meth:`sync_after` reads it; empty for the presets
    and where the wait did not depend on the gap (then every call pays :attr:`sync_s`)."""
    kind_costs: tuple[tuple[str, float, float], ...] = ()
    """Measured (collective kind, fixed seconds per call, bandwidth) of kinds whose algorithm the backend runs at its
    own speed (gloo's all-gather is several times slower per byte than its all-reduce); a kind listed here is priced
    ``fixed + sent / bandwidth`` instead of the alpha-beta figures above (up to the first of :attr:`kind_rates_beyond`).
    Empty for the presets."""
    kind_rates_beyond: tuple[tuple[str, float, float], ...] = ()
    """Measured (collective kind, sent bytes, bandwidth): past that many bytes sent, a collective of a kind in
    :attr:`kind_costs` moves its further bytes at this bandwidth, up to the kind's next entry. The time of a kind is
    the line through the calibration's measured sizes (:func:`metadist.cost.calibrate.fit_link`): gloo's all-gather
    of a 32 MiB shard between two CPU processes ran at half the bytes/s of a 2 MiB one, its all-reduce at 1.3 times.
    Empty for the presets and calibrations before version 16."""
    fsdp_unit_costs: tuple[tuple[str, float, float], ...] = ()
    """Measured (variant, fixed seconds, bytes/s) of what torch's FSDP2 adds to a step per unit over this link's
    ranks, ``zero2`` (parameters kept gathered from forward to backward) and ``zero3`` (gathered again for the
    backward): its collectives, its copies into and out of their flat buffers and its hooks, priced
    ``fixed + unit bytes / bytes/s`` (``metadist calibrate`` on CPUs, for the axis of all its processes:
    :func:`metadist.solver.baselines.torch_fsdp_estimate`). Empty for the presets and the other axes, whose FSDP2
    units are priced by their collectives alone."""

    def __post_init__(self) -> None:
        points = tuple(sorted((float(gap), float(wait)) for gap, wait in self.sync_by_gap))
        object.__setattr__(self, "sync_by_gap", points)
        if any(gap < 0 or wait < 0 for gap, wait in points):
            raise ClusterError(f"a link's sync by gap needs gaps and waits >= 0, got {points}")
        for name in ("kind_costs", "kind_rates_beyond", "fsdp_unit_costs"):
            costs = tuple(sorted((str(kind), float(fixed), float(rate)) for kind, fixed, rate in getattr(self, name)))
            object.__setattr__(self, name, costs)
            if any(fixed < 0 or rate <= 0 for _, fixed, rate in costs):
                raise ClusterError(f"a link's {name.replace('_', ' ')} need fixed seconds >= 0 and a rate > 0, got {costs}")
        if not self.bandwidth_bytes_per_s > 0 or not self.latency_s >= 0 or not self.call_overhead_s >= 0 or not self.sync_s >= 0:
            raise ClusterError(f"a link needs bandwidth > 0 and latency, call overhead and sync cost >= 0, got {self}")

    def sync_after(self, gap_s: float) -> float:
        """The wait of a call issued ``gap_s`` seconds of compute after the previous collective: linear between the
        measured points of :attr:`sync_by_gap`, the end point's wait beyond either end (a drift bounded by the
        scheduler's turns); :attr:`sync_s` where none was measured."""
        points = self.sync_by_gap
        if not points:
            return self.sync_s
        if gap_s <= points[0][0]:
            return points[0][1]
        for (low, low_wait), (high, high_wait) in zip(points, points[1:]):
            if gap_s < high:
                return low_wait + (high_wait - low_wait) * (gap_s - low) / (high - low)
        return points[-1][1]

    def kind_cost(self, kind: str) -> tuple[float, float] | None:
        """(fixed seconds, bandwidth) measured for collectives of ``kind``; None when it follows the alpha-beta figures."""
        for name, fixed, bandwidth in self.kind_costs:
            if name == kind:
                return fixed, bandwidth
        return None

    def kind_transfer_seconds(self, kind: str, sent: float) -> float | None:
        """The seconds a collective of ``kind`` spends on ``sent`` bytes beyond its fixed cost, on the measured line of
        :attr:`kind_costs` and :attr:`kind_rates_beyond`; None when the kind follows the alpha-beta figures."""
        measured = self.kind_cost(kind)
        if measured is None:
            return None
        bandwidth, done, seconds = measured[1], 0.0, 0.0
        for name, start, rate in self.kind_rates_beyond:
            if name != kind or start <= done:
                continue
            if sent <= start:
                break
            seconds += (start - done) / bandwidth
            bandwidth, done = rate, start
        return seconds + max(sent - done, 0.0) / bandwidth

    def fsdp_unit_cost(self, variant: str) -> tuple[float, float] | None:
        """(fixed seconds, bytes/s) measured for an FSDP2 unit of ``variant`` (``zero2``, ``zero3``); None where not
        measured."""
        for name, fixed, rate in self.fsdp_unit_costs:
            if name == variant:
                return fixed, rate
        return None


def attention_key_of(key: Any) -> AttentionKey:
    """An attention key with its shapes as tuples (a JSON document, a cluster's or the cached times', gives lists)."""
    direction, dtype, query, key_shape, value, mask, mask_dtype, causal = key
    return (str(direction), str(dtype), tuple(int(size) for size in query), tuple(int(size) for size in key_shape),
            tuple(int(size) for size in value), tuple(int(size) for size in mask), str(mask_dtype), bool(causal))


def relayout_key_of(key: Any) -> RelayoutKey:
    """A relayout key with its shape as a tuple (a JSON document, a cluster's or the cached times', gives a list)."""
    read, written, shape = key
    return (str(read), str(written), tuple(int(size) for size in shape))


def _dtype_pairs(pairs: Mapping[str, float] | Any) -> tuple[tuple[str, float], ...]:
    """(dtype, figure) pairs, sorted, from a mapping or pairs (a JSON document's lists)."""
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return tuple(sorted((str(name), float(value)) for name, value in items))


def _curves(curves: Mapping[str, Any] | Any) -> tuple[tuple[str, tuple[tuple[float, float], ...]], ...]:
    """(dtype, ((size, rate), ...)) pairs, dtypes and sizes sorted, from a mapping or pairs (a JSON document's lists)."""
    items = curves.items() if isinstance(curves, Mapping) else curves
    return tuple(sorted((str(name), tuple(sorted((float(size), float(rate)) for size, rate in points)))
                        for name, points in items))


def interpolate_curve(points: tuple[tuple[float, float], ...], size: float) -> float:
    """The rate at ``size`` on a measured curve of (size, rate) points, sizes ascending: linear in the logarithm of
    the size between two points, the end point's rate beyond either end."""
    if size <= points[0][0]:
        return points[0][1]
    for (low, low_rate), (high, high_rate) in zip(points, points[1:]):
        if size <= high:
            share = math.log(size / low) / math.log(high / low)
            return low_rate + share * (high_rate - low_rate)
    return points[-1][1]


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or CPU process): its roofline and its memory."""

    peak_flops_per_s: float
    """Peak arithmetic throughput of float32 work (on GPUs: matmuls on TF32 tensor cores)."""
    memory_bandwidth_bytes_per_s: float
    """Device memory bandwidth (the roofline's other roof)."""
    memory_capacity_bytes: float
    """Device memory; the default per-device memory budget."""
    name: str = ""
    peak_flops_per_s_by_dtype: tuple[tuple[str, float], ...] = ()
    """Peak throughput of other floating dtypes, as (MetaIR dtype, FLOP/s) pairs (bfloat16 and float16 run on
    tensor cores at about twice the TF32 rate); a dtype not listed runs at ``peak_flops_per_s``."""
    unsupported_dtypes: tuple[str, ...] = ()
    """Floating dtypes the device cannot compute in (bfloat16 before NVIDIA Ampere)."""
    memory_bandwidth_bytes_per_s_by_dtype: tuple[tuple[str, float], ...] = ()
    """Elementwise bytes/s of other floating dtypes, as (MetaIR dtype, bytes/s) pairs, where they differ from
    ``memory_bandwidth_bytes_per_s`` (on CPUs, bfloat16 and float16 elementwise kernels widen each element to
    float32 and back, and move fewer bytes per second: measured by ``metadist calibrate``); a dtype not listed
    moves ``memory_bandwidth_bytes_per_s``."""
    matmul_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    """Measured matmul throughput by size, per dtype: (MetaIR dtype, ((FLOPs of one matmul, FLOP/s), ...)), sizes
    ascending (``metadist calibrate`` on CPUs: a 64-wide bfloat16 matmul runs at a quarter of float32's rate, a
    512-wide one at three times it). A node is priced at the rate its local FLOPs fall at, interpolated over the
    logarithm of the size and held at the ends; a dtype without a curve runs at its peak. A name ``DTYPE@nt`` or
    ``DTYPE@tn`` holds the curve of matmuls with their second or first operand transposed (measured for bfloat16 and
    float16 on CPUs, whose kernels run those layouts 3-15x faster than row-major by row-major; see
    :func:`~.compute.matmul_layout`)."""
    elementwise_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    """Measured elementwise bytes/s by the bytes one op moves, per dtype, as ``matmul_curves``, capped at the
    largest size's rate (see :meth:`bandwidth_bytes_per_s`)."""
    matmul_stream_bytes_per_s_by_dtype: tuple[tuple[str, float], ...] = ()
    """Bytes/s at which a matmul of few rows passes over its larger operand, per dtype, as (MetaIR dtype, bytes/s)
    pairs (``metadist calibrate`` on CPUs: its kernels pack that operand at about 2 GB/s in float32 on this project's
    2-core machine, a tenth of the elementwise rate). A matmul takes at least its larger operand's local bytes at this
    rate (:meth:`matmul_stream_s`): a skinny one (few tokens per expert, a small local batch) is priced by it, a
    square one by its FLOPs. A dtype not listed has no such floor. ``DTYPE@nt`` and ``DTYPE@tn`` name the rates of
    those layouts, as in :attr:`matmul_curves`."""
    op_overhead_s: float = 0.0
    """Fixed cost of running one op, whatever its size (dispatch and launch: a few microseconds per op on a
    CPU process, measured by ``metadist calibrate``); every node of the step pays it, views included."""
    op_element_seconds: tuple[tuple[str, float], ...] = ()
    """Measured seconds per output element of ops whose kernels compute more than they move, as (op name, seconds)
    pairs (``exp``, ``tanh``, ``_log_softmax``...: :func:`~.compute.op_name` names; measured in float32 by
    ``metadist calibrate`` on CPUs, where a ``tanh`` takes ~18x the time its bytes take at the elementwise rate). A
    node of a listed op takes at least its local output elements at that rate, beyond ``op_overhead_s``; empty for
    the presets (a GPU's special-function units keep such ops near the memory roofline)."""
    eager_op_overhead_s: float = 0.0
    """The fixed cost per node of the captured graph when torch runs the same step eagerly (fused optimizer kernels,
    scalars as Python floats): what a baseline that runs the model itself (torch DDP, FSDP) pays; measured by
    ``metadist calibrate`` on CPU, 0 (not measured) elsewhere. MetaDist's own plans pay ``op_overhead_s``."""
    dtensor_op_overhead_s: float = 0.0
    """What one op on a DTensor costs beyond the same op on a plain tensor (sharding propagation and dispatch, in
    Python): torch's FSDP2 runs its optimizer's ops on DTensor parameters, its tensor parallelism its parallel
    modules' ops too. Measured by ``metadist calibrate`` on CPU (~14-45 us per op on this project's 2-core machine),
    0 (not measured) elsewhere. MetaDist's runtime runs plain tensors and does not pay it."""
    dtensor_module_op_overhead_s: float = 0.0
    """What one op of a tensor-parallel module's forward and backward (a column- or row-wise linear on DTensors)
    costs beyond the same op on plain tensors: a linear's matmul on DTensors, its input wrapped and its output
    unwrapped, costs ~3x an elementwise op's ``dtensor_op_overhead_s`` on CPU. Measured by ``metadist calibrate`` on
    CPU (calibration version 32), 0 (not measured: such ops are priced at ``dtensor_op_overhead_s``) elsewhere."""
    dtensor_collective_overhead_s: float = 0.0
    """What one all-reduce that torch's tensor parallelism issues through DTensor (a row-wise linear's output, a
    column-wise linear's input gradient) costs the calling thread beyond the same all-reduce issued plainly, whose
    cost the link prices: the redistribution, the functional collective and its wait in Python (~0.3-0.4 ms a call on
    this project's 2-core machine). Measured by ``metadist calibrate`` on CPU processes (calibration version 34), 0
    (not measured) elsewhere."""
    matmul_seconds: tuple[tuple[MatmulKey, float], ...] = ()
    """Measured seconds of matmuls by local shape, as (``(dtype, layout, batch, m, k, n)``, seconds) pairs (``batch``
    0 for a plain matmul; ``layout`` as :attr:`matmul_curves`'s): a node whose local matmul is listed is priced at its
    time, beyond ``op_overhead_s``, instead of on the curves. Filled for a step's float32, bfloat16 and float16 matmuls
    on this machine's calibrated CPU cluster (:func:`~.matmul_times.with_measured_matmuls`), the sustained slowdown applied;
    empty for the presets."""
    attention_seconds: tuple[tuple[AttentionKey, float], ...] = ()
    """Measured seconds of fused attention calls (``scaled_dot_product_attention``'s CPU kernel, forward and backward)
    by local shape, as (key, seconds) pairs (:data:`AttentionKey`): a node whose local call is listed is priced at its
    time, beyond ``op_overhead_s``, instead of by its roofline. Filled for a step's attention on this machine's
    calibrated CPU cluster (:func:`~.attention_times.with_measured_attention`), the sustained slowdown applied; empty
    for the presets."""
    relayout_seconds: tuple[tuple[RelayoutKey, float], ...] = ()
    """Measured seconds of relayout copies (a transposed operand copied into a row-major tensor, :attr:`~.compute.Work.relayout`)
    by local shape and dtypes, as (key, seconds) pairs (:data:`RelayoutKey`): a node whose local copy is listed is
    priced at its time, beyond ``op_overhead_s``, instead of at the ``relayout`` seconds per element. Filled for a
    step's relayouts on this machine's calibrated CPU cluster (:func:`~.relayout_times.with_measured_relayouts`), the
    sustained slowdown applied; empty for the presets."""
    sustained_slowdown: float = 1.0
    """How much slower the processes computed over a long stretch than in the calibration's short timed calls, all at
    once (``metadist calibrate`` on CPU; 1 elsewhere). Already applied: the rates above are divided by it and the
    per-op seconds multiplied. Processes that share cores take turns on them, which a call of a millisecond often does
    not see: 4 processes on this project's 2-core machine, 1.55-1.9."""

    def __post_init__(self) -> None:
        pairs = _dtype_pairs(self.peak_flops_per_s_by_dtype)
        bandwidths = _dtype_pairs(self.memory_bandwidth_bytes_per_s_by_dtype)
        streams = _dtype_pairs(self.matmul_stream_bytes_per_s_by_dtype)
        object.__setattr__(self, "matmul_stream_bytes_per_s_by_dtype", streams)
        object.__setattr__(self, "_streams", dict(streams))
        object.__setattr__(self, "peak_flops_per_s_by_dtype", pairs)
        object.__setattr__(self, "memory_bandwidth_bytes_per_s_by_dtype", bandwidths)
        object.__setattr__(self, "unsupported_dtypes", tuple(self.unsupported_dtypes))
        matmul, elementwise = _curves(self.matmul_curves), _curves(self.elementwise_curves)
        object.__setattr__(self, "matmul_curves", matmul)
        object.__setattr__(self, "elementwise_curves", elementwise)
        object.__setattr__(self, "_rates", {})  # (curve kind, dtype, size) -> rate or None: compute_seconds asks often
        matmuls = tuple((tuple(key), float(seconds)) for key, seconds in self.matmul_seconds)
        object.__setattr__(self, "matmul_seconds", matmuls)
        object.__setattr__(self, "_matmul_seconds", dict(matmuls))
        attention = tuple((attention_key_of(key), float(seconds)) for key, seconds in self.attention_seconds)
        object.__setattr__(self, "attention_seconds", attention)
        object.__setattr__(self, "_attention_seconds", dict(attention))
        relayouts = tuple((relayout_key_of(key), float(seconds)) for key, seconds in self.relayout_seconds)
        object.__setattr__(self, "relayout_seconds", relayouts)
        object.__setattr__(self, "_relayout_seconds", dict(relayouts))
        elements = _dtype_pairs(self.op_element_seconds)
        object.__setattr__(self, "op_element_seconds", elements)
        object.__setattr__(self, "_element_seconds", dict(elements))
        figures = (self.peak_flops_per_s, self.memory_bandwidth_bytes_per_s, self.memory_capacity_bytes,
                   *(v for _, v in pairs), *(v for _, v in bandwidths), *(v for _, v in streams),
                   *(value for _, points in (*matmul, *elementwise) for point in points for value in point))
        if min(figures) <= 0 or not self.op_overhead_s >= 0 or not self.eager_op_overhead_s >= 0 \
                or not self.dtensor_op_overhead_s >= 0 or not self.dtensor_module_op_overhead_s >= 0 \
                or not self.dtensor_collective_overhead_s >= 0 \
                or not all(seconds >= 0 for _, seconds in (*elements, *matmuls, *attention, *relayouts)) \
                or not self.sustained_slowdown >= 1:
            raise ClusterError(f"device figures must be positive (op overhead and seconds per element >= 0, the sustained "
                               f"slowdown >= 1), got {self}")

    def flops_per_s(self, dtype: str, flops: float | None = None, layout: str = "") -> float:
        """FLOP/s of work in ``dtype`` (a MetaIR dtype name): at ``flops`` on the dtype's measured curve, if it has
        one and ``flops`` is given, else its peak. ``layout`` (a matmul's, :func:`~.compute.matmul_layout`: ``"nt"``
        or ``"tn"``) takes the curve measured in that layout (``DTYPE@LAYOUT`` in ``matmul_curves``) where there is
        one, else the dtype's row-major one."""
        if flops is not None and self.matmul_curves:
            rate = self._on_curve("matmul", self.matmul_curves, f"{dtype}@{layout}", flops) if layout else None
            if rate is None:
                rate = self._on_curve("matmul", self.matmul_curves, dtype, flops)
            if rate is not None:
                return rate
        for name, peak in self.peak_flops_per_s_by_dtype:
            if name == dtype:
                return peak
        return self.peak_flops_per_s

    def bandwidth_bytes_per_s(self, dtype: str, nbytes: float | None = None) -> float:
        """Elementwise bytes/s of work in ``dtype`` (a MetaIR dtype name): at ``nbytes`` on the dtype's measured
        curve, if it has one and ``nbytes`` is given, but never above the curve's largest size's rate; else its peak.

        The calibration repeats one add on the same buffers, which a small add finds in cache (on this machine a
        float32 add of 64 Ki elements moved 56 GB/s, one of 1 Mi 21 GB/s); a step's ops mostly read what other ops
        wrote earlier. Priced at the cache's rates, a step came out faster than measured (torch DDP's predictions
        in `make bench` moved from 9 of 28 within 25 % to 4), so a small op pays the streaming rate, or the
        lower rate its size was measured at (bfloat16's small adds are slower per byte)."""
        if nbytes is not None and self.elementwise_curves:
            rate = self._on_curve("elementwise", self.elementwise_curves, dtype, nbytes, capped=True)
            if rate is not None:
                return rate
        for name, rate in self.memory_bandwidth_bytes_per_s_by_dtype:
            if name == dtype:
                return rate
        return self.memory_bandwidth_bytes_per_s

    def element_seconds(self, op: str, dtype: str = "float32") -> float:
        """Measured seconds per output element of ``op`` (an :func:`~.compute.op_name`) in ``dtype``: its figure in
        that dtype (``OP@DTYPE``, timed in the narrow dtypes from calibration version 30), else its float32 figure
        (``OP``: a calibration before version 30, a dtype not timed); 0 when not measured."""
        if dtype != "float32":
            seconds = self._element_seconds.get(f"{op}@{dtype}")
            if seconds is not None:
                return seconds
        return self._element_seconds.get(op, 0.0)

    def measured_matmul_s(self, key: MatmulKey) -> float | None:
        """The measured seconds of the local matmul ``key`` (:attr:`matmul_seconds`); None where it was not timed."""
        return self._matmul_seconds.get(key)  # type: ignore[attr-defined]

    def measured_attention_s(self, key: AttentionKey) -> float | None:
        """The measured seconds of the local fused attention call ``key`` (:attr:`attention_seconds`); None where it
        was not timed."""
        return self._attention_seconds.get(key)  # type: ignore[attr-defined]

    def measured_relayout_s(self, key: RelayoutKey) -> float | None:
        """The measured seconds of the local relayout copy ``key`` (:attr:`relayout_seconds`); None where it was not
        timed."""
        return self._relayout_seconds.get(key)  # type: ignore[attr-defined]

    def matmul_stream_s(self, dtype: str, operand_bytes: float, layout: str = "") -> float:
        """The least seconds a matmul in ``dtype`` whose larger operand holds ``operand_bytes`` (locally) takes: that
        operand passed over at ``matmul_stream_bytes_per_s_by_dtype``'s rate (0 where the dtype has none); in
        ``layout`` (``"nt"``, ``"tn"``) at the rate measured in it (``DTYPE@LAYOUT``) where there is one."""
        rates = self._streams  # type: ignore[attr-defined]
        rate = rates.get(f"{dtype}@{layout}") if layout else None
        rate = rate if rate is not None else rates.get(dtype)
        return 0.0 if rate is None else operand_bytes / rate

    def _on_curve(self, kind: str, curves, dtype: str, size: float, capped: bool = False) -> float | None:
        """The rate at ``size`` on ``dtype``'s curve of ``curves`` (None without one), ``capped`` at its largest
        size's rate; remembered, as the solver asks for the same few sizes many times (a miss too: every float32
        matmul in a transposed layout asks for a ``float32@LAYOUT`` curve no device measures)."""
        key = (kind, dtype, size)
        if key in self._rates:
            return self._rates[key]
        points = next((points for name, points in curves if name == dtype), None)
        rate = None
        if points is not None:
            rate = interpolate_curve(points, size)
            rate = min(rate, points[-1][1]) if capped else rate
        self._rates[key] = rate
        return rate

    def supports(self, dtype: str) -> bool:
        return dtype not in self.unsupported_dtypes


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A mesh of identical devices with one link per mesh axis."""

    mesh: Mesh
    device: Device
    axis_links: tuple[Link, ...]
    """One link per mesh axis, in mesh axis order."""
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis_links", tuple(self.axis_links))
        if len(self.axis_links) != self.mesh.ndim:
            raise ClusterError(
                f"cluster {self.name!r} has {len(self.axis_links)} axis links for a {self.mesh.ndim}-axis mesh {self.mesh}; "
                "give one link per mesh axis"
            )

    def link(self, axis: int) -> Link:
        return self.axis_links[axis]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CLUSTER_FORMAT,
            "version": CLUSTER_FORMAT_VERSION,
            "name": self.name,
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "device": _fields(self.device),
            "axis_links": [_fields(link) for link in self.axis_links],
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "Cluster":
        if data.get("format") != CLUSTER_FORMAT:
            raise ClusterError(f"not a MetaDist cluster document (expected format {CLUSTER_FORMAT!r})")
        try:
            return Cluster(
                name=data.get("name", ""),
                mesh=Mesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"])),
                device=Device(**data["device"]),
                axis_links=tuple(Link(**item) for item in data["axis_links"]),
            )
        except (KeyError, TypeError) as err:
            raise ClusterError(f"malformed cluster document: {err}; write it with `metadist calibrate --json FILE`") from None

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class Machine:
    """A preset: a device kind, devices per node, and the intra- and inter-node links."""

    device: Device
    devices_per_node: int
    intra_node_link: Link
    inter_node_link: Link
    description: str


# Dense tensor-core peaks: float32 at the TF32 rate (torch.backends.cuda.matmul.allow_tf32; without it float32
# matmuls run on CUDA cores, ~8x slower), bfloat16 and float16 at twice that. V100s have no bfloat16.
A100 = Device(peak_flops_per_s=156e12, memory_bandwidth_bytes_per_s=2.0e12, memory_capacity_bytes=80e9, name="A100-80GB",
              peak_flops_per_s_by_dtype={"bfloat16": 312e12, "float16": 312e12})
H100 = Device(peak_flops_per_s=494.5e12, memory_bandwidth_bytes_per_s=3.35e12, memory_capacity_bytes=80e9, name="H100-80GB",
              peak_flops_per_s_by_dtype={"bfloat16": 989e12, "float16": 989e12})
V100 = Device(peak_flops_per_s=15.7e12, memory_bandwidth_bytes_per_s=0.9e12, memory_capacity_bytes=32e9, name="V100-32GB",
              peak_flops_per_s_by_dtype={"float16": 125e12}, unsupported_dtypes=("bfloat16",))
NVLINK2 = Link(bandwidth_bytes_per_s=130e9, latency_s=2e-6, call_overhead_s=10e-6, name="nvlink2")
NVLINK3 = Link(bandwidth_bytes_per_s=240e9, latency_s=1.5e-6, call_overhead_s=8e-6, name="nvlink3")
NVLINK4 = Link(bandwidth_bytes_per_s=370e9, latency_s=1e-6, call_overhead_s=8e-6, name="nvlink4")
INFINIBAND_NDR = Link(bandwidth_bytes_per_s=45e9, latency_s=5e-6, call_overhead_s=12e-6, name="infiniband-ndr")
# gloo between local processes on a small CPU machine, often more processes than cores. Measured on
# the 2-core development machine: a 4-byte all-reduce costs 0.2 ms with 2 processes and ~2 ms with 4
# (scheduling, not the wire, dominates); 16 MiB all-gathers reach ~1 GB/s.
# gloo's reduce-scatter is an all-reduce of the whole input (each rank then keeps its piece).
GLOO_LOOPBACK = Link(bandwidth_bytes_per_s=1e9, latency_s=100e-6, call_overhead_s=500e-6, name="gloo-loopback",
                     reduce_scatter_as_all_reduce=True)
# One process on the development machine's CPU (AVX-512 with bf16 instructions): measured single-thread matmuls
# reach ~42 GFLOP/s in float32, ~110 in bfloat16 and ~1.4 in float16 (no fast float16 kernel on CPUs).
CPU_CORE = Device(peak_flops_per_s=50e9, memory_bandwidth_bytes_per_s=10e9, memory_capacity_bytes=16e9, name="cpu",
                  peak_flops_per_s_by_dtype={"bfloat16": 110e9, "float16": 1.5e9}, op_overhead_s=10e-6)

PRESETS: Mapping[str, Machine] = {
    "a100x8": Machine(device=A100, devices_per_node=8, intra_node_link=NVLINK3, inter_node_link=INFINIBAND_NDR,
                      description="one node of 8 A100s over NVLink (more devices: nodes over InfiniBand)"),
    "v100x8": Machine(device=V100, devices_per_node=8, intra_node_link=NVLINK2, inter_node_link=INFINIBAND_NDR,
                      description="one node of 8 V100s over NVLink (no bfloat16; more devices: nodes over InfiniBand)"),
    "h100x8": Machine(device=H100, devices_per_node=8, intra_node_link=NVLINK4, inter_node_link=INFINIBAND_NDR,
                      description="one node of 8 H100s over NVLink (more devices: nodes over InfiniBand)"),
    "h100-ib": Machine(device=H100, devices_per_node=8, intra_node_link=NVLINK4, inter_node_link=INFINIBAND_NDR,
                       description="nodes of 8 H100s: NVLink inside a node, InfiniBand between nodes"),
    "cpu-gloo": Machine(device=CPU_CORE, devices_per_node=1 << 20, intra_node_link=GLOO_LOOPBACK,
                        inter_node_link=GLOO_LOOPBACK, description="processes on this CPU talking over gloo"),
}
DEFAULT_PRESET = "h100-ib"


def cluster_for(preset: str, mesh: Mesh) -> Cluster:
    """The preset ``preset`` laid over ``mesh``: innermost axes inside a node take the fast link."""
    try:
        machine = PRESETS[preset]
    except KeyError:
        raise ClusterError(f"unknown cluster preset {preset!r}; presets are {sorted(PRESETS)}, or pass a cluster JSON file") from None
    links: list[Link] = []
    devices_inside = 1
    for size in reversed(mesh.shape):
        devices_inside *= size
        links.append(machine.intra_node_link if devices_inside <= machine.devices_per_node else machine.inter_node_link)
    return Cluster(mesh=mesh, device=machine.device, axis_links=tuple(reversed(links)), name=preset)


def load_cluster(path: str | Path, mesh: Mesh | None = None) -> Cluster:
    """Read a cluster JSON file; with ``mesh``, re-lay its links over that mesh (same axis count)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ClusterError(f"cannot read cluster file {path}: {err}") from None
    cluster = Cluster.from_dict(data)
    if mesh is None or mesh == cluster.mesh:
        return cluster
    if mesh.ndim == cluster.mesh.ndim:
        return replace(cluster, mesh=mesh)
    if cluster.mesh.ndim == 1:
        return replace(cluster, mesh=mesh, axis_links=(cluster.axis_links[0],) * mesh.ndim)
    raise ClusterError(
        f"cluster file {path} describes a {cluster.mesh.ndim}-axis mesh {cluster.mesh}, not {mesh}; "
        "calibrate with the same --mesh, or pass a preset"
    )


def resolve_cluster(spec: str | None, mesh: Mesh) -> Cluster:
    """A preset name or a JSON file path (the CLI's ``--cluster``); None takes the default preset."""
    if spec is None:
        return cluster_for(DEFAULT_PRESET, mesh)
    if spec in PRESETS:
        return cluster_for(spec, mesh)
    if Path(spec).is_file():
        return load_cluster(spec, mesh)
    raise ClusterError(f"--cluster {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing JSON file")
