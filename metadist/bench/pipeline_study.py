"""A simulated pipeline study: models that need pipeline parallelism, priced by the cost model.

    python -m metadist.bench.pipeline_study --models llama-70b --devices 64 --pp 4,8 --out FILE.json

Nothing runs on GPUs: each model is built on the meta device, its step captured on one microbatch
per microbatch count (``raw_grads=True``), its rules found in the rule database, and then, on the
``h100-ib`` preset (nodes of 8 H100-80GB, NVLink inside, InfiniBand between):

- **MetaDist**: :func:`~metadist.solver.pipeline.search_pipeline` over the given pp degrees (1: no
  pipeline, the whole step on all devices) and microbatch counts: cuts, each stage's ILP, the
  schedule, the choice, and the search time;
- **Megatron 3D** hand plans: for each pp degree and microbatch count, the same balanced cuts,
  each stage laid out as Megatron-LM does (tensor parallel over the 8 GPUs of a node, data
  parallel across the stage's nodes: ``baseline_plan(..., "megatron")`` on the stage's sub-mesh),
  1F1B;
- **ZeRO-3** on all devices, no pipeline (``baseline_plan(..., "zero3")``).

The global batch is fixed per model (``GLOBAL_BATCH``), sequences of ``SEQ_LEN`` tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

CLUSTER_PRESET = "h100-ib"
GPUS_PER_NODE = 8

CONFIGS = {
    "llama-70b": ("llama", dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "gpt-175b": ("gpt2", dict(vocab_size=50257, n_positions=2048, n_embd=12288, n_layer=96, n_head=96)),
}
"""Llama 2 70B shapes; a GPT-3 175B-class config (GPT-2 architecture at GPT-3 175B's width and depth)."""
SEQ_LEN = {"llama-70b": 2048, "gpt-175b": 2048}
GLOBAL_BATCH = {"llama-70b": 64, "gpt-175b": 64}


@dataclass(frozen=True, kw_only=True)
class PipelineRow:
    model: str
    devices: int
    method: str
    mesh: tuple[int, ...]
    pp: int = 1
    microbatches: int = 1
    schedule: str = "-"
    step_s: float | None = None
    bubble_fraction: float | None = None
    memory_bytes: float | None = None
    fits: bool = False
    error: str = ""
    search_s: float | None = None
    stages: list = field(default_factory=list)


def study_workload(name: str, global_batch: int):
    """The model on meta with ``global_batch`` sequences."""
    import torch
    import transformers

    from ..workload import Workload
    from ..workloads.builtin import adamw, hf_loss

    family, config = CONFIGS[name]
    # a training step keeps no KV cache (as the built-ins: metadist.workloads.builtin)
    if family == "llama":
        hf_config, model_class = transformers.LlamaConfig(**config, use_cache=False), transformers.LlamaForCausalLM
    else:
        hf_config, model_class = transformers.GPT2Config(**config, use_cache=False), transformers.GPT2LMHeadModel
    with torch.device("meta"):
        model = model_class(hf_config)
    model.loss_type = "ForCausalLM"
    model.train()
    tokens = torch.randint(0, config["vocab_size"], (global_batch, SEQ_LEN[name]), generator=torch.Generator().manual_seed(0))
    return Workload(model=model, batch={"input_ids": tokens, "labels": tokens.clone()}, loss_fn=hf_loss,
                    optimizer=adamw, name=name, extras={"family": family})


def study(name: str, devices: int, pp_degrees: list[int], microbatches: list[int] | None, time_limit_s: float) -> list[PipelineRow]:
    from ..cost.cluster import cluster_for
    from ..frontends.torch.microbatch import MicrobatchGraphs
    from ..solver import SolverError, baseline_plan
    from ..solver.pipeline import plan_pipeline, search_pipeline
    from ..solver.pipeline.search import pipeline_mesh

    graphs = MicrobatchGraphs(study_workload(name, GLOBAL_BATCH[name]))
    cluster = lambda mesh: cluster_for(CLUSTER_PRESET, mesh)  # noqa: E731
    started = time.perf_counter()
    result = search_pipeline(graphs, devices, cluster, global_batch=graphs.global_batch, per_node=GPUS_PER_NODE,
                             pp_degrees=pp_degrees, microbatches=microbatches, time_limit_s=time_limit_s)
    search_s = time.perf_counter() - started
    log.info("%s on %d: search took %.0f s\n%s", name, devices, search_s, result.explain())
    rows = []
    for c in result.candidates:
        rows.append(PipelineRow(model=name, devices=devices, method="metadist" + (" (chosen)" if c is result.chosen else ""),
                                mesh=c.mesh.shape, pp=c.pp, microbatches=c.microbatches, schedule=c.schedule,
                                step_s=c.step_s, bubble_fraction=c.bubble_fraction if c.pp > 1 else None,
                                memory_bytes=c.memory_bytes, fits=c.fits, error=c.error,
                                search_s=search_s if c is result.chosen else None, stages=_stages(c.plan)))
    budget = cluster_for(CLUSTER_PRESET, pipeline_mesh(1, devices, GPUS_PER_NODE)).device.memory_capacity_bytes

    def megatron(graph, rules, stage_cluster, _budget):
        return baseline_plan(graph, rules, stage_cluster, "megatron", time_limit_s)

    for c in result.candidates:
        if c.pp == 1 or c.schedule != "1f1b":
            continue
        graph, rules, divisor = graphs(c.microbatches, True)
        try:
            plan = plan_pipeline(graph, rules, cluster(c.mesh), microbatches=c.microbatches, schedule="1f1b",
                                 loss_divisor=divisor, stage_planner=megatron, time_limit_s=time_limit_s)
        except SolverError as err:
            rows.append(PipelineRow(model=name, devices=devices, method="megatron 3D", mesh=c.mesh.shape, pp=c.pp,
                                    microbatches=c.microbatches, schedule="1f1b", error=str(err)))
            continue
        e = plan.estimate
        rows.append(PipelineRow(model=name, devices=devices, method="megatron 3D", mesh=c.mesh.shape, pp=c.pp,
                                microbatches=c.microbatches, schedule="1f1b", step_s=e["step_s"],
                                bubble_fraction=e["bubble_fraction"], memory_bytes=e["memory_bytes_peak"],
                                fits=e["memory_bytes_peak"] <= budget, stages=_stages(plan)))
    whole_mesh = pipeline_mesh(1, devices, GPUS_PER_NODE)
    graph, rules, _ = graphs(1, False)
    try:
        plan = baseline_plan(graph, rules, cluster(whole_mesh), "zero3", time_limit_s)
        rows.append(PipelineRow(model=name, devices=devices, method="zero3", mesh=whole_mesh.shape,
                                step_s=plan.estimate["step_s"], memory_bytes=plan.estimate["memory_bytes_peak"],
                                fits=plan.estimate["memory_bytes_peak"] <= budget))
    except SolverError as err:
        rows.append(PipelineRow(model=name, devices=devices, method="zero3", mesh=whole_mesh.shape, error=str(err)))
    return rows


def _stages(plan) -> list:
    if plan is None or not hasattr(plan, "stages"):
        return []
    return [{key: stage[key] for key in ("forward_s", "backward_s", "update_s", "memory_bytes_peak", "in_flight")}
            for stage in plan.estimate["stages"]]


def markdown(rows: list[PipelineRow]) -> str:
    lines = ["| model | GPUs | layout | mesh | pp | microbatches | schedule | est. step s | bubble | est. memory/GPU | fits 80 GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = "-" if r.step_s is None else f"{r.step_s:.3f}"
        bubble = "-" if r.bubble_fraction is None else f"{r.bubble_fraction:.1%}"
        memory = "-" if r.memory_bytes is None else f"{r.memory_bytes / 2**30:.2f} GiB"
        fits = "yes" if r.fits else ("**no**" + (f": {r.error}" if r.error else ""))
        lines.append(f"| {r.model} | {r.devices} | {r.method} | {'x'.join(map(str, r.mesh))} | {r.pp} | {r.microbatches} | "
                     f"{r.schedule} | {step} | {bubble} | {memory} | {fits} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.pipeline_study", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama-70b")
    parser.add_argument("--devices", default="64")
    parser.add_argument("--pp", default="1,4,8", help="pp degrees to search (1: no pipeline)")
    parser.add_argument("--microbatches", help="microbatch counts to search (default: pp, 2 pp, 4 pp)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit per plan, seconds")
    parser.add_argument("--out", required=True)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ..files import write_atomically

    rows: list[PipelineRow] = []
    for model in args.models.split(","):
        for devices in (int(n) for n in args.devices.split(",")):
            rows.extend(study(model, devices, [int(p) for p in args.pp.split(",")],
                              None if not args.microbatches else [int(m) for m in args.microbatches.split(",")],
                              args.time_limit))
            write_atomically(args.out, json.dumps({"format": "metadist.pipeline_study", "version": 1,
                                                   "cluster": CLUSTER_PRESET, "command": "python -m metadist.bench.pipeline_study "
                                                   + " ".join(sys.argv[1:] if argv is None else argv), "rows": [asdict(r) for r in rows]}, indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
