"""One rank of ``metadist calibrate`` (launched by torchrun; with :mod:`.op_counts`, the torch code under ``cost``).

Every rank times all-reduce, all-gather, reduce-scatter and all-to-all over each mesh axis's
process groups for several message sizes, up to 32 MiB (gloo on CPU, NCCL with CUDA). On CPU the ranks keep freed
host memory for reuse, as the steps they price do (:mod:`metadist.runtime.host_memory`): otherwise each large
buffer is fresh pages, and a 32 MiB all-to-all between two processes took twice as long. Then every rank, all at
once (as they compute in a training step, sharing the machine's cores), times float32 matmuls
(FLOP/s), a memory-bound elementwise add (bytes/s), a stream of tiny ops (the fixed cost of one
op) and the ops that compute more than they move (exp, tanh, softmax: seconds per element); the
slowest rank's figures are kept. Two figures are measured through the runtime itself
(:func:`_runtime_figures`): a small captured training step (an MLP with AdamW, compiled by
``metadist.compile`` with every rank running the whole step) timed on every rank at once gives the
seconds the runtime spends per node beyond its roofline, and a small all-reduce issued by the
runtime's collectives between two compute phases gives what a collective costs where a step runs
it (the wait for the slower peer included; :class:`_InStepSampler`), and a mix of elementwise ops on a sharded DTensor
against the same ops on its local tensor gives what torch's DTensor adds per op, a tensor-parallel pair of linears on
an axis of all the ranks against the same pair on an axis of one what it adds to each all-reduce tensor parallelism
issues (:func:`_dtensor_collective_seconds`), and a chain of four linear units
under torch's ``fully_shard`` against the same chain unsharded gives what FSDP2 adds per unit
(:func:`_fsdp_unit_seconds`). Last,
the same op mix timed in short bursts and in a
long stretch gives how much slower the ranks compute over a step than in the short timed calls
(:func:`_sustained_slowdown`: ranks sharing cores take turns). Rank 0 writes the measurements as JSON.
Usage: ``python -m torch.distributed.run --standalone --nproc-per-node N -m
metadist.cost.calibrate_worker --mesh 2x2 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..files import write_atomically
from ..runtime.collectives import start_all_gather

logger = logging.getLogger(__name__)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _axis_groups(shape: list[int]) -> list[object]:
    """For each mesh axis, this rank's group along it (every rank creates every group, in order)."""
    rank, mine = dist.get_rank(), []
    world = list(range(dist.get_world_size()))
    for axis in range(len(shape)):
        stride = 1
        for size in shape[axis + 1:]:
            stride *= size
        found = None
        for start in world:
            if (start // stride) % shape[axis] != 0:
                continue
            members = [start + i * stride for i in range(shape[axis])]
            group = dist.new_group(members)
            if rank in members:
                found = group
        mine.append(found)
    return mine


def _group_sizes(world: int, shape: list[int]) -> list[int]:
    """The group sizes an axis of another mesh of ``world`` processes can have that no axis of ``shape`` has: every
    divisor between 1 and ``world``. Their collectives are timed on groups of consecutive ranks, all groups at once,
    as a mesh's axis runs them (``"axis": -1`` in the report, ``"group_size"`` saying which)."""
    return [size for size in range(2, world) if world % size == 0 and size not in shape]


def fsdp_group_sizes(world: int, shape: list[int]) -> list[int]:
    """The group sizes below ``world`` that FSDP2's units are timed on (:func:`_fsdp_unit_seconds`): each axis size of
    ``shape`` and each of :func:`_group_sizes`, above 1."""
    return sorted({size for size in shape if 1 < size < world} | set(_group_sizes(world, shape)))


def _run(op: str, tensor: torch.Tensor, group, size: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(tensor, group=group)
    elif op == "all_gather":  # as the runtime carries it out (an all-to-all on gloo)
        gathered = torch.empty(tensor.numel() * size, dtype=tensor.dtype, device=tensor.device)
        start_all_gather(gathered, tensor, group, size, async_op=False)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty_like(tensor[: tensor.numel() // size]), tensor, group=group)
    else:
        dist.all_to_all_single(torch.empty_like(tensor), tensor, group=group)


LARGE_MESSAGE_BYTES = 1 << 23
"""Messages of this size or more are timed :data:`LARGE_MESSAGE_REPEATS` times, not ``--repeats`` times: a gloo
all-gather of a 32 MiB shard among 4 CPU processes takes a few hundred milliseconds, and its times vary little."""

LARGE_MESSAGE_REPEATS = 5


def _time(op: str, nbytes: int, group, size: int, device: torch.device, repeats: int) -> float:
    tensor = torch.ones(max(size, nbytes // 4 // size * size), dtype=torch.float32, device=device)
    if nbytes >= LARGE_MESSAGE_BYTES:
        repeats = min(repeats, LARGE_MESSAGE_REPEATS)
    for _ in range(2):
        _run(op, tensor, group, size)
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        started = time.perf_counter()
        _run(op, tensor, group, size)
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    seconds = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return float(seconds.item())


def _rate(work: float, run, repeats: int) -> float:
    """``work`` units per second of ``run()``: the median of ``repeats`` timed calls after one warm-up."""
    run()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return work / statistics.median(samples)


NARROW_DTYPES = (torch.bfloat16, torch.float16)
"""Floating dtypes measured besides float32 (a mixed-precision policy computes in them)."""

MATMUL_SIZES = (64, 128, 256, 512)
"""Square matmul widths of the FLOP/s curve: a CPU's bfloat16 kernels run at a quarter of float32's rate at 64 and
three times it at 512, so one figure cannot price both a tiny model and a large one."""

MATMUL_LAYOUTS = ("nt", "tn")
"""The operand layouts measured besides row-major by row-major, for :data:`NARROW_DTYPES` only: a matmul with its
second operand transposed (``nt``, a linear layer's forward) or its first (``tn``, a weight's gradient). On this
project's machine (one thread, 512-wide) bfloat16 ran at 1.3 GFLOP/s row-major, 5.6 ``nt`` and 18 ``tn``, float16 at
1.3, 9.0 and 4.3; float32 at 61-67 in every layout, so its one curve prices them all. Both operands transposed ran
at the row-major rate (1.3-1.4) and is priced on its curve."""

STREAM_ROWS, STREAM_WIDTH = 8, 2048
"""The matmul whose rate prices a pass over a large operand (``matmul_stream_bytes_per_s``): 8 rows against a
2048 x 2048 operand. A CPU's kernels pack the large operand at a rate of their own: on this project's 2-core machine a
float32 ``[8, 4096] @ [4096, 4096]`` ran at 8 GFLOP/s against 70 for a square matmul of the same FLOPs, about 2 GB/s
of the operand's bytes, where the elementwise rate was 21 GB/s."""

ELEMENTWISE_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 23, 1 << 25)
"""Element counts of the elementwise bytes/s curve (a cache-resident add runs several times faster per byte). The
largest (32M elements: three float32 operands of 128 MiB) streams from memory, as a large model's activations,
weights, gradients and optimizer states do during a step; its rate caps every size's (:meth:`~.cluster.Device.
bandwidth_bytes_per_s`). On this project's machine (32 MiB of L3 shared by 2 cores) an add of 1M-element operands ran
at 18-21 GB/s, one of 8M at 10-13 GB/s, where the step's own adds and multiplies on 6-28 MiB tensors ran at 1.4-1.5x
their price from the smaller sizes (version 9 added 8M). Later, 2 processes at once: 8M elements 21-28 GB/s, 32M 15;
an update's ops on GPT-2 small's parameters (0.6-38.6M elements each, read where the pass before left them) 13-15 GB/s
whatever their size, 1.6-1.9x their price when 8M was the largest (version 16 added 32M, with the collectives timed at
32 MiB: priced from 2 MiB, a plan leaning on large all-gathers ran worse than the one before)."""


ELEMENT_OP_SHAPE = (256, 1024)
"""The float32 operands of the ops whose seconds per element are measured (:func:`_element_ops`): 2^18 elements, past
the caches' help (1 MiB an operand) and short enough to time in a few milliseconds."""


def _element_ops(device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Ops whose kernels compute more than they move (transcendental functions, softmax, layer norm and their
    backwards, random draws), by :func:`metadist.cost.compute.op_name`, each a call on :data:`ELEMENT_OP_SHAPE`
    operands of ``dtype``. On this project's machine, a 12-layer GPT-2's step timed op by op (``python -m
    metadist.bench.op_costs examples/gpt_85m.py``) ran its dropout masks (``bernoulli``) at 25x, ``_safe_softmax`` at
    11x and layer norm and its backward at 2.5-2.7x the price of their bytes."""
    aten = torch.ops.aten
    x = torch.randn(*ELEMENT_OP_SHAPE, device=device).to(dtype)
    positive, grad = x.abs() + 0.5, torch.randn_like(x)
    soft, log_soft = torch.softmax(x, -1), torch.log_softmax(x, -1)
    weight, bias = (torch.randn(ELEMENT_OP_SHAPE[1], device=device).to(dtype) for _ in range(2))
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [ELEMENT_OP_SHAPE[1]], weight, bias, 1e-5)
    return {
        "exp": lambda: aten.exp.default(x), "expm1": lambda: aten.expm1.default(x),
        "log": lambda: aten.log.default(positive), "log1p": lambda: aten.log1p.default(positive),
        "sqrt": lambda: aten.sqrt.default(positive), "rsqrt": lambda: aten.rsqrt.default(positive),
        "tanh": lambda: aten.tanh.default(x), "sigmoid": lambda: aten.sigmoid.default(x),
        "erf": lambda: aten.erf.default(x), "sin": lambda: aten.sin.default(x), "cos": lambda: aten.cos.default(x),
        "gelu": lambda: aten.gelu.default(x), "gelu_backward": lambda: aten.gelu_backward.default(grad, x),
        "silu": lambda: aten.silu.default(x), "silu_backward": lambda: aten.silu_backward.default(grad, x),
        "_softmax": lambda: aten._softmax.default(x, -1, False),
        "_log_softmax": lambda: aten._log_softmax.default(x, -1, False),
        "_softmax_backward_data": lambda: aten._softmax_backward_data.default(grad, soft, -1, dtype),
        "_log_softmax_backward_data": lambda: aten._log_softmax_backward_data.default(grad, log_soft, -1, dtype),
        "_safe_softmax": lambda: aten._safe_softmax.default(x, -1),
        "native_layer_norm": lambda: aten.native_layer_norm.default(x, [ELEMENT_OP_SHAPE[1]], weight, bias, 1e-5),
        "native_layer_norm_backward": lambda: aten.native_layer_norm_backward.default(
            grad, x, [ELEMENT_OP_SHAPE[1]], mean, rstd, weight, bias, [True, True, True]),
        "bernoulli": lambda: aten.bernoulli.p(x, 0.9),
        "rand": lambda: aten.rand.default(list(ELEMENT_OP_SHAPE), dtype=dtype, device=device),
        "randn": lambda: aten.randn.default(list(ELEMENT_OP_SHAPE), dtype=dtype, device=device),
    }


RELAYOUT_SHAPE = (1024, 1024)
"""The float32 operand whose transposed copy times a relayout (:data:`metadist.cost.compute.RELAYOUT`): 4 MiB, past
a core's own caches, as the gradient layout copies of Mixtral's experts are (4 MiB each). On this project's machine a
transposed copy ran at 0.7 ns an element at 1 MiB and 0.9-1.2 at 4 MiB, in float32 and bfloat16 alike."""


ELEMENT_BUDGET_S = 0.004
"""Seconds of calls each sample of an op's time fills in float32 (:func:`_element_seconds`)."""

NARROW_ELEMENT_BUDGET_S = 0.002
"""The same in each of :data:`NARROW_DTYPES`."""


def _element_seconds(device: torch.device) -> dict[str, float]:
    """``op_element_s:OP``: seconds per output element of each of :func:`_element_ops` in float32, and in each of
    :data:`NARROW_DTYPES` (``op_element_s:OP@DTYPE``, version 30), and of a relayout (a transposed
    :data:`RELAYOUT_SHAPE` operand copied into a row-major tensor), less the fixed cost of one call (timed on a single
    element), which ``op_overhead_s`` prices. A CPU's kernels of some ops run at other rates in a narrow dtype: on this
    project's machine ``tanh`` (GPT-2's GELU) took 1.46 ns an element in bfloat16 against 0.27 in float32, ``exp``
    0.34 against 0.19, layer norm 0.40 against 0.28."""
    from .compute import RELAYOUT

    one = torch.ones(1, device=device)
    floor = _per_call_seconds(lambda: torch.ops.aten.exp.default(one), device)
    elements = ELEMENT_OP_SHAPE[0] * ELEMENT_OP_SHAPE[1]
    figures: dict[str, float] = {}
    for dtype in (torch.float32, *NARROW_DTYPES):
        narrow = dtype in NARROW_DTYPES
        suffix = f"@{str(dtype).removeprefix('torch.')}" if narrow else ""
        budget_s = NARROW_ELEMENT_BUDGET_S if narrow else ELEMENT_BUDGET_S
        for name, call in _element_ops(device, dtype).items():
            seconds = _per_call_seconds(call, device, budget_s)
            figures[f"op_element_s:{name}{suffix}"] = 1.0 / _net_rate(elements, seconds, floor)
    transposed = torch.randn(*RELAYOUT_SHAPE, device=device).t()
    relayout = _per_call_seconds(lambda: torch.ops.aten.clone.default(transposed, memory_format=torch.contiguous_format),
                                 device)
    figures[f"op_element_s:{RELAYOUT}"] = 1.0 / _net_rate(transposed.numel(), relayout, floor)
    return figures


def _roofline(device: torch.device) -> dict[str, float]:
    """This rank's rates and its fixed seconds per op (run on every rank at once, or by one rank alone where ranks share
    cores: :func:`_roofline_alone`).

    For float32 and each of :data:`NARROW_DTYPES`: the FLOP/s of square matmuls at each of :data:`MATMUL_SIZES`
    (``matmul_curve:DTYPE:FLOPS``, keyed by one matmul's FLOPs) and the bytes/s of an add at each of
    :data:`ELEMENTWISE_SIZES` (``elementwise_curve:DTYPE:BYTES``), both less the fixed cost of one call (timed on
    a single element), which ``op_overhead_s`` prices; the largest size's figures are the dtype's peaks
    (``peak_flops_per_s``, ``memory_bandwidth_bytes_per_s``, with ``_DTYPE`` for the narrow ones); and the bytes/s at
    which a matmul of few rows passes over its large operand (``matmul_stream_bytes_per_s``, :func:`_matmul_stream`);
    for the narrow dtypes, the same matmul figures in each of :data:`MATMUL_LAYOUTS` (``matmul_curve:DTYPE@LAYOUT:FLOPS``,
    ``matmul_stream_bytes_per_s_DTYPE@LAYOUT``); and the seconds per element of the ops that compute more than they move (``op_element_s:OP``,
    :func:`_element_seconds`).
    """
    figures: dict[str, float] = {}
    for dtype in (torch.float32, *NARROW_DTYPES):
        name = str(dtype).removeprefix("torch.")
        suffix = "" if dtype == torch.float32 else f"_{name}"
        for flops, rate in _matmul_curve(device, dtype):
            figures[f"matmul_curve:{name}:{flops}"] = figures[f"peak_flops_per_s{suffix}"] = rate
        for nbytes, rate in _elementwise_curve(device, dtype):
            figures[f"elementwise_curve:{name}:{nbytes}"] = figures[f"memory_bandwidth_bytes_per_s{suffix}"] = rate
        figures[f"matmul_stream_bytes_per_s{suffix}"] = _matmul_stream(device, dtype)
        for layout in MATMUL_LAYOUTS if dtype in NARROW_DTYPES else ():
            for flops, rate in _matmul_curve(device, dtype, layout):
                figures[f"matmul_curve:{name}@{layout}:{flops}"] = rate
            figures[f"matmul_stream_bytes_per_s_{name}@{layout}"] = _matmul_stream(device, dtype, layout)
    chain = _tiny_op_chain(400)  # a GraphModule of aten ops, as a captured step's rank program runs them
    tiny = torch.ones(8, device=device)
    sync = _synchronizer(device)

    def tiny_ops() -> None:
        chain(tiny)
        sync()

    figures["op_overhead_s"] = 1.0 / _rate(400, tiny_ops, 5)
    figures.update(_element_seconds(device))
    return figures


def _synchronizer(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


SETTLE_CALLS = 3
"""Untimed calls of an op before its samples (fewer where they pass ten budgets): the fastest sets how many calls a
sample repeats. The first call alone had set it before; a first call slowed by something passing (the machine's
first launch, its file cache cold: a 64-wide matmul's took milliseconds) left one call a sample, and a few slow
samples the median."""


def _per_call_seconds(call, device: torch.device, budget_s: float = 0.004) -> float:
    """Median seconds of one ``call()`` over 5 samples, each repeating it to fill about ``budget_s`` (the repeats
    set by the fastest of :data:`SETTLE_CALLS` first calls)."""
    sync = _synchronizer(device)
    once, spent = float("inf"), 0.0
    for _ in range(SETTLE_CALLS):
        started = time.perf_counter()
        call()
        sync()
        took = time.perf_counter() - started
        once, spent = min(once, took), spent + took
        if spent > 10 * budget_s:
            break
    once = max(once, 1e-7)
    repeats = max(1, min(1000, int(budget_s / once)))

    def calls() -> None:
        for _ in range(repeats):
            call()
        sync()

    return median_seconds(calls, 5) / repeats


def _net_rate(work: float, seconds: float, floor: float) -> float:
    """``work`` per second of what a call costs beyond the fixed ``floor`` (at least a tenth of the call)."""
    return work / max(seconds - floor, 0.1 * seconds)


def _operand(rows: int, columns: int, device: torch.device, dtype: torch.dtype, transposed: bool,
             lead: tuple[int, ...] = ()) -> torch.Tensor:
    """A ``[*lead, rows, columns]`` operand of random values, row-major, or the transposed view (its last two dims) of
    a row-major one."""
    if transposed:
        return torch.randn(*lead, columns, rows, device=device).to(dtype).transpose(-1, -2)
    return torch.randn(*lead, rows, columns, device=device).to(dtype)


def _matmul_curve(device: torch.device, dtype: torch.dtype, layout: str = "") -> list[tuple[int, float]]:
    """(FLOPs of one matmul, FLOP/s) at each of :data:`MATMUL_SIZES`, up to the first that takes over 50 ms (a CPU
    without float16 kernels runs them at a few GFLOP/s); ``layout`` ``"nt"`` or ``"tn"``: the second or the first
    operand a transposed view (:data:`MATMUL_LAYOUTS`)."""
    def operands(n: int):
        return (_operand(n, n, device, dtype, layout == "tn"), _operand(n, n, device, dtype, layout == "nt"))

    a, b = operands(1)
    floor = _per_call_seconds(lambda: torch.mm(a, b), device)
    curve = []
    for n in MATMUL_SIZES:
        a, b = operands(n)
        seconds = _per_call_seconds(lambda: torch.mm(a, b), device)
        curve.append((2 * n**3, _net_rate(2 * n**3, seconds, floor)))
        if _any_rank(seconds > 0.05, device):  # every rank stops at the same size: their figures are reduced key by key
            break
    return curve


_MEASURING_ALONE = False
"""True while one rank measures its compute figures alone (:func:`_roofline_alone`): :func:`_any_rank` then answers
for this rank without a collective, the others waiting for its figures."""


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank (every rank calls this at the same point; this rank's own ``flag`` while it
    measures alone)."""
    if _MEASURING_ALONE:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _matmul_stream(device: torch.device, dtype: torch.dtype, layout: str = "") -> float:
    """Bytes/s of the large operand of a :data:`STREAM_ROWS`-row matmul (:data:`STREAM_WIDTH` wide): the least time
    any matmul takes per byte of its larger operand, whatever its FLOPs (a skinny matmul's price); ``layout`` as in
    :func:`_matmul_curve`."""
    a = _operand(STREAM_ROWS, STREAM_WIDTH, device, dtype, layout == "tn")
    b = _operand(STREAM_WIDTH, STREAM_WIDTH, device, dtype, layout == "nt")
    return b.numel() * b.element_size() / _per_call_seconds(lambda: torch.mm(a, b), device)


def _elementwise_curve(device: torch.device, dtype: torch.dtype) -> list[tuple[int, float]]:
    """(bytes one add moves, bytes/s) at each of :data:`ELEMENTWISE_SIZES`: two reads and one write per element."""
    def operands(count: int):
        x, y = torch.randn(count, device=device).to(dtype), torch.randn(count, device=device).to(dtype)
        return x, y, torch.empty_like(x)

    x, y, out = operands(1)
    floor = _per_call_seconds(lambda: torch.add(x, y, out=out), device)
    curve = []
    for count in ELEMENTWISE_SIZES:
        x, y, out = operands(count)
        nbytes = 3 * count * x.element_size()
        curve.append((nbytes, _net_rate(nbytes, _per_call_seconds(lambda: torch.add(x, y, out=out), device), floor)))
    return curve


def _roofline_alone(device: torch.device) -> dict[str, float]:
    """:func:`_roofline`'s figures measured by rank 0 alone while the other ranks wait, given to every rank: where
    ranks share cores (version 23).

    Timed with every rank at once, each figure's short calls ran alone on a core or waited their turn, by chance, and
    the sustained slowdown applied on top counted the sharing twice for the figures whose calls had waited: on 4
    processes sharing this project's 2 cores, the raw figures came to 0.14-2.75x one process's alone, and the
    calibration priced MetaDist's plans' compute at 2.6-3.5x their one-process price, where each rank's program ran
    2.0-2.6x its time alone with every rank computing at once (``python -m metadist.bench.rank_compute``). Alone, each
    figure is a rank's on a free core, and the sharing is applied once, by the slowdown (as for the runtime's two
    calibration steps since version 11). The waiting ranks block in the broadcast that hands them the figures."""
    global _MEASURING_ALONE
    figures = None
    if dist.get_rank() == 0:
        _MEASURING_ALONE = True
        try:
            figures = _roofline(device)
        finally:
            _MEASURING_ALONE = False
    box = [figures]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _tiny_op_chain(length: int) -> torch.nn.Module:
    """A ``torch.fx`` GraphModule of ``length`` dependent aten ops on its input (each op's fixed cost dominates)."""
    import torch.fx

    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    for index in range(length):
        op = (torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor)[index % 2]
        value = graph.call_function(op, (value, value))
    graph.output(value)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _slowest(figures: dict[str, float], device: torch.device) -> dict[str, float]:
    """Every rank's figures -> the slowest rank's (lowest rates, highest overhead)."""
    keys = sorted(figures)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    if any(other != keys for other in every):  # a reduction of lists of other lengths would abort the processes
        differing = sorted(set().union(*map(set, every)) - set.intersection(*map(set, every)))
        raise RuntimeError(f"internal: the calibration's ranks measured different figures ({', '.join(differing)})")
    sign = [1.0 if slower_when_larger(key) else -1.0 for key in keys]
    values = torch.tensor([s * figures[key] for s, key in zip(sign, keys)], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {key: s * value for s, key, value in zip(sign, keys, values.tolist())}


_SECONDS = frozenset({"op_overhead_s", "captured_step_s", "captured_roofline_s", "eager_step_s", "in_step_collective_s",
                      "compute_phase_s", "in_step_collective_short_s", "compute_phase_short_s",
                      "in_step_collective_long_s", "compute_phase_long_s", "sustained_slowdown", "core_sharing",
                      "dtensor_op_s", "dtensor_module_op_s", "dtensor_collective_s"})
"""Figures that are times or slowdowns (the slowest rank has the largest), with every key of :data:`_SECONDS_PREFIXES`;
the others are rates (the smallest). Up to version 27 ``captured_roofline_s`` was taken for a rate; every rank computes
it from the same (already reduced) rates, so the figure kept was the same."""

_SECONDS_PREFIXES = ("op_element_s:", "in_step_collective_s:", "in_step_collective_short_s:",
                     "in_step_collective_long_s:", "fsdp_unit_s:")
"""Prefixes of families of figures in seconds (per op, size or variant)."""


def slower_when_larger(key: str) -> bool:
    """Whether the device figure ``key`` is a time or a slowdown (the slowest rank's is its largest), not a rate (the
    slowest rank's is its smallest): what :func:`_slowest` keeps. Up to version 25 the FSDP2 unit figures
    (``fsdp_unit_s:``) were taken for rates, and the calibration kept the fastest rank's."""
    return key in _SECONDS or key.startswith(_SECONDS_PREFIXES)


SUSTAINED_BURST_ITERATIONS = 20
"""Iterations of :func:`_sustained_slowdown`'s op mix in one short timed burst (~0.5 ms on this project's machine),
as the other figures are timed."""
SUSTAINED_ITERATIONS = 6000
"""Iterations of the same mix in one long stretch (~150 ms alone), as a training step computes."""
SUSTAINED_STRETCHES = 5
"""Long stretches :func:`_sustained_slowdown` times; the fastest is kept (:func:`_slowdown_of`)."""


def _slowdown_of(bursts: list[float], stretches: list[float]) -> float:
    """The sustained slowdown from per-iteration times: the fastest long stretch's over the median burst's.

    The machine's other work only ever slows a stretch down, and a stretch of ~150 ms is long enough to meet it: of
    the median of 3 stretches, the 2-process calibration before one 12-layer GPT's bench entry measured 1.61 where the
    calibrations around it measured 0.9-1.06, and the entry's compute was priced 60 % above what it ran. The ranks' own
    sharing of the cores slows every stretch alike (4 processes on 2 cores: 1.5-1.9 in each), so the least of several
    stretches keeps it and drops what happened to run beside them."""
    if not bursts or not stretches:
        raise ValueError("the sustained slowdown needs at least one burst and one stretch")
    return min(stretches) / statistics.median(bursts)


def _sustained_slowdown(repeats: int = 15) -> float:
    """How much slower this rank computes over a long stretch than in the short timed calls the other figures come
    from, every rank computing at once (a CPU figure).

    Ranks that share cores are each given them in turns by the scheduler. A call of a millisecond or less often runs
    within one turn, so the medians of short calls measure a rank alone on a core; a step of tens of milliseconds
    shares its cores all along. On this project's 2-core machine 4 ranks computed 1.55-1.70x slower per iteration
    over 4,000 iterations than in bursts of 20 (a calibration, over 6,000: 1.88x), where 2 ranks computed 0.90-0.94x
    (warm caches). The ratio of the two per-iteration times (:func:`_slowdown_of`) is reported as measured;
    :func:`metadist.cost.calibrate.sustained_slowdown` takes it at least 1 and scales the rates and per-op seconds by it.
    """
    x = torch.randn(64, 64)

    def mix(iterations: int) -> None:
        y = x
        for _ in range(iterations):
            y = torch.tanh(y @ x) * 0.5

    def timed(iterations: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        mix(iterations)
        return (time.perf_counter() - started) / iterations

    mix(SUSTAINED_BURST_ITERATIONS)
    bursts = [timed(SUSTAINED_BURST_ITERATIONS) for _ in range(repeats)]
    return _slowdown_of(bursts, [timed(SUSTAINED_ITERATIONS) for _ in range(SUSTAINED_STRETCHES)])


def core_sharing() -> float:
    """The compute threads of this host's ranks per core they may run on (``LOCAL_WORLD_SIZE`` ranks of
    ``torch.get_num_threads()`` threads each; a CPU figure): above 1, the ranks cannot all compute at once, and a step
    in which every rank computes takes at least that many times as long as one rank alone.

    The sustained slowdown measures the same sharing, but from short bursts timed with every rank at once: a burst of
    one of 4 ranks on 2 cores ran alone on a core or waited its turn, so their median mixed both and the ratio came
    out at 1.55-1.88 on this project's 2-core machine, where an eager DDP step of gpt2-tiny (no collective) took 2.2x
    as long with all 4 ranks computing as alone; :func:`metadist.cost.calibrate.sustained_slowdown` takes the larger.
    """
    import os

    from ..config import usable_cores

    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * torch.get_num_threads() / max(usable_cores(), 1)


class _CalibrationMLP(torch.nn.Module):
    """Two hidden layers with a norm and a GELU: the op mix of a transformer block's forward and backward."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first = torch.nn.Linear(32, width)
        self.norm = torch.nn.LayerNorm(width)
        self.second = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.norm(self.first(x)))
        return self.head(torch.nn.functional.gelu(self.second(hidden)))


def _calibration_step(model, optimizer, batch):
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def median_seconds(run, repeats: int, clock=time.perf_counter) -> float:
    """The median of ``repeats`` calls of ``run()`` as ``clock`` times them: wall time, or with ``time.thread_time``
    the calling thread's CPU time (a wait for a peer adds none, nor the work a backend's own threads do: gloo carries
    out its collectives on them)."""
    samples = []
    for _ in range(repeats):
        started = clock()
        run()
        samples.append(clock() - started)
    return statistics.median(samples)


def _runtime_figures(roofline: dict[str, float], repeats: int = 15) -> dict[str, float]:
    """The runtime's own costs on this rank (every rank runs this at once).

    - ``captured_step_s``, ``captured_nodes``, ``captured_roofline_s``: a small training step compiled by
      ``metadist.compile`` (every rank runs the whole step, no collective), its node count and the sum of its
      nodes' rooflines at this rank's measured rates; what the step takes beyond the rooflines is the runtime's
      fixed cost of its nodes (dispatch, dtype casts of scalar operands, copies into the capture's layouts).
      ``eager_step_s``: the same step run eagerly by torch (fused optimizer kernels, Python-float scalars), what
      a baseline that runs the model itself (torch DDP, FSDP) pays for the same nodes. Both are timed one rank at
      a time while the others wait: a step of 1-4 ms is about a scheduler turn, so timed with every rank computing
      a sample's time depended on whether it was descheduled (on 4 ranks sharing 2 cores, three calibrations in a
      row put MetaDist's runtime at 13.0, 10.9 and 23.5 us a node, one in the bench 76), and the sustained slowdown
      was then applied on top of samples that had already seen the contention. Alone, the figures are a rank's on a
      free core, as the other short calls' are, and the contention is applied once, by the slowdown.
    - ``dtensor_op_s``: what an op on a sharded DTensor costs beyond the same op on a plain tensor
      (:func:`_dtensor_op_seconds`), which torch's FSDP2 and tensor parallelism pay per op on their DTensor parameters.
    - ``dtensor_module_op_s``: what an op of a tensor-parallel linear's forward and backward costs beyond the same
      linear on plain tensors (:func:`_dtensor_module_op_seconds`).
    - ``dtensor_collective_s``: what an all-reduce torch's tensor parallelism issues through DTensor costs the
      calling thread beyond the same all-reduce issued plainly (:func:`_dtensor_collective_seconds`; 0 on one
      process).
    """
    import metadist
    from metadist.ir import Mesh
    from metadist.solver.estimate import node_compute_s

    from .cluster import Cluster, Device, Link

    torch.manual_seed(0)
    model = _CalibrationMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    world = dist.get_world_size()
    step = metadist.compile(_calibration_step, mesh=(world,), plan="replicate")
    for _ in range(3):
        step(model, optimizer, batch)
    graph, plan = step.torch_step.graph, step.plan
    mesh = Mesh((world,))
    device = Device(peak_flops_per_s=roofline["peak_flops_per_s"], memory_bandwidth_bytes_per_s=roofline["memory_bandwidth_bytes_per_s"],
                    memory_capacity_bytes=1.0, op_overhead_s=0.0)
    cluster = Cluster(mesh=mesh, device=device, axis_links=(Link(bandwidth_bytes_per_s=1e9, latency_s=0.0),))
    roofline_s = sum(node_compute_s(graph, name, strategy, cluster) for name, strategy in plan.node_strategies.items())

    torch.manual_seed(0)
    eager_model = _CalibrationMLP()  # the same initial weights (the compiled step's model now holds DTensors)
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    for _ in range(3):
        _calibration_step(eager_model, eager_optimizer, batch)
    captured, eager = [], []
    for turn in range(world):  # one rank at a time: see the docstring
        dist.barrier()
        if dist.get_rank() != turn:
            continue
        for _ in range(2 * repeats):  # interleaved, so that a change of the machine's load hits both alike
            captured.append(median_seconds(lambda: step(model, optimizer, batch), 1))
            eager.append(median_seconds(lambda: _calibration_step(eager_model, eager_optimizer, batch), 1))
    dist.barrier()
    step_s, eager_s = statistics.median(captured), statistics.median(eager)
    figures = {"captured_step_s": step_s, "captured_nodes": float(len(graph.nodes)), "captured_roofline_s": roofline_s,
               "eager_step_s": eager_s, "sustained_slowdown": _sustained_slowdown(), "core_sharing": core_sharing(),
               "dtensor_op_s": _dtensor_op_seconds(_world_mesh(world), repeats),
               "dtensor_module_op_s": _dtensor_module_op_seconds(world, repeats),
               "dtensor_collective_s": _dtensor_collective_seconds(world, repeats)}
    return figures


IN_STEP_REPEATS = 15
"""Samples of each in-step figure a round (a third as many for the long phase, :func:`_in_step_phases`)."""


class _InStepSampler:
    """``compute_phase_s``, ``in_step_collective_s`` and their ``_short`` twins (and ``_long`` where the ranks do not
    share cores, :func:`_in_step_phases`) among all the processes, and ``in_step_collective_s:SIZE`` and its twins
    between groups of each smaller size (all groups at once): of samples taken in rounds over every figure in turn
    (:meth:`round`), which the worker runs at three points of its work (version 33; three back to back at its end
    before), so that a figure's samples span the whole calibration, not one stretch of it; the waits' mean
    (:func:`expected_wait`), the phases' median (:meth:`figures`).

    On 4 processes sharing 2 cores, a pair's figure timed in one stretch moved 2x between three stretches of one
    launch (after the short phase 0.9, 1.9 and 1.6 ms; after the long one 4.1, 6.5 and 7.4): which processes share a
    core changes as the scheduler moves them, and a step meets every such turn. On 2 processes, with the three rounds
    back to back, the wait after the 2 ms phase came to 1.45, 1.30 and 0.48 ms in three calibrations a minute apart
    (each the mean of 45 samples): how often other work takes a core from one of the processes changes over seconds.
    Spread over the run, three more gave 1.50, 1.34 and 0.65: the machine's own drift, which no statistic of one
    calibration's samples removes."""

    def __init__(self, world: int, repeats: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from metadist.runtime.collectives import Collectives

        self.timed = [(Collectives.from_device_mesh(_world_mesh(world)), 0, "")]
        self.timed += [(Collectives.from_device_mesh(init_device_mesh("cpu", (world // size, size))), 1, f":{size}")
                       for size in _group_sizes(world, [world])]
        # every rank times the same phases, whatever its host's cores
        self.phases = _in_step_phases(_any_rank(core_sharing() > 1, torch.device("cpu")), repeats)
        self.samples: dict[str, list[float]] = {}

    def round(self) -> None:
        """One round: each figure's samples of this round, every figure in turn (every rank at once)."""
        for comm, axis, group in self.timed:
            for ops, phase, count in self.phases:
                alone, extra = _in_step_collective(comm, axis, count, ops)
                self.samples.setdefault(f"in_step_collective{phase}_s{group}", []).extend(extra)
                if not group:
                    self.samples.setdefault(f"compute_phase{phase}_s", []).extend(alone)

    def figures(self) -> dict[str, float]:
        if not self.samples:
            raise RuntimeError("_InStepSampler.figures before any round")
        return {key: max((expected_wait if key.startswith("in_step_collective") else statistics.median)(values), 0.0)
                for key, values in self.samples.items()}


WAIT_TRIM = 0.05
"""Share of the largest samples :func:`expected_wait` leaves out, rounded up (a hiccup of the machine that a step's
median leaves out too)."""


def expected_wait(samples: list[float]) -> float:
    """What one in-step call waits on average: the mean of ``samples`` less their largest :data:`WAIT_TRIM` (version
    33; the median before). A step pays the sum of its calls' waits, and that sum goes by their mean. The same holds
    for FSDP2's small units (:func:`_fsdp_unit_seconds`), whose chain steps were bimodal too (2 processes, 256 KiB:
    ZeRO-2 steps of 8.5-9.8 ms or 12-20, the median's figure 2.2-3.9 ms a unit over three probes, the mean's
    2.5-3.6).

    Where every rank has a core, the waits are bimodal: on this project's 2-core machine (2 processes, a 2 ms phase)
    about two thirds of the samples took 0.2-0.6 ms and the rest 2-5 ms, a scheduler tick of another process taking the
    partner's core. Their median fell in either mode by chance: two calibrations a few seconds apart priced the wait
    at 0.98 and 0.36 ms, and two bench pages priced a 12-layer GPT plan's ~110 calls at 272 and 174 ms. In two probes
    of 45 samples the median was 0.44 and 0.51 ms, the mean 1.59 and 1.55. Where ranks share cores (4 processes) the
    waits spread over one broad mode, the mean 1.1-1.3x the median."""
    if not samples:
        raise ValueError("expected_wait needs at least one sample")
    left_out = min(math.ceil(len(samples) * WAIT_TRIM), len(samples) - 1)
    return statistics.fmean(sorted(samples)[:len(samples) - left_out])


DTENSOR_OPS = 8
"""Ops per pass of :func:`_dtensor_op_seconds`'s mix."""


def _dtensor_op_seconds(mesh, repeats: int) -> float:
    """Seconds one elementwise op on a sharded DTensor takes beyond the same op on its local tensor, timed one rank at
    a time as ``eager_step_s`` is (a CPU figure): what torch's FSDP2 and tensor parallelism pay per op they run on
    DTensor parameters (sharding propagation and dispatch in Python, for an op that moves a few bytes). The mix is an
    eager optimizer's in place and out of place ops; on this project's 2-core machine about 14 us for an ``add``
    and 45 for a ``mul_``, against 2-5 on the local tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    whole = torch.rand(256 * world) + 0.5
    pieces = [distribute_tensor(whole.clone(), mesh, [Shard(0)]) for _ in range(3)]
    locals_ = [piece.to_local().clone() for piece in pieces]

    def mix(x, y, z) -> None:  # DTENSOR_OPS ops, the kinds an eager AdamW step issues per parameter
        x.mul_(0.999)
        x.lerp_(y, 0.1)
        z.mul_(0.999)
        z.addcmul_(y, y, value=0.001)
        denominator = z.sqrt()
        denominator = denominator.div(1.0)
        denominator.add_(1e-8)
        x.addcdiv_(y, denominator, value=-1e-6)

    return _extra_seconds_alone(lambda: mix(*pieces), lambda: mix(*locals_), repeats) / DTENSOR_OPS


def _extra_seconds_alone(costly, plain, repeats: int) -> float:
    """What a call of ``costly()`` takes beyond one of ``plain()`` (0 at least): the difference of their medians,
    each called ``2 * repeats`` times, interleaved, after three untimed calls, timed one rank at a time as the eager
    step is (the slowdown prices the sharing once). Every rank calls it (it holds barriers)."""
    for _ in range(3):
        costly()
        plain()
    with_cost, without = [], []
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if dist.get_rank() != turn:
            continue
        for _ in range(2 * repeats):  # interleaved, so that a change of the machine's load hits both alike
            with_cost.append(median_seconds(costly, 1))
            without.append(median_seconds(plain, 1))
    dist.barrier()
    return max(statistics.median(with_cost) - statistics.median(without), 0.0)


TP_PAIR_WIDTH = 32
"""Width of :func:`_dtensor_module_op_seconds`'s pair of parallel linears (the inner one 4x as wide, as an MLP's)."""

TP_PAIR_INPUT = (2, 8)
"""Batch and sequence of the pair's input (a model's hidden states, as its parallel modules take them)."""


def _dtensor_module_op_seconds(world: int, repeats: int) -> float:
    """Seconds one op of a tensor-parallel module's forward and backward costs beyond the same module on plain tensors:
    a column-wise linear and a row-wise one after it (torch's ``parallelize_module``, as an MLP's pair), run forward and
    backward on a mesh axis of one rank, against the same two linears unsharded, over the ops the pair runs
    (:func:`.op_counts.module_ops`, as torch's TP is counted on a model). Timed one rank at a time, as
    ``dtensor_op_s`` is. Such an op (a linear's matmul, its input wrapped and its output unwrapped, the backward's
    redistributions) costs more than an optimizer's elementwise op on a DTensor: on this project's 2-core machine,
    llama-tiny's and gpt2-tiny's parallel modules ran 41 us an op beyond their plain step on a 1x1 mesh, where
    ``dtensor_op_s`` was 12. The collectives a wider axis adds are priced as calls, and what DTensor adds to each by
    :func:`_dtensor_collective_seconds`, not here."""
    from torch.distributed.device_mesh import init_device_mesh

    from .op_counts import module_ops

    plain, plain_step = _tp_pair(None)
    _, parallel_step = _tp_pair(init_device_mesh("cpu", (world, 1), mesh_dim_names=("ranks", "tp"))["tp"])
    ops = module_ops(plain[0], (*TP_PAIR_INPUT, TP_PAIR_WIDTH), torch.float32, True) + \
        module_ops(plain[2], (*TP_PAIR_INPUT, 4 * TP_PAIR_WIDTH), torch.float32, True)
    return _extra_seconds_alone(parallel_step, plain_step, repeats) / ops


def _tp_pair(mesh):
    """:func:`_dtensor_module_op_seconds`'s pair of linears (column-wise, then row-wise) over ``mesh`` (None: plain),
    and its forward and backward on an input that needs its gradient, as a step leaves the parameters' gradients."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    pair = nn.Sequential(nn.Linear(TP_PAIR_WIDTH, 4 * TP_PAIR_WIDTH), nn.ReLU(), nn.Linear(4 * TP_PAIR_WIDTH, TP_PAIR_WIDTH))
    if mesh is not None:
        pair = parallelize_module(pair, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(*TP_PAIR_INPUT, TP_PAIR_WIDTH, requires_grad=True)

    def forward_backward() -> None:
        for p in pair.parameters():
            p.grad = None  # as a training step's zero_grad leaves them
        x.grad = None
        pair(x).sum().backward()

    return pair, forward_backward


TP_PAIR_CALLS = 2
"""All-reduces of the pair's forward and backward on an axis of more than one rank: the row-wise linear's output and
the column-wise linear's input gradient."""


def _dtensor_collective_seconds(world: int, repeats: int) -> float:
    """CPU seconds one all-reduce that torch's tensor parallelism issues through DTensor (a redistribution from
    partial to replicated values: a functional collective, its wait and the tensors wrapped around it) costs the
    calling thread beyond the same all-reduce issued with ``dist.all_reduce``, whose cost the link's fitted price
    holds. :func:`_tp_pair` on an axis of all the processes, against the same pair on an axis of one and two plain
    all-reduces of the pair's activations over all the processes, per call (:data:`TP_PAIR_CALLS`); each run
    ``2 * repeats`` times, interleaved, after three untimed ones, the medians' difference.

    Timed on every rank at once (the calls need them all), as the calling thread's CPU time, which a wait adds nothing
    to. On this project's 2-core machine such a call took 310-400 us of the thread beyond the pair on one rank and a
    plain all-reduce's 27-70 us (2 and 4 processes, the pair 64 wide): not priced before version 34, when torch's TP
    rows on 4 processes measured 1.27-1.43x their price on one page. 0 on one process."""
    if world == 1:
        return 0.0
    from torch.distributed.device_mesh import init_device_mesh

    _, spread = _tp_pair(init_device_mesh("cpu", (1, world), mesh_dim_names=("ranks", "tp"))["tp"])
    _, alone = _tp_pair(init_device_mesh("cpu", (world, 1), mesh_dim_names=("ranks", "tp"))["tp"])
    activations = torch.zeros(*TP_PAIR_INPUT, TP_PAIR_WIDTH)  # zeros: summed over and over, they stay finite

    def plain() -> None:
        for _ in range(TP_PAIR_CALLS):
            dist.all_reduce(activations)

    runs = (spread, alone, plain)
    for _ in range(3):
        for run in runs:
            run()
    samples: tuple[list[float], ...] = ([], [], [])
    for _ in range(2 * repeats):  # interleaved, so that a change of the machine's load hits all three alike
        for run, taken in zip(runs, samples):
            taken.append(median_seconds(run, 1, clock=time.thread_time))
    spread_s, alone_s, plain_s = (statistics.median(taken) for taken in samples)
    return max(spread_s - alone_s - plain_s, 0.0) / TP_PAIR_CALLS


FSDP_UNIT_BYTES = (1 << 18, 1 << 25)
"""About the float32 units whose FSDP2 calls :func:`_fsdp_unit_seconds` times (256 KiB and 32 MiB; the nearest square
widths the ranks divide): a tiny model's blocks and a 124M-parameter GPT's (28 MiB) are priced through the line these
two points give. Timed at 256 KiB and 16 MiB, a 28 MiB unit's cost fell 10 % short of what it measured."""


FSDP_UNITS = 4
"""Units in the chain :func:`_fsdp_unit_seconds` times: FSDP2 overlaps a unit's all-gather with the unit before it."""

FSDP_ROWS = 32
"""Rows of the input each unit's square matmul multiplies."""

FSDP_REPEATS = 15
"""Timed steps of each variant of the small units' chain (:func:`_fsdp_unit_seconds`)."""

FSDP_LARGE_BYTES = 1 << 22
"""Units of at least this many bytes are timed as large ones (:data:`FSDP_LARGE_WARMUP_ROUNDS`,
:data:`FSDP_LARGE_ROUNDS`): their chain takes ~0.4 s a turn on 2 processes, ~1 s on 4."""

FSDP_LARGE_WARMUP_ROUNDS = 2
"""Untimed rounds of the large units' chains (each variant in turn) before the timed ones (version 30; one step of
each variant after the other before)."""

FSDP_LARGE_ROUNDS = 4
"""Timed rounds of the large units' chains, of which the fastest step of each variant is kept (version 30): a step
whose process grows its heap takes a page fault for every fresh page, which a training step past its first turns does
not. On 2 processes of this project's machine, 32 MiB units, the first 3 rounds of a fresh process after one step of
each variant: 8,000-41,000 page faults in 5 of 12 steps of FSDP2, each of them 1.4-2.6x the others (ZeRO-2 370-410 ms a
chain without faults, 610-750 with; ZeRO-3 490-550 against 685-1,355). Their median priced ZeRO-2's unit above
ZeRO-3's in 2 of 4 such calibrations (129 and 137 ms against 119 and 113), and a page's gpt-85m ZeRO-2 row at 2x what
it ran (3,548 ms predicted, 1,763 measured), where ZeRO-3 does what ZeRO-2 does and gathers each unit once more."""


def _fsdp_chain(width: int) -> torch.nn.Module:
    """:data:`FSDP_UNITS` units, each a bias-free ``width`` x ``width`` linear layer and a ReLU, as a model's blocks."""
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.ReLU())
                                 for _ in range(FSDP_UNITS)))


def _fsdp_unit_seconds(size: int, repeats: int) -> dict[str, float]:
    """Seconds torch's FSDP2 adds to a forward and backward per unit of each size in :data:`FSDP_UNIT_BYTES`, with
    its parameters kept gathered from forward to backward (``fsdp_unit_s:zero2:BYTES``) and gathered again for the
    backward (``fsdp_unit_s:zero3:BYTES``): a chain of :data:`FSDP_UNITS` linear units sharded by ``fully_shard`` (per
    unit and at a root without parameters, as a model's blocks are) less the same chain unsharded, every rank at once,
    over the units. ``size``: the ranks each chain is sharded over, all of them or groups of ``size`` consecutive
    ranks, every group at once (keys ``fsdp_unit_s:VARIANT:BYTES:SIZE``; version 27), as FSDP2 runs over one axis of
    a 2-D mesh under tensor parallelism. Each size's chains take turns, a step each, ``repeats`` rounds: the mean of
    each chain's steps less the slowest is kept (:func:`expected_wait`, version 33; their median before); from
    :data:`FSDP_LARGE_BYTES` on, the fastest of :data:`FSDP_LARGE_ROUNDS` (version 30).

    That is FSDP2 as it runs on this backend inside a step, not its collectives alone: the all-gather's copy-in into a
    fresh flat buffer and copy-out into the unsharded parameters, overlapped with the unit before; the reduce-scatter's
    copy-in (``chunk_cat``); gloo's reduce-scatter (an all-reduce of a copy of the whole input), blocking; the division
    of the gradients; FSDP2's hooks. On this project's 2-core machine (2 processes) a GPT block's 28 MiB unit took
    ~90 ms of such calls in a step, where the link's all-gather and all-reduce of its bytes were priced at ~40.

    The worker times them first, before anything else it measures (version 26). Timed where they were before, after
    the rest of the device figures, the same function gave a 256 KiB unit 8.4-8.5 ms (ZeRO-2; a launch and two
    probes) where it gave 10.9-12.5 at the start of a process (seven probes; 4 processes on this project's 2 cores,
    the same hour), and the benchmark's FSDP2 rows ran at the fresh figure: the small models' ZeRO-2 and ZeRO-3 rows
    measured 1.15-1.71x their price on every page with the late one, mlp's at ~12.6 ms a unit. What in the earlier
    measurements speeds the later FSDP2 steps up was not found (not the compiled step, the DTensor ops, the sustained
    stretches, the collector, nor the heap alone)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if size == world:
        mesh, suffix = _world_mesh(world), ""
    else:
        mesh = init_device_mesh("cpu", (world // size, size), mesh_dim_names=("groups", "members"))["members"]
        suffix = f":{size}"
    figures = {}
    for nbytes in FSDP_UNIT_BYTES:
        width = max(size, int((nbytes // 4) ** 0.5) // size * size)
        x = torch.rand(FSDP_ROWS, width)
        torch.manual_seed(0)
        runs = {"plain": _fsdp_chain(width)}
        for variant, reshard in (("zero2", False), ("zero3", True)):
            model = _fsdp_chain(width)
            for unit in model:
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
            runs[variant] = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

        def step(model) -> None:
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)

        large = nbytes >= FSDP_LARGE_BYTES
        if large:  # in rounds, as they are timed: the heap grows as the variants' steps take turns
            for _ in range(FSDP_LARGE_WARMUP_ROUNDS):
                for model in runs.values():
                    step(model)
        else:
            for model in runs.values():
                for _ in range(2):
                    step(model)
        samples: dict[str, list[float]] = {name: [] for name in runs}
        # interleaved, so that a change of the machine's load hits every variant alike
        for _ in range(FSDP_LARGE_ROUNDS if large else repeats):
            for name, model in runs.items():
                dist.barrier()
                samples[name].append(median_seconds(lambda: step(model), 1))
        kept = min if large else expected_wait  # see FSDP_LARGE_ROUNDS
        plain = kept(samples["plain"])
        for variant in ("zero2", "zero3"):
            extra = max(kept(samples[variant]) - plain, 0.0) / FSDP_UNITS
            figures[f"fsdp_unit_s:{variant}:{width * width * 4}{suffix}"] = extra
    return figures


IN_STEP_PHASE_OPS = 1200
"""Tiny ops in the compute phase before the in-step all-reduce (:func:`_in_step_collective`): about 3 ms, a scheduler
turn, on this project's machine. In a step the other ranks are computing while a collective runs, and on processes
that share cores the ranks of a collective then wait for a turn on a core: on 4 gloo processes sharing 2 cores a
4 KiB all-gather between 2 of them cost 0.46 ms after a phase of 0.25 ms (every rank soon idle), 1.3 after 1 ms and
2.0 after 3 ms; an all-reduce among the 4, 4.1, 6.0 and 6.4 ms. The 100-op phase of version 16 and before (0.27 ms)
priced a 2x2 plan's four calls between pairs at 0.6 ms each, and the plan that made them ran x1.46 of DDP's one. On 2
processes the figure is the same after either phase (0.3-0.5 ms)."""


IN_STEP_SHORT_PHASE_OPS = 100
"""Tiny ops in the short compute phase (about 0.27 ms): the in-step all-reduce timed after it too
(``in_step_collective_short_s``) is the wait of a call that follows another soon (version 18,
:attr:`.cluster.Link.sync_by_gap`)."""

IN_STEP_LONG_PHASE_OPS = 4000
"""Tiny ops in the long compute phase (about 9 ms), timed only where every rank has a core of its own
(:func:`core_sharing` at most 1): the in-step all-reduce after it (``in_step_collective_long_s``) is the wait of a call
that follows a stretch of a model's compute (version 21). On 2 gloo processes of this project's 2-core machine the
wait's median was 0.31 ms after 0.24 ms of compute, 0.45 after 2.7, 1.18 after 8.8 and 1.32 after 26: the processes
drift apart the longer they compute, as the machine's other work takes a core from one of them for a while. A
12-layer GPT's plan on those 2 processes (74 calls, 5-40 ms of compute before each) was blocked 2.5 ms a call on
average, about 1.5 ms beyond its call's price. Where ranks share cores the scheduler's turns bound the drift instead
(4 processes on 2 cores: a step of mixtral-mini with 14 calls ran 76 ms in all, where this figure came to 23 ms a
call), and the long phase is not timed."""


def _in_step_phases(shared: bool, repeats: int) -> tuple[tuple[int, str, int], ...]:
    """(tiny ops, figure suffix, samples a round) of each compute phase the in-step all-reduce is timed after: the
    long one (:data:`IN_STEP_LONG_PHASE_OPS`, a third of the samples) only where no rank ``shared`` its cores
    (:func:`core_sharing` over 1 on some host)."""
    phases = ((IN_STEP_PHASE_OPS, "", repeats), (IN_STEP_SHORT_PHASE_OPS, "_short", repeats))
    return phases + (((IN_STEP_LONG_PHASE_OPS, "_long", max(3, repeats // 3)),) if not shared else ())


def _in_step_collective(comm, axis: int, repeats: int, ops: int = IN_STEP_PHASE_OPS) -> tuple[list[float], list[float]]:
    """``repeats`` samples of (a phase of ``ops`` tiny ops alone, what a 4 KiB all-reduce on ``axis`` of ``comm`` adds
    after it)."""
    phase = _tiny_op_chain(ops)
    tiny, small = torch.ones(8), torch.ones(1024)

    def computing() -> None:
        phase(tiny)

    def computing_then_reducing() -> None:
        phase(tiny)
        comm.all_reduce(small, axis, "sum")

    for _ in range(3):
        computing_then_reducing()
    dist.barrier()
    alone, extra = [], []
    # interleaved, so that a change of the machine's load hits both alike; 3 rounds of 21 pairs (~0.5 s) a figure: the
    # difference is a few tenths of a millisecond to a few, and its median over 45 pairs of the old short phase moved
    # 2x between two calibrations
    for _ in range(repeats):
        alone.append(median_seconds(computing, 1))
        extra.append(median_seconds(computing_then_reducing, 1) - alone[-1])
    return alone, extra


def _world_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 4 or 2x2")
    parser.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    parser.add_argument("--repeats", type=int, default=21, help="timed calls per collective and size (the median is kept)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if not use_cuda:  # the host heap the steps it prices run with: fresh pages for every large buffer otherwise
        from ..runtime.host_memory import keep_freed_host_memory_as_set

        keep_freed_host_memory_as_set()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    shape = [int(part) for part in args.mesh.split("x")]
    world = dist.get_world_size()
    # FSDP2's units first, in a process as fresh as a training step's (see _fsdp_unit_seconds): over all the
    # processes, then over groups of each size a mesh axis of these processes can have
    fsdp: dict[str, float] = {}
    in_step = None
    if device.type == "cpu" and world > 1:
        for size in (world, *fsdp_group_sizes(world, shape)):
            fsdp.update(_fsdp_unit_seconds(size, FSDP_REPEATS))
        # the in-step waits' rounds (CPU processes): one here, one after the collectives, one at the end
        in_step = _InStepSampler(world, IN_STEP_REPEATS)
        in_step.round()
    # the mesh's own axes, then groups of the sizes other meshes of these processes have (2x2 of 4: pairs), all at once
    timed = [(axis, shape[axis], group) for axis, group in enumerate(_axis_groups(shape))]
    timed += [(-1, size, _axis_groups([world // size, size])[1]) for size in _group_sizes(world, shape)]
    measurements, unsupported = [], []
    for axis, size, group in timed:
        for op in OPS:
            for nbytes in (int(s) for s in args.sizes.split(",")):
                try:
                    seconds = _time(op, nbytes, group, size, device, args.repeats)
                except (RuntimeError, NotImplementedError, ValueError) as err:  # the backend lacks this collective
                    unsupported.append({"axis": axis, "group_size": size, "op": op,
                                        "reason": str(err).splitlines()[0][:200]})
                    break
                measurements.append({"axis": axis, "group_size": size, "op": op, "bytes": nbytes, "seconds": seconds})
    dist.barrier()
    if in_step is not None:
        in_step.round()
    if device.type == "cpu" and _any_rank(core_sharing() > 1, device):  # ranks share cores: see _roofline_alone
        roofline = _roofline_alone(device)
    else:
        roofline = _slowest(_roofline(device), device)
    if device.type == "cpu":  # the runtime's per-node and per-collective costs (CPU processes; GPUs keep the roofline)
        runtime = _runtime_figures(roofline)
        if in_step is not None:
            in_step.round()
        roofline.update(_slowest(runtime | fsdp | (in_step.figures() if in_step is not None else {}), device))
    if dist.get_rank() == 0:
        report = {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "mesh": shape,
                  "device": roofline, "device_name": torch.cuda.get_device_name(device) if use_cuda else "cpu",
                  "memory_capacity_bytes": torch.cuda.get_device_properties(device).total_memory if use_cuda else None,
                  "measurements": measurements, "unsupported": unsupported}
        write_atomically(args.out, json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
