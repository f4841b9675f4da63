"""Run a test script under torchrun on N local gloo processes and return what it printed.

The scripts print ``OK <name> <figures>`` lines on success; a failing assertion on any rank
makes the launch fail, and the test shows the tail of every rank's output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PRELUDE = textwrap.dedent(
    """
    import copy, os, sys, warnings
    import torch
    import torch.distributed as dist
    import metadist
    from torch.distributed.tensor import DTensor

    def finish():
        dist.barrier()
        dist.destroy_process_group()
        from metadist.runtime.setup import exit_process
        exit_process(0)  # torch 2.13's gloo can abort at exit after all-gathers (see exit_process)

    def rank0_print(*args):
        if int(os.environ["RANK"]) == 0:
            print(*args, flush=True)
    """
)


def run_torchrun(tmp_path: Path, body: str, nproc: int = 2, args: tuple[str, ...] = (), timeout: int = 600,
                 expect_failure: bool = False) -> subprocess.CompletedProcess:
    """Launch ``PRELUDE + body`` on ``nproc`` processes; assert it succeeded (or failed, with ``expect_failure``)."""
    script = tmp_path / f"script_{abs(hash(body)) % 10**8}.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )
    output = result.stdout[-4000:] + result.stderr[-30000:]
    if expect_failure:
        assert result.returncode != 0, output
    else:
        assert result.returncode == 0, output
    return result
