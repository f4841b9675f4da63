"""Benchmark harness pieces that need no process group: the byte counter's parsing, the memory
tracker, loss scaling, the GPT-2 TP conversion, result JSON, and the report generator."""

from __future__ import annotations

import copy

import json
import os

import pytest
import torch

from metadist.bench.baselines import disable_dropout, local_batch, loss_scale, shard_units
from metadist.bench.comm_count import MEMORY_EVENT, TraceEvent, count_collectives, window
from metadist.bench.memory_track import cpu_memory_peak
from metadist.bench.results import STATUS_OK, STATUS_UNAVAILABLE, BenchRun, MethodResult
from metadist.bench.tp_plans import convert_gpt2_for_tp


def _op(name, start, shapes, dtypes=()):
    return TraceEvent(name=name, start_ns=start, end_ns=start + 1, shapes=shapes, dtypes=dtypes)


def test_counter_reads_payload_of_each_collective_kind():
    events = [
        TraceEvent(name="bench:step1", start_ns=0, end_ns=1000),
        # all-reduce of a tensor list: dtype from the backend event that carries it out
        _op("c10d::allreduce_", 10, ([[100], [28]], [], []), ("TensorList", "", "")),
        _op("gloo:all_reduce", 11, ([128],), ("float",)),
        # all-gather into a tensor: output [2 x 50] of an input [50] -> group of 2
        _op("c10d::_allgather_base_", 20, ([100], [50], []), ("float", "float", "")),
        _op("c10d::_reduce_scatter_base_", 30, ([25], [50], []), ("c10::BFloat16", "c10::BFloat16", "")),
        _op("c10d::allreduce_", 2000, ([[1000]],), ("TensorList",)),  # outside the window
    ]
    count = count_collectives(events, *window(events, "bench:step1"), default_group_size=2)
    assert count.bytes_by_kind() == {"all_reduce": 128 * 4, "all_gather": 100 * 4, "reduce_scatter": 50 * 2}
    assert count.calls_by_kind() == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}
    # ring on 2 ranks: all-reduce sends its buffer once, gathers and scatters half of it
    assert count.wire_bytes == pytest.approx(128 * 4 + 100 * 4 / 2 + 50 * 2 / 2)
    assert count.assumed_dtype_calls == 0


def test_missing_window_names_the_regions_present():
    with pytest.raises(LookupError, match="bench:build"):
        window([TraceEvent(name="bench:build", start_ns=0, end_ns=1)], "bench:step1")


def test_memory_peak_is_the_running_sum_inside_the_window():
    def alloc(t, nbytes):
        return TraceEvent(name=MEMORY_EVENT, start_ns=t, end_ns=t, nbytes=nbytes)

    events = [alloc(1, 1000), alloc(2, 500), alloc(3, -500),  # build: 1000 held
              alloc(11, 300), alloc(12, 200), alloc(13, -400), alloc(30, 5000)]  # step in [10, 20]
    peak = cpu_memory_peak(events, 10, 20)
    assert (peak.state_bytes, peak.peak_bytes) == (1000, 1500)


def test_loss_scale_makes_data_parallel_mean_the_whole_batch_loss():
    labels = torch.tensor([[5, -100, -100, -100], [5, 6, 7, -100]])  # masked LM: 1 and 3 targets
    whole = {"input_ids": labels.clone(), "labels": labels}
    halves = [local_batch(whole, 2, index) for index in range(2)]
    scales = [loss_scale(half, whole, "bert", 2) for half in halves]
    assert scales == [pytest.approx(2 * 1 / 4), pytest.approx(2 * 3 / 4)]
    causal = {"input_ids": labels.abs(), "labels": labels.abs()}
    assert loss_scale(local_batch(causal, 2, 0), causal, "llama", 2) == 1.0


