"""``metadist calibrate --nproc N``: measure compute and collectives on this machine, fit alpha-beta per axis.

On one axis (no ``--mesh``) the measurement also replaces this machine's cached calibration for N
processes, the one CPU runs and benchmarks plan on (:func:`metadist.cost.calibrate.machine_cluster`).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from ..files import write_atomically
from .common import human_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure collectives on local processes and write a cluster JSON for `metadist plan --cluster`",
        description="Launch N local processes with torchrun, time all-reduce, all-gather, reduce-scatter and all-to-all "
        "per mesh axis (gloo on CPU, NCCL with CUDA), fit latency and bandwidth per axis, and time matmuls, an "
        "elementwise op and tiny ops on every process at once (FLOP/s, bytes/s, seconds per op). On one axis, the "
        "result also replaces this machine's cached calibration that CPU runs plan on.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of local processes")
    parser.add_argument("--mesh", help="mesh shape over the processes, e.g. 2x2 (default: one axis of N)")
    parser.add_argument("--sizes", help="message sizes in bytes, comma-separated (default: 4 KiB to 32 MiB, "
                        "metadist.cost.calibrate.FULL_SIZES)")
    parser.add_argument("--launches", type=int, help="launch the workers this many times and keep each figure's median "
                        "(default: 3 where the processes outnumber this machine's cores, else 1)")
    parser.add_argument("--json", metavar="FILE", help="write the cluster JSON to FILE")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..cost.calibrate import FULL_SIZES, busy_note, calibrate
    from ..ir import Mesh
    from ..solver import errors  # noqa: F401  (its USER_ERRORS, ClusterError included, are the CLI's user errors)

    mesh = Mesh.parse(args.mesh) if args.mesh else Mesh((args.nproc,))
    console = Console()
    with console.status(f"calibrating {args.nproc} processes") as status:
        def on_launch(index: int, launches: int) -> None:
            if launches > 1:
                status.update(f"calibrating {args.nproc} processes: launch {index} of {launches} (each figure the median over them)")

        def on_busy(text: str) -> None:
            console.print(text, markup=False)

        cluster, report = calibrate(args.nproc, mesh, args.sizes or FULL_SIZES, launches=args.launches, on_launch=on_launch,
                                    on_busy=on_busy)
    note = busy_note(report, args.nproc)
    if note is not None:
        console.print(note, markup=False)
    cached = None
    if mesh.ndim == 1 and report["backend"] == "gloo":
        from ..config import settings_from_env
        from ..cost.calibrate import calibration_path, save_calibration

        cached = calibration_path(settings_from_env().cache_dir, args.nproc)
        save_calibration(cached, report, args.nproc)
        from ..cost import attention_times, matmul_times, relayout_times

        # the shapes timed at the last calibration's speed (matmuls, fused attention, relayouts): timed again on use
        for timed in (matmul_times, attention_times, relayout_times):
            timed.table_path(settings_from_env().cache_dir).unlink(missing_ok=True)
    over = f", the median of {report['launches']} launches" if report.get("launches", 1) > 1 else ""
    table = Table(title=f"calibrated {report['backend']} on {args.nproc} processes, mesh {mesh}{over}")
    for column in ("axis", "size", "per call", "in-step wait", "latency per step", "bandwidth", "reduce-scatter"):
        table.add_column(column, justify="right")
    for name, size, link in zip(mesh.axis_names, mesh.shape, cluster.axis_links):
        table.add_row(name, str(size), _duration(link.call_overhead_s), _duration(link.sync_s), _duration(link.latency_s),
                      f"{human_bytes(link.bandwidth_bytes_per_s)}/s", "as all-reduce" if link.reduce_scatter_as_all_reduce else "ring")
    console.print(table)
    for name, link in zip(mesh.axis_names, cluster.axis_links):
        if link.sync_by_gap:  # the wait by the compute before a call (Link.sync_by_gap), where it differs
            waits = ", ".join(f"{_duration(wait)} after {_duration(gap)}" for gap, wait in link.sync_by_gap)
            console.print(f"  {name}: in a step a call waits by the compute before it: {waits} of compute", markup=False)
    device = cluster.device
    console.print(f"device (slowest process, all computing at once): {device.peak_flops_per_s / 1e9:.1f} GFLOP/s matmul, "
                  f"{human_bytes(device.memory_bandwidth_bytes_per_s)}/s elementwise, {device.op_overhead_s * 1e6:.1f} us per node "
                  f"in the runtime ({device.eager_op_overhead_s * 1e6:.1f} us eager), "
                  f"{human_bytes(device.memory_capacity_bytes)} capacity", markup=False)
    dtensor = [f"{seconds * 1e6:.1f} us {what}" for seconds, what in
               ((device.dtensor_op_overhead_s, "an elementwise op"),
                (device.dtensor_module_op_overhead_s, "an op of a parallel linear"),
                (device.dtensor_collective_overhead_s, "a parallel linear's all-reduce")) if seconds > 0]
    if dtensor:
        console.print(f"  torch's DTensor (FSDP2, TP) adds {', '.join(dtensor)}", markup=False)
    if device.sustained_slowdown > 1:
        console.print(f"  over a step the processes computed {device.sustained_slowdown:.2f}x slower than in short timed "
                      "calls (they share cores): the figures above include it", markup=False)
    for dtype, flops in (("float32", device.peak_flops_per_s), *device.peak_flops_per_s_by_dtype):
        stream = device.matmul_stream_s(dtype, 1.0)
        console.print(f"  in {dtype}: {flops / 1e9:.1f} GFLOP/s matmul, "
                      f"{human_bytes(device.bandwidth_bytes_per_s(dtype))}/s elementwise"
                      + (f", {human_bytes(1.0 / stream)}/s of a skinny matmul's large operand" if stream else ""), markup=False)
    if cached is not None:
        console.print(f"cached as this machine's calibration for {args.nproc} processes: {cached}", markup=False)
    for item in report["unsupported"]:
        where = f"axis {item['axis']}" if item["axis"] >= 0 else f"groups of {item['group_size']}"
        console.print(f"not measured on {where}: {item['op']} ({item['reason']})", markup=False)
    if args.json:
        write_atomically(args.json, cluster.to_json())
        console.print(f"cluster JSON written to {args.json}")
    else:
        console.print(cluster.to_json(), markup=False)
    return 0


def _duration(seconds: float) -> str:
    """``seconds`` in milliseconds from 1 ms up, else in microseconds."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"
