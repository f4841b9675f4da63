"""A simulated scale study: MetaDist's plan next to the hand-written layouts, all priced by the cost model.

    python -m metadist.bench.scale_study [--models gpt2-xl,llama-7b,llama-13b] [--devices 8,64] --out FILE.json

Nothing here runs on GPUs: each model is built on the meta device, captured, its rules discovered
(ShardCombine, from the rule database where known), and then every layout is planned and
estimated by the same cost model (``h100-ib`` preset: nodes of 8 H100-80GB over NVLink,
InfiniBand between nodes) through the solver's public functions:

- MetaDist: ``plan_graph`` with the 80 GB per-device budget;
- DDP, ZeRO-2, ZeRO-3, Megatron: ``baseline_plan`` (no budget: the estimate says whether it fits);
- the best hand-written 2-D layout: ``megatron`` (TP on the inner axis, DP on the outer) over every
  2-D mesh whose inner axis stays inside a node, the fastest that fits.

8 devices are one node, mesh ``(8,)``; 64 devices are 8 nodes, mesh ``(8, 8)`` (node, GPU). The
global batch is one sequence per device (weak scaling), so every data-parallel layout divides it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

SCALE_MODELS = ("gpt2-xl", "llama-7b", "llama-13b")
DEVICE_COUNTS = (8, 64)
GPUS_PER_NODE = 8
CLUSTER_PRESET = "h100-ib"

LLAMA_13B = dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                 num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
"""Llama 2 13B shapes (not a built-in), built on meta here."""

SEQ_LEN = {"gpt2-xl": 1024, "llama-7b": 2048, "llama-13b": 2048}


@dataclass(frozen=True, kw_only=True)
class ScaleRow:
    """One layout of one model on one cluster, as the cost model prices it."""

    model: str
    devices: int
    method: str
    mesh: tuple[int, ...]
    params: int = 0
    step_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    memory_bytes: float | None = None
    fits: bool = False
    error: str = ""
    compile_s: dict = field(default_factory=dict)
    solver_status: str = ""
    """The ILP's status and gap (a time-limited ILP returns its best plan so far)."""


