"""Write ``docs/benchmarks.md`` and its plots from measured result files.

    python -m metadist.bench.report --results DIR [--scale FILE.json] --out docs/benchmarks.md

The page is made only from what a real run wrote (``BenchRun`` JSON files from the harness, the
scale study's JSON); it invents nothing, and says where MetaDist loses as plainly as where it
wins: the comparisons are computed from the figures, not written by hand.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .results import BenchRun, MethodResult

log = logging.getLogger(__name__)

METADIST = ("metadist-ilp", "metadist-beam", "metadist-ilp-sync", "metadist-ilp-recompute")
METADIST_MIXED = ("metadist-ilp-bf16", "metadist-ilp-bf16-recompute")
"""MetaDist rows under a precision policy: shown, never compared with the float32 baselines."""
DISTRIBUTED_BASELINES = ("ddp", "zero2", "zero3", "tp", "tp-dp")


# ---------------------------------------------------------------- formatting


def fmt_bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return "-"


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def method_row(run: BenchRun, result: MethodResult) -> dict[str, str]:
    """One method's figures as table cells (shared by the markdown page and the CLI)."""
    if not result.ok:
        return {"method": result.method, "status": f"{result.status}: {result.reason}"}
    ddp = run.method("ddp")
    ratio = "-"
    if ddp is not None and ddp.ok and ddp.median_step_s:
        ratio = f"{result.median_step_s / ddp.median_step_s:.2f}"
    low, high = result.spread_s
    agreement = run.loss_agreement().get(result.method)
    compile_total = sum(result.compile_s.values()) if result.compile_s else None
    return {
        "method": result.method,
        "mesh": "x".join(map(str, result.mesh_shape)),
        "median ms": fmt_ms(result.median_step_s),
        "p25-p75 ms": f"{fmt_ms(low)}-{fmt_ms(high)}",
        "vs DDP": ratio,
        "comm payload/rank": fmt_bytes(result.comm_payload_bytes),
        "comm wire/rank": fmt_bytes(result.comm_wire_bytes),
        "calls": str(sum(result.comm_calls_by_kind.values())),
        "state mem/rank": fmt_bytes(result.state_memory_bytes),
        "peak mem/rank": fmt_bytes(result.peak_memory_bytes),
        "final loss": f"{result.final_loss:.6f}" if result.final_loss is not None else "-",
        "rel. diff": "-" if agreement is None else f"{agreement:.1e}",
        "compile s": "-" if compile_total is None else f"{compile_total:.2f}",
    }


COLUMNS = ("method", "mesh", "median ms", "p25-p75 ms", "vs DDP", "comm payload/rank", "comm wire/rank", "calls",
           "state mem/rank", "peak mem/rank", "final loss", "rel. diff", "compile s")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def run_table(run: BenchRun) -> str:
    rows, unavailable = [], []
    for result in run.methods:
        cells = method_row(run, result)
        if result.ok:
            rows.append([cells[column] for column in COLUMNS])
        else:
            unavailable.append(f"- **{result.method}**: {result.status}: {result.reason}")
    return "\n".join([markdown_table(COLUMNS, rows), "", *unavailable])


# ---------------------------------------------------------------- comparisons


@dataclass(frozen=True)
class Gap:
    """MetaDist against the best distributed baseline on one figure of one model."""

    model: str
    figure: str
    metadist: str
    baseline: str
    ratio: float
    """MetaDist's figure over the baseline's (> 1: MetaDist is worse)."""
    detail: str


def _best(run: BenchRun, names: Sequence[str], key) -> MethodResult | None:
    candidates = [result for name in names if (result := run.method(name)) is not None and result.ok and key(result) is not None]
    return min(candidates, key=key) if candidates else None


def gaps(run: BenchRun) -> list[Gap]:
    """Time, communication and peak memory of MetaDist's best row against the best baseline's."""
    figures = (
        ("step time", lambda r: r.median_step_s, fmt_ms, " ms"),
        ("comm payload", lambda r: r.comm_payload_bytes, fmt_bytes, ""),
        ("peak memory", lambda r: r.peak_memory_bytes, fmt_bytes, ""),
    )
    found = []
    for figure, key, fmt, unit in figures:
        ours, theirs = _best(run, METADIST, key), _best(run, DISTRIBUTED_BASELINES, key)
        if ours is None or theirs is None:
            continue
        ratio = key(ours) / key(theirs) if key(theirs) else (1.0 if key(ours) == key(theirs) else float("inf"))
        detail = (f"{ours.method} {fmt(key(ours))}{unit} ({_calls(ours)}) vs {theirs.method} "
                  f"{fmt(key(theirs))}{unit} ({_calls(theirs)})")
        found.append(Gap(run.model, figure, ours.method, theirs.method, ratio, detail))
    return found


def _calls(result: MethodResult) -> str:
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(result.comm_calls_by_kind.items()))
    return kinds or "no collectives"


def gap_lines(runs: Sequence[BenchRun]) -> list[str]:
    """Sentences, worst gap for MetaDist first."""
    all_gaps = sorted((gap for run in runs for gap in gaps(run)), key=lambda gap: -gap.ratio)
    lines = [f"- **{run.model}: {result.method} {result.status}**: {result.reason}"
             for run in runs for result in run.methods if result.method in (*METADIST, *METADIST_MIXED) and not result.ok]
    for gap in all_gaps:
        verdict = "loses" if gap.ratio > 1.05 else "wins" if gap.ratio < 0.95 else "ties"
        lines.append(f"- **{gap.model}, {gap.figure}: MetaDist {verdict}** (x{gap.ratio:.2f}): {gap.detail}.")
    return lines


