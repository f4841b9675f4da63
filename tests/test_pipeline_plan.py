"""Pipeline planning: regions, cuts, stage layout, per-stage plans, the schedule estimate, the search, bad input.

Planning only (no processes): the tiny built-ins captured on one microbatch with ``raw_grads=True``.
"""

from __future__ import annotations

import math

import pytest

from metadist.cost.cluster import cluster_for
from metadist.ir import Mesh
from metadist.ir.pipeline import PipelinePlan
from metadist.ir.stage_graphs import stage_graph
from metadist.solver.errors import PipelineError
from metadist.solver.pipeline import pipeline_estimate, plan_pipeline, search_pipeline
from metadist.solver.pipeline.cuts import balanced_cuts, check_stage_count, cut_candidates
from metadist.solver.pipeline.partition import partition
from metadist.solver.pipeline.planner import StageFigures, in_flight, pipeline_cluster
from metadist.solver.pipeline.regions import split_regions
from metadist.solver.pipeline.search import check_pipeline_mesh, microbatch_counts


@pytest.fixture(scope="module")
def rules_db():
    from metadist.shardcombine.database import default_db_path

    return str(default_db_path())


_GRAPHS: dict = {}


def microbatch_graphs(name: str, rules_db: str):
    from metadist.frontends.torch.microbatch import MicrobatchGraphs
    from metadist.workloads import load_workload

    if name not in _GRAPHS:
        _GRAPHS[name] = MicrobatchGraphs(load_workload(name), rules_db)
    return _GRAPHS[name]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_two_stages_place_every_node_once_and_agree_on_messages(name, rules_db):
    graph, _, divisor = microbatch_graphs(name, rules_db)(2, True)
    assert divisor is not None  # a mean cross-entropy: each microbatch's gradients weighted by its target count
    regions = split_regions(graph, divisor)
    parts = [set(regions.forward), set(regions.backward), set(regions.update), set(regions.floating), set(regions.random)]
    assert sum(map(len, parts)) == len(graph.nodes) and set().union(*parts) == {node.name for node in graph.nodes}
    candidates = cut_candidates(graph, regions)
    assert candidates.max_stages >= 3  # at least the layer boundaries of the 2 layers
    cluster = cluster_for("h100-ib", Mesh((2, 2), ("pp", "dp")))
    cut = partition(graph, regions, 2, cluster, cluster.link(0), microbatches=2)
    stages = cut.layout.stages
    placed = [name for stage in stages for name in (*stage.forward, *stage.backward, *stage.update)]
    fixed = set(regions.floating) | set(regions.random)
    moved = [n for n in placed if n not in fixed]
    assert sorted(moved) == sorted(set(regions.forward) | set(regions.backward) | set(regions.update))
    assert stages[0].forward_send == stages[1].forward_recv and stages[1].backward_send == stages[0].backward_recv
    assert stages[0].forward_send  # the residual stream crosses the cut
    assert all(stage.forward for stage in stages)
    params = {gi.value.name for gi in graph.inputs_by_role(__import__("metadist.ir", fromlist=["Role"]).Role.PARAM)}
    owned = [name for stage in stages for name in stage.owned if name in params]
    assert sorted(owned) == sorted(params)  # every parameter updated by exactly one stage
    for stage in stages:
        piece = stage_graph(graph, stage, regions.loss, cut.layout.transfers)  # a valid graph of its own
        assert {node.name for node in piece.nodes} == {*stage.forward, *stage.backward, *stage.update}


def test_pipeline_plan_on_a_pp_by_dp_mesh(rules_db):
    graph, rules, divisor = microbatch_graphs("gpt2-tiny", rules_db)(2, True)
    cluster = cluster_for("cpu-gloo", Mesh((2, 2), ("pp", "dp")))
    plan = plan_pipeline(graph, rules, cluster, microbatches=2, schedule="1f1b", loss_divisor=divisor, time_limit_s=20)
    assert len(plan.stages) == 2 and all(stage.plan.mesh.shape == (2,) for stage in plan.stages)
    e = plan.estimate
    assert e["step_s"] >= e["forward_backward_s"] + e["update_s"] > 0
    assert 0 <= e["bubble_fraction"] < 1 and e["p2p_bytes_per_microbatch"] > 0
    assert [stage["in_flight"] for stage in e["stages"]] == [2, 1]  # 1F1B: stage i holds min(m, p - i)
    assert e["memory_bytes_peak"] == max(stage["memory_bytes_peak"] for stage in e["stages"])
    again = PipelinePlan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json() and again.decisions_hash() == plan.decisions_hash()
    plan.check_for(graph, plan.metadist_version)