def main_mesh(devices: int) -> tuple[int, ...]:
    return (devices,) if devices <= GPUS_PER_NODE else (devices // GPUS_PER_NODE, GPUS_PER_NODE)


def two_d_meshes(devices: int) -> list[tuple[int, int]]:
    """(dp, tp) meshes with 1 < tp <= GPUS_PER_NODE, tp dividing a node."""
    return [(devices // tp, tp) for tp in (2, 4, 8) if tp <= GPUS_PER_NODE and devices % tp == 0 and devices // tp > 1]


def scale_workload(name: str, devices: int):
    """The model on meta with a global batch of one sequence per device."""
    from ..workloads import builtin_workload

    if name != "llama-13b":
        return builtin_workload(name, device="meta", batch_size=devices, seq_len=SEQ_LEN.get(name))
    import torch
    import transformers

    from ..workload import Workload
    from ..workloads.builtin import adamw, hf_loss

    config = transformers.LlamaConfig(**LLAMA_13B, attn_implementation="eager", use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    model.train()
    input_ids = torch.randint(0, LLAMA_13B["vocab_size"], (devices, SEQ_LEN[name]), generator=torch.Generator().manual_seed(0))
    return Workload(model=model, batch={"input_ids": input_ids, "labels": input_ids.clone()}, loss_fn=hf_loss,
                    optimizer=adamw, name=name, extras={"family": "llama"})


def capture_and_discover(name: str, devices: int) -> tuple[Any, Any, dict[str, float]]:
    """The graph and rules of ``name`` and how long each took."""
    from ..frontends.torch import capture_step
    from ..frontends.torch.discovery import TorchExecutor
    from ..shardcombine.api import graph_rules
    from ..shardcombine.database import RuleDatabase

    workload = scale_workload(name, devices)
    optimizer = workload.optimizer(workload.model.parameters())
    started = time.perf_counter()
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, name=name)
    capture_s = time.perf_counter() - started
    started = time.perf_counter()
    with RuleDatabase() as db:
        rules = graph_rules(step.graph, TorchExecutor(), db=db)
    return step.graph, rules, {"capture": capture_s, "discovery": time.perf_counter() - started}


def _row(model: str, devices: int, method: str, mesh: tuple[int, ...], plan: Any, budget: float, compile_s: dict | None = None,
         params: int = 0) -> ScaleRow:
    estimate = plan.estimate
    memory = estimate.get("memory_bytes_peak")
    return ScaleRow(model=model, devices=devices, method=method, mesh=mesh, params=params, step_s=estimate.get("step_s"),
                    compute_s=estimate.get("compute_s"), comm_s=estimate.get("comm_s"), memory_bytes=memory,
                    fits=memory is not None and memory <= budget, compile_s=compile_s or {},
                    solver_status=_solver_status(plan.solver))


def _solver_status(stats: Any) -> str:
    status, gap = stats.get("status", ""), stats.get("mip_gap")
    return f"{status}, gap {gap:.3g}" if isinstance(gap, (int, float)) else str(status)


def study_model(name: str, devices: int) -> list[ScaleRow]:
    """Every layout of ``name`` on ``devices`` GPUs."""
    from ..cost.cluster import cluster_for
    from ..ir import Mesh
    from ..lowering import lower
    from ..solver import InfeasibleBudgetError, SolverError, baseline_plan, plan_graph

    graph, rules, compile_s = capture_and_discover(name, devices)
    mesh = main_mesh(devices)
    cluster = cluster_for(CLUSTER_PRESET, Mesh(mesh))
    budget = cluster.device.memory_capacity_bytes
    rows = []
    started = time.perf_counter()
    try:
        plan = plan_graph(graph, rules, cluster, recompute=False)  # the study prices training without recomputation
        solve_s = time.perf_counter() - started
        started = time.perf_counter()
        lower(graph, plan, (0,) * len(mesh))
        times = {**compile_s, "solve": solve_s, "lowering": time.perf_counter() - started}
        rows.append(_row(name, devices, "metadist", mesh, plan, budget, times, graph.parameter_count()))
    except InfeasibleBudgetError as err:
        rows.append(ScaleRow(model=name, devices=devices, method="metadist", mesh=mesh, error=str(err),
                             memory_bytes=err.minimum_bytes, compile_s=compile_s, params=graph.parameter_count()))
    for kind in ("dp", "zero2", "zero3", "megatron"):
        try:
            rows.append(_row(name, devices, kind, mesh, baseline_plan(graph, rules, cluster, kind), budget))
        except SolverError as err:
            rows.append(ScaleRow(model=name, devices=devices, method=kind, mesh=mesh, error=str(err)))
    megatron = next(row for row in rows if row.method == "megatron")
    rows.append(_best_two_d(name, devices, graph, rules, budget, megatron))
    return rows


def _best_two_d(name: str, devices: int, graph: Any, rules: Any, budget: float, megatron: ScaleRow) -> ScaleRow:
    """The fastest fitting megatron layout over the 2-D (dp, tp) meshes (else the smallest).

    The megatron row on the main mesh is one candidate already when that mesh is 2-D.
    """
    from dataclasses import replace

    from ..cost.cluster import cluster_for
    from ..ir import Mesh
    from ..solver import SolverError, baseline_plan

    candidates = []
    if len(megatron.mesh) == 2 and not megatron.error:
        candidates.append(replace(megatron, method=f"best 2-D (dp {megatron.mesh[0]} x tp {megatron.mesh[1]})"))
    for mesh in two_d_meshes(devices):
        if mesh == megatron.mesh:
            continue
        try:
            plan = baseline_plan(graph, rules, cluster_for(CLUSTER_PRESET, Mesh(mesh)), "megatron")
        except SolverError as err:
            log.warning("%s on %s: no 2-D megatron plan: %s", name, mesh, err)
            continue
        candidates.append(_row(name, devices, f"best 2-D (dp {mesh[0]} x tp {mesh[1]})", mesh, plan, budget))
    if not candidates:
        return ScaleRow(model=name, devices=devices, method="best 2-D", mesh=(), error="no 2-D layout could be planned")
    fitting = [row for row in candidates if row.fits]
    if fitting:
        return min(fitting, key=lambda row: row.step_s)
    return min(candidates, key=lambda row: row.memory_bytes or float("inf"))


def run_study(models: tuple[str, ...], device_counts: tuple[int, ...], out: str) -> list[ScaleRow]:
    """Every model on every cluster size; the file is rewritten after each, so a long study leaves partial results."""
    rows: list[ScaleRow] = []
    for model in models:
        for devices in device_counts:
            log.info("scale study: %s on %d devices", model, devices)
            started = time.perf_counter()
            rows.extend(study_model(model, devices))
            log.info("scale study: %s on %d devices took %.0f s", model, devices, time.perf_counter() - started)
            _write(out, rows)
    return rows


def _write(out: str, rows: list[ScaleRow]) -> None:
    from ..files import write_atomically

    write_atomically(out, json.dumps({"format": "metadist.scale_study", "version": 1, "cluster": CLUSTER_PRESET,
                                      "rows": [asdict(row) for row in rows]}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.scale_study", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(SCALE_MODELS))
    parser.add_argument("--devices", default=",".join(map(str, DEVICE_COUNTS)))
    parser.add_argument("--out", required=True)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run_study(tuple(args.models.split(",")), tuple(int(n) for n in args.devices.split(",")), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
