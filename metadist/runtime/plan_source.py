"""Where a run's plan comes from: the solver (default), a baseline, the all-replicate plan, or a plan file."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping

from ..frontends.torch import TorchStep
from ..ir import Mesh
from ..ir.plan import Plan
from ..lowering import replicate_plan
from ..progress import phase
from .errors import RuntimeSetupError

__all__ = ["load_plan", "plan_decisions", "PLAN_SOURCES"]

log = logging.getLogger(__name__)

#: Plan sources that are not files.
PLAN_SOURCES = ("solver", "replicate", "dp", "zero2", "zero3", "megatron")


def load_plan(
    source: str | Plan,
    torch_step: TorchStep,
    mesh: Mesh,
    metadist_version: str,
    memory_budget_bytes: int | None,
    cluster: str | None = None,
    *,
    bucket_cap_bytes: int | None = None,
    pinned: Mapping[str, tuple] | None = None,
) -> Plan:
    """The plan for ``torch_step.graph`` on ``mesh`` from ``source`` (checked against the graph).

    ``source``: ``solver`` (ShardCombine's rules, then the ILP), ``replicate``, a
    solver baseline (``dp``, ``zero2``, ``zero3``, ``megatron``), a plan JSON file
    or a :class:`Plan` already read.
    ``cluster``: the cost model's cluster preset or file (None on CPU: ``METADIST_CPU_CLUSTER``, by default this
    machine as calibrated on first use, :func:`metadist.cost.calibrate.machine_cluster`).
    ``bucket_cap_bytes``: the runtime's coalescing cap, which the solver prices (None: default).
    ``pinned``: graph input name -> the sharding its state already lies in, which the solver keeps.
    """
    graph = torch_step.graph
    if isinstance(source, Plan):
        plan, source = source, "the given plan"
    elif source == "replicate":
        plan = replicate_plan(graph, mesh, metadist_version)
    elif source in PLAN_SOURCES:
        plan = _solver_plan(torch_step, mesh, source, memory_budget_bytes, cluster, bucket_cap_bytes, dict(pinned or {}))
    else:
        path = Path(source)
        if not path.is_file():
            raise RuntimeSetupError(f"--plan {source!r} is neither one of {', '.join(PLAN_SOURCES)} nor a plan file")
        plan = Plan.from_json(path.read_text())
    if plan.recompute:
        from ..solver.recompute import apply_recompute

        graph = apply_recompute(graph, plan.recompute)
    plan.check_for(graph, metadist_version)
    log.info("plan from %s: %d node strategies on mesh %s", source, len(plan.node_strategies), plan.mesh)
    if plan.mesh.shape != mesh.shape:
        raise RuntimeSetupError(f"the plan is for a {plan.mesh} mesh, the run has {mesh}; plan for {mesh} or pass --mesh")
    return plan


def _solver_plan(torch_step: TorchStep, mesh: Mesh, source: str, memory_budget_bytes: int | None, cluster: str | None,
                 bucket_cap_bytes: int | None, pinned: dict) -> Plan:
    """Rank 0 discovers the rules and solves; the other ranks receive its plan as JSON.

    Planning once and broadcasting keeps every rank on the same plan even when the
    solver stops at its time limit (its incumbent could differ between ranks).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return _solve(torch_step, mesh, source, memory_budget_bytes, cluster, bucket_cap_bytes, pinned)
    plan = (_solve(torch_step, mesh, source, memory_budget_bytes, cluster, bucket_cap_bytes, pinned)
            if dist.get_rank() == 0 else None)
    with phase("waiting for rank 0's plan", quiet=True):
        return broadcast_plan(plan)


def broadcast_plan(plan: Plan | None) -> Plan:
    """Rank 0's ``plan`` (None on the other ranks) on every rank, sent as its JSON."""
    return Plan.from_json(broadcast_text(plan.to_json() if plan is not None else ""))


def _solve(torch_step: TorchStep, mesh: Mesh, source: str, memory_budget_bytes: int | None, cluster: str | None,
           bucket_cap_bytes: int | None, pinned: dict) -> Plan:
    import torch

    from ..cost.cluster import resolve_cluster
    from ..frontends.torch.discovery import TorchExecutor
    from ..shardcombine.api import rules_from_database
    from ..solver import baseline_plan, plan_graph
    from ..solver.problem import Restrictions

    rules = rules_from_database(torch_step.graph, TorchExecutor())  # marks the "discovery" phase
    reduce_dtype = torch_step.precision.reduce_dtype
    if cluster is None and not torch.cuda.is_available():
        from ..config import settings_from_env
        from ..cost.calibrate import default_cpu_cluster

        settings = settings_from_env()
        with phase("calibrate"):
            resolved = default_cpu_cluster(mesh, settings.cpu_cluster, settings.cache_dir, announce=_announce)
            from ..cost.timed_shapes import with_measured_shapes  # matmuls, attention, relayouts: their times here

            resolved = with_measured_shapes(resolved, torch_step.graph, settings.cache_dir, announce=_announce)
    else:
        resolved = resolve_cluster(cluster, mesh)
    with phase("solve"):
        if source == "solver":
            restrictions = Restrictions(input_shardings={name: frozenset({sharding}) for name, sharding in pinned.items()})
            return plan_graph(torch_step.graph, rules, resolved, memory_budget_bytes=memory_budget_bytes,
                              bucket_cap_bytes=bucket_cap_bytes, restrictions=restrictions, reduce_dtype=reduce_dtype)
        return baseline_plan(torch_step.graph, rules, resolved, source, reduce_dtype=reduce_dtype)


def _announce(text: str) -> None:
    import sys

    print(f"metadist: {text}", file=sys.stderr, flush=True)


def broadcast_text(text: str) -> str:
    """Rank 0's ``text`` on every rank, sent as bytes in a tensor (no pickle)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    payload = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    buffer = payload.to(device) if dist.get_rank() == 0 else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0)
    return buffer.cpu().numpy().tobytes().decode()  # not tolist(): a Python int per byte


def plan_decisions(plan: Plan) -> str:
    """The plan's decisions as canonical JSON: what every rank must agree on.

    Solver statistics and estimates (timings) are left out: they may differ
    between ranks without changing what runs.
    """
    data = plan.to_dict()
    keep = ("graph_fingerprint", "metadist_version", "mesh", "node_strategies", "input_shardings", "output_shardings",
            "recompute")
    return json.dumps({key: data[key] for key in keep}, sort_keys=True)