def test_schedule_estimate_matches_the_closed_forms():
    link = cluster_for("h100-ib", Mesh((4,), ("pp",))).link(0)
    stage = StageFigures(forward_s=1.0, backward_s=2.0, update_s=0.5, memory_bytes=10.0, saved_bytes=3.0,
                         send_up_bytes=0.0, send_down_bytes=0.0)
    for m in (1, 4, 8):
        e = pipeline_estimate([stage] * 4, m, "1f1b", link)
        assert math.isclose(e["forward_backward_s"], (m + 3) * 3.0)
        assert math.isclose(e["bubble_fraction"], 3 / (m + 3)) and math.isclose(e["ideal_bubble_fraction"], 3 / (m + 3))
        assert math.isclose(e["step_s"], (m + 3) * 3.0 + 0.5)
        gpipe = pipeline_estimate([stage] * 4, m, "gpipe", link)
        assert gpipe["step_s"] == e["step_s"]
        assert gpipe["memory_bytes_peak"] == 10.0 + (m - 1) * 3.0
        assert [s["in_flight"] for s in e["stages"]] == [min(m, 4 - i) for i in range(4)]
    slow = StageFigures(forward_s=2.0, backward_s=4.0, update_s=0.0, memory_bytes=1.0, saved_bytes=0.0,
                        send_up_bytes=0.0, send_down_bytes=0.0)
    e = pipeline_estimate([stage, slow], 4, "1f1b", link)  # the slow stage paces the others
    assert math.isclose(e["forward_backward_s"], 3.0 + 6.0 + 3 * 6.0)
    assert e["bubble_fraction"] > e["ideal_bubble_fraction"]
    assert in_flight("gpipe", 4, 3, 8) == 8 and in_flight("1f1b", 4, 3, 8) == 1


def test_balanced_cuts_minimise_the_slowest_stage():
    assert balanced_cuts([1, 1, 1, 1], [0, 0, 0], 2) == (1,)
    assert balanced_cuts([4, 1, 1, 1, 1], [0, 0, 0, 0], 2) == (0,)
    assert balanced_cuts([1, 1, 1, 1, 1, 1], [0] * 5, 3) == (1, 3)
    # an expensive crossing moves the cut to a cheap one when the balance allows
    assert balanced_cuts([1, 1, 1, 1], [0, 5, 0], 2) in ((0,), (2,))
    # each stage pays its own sends: the activation up at its end, the gradient down at its start
    assert balanced_cuts([1] * 6, [1] * 5, 2) == (2,)


def test_search_chooses_and_explains(rules_db):
    graphs = microbatch_graphs("gpt2-tiny", rules_db)
    result = search_pipeline(graphs, 2, lambda mesh: cluster_for("h100-ib", mesh), global_batch=graphs.global_batch,
                             pp_degrees=[1, 2], microbatches=[2], time_limit_s=20)
    labels = sorted(c.label for c in result.candidates)
    assert labels == ["no pipeline", "pp=2 m=2 1f1b", "pp=2 m=2 gpipe"]
    assert result.chosen is not None and result.chosen.fits
    assert result.chosen.step_s == min(c.step_s for c in result.candidates if c.fits)
    from metadist.solver.pipeline.search import _lower_bounds, pipeline_mesh

    graph, _, divisor = graphs(1, True)
    bound = _lower_bounds(graph, divisor, cluster_for("h100-ib", pipeline_mesh(1, 2, 8)), 2)
    for c in result.candidates:  # the bound that prunes the search holds for every plan it made
        assert 0 < bound(c.pp, c.microbatches) <= c.step_s
    assert bound(2, 2) > bound(2, 8) > bound(1, 1)
    text = result.explain()
    assert "chosen:" in text and "no pipeline" in text and "pp=2 m=2 gpipe" in text
    pp = [c for c in result.candidates if c.pp == 2]
    assert math.isclose(pp[0].step_s, pp[1].step_s)  # one bubble for both schedules; 1F1B holds fewer microbatches
    assert min(c.memory_bytes for c in pp if c.schedule == "1f1b") <= min(c.memory_bytes for c in pp if c.schedule == "gpipe")
    # a budget below the fastest whole-step plan's peak: every candidate kept fits it, the fastest of those is chosen,
    # and the whole step pays for its smaller footprint in time (on two devices it can shard more than a pipeline
    # stage holds, so the pipeline need not be the only choice)
    whole = next(c for c in result.candidates if c.pp == 1)
    budget = whole.memory_bytes * 0.9
    tight = search_pipeline(graphs, 2, lambda mesh: cluster_for("h100-ib", mesh), global_batch=graphs.global_batch,
                            pp_degrees=[1, 2], microbatches=[2], memory_budget_bytes=budget, time_limit_s=20)
    assert tight.chosen is not None and tight.chosen.memory_bytes <= budget
    assert all(c.memory_bytes <= budget for c in tight.candidates if c.fits)
    assert tight.chosen.step_s == min(c.step_s for c in tight.candidates if c.fits)
    smaller = next(c for c in tight.candidates if c.pp == 1)
    assert not smaller.fits or smaller.step_s >= whole.step_s


