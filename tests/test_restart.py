"""A killed or stuck rank is survived: the group restarts and resumes from the newest complete checkpoint.

``metadist run --checkpoint-dir D --checkpoint-every N --max-restarts R`` on 2 gloo ranks, with one rank
killed by SIGKILL (or stopped by SIGSTOP, so that the other times out in a collective) after a
checkpoint: the run finishes, and its per-step losses and final checkpoint equal an uninterrupted
run's bit for bit. Plus the Checkpointer's own contract: partial folders are never loaded, old ones
are pruned, and a checkpoint of another model is a clear error.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from torchrun_script import run_torchrun

pytestmark = [pytest.mark.distributed]

MODEL = textwrap.dedent(
    """
    import os
    from pathlib import Path
    import torch, metadist

    def workload():
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and "PID_DIR" in os.environ:
            Path(os.environ["PID_DIR"], f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Dropout(0.1), torch.nn.GELU(),
                                    torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 10))
        g = torch.Generator().manual_seed(1)
        batch = {"x": torch.randn(512, 256, generator=g), "y": torch.randint(0, 10, (512,), generator=g)}
        return metadist.Workload(
            model=model, batch=batch,
            loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        )
    """
)
STEPS = 16


def _run(tmp_path: Path, name: str, *extra: str, fault=None) -> tuple[subprocess.CompletedProcess, Path]:
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    checkpoints = tmp_path / f"ckpt-{name}"
    pids = tmp_path / f"pids-{name}"
    pids.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PID_DIR": str(pids)}
    command = [sys.executable, "-m", "metadist.cli.main", "run", str(model), "--nproc", "2", "--steps", str(STEPS),
               "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "4", "--log-dir", str(tmp_path / "logs"),
               *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if fault is not None:
        _inject(fault, checkpoints, pids, process)
    stdout, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), checkpoints


def _inject(fault: str, checkpoints: Path, pids: Path, process: subprocess.Popen) -> None:
    """Once the step-4 checkpoint is complete, kill (or stop) rank 1 of the first attempt."""
    deadline = time.monotonic() + 300
    while not (checkpoints / "step-00000004" / ".metadata").exists():
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.01)
    pid = int((pids / "rank1").read_text())
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


def _losses(stdout: str) -> dict[int, str]:
    """The last loss printed for each step (a restarted run prints the steps after its checkpoint again)."""
    return {int(step): loss for step, loss in re.findall(r"step (\d+): loss (\S+)", stdout)}


def _final_state(checkpoints: Path) -> dict:
    return _final_state_at(checkpoints, STEPS)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}{key}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    result, checkpoints = _run(tmp_path, "plain")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return _losses(result.stdout), _final_state(checkpoints)


@pytest.mark.parametrize("fault", ["kill", pytest.param("stop", marks=pytest.mark.slow)])
def test_a_lost_rank_restarts_the_group_from_the_last_checkpoint_bit_for_bit(tmp_path, uninterrupted, fault):
    extra = ("--max-restarts", "2") + (("--timeout-s", "10") if fault == "stop" else ())
    result, checkpoints = _run(tmp_path, fault, *extra, fault=fault)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "restarted 1 time(s)" in result.stdout, result.stdout[-2000:]
    assert re.search(r"resumed from .*step-000000(04|08|12)", result.stdout.replace("\n", "")), result.stdout[-3000:]
    losses, state = uninterrupted
    assert _losses(result.stdout) == losses
    resumed = dict(_flat(_final_state(checkpoints)))
    reference = dict(_flat(state))
    assert resumed.keys() == reference.keys()
    different = [key for key, value in reference.items() if not torch.equal(resumed[key], value)]
    assert not different, different[:5]


def test_checkpointer_never_loads_a_partial_save_and_keeps_the_newest(tmp_path):
    result = run_torchrun(tmp_path, """
ckpt_dir = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
batch = {"x": torch.randn(8, 8), "y": torch.randn(8, 4)}

@metadist.compile(mesh=(2,))
def train_step(model, optimizer, batch):
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    return loss