def call_lines(runs: Sequence[BenchRun]) -> list[str]:
    """How many collectives each MetaDist row issues per step against the baselines, and their mean size."""
    lines = []
    for run in runs:
        cells = []
        for result in run.methods:
            calls = sum(result.comm_calls_by_kind.values())
            if result.ok and calls:
                cells.append(f"{result.method} {calls} ({fmt_bytes(result.comm_payload_bytes / calls)} each)")
        if cells:
            lines.append(f"- {run.model}: " + ", ".join(cells))
    return lines


def prediction_rows(runs: Sequence[BenchRun]) -> list[list[str]]:
    """Predicted (cost model, ``cpu-gloo`` preset) against measured, per method."""
    rows = []
    for run in runs:
        for result in run.methods:
            predicted = result.predicted
            if not result.ok or not predicted or predicted.get("step_s") is None:
                continue
            measured_time, measured_wire = result.median_step_s, result.comm_wire_bytes
            rows.append([
                run.model, result.method, fmt_ms(predicted["step_s"]), fmt_ms(measured_time),
                f"{measured_time / predicted['step_s']:.2f}" if predicted["step_s"] else "-",
                fmt_bytes(predicted.get("comm_bytes")), fmt_bytes(measured_wire),
                f"{measured_wire / predicted['comm_bytes']:.2f}" if measured_wire is not None and predicted.get("comm_bytes") else "-",
            ])
    return rows


# ---------------------------------------------------------------- scale study


def scale_tables(scale: dict) -> str:
    """One table of every layout; *vs MetaDist* is the layout's estimated step time over MetaDist's."""
    header = ("model", "GPUs", "layout", "mesh", "est. step s", "vs MetaDist", "est. memory/GPU", "fits 80 GB", "solver")
    ours = {(row["model"], row["devices"]): row["step_s"] for row in scale["rows"] if row["method"] == "metadist"}
    rows = []
    for row in scale["rows"]:
        fits = "yes" if row["fits"] else ("**no**" if not row["error"] else f"**no**: {row['error'][:160]}")
        reference = ours.get((row["model"], row["devices"]))
        ratio = f"{row['step_s'] / reference:.2f}" if reference and row["step_s"] else "-"
        rows.append([row["model"], str(row["devices"]), row["method"], "x".join(map(str, row["mesh"])),
                     "-" if row["step_s"] is None else f"{row['step_s']:.3f}", ratio, fmt_bytes(row["memory_bytes"]),
                     fits, row.get("solver_status", "")])
    return markdown_table(header, rows)


def scale_verdicts(scale: dict) -> list[str]:
    """Per model and cluster: MetaDist's estimate against the fastest layout that fits, in one sentence."""
    lines = []
    cells = sorted({(row["model"], row["devices"]) for row in scale["rows"]}, key=lambda cell: (cell[1], cell[0]))
    for model, devices in cells:
        rows = [row for row in scale["rows"] if (row["model"], row["devices"]) == (model, devices)]
        ours = next((row for row in rows if row["method"] == "metadist"), None)
        fitting = [row for row in rows if row["method"] != "metadist" and row["fits"] and row["step_s"]]
        best = min(fitting, key=lambda row: row["step_s"]) if fitting else None
        where = f"{model} on {devices} GPUs"
        if ours is None or not ours["fits"]:
            others = f"the fastest that fits is {best['method']}" if best else "no baseline fits either"
            lines.append(f"- {where}: **MetaDist finds no plan that fits**; {others}.")
        elif best is None:
            lines.append(f"- {where}: **MetaDist wins**: its plan ({fmt_bytes(ours['memory_bytes'])}/GPU) is the only one that fits.")
        else:
            ratio = ours["step_s"] / best["step_s"]
            verdict = "loses" if ratio > 1.005 else "wins" if ratio < 0.995 else "ties"
            lines.append(f"- {where}: **MetaDist {verdict}** against {best['method']} (mesh "
                         f"{'x'.join(map(str, best['mesh']))}), estimated step x{ratio:.3f} of it.")
    return lines


def missing_scale_cells(scale: dict, models: Sequence[str], devices: Sequence[int]) -> list[str]:
    have = {(row["model"], row["devices"]) for row in scale["rows"]}
    return [f"{model} on {count} GPUs" for model in models for count in devices if (model, count) not in have]


def _ratio_summary(rows: Sequence[Sequence[str]]) -> str:
    """The spread of measured/predicted, MetaDist's rows and the baselines' apart, for time and for wire bytes."""
    ours = [row for row in rows if row[1].startswith("metadist")]
    theirs = [row for row in rows if not row[1].startswith("metadist")]
    return (f"Measured over predicted, MetaDist's {len(ours)} rows (the plan the runtime runs): step time "
            f"{_spread(ours, 4)}; wire bytes {_spread(ours, 7)}. The baselines' {len(theirs)} rows (torch's DDP and FSDP2 "
            f"and TP against their estimates): step time {_spread(theirs, 4)}; wire bytes "
            f"{_spread(theirs, 7)}. A ratio above 1 means the cost model is optimistic.")


def _spread(rows: Sequence[Sequence[str]], column: int) -> str:
    values = sorted(float(row[column]) for row in rows if row[column] != "-")
    if not values:
        return "-"
    return f"{values[0]:.2f} to {values[-1]:.2f} (median {values[len(values) // 2]:.2f})"


# ---------------------------------------------------------------- the page