def test_bad_pipeline_input_says_what_fits(rules_db):
    graph, _, divisor = microbatch_graphs("gpt2-tiny", rules_db)(2, True)
    candidates = cut_candidates(graph, split_regions(graph, divisor))
    with pytest.raises(PipelineError, match=f"at most pp={candidates.max_stages} stages fit"):
        check_stage_count(candidates, candidates.max_stages + 1)
    with pytest.raises(PipelineError, match="pp degrees that fit: 1, 2, 3, 6"):
        check_pipeline_mesh(6, 4)
    from metadist.frontends.torch.microbatch import first_microbatch

    import torch

    with pytest.raises(PipelineError, match="counts that fit: 1, 2, 4"):
        first_microbatch({"x": torch.zeros(4, 3)}, 3)
    with pytest.raises(PipelineError, match="disagree on dim 0"):
        first_microbatch({"x": torch.zeros(4, 3), "y": torch.zeros(2)}, 2)
    with pytest.raises(PipelineError, match="no 'pp' axis"):
        pipeline_cluster(cluster_for("h100-ib", Mesh((2, 2))))
    assert microbatch_counts(16, 2) == [2, 4, 8, 16][:4] and microbatch_counts(6, 4) == []


def test_cli_plans_a_pipeline(rules_db, capsys, tmp_path):
    from metadist.cli.main import main

    out = tmp_path / "pp.json"
    assert main(["plan", "llama-tiny", "--mesh", "pp=2,dp=2", "--cluster", "cpu-gloo", "--microbatches", "2",
                 "--rules-db", rules_db, "--json", str(out), "--time-limit", "20"]) == 0
    text = capsys.readouterr().out
    assert "pipeline of llama-tiny" in text and "bubble" in text
    assert PipelinePlan.from_json(out.read_text()).microbatches == 2
    assert main(["plan", "llama-tiny", "--mesh", "pp=2", "--microbatches", "3", "--rules-db", rules_db]) == 2
    assert "3 microbatches do not divide the batch of 4" in capsys.readouterr().err
    assert main(["plan", "llama-tiny", "--devices", "6", "--pp", "4", "--rules-db", rules_db]) == 2
    assert "pp=4 does not divide the 6 devices" in capsys.readouterr().err
    assert main(["run", "llama-tiny", "--nproc", "2", "--mesh", "dp=2", "--microbatches", "2"]) == 2
    assert "--microbatches and --schedule go with a mesh with a pp axis" in capsys.readouterr().err


@pytest.mark.parametrize("pp,microbatches,preset", [(2, 2, "cpu-gloo"), (4, 4, "h100-ib")])
def test_stages_compute_the_step_over_microbatches(pp, microbatches, preset, rules_db):
    """The plan's stages, run in one process with only what each stage holds or is sent, give one device's step."""
    import torch

    from metadist.frontends.torch.execute import execute_graph
    from metadist.frontends.torch.pipeline_reference import run_pipeline_reference
    from metadist.ir import Role
    from metadist.runtime.check import ReferenceRun, compare_runs

    graphs = microbatch_graphs("llama-tiny", rules_db)
    graph, rules, divisor = graphs(microbatches, True)
    plan = plan_pipeline(graph, rules, cluster_for(preset, Mesh((pp,), ("pp",))), microbatches=microbatches,
                         loss_divisor=divisor, time_limit_s=20)
    workload = graphs.workload
    optimizer = workload.optimizer(workload.model.parameters())
    from metadist.frontends.torch import capture_step
    from metadist.frontends.torch.microbatch import first_microbatch

    step = capture_step(workload.train_step(), workload.model, optimizer, first_microbatch(workload.batch, microbatches),
                        name=workload.name, raw_grads=True)
    got = run_pipeline_reference(step, plan, workload.model, optimizer, workload.batch)
    whole, _, _ = graphs(1, True)
    whole_step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, name=workload.name,
                              raw_grads=True)
    outputs = execute_graph(whole, whole_step.gather_inputs(workload.model, optimizer, workload.batch))
    state, grads = {}, {}
    for output, value in zip(whole.outputs, outputs):
        if output.role is Role.LOSS:
            torch.testing.assert_close(got["loss"], value, rtol=1e-6, atol=1e-6)
            loss = float(value)
        elif output.replaces is not None:
            state[output.replaces] = value
        elif output.role is Role.GRAD:
            grads[output.source.removeprefix("grad:")] = value
            torch.testing.assert_close(got["grads"][output.source.removeprefix("grad:")], value, rtol=1e-4, atol=1e-6)
    assert state.keys() == got["state"].keys() and grads.keys() == got["grads"].keys() and state
    # the updated state as `--check` holds it: the tolerance, with AdamW's step of ~lr on an element whose gradient is
    # rounding noise excused, on parameters only (on one machine the microbatched and the whole step's gradients of
    # one element of llama-tiny's layers.0.mlp.down_proj.weight were both noise, and its updates 1.7e-5 apart)
    report = compare_runs(ReferenceRun(losses=(loss,), state=state, grads=grads), [float(got["loss"])], got["state"],
                          got["grads"])
    report.raise_if_failed()


