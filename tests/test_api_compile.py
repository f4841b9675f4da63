"""`@metadist.compile` under torchrun: the decorated plain step trains like the single-device step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.distributed]

SCRIPT = textwrap.dedent(
    """
    import copy, sys
    import torch
    import torch.distributed as dist
    import metadist
    from metadist.workloads import builtin_workload

    workload = builtin_workload("mlp", optimizer="adamw")
    reference_model = copy.deepcopy(workload.model)
    reference_opt = workload.optimizer(reference_model.parameters())
    model = workload.model
    optimizer = workload.optimizer(model.parameters())

    @metadist.compile(mesh=MESH, timeout_s=120)
    def train_step(model, optimizer, batch):
        loss = workload.loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    plain = workload.train_step()
    for step in range(3):
        loss = train_step(model, optimizer, workload.batch)
        expected = plain(reference_model, reference_opt, workload.batch)
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()) + 1e-6, (step, loss, expected)
    # the model holds the trained state, as DTensors over each rank's shards (no call needed)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    worst = max((a.full_tensor() - b).abs().max().item() for a, b in zip(model.parameters(), reference_model.parameters()))
    assert worst < 1e-4, worst
    full = train_step.state_dict()
    for name, param in reference_model.named_parameters():
        assert full[name].shape == param.shape, name  # full tensors, not shards
    if dist.get_rank() == 0:
        print("COMPILED-OK", train_step.plan.mesh, f"max param diff {worst:.2e}")
    dist.destroy_process_group()
    from metadist.runtime.setup import exit_process
    exit_process(0)  # torch 2.13's gloo can abort at exit after all-gathers (see exit_process)
    """
)


@pytest.mark.parametrize("nproc,mesh", [(2, "(2,)"), (4, "(2, 2)")])
def test_compile_decorator_matches_single_device(tmp_path, nproc, mesh):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("MESH", mesh))
    env = {**os.environ, "METADIST_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "COMPILED-OK" in result.stdout


def test_compile_without_torchrun_is_a_clear_error(tmp_path):
    code = textwrap.dedent(
        """
        import torch, metadist
        from metadist.workloads import builtin_workload
        w = builtin_workload("mlp")
        step = metadist.compile(w.train_step())
        try:
            step(w.model, w.optimizer(w.model.parameters()), w.batch)
        except Exception as err:
            print(type(err).__name__, err)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "torchrun" in result.stdout, result.stdout + result.stderr