def pipeline_section(study: dict) -> list[str]:
    """The simulated pipeline study (``metadist.bench.pipeline_study``) as a section of the page."""
    from .pipeline_study import PipelineRow, markdown

    rows = [PipelineRow(**{**row, "mesh": tuple(row["mesh"])}) for row in study["rows"]]
    lines = ["## Simulated pipeline study (cost model only, `%s` preset)" % study.get("cluster", "?"), "",
             "Models that need pipeline parallelism, every layout priced by the same cost model; no GPU ran. *metadist* "
             "rows are the candidates of MetaDist's search (pp degree, microbatch count, schedule, each stage sharded by "
             "the ILP on its sub-mesh; pp 1 is the whole step on all devices); *megatron 3D* uses the same cuts with "
             "each stage laid out as Megatron-LM does (TP inside a node, DP across the stage's nodes, 1F1B); *zero3* "
             "is the whole step, no pipeline. The bubble is the idle share of device time in the forward/backward "
             "part of the schedule.", "", "```bash",
             *study.get("commands", [study.get("command", "python -m metadist.bench.pipeline_study")]), "```", ""]
    for model, devices in dict.fromkeys((row.model, row.devices) for row in rows):
        cell = [row for row in rows if (row.model, row.devices) == (model, devices)]
        chosen = [row for row in cell if row.method.endswith("(chosen)")]
        priced = [row for row in cell if row.step_s is not None]
        if chosen:
            row = chosen[0]
            rivals = [r for r in priced if not r.method.startswith("metadist") and r.fits]
            versus = "" if not rivals else "; the fastest hand layout that fits: %s, step x%.3f of MetaDist's" % (
                min(rivals, key=lambda r: r.step_s).method, min(r.step_s for r in rivals) / row.step_s)
            lines.append(f"- {model} on {devices} GPUs: MetaDist chose pp={row.pp}, {row.microbatches} microbatches, "
                         f"{row.schedule}, estimated step {row.step_s:.3f} s, search {row.search_s:.0f} s{versus}.")
        elif priced:
            lines.append(f"- {model} on {devices} GPUs: no layout fits 80 GB per GPU (the estimates are fp32 training "
                         "without activation recomputation); the smallest footprint priced: "
                         + ", ".join(f"{r.method} pp={r.pp} m={r.microbatches} {r.memory_bytes / 2**30:.0f} GiB, "
                                     f"step {r.step_s:.3f} s" for r in sorted(priced, key=lambda r: r.memory_bytes)[:2]) + ".")
    return lines + ["", markdown(rows), ""]


PLANNING_NOTES = "planning_notes.md"
"""Measurements taken by hand for the planning section (before/after comparisons on one tree and another), kept in
``docs/bench/`` beside the result files: the page includes the file as written, so regenerating keeps them."""


def planning_section(studies: Sequence[dict], notes: str = "") -> list[str]:
    """Planning time at scale (``metadist.bench.solver_bench --json``): each phase's wall and CPU seconds, then
    ``notes`` (the text of :data:`PLANNING_NOTES`)."""
    lines = ["## Planning time at scale (`metadist.bench.solver_bench`)", "",
             "Capture (a deep model on 4 of its layers, expanded to all), discovery (the rule database warm), and per "
             "mesh the problem build, ILP build, solve and whole `plan_graph` seconds, on this machine. Wall seconds "
             "stretch with the load average (column *load*, on the machine's CPUs); CPU seconds are what the work "
             "costs. *without rule*: nodes that run replicated (factories: scalars and `arange`, which have no inputs).",
             "", "```bash", *(study.get("command", "python -m metadist.bench.solver_bench") for study in studies), "```", ""]
    header = ("model", "mesh", "nodes", "without rule", "load s (CPU)", "capture s (CPU)", "discovery s (CPU)",
              "problem s", "ILP build s", "solve s", "plan total s (CPU)", "gap", "method", "load")
    rows = []
    for study in studies:
        for model, results in study.get("models", {}).items():
            for row in results:
                front = row.get("front_s", {})

                def phase(name: str) -> str:
                    return "-" if name not in front else f"{front[name][0]:.2f} ({front[name][1]:.2f})"

                gap = row.get("mip_gap")
                rows.append([model, row["mesh"], str(row["graph_nodes"]), str(row.get("nodes_without_rule", "-")),
                             phase("load"), phase("capture"), phase("discovery"), f"{row['problem_build_s']:.2f}",
                             f"{row['build_s']:.2f}", f"{row['solve_s']:.2f}",
                             f"{row['plan_total_s']:.2f} ({row['plan_total_cpu_s']:.2f})",
                             "-" if gap is None else f"{gap:.3g}", str(row.get("method")),
                             f"{row['load_average_1min']:.1f}" if "load_average_1min" in row else "-"])
    return lines + [markdown_table(header, rows), ""] + ([notes.strip(), ""] if notes.strip() else [])


