"""Pipeline execution (#13): the schedules' orders, their point-to-point pairing, and `metadist run --mesh pp=...`.

The multi-process cases launch torchrun (gloo) and compare the pipeline's loss, accumulated gradients, updated
parameters and optimizer state with the same steps on one device (``--check``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from metadist.runtime.pipeline import BACKWARD, FORWARD, message_tags, schedule_order
from metadist.runtime.pipeline_worker import default_microbatches, pipeline_device_mesh
from metadist.ir import Mesh


def _simulate(schedule: str, stages: int, m: int) -> list[tuple[int, str, int]]:
    """Run every stage's order with blocking receives and non-blocking sends; the global order of phases run.

    A forward of microbatch k on stage i > 0 waits for stage i - 1's; a backward on stage i < last waits for stage
    i + 1's. Raises AssertionError when no stage can move (a deadlock).
    """
    orders = [schedule_order(schedule, stages, i, m) for i in range(stages)]
    done: set[tuple[int, str, int]] = set()
    position = [0] * stages
    ran = []
    while any(position[i] < len(orders[i]) for i in range(stages)):
        moved = False
        for i in range(stages):
            if position[i] == len(orders[i]):
                continue
            kind, k = orders[i][position[i]]
            needs = (i - 1, FORWARD, k) if kind == FORWARD and i else (i + 1, BACKWARD, k) if kind == BACKWARD and i + 1 < stages else None
            if needs is None or needs in done:
                done.add((i, kind, k))
                ran.append((i, kind, k))
                position[i] += 1
                moved = True
        assert moved, f"{schedule} deadlocks with {stages} stages and {m} microbatches at {position}"
    return ran


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(2, 1), (2, 2), (2, 4), (3, 2), (4, 4), (4, 8)])
def test_schedules_run_each_phase_once_in_a_pairing_that_cannot_deadlock(schedule, stages, m):
    for i in range(stages):
        order = schedule_order(schedule, stages, i, m)
        assert sorted(order) == sorted([(FORWARD, k) for k in range(m)] + [(BACKWARD, k) for k in range(m)])
        assert all(order.index((FORWARD, k)) < order.index((BACKWARD, k)) for k in range(m))
        # microbatches in flight (forward run, backward not yet): GPipe holds all, 1F1B at most stages - i
        in_flight = most = 0
        for kind, _ in order:
            in_flight += 1 if kind == FORWARD else -1
            most = max(most, in_flight)
        assert most == (m if schedule == "gpipe" else min(m, stages - i))
    _simulate(schedule, stages, m)


def test_1f1b_order_of_the_first_stage():
    assert schedule_order("1f1b", 2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert schedule_order("1f1b", 2, 1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_message_tags_are_distinct_over_a_step():
    tags = [tag for k in range(8) for direction in (FORWARD, BACKWARD) for tag in message_tags(k, direction, 5)]
    assert len(tags) == len(set(tags))


def test_defaults_and_the_device_mesh_of_a_pipeline():
    assert default_microbatches(2, 4) == 2 and default_microbatches(4, 6) == 3 and default_microbatches(4, 1) == 1
    assert pipeline_device_mesh(Mesh((2,), ("pp",))) == Mesh((2, 1), ("pp", "stage"))
    assert pipeline_device_mesh(Mesh((2, 2), ("pp", "dp"))) == Mesh((2, 2), ("pp", "dp"))


def test_random_draws_are_the_whole_batch_draws_sliced():
    """Dropout masks: drawn whole from the seed in graph order, as one device draws them, then sliced."""
    from metadist.frontends.torch import capture_step
    from metadist.frontends.torch.microbatch import first_microbatch
    from metadist.runtime.pipeline import _RandomDraws
    from metadist.workloads import builtin_workload

    workload = builtin_workload("gpt2-tiny")
    optimizer = workload.optimizer(workload.model.parameters())
    micro = capture_step(workload.train_step(), workload.model, optimizer, first_microbatch(workload.batch, 2),
                         raw_grads=True).graph
    whole = capture_step(workload.train_step(), workload.model, optimizer, workload.batch).graph
    randoms = [node for node in whole.nodes if node.op.is_random]
    assert randoms, "gpt2-tiny trains with its default dropout"
    draws = _RandomDraws(micro, whole, 2)
    torch.manual_seed(3)
    got = draws.draw(torch.device("cpu"))
    torch.manual_seed(3)
    from metadist.frontends.torch.execute import execute_graph

    want = execute_graph(draws.draws, [torch.empty(gi.value.spec.shape, dtype=getattr(torch, gi.value.spec.dtype))
                                       for gi in draws.draws.inputs])
    for (mine, _), whole_tensor in zip(draws.pairs, want):
        assert torch.equal(torch.cat(got[mine]), whole_tensor)
    with pytest.raises(Exception, match="random"):
        _RandomDraws(micro, None, 2)


def run_metadist(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _passed(result: subprocess.CompletedProcess) -> str:
    text = result.stdout.replace("\n", " ")
    assert result.returncode == 0, result.stdout[-2500:] + result.stderr[-2500:]
    assert "check: PASS" in text, result.stdout[-2500:]
    return text


@pytest.mark.distributed
def test_llama_pp2_1f1b_built_on_meta_matches_one_device():
    text = _passed(run_metadist("llama-tiny", "--nproc", "2", "--mesh", "pp=2", "--steps", "2", "--check",
                                "--schedule", "1f1b", "--meta-init", "--timeout-s", "120"))
    assert "2 stages on 2 (pp)" in text and "schedule 1f1b" in text and "step 1: loss" in text
    assert "meta-device model is materialised whole" in text


@pytest.mark.distributed
@pytest.mark.slow
def test_gpt2_pp2_gpipe_with_dropout_matches_one_device():
    text = _passed(run_metadist("gpt2-tiny", "--nproc", "2", "--mesh", "pp=2", "--steps", "2", "--check",
                                "--schedule", "gpipe", "--timeout-s", "120"))
    assert "schedule gpipe" in text


@pytest.mark.distributed
@pytest.mark.slow
def test_bert_pp2_dp2_matches_one_device():
    """Masked LM: microbatches count different numbers of labels, so the loss divisor weights them."""
    text = _passed(run_metadist("bert-tiny", "--nproc", "4", "--mesh", "pp=2,dp=2", "--steps", "2", "--check",
                                "--timeout-s", "180"))
    assert "sub-mesh 2 (dp)" in text


ONE_LAYER = """
import torch
import metadist


