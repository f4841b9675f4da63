"""Count the bytes every collective moves, the same way for every method.

The counter reads a ``torch.profiler`` trace taken with ``record_shapes=True``. Every collective
of every method (DDP's C++ reducer, FSDP2's all-gathers and reduce-scatters, DTensor's functional
collectives, MetaDist's runtime) reaches the process group through one dispatcher op of the
``c10d`` namespace (``c10d::allreduce_``, ``c10d::_allgather_base_``...), so counting those ops
counts everything and counts it once. Their tensor shapes come from the profiler's structured
input shapes; their dtype comes from the op itself, or for tensor-list ops from the backend event
(``gloo:all_reduce``, ``nccl:all_reduce``...) that carries it out.

Bytes are the **payload** of each call, per rank, in the nccl-tests convention:

=================  ==========================================
collective         payload bytes
=================  ==========================================
all_reduce         the buffer reduced
all_gather         the gathered output (group size x input)
reduce_scatter     the input before scattering
all_to_all         the input
broadcast          the buffer
=================  ==========================================

On the wire a ring all-reduce sends ``2 (g-1)/g`` payloads per rank and the others ``(g-1)/g``.
gloo carries out a reduce-scatter as an all-reduce of the whole input: the counter names the
collective the caller asked for, and on gloo (``backend="gloo"``) counts its wire bytes as that
all-reduce's, ``2 (g-1)/g`` payloads, which is what the rank sends (and what the cost model prices,
:attr:`metadist.cost.cluster.Link.reduce_scatter_as_all_reduce`).

MetaDist's runtime carries out an all-gather of CPU tensors on gloo as an all-to-all of its input repeated once per
rank (:func:`metadist.runtime.collectives.start_all_gather`): the trace shows that all-to-all, whose payload (its
input) is the gathered bytes and whose wire bytes are the all-gather's, ``(g-1)/g`` of them.

**Group sizes.** The profiler does not record which process group a collective ran on. A gather's or a
scatter's shapes tell its group size; an all-reduce's, an all-to-all's or a broadcast's do not, so on a mesh of
more than one axis (collectives on sub-groups of different sizes) the trace alone cannot give wire bytes.
torch's flight recorder can: enabled before the process groups are made (:func:`enable_flight_recorder`), it logs
every collective a process group carries out, with the group's name, the tensors' sizes and dtypes
(:func:`recorded_calls`, between two :func:`flight_recorder_mark` calls). Its kinds are the ones the backend
carries out (gloo logs a reduce-scatter as the all-reduce it runs), so its wire bytes follow the same ring
convention.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from ..cost.comm import backend_reduce_scatters_as_all_reduce, carried_kind

log = logging.getLogger(__name__)

#: c10d dispatcher op -> (collective kind, how its payload is read from its tensor arguments).
#: ``first``: the first argument; ``output``: argument 0 (the output of ``*_base_`` ops);
#: ``input``: argument 1 (the input of ``*_base_`` ops).
C10D_OPS: dict[str, tuple[str, str]] = {
    "c10d::allreduce_": ("all_reduce", "first"),
    "c10d::allreduce_coalesced_": ("all_reduce", "first"),
    "c10d::_allgather_base_": ("all_gather", "output"),
    "c10d::allgather_": ("all_gather", "output"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "output"),
    "c10d::allgather_coalesced_": ("all_gather", "output"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input"),
    "c10d::reduce_scatter_": ("reduce_scatter", "input"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "input"),
    "c10d::alltoall_base_": ("all_to_all", "input"),
    "c10d::alltoall_": ("all_to_all", "input"),
    "c10d::broadcast_": ("broadcast", "first"),
    "c10d::reduce_": ("reduce", "first"),
    "c10d::gather_": ("gather", "first"),
    "c10d::scatter_": ("scatter", "output"),
}

MARKER_PREFIX = "bench:"
"""Prefix of the ``record_function`` regions the harness opens around builds and steps."""

MEMORY_EVENT = "[memory]"
"""Name of the profiler's allocation events (``profile_memory=True``)."""

BACKEND_PREFIXES = ("gloo:", "nccl:")
"""Names of the backend events that carry out a collective (and carry its dtype)."""

_DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "int": 4, "long int": 8,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
    "c10::complex<double>": 16, "long": 8,
}

ASSUMED_ELEMENT_BYTES = 4
"""Element size used when neither the op nor a backend event names the dtype (counted and reported)."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as the caller asked for it."""

    kind: str
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast..."""
    payload_bytes: int
    """Per-rank payload in the convention of the module docstring."""
    op: str
    """The c10d dispatcher op."""
    dtype_assumed: bool = False
    """True when the element size was not recorded and :data:`ASSUMED_ELEMENT_BYTES` was used."""
    group_size: int = 0
    """Ranks in the collective's group: read from the shapes of gathers and scatters, else the
    caller's default (0: unknown)."""
    reduce_scatter_as_all_reduce: bool = False
    """The backend carries out a reduce-scatter as an all-reduce of its input (gloo)."""

    @property
    def wire_bytes(self) -> float | None:
        """Bytes this rank sends with a ring algorithm (None when the group size is unknown); a send its payload, a
        receive and a barrier nothing."""
        n = self.group_size
        if self.kind in ("recv", "barrier"):
            return 0.0
        if n <= 0:
            return None
        if n == 1:
            return 0.0
        if self.kind == "send":
            return float(self.payload_bytes)
        if carried_kind(self.kind, self.reduce_scatter_as_all_reduce) == "all_reduce":
            return 2 * (n - 1) / n * self.payload_bytes
        return (n - 1) / n * self.payload_bytes