def page(runs: Sequence[BenchRun], scale: dict | None, images: dict[str, str], commands: Sequence[str],
         pipeline: dict | None = None, recompute: dict | None = None, pipeline_run: dict | None = None,
         planning: Sequence[dict] = (), overhead: dict | None = None, planning_notes: str = "") -> str:
    first = runs[0]
    machine, versions = first.machine, first.versions
    parts = [
        "# Benchmarks: MetaDist against DDP, ZeRO-2, ZeRO-3 and Megatron-style tensor parallelism",
        "",
        "_Generated by `make bench` (`python -m metadist.bench.suite`) from the result files of a real run; "
        "do not edit by hand._",
        "",
        "## Machine and versions (read at run time)",
        "",
        f"- CPUs: {machine.get('cpu_count')} ({machine.get('processor')}), {machine.get('platform')}; "
        f"GPU: {machine.get('gpu')}; backend: {first.backend} on {first.device}",
        "- " + ", ".join(f"{name} {version}" for name, version in versions.items()),
        *_load_lines(runs),
        "",
        "## Commands",
        "",
        "```bash",
        *commands,
        *(run.command for run in runs),
        *([recompute["command"]] if recompute and "command" in recompute else []),
        "```",
        "",
        _method_notes(first),
    ]
    for run in runs:
        shapes = ", ".join(f"{key} {tuple(value)}" for key, value in run.batch_shapes.items())
        parts += [f"## {run.model}: {run.world_size} processes, mesh {'x'.join(map(str, run.mesh_shape))}", "",
                  f"{run.params:,} parameters; global batch {shapes}; {run.warmup} warm-up and {_timed_words(run)} "
                  f"after 2 profiled ones, {_timing_words(run)}.", "", run_table(run), ""]
        experts = [f"- {result.method}: {result.note.split('; ', 1)[1]}" for result in run.methods
                   if result.ok and "; expert weights" in result.note]
        if experts:
            parts += ["MetaDist's plans for the experts (the ILP's choice, priced with the collectives it implies):",
                      "", *experts, "",
                      "The baselines run the library's own experts code (`grouped_mm`: each token through its `k` "
                      "experts); MetaDist runs the static dropless dispatch it captured "
                      "(`metadist.frontends.torch.moe`: every expert over `S` slots per group of `S` tokens, `E / k` "
                      "times the expert rows, plus the one-hot dispatch and combine matmuls), the same function up "
                      "to rounding (*rel. diff*).", ""]
    parts += ["## Where MetaDist wins and where it loses", "",
              "Each line sets MetaDist's better row (ILP or beam) against the best distributed baseline on one "
              "figure; worst first.", "", *gap_lines(runs), "",
              "Collectives per step and their mean payload, per method:", "", *call_lines(runs), "",
              "Why, as far as these figures show: on gloo every call pays a round trip between processes, so a "
              "hundred small collectives cost more than a few large ones of the same total size. MetaDist coalesces "
              "its reshards into buckets (one call for the gradients of the update, as DDP's buckets; one call per "
              "mesh axis for the state gathered at the end of the step), but a value resharded in the forward or "
              "backward pass is mostly read right after it is made and still takes a call of its own, where DDP "
              "needs none there, and a multi-axis reshard takes one call per mesh axis. Overlap hides a collective "
              "only behind the local ops between its issue and its first reader; in these small steps the gradients "
              "form one bucket made at the end of the backward pass and read at once by the optimizer, so little is "
              "hidden (compare *metadist-ilp* with *metadist-ilp-sync*), and on a loaded CPU gloo's threads compete "
              "with the compute for cores. MetaDist's plans also move more bytes than DDP's (the solver shards the "
              "update, ZeRO-style, and gathers the result). Its peak memory is set inside the bucketed collectives of the update: the packed buffer, "
              "gloo's own copy (gloo reduce-scatters by all-reducing a clone of the whole input) and the result, "
              "next to the gathered parameters the plan returns; with overlap on, a bucket's members are freed once "
              "packed, before the collective runs.", ""]
    never_lose = never_lose_lines(runs)
    if never_lose:
        parts += ["## Never lose: MetaDist against the best baseline, per model and mesh", "",
                  f"MetaDist's measured median step over the fastest distributed baseline's (all fit in this machine's "
                  f"memory); where it is above {NEVER_LOSE_RATIO}, the line says why, from the figures.", "", *never_lose, ""]
    prediction = prediction_rows(runs)
    if prediction:
        clusters = sorted({str(result.predicted["cluster"]) for run in runs for result in run.methods
                           if result.ok and result.predicted.get("cluster")})
        named = ", ".join(f"`{name}`" for name in clusters) or "cluster not recorded"
        parts += [f"## The cost model against the measurements (this machine; cost model: {named})", "",
                  "`calibrated-gloo` is this machine as `metadist calibrate` measured it (run automatically on first "
                  "use and cached); `cpu-gloo` is the fixed preset older result files were predicted with. Predicted "
                  "wire bytes count what the rank program sends (a resharding shared by its readers once, gloo's "
                  "reduce-scatter as the all-reduce it runs). MetaDist's rows are priced as their lowered rank "
                  "program runs: the cost model's compute, and each collective call of the program once (a coalesced "
                  "bucket pays one call's fixed cost; result files older than that carry the solver's estimate, which "
                  "shares a bucket's fixed cost by an estimate). torch's DDP and FSDP2 (ddp, zero2, zero3) are priced as they "
                  "run: one all-reduce per gradient bucket as DDP fills them (1 MiB first, then 25 MiB, no parameter "
                  "split); per FSDP unit its all-gathers and its reduce-scatter "
                  "(from calibration version 14, on all the processes: what FSDP2 was measured to add per unit of "
                  "its bytes, its copies and hooks included), at the eager per-node cost (result files older than that carry the solver's dp/ZeRO layouts' "
                  "estimates). torch's TP (tp, tp-dp) is priced as it runs too: one blocking all-reduce per row-wise "
                  "output and per column-wise input gradient, FSDP2 per unit on the data-parallel axis of tp-dp. FSDP2 "
                  "and TP also pay the calibrated cost of each op they run on a DTensor (the optimizer's, "
                  "calibration version 13, and TP's parallel modules', each a linear's op timed on DTensors from "
                  "version 32), and from version 34 what DTensor adds to each of TP's all-reduces in the calling "
                  "thread; older result files price the Megatron rows as the "
                  "solver's Megatron layout, with MetaDist's collectives. Where the calibration measured a call's "
                  "wait by the compute before it, MetaDist's calls wait by the compute their program runs before each, "
                  "torch's by the step's compute spread evenly between its calls.", "",
                  _ratio_summary(prediction), "",
                  markdown_table(("model", "method", "predicted ms", "measured ms", "measured/predicted",
                                  "predicted wire/rank", "measured wire/rank", "measured/predicted"), prediction), ""]
    if scale:
        from .scale_study import DEVICE_COUNTS, SCALE_MODELS

        missing = missing_scale_cells(scale, SCALE_MODELS, DEVICE_COUNTS)
        parts += ["## Simulated scale study (cost model only, `%s` preset)" % scale.get("cluster", "?"), "",
                  "Estimated by the same cost model for every layout; no GPU ran. Layouts that do not fit in 80 GB per "
                  "GPU are marked **no**. One sequence per GPU (weak scaling). The baselines are the solver's own "
                  "(`baseline_plan`): each fixes how parameters, optimizer states and the batch lie at the start of "
                  "the step and lets the ILP choose every other sharding, so each is the cheapest plan of its family "
                  "by the cost model; where MetaDist's estimate equals one, the ILP found that family cheapest. "
                  "*megatron* is TP over the inner mesh axis (within a node) and DP over the outer. *solver*: the ILP's status; a plan "
                  "found at the time limit is the best one found, not a proven optimum. Given the error of the cost "
                  "model measured above, read these as the model's ranking of the layouts, not as step times.", "",
                  *scale_verdicts(scale), "",
                  "MetaDist plans on the mesh it is given ((8,) for one node, (8, 8) for 8 nodes); it does not choose "
                  "the mesh shape, so a hand-written layout on another mesh (the *best 2-D* rows) can beat it.", "",
                  scale_tables(scale), ""]
        if missing:
            parts += [f"Not in this study (the run did not reach them): {', '.join(missing)}.", ""]
    if planning:
        parts += planning_section(planning, planning_notes)
    if pipeline:
        parts += pipeline_section(pipeline)
    if recompute:
        from .recompute_demo import markdown as recompute_markdown

        parts += [f"## Recomputation inside the search (cost model only, `{recompute.get('cluster', '?')}` preset)", "",
                  "A budget no plan meets without activation recomputation: the ILP chooses, per repeated layer, to "
                  "keep or recompute (priced in forward compute and in the memory of every peak the layer's saved "
                  "activations span) together with the shardings (`metadist.solver.recompute`). Every plan is priced by "
                  "the same cost model; *zero3+recompute* is ZeRO-3 with every layer recomputing.", "",
                  "```bash", recompute.get("command", "python -m metadist.bench.recompute_demo"), "```", "",
                  *recompute_markdown(recompute), ""]
    if pipeline_run:
        from .pipeline_run import markdown as pipeline_run_markdown

        parts += ["## Pipeline execution, measured (CPU, gloo)", "",
                  "A pipeline run (`--mesh pp=N`, 1F1B) and a run of the ILP's plan without a pipeline (`--mesh dp=N`) of "
                  "the same step on the same processes, alternated, each with `--check`: the median step after the first, "
                  "over every repeat. pp/dp below 1: the pipeline is faster. At these sizes a step is mostly per-op "
                  "overhead, which every microbatch pays again on each stage, so more microbatches cost more here; a "
                  "pipeline sends one activation and its gradient per microbatch where data parallelism all-reduces "
                  "every gradient. *load*: the machine's 1-minute load average on 2 cores at the end.", "",
                  *pipeline_run_markdown(pipeline_run), ""]
    if overhead:
        from .overhead_bench import markdown as overhead_markdown

        parts += ["## One process: the compiled step against the eager step", "",
                  "The same model, optimizer and batch on one process, timed step by step in turn: the user's eager step, "
                  "the captured graph interpreted node by node, MetaDist's compiled rank program built one node per op, and "
                  "as `metadist.compile` builds it, small elementwise ops batched into `_foreach` calls and repeated small "
                  "ops merged (`metadist.runtime.batching`). Both compiled columns are timed after their first call, "
                  "which takes out the layout calls that did nothing and calls each op through torch's Python binding "
                  "where that makes the same call (`metadist.runtime.graph_module.FirstRunProbe`). Milliseconds "
                  "(median), ratio to eager in brackets. What is left over eager is mostly the step's wrapper: the "
                  "variant key, and reading and writing the state where the model holds it.", "",
                  "```bash", overhead.get("command", "python -m metadist.bench.overhead_bench"), "```", "",
                  *overhead_markdown(overhead), ""]
    parts += ["## Plots", ""] + [f"![{title}]({path})" for title, path in images.items()] + [""]
    return "\n".join(parts)


