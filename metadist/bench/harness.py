"""The measurement harness: every method on the same model, batch and processes, in one invocation.

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m metadist.bench.harness MODEL [--mesh DPxTP] [--steps K] [--methods ...] --out FILE.json

Each method, as a recipe (the same for every method):

1. build it from a private copy of the same seeded model (dropout off, see below);
2. run ``PROFILED_STEPS`` steps under ``torch.profiler`` (shapes and memory recorded): the last
   one is the measured step for collective bytes (:mod:`.comm_count`) and memory
   (:mod:`.memory_track`);
3. run ``warmup`` more steps, then ``steps`` timed ones, each started after a barrier; a step's
   time is the slowest rank's; then more timed ones while they spanned under ``--min-timed-s``
   (:data:`MIN_TIMED_S`; interleaved, more rounds), so that a tiny model's steps are timed over
   seconds, not one scheduler turn;
4. the loss after the first ``steps`` timed steps, summed over the ranks' contributions, is the
   whole batch's loss.

A timed step is a turn of ``--turn-steps`` consecutive steps (:data:`TURN_STEPS`) after a barrier, timed together:
its time is the turn's span over its steps, as a training loop runs them back to back.

``--timing interleaved`` (the default) builds and profiles every method first and keeps them all; then each round
gives every method a turn, the order rotated by one each round: a warm-up round's turn is one untimed step, a timed
round's one timed turn. A machine whose speed drifts over minutes (a shared CPU, a GPU's clocks) then slows every
method alike, and their ratios hold; one after the other, a drift between two methods' turns showed as a 10-20 %
difference between runs of the same code. The methods are alive together, so the run needs the memory of all of them
at once, except those named by ``--timed-alone`` (the one-device reference by default, :data:`TIMED_ALONE`), each
timed on its own first. The methods share their processes, and on CPU every method runs with glibc keeping freed
host memory for reuse (``METADIST_HOST_HEAP``, set for the process before the first method is built, as a compiled
step sets it): the methods timed alone first too, which ran without it before and touched fresh pages after every
free. ``--timing sequential`` times each method right after its build and frees it before the next.

Every method's final loss is taken after ``PROFILED_STEPS + warmup + turn_steps * steps`` steps from the same weights
on the same global batch (the turns added for time's sake come after it), so their final losses must agree with the
single-device one (relative tolerance :data:`.results.LOSS_RTOL`). Dropout is switched off (every dropout
probability set to 0): with dropout on, each method draws different masks and the losses could not be compared.
MetaDist compiles (capture, discovery, solve, lowering) outside the profiler, so its compile
times carry no profiling overhead.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from ..progress import enter, phase
from ..workload import Workload
from .baselines import BASELINE_METHODS, MethodUnavailable, Prepared, RankContext, build_baseline, disable_dropout
from .comm_count import (UnreadableRecord, count_collectives, enable_flight_recorder, events_from_profile,
                         flight_recorder_entries, flight_recorder_mark, process_group_sizes, recorded_calls, window)
from .memory_track import MemoryPeak, cpu_memory_peak
from .metadist_method import METADIST_METHODS, build_metadist, predict_baselines
from .results import STATUS_FAILED, STATUS_OK, STATUS_UNAVAILABLE, TIMINGS, BenchRun, MethodResult

log = logging.getLogger(__name__)

ALL_METHODS = (*BASELINE_METHODS, *METADIST_METHODS)
TIMED_ALONE = ("single",)
"""The methods that interleaved timing measures on their own by default (``--timed-alone``), each first and freed
before the others are built: the one-device reference holds the whole model, gradients and optimizer state on every
rank, the most memory of any method, and it is no distributed baseline to compare with. Every method alive at once
needs the sum of their memory: GPT-2 small's five took all of this machine's 24 GB (a rank was killed), its four
distributed ones 20 GB."""
PROFILED_STEPS = 2
"""Steps run under the profiler; the last is the measured one (the first allocates optimizer state)."""
MIN_TIMED_S = 10.0
"""Default ``--min-timed-s``: the seconds a method's timed steps (or, interleaved, the rounds) span at least. On this
project's 2-core machine one thread's matmul and add moved by 10-20 % from one few-second sample to the next within a
minute, and 4 processes sharing 2 cores make a step of a few milliseconds about one scheduler turn: ten timed steps
of a tiny model spanned a fraction of a second, and the same program run as two methods in the same rounds (the ILP
plan with and without overlap on mlp) came out 6.3 and 8.4 ms on one page, 8.5 and 7.1 on another."""
MAX_TIMED_STEPS = 300
"""The most timed steps (turns, :data:`TURN_STEPS`) ``--min-timed-s`` adds up to."""
TURN_STEPS = 4
"""Default ``--turn-steps``: the consecutive steps of a timed turn, timed together after one barrier (a timed step's
figure is the turn's span over them). One step a barrier is not what a training loop runs: on this project's 2-core
machine, gpt2-tiny on 2 processes (batch 16 x 64, interleaved with three other methods) ran MetaDist's plan at
22.2-24.4 ms a step and torch DDP at 22.8-23.8 timed one step after each barrier, 20.6 and 20.3 in turns of 4 (on 4
processes sharing the 2 cores, llama-tiny's 21.5 and 26.7 one step a barrier, 20.5 and 26.6 in turns of 4). Steps
without a barrier before each, but each timed on its own, are no loop's figure either: on 4 processes they came out up
to 30 % slower than in turns, the slowest rank's time of each step counting the skew the ranks carry from step to
step."""


@dataclass(frozen=True, kw_only=True)
class HarnessConfig:
    """What one invocation measures; the same on every rank."""

    model: str
    """Built-in name or path/to/file.py[:function]."""
    methods: tuple[str, ...]
    steps: int
    """Timed steps per method, at least; more where they took under ``min_timed_s`` (:func:`timed_steps_to_add`).
    Every method's final loss is the one after this many (the same number of steps for every method)."""
    warmup: int
    """Unprofiled, untimed steps before the timed ones."""
    mesh_shape: tuple[int, ...]
    """Mesh of the 2-D methods (tp-dp) and of MetaDist; () for 1-D over all ranks."""
    batch_size: int | None
    seq_len: int | None
    optimizer: str
    out: str
    """Path of the result JSON (written by rank 0)."""
    predict: bool
    """Also record the cost model's estimate of each baseline (needs the solver)."""
    timeout_s: float
    cluster: str | None = None
    """The cost model's cluster for MetaDist's plans and the estimates: a preset or a calibrated JSON file
    (``metadist calibrate``); None: ``cpu-gloo`` on CPU, the default preset on GPUs."""
    timing: str = TIMINGS[0]
    """``interleaved``: every method's timed steps taken in turn, round by round; ``sequential``: one method's after
    the other's (see the module docstring)."""
    timed_alone: tuple[str, ...] = ()
    """With interleaved timing, the methods measured on their own first (and freed before the others are built)."""
    min_timed_s: float = MIN_TIMED_S
    """Timed steps are added after the first ``steps`` until they span about this many seconds (0: none added)."""
    turn_steps: int = TURN_STEPS
    """Consecutive steps of a timed turn, timed together after one barrier: each timed step's figure is a turn's
    mean."""

    def __post_init__(self) -> None:
        unknown = [method for method in self.methods if method not in ALL_METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(ALL_METHODS)}")
        if self.timing not in TIMINGS:
            raise ValueError(f"--timing {self.timing!r}: choose {' or '.join(TIMINGS)}")
        stray = [method for method in self.timed_alone if method not in self.methods]
        if stray:
            raise ValueError(f"--timed-alone names {stray}, which --methods does not run; name methods of --methods")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {self.steps} and {self.warmup}")
        if self.turn_steps < 1:
            raise ValueError(f"--turn-steps must be >= 1, got {self.turn_steps}")
        if not self.min_timed_s >= 0:
            raise ValueError(f"--min-timed-s must be >= 0 seconds, got {self.min_timed_s}")


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x2"`` -> ``(2, 2)``; ``""`` -> ``()``."""
    if not text:
        return ()
    try:
        shape = tuple(int(size) for size in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh {text!r} is not sizes joined by 'x', e.g. 2x2") from None
    if any(size < 1 for size in shape):
        raise ValueError(f"--mesh {text!r} has a size below 1")
    return shape


def parse_args(argv: list[str] | None = None) -> HarnessConfig:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.harness", description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated; default: all")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed turns (--turn-steps steps each) per method, at least (the final losses are "
                             "compared after this many)")
    parser.add_argument("--min-timed-s", type=float, default=MIN_TIMED_S,
                        help=f"add timed turns until a method's (interleaved: a round's) span about this many seconds, "
                             f"at most {MAX_TIMED_STEPS} in all (default {MIN_TIMED_S:g}; 0: exactly --steps)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--turn-steps", type=int, default=TURN_STEPS,
                        help=f"consecutive steps timed together after one barrier, each timed step's figure their mean "
                             f"(default {TURN_STEPS}; 1: a barrier before every step)")
    parser.add_argument("--mesh", default="", help="DPxTP mesh for tp-dp and MetaDist, e.g. 2x2")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-predict", action="store_true", help="skip the cost model's estimates of the baselines")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="bound on every collective (a failed rank never hangs the others)")
    parser.add_argument("--cluster", default=None, help="cost model cluster: preset or calibrated JSON file")
    parser.add_argument("--timing", default=TIMINGS[0], choices=TIMINGS,
                        help="interleaved (default): the methods' timed steps in turn, round by round, all methods alive "
                             "at once (single is timed on its own first); sequential: each method timed after its build "
                             "and freed before the next")
    parser.add_argument("--timed-alone", default=None,
                        help="with interleaved timing, comma-separated methods measured on their own first and freed "
                             "before the others are built (default: single, if it runs; '' for none): what keeps the "
                             "memory of the methods alive at once within the machine's")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    methods = tuple(m for m in args.methods.split(",") if m)
    if args.timed_alone is None:
        timed_alone = tuple(m for m in TIMED_ALONE if m in methods)
    else:
        timed_alone = tuple(m for m in args.timed_alone.split(",") if m)
    return HarnessConfig(
        model=args.model, methods=methods, steps=args.steps,
        warmup=args.warmup, mesh_shape=parse_mesh(args.mesh), batch_size=args.batch_size, seq_len=args.seq_len,
        optimizer=args.optimizer, out=args.out, predict=not args.no_predict, timeout_s=args.timeout_s,
        cluster=args.cluster, timing=args.timing,
        timed_alone=timed_alone, min_timed_s=args.min_timed_s, turn_steps=args.turn_steps,
    )


# ---------------------------------------------------------------- setup


def setup(config: HarnessConfig) -> RankContext:
    """The process group (NCCL on GPUs, gloo on CPUs) and who this rank is."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    global _RECORDING
    _RECORDING = enable_flight_recorder()  # before any process group: the wire bytes of sub-group collectives
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=config.timeout_s))
    world = dist.get_world_size()
    mesh_shape = config.mesh_shape or (world,)
    size = 1
    for axis_size in mesh_shape:
        size *= axis_size
    if size != world:
        raise ValueError(f"--mesh {'x'.join(map(str, mesh_shape))} has {size} devices but {world} processes run; "
                         f"launch {size} processes or pick a mesh of {world}")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return RankContext(rank=dist.get_rank(), world_size=world, device=device, mesh_shape=mesh_shape,
                       cluster=config.cluster)


def load_bench_workload(config: HarnessConfig) -> Workload:
    """The workload on the CPU with real weights, dropout off."""
    from ..workloads import builtin_workload, load_workload
    from ..workloads.builtin import BUILTINS

    if config.model in BUILTINS:
        workload = builtin_workload(config.model, device="cpu", optimizer=config.optimizer,
                                    batch_size=config.batch_size, seq_len=config.seq_len)
    else:
        workload = load_workload(config.model)
    disable_dropout(workload.model)
    return workload


# ---------------------------------------------------------------- one method


def _sync(ctx: RankContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()


_RECORDING = False
"""Whether torch's flight recorder logs this process's collectives (:func:`setup` enables it)."""


def _profiled_run(method: str, workload: Workload, ctx: RankContext, prepared: Prepared | None) -> tuple[Prepared, Any, MemoryPeak | None, torch.Tensor, tuple[int, int] | None]:
    """Build (unless prepared) and run the profiled steps; returns the profiler, the CUDA memory peak, the loss and
    the flight recorder's marks around the last step (None when it does not record)."""
    cuda_peak, marks = None, None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=ctx.device.type == "cpu") as prof:
        baseline = torch.cuda.memory_allocated() if ctx.device.type == "cuda" else 0
        with record_function("bench:build"):
            prepared = prepared or build_baseline(method, workload, ctx)
            if prepared.build is not None:
                prepared.build()
        for index in range(PROFILED_STEPS):
            last = index == PROFILED_STEPS - 1
            if last and ctx.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                state = torch.cuda.memory_allocated() - baseline
            before = flight_recorder_mark() if last and _RECORDING else None
            with record_function(f"bench:step{index}"):
                loss = prepared.step()
                _sync(ctx)
            if before is not None:
                marks = (before, flight_recorder_mark())
        if ctx.device.type == "cuda":
            cuda_peak = MemoryPeak(state_bytes=state, peak_bytes=torch.cuda.max_memory_allocated() - baseline,
                                   source="cuda-allocator")
    return prepared, prof, cuda_peak, loss, marks


def _recorded_wire_bytes(method: str, marks: tuple[int, int] | None, profiled: float | None) -> float | None:
    """The wire bytes of the collectives torch's flight recorder logged between ``marks`` (each with its process
    group's size); None when it did not record or an entry cannot be read (said in the log). ``profiled``: the
    profiler's count of the same step where it knows every group's size, compared."""
    if marks is None:
        return None
    try:
        recorded = sum(call.wire_bytes for call in recorded_calls(flight_recorder_entries(), *marks, process_group_sizes()))
    except UnreadableRecord as err:
        log.warning("%s: the flight recorder's collectives were not counted: %s", method, err)
        return None
    if profiled is not None and abs(recorded - profiled) > 1e-6 * max(profiled, 1.0):
        log.warning("%s: the flight recorder counts %.0f wire bytes a step, the profiler %.0f", method, recorded, profiled)
    return recorded


@dataclass
class _Built:
    """A method built and profiled, waiting for its timed steps."""

    method: str
    prepared: Prepared
    comm: Any
    memory: MemoryPeak
    compile_s: dict
    predicted: dict
    times: list[float]
    loss: torch.Tensor | None = None
    recorded_wire: float | None = None
    """The last profiled step's wire bytes by torch's flight recorder (:func:`_recorded_wire_bytes`)."""


def _timed_step(built: _Built, ctx: RankContext, turn_steps: int) -> None:
    """One timed turn: ``turn_steps`` consecutive steps after a barrier, their mean appended to the method's times."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(turn_steps):
        built.loss = built.prepared.step()
    _sync(ctx)
    built.times.append((time.perf_counter() - started) / turn_steps)


def build_method(method: str, workload: Workload, ctx: RankContext) -> _Built | MethodResult:
    """Build and profile one method: its collective bytes and memory from the last profiled step; a MethodResult
    instead when it is unavailable or MetaDist's pipeline failed."""
    compile_s, predicted, prepared = {}, {}, None
    try:
        if method in METADIST_METHODS:
            prepared, compile_s, predicted = build_metadist(method, workload, ctx)
        prepared, prof, cuda_peak, loss, marks = _profiled_run(method, workload, ctx, prepared)
    except MethodUnavailable as err:
        log.warning("%s: not available: %s", method, err)
        dist.barrier()
        return MethodResult(method=method, status=STATUS_UNAVAILABLE, reason=str(err))
    except (RuntimeError, ValueError, AssertionError) as err:
        if method not in METADIST_METHODS:
            raise  # a baseline that breaks is a bug of the harness: keep the traceback
        return _failed(method, err)
    events = events_from_profile(prof)
    start, end = window(events, f"bench:step{PROFILED_STEPS - 1}")
    one_d = len(prepared.mesh_shape) == 1
    comm = count_collectives(events, start, end, default_group_size=ctx.world_size if one_d else 0, backend=dist.get_backend())
    memory = cuda_peak or cpu_memory_peak(events, start, end)
    del prof, events
    return _Built(method, prepared, comm, memory, compile_s, predicted, [], loss,
                  _recorded_wire_bytes(method, marks, comm.wire_bytes))


def finish_method(built: _Built, ctx: RankContext) -> MethodResult:
    """The method's result from its timed steps (each the slowest rank's) and figures; frees the method."""
    slowest = torch.tensor(built.times, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    total = built.loss.detach().to(torch.float64).reshape(())
    dist.all_reduce(total)
    local = {"comm": built.comm, "memory": built.memory, "recorded_wire": built.recorded_wire}
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, local)
    result = _result(built.method, built.prepared, slowest.tolist(), float(total), gathered, built.compile_s,
                     built.predicted)
    built.prepared = None
    gc.collect()
    dist.barrier()
    return result


def measure_method(method: str, workload: Workload, ctx: RankContext, config: HarnessConfig) -> MethodResult:
    """Build, profile and time one method on its own; figures are the maximum over ranks."""
    built = build_method(method, workload, ctx)
    if isinstance(built, MethodResult):
        return built
    for _ in range(config.warmup):
        built.loss = built.prepared.step()
    for _ in range(config.steps):
        _timed_step(built, ctx, config.turn_steps)
    compared = built.loss
    for _ in range(timed_steps_to_add(sum(built.times), config, ctx)):
        _timed_step(built, ctx, config.turn_steps)
    built.loss = compared
    return finish_method(built, ctx)


def timed_steps_to_add(turn_times_s: float, config: HarnessConfig, ctx: RankContext) -> int:
    """Timed turns (or interleaved rounds) to add after the first ``config.steps``, whose recorded figures (each a
    turn's mean step) add up to ``turn_times_s`` on this rank, so that all of them span about ``config.min_timed_s``
    (a turn spans ``config.turn_steps`` times its figure): the same on every rank (the slowest rank's span), at most
    :data:`MAX_TIMED_STEPS` in all. A method's final loss stays the one after ``config.steps``, so that every
    method's is compared after as many steps whatever was added."""
    if config.min_timed_s <= 0:
        return 0
    slowest = torch.tensor([turn_times_s * config.turn_steps], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return steps_for_span(float(slowest), config.steps, config.min_timed_s)


def steps_for_span(span_s: float, steps: int, min_timed_s: float) -> int:
    """Steps to add to ``steps`` that took ``span_s`` so that all span ``min_timed_s`` at the same pace, within
    :data:`MAX_TIMED_STEPS` in all."""
    if span_s <= 0 or span_s >= min_timed_s:
        return 0
    wanted = math.ceil(steps * min_timed_s / span_s - 1e-9)  # 10.000000000000002 rounds is 10
    return max(0, min(wanted, MAX_TIMED_STEPS) - steps)


def measure_interleaved(methods: tuple[str, ...], workload: Workload, ctx: RankContext,
                        config: HarnessConfig) -> list[MethodResult]:
    """Build and profile every method, then run their warm-up and timed steps in rounds, one step of each method a
    round, the order rotated by one each round; results in ``methods``' order. The config's ``timed_alone`` methods
    are measured on their own first."""
    results: dict[str, MethodResult] = {}
    alive: list[_Built] = []
    for method in methods:
        if method in config.timed_alone:  # first, and freed before the others are built
            with phase(method):
                results[method] = measure_method(method, workload, ctx, config)
    for method in methods:
        if method in config.timed_alone:
            continue
        with phase(method):
            built = build_method(method, workload, ctx)
        if isinstance(built, MethodResult):
            results[method] = built
        else:
            alive.append(built)
    with phase("timed steps, interleaved"):
        first = config.warmup + config.steps
        _rounds(alive, range(first), config.warmup, config.turn_steps, ctx)
        compared = [built.loss for built in alive]
        added = timed_steps_to_add(sum(sum(built.times) for built in alive), config, ctx) if alive else 0
        _rounds(alive, range(first, first + added), config.warmup, config.turn_steps, ctx)
        for built, loss in zip(alive, compared):
            built.loss = loss
    for built in alive:
        results[built.method] = finish_method(built, ctx)
    return [results[method] for method in methods]


def _rounds(alive: list[_Built], indices: range, warmup: int, turn_steps: int, ctx: RankContext) -> None:
    """Rounds ``indices`` of the interleaved steps: a turn of every method in each, starting ``index`` methods on; a
    round below ``warmup`` is a warm-up (one untimed step a turn, no barrier), a timed round's turn is ``turn_steps``
    steps timed together (:func:`_timed_step`)."""
    for index in indices:
        for turn in range(len(alive)):
            built = alive[(index + turn) % len(alive)]
            if index < warmup:
                built.loss = built.prepared.step()
            else:
                _timed_step(built, ctx, turn_steps)


def _failed(method: str, err: BaseException) -> MethodResult:
    """MetaDist's pipeline failed on this rank: record why (first line), after the ranks meet again."""
    reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    log.error("%s failed: %s", method, reason)
    gc.collect()
    dist.barrier()
    return MethodResult(method=method, status=STATUS_FAILED, reason=reason)


def _result(method: str, prepared: Prepared, times: list[float], loss: float, gathered: list[dict],
            compile_s: dict, predicted: dict) -> MethodResult:
    busiest = max(gathered, key=lambda item: item["comm"].total_bytes)["comm"]
    # the profiler's count where it knows every group's size (one-axis meshes), else the flight recorder's
    wires = [item["recorded_wire"] if item["comm"].wire_bytes is None else item["comm"].wire_bytes for item in gathered]
    return MethodResult(
        method=method, status=STATUS_OK, mesh_shape=tuple(prepared.mesh_shape), step_times_s=tuple(times),
        comm_payload_bytes=busiest.total_bytes,
        comm_wire_bytes=None if any(w is None for w in wires) else max(wires),
        comm_bytes_by_kind=busiest.bytes_by_kind(), comm_calls_by_kind=busiest.calls_by_kind(),
        state_memory_bytes=max(item["memory"].state_bytes for item in gathered),
        peak_memory_bytes=max(item["memory"].peak_bytes for item in gathered),
        memory_source=gathered[0]["memory"].source, final_loss=loss, compile_s=compile_s,
        predicted=predicted, note=prepared.note,
    )


# ---------------------------------------------------------------- the run


def machine_info() -> dict[str, Any]:
    """The machine, read at run time."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.machine(),
        "cuda": torch.cuda.is_available(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "load_average_1min": os.getloadavg()[0], "host_heap": _host_heap(),
    }
    return info


def _host_heap() -> str:
    """Whether the C library keeps freed host memory in this process: ``kept`` or ``system``."""
    from ..runtime import host_memory

    return "kept" if host_memory.keeps_freed_host_memory() else "system"


def same_host_heap(ctx: RankContext) -> None:
    """On CPU, the C library keeps freed host memory for every method of the run (:mod:`metadist.runtime.host_memory`),
    unless ``METADIST_HOST_HEAP=system``: a compiled step sets this for its process when it is built, so without it here
    the methods measured before MetaDist's build (those timed alone) would run with other allocator settings than
    those measured after it."""
    from ..runtime.host_memory import keep_freed_host_memory_as_set

    if ctx.device.type == "cpu":
        keep_freed_host_memory_as_set()


def versions() -> dict[str, str]:
    import transformers

    from .. import __version__

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "metadist": __version__}


def run(config: HarnessConfig, argv: list[str]) -> int:
    enter("setup")
    ctx = setup(config)
    same_host_heap(ctx)
    enter("load")
    workload = load_bench_workload(config)
    if config.timing == "interleaved":
        results = measure_interleaved(config.methods, workload, ctx, config)
    else:
        results = []
        for method in config.methods:
            with phase(method):  # the phase file names the method a rank was measuring if a signal kills it
                results.append(measure_method(method, workload, ctx, config))
    predictions = _predictions(workload, ctx, config)
    results = [_with_prediction(result, predictions) for result in results]
    if ctx.rank == 0:
        bench = BenchRun(
            model=workload.name or config.model, world_size=ctx.world_size, mesh_shape=tuple(ctx.mesh_shape),
            backend=dist.get_backend(), device=ctx.device.type, steps=config.steps, warmup=config.warmup,
            min_timed_s=config.min_timed_s, turn_steps=config.turn_steps,
            timing=config.timing, timed_alone=config.timed_alone if config.timing == "interleaved" else (),
            batch_shapes={key: tuple(value.shape) for key, value in workload.batch.items()},
            params=sum(p.numel() for p in workload.model.parameters()), machine=machine_info(), versions=versions(),
            command=f"python -m torch.distributed.run --standalone --nproc-per-node {ctx.world_size} "
                    f"-m metadist.bench.harness {' '.join(argv)}",
            methods=tuple(results),
        )
        _write(config.out, bench.to_json())
        for result in results:
            log.info("%s: %s median %s s, loss %s", result.method, result.status, result.median_step_s, result.final_loss)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _predictions(workload: Workload, ctx: RankContext, config: HarnessConfig) -> dict[str, dict]:
    if not config.predict:
        return {}
    try:
        return predict_baselines(workload, ctx)
    except MethodUnavailable as err:
        log.warning("no cost-model estimates of the baselines: %s", err)
        return {}


def _with_prediction(result: MethodResult, predictions: dict[str, dict]) -> MethodResult:
    if result.predicted or result.method not in predictions:
        return result
    from dataclasses import replace

    return replace(result, predicted=predictions[result.method])


def _write(path: str, text: str) -> None:
    from ..files import write_atomically

    write_atomically(path, text)


def main(argv: list[str] | None = None) -> int:
    """One rank; a failure is recorded for ``metadist bench``'s one block (see :func:`metadist.runtime.failure.run_rank`)."""
    from ..runtime.failure import run_rank

    argv = list(sys.argv[1:] if argv is None else argv)
    return run_rank(lambda: run(parse_args(argv), argv), show_phases=False)


if __name__ == "__main__":
    from metadist.runtime.setup import exit_process

    exit_process(main())  # not sys.exit: see exit_process (torch 2.13 gloo can abort at exit)