checkpointer = metadist.Checkpointer(ckpt_dir, every=2, keep=2, async_save=True)
train_step.prepare(model, optimizer, batch)
assert checkpointer.restore(model, optimizer, scheduler=scheduler) == 0
for step in range(6):
    train_step(model, optimizer, batch)
    scheduler.step()
    checkpointer.maybe_save(step + 1, model, optimizer, scheduler=scheduler, extra={"epoch": step // 3})
checkpointer.wait()
assert checkpointer.complete_steps() == [4, 6], checkpointer.complete_steps()
weights = model.weight.full_tensor().clone()
lr = optimizer.param_groups[0]["lr"]

# a save that died half-way leaves a partial folder and a folder with no metadata: neither is taken
if dist.get_rank() == 0:
    os.makedirs(os.path.join(ckpt_dir, ".step-00000008.partial"))
    os.makedirs(os.path.join(ckpt_dir, "step-00000010"))
dist.barrier()
assert checkpointer.latest() == 6

# resume into other weights and another scheduler position
with torch.no_grad():
    model.weight.mul_(0.0)
fresh_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
extra = {}
assert checkpointer.restore(model, optimizer, scheduler=fresh_scheduler, extra=extra) == 6
assert torch.equal(model.weight.full_tensor(), weights)
assert fresh_scheduler.last_epoch == 6 and optimizer.param_groups[0]["lr"] == lr, (fresh_scheduler.last_epoch, lr)
assert extra == {"epoch": 1}, extra

# a checkpoint of another model is a clear error naming the folder, and changes nothing
other = metadist.Checkpointer(ckpt_dir + "-other", every=1)
small = torch.nn.Linear(3, 3)
other.save(1, small, None)
try:
    other.restore(model, optimizer)
except Exception as err:
    assert "does not fit this run" in str(err) and "step-00000001" in str(err), err
else:
    raise AssertionError("a checkpoint of another model must be refused")
assert torch.equal(model.weight.full_tensor(), weights)
rank0_print("OK checkpointer")
finish()
""", args=(str(tmp_path / "ckpt"),))
    assert "OK checkpointer" in result.stdout


USER_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import torch.distributed as dist
    import metadist

    out, kill_at = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.1), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(16, 32, generator=g), "y": torch.randint(0, 4, (16,), generator=g)}

    @metadist.compile(mesh=(2,), timeout_s=30)
    def train_step(model, optimizer, batch):
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        return loss

    checkpointer = metadist.Checkpointer(out, every=2)
    train_step.prepare(model, optimizer, batch)
    start = checkpointer.restore(model, optimizer, scheduler=scheduler)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    for step in range(start, 10):
        if attempt == 0 and step == kill_at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the machine took this rank away
        loss = train_step(model, optimizer, batch)
        scheduler.step()
        if dist.get_rank() == 0:
            print(f"attempt {attempt} step {step} loss {loss.item():.8f}", flush=True)
        checkpointer.maybe_save(step + 1, model, optimizer, scheduler=scheduler)
    dist.barrier()
    dist.destroy_process_group()
    from metadist.runtime.setup import exit_process
    exit_process(0)
    """
)


def test_a_users_torchrun_script_survives_a_killed_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, kill_at in (("plain", -1), ("killed", 5)):
        out = tmp_path / name
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
             str(script), str(out), str(kill_at)], capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = (result.stdout, out)
    assert "attempt 1 step 4" in runs["killed"][0], runs["killed"][0]  # resumed from the step-4 checkpoint
    losses = {name: dict(re.findall(r"step (\d+) loss (\S+)", stdout)) for name, (stdout, _) in runs.items()}
    assert losses["killed"] == losses["plain"]
    final = {name: dict(_flat(_final_state_at(out, 10))) for name, (_, out) in runs.items()}
    assert final["killed"].keys() == final["plain"].keys()
    assert all(torch.equal(final["killed"][key], value) for key, value in final["plain"].items())


def _final_state_at(checkpoints: Path, step: int) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoints.parent / f"{checkpoints.name}-final.pt"
    dcp_to_torch_save(checkpoints / f"step-{step:08d}", target)
    return torch.load(target, weights_only=False)


def test_a_checkpoint_resumes_on_another_world_size_and_mesh(tmp_path, uninterrupted):
    """Saved by 2 ranks, resumed by 4 on a 2x2 mesh: replanned, DCP reshards, the run continues where it was."""
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    checkpoints = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "metadist.cli.main", "run", str(model), "--checkpoint-dir", str(checkpoints),
            "--log-dir", str(tmp_path / "logs")]
    first = subprocess.run(base + ["--nproc", "2", "--steps", "8"], capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = subprocess.run(base + ["--nproc", "4", "--mesh", "2x2", "--steps", str(STEPS), "--checkpoint-every", "4"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert re.search(r"resumed from .*step-00000008", second.stdout.replace("\n", "")), second.stdout[-3000:]
    losses, _ = uninterrupted
    resumed = _losses(second.stdout)
    assert sorted(resumed) == list(range(8, STEPS))
    for step, loss in resumed.items():  # another world size sums in another order: equal within fp32 rounding
        assert abs(float(loss) - float(losses[step])) <= 1e-5 * abs(float(losses[step])), (step, loss, losses[step])
