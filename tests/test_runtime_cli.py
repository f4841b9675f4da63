"""End to end: the command ``metadist run`` builds, run through torchrun on 2 gloo ranks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from metadist.cli import run as run_command

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _command(*argv: str) -> list[str]:
    parser = argparse.ArgumentParser()
    run_command.register(parser.add_subparsers())
    return run_command.worker_command(parser.parse_args(["run", *argv]))


def test_run_with_the_solver_plan_passes_its_check():
    result = subprocess.run(_command("mlp", "--nproc", "2", "--steps", "2", "--check", "--optimizer", "sgd", "--timeout-s", "60"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(source: solver)" in result.stdout.replace("\n", " ")
    assert "check: PASS" in result.stdout
    assert "step 1: loss" in result.stdout


def test_a_plan_for_another_graph_is_refused_on_every_rank(tmp_path):
    plan = {
        "format": "metadist.plan", "version": 1, "graph_name": "other", "graph_fingerprint": "0" * 16,
        "metadist_version": __import__("metadist").__version__, "mesh": {"shape": [2], "axis_names": ["axis0"]},
        "node_strategies": {}, "input_shardings": {}, "output_shardings": [],
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    logs = tmp_path / "logs"
    result = subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", "mlp", "--nproc", "2", "--plan", str(path),
                             "--timeout-s", "30", "--log-dir", str(logs)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2  # bad input
    assert result.stderr.count("this plan was made for another graph") == 1  # one block on the terminal
    assert "also failed: rank 1 (the same error" in result.stderr
    rank_logs = sorted(logs.glob("*/ranks_*/attempt_0/*/stderr.log"))
    assert len(rank_logs) == 2 and all("this plan was made for another graph" in log.read_text() for log in rank_logs)