def test_gpt2_conversion_to_linear_keeps_the_function():
    from metadist.workloads import builtin_workload

    workload = builtin_workload("gpt2-tiny")
    disable_dropout(workload.model)
    converted = copy.deepcopy(workload.model)
    convert_gpt2_for_tp(converted, tp_degree=1)
    batch = workload.batch
    want = workload.loss_fn(workload.model, batch)
    got = workload.loss_fn(converted, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(shard_units(converted)) == 2


def _fixture_run() -> BenchRun:
    """A small result fixture for the report generator (test data only; never written to docs/)."""
    def ok(method, time_s, loss, **extra):
        return MethodResult(method=method, status=STATUS_OK, mesh_shape=(2,), step_times_s=(time_s, time_s * 1.1, time_s * 0.9),
                            comm_payload_bytes=extra.pop("payload", 1000), comm_wire_bytes=500.0,
                            comm_calls_by_kind={"all_reduce": 2}, state_memory_bytes=4096, peak_memory_bytes=8192,
                            memory_source="cpu-profiler", final_loss=loss, **extra)

    methods = (
        ok("single", 0.001, 2.0),
        ok("ddp", 0.002, 2.0000001),
        ok("metadist-ilp", 0.004, 2.0, payload=3000, compile_s={"capture": 0.5, "discovery": 0.1, "solve": 0.2, "lowering": 0.05},
           predicted={"step_s": 0.001, "comm_bytes": 400.0, "memory_bytes": 5000.0}),
        MethodResult(method="tp", status=STATUS_UNAVAILABLE, reason="no plan for the cnn family"),
    )
    return BenchRun(model="fixture", world_size=2, mesh_shape=(2,), backend="gloo", device="cpu", steps=3, warmup=1,
                    batch_shapes={"x": (4, 8)}, params=123, machine={"cpu_count": 2, "gpu": "none"},
                    versions={"torch": torch.__version__}, command="python -m ... fixture", methods=methods)


def test_results_round_trip_through_json():
    run = _fixture_run()
    again = BenchRun.from_json(run.to_json())
    assert again == run
    assert again.method("ddp").median_step_s == pytest.approx(0.002)
    assert again.loss_agreement()["ddp"] == pytest.approx(5e-8)


def test_report_writes_page_and_plots(tmp_path):
    from metadist.bench.report import write_report

    results = tmp_path / "results"
    results.mkdir()
    (results / "fixture.json").write_text(_fixture_run().to_json())
    page = write_report(results, tmp_path / "docs" / "benchmarks.md", commands=["make bench"]).read_text()
    assert "| metadist-ilp | 2 | 4.00 |" in page
    assert "**tp**: not available: no plan for the cnn family" in page
    assert "MetaDist loses** (x2.00)" in page  # step time: 4 ms against DDP's 2 ms
    assert "CPUs: 2" in page and "make bench" in page
    for name in ("step_time.png", "memory.png", "compile_time.png", "predicted_vs_measured.png"):
        assert (tmp_path / "docs" / "img" / name).stat().st_size > 0


def test_the_planning_section_shows_each_phase_with_its_cpu_seconds_and_the_load():
    from metadist.bench.report import planning_section

    row = {"mesh": "8x8", "graph_nodes": 14027, "nodes_without_rule": 359, "problem_build_s": 2.5, "build_s": 0.1,
           "solve_s": 1.9, "plan_total_s": 7.0, "plan_total_cpu_s": 6.3, "mip_gap": 0.0325, "method": "LP relaxation",
           "front_s": {"load": [3.0, 2.1], "capture": [5.3, 2.9], "discovery": [0.2, 0.2]}, "load_average_1min": 7.4}
    lines = planning_section([{"command": "python -m metadist.bench.solver_bench --models llama-7b", "models": {"llama-7b": [row]}}])
    assert "python -m metadist.bench.solver_bench --models llama-7b" in lines
    assert "| llama-7b | 8x8 | 14027 | 359 | 3.00 (2.10) | 5.30 (2.90) | 0.20 (0.20) | 2.50 | 0.10 | 1.90 | 7.00 (6.30) | 0.0325 " \
           "| LP relaxation | 7.4 |" in "\n".join(lines)


def _report_folders(tmp_path):
    """A results folder holding the fixture run, and a docs/bench folder with an empty scale study."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "fixture.json").write_text(_fixture_run().to_json())
    bench = tmp_path / "docs" / "bench"
    bench.mkdir(parents=True)
    (bench / "scale_study.json").write_text("{}")
    return results, bench


def test_the_overhead_section_renders_each_column_against_eager(tmp_path):
    from metadist.bench.report import write_report

    results, bench = _report_folders(tmp_path)
    (bench / "overhead.json").write_text(json.dumps({
        "command": "python -m metadist.bench.overhead_bench gpt2-tiny --steps 30 --out docs/bench/overhead.json",
        "load_average_1min": 0.3, "rows": [{"model": "gpt2-tiny", "eager_ms": 5.0, "graph_ms": 10.0,
                                            "unbatched_ms": 7.5, "compiled_ms": 6.0}]}))
    page = write_report(results, tmp_path / "docs" / "benchmarks.md", bench / "scale_study.json").read_text()
    assert "python -m metadist.bench.overhead_bench gpt2-tiny --steps 30" in page
    assert "| gpt2-tiny | 5.00 | 10.00 (2.00x) | 7.50 (1.50x) | 6.00 (1.20x) |" in page


def test_the_planning_notes_written_by_hand_survive_regenerating_the_page(tmp_path):
    from metadist.bench.report import PLANNING_NOTES, write_report

    results, bench = _report_folders(tmp_path)
    row = {"mesh": "8x8", "graph_nodes": 10, "problem_build_s": 1.0, "build_s": 0.1, "solve_s": 0.2, "plan_total_s": 2.0,
           "plan_total_cpu_s": 1.5}
    (bench / "solver_bench_x.json").write_text(json.dumps({"models": {"llama-7b": [row]}}))
    (bench / PLANNING_NOTES).write_text("Before and after, side by side: 9.1 s against 19.5 s.\n")
    page = write_report(results, tmp_path / "docs" / "benchmarks.md", bench / "scale_study.json").read_text()
    section = page[page.index("## Planning time at scale"):]
    assert "| llama-7b | 8x8 | 10 |" in section
    assert section.index("| llama-7b | 8x8 | 10 |") < section.index("Before and after, side by side: 9.1 s against 19.5 s.")


def test_never_lose_states_each_ratio_and_why_it_loses():
    from dataclasses import replace

    from metadist.bench.report import never_lose_lines, run_order

    run = _fixture_run()
    (line,) = never_lose_lines([run])
    assert "metadist-ilp 4.00 ms / ddp 2.00 ms = **x2.00**; why:" in line
    assert "not one of the solver's baselines" in line and "x4.0 its estimate" in line
    fast = replace(run, methods=tuple(replace(m, step_times_s=(0.00204,) * 3) if m.method == "metadist-ilp" else m
                                      for m in run.methods))
    assert never_lose_lines([fast])[0].endswith("= **x1.02**")  # within 1.05: no reason needed
    small = replace(run, model="gpt2-small", params=124_000_000)
    big_tiny = replace(run, model="mixtral-mini", params=10_000_000)
    assert [r.model for r in sorted([big_tiny, run, small], key=run_order)] == ["gpt2-small", "mixtral-mini", "fixture"]


def test_never_lose_names_the_measured_per_node_costs_when_the_calibration_has_them():
    from dataclasses import replace

    from metadist.bench.report import never_lose_lines

    run = _fixture_run()
    per_node = {"step_s": 0.004, "nodes": 1000, "op_overhead_s": 20e-6, "eager_op_overhead_s": 8e-6}
    methods = tuple(replace(m, predicted={**m.predicted, **per_node}) if m.method == "metadist-ilp"
                    else replace(m, predicted={**m.predicted, "step_s": 0.002}) if m.method == "ddp" else m for m in run.methods)
    (line,) = never_lose_lines([replace(run, methods=methods)])
    assert "the captured step's 1000 nodes cost 20 us each in MetaDist's runtime against 8 us eagerly" in line
    assert "x2.5 per node, 12.0 ms a step" in line and "predicted x2.00 of ddp, measured x2.00" in line
    assert line.endswith("(2.0 ms lost, 100% of it the per-node cost)")  # the per-node cost alone covers the loss
    slow = tuple(replace(m, step_times_s=(0.4,) * 3) if m.method == "metadist-ilp" else m for m in methods)
    (line,) = never_lose_lines([replace(run, methods=slow)])
    assert line.endswith("(398.0 ms lost, 3% of it the per-node cost)")  # the rest is outside the per-node figures


def test_wholerun_bench_reports_each_part_and_the_trees_side_by_side():
    from io import StringIO
    from pathlib import Path

    from rich.console import Console

    from metadist.bench.wholerun_bench import WholeRun, report

    trees = [Path("/x/main"), Path("/x/branch")]
    runs = [WholeRun(str(trees[0]), 24.0, 2.0, {"load": 3.0, "capture": 2.0}, 1.0),
            WholeRun(str(trees[1]), 18.0, 2.0, {"load": 3.0, "capture": 1.0}, 1.0),
            WholeRun(str(trees[0]), 26.0, 2.5, {"load": 3.5, "capture": 2.0}, 1.0),
            WholeRun(str(trees[1]), 21.0, 2.0, {"load": 3.0, "capture": 1.0, "solve": 0.5}, 1.0)]
    out = StringIO()
    report(runs, trees, Console(file=out, width=200))
    text = out.getvalue()
    assert "│ wall  " in text and "25.00" in text and "19.50" in text  # medians of each tree's walls
    assert "│ solve " in text and "0.25" in text  # a phase one run lacks counts as 0 s there
    assert "│ rest  " in text and "17.50" in text and "13.25" in text  # wall - before the ranks - phases: 17, 18 and 12, 14.5
    assert "/x/main: walls 24.0, 26.0 s; median 25.0 s (x1.00 of the first tree); 0 of 2 at most 20 s" in text
    assert "/x/branch: walls 18.0, 21.0 s; median 19.5 s (x0.78 of the first tree); 1 of 2 at most 20 s" in text


def test_interleaved_timing_takes_one_step_of_each_method_a_round_rotating_the_order(monkeypatch):
    """Warm-up and timed steps go round the methods, the first of each round one further on; warm-ups are not timed;
    a method timed alone runs first, whole, before the others are built; results keep the methods' order."""
    from metadist.bench import harness
    from metadist.bench.baselines import Prepared

    calls: list[str] = []
    monkeypatch.setattr(harness.dist, "barrier", lambda: calls.append("barrier"))

    def built(method):
        def step():
            calls.append(method)
            return torch.tensor(1.0)
        return harness._Built(method, Prepared(method, step, (), (2,)), None, None, {}, {}, [])

    def build_method(method, workload, ctx):
        calls.append(f"build {method}")
        return built(method)

    def finish_method(item, ctx):
        return MethodResult(method=item.method, status=STATUS_OK, step_times_s=tuple(item.times))

    def measure_method(method, workload, ctx, config):
        calls.append(f"alone {method}")
        return MethodResult(method=method, status=STATUS_OK, step_times_s=(1.0,) * config.steps)

    monkeypatch.setattr(harness, "build_method", build_method)
    monkeypatch.setattr(harness, "finish_method", finish_method)
    monkeypatch.setattr(harness, "measure_method", measure_method)
    config = harness.HarnessConfig(model="mlp", methods=("ddp", "single", "zero3", "metadist-ilp"), steps=3, warmup=1,
                                   mesh_shape=(), batch_size=None, seq_len=None, optimizer="adamw", out="x.json",
                                   predict=False, timeout_s=10.0, timed_alone=("single",), min_timed_s=0.0,
                                   turn_steps=1)
    ctx = type("Ctx", (), {"device": torch.device("cpu")})()
    results = harness.measure_interleaved(config.methods, None, ctx, config)

    assert [r.method for r in results] == ["ddp", "single", "zero3", "metadist-ilp"]
    assert calls[:4] == ["alone single", "build ddp", "build zero3", "build metadist-ilp"]
    steps = [call for call in calls[4:] if call != "barrier"]
    assert steps == ["ddp", "zero3", "metadist-ilp",  # the warm-up round
                     "zero3", "metadist-ilp", "ddp",  # timed rounds, each starting one method further on
                     "metadist-ilp", "ddp", "zero3",
                     "ddp", "zero3", "metadist-ilp"]
    assert calls[4:7] == ["ddp", "zero3", "metadist-ilp"]  # no barrier before an untimed warm-up step
    assert calls.count("barrier") == 9  # one before each timed step
    assert all(len(r.step_times_s) == 3 for r in results)


def test_interleaved_rounds_are_added_until_they_span_min_timed_s_and_losses_stay_after_steps(monkeypatch):
    """Rounds are added after ``steps`` timed ones while they spanned under ``min_timed_s`` (the slowest rank's span,
    agreed with one all-reduce), at most MAX_TIMED_STEPS in all; each method's final loss stays the one after
    ``steps`` timed steps, so that methods are compared after the same number of steps."""
    from dataclasses import replace

    from metadist.bench import harness
    from metadist.bench.baselines import Prepared

    monkeypatch.setattr(harness.dist, "barrier", lambda: None)
    reduced: list[float] = []

    def all_reduce(tensor, op=None):
        reduced.append(float(tensor))
        tensor.fill_(2.0 * float(tensor))  # another rank was twice as slow

    monkeypatch.setattr(harness.dist, "all_reduce", all_reduce)
    clock = iter(range(10**6))
    monkeypatch.setattr(harness.time, "perf_counter", lambda: 0.01 * next(clock))  # every step 10 ms on this rank

    def built(method):
        counter = iter(range(1, 10**6))
        step = Prepared(method, lambda: torch.tensor(float(next(counter))), (), (2,))
        return harness._Built(method, step, None, None, {}, {}, [])

    monkeypatch.setattr(harness, "build_method", lambda method, workload, ctx: built(method))
    monkeypatch.setattr(harness, "finish_method", lambda item, ctx: MethodResult(
        method=item.method, status=STATUS_OK, step_times_s=tuple(item.times), final_loss=float(item.loss)))
    config = harness.HarnessConfig(model="mlp", methods=("ddp", "zero3"), steps=4, warmup=1, mesh_shape=(),
                                   batch_size=None, seq_len=None, optimizer="adamw", out="x.json", predict=False,
                                   timeout_s=10.0, min_timed_s=0.4, turn_steps=1)
    ctx = type("Ctx", (), {"device": torch.device("cpu")})()
    results = harness.measure_interleaved(config.methods, None, ctx, config)
    assert reduced == pytest.approx([0.08])  # 2 methods x 4 timed steps x 10 ms on this rank
    # the slowest rank's 4 rounds took 0.16 s: 10 rounds span 0.4 s, so 6 are added
    assert [len(result.step_times_s) for result in results] == [10, 10]
    assert [result.final_loss for result in results] == [5.0, 5.0]  # after the warm-up and 4 timed steps
    assert harness.steps_for_span(0.16, 4, 0.4) == 6
    assert harness.steps_for_span(0.001, 10, 10.0) == harness.MAX_TIMED_STEPS - 10  # capped
    assert harness.steps_for_span(12.0, 10, 10.0) == 0 and harness.steps_for_span(0.0, 10, 10.0) == 0
    with pytest.raises(ValueError, match="--min-timed-s must be >= 0"):
        replace(config, min_timed_s=-1.0)


def test_a_timed_turn_is_consecutive_steps_after_one_barrier_and_losses_compare_after_as_many(monkeypatch):
    """A timed turn is ``turn_steps`` steps after one barrier, its figure their mean; interleaved, a warm-up round's
    turn is one untimed step; a method timed on its own takes the same turns, so every method's final loss is taken
    after as many steps; rounds added for time's sake count a turn's whole span."""
    from dataclasses import replace

    from metadist.bench import harness
    from metadist.bench.baselines import Prepared

    calls: list[str] = []
    monkeypatch.setattr(harness.dist, "barrier", lambda: calls.append("barrier"))
    reduced: list[float] = []

    def all_reduce(tensor, op=None):
        reduced.append(float(tensor))

    monkeypatch.setattr(harness.dist, "all_reduce", all_reduce)
    now = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: now[0])

    def built(method):
        taken = [0]

        def step():
            calls.append(method)
            taken[0] += 1
            now[0] += 0.01 * taken[0]  # a method's n-th step takes n x 10 ms, its loss n
            return torch.tensor(float(taken[0]))
        return harness._Built(method, Prepared(method, step, (), (2,)), None, None, {}, {}, [])

    monkeypatch.setattr(harness, "build_method", lambda method, workload, ctx: built(method))
    monkeypatch.setattr(harness, "finish_method", lambda item, ctx: MethodResult(
        method=item.method, status=STATUS_OK, step_times_s=tuple(item.times), final_loss=float(item.loss)))
    config = harness.HarnessConfig(model="mlp", methods=("single", "ddp", "zero3"), steps=2, warmup=1, mesh_shape=(),
                                   batch_size=None, seq_len=None, optimizer="adamw", out="x.json", predict=False,
                                   timeout_s=10.0, timed_alone=("single",), min_timed_s=0.0, turn_steps=3)
    ctx = type("Ctx", (), {"device": torch.device("cpu")})()
    results = harness.measure_interleaved(config.methods, None, ctx, config)

    alone, rounds = calls[:calls.index("ddp")], calls[calls.index("ddp"):]
    assert alone == ["single"] + (["barrier"] + ["single"] * 3) * 2  # a warm-up step, then two turns of 3
    assert rounds == ["ddp", "zero3",  # the warm-up round
                      "barrier", "zero3", "zero3", "zero3", "barrier", "ddp", "ddp", "ddp",  # a turn each, rotated
                      "barrier", "ddp", "ddp", "ddp", "barrier", "zero3", "zero3", "zero3"]
    assert [result.final_loss for result in results] == [7.0, 7.0, 7.0]  # 1 + 2 turns x 3 steps for every method
    # the n-th step takes n x 10 ms; after the warm-up step, the turns are steps 2-4 and 5-7: their means
    assert all(result.step_times_s == pytest.approx((0.03, 0.06)) for result in results)
    assert reduced == []  # min_timed_s 0: no turns added, no agreement needed
    reduced.clear()
    calls.clear()
    results = harness.measure_interleaved(("ddp",), None, ctx, replace(config, methods=("ddp",), timed_alone=(),
                                                                           min_timed_s=0.45))
    assert reduced == pytest.approx([0.27])  # the span counts every step of the turns: 3 x (0.03 + 0.06)
    assert len(results[0].step_times_s) == 4  # 2 turns spanned 0.27 s: 0.45 s takes ceil(2 x 0.45 / 0.27) = 4 turns
    with pytest.raises(ValueError, match="--turn-steps must be >= 1"):
        replace(config, turn_steps=0)
    assert harness.parse_args(["mlp", "--out", "x.json"]).turn_steps == harness.TURN_STEPS
    assert harness.parse_args(["mlp", "--out", "x.json", "--turn-steps", "1"]).turn_steps == 1


