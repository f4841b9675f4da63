"""The measured results of one benchmark invocation, as frozen data that round-trips through JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

RESULTS_FORMAT = "metadist.bench"
RESULTS_FORMAT_VERSION = 1

STATUS_OK = "ok"
STATUS_UNAVAILABLE = "not available"
STATUS_FAILED = "failed"

LOSS_RTOL = 1e-4
"""Largest relative difference of a method's final loss from the single-device loss that counts as
agreement (fp32; the methods differ in reduction order only)."""

TIMINGS = ("interleaved", "sequential")
"""How a run times its methods (:attr:`BenchRun.timing`); the first is the harness's default (``--timing``)."""


@dataclass(frozen=True, kw_only=True)
class MethodResult:
    """One method's figures; per-rank figures are the maximum over ranks."""

    method: str
    status: str
    """``ok``, ``not available`` (cannot apply here) or ``failed`` (MetaDist's pipeline raised)."""
    reason: str = ""
    """Why the method did not run, or the first line of its error."""
    mesh_shape: tuple[int, ...] = ()
    step_times_s: tuple[float, ...] = ()
    """Each timed step: the slowest rank's time."""
    comm_payload_bytes: int = 0
    """Collective payload bytes per rank per step (:mod:`.comm_count`)."""
    comm_wire_bytes: float | None = None
    """Ring-algorithm bytes sent per rank per step; None where a group size was unknown."""
    comm_bytes_by_kind: Mapping[str, int] = field(default_factory=dict)
    comm_calls_by_kind: Mapping[str, int] = field(default_factory=dict)
    state_memory_bytes: int = 0
    """Bytes held when the measured step starts (:mod:`.memory_track`)."""
    peak_memory_bytes: int = 0
    """Most bytes held during the measured step."""
    memory_source: str = ""
    final_loss: float | None = None
    """Loss of the whole batch at the last step."""
    compile_s: Mapping[str, float] = field(default_factory=dict)
    """MetaDist only: capture, discovery, solve, lowering seconds."""
    predicted: Mapping[str, Any] = field(default_factory=dict)
    """The cost model's estimate of this method on this machine (``step_s``, ``comm_bytes``, ``memory_bytes``)."""
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def median_step_s(self) -> float | None:
        return _quantile(self.step_times_s, 0.5)

    @property
    def spread_s(self) -> tuple[float, float] | None:
        """The 25th and 75th percentiles of the step time."""
        if not self.step_times_s:
            return None
        return _quantile(self.step_times_s, 0.25), _quantile(self.step_times_s, 0.75)


@dataclass(frozen=True, kw_only=True)
class BenchRun:
    """One invocation: one model, one batch, one set of processes, every method."""

    model: str
    world_size: int
    mesh_shape: tuple[int, ...]
    backend: str
    device: str
    steps: int
    warmup: int
    batch_shapes: Mapping[str, tuple[int, ...]]
    params: int
    machine: Mapping[str, Any]
    versions: Mapping[str, str]
    command: str
    methods: tuple[MethodResult, ...]
    loss_rtol: float = LOSS_RTOL
    notes: tuple[str, ...] = ()
    timing: str = "sequential"
    """How the timed steps ran: ``interleaved`` (round by round, every method a step in turn) or ``sequential`` (one
    method's after the other's; what files without the field did)."""
    timed_alone: tuple[str, ...] = ()
    """With interleaved timing, the methods timed on their own first (memory: see the harness's ``--timed-alone``)."""
    min_timed_s: float = 0.0
    """Timed steps were added after the first ``steps`` until they spanned about this many seconds (the harness's
    ``--min-timed-s``; 0: exactly ``steps``, what files without the field did). Each method's count is the length
    of its ``step_times_s``."""
    turn_steps: int = 1
    """The consecutive steps of a timed turn, timed together after one barrier: each of ``step_times_s`` is a turn's
    mean (the harness's ``--turn-steps``; 1: a barrier before every timed step, what files without the field did)."""

    def method(self, name: str) -> MethodResult | None:
        return next((result for result in self.methods if result.method == name), None)

    def loss_agreement(self) -> dict[str, float]:
        """Relative difference of every method's final loss from the single-device one."""
        reference = self.method("single")
        if reference is None or reference.final_loss is None:
            return {}
        base = reference.final_loss
        return {
            result.method: abs(result.final_loss - base) / max(abs(base), 1e-12)
            for result in self.methods if result.ok and result.final_loss is not None
        }

    def to_json(self) -> str:
        data = asdict(self)
        data = {"format": RESULTS_FORMAT, "version": RESULTS_FORMAT_VERSION, **data}
        return json.dumps(data, indent=1, allow_nan=False)

    @staticmethod
    def from_json(text: str) -> "BenchRun":
        data = json.loads(text)
        if data.get("format") != RESULTS_FORMAT or data.get("version") != RESULTS_FORMAT_VERSION:
            raise ValueError(f"not a MetaDist benchmark result (format {RESULTS_FORMAT!r} v{RESULTS_FORMAT_VERSION})")
        methods = tuple(_method_from_dict(item) for item in data.pop("methods"))
        names = {f.name for f in fields(BenchRun)}
        kwargs = {key: value for key, value in data.items() if key in names}
        kwargs["mesh_shape"] = tuple(kwargs["mesh_shape"])
        kwargs["notes"] = tuple(kwargs.get("notes", ()))
        kwargs["timed_alone"] = tuple(kwargs.get("timed_alone", ()))
        kwargs["batch_shapes"] = {key: tuple(value) for key, value in kwargs["batch_shapes"].items()}
        return BenchRun(methods=methods, **kwargs)


def _method_from_dict(data: Mapping[str, Any]) -> MethodResult:
    item = dict(data)
    item["mesh_shape"] = tuple(item.get("mesh_shape", ()))
    item["step_times_s"] = tuple(item.get("step_times_s", ()))
    return MethodResult(**item)


def _quantile(values: tuple[float, ...], q: float) -> float | None:
    """Linear-interpolation quantile (numpy's default), without numpy."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