def workload():
    torch.manual_seed(0)
    return metadist.Workload(model=torch.nn.Linear(8, 4), batch=(torch.randn(4, 8), torch.randn(4, 4)),
                             loss_fn=lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name="one-layer")
"""


@pytest.mark.distributed
def test_run_says_in_one_block_when_no_stage_plan_fits(tmp_path):
    """Rank 0 plans; its reason reaches every rank, so the block names it once, not a lost connection."""
    model = tmp_path / "one_layer.py"
    model.write_text(ONE_LAYER)
    result = run_metadist(str(model), "--nproc", "2", "--mesh", "pp=2", "--steps", "1", "--memory-gb", "1e-7",
                          "--timeout-s", "60")
    assert result.returncode != 0
    assert "InfeasibleBudgetError" in result.stderr and "stage" in result.stderr, result.stderr[-2000:]
    assert "rank 1 (the same error" in result.stderr and "Connection closed" not in result.stderr


def test_run_refuses_pipeline_options_without_a_pp_axis(capsys):
    from metadist.cli.main import main

    assert main(["run", "llama-tiny", "--nproc", "2", "--schedule", "gpipe"]) == 2
    assert "--microbatches and --schedule go with a mesh with a pp axis" in capsys.readouterr().err
    assert main(["run", "llama-tiny", "--nproc", "4", "--mesh", "pp=3"]) == 2
    assert "has 3 devices but --nproc is 4" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_under_a_plan_without_pp(tmp_path):
    """pp=2 saves after 2 steps (DCP, the usual layout); dp=2 resumes it, and its third step is one device's third."""
    import re

    from metadist.runtime.check import reference_run
    from metadist.workloads import builtin_workload

    folder = str(tmp_path / "ckpt")
    first = run_metadist("llama-tiny", "--nproc", "2", "--mesh", "pp=2", "--steps", "2", "--checkpoint-dir", folder)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    second = run_metadist("llama-tiny", "--nproc", "2", "--mesh", "dp=2", "--steps", "3", "--checkpoint-dir", folder)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "resumed from" in second.stdout
    got = float(re.search(r"step 2: loss ([0-9.]+)", second.stdout).group(1))
    workload = builtin_workload("llama-tiny")
    want = reference_run(workload.train_step(), workload.model, workload.optimizer, workload.batch, steps=3, seed=0)
    assert got == pytest.approx(want.losses[2], rel=1e-5, abs=1e-5)


