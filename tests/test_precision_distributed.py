"""Mixed precision end to end: ``metadist run --precision`` on 2 gloo ranks, checked against one device."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", *argv, "--nproc", "2", "--steps", "3",
                           "--check", "--timeout-s", "120"], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_run_matches_one_device_under_the_same_policy(precision):
    result = _run("mlp", "--precision", precision)
    output = " ".join(result.stdout.split())  # rich wraps long lines
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert f"precision {precision}: compute in" in output
    assert "check: PASS" in result.stdout
    assert "rounding measured against float32" in output
    if precision == "fp16":
        assert "loss scaled by a GradScaler" in output
        # the mlp's float16 loss times the initial scale 2**16 overflows: step 0 is skipped on every rank, as on one
        # device (its loss comes back at step 1), and the halved scale lets step 1 update
        losses = re.findall(r"step \d+: loss (\S+)", output)
        assert losses[0] == losses[1] != losses[2]