def test_harness_arguments_check_the_timing_and_the_methods_timed_alone():
    from metadist.bench import harness

    config = harness.parse_args(["mlp", "--methods", "single,ddp", "--out", "x.json"])
    assert config.timing == "interleaved" and config.timed_alone == ("single",)
    config = harness.parse_args(["mlp", "--methods", "ddp,zero3", "--out", "x.json"])
    assert config.timed_alone == ()  # the default names the one-device reference only when it runs
    config = harness.parse_args(["mlp", "--methods", "single,ddp", "--timed-alone", "", "--timing", "sequential",
                                 "--out", "x.json"])
    assert config.timing == "sequential" and config.timed_alone == ()
    with pytest.raises(ValueError, match="--timed-alone names \\['zero2'\\], which --methods does not run"):
        harness.parse_args(["mlp", "--methods", "single,ddp", "--timed-alone", "zero2", "--out", "x.json"])
    with pytest.raises(SystemExit):
        harness.parse_args(["mlp", "--timing", "parallel", "--out", "x.json"])


def test_results_say_how_they_were_timed_and_older_files_read_as_sequential(tmp_path):
    import dataclasses

    from metadist.bench.report import write_report

    run = dataclasses.replace(_fixture_run(), timing="interleaved", timed_alone=("single",))
    assert BenchRun.from_json(run.to_json()) == run
    older = json.loads(_fixture_run().to_json())
    del older["timing"], older["timed_alone"]
    assert BenchRun.from_json(json.dumps(older)).timing == "sequential"
    results = tmp_path / "results"
    results.mkdir()
    (results / "fixture.json").write_text(run.to_json())
    page = write_report(results, tmp_path / "docs" / "benchmarks.md", commands=["make bench"]).read_text()
    assert ("1 warm-up and 3 timed steps after 2 profiled ones, the methods taking their warm-up and timed steps in "
            "turn (interleaved); single timed on its own first.") in page
    turns = dataclasses.replace(run, turn_steps=4)
    assert BenchRun.from_json(turns.to_json()) == turns
    (results / "fixture.json").write_text(turns.to_json())
    page = write_report(results, tmp_path / "docs" / "benchmarks.md", commands=["make bench"]).read_text()
    assert ("1 warm-up and 3 timed turns of 4 steps after 2 profiled ones, the methods taking their warm-up and "
            "timed steps in turn (interleaved)") in page
    (results / "fixture.json").write_text(json.dumps(older))
    page = write_report(results, tmp_path / "docs" / "benchmarks.md", commands=["make bench"]).read_text()
    assert "after 2 profiled ones, each method timed on its own, one after the other." in page