COMPILE_SCRIPT = """
import torch
import torch.distributed as dist

import metadist
from metadist.runtime.check import compare_runs, reference_run
from metadist.workloads import builtin_workload

workload = builtin_workload("gpt2-tiny")  # default dropout: drawn whole, sliced per microbatch
reference = reference_run(workload.train_step(), workload.model, workload.optimizer, workload.batch, steps=2, seed=0)
optimizer = workload.optimizer(workload.model.parameters())
step = metadist.compile(workload.train_step(), mesh="pp=2", microbatches=2, schedule="gpipe")
torch.manual_seed(0)
losses = [float(step(workload.model, optimizer, workload.batch)) for _ in range(2)]
report = compare_runs(reference, losses, step.state_dict(), step.compiled.grads())
report.raise_if_failed()
for name, param in workload.model.named_parameters():  # the model holds the updated state, whole
    assert torch.equal(param.detach(), step.state_dict()[name]), name
# what --check compares: each stage's whole tensors sent to rank 0 one at a time, the same as gathered everywhere
pipe = step.compiled.step
everywhere = (pipe.grads(), pipe.state_dict(workload.model, optimizer, workload.batch))
first = (dict(pipe.grads_one_by_one().pairs), dict(pipe.state_one_by_one(workload.model, optimizer, workload.batch).pairs))
for mine, whole in zip(first, everywhere):
    if dist.get_rank() == 0:
        assert mine.keys() == whole.keys() and len(whole) > 0, (sorted(mine), sorted(whole))
        assert all(torch.equal(mine[key], whole[key]) for key in whole)
    else:
        assert mine == {}, sorted(mine)
if dist.get_rank() == 0:
    print("PIPELINE-COMPILED-OK", len(report.differences), "streamed", sum(len(d) for d in first))
dist.destroy_process_group()
from metadist.runtime.setup import exit_process
exit_process(0)
"""


@pytest.mark.distributed
def test_compile_runs_a_pipeline_and_keeps_the_model_current(tmp_path):
    script = tmp_path / "train_pp.py"
    script.write_text(COMPILE_SCRIPT)
    env = {**os.environ, "METADIST_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PIPELINE-COMPILED-OK" in result.stdout


def test_pipeline_run_rows_are_recorded_replaced_and_rendered(tmp_path):
    from metadist.bench.pipeline_run import markdown, record

    path = tmp_path / "pipeline_run.json"
    base = {"nproc": 2, "steps": 12, "repeats": 2, "pp_passed": True, "dp_passed": True, "load_average_1min": 3.0}
    record(path, {**base, "model": "llama-tiny", "microbatches": 4, "pp_ms": 90.0, "dp_ms": 60.0, "command": "first"})
    record(path, {**base, "model": "bert-tiny", "microbatches": 2, "pp_ms": 80.0, "dp_ms": 100.0, "command": "bert",
                  "dp_passed": False})
    record(path, {**base, "model": "llama-tiny", "microbatches": 4, "pp_ms": 120.0, "dp_ms": 60.0, "command": "again"})
    data = json.loads(path.read_text())
    assert [(r["model"], r["command"]) for r in data["rows"]] == [("bert-tiny", "bert"), ("llama-tiny", "again")]
    text = "\n".join(markdown(data))
    assert "| bert-tiny | 2 | 2 | 80.0 ms | 100.0 ms | 0.80 | FAIL | 3.0 |" in text
    assert "| llama-tiny | 2 | 4 | 120.0 ms | 60.0 ms | 2.00 | PASS | 3.0 |" in text
    assert "first" not in text and "again" in text


def _pipeline_replica_drift() -> dict:
    import torch.distributed as dist

    import metadist
    from metadist.ir import Replicate
    from metadist.workloads import builtin_workload

    workload = builtin_workload("mlp")
    optimizer = workload.optimizer(workload.model.parameters())
    step = metadist.compile(workload.train_step(), mesh="pp=2,dp=2", microbatches=2, cluster="cpu-gloo")
    step(workload.model, optimizer, workload.batch)
    pipe = step.compiled.step
    found = {"clean": pipe.replica_disagreements(), "rank": dist.get_rank(), "sub": tuple(pipe.sub_coords)}
    replicated = sorted(name for name in pipe.stage.owned if pipe.local_state[name].is_floating_point()
                        and all(isinstance(placement, Replicate) for placement in pipe._sharding_in(pipe.index, name)))
    found["name"] = replicated[0] if replicated and found["sub"] == (1,) else None
    if found["name"] is not None:  # the second rank of each stage moves one element of a replicated piece
        with torch.no_grad():
            piece = pipe.local_state[found["name"]].view(-1)
            piece[0] += 1e-3 * (piece.abs().sum() + 1.0)
    found["moved"] = pipe.replica_disagreements()
    return found


@pytest.mark.distributed
def test_a_pipeline_compares_the_copies_within_each_stage():
    """``--check`` on a pipeline compares every rank's copies of its stage's replicated pieces (each stage's sub-mesh on
    its own): an element moved on the second rank of a stage is found and named; untouched copies agree."""
    from test_runtime_support import run_distributed

    results = run_distributed(_pipeline_replica_drift, 4, timeout_s=400)
    assert all(result["clean"] == [] for result in results), [result["clean"] for result in results]
    moved = sorted((result["name"], result["rank"]) for result in results if result["name"] is not None)
    assert moved  # a stage keeps a replicated piece on its dp axis (the optimizer's step count at least)
    for result in results:
        assert sorted((name, rank) for name, _, rank in result["moved"]) == moved
