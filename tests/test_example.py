"""``examples/train_gpt.py`` at a tiny size: it trains, evaluates, checkpoints, resumes, and 1 and 2
processes draw the same loss curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TINY = ("--layers", "2", "--width", "64", "--heads", "4", "--batch", "8", "--context", "32", "--text-mb", "0.3",
        "--eval-every", "3", "--checkpoint-every", "3", "--warmup", "2")


def _train(out: Path, nproc: int, steps: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(EXAMPLE),
               "--steps", str(steps), "--out", str(out), *TINY, *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_the_example_trains_resumes_and_matches_one_process(tmp_path):
    two = tmp_path / "two"
    _train(two, 2, 9, "--stop-after", "6")  # preempted after 6 of 9 steps
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    resumed = _train(two, 2, 9)
    assert "resumed at step 6" in resumed.stdout, resumed.stdout
    assert (two / "loss.png").stat().st_size > 0
    history = json.loads((two / "losses.json").read_text())
    assert [step for step, *_ in history["train"]] == list(range(9))  # the history came back from the checkpoint
    assert [step for step, _ in history["eval"]] == [2, 5, 8]

    one = tmp_path / "one"
    _train(one, 1, 9)
    single = json.loads((one / "losses.json").read_text())
    for (step, loss, norm, lr), (_, want_loss, want_norm, want_lr) in zip(history["train"], single["train"]):
        assert lr == want_lr, step
        assert abs(loss - want_loss) <= 1e-4 * want_loss, (step, loss, want_loss)
        assert abs(norm - want_norm) <= 1e-3 * want_norm, (step, norm, want_norm)
    assert history["train"][-1][1] < history["train"][0][1]  # it learns
