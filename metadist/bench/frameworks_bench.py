"""The same model planned from PyTorch and from JAX, side by side (issue: JAX frontend).

    python -m metadist.bench.frameworks_bench [--mesh 8] [--cluster h100x8] [--pair mlp:jax-mlp]

Both steps go through the same pipeline (capture into MetaIR, ShardCombine on the
framework's own ops, the same cost model and ILP). Printed: graph sizes, the
plans' estimates, and each parameter's sharding in both plans, paired by shape
(PyTorch's ``nn.Linear`` stores ``(out, in)``, the JAX model ``(in, out)``, so 2-D
weights are compared transposed: ``S(0)`` on one is ``S(1)`` on the other).
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.table import Table


def _plan(model: str, mesh, cluster_name: str):
    from ..api import capture_and_discover
    from ..cost import resolve_cluster
    from ..solver import plan_graph

    graph, rules = capture_and_discover(model, None)
    return graph, plan_graph(graph, rules, resolve_cluster(cluster_name, mesh))


def _param_shardings(graph, plan) -> list[tuple[str, tuple[int, ...], tuple]]:
    from ..ir import Role

    return [(i.value.name, i.value.spec.shape, plan.input_shardings[i.value.name]) for i in graph.inputs_by_role(Role.PARAM)]


def _equivalent(torch_shape, torch_sharding, jax_shape, jax_sharding) -> bool:
    """Whether both shardings split the same logical dim. A 2-D weight is (out, in) in PyTorch
    and (in, out) in the JAX model, so its dims are compared transposed (square ones too)."""
    from ..ir import Shard

    if len(torch_shape) != 2:
        return torch_sharding == jax_sharding
    rank = len(torch_shape)
    flipped = tuple(Shard(rank - 1 - p.dim) if isinstance(p, Shard) else p for p in jax_sharding)
    return torch_sharding == flipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.frameworks_bench")
    parser.add_argument("--mesh", default="8")
    parser.add_argument("--cluster", default="h100x8")
    parser.add_argument("--pair", default="mlp:jax-mlp", help="TORCH_MODEL:JAX_MODEL")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from ..ir import Mesh, format_sharding

    mesh = Mesh.parse(args.mesh)
    torch_name, jax_name = args.pair.split(":")
    console = Console(width=140)
    results = {name: _plan(name, mesh, args.cluster) for name in (torch_name, jax_name)}
    summary = Table(title=f"{torch_name} (PyTorch) and {jax_name} (JAX) planned on mesh {mesh}, cluster {args.cluster}")
    for column in ("model", "ops", "step ms", "compute ms", "comm ms", "peak memory MiB", "collectives"):
        summary.add_column(column, justify="right")
    for name, (graph, plan) in results.items():
        e = plan.estimate
        summary.add_row(name, str(len(graph.nodes)), f"{e['step_s'] * 1e3:.4f}", f"{e['compute_s'] * 1e3:.4f}",
                        f"{e['comm_s'] * 1e3:.4f}", f"{e['memory_bytes_peak'] / 2**20:.2f}",
                        ", ".join(f"{k} x{v}" for k, v in sorted(e.get("collectives_by_kind", {}).items())))
    console.print(summary)
    torch_params = _param_shardings(*results[torch_name])
    jax_params = _param_shardings(*results[jax_name])
    pairs = Table(title="parameter shardings, paired by shape")
    for column in ("PyTorch parameter", "shape", "sharding", "JAX parameter", "shape", "sharding", "same split"):
        pairs.add_column(column)
    unmatched = list(jax_params)
    agree = 0
    for name, shape, sharding in torch_params:
        match = next((p for p in unmatched if p[1] == shape or p[1] == tuple(reversed(shape))), None)
        if match is None:
            pairs.add_row(name, str(shape), format_sharding(sharding), "-", "-", "-", "-")
            continue
        unmatched.remove(match)
        same = _equivalent(shape, sharding, match[1], match[2])
        agree += same
        pairs.add_row(name, str(shape), format_sharding(sharding), match[0], str(match[1]), format_sharding(match[2]),
                      "yes" if same else "no")
    console.print(pairs)
    console.print(f"{agree} of {len(torch_params)} parameters lie the same way in both plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
