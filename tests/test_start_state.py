"""Every rank starts from rank 0's model and the same batch, or is told it did not (2 and 4 gloo ranks).

The README's own model file (unseeded: each process builds other weights and another batch) passes
``--check``; a user script whose ranks build different models trains as one device fed rank 0's
model; a batch that differs between ranks is a clear error naming the leaf; ``batch='local'`` takes
each rank's slice and equals one device fed the concatenated batch; different model code on
different ranks is a clear error naming the first differing parameter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from torchrun_script import run_torchrun

pytestmark = [pytest.mark.distributed]

README_MODEL = textwrap.dedent(
    """
    import torch, metadist

    def workload():
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
        batch = {"x": torch.randn(32, 64), "y": torch.randint(0, 10, (32,))}
        return metadist.Workload(
            model=model,
            batch=batch,  # the global batch
            loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        )
    """
)


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_readme_example_unseeded_passes_check(tmp_path, nproc):
    model_file = tmp_path / "model.py"
    model_file.write_text(README_MODEL)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", str(model_file), "--nproc", str(nproc),
                             "--check", "--steps", "3"], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check: PASS" in result.stdout, result.stdout[-3000:]
    assert "starting state" in result.stdout, result.stdout[-3000:]


MLP = """
def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))

def step_fn(model, optimizer, batch):
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss

rank = int(os.environ["RANK"])
g = torch.Generator().manual_seed(100)
batch = {"x": torch.randn(16, 12, generator=g), "y": torch.randint(0, 5, (16,), generator=g)}
"""


def test_unseeded_ranks_train_rank_0s_model_and_a_differing_batch_is_refused(tmp_path):
    result = run_torchrun(tmp_path, MLP + """
model = mlp(seed=1000 + rank)          # every rank builds other weights, as an unseeded script does
reference = mlp(seed=1000)             # what rank 0 built
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
train_step = metadist.compile(step_fn, mesh=(2,))
for _ in range(3):
    loss = train_step(model, optimizer, batch).item()
    want = step_fn(reference, ref_opt, batch).item()
    assert abs(loss - want) < 1e-5, (loss, want)
worst = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
assert worst < 1e-5, worst

# a batch that differs between ranks (a sampler shuffled differently) stops the next compiled shape
other = {"x": batch["x"][:8].roll(rank, dims=0), "y": batch["y"][:8]}
try:
    train_step(model, optimizer, other)
except Exception as err:
    assert "batch.x" in str(err) and "differs between ranks" in str(err) and "batch='local'" in str(err), err
else:
    raise AssertionError("a batch that differs between ranks must be refused")
rank0_print("OK start-state", f"max param diff {worst:.1e}")
finish()
""")
    assert "OK start-state" in result.stdout


@pytest.mark.parametrize("nproc,mesh", [(2, "(2,)"), (4, "(2, 2)")])
def test_local_batches_equal_one_device_fed_the_concatenation(tmp_path, nproc, mesh):
    result = run_torchrun(tmp_path, MLP + f"""
model, reference = mlp(seed=3), mlp(seed=3)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
train_step = metadist.compile(step_fn, mesh={mesh}, batch="local")
world = int(os.environ["WORLD_SIZE"])
for step in range(3):
    gen = torch.Generator().manual_seed(step)
    whole = {{"x": torch.randn(8 * world, 12, generator=gen), "y": torch.randint(0, 5, (8 * world,), generator=gen)}}
    mine = {{key: value.chunk(world)[rank] for key, value in whole.items()}}   # what a DistributedSampler gives
    loss = train_step(model, optimizer, mine).item()
    want = step_fn(reference, ref_opt, whole).item()
    assert abs(loss - want) < 1e-5, (step, loss, want)
worst = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
assert worst < 1e-5, worst
layout = train_step.batch_layout()
assert set(layout) == {{".x", ".y"}} and all("slice" in text for text in layout.values()), layout
rank0_print("OK local-batch", f"max param diff {{worst:.1e}}", layout)
finish()
""", nproc=nproc)
    assert "OK local-batch" in result.stdout


def test_different_models_on_different_ranks_name_the_first_difference(tmp_path):
    result = run_torchrun(tmp_path, MLP + """
width = 32 if rank == 0 else 48
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.GELU(), torch.nn.Linear(width, 5))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_step = metadist.compile(step_fn, mesh=(2,))
try:
    train_step(model, optimizer, batch)
except Exception as err:
    assert "different models" in str(err) and "param 0.weight" in str(err), err
else:
    raise AssertionError("different models must be refused")
rank0_print("OK different-models")
finish()
""")
    assert "OK different-models" in result.stdout