def _load_lines(runs: Sequence[BenchRun]) -> list[str]:
    """The 1-minute load average when each run ended: the machine may be shared, and timings move with it."""
    loads = [f"{run.model} {run.machine['load_average_1min']:.1f}" for run in runs if "load_average_1min" in run.machine]
    if not loads:
        return []
    return [f"- 1-minute load average at the end of each run (on {runs[0].machine.get('cpu_count')} CPUs): "
            f"{', '.join(loads)}. Above the CPU count, processes wait for a core and step times stretch."]


def _timed_words(run: BenchRun) -> str:
    """How many timed steps each method took: ``steps``, or the range its rows took where steps were added to span
    ``min_timed_s`` (the losses compared after ``steps``); with turns of several steps, how many turns of how many."""
    counts = sorted({len(result.step_times_s) for result in run.methods if result.ok and result.step_times_s})
    k = run.turn_steps
    unit = "timed steps" if k == 1 else f"timed turns of {k} steps"
    if not run.min_timed_s or not counts or counts == [run.steps]:
        return f"{run.steps} {unit}"
    taken = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    compared = run.steps if k == 1 else f"{run.steps} turns"
    return (f"{taken} {unit} (at least {run.steps}, more to span about {run.min_timed_s:g} s; losses compared "
            f"after {compared})")


def _timing_words(run: BenchRun) -> str:
    if run.timing == "interleaved":
        alone = ("" if not run.timed_alone else f"; {run.timed_alone[0]} timed on its own first" if len(run.timed_alone) == 1
                 else f"; {', '.join(run.timed_alone)} each timed on its own first")
        return f"the methods taking their warm-up and timed steps in turn (interleaved){alone}"
    return "each method timed on its own, one after the other"


