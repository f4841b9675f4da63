"""``metadist calibrate --nproc N``: measure collectives on this machine, fit alpha-beta per axis."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from .common import human_bytes, write_atomically


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure collectives on local processes and write a cluster JSON for `metadist plan --cluster`",
        description="Launch N local processes with torchrun, time all-reduce, all-gather, reduce-scatter and all-to-all "
        "per mesh axis (gloo on CPU, NCCL with CUDA), and fit latency and bandwidth per axis.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of local processes")
    parser.add_argument("--mesh", help="mesh shape over the processes, e.g. 2x2 (default: one axis of N)")
    parser.add_argument("--sizes", default="4096,65536,1048576,4194304", help="message sizes in bytes, comma-separated")
    parser.add_argument("--json", metavar="FILE", help="write the cluster JSON to FILE")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..cost.calibrate import calibrate
    from ..ir import Mesh
    from ..solver import errors  # noqa: F401  (its USER_ERRORS, ClusterError included, are the CLI's user errors)

    mesh = Mesh.parse(args.mesh) if args.mesh else Mesh((args.nproc,))
    cluster, report = calibrate(args.nproc, mesh, args.sizes)
    console = Console()
    table = Table(title=f"calibrated {report['backend']} on {args.nproc} processes, mesh {mesh}")
    for column in ("axis", "size", "latency", "bandwidth"):
        table.add_column(column, justify="right")
    for name, size, link in zip(mesh.axis_names, mesh.shape, cluster.axis_links):
        table.add_row(name, str(size), f"{link.latency_s * 1e6:.1f} us", f"{human_bytes(link.bandwidth_bytes_per_s)}/s")
    console.print(table)
    device = cluster.device
    console.print(f"device: {device.peak_flops_per_s / 1e9:.1f} GFLOP/s, {human_bytes(device.memory_bandwidth_bytes_per_s)}/s memory, "
                  f"{human_bytes(device.memory_capacity_bytes)} capacity", markup=False)
    for item in report["unsupported"]:
        console.print(f"not measured on axis {item['axis']}: {item['op']} ({item['reason']})", markup=False)
    if args.json:
        write_atomically(args.json, cluster.to_json())
        console.print(f"cluster JSON written to {args.json}")
    else:
        console.print(cluster.to_json(), markup=False)
    return 0