def test_metadist_bench_passes_the_timing_to_the_harness():
    from metadist.bench import harness
    from metadist.cli.bench import harness_args
    from metadist.cli.main import build_parser

    args = build_parser().parse_args(["bench", "gpt2-small", "--methods", "single,ddp,zero2,metadist-ilp",
                                      "--timed-alone", "single,zero2"])
    config = harness.parse_args(harness_args(args, "out.json"))
    assert config.timing == "interleaved" and config.timed_alone == ("single", "zero2")
    args = build_parser().parse_args(["bench", "mlp", "--methods", "single,ddp", "--timing", "sequential", "--timed-alone", ""])
    config = harness.parse_args(harness_args(args, "out.json"))
    assert config.timing == "sequential" and config.timed_alone == ()
    config = harness.parse_args(harness_args(build_parser().parse_args(["bench", "mlp"]), "out.json"))
    assert config.timing == "interleaved" and config.timed_alone == ("single",)  # every method runs: single alone


def test_op_costs_times_every_node_and_the_layout_copies_against_the_cost_models_price(capsys):
    """``python -m metadist.bench.op_costs``: a row per node of the captured step (and one per copy the runtime makes to
    follow the trace's layout, priced 0), each with the cost model's price and its time alone and in the step's order;
    summed per operator. Mixtral's expert-weight gradients laid out as their weights are nodes of the step (relayout
    clones, priced); a value the runtime makes contiguous that is not (here a transposed view named so) is a copy row."""
    import torch

    from metadist.bench.op_costs import CONTIGUOUS_COPY, _run_in_order, by_op, main, measure
    from metadist.cost.compute import node_work
    from metadist.frontends.torch import capture_step
    from metadist.workloads import builtin_workload

    data = measure("mixtral-tiny", repeats=1, cluster_name="cpu-gloo")
    workload = builtin_workload("mixtral-tiny")
    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch)
    graph = step.graph
    nodes = [row for row in data["nodes"] if row["op"] != CONTIGUOUS_COPY]
    assert [row["node"] for row in nodes] == [node.name for node in graph.nodes]
    relayouts = {node.name for node in graph.nodes if node_work(graph, node).relayout}
    assert relayouts and all(row["predicted_s"] > 0 for row in nodes if row["node"] in relayouts)
    transposed = next(node.outputs[0].name for node in graph.nodes if node.op.target == "aten.transpose.int"
                      and graph.value(node.input_names[0]).spec.rank == 3)
    env = {gi.value.name: tensor for gi, tensor in zip(graph.inputs, step.gather_inputs(workload.model, optimizer,
                                                                                          workload.batch))}
    env.update(step.constants)
    with torch.no_grad():
        calls = _run_in_order(graph, env, step.contiguous_values | {transposed})
    copies = [name for name, node, _ in calls if node is None]
    assert f"{transposed}.contiguous()" in copies
    # the in-step runs free each value after its last use, as the runtime does: only the inputs and outputs are left
    freed = {gi.value.name: tensor for gi, tensor in zip(graph.inputs, step.gather_inputs(workload.model, optimizer,
                                                                                          workload.batch))}
    freed.update(step.constants)
    given = set(freed)
    with torch.no_grad():
        freed_calls = _run_in_order(graph, freed, step.contiguous_values | {transposed}, free=True)
    assert [(name, node) for name, node, _ in freed_calls] == [(name, node) for name, node, _ in calls]
    outputs = {value.name for value in graph.outputs}
    read = {name for node in graph.nodes for name in node.input_names}
    unread = {value.name for node in graph.nodes for value in node.outputs if value is not None} - read - outputs
    assert outputs <= set(freed) and set(freed) - outputs <= given | unread  # a value no node reads is never freed
    assert len(env) > len(freed) + len(graph.nodes) // 2
    assert all(name.removesuffix(".contiguous()") in step.contiguous_values | {transposed} for name in copies)
    assert all(row["measured_s"] > 0 and row["in_step_s"] > 0 for row in data["nodes"])
    assert all(row["predicted_s"] > 0 for row in nodes)
    grouped = by_op(data["nodes"])
    assert sum(entry["in_step_s"] for entry in grouped) == pytest.approx(sum(row["in_step_s"] for row in data["nodes"]))
    assert sum(entry["nodes"] for entry in grouped) == len(data["nodes"])
    assert [entry["measured_s"] for entry in grouped] == sorted((entry["measured_s"] for entry in grouped), reverse=True)
    assert main(["mlp", "--repeats", "1", "--cluster", "cpu-gloo", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.lstrip().startswith("mlp: ") and "nodes, each op timed alone and in the step's order" in out
    import os

    threads = torch.get_num_threads()
    try:  # as one rank of 2: priced replicated on a 2-device mesh (each rank computes all of its batch), one thread
        two = measure("mlp", repeats=1, cluster_name="cpu-gloo", nproc=2)
        assert torch.get_num_threads() == 1 or os.environ.get("OMP_NUM_THREADS", "").strip()
    finally:
        torch.set_num_threads(threads)
    one = measure("mlp", repeats=1, cluster_name="cpu-gloo")
    assert two["nproc"] == 2 and one["nproc"] == 1
    assert [row["predicted_s"] for row in two["nodes"]] == pytest.approx([row["predicted_s"] for row in one["nodes"]])
    with pytest.raises(SystemExit):
        main(["mlp", "--repeats", "1", "--cluster", "cpu-gloo", "--nproc", "0"])


def test_never_lose_leads_with_the_static_experts_extra_rows_where_the_model_routes_tokens():
    """Mixture of experts: the captured experts compute E*G*C token rows where the library's run T*k; a loss to torch's
    baseline says so first (dropless: E / k), then what the figures say as for any model."""
    from dataclasses import replace

    from metadist.bench.report import never_lose_lines
    from metadist.ir.routing import ExpertRouting, computed_over_routed

    routing = ExpertRouting(module="model.layers.0.mlp.experts", num_experts=8, top_k=2, tokens=64, groups=4, group_tokens=16,
                            capacity=16)
    assert routing.dropless and computed_over_routed([routing]) == 4.0
    run = _fixture_run()
    per_node = {"step_s": 0.004, "nodes": 1000, "op_overhead_s": 20e-6, "eager_op_overhead_s": 8e-6,
                "expert_rows_over_routed": computed_over_routed([routing])}
    methods = tuple(replace(m, predicted={**m.predicted, **per_node}) if m.method == "metadist-ilp"
                    else replace(m, predicted={**m.predicted, "step_s": 0.002}) if m.method == "ddp" else m for m in run.methods)
    (line,) = never_lose_lines([replace(run, methods=methods)])
    why = line.split("why: ", 1)[1]
    assert why.startswith("the experts run with static shapes, computing x4.0 the token rows the routing asks for "
                          "(ddp runs the library's experts on their routed tokens only); the captured step's 1000 nodes")
    capped = replace(routing, capacity=5)  # C = ceil(1.25 * k * S / E): 5 slots of 16
    assert not capped.dropless and computed_over_routed([capped]) == 8 * 4 * 5 / (64 * 2)
    assert computed_over_routed([routing, capped]) == 8 * 4 * (16 + 5) / (2 * 64 * 2)  # rows summed over the layers


def test_the_suite_calibrates_right_before_each_entry(monkeypatch, tmp_path):
    """``make bench`` measures the machine again before every entry, for its process count, so that an entry's
    predictions are priced at the machine's speed of that minute; ``--keep-calibration`` plans with the cached one."""
    from metadist.bench import suite

    ran: list[list[str]] = []
    monkeypatch.setattr(suite, "_run", lambda argv, env=None: ran.append(argv) or True)
    monkeypatch.setattr(suite, "write_report", lambda *args, **kwargs: tmp_path / "benchmarks.md")
    assert suite.main(["--models", "gpt-85m,mlp,gpt2-tiny", "--skip-scale", "--docs", str(tmp_path)]) == 0
    steps = [("calibrate", argv[argv.index("--nproc") + 1]) if "calibrate" in argv else ("bench", argv[argv.index("metadist.bench.harness") + 1])
             for argv in ran]
    assert steps == [("calibrate", "2"), ("bench", "examples/gpt_85m.py"), ("calibrate", "4"), ("bench", "mlp"),
                     ("calibrate", "4"), ("bench", "gpt2-tiny"), ("calibrate", "2"), ("bench", "gpt2-tiny"),
                     ("calibrate", "2"), ("bench", "gpt2-tiny")]  # a model's name runs each of its entries
    outs = [argv[argv.index("--out") + 1].rsplit("/", 1)[-1] for argv in ran if "--out" in argv]
    assert outs == ["gpt-85m-2proc.json", "mlp-4proc.json", "gpt2-tiny-4proc.json", "gpt2-tiny-2proc-bf16.json",
                    "gpt2-tiny-2proc-recompute.json"]
    turns = [argv[argv.index("--turn-steps") + 1] if "--turn-steps" in argv else None
             for argv in ran if "--out" in argv]
    assert turns == ["1", None, None, None, None]  # the leading entries' steps take seconds: one a turn
    ran.clear()
    assert suite.main(["--models", "gpt2-tiny-recompute,gpt2-tiny-4proc", "--skip-scale", "--docs", str(tmp_path)]) == 0
    assert [argv[argv.index("--out") + 1].rsplit("/", 1)[-1] for argv in ran if "--out" in argv] == [
        "gpt2-tiny-4proc.json", "gpt2-tiny-2proc-recompute.json"]  # a result stem names one entry
    ran.clear()
    assert suite.main(["--models", "mlp", "--skip-scale", "--keep-calibration", "--docs", str(tmp_path)]) == 0
    assert len(ran) == 1 and "metadist.bench.harness" in ran[0]


@pytest.mark.parametrize("chosen, expected", [("", "1"), ("  ", "1"), (None, "1"), ("3", "3")])
def test_the_suites_harness_ranks_run_the_threads_a_metadist_run_rank_runs(monkeypatch, tmp_path, chosen, expected):
    """torchrun passes an ``OMP_NUM_THREADS`` set to an empty string on as it is (every rank would run a thread per
    core); the suite's harness launches set it as ``metadist run`` does, one thread a rank unless a number is chosen,
    while its calibration launches set their own."""
    from metadist.bench import suite

    if chosen is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", chosen)
    envs: dict[str, dict | None] = {}
    monkeypatch.setattr(suite, "_run", lambda argv, env=None: envs.__setitem__(
        "harness" if "metadist.bench.harness" in argv else "calibrate", env) or True)
    monkeypatch.setattr(suite, "write_report", lambda *args, **kwargs: tmp_path / "benchmarks.md")
    assert suite.main(["--models", "mlp", "--skip-scale", "--docs", str(tmp_path)]) == 0
    assert envs["harness"]["OMP_NUM_THREADS"] == expected and envs["harness"]["PATH"] == os.environ["PATH"]
    assert envs["calibrate"] is None


def _recorder_entry(record_id: int, name: str, group: str, sizes, dtypes, output_sizes=None) -> dict:
    return {"record_id": record_id, "profiling_name": name, "process_group": [group, "desc"], "input_sizes": sizes,
            "input_dtypes": dtypes, "output_sizes": output_sizes or sizes, "output_dtypes": dtypes}


def test_recorded_calls_read_the_flight_recorders_window_and_refuse_what_they_cannot_read():
    from metadist.bench.comm_count import UnreadableRecord, recorded_calls

    entries = [_recorder_entry(4, "gloo:all_reduce", "0", [[3]], ["Float"]),
               _recorder_entry(5, "nccl:_allgather_base", "1", [[2, 8]], ["BFloat16"], output_sizes=[[4, 8]]),
               _recorder_entry(6, "nccl:_reduce_scatter_base", "0", [[16]], ["Double"]),
               _recorder_entry(7, "gloo:send", "1", [[10]], ["Long"]),
               _recorder_entry(8, "gloo:recv", "1", [[10]], ["Long"]),
               _recorder_entry(9, "gloo:barrier", "0", [[1]], ["Float"])]
    sizes = {"0": 4, "1": 2}
    calls = recorded_calls(entries, 4, 9, sizes)
    assert [(call.kind, call.payload_bytes, call.group_size, call.wire_bytes) for call in calls] == [
        ("all_gather", 64, 2, 32.0), ("reduce_scatter", 128, 4, 96.0), ("send", 80, 2, 80.0), ("recv", 80, 2, 0.0),
        ("barrier", 4, 4, 0.0)]
    assert recorded_calls(entries, 3, 4, sizes)[0].wire_bytes == 2 * 3 / 4 * 12
    with pytest.raises(UnreadableRecord, match="kept 6 of the 7"):  # the ring overwrote the oldest entry
        recorded_calls(entries, 2, 9, sizes)
    with pytest.raises(UnreadableRecord, match="process group '1'"):
        recorded_calls(entries, 4, 5, {"0": 4})
    with pytest.raises(UnreadableRecord, match="dtype 'Float4'"):
        recorded_calls([_recorder_entry(1, "gloo:all_reduce", "0", [[3]], ["Float4"])], 0, 1, sizes)
    with pytest.raises(UnreadableRecord, match="'nccl:coalesced'"):
        recorded_calls([_recorder_entry(1, "nccl:coalesced", "0", [], [])], 0, 1, sizes)


def test_stand_in_collectives_give_each_call_its_real_shape_from_the_ranks_own_values():
    from metadist.bench.rank_compute import StandInCollectives

    comm = StandInCollectives(("a", "b"), (2, 4))
    piece = torch.arange(12.0).reshape(4, 3)
    gathered = comm.wait_tensor(comm._start("all_gather", piece, 1))
    assert gathered.shape == (16, 3) and torch.equal(gathered[8:12], piece)
    scattered = comm.wait_tensor(comm._start("reduce_scatter", piece, 0, "sum"))
    assert scattered.shape == (2, 3) and torch.equal(scattered, piece[:2])
    for kind in ("all_reduce", "all_to_all"):
        out = comm.wait_tensor(comm._start(kind, piece, 1, "sum"))
        assert torch.equal(out, piece) and out.data_ptr() != piece.data_ptr()


def test_rank_compute_times_every_ranks_program_alone_and_at_once_against_its_price(capsys):
    """``python -m metadist.bench.rank_compute``: per layout, the compute priced at one process's and at N processes'
    figures, the first rank's program timed alone and every rank's at once (forked processes, stand-in collectives)."""
    from metadist.bench.rank_compute import main, measure

    data = measure("mlp", (2,), ("plan", "dp", "eager"), window_s=0.05, cluster_name="cpu-gloo")
    assert [row["layout"] for row in data["rows"]] == ["plan", "dp", "eager"]
    for row in data["rows"]:
        assert row["priced_alone_s"] > 0 and row["priced_shared_s"] > 0 and row["alone_s"] > 0
        assert 0 < row["at_once_min_s"] <= row["at_once_s"] <= row["at_once_max_s"]
    plan, dp, eager = data["rows"]
    assert 0 <= plan["replicated_nodes"] <= plan["nodes"]
    assert dp["replicated_nodes"] < dp["nodes"]  # the batch's nodes are split
    assert eager["replicated_nodes"] is None  # torch's own step: no plan
    assert main(["mlp", "--mesh", "2", "--layouts", "dp", "--window-s", "0.05", "--cluster", "cpu-gloo"]) == 0
    out = capsys.readouterr().out
    assert "alone and 2 processes at once" in out and "mlp" in out
    with pytest.raises(SystemExit):
        main(["mlp", "--layouts", "zero9"])
    with pytest.raises(SystemExit):  # torch's eager step runs as written
        main(["mlp", "--precision", "bf16", "--layouts", "plan,eager"])
    with pytest.raises(ValueError, match="eager step runs as written"):
        measure("mlp", (2,), ("eager",), window_s=0.05, cluster_name="cpu-gloo", precision="bf16")
    bf16 = measure("mlp", (2,), ("plan",), window_s=0.05, cluster_name="cpu-gloo", precision="bf16")
    assert bf16["precision"] == "bf16" and bf16["rows"][0]["at_once_s"] > 0


@pytest.mark.parametrize("how", ["raises", "dies"])
def test_rank_compute_names_the_rank_whose_step_fails_or_whose_process_dies(how):
    import os
    from types import SimpleNamespace

    from metadist.bench.rank_compute import Eager, at_once_s

    def train_step():
        def step(model, optimizer, batch):
            if how == "dies":
                os._exit(3)
            raise ValueError("a broken step")
        return step

    workload = SimpleNamespace(model=torch.nn.Linear(2, 2), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                               batch={"x": torch.zeros(2, 2)}, train_step=train_step)
    expected = r"process died: rank \([01],\): exit code 3" if how == "dies" else r"step failed: .*ValueError: a broken step"
    with pytest.raises(RuntimeError, match=expected):
        at_once_s(Eager(workload), (2,), 0.05)


def test_a_result_keeps_the_link_figures_its_calls_were_priced_with():
    import json
    from dataclasses import replace

    from metadist.bench.metadist_method import link_figures
    from metadist.cost import cluster_for
    from metadist.ir import Mesh

    cluster = cluster_for("cpu-gloo", Mesh((2, 2)))
    cluster = replace(cluster, axis_links=(replace(cluster.link(0), sync_s=4e-3, sync_by_gap=((2e-4, 7e-4), (2e-3, 5e-3)),
                                                   kind_costs=(("all_gather", 1.6e-3, 1e9),)), cluster.link(1)))
    figures = link_figures(cluster)
    first, second = (figures[name] for name in cluster.mesh.axis_names)
    assert first["sync_s"] == 4e-3 and first["sync_by_gap"] == [[2e-4, 7e-4], [2e-3, 5e-3]]
    assert first["kind_fixed_s"] == {"all_gather": 1.6e-3}
    assert second["sync_s"] == cluster.link(1).sync_s and second["bandwidth_bytes_per_s"] == cluster.link(1).bandwidth_bytes_per_s
    assert json.loads(json.dumps(figures)) == figures  # it goes into the result file as it is