def _method_notes(run: BenchRun) -> str:
    return "\n".join([
        "## How it is measured",
        "",
        "- One invocation runs every method on the same seeded model, the same global batch and the same processes. "
        "Dropout is off (all dropout probabilities 0), so every method computes the same function; final losses must "
        f"agree with the single-device loss to a relative {run.loss_rtol:.0e} (column *rel. diff*).",
        "- *median ms*: the median over the timed steps of the slowest rank's step time; *p25-p75*: its spread. "
        "*vs DDP*: median over DDP's median. A timed step is a turn of consecutive steps after a barrier, timed "
        "together (`--turn-steps`; each section says how many): a training loop runs its steps back to back, and one "
        "step after each barrier ran gpt2-tiny's steps on 2 processes 10-20 % slower.",
        "- *Interleaved* timing (the harness's default, `--timing interleaved`): every method is built and profiled "
        "first and kept; then each round gives every method a turn, the order rotated by one each round, "
        "so a machine whose speed drifts over minutes slows every method alike and their ratios hold. The methods "
        "named by `--timed-alone` (by default *single*, the one-device reference and the largest in memory) are timed "
        "on their own first, so that those alive together fit in memory. The methods share their processes, and on CPU "
        "glibc keeps freed host memory for every method from the run's start (`METADIST_HOST_HEAP`, which a compiled step "
        "sets for its process; result files whose machine lacks `host_heap` set it only once MetaDist's step was built, "
        "so the methods timed alone ran without it). Measured one "
        "after the other (`--timing sequential`, and the older result files), such a drift between two methods' turns "
        "moved MetaDist/DDP on gpt-85m by 10-20 % between runs of the same code. Each section says which it used.",
        "- *comm payload/rank*: bytes of every collective this rank issued in one step, read from the c10d ops of a "
        "`torch.profiler` trace (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input); "
        "*wire/rank*: what a ring algorithm sends for them over each one's process group (the group's size from the "
        "trace's shapes on a one-axis mesh, else from torch's flight recorder, which logs each collective's group). "
        "Gloo carries out reduce-scatter as an all-reduce.",
        "- *state/peak mem/rank*: on CPU, the running sum of the c10 allocator's allocation events (profiler, "
        "`profile_memory=True`) from the method's build on: held at the start of the measured step, and at its peak; "
        "on GPU, `torch.cuda.max_memory_allocated`. Every method, MetaDist included, is counted the same way with "
        "nothing left out: each builds from its own copy of the seeded source model made inside the measured window, "
        "so the figures count that copy, what the method builds from it (DDP's buckets, FSDP2's or MetaDist's shards), "
        "the full tensors it frees (FSDP2 and MetaDist keep only this rank's shards in the model), gradients, optimizer "
        "states and what the steps allocate. Only the source model itself, the same for every method, and memory "
        "outside the c10 allocator (gloo's own buffers, Python objects) are outside the figures.",
        "- ZeRO-2 is FSDP2 with `reshard_after_forward=False`, ZeRO-3 with `True` (one unit per transformer block "
        "and the root). Megatron TP splits attention and MLP projections column-then-row; embeddings, norms and the LM "
        "head stay replicated. GPT-2's `Conv1D` layers are converted to equal `nn.Linear` layers for TP. tp-dp is TP "
        "on the inner mesh axis and FSDP2 (ZeRO-2 style) on the outer.",
        "- MetaDist's compile time (capture, discovery, solve, lowering) is measured outside the profiler; discovery "
        "reads the rule database, so it is short once the signatures are known.",
        "- MetaDist coalesces its collectives as DDP and FSDP bucket gradients: reshards of the same kind, mesh axis, "
        "reduce op and dtype that can run at the same point share one call on a flat buffer (buckets of at most 25 MiB, "
        "`metadist.lowering.coalesce`); its *calls* column counts those calls, and its cost model prices the gradient "
        "reductions of the update as buckets (`metadist.cost.bucketing`). Identical collectives on one value (two "
        "reshards of it that start alike) run once.",
        "- MetaDist overlaps communication with computation (`metadist.lowering.overlap`): each collective or bucket is "
        "issued right after its last source is made and waited for right before its first reader, with at most two "
        "buckets' worth of buffers in flight. *metadist-ilp-sync* runs the same plan with overlap off (every collective "
        "waited for where it is issued), in the same run, so the two rows show what overlap changes.",
        "- *metadist-ilp-bf16* captures and plans the step under the bf16 precision policy (`--precision bf16`: float32 "
        "master weights and optimizer state, bfloat16 computation, gradients reduced in float32): next to "
        "*metadist-ilp* it shows what bfloat16 changes in step time and memory on this machine. Its loss differs from "
        "the float32 loss by bfloat16 rounding (column *rel. diff*), and it takes no part in the comparisons with the "
        "float32 baselines.",
        "- *metadist-ilp-recompute* and *metadist-ilp-bf16-recompute* run the same steps with every repeated layer "
        "recomputing its forward before its backward (full activation checkpointing, `metadist.solver.recompute`: the "
        "layer's forward nodes cloned before its backward, its random draws kept), planned by the same ILP: next to "
        "the rows without it they show what recomputation changes in step time and peak memory on this machine.",
        "",
    ])


# ---------------------------------------------------------------- plots