def test_reference_refuses_random_ops(rules_db):
    from metadist.frontends.torch import capture_step
    from metadist.frontends.torch.pipeline_reference import run_pipeline_reference

    graphs = microbatch_graphs("gpt2-tiny", rules_db)
    graph, rules, divisor = graphs(2, True)
    plan = plan_pipeline(graph, rules, cluster_for("cpu-gloo", Mesh((2,), ("pp",))), microbatches=2,
                         loss_divisor=divisor, time_limit_s=20)
    workload = graphs.workload
    optimizer = workload.optimizer(workload.model.parameters())
    from metadist.frontends.torch.microbatch import first_microbatch

    step = capture_step(workload.train_step(), workload.model, optimizer, first_microbatch(workload.batch, 2),
                        name=workload.name, raw_grads=True)
    with pytest.raises(PipelineError, match="draws random numbers"):
        run_pipeline_reference(step, plan, workload.model, optimizer, workload.batch)


def test_pipeline_study_section_renders_rows():
    from dataclasses import asdict

    from metadist.bench.pipeline_study import PipelineRow
    from metadist.bench.report import pipeline_section

    rows = [PipelineRow(model="m", devices=16, method="metadist (chosen)", mesh=(2, 8), pp=2, microbatches=4,
                        schedule="1f1b", step_s=1.5, bubble_fraction=0.2, memory_bytes=2**30, fits=True, search_s=3.0),
            PipelineRow(model="m", devices=16, method="zero3", mesh=(2, 8), error="too big")]
    text = "\n".join(pipeline_section({"cluster": "h100-ib", "command": "python -m x", "rows": [asdict(r) for r in rows]}))
    assert "MetaDist chose pp=2, 4 microbatches, 1f1b" in text and "| m | 16 | zero3 | 2x8 |" in text
    assert "**no**: too big" in text and "20.0%" in text and "python -m x" in text


def test_raw_grads_are_autograds_gradients_before_the_optimizer():
    import copy

    import torch

    from metadist.frontends.torch import capture_step
    from metadist.frontends.torch.errors import CaptureError
    from metadist.frontends.torch.execute import execute_graph
    from metadist.ir import Role
    from metadist.workloads import load_workload

    workload = load_workload("mlp")

    def clipped(model, optimizer, batch):  # what the optimizer sees differs from what autograd accumulated
        loss = workload.loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(clipped, workload.model, optimizer, workload.batch, raw_grads=True)
    outputs = execute_graph(step.graph, step.gather_inputs(workload.model, optimizer, workload.batch))
    got = {o.source.removeprefix("grad:"): v for o, v in zip(step.graph.outputs, outputs) if o.role is Role.GRAD}
    model = copy.deepcopy(workload.model)
    workload.loss_fn(model, workload.batch).backward()
    assert set(got) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad)
    regions = split_regions(step.graph, step.loss_divisor)  # clipping reads only accumulated gradients: an update
    cluster = cluster_for("h100-ib", Mesh((2,), ("pp",)))
    with pytest.raises(PipelineError, match="gradient clipping by a global norm"):  # but it combines every stage's
        partition(step.graph, regions, 2, cluster, cluster.link(0))
    with pytest.raises(CaptureError, match="ask for one of them"):
        capture_step(clipped, workload.model, optimizer, workload.batch, raw_grads=True, keep_grads=True)