@dataclass(frozen=True)
class CommCount:
    """Collectives of one rank over one window (one training step)."""

    calls: tuple[CollectiveCall, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(call.payload_bytes for call in self.calls)

    def bytes_by_kind(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for call in self.calls:
            totals[call.kind] = totals.get(call.kind, 0) + call.payload_bytes
        return totals

    def calls_by_kind(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for call in self.calls:
            counts[call.kind] = counts.get(call.kind, 0) + 1
        return counts

    @property
    def wire_bytes(self) -> float | None:
        """Ring-algorithm bytes this rank sends; None if any call's group size is unknown."""
        sizes = [call.wire_bytes for call in self.calls]
        return None if any(size is None for size in sizes) else float(sum(sizes))

    @property
    def assumed_dtype_calls(self) -> int:
        return sum(call.dtype_assumed for call in self.calls)


@dataclass(frozen=True)
class TraceEvent:
    """The part of a profiler event the counter reads (kept framework-light for tests)."""

    name: str
    start_ns: int
    end_ns: int
    shapes: tuple = ()
    dtypes: tuple = ()
    thread: int = 0
    nbytes: int = 0
    """For ``[memory]`` events: bytes allocated (positive) or freed (negative)."""
    device: str = "cpu"


def events_from_profile(prof: Any) -> list[TraceEvent]:
    """The profiler's kineto events as :class:`TraceEvent`: collectives, backend calls, markers, memory."""
    events = []
    for event in prof.profiler.kineto_results.events():
        name = event.name()
        if name == MEMORY_EVENT:
            device = str(event.device_type()).rsplit(".", 1)[-1].lower()
            events.append(TraceEvent(name=name, start_ns=event.start_ns(), end_ns=event.start_ns(),
                                     nbytes=event.nbytes(), device=device))
            continue
        if not (name in C10D_OPS or name.startswith(BACKEND_PREFIXES) or name.startswith(MARKER_PREFIX)):
            continue
        shapes = event.structured_input_shapes()
        events.append(TraceEvent(
            name=name, start_ns=event.start_ns(), end_ns=event.end_ns(), shapes=tuple(shapes),
            dtypes=tuple(event.dtypes()), thread=event.start_thread_id(),
        ))
    return events


def window(events: Sequence[TraceEvent], marker: str) -> tuple[int, int]:
    """Start and end (ns) of the ``record_function`` region named ``marker``."""
    for event in events:
        if event.name == marker:
            return event.start_ns, event.end_ns
    names = sorted({event.name for event in events if event.name.startswith(MARKER_PREFIX)})
    raise LookupError(f"no profiler region {marker!r} in the trace; regions present: {names}")


def count_collectives(events: Sequence[TraceEvent], start_ns: int, end_ns: int, default_group_size: int = 0,
                      backend: str = "") -> CommCount:
    """The collectives whose c10d op started inside ``[start_ns, end_ns]``.

    ``default_group_size``: the group size of collectives whose shapes do not tell it (all-reduce,
    broadcast, all-to-all): the world size when every collective spans all ranks, else 0 (unknown).
    ``backend``: the process group's backend (``gloo`` counts a reduce-scatter's wire bytes as an all-reduce's).
    """
    backend_events = sorted((e for e in events if e.name.startswith(BACKEND_PREFIXES)), key=lambda e: e.start_ns)
    used: set[int] = set()
    calls = []
    for event in sorted(events, key=lambda e: e.start_ns):
        if event.name not in C10D_OPS or not start_ns <= event.start_ns <= end_ns:
            continue
        call = _call_of(event, backend_events, used, default_group_size)
        calls.append(replace(call, reduce_scatter_as_all_reduce=backend_reduce_scatters_as_all_reduce(backend)))
    count = CommCount(tuple(calls))
    if count.assumed_dtype_calls:
        log.warning("%d collective(s) had no recorded dtype; counted with %d-byte elements",
                    count.assumed_dtype_calls, ASSUMED_ELEMENT_BYTES)
    return count


def _call_of(event: TraceEvent, backend: Sequence[TraceEvent], used: set[int], default_group_size: int) -> CollectiveCall:
    kind, which = C10D_OPS[event.name]
    argument = {"first": 0, "output": 0, "input": 1}[which]
    shapes = _tensor_shapes(event.shapes[argument] if len(event.shapes) > argument else [])
    group_size = _group_size(event, kind) or default_group_size
    element_bytes = _DTYPE_BYTES.get(event.dtypes[argument]) if len(event.dtypes) > argument else None
    assumed = False
    if element_bytes is None:
        element_bytes = _backend_element_bytes(event, backend, used)
    if element_bytes is None:
        element_bytes, assumed = ASSUMED_ELEMENT_BYTES, True
    numel = sum(math.prod(shape) for shape in shapes)
    return CollectiveCall(kind=kind, payload_bytes=numel * element_bytes, op=event.name, dtype_assumed=assumed,
                          group_size=group_size)


def _group_size(event: TraceEvent, kind: str) -> int:
    """The ratio of the gathered (or scattered) size to the shard size; 0 when the shapes do not say."""
    if kind not in ("all_gather", "reduce_scatter") or len(event.shapes) < 2:
        return 0
    big, small = (0, 1) if kind == "all_gather" else (1, 0)
    big_numel = sum(math.prod(shape) for shape in _tensor_shapes(event.shapes[big]))
    small_numel = sum(math.prod(shape) for shape in _tensor_shapes(event.shapes[small]))
    return big_numel // small_numel if small_numel and big_numel % small_numel == 0 else 0


def _backend_element_bytes(event: TraceEvent, backend: Sequence[TraceEvent], used: set[int]) -> int | None:
    """Element size from the first unused backend event that starts after the c10d op."""
    for index, candidate in enumerate(backend):
        if index in used or candidate.start_ns < event.start_ns:
            continue
        used.add(index)
        for dtype in candidate.dtypes:
            if dtype in _DTYPE_BYTES:
                return _DTYPE_BYTES[dtype]
        return None
    return None


def _tensor_shapes(shape: Any) -> list[list[int]]:
    """Flatten a structured shape (a tensor's shape, a list of them, or a list of lists); ``[]`` is a scalar."""
    if all(isinstance(size, int) for size in shape):
        return [list(shape)]
    flat: list[list[int]] = []
    for item in shape:
        flat.extend(_tensor_shapes(item))
    return flat


# ---------------------------------------------------------------- the flight recorder: collectives with their groups

FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
"""The environment variable torch reads, once, when a process group first records: entries kept (0: off)."""

FLIGHT_RECORDER_ENTRIES = 1 << 16
"""Entries the harness keeps: far more than one step issues (GPT-2 small's plan: ~115 collectives a step)."""

_RECORDED_KINDS = (("all_reduce", "all_reduce"), ("allreduce", "all_reduce"), ("reduce_scatter", "reduce_scatter"),
                   ("all_gather", "all_gather"), ("allgather", "all_gather"), ("all_to_all", "all_to_all"),
                   ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("gather", "gather"), ("scatter", "scatter"),
                   ("reduce", "reduce"), ("send", "send"), ("recv", "recv"), ("barrier", "barrier"))
"""Substrings of a flight recorder entry's ``profiling_name`` (``gloo:all_reduce``, ``nccl:_allgather_base``...) and the
kind each names, the first that matches."""

_RECORDED_ELEMENT_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
                           "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16,
                           "Float8_e4m3fn": 1, "Float8_e5m2": 1}


def enable_flight_recorder() -> bool:
    """Ask torch to keep its flight recorder (:data:`FLIGHT_RECORDER_ENTRIES` entries) unless the environment sets its
    size already; call before the first process group is made. True when it will record."""
    os.environ.setdefault(FLIGHT_RECORDER_ENV, str(FLIGHT_RECORDER_ENTRIES))
    return int(os.environ[FLIGHT_RECORDER_ENV] or 0) > 0


def flight_recorder_entries() -> list[dict[str, Any]]:
    """Every entry torch's flight recorder holds (finished collectives included), oldest first."""
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return sorted(json.loads(_dump_fr_trace_json(True, False)).get("entries", []), key=lambda entry: entry["record_id"])


def flight_recorder_mark() -> int:
    """The record id of the flight recorder's newest entry (-1 when it holds none): the collectives recorded after a
    mark are those with a larger id."""
    entries = flight_recorder_entries()
    return entries[-1]["record_id"] if entries else -1


def process_group_sizes() -> dict[str, int]:
    """Size of each process group this rank belongs to, by the name the flight recorder logs."""
    from torch.distributed import distributed_c10d as c10d

    return {str(name): group.size() for group, name in c10d._world.pg_names.items()}


class UnreadableRecord(ValueError):
    """A flight recorder entry that the counter cannot read (a kind, a dtype or a group it does not know)."""


def recorded_calls(entries: Sequence[Mapping[str, Any]], after: int, upto: int,
                   group_sizes: Mapping[str, int]) -> tuple[CollectiveCall, ...]:
    """The collectives the flight recorder logged with record ids in ``(after, upto]``, as the backend carried them out
    (gloo's reduce-scatter as the all-reduce it runs; ``op`` the entry's ``profiling_name``).

    Raises :class:`UnreadableRecord` when an entry of the window is missing (the recorder's ring overwrote it), or
    names a collective, a dtype or a process group (``group_sizes``: :func:`process_group_sizes`) the counter does
    not know."""
    window_entries = [entry for entry in entries if after < entry["record_id"] <= upto]
    if len(window_entries) != upto - after:
        raise UnreadableRecord(f"the flight recorder kept {len(window_entries)} of the {upto - after} collectives "
                               f"recorded in the window (raise {FLIGHT_RECORDER_ENV})")
    return tuple(_recorded_call(entry, group_sizes) for entry in window_entries)


def _recorded_call(entry: Mapping[str, Any], group_sizes: Mapping[str, int]) -> CollectiveCall:
    name = str(entry.get("profiling_name", ""))
    operation = name.split(":", 1)[-1]
    kind = next((kind for text, kind in _RECORDED_KINDS if text in operation), None)
    if kind is None:
        raise UnreadableRecord(f"flight recorder entry {name!r}: not a collective the counter knows")
    group = str(entry["process_group"][0])
    if group not in group_sizes:
        raise UnreadableRecord(f"flight recorder entry {name!r} ran on process group {group!r}, which this rank does "
                               f"not know (groups: {sorted(group_sizes)})")
    sizes, dtypes = ((entry.get("output_sizes"), entry.get("output_dtypes")) if kind == "all_gather"
                     else (entry.get("input_sizes"), entry.get("input_dtypes")))
    payload = 0
    for shape, dtype in zip(sizes or (), dtypes or ()):
        if dtype not in _RECORDED_ELEMENT_BYTES:
            raise UnreadableRecord(f"flight recorder entry {name!r}: dtype {dtype!r} has no known element size")
        payload += math.prod(shape) * _RECORDED_ELEMENT_BYTES[dtype]
    return CollectiveCall(kind=kind, payload_bytes=payload, op=name, group_size=group_sizes[group])