def plot_all(runs: Sequence[BenchRun], scale: dict | None, image_dir: Path, link_prefix: str) -> dict[str, str]:
    """Write the PNGs; returns title -> path relative to the page."""
    import matplotlib

    matplotlib.use("Agg")
    image_dir.mkdir(parents=True, exist_ok=True)
    images = {}
    images["step time by method (bars: p25-p75)"] = _bars(
        runs, lambda r: r.median_step_s * 1e3, "median step time (ms)", image_dir / "step_time.png", link_prefix,
        spread=lambda r: (r.median_step_s - r.spread_s[0], r.spread_s[1] - r.median_step_s))
    images["peak memory by method"] = _bars(runs, lambda r: r.peak_memory_bytes / 2**20, "peak memory per rank (MiB)",
                                            image_dir / "memory.png", link_prefix)
    compile_path = _compile_plot(runs, scale, image_dir / "compile_time.png", link_prefix)
    if compile_path:
        images["MetaDist compile time by model size"] = compile_path
    predicted_path = _prediction_plot(runs, image_dir / "predicted_vs_measured.png", link_prefix)
    if predicted_path:
        images["cost model: predicted vs measured"] = predicted_path
    return images


def _bars(runs: Sequence[BenchRun], value, label: str, path: Path, link_prefix: str, spread=None) -> str:
    """One panel per run, one bar per method (MetaDist in red); ``spread`` gives (below, above) error bars in seconds."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.8), squeeze=False)
    for ax, run in zip(axes[0], runs):
        ok = [result for result in run.methods if result.ok]
        errors = None
        if spread is not None:
            pairs = [spread(result) for result in ok]
            errors = [[low * 1e3 for low, _ in pairs], [high * 1e3 for _, high in pairs]]
        ax.bar([result.method for result in ok], [value(result) for result in ok], yerr=errors, capsize=3,
               color=["tab:red" if result.method in (*METADIST, *METADIST_MIXED) else "tab:blue" for result in ok])
        ax.set_title(f"{run.model} ({run.world_size} procs)")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"{link_prefix}{path.name}"


def _compile_points(runs: Sequence[BenchRun], scale: dict | None) -> list[tuple[str, int, dict]]:
    points = {}
    for run in runs:
        for result in run.methods:
            if result.method == "metadist-ilp" and result.ok and result.compile_s:
                points[run.model] = (run.params, dict(result.compile_s))
    complete = [row for row in (scale or {}).get("rows", [])
                if row["method"] == "metadist" and "solve" in row.get("compile_s", {})]  # planned (fits) rows only
    for row in sorted(complete, key=lambda row: row["devices"]):
        points.setdefault(f"{row['model']}\n{row['devices']} GPUs", (row.get("params", 0), row["compile_s"]))
    return sorted(((name, params, stages) for name, (params, stages) in points.items()), key=lambda item: item[1])


def _compile_plot(runs: Sequence[BenchRun], scale: dict | None, path: Path, link_prefix: str) -> str | None:
    import matplotlib.pyplot as plt

    points = _compile_points(runs, scale)
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(points)
    labels = [f"{name}\n{params / 1e6:.1f}M" for name, params, _ in points]
    for stage in ("capture", "discovery", "solve", "lowering"):
        heights = [stages.get(stage, 0.0) for _, _, stages in points]
        ax.bar(labels, heights, bottom=bottom, label=stage)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("seconds")
    ax.set_title("MetaDist compile time by model size (shared machine; see load)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"{link_prefix}{path.name}"


def _prediction_plot(runs: Sequence[BenchRun], path: Path, link_prefix: str) -> str | None:
    import matplotlib.pyplot as plt

    pairs = [(result.predicted, result, run.model) for run in runs for result in run.methods
             if result.ok and result.predicted and result.predicted.get("step_s")]
    if not pairs:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for predicted, result, model in pairs:
        left.scatter(predicted["step_s"] * 1e3, result.median_step_s * 1e3)
        left.annotate(f"{model}/{result.method}", (predicted["step_s"] * 1e3, result.median_step_s * 1e3), fontsize=6)
        if result.comm_wire_bytes is not None and predicted.get("comm_bytes"):
            right.scatter(predicted["comm_bytes"], result.comm_wire_bytes)
            right.annotate(f"{model}/{result.method}", (predicted["comm_bytes"], result.comm_wire_bytes), fontsize=6)
    from matplotlib.ticker import NullFormatter

    for ax, what in ((left, "step time (ms)"), (right, "wire bytes per rank")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        low = min(ax.get_xlim()[0], ax.get_ylim()[0])
        high = max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.plot([low, high], [low, high], "k--", linewidth=0.8, label="predicted = measured")
        ax.legend(loc="lower right", fontsize=7)
        ax.set_xlabel(f"predicted {what}")
        ax.set_ylabel(f"measured {what}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"{link_prefix}{path.name}"


# ---------------------------------------------------------------- entry point


def load_runs(directory: Path) -> list[BenchRun]:
    """The result files of ``directory``, models that inform first (:func:`run_order`)."""
    files = sorted(directory.glob("*.json"))
    runs = [BenchRun.from_json(path.read_text()) for path in files if _is_bench_file(path)]
    if not runs:
        raise FileNotFoundError(f"no benchmark result files (format metadist.bench) in {directory}; run the harness first")
    return sorted(runs, key=run_order)


LEADING_MODELS = ("gpt2-small", "gpt-85m", "gpt_85m")
"""Models the page leads with (sizes that inform: GPT-2 small, 124M, and the 12-layer 768-wide GPT), before the tiny ones."""


def run_order(run: BenchRun) -> tuple:
    """Leading models first (in :data:`LEADING_MODELS` order), then the others by parameter count, largest first."""
    name = run.model.rsplit("/", 1)[-1].removesuffix(".py")
    lead = next((index for index, model in enumerate(LEADING_MODELS) if name.startswith(model)), len(LEADING_MODELS))
    return (lead, -run.params, run.model, run.world_size)


NEVER_LOSE_RATIO = 1.05
"""MetaDist's measured median step may be at most this many times the best baseline's (issue: never lose)."""


def never_lose_lines(runs: Sequence[BenchRun]) -> list[str]:
    """Per model and mesh: MetaDist's median step over the best distributed baseline's, and why where it is > 1.05."""
    lines = []
    for run in runs:
        where = f"{run.model} on {run.world_size} processes (mesh {'x'.join(map(str, run.mesh_shape))})"
        ours = run.method("metadist-ilp")
        best = _best(run, DISTRIBUTED_BASELINES, lambda r: r.median_step_s)
        if ours is None or best is None:
            continue
        if not ours.ok:
            lines.append(f"- {where}: **metadist-ilp {ours.status}**: {ours.reason}")
            continue
        ratio = ours.median_step_s / best.median_step_s
        head = f"- {where}: metadist-ilp {fmt_ms(ours.median_step_s)} ms / {best.method} {fmt_ms(best.median_step_s)} ms = **x{ratio:.2f}**"
        lines.append(head + ("" if ratio <= NEVER_LOSE_RATIO else f"; why: {_why_slower(ours, best)}"))
    return lines


def _why_slower(ours: MethodResult, best: MethodResult) -> str:
    """One line: what the figures say about a loss (the cost model's view against the measurement), led by the static
    experts' extra work where the model routes tokens (the baselines, torch's own, run the library's experts on their
    routed tokens only)."""
    experts = ours.predicted.get("expert_rows_over_routed")
    lead = (f"the experts run with static shapes, computing x{experts:.1f} the token rows the routing asks for "
            f"({best.method} runs the library's experts on their routed tokens only); " if experts and experts > 1 else "")
    return lead + _why_slower_figures(ours, best)


def _why_slower_figures(ours: MethodResult, best: MethodResult) -> str:
    count = sum(ours.comm_calls_by_kind.values())
    calls = f"{count} collective call{'' if count == 1 else 's'} against {sum(best.comm_calls_by_kind.values())}"
    ours_s, best_s = ours.predicted.get("step_s"), best.predicted.get("step_s")
    if not ours_s:
        return f"no cost-model estimate was recorded for MetaDist's plan; {calls}"
    under = ours.median_step_s / ours_s
    if not best_s:
        return (f"{best.method} is not one of the solver's baselines, so the planner could not price it; MetaDist's "
                f"step took x{under:.1f} its estimate; {calls}")
    nodes, runtime_s, eager_s = ours.predicted.get("nodes"), ours.predicted.get("op_overhead_s"), ours.predicted.get("eager_op_overhead_s")
    if nodes and runtime_s and eager_s and runtime_s > eager_s:
        # the calibration measured both: the captured step run by MetaDist's runtime and the same step run eagerly
        per_node_s = nodes * (runtime_s - eager_s)
        lost_s = ours.median_step_s - best.median_step_s
        return (f"the captured step's {nodes} nodes cost {runtime_s * 1e6:.0f} us each in MetaDist's runtime against "
                f"{eager_s * 1e6:.0f} us eagerly (calibration: x{runtime_s / eager_s:.1f} per node, {per_node_s * 1e3:.1f} ms "
                f"a step), and {calls}; predicted x{ours_s / best_s:.2f} of {best.method}, measured x{ours.median_step_s / best.median_step_s:.2f} "
                f"({lost_s * 1e3:.1f} ms lost, {min(1.0, per_node_s / lost_s):.0%} of it the per-node cost)")
    return (f"the cost model put MetaDist's plan at x{ours_s / best_s:.2f} of the solver's {best.method} layout, but "
            f"MetaDist's step took x{under:.1f} its estimate and {best.method}'s x{best.median_step_s / best_s:.1f} "
            f"({best.method} here is torch's own implementation, not the solver's layout); {calls}")


def _is_bench_file(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("format") == "metadist.bench"
    except (OSError, json.JSONDecodeError):
        return False


def write_report(results_dir: Path, out: Path, scale_path: Path | None = None, commands: Sequence[str] = ()) -> Path:
    """Write the page and its images (under ``out``'s folder, ``img/``); returns the page's path."""
    runs = load_runs(results_dir)
    scale = json.loads(scale_path.read_text()) if scale_path is not None and scale_path.is_file() else None
    images = plot_all(runs, scale, out.parent / "img", "img/")
    from ..files import write_atomically

    studies = [json.loads(path.read_text()) for path in sorted(scale_path.parent.glob("pipeline_study*.json"))] \
        if scale_path is not None else []
    pipeline = None if not studies else {"cluster": studies[0].get("cluster"), "rows": [r for s in studies for r in s["rows"]],
                                         "commands": [s["command"] for s in studies if "command" in s]}
    recompute_path = scale_path.parent / "recompute_demo.json" if scale_path is not None else None
    recompute = json.loads(recompute_path.read_text()) if recompute_path is not None and recompute_path.is_file() else None
    pipeline_run_path = scale_path.parent / "pipeline_run.json" if scale_path is not None else None
    pipeline_run = (json.loads(pipeline_run_path.read_text())
                    if pipeline_run_path is not None and pipeline_run_path.is_file() else None)
    planning = [json.loads(path.read_text()) for path in sorted(scale_path.parent.glob("solver_bench*.json"))] \
        if scale_path is not None else []
    overhead_path = scale_path.parent / "overhead.json" if scale_path is not None else None
    overhead = json.loads(overhead_path.read_text()) if overhead_path is not None and overhead_path.is_file() else None
    notes_path = scale_path.parent / PLANNING_NOTES if scale_path is not None else None
    notes = notes_path.read_text() if notes_path is not None and notes_path.is_file() else ""
    write_atomically(out, page(runs, scale, images, commands, pipeline, recompute, pipeline_run, planning, overhead, notes))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metadist.bench.report", description=__doc__.split("\n")[0])
    parser.add_argument("--results", required=True, type=Path, help="folder of harness result JSON files")
    parser.add_argument("--scale", type=Path, default=None, help="the scale study's JSON")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args(argv)
    write_report(args.results, args.out, args.scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
