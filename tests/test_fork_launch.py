"""``metadist run`` forks its ranks from a fork server that imported torch and MetaDist once (``LocalLaunch.fork``).

A forked rank must start as a spawned one would: its own thread count, the default signal handlers, torch's own
logging, its torchelastic environment, the command's environment. And the process it is forked from must be
single-threaded: the command itself runs the launcher's stores on threads, and a fork of it can hang on a lock one
of them held. The model file below writes what its rank sees, and the run checks it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY_WORKLOAD = '''
    torch.manual_seed(0)
    return metadist.Workload(model=torch.nn.Linear(8, 4), batch={"x": torch.randn(4, 8)},
                             loss_fn=lambda m, b: m(b["x"]).square().mean(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
'''
"""The end of a model file's ``workload()``: a tiny seeded model and step."""

REPORTING_MODEL = '''
import json, logging, os, signal, sys
import torch
import metadist

def workload():
    rank = int(os.environ["RANK"])
    facts = {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
        "grandparent": int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1]),
        "command_env": os.environ.get("SET_FOR_THE_COMMAND"),
        "threads": torch.get_num_threads(),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "launcher_log_handlers": [type(h).__name__ for name in ("torch.distributed", "torch.multiprocessing")
                                  for h in logging.getLogger(name).handlers
                                  if getattr(h, "baseFilename", "").endswith("launcher.log")],
        "local_rank": os.environ["LOCAL_RANK"],
        "main": getattr(sys.modules["__main__"], "__file__", ""),
    }
    with open(os.path.join(os.environ["FACTS_DIR"], f"rank{rank}.json"), "w") as out:
        json.dump(facts, out)
''' + TINY_WORKLOAD


@pytest.mark.distributed
def test_forked_ranks_start_as_spawned_ones_would_and_pass_the_check(tmp_path):
    model = tmp_path / "model_file.py"
    model.write_text(REPORTING_MODEL)
    env = dict(os.environ, OMP_NUM_THREADS="1", FACTS_DIR=str(tmp_path), SET_FOR_THE_COMMAND="yes")
    command = subprocess.Popen([sys.executable, "-m", "metadist.cli.main", "run", str(model), "--nproc", "2",
                                "--steps", "2", "--check", "--timeout-s", "60", "--log-dir", str(tmp_path / "logs")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = command.communicate(timeout=600)
    assert command.returncode == 0, stdout + stderr
    assert "check: PASS" in stdout
    facts = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, seen in enumerate(facts):
        # a fork of the command's fork server, a single-threaded child of the command (a spawned rank's parent is the
        # command, and its __main__ is metadist/runtime/worker.py)
        assert seen["grandparent"] == command.pid and seen["parent"] != command.pid, seen
        assert seen["parent_threads"] == 1, seen
        assert Path(seen["main"]).parts[-3:] == ("metadist", "cli", "main.py"), seen
        assert seen["command_env"] == "yes", seen
        assert seen["threads"] == 1, seen  # OMP_NUM_THREADS as the launch set it, not the launcher's count
        assert seen["sigterm_default"] and seen["sigint_default"], seen  # not torchelastic's launcher handlers
        assert seen["launcher_log_handlers"] == [], seen  # the launcher's log file stays the launcher's
        assert seen["local_rank"] == str(rank)


FAILING_MODEL = '''
import torch

def workload():
    raise ValueError("this model file is broken on every rank")
'''


@pytest.mark.distributed
def test_ranks_failing_alike_are_told_as_one_block_naming_rank_0(tmp_path):
    """Both forked ranks fail the same way: the block names rank 0 and says rank 1 failed alike (the failing rank waits
    for its peers' error files before it exits), and torch's "Terminating process" warning stays in the launcher's
    log, off the terminal."""
    model = tmp_path / "model_file.py"
    model.write_text(FAILING_MODEL)
    result = subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", str(model), "--nproc", "2", "--steps", "1",
                             "--timeout-s", "60", "--log-dir", str(tmp_path / "logs")],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    assert result.stderr.startswith("metadist run: rank 0 failed during load"), result.stderr
    assert "this model file is broken on every rank" in result.stderr
    assert "rank 1 (the same error" in result.stderr, result.stderr
    assert "Terminating process" not in result.stdout + result.stderr


STUCK_MODEL = '''
import os, time
import torch
import metadist

def workload():
    if os.environ["RANK"] == "1":
        time.sleep(600)  # this rank never finishes loading
''' + TINY_WORKLOAD


@pytest.mark.distributed
def test_a_rank_that_never_comes_is_named_with_the_line_it_was_stuck_on(tmp_path):
    """Rank 1 hangs in the model file; rank 0 times out waiting for it in its first collective. The block names rank 0's
    timeout and then rank 1: it recorded nothing, the launcher stopped it during load, at the user's line, and its
    log ends with its Python stack (written at the launcher's SIGTERM)."""
    model = tmp_path / "model_file.py"
    model.write_text(STUCK_MODEL)
    result = subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", str(model), "--nproc", "2",
                             "--steps", "1", "--timeout-s", "10", "--log-dir", str(tmp_path / "logs")],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 1, result.stdout + result.stderr
    block = result.stderr.splitlines()
    assert block[0] == "metadist run: rank 0 failed during load", result.stderr
    at = block.index("  rank 1 recorded no failure: the launcher stopped it during load")
    assert block[at + 1] == f"    at {model}:8 in workload: time.sleep(600)  # this rank never finishes loading", block
    log = Path(block[at + 2].split(": ", 1)[1])
    assert log.name == "stderr.log" and "in workload" in log.read_text()


@pytest.mark.distributed
def test_a_spawned_rank_that_never_comes_is_named_too(tmp_path, monkeypatch):
    """Spawned ranks (a machine with CUDA, ``metadist bench``): torchelastic reports the rank it stopped as failed by
    SIGTERM. Beside rank 0's recorded timeout that rank did not fail, it was stopped: the block names rank 0 as the
    failure and rank 1 as the rank it waited for, with its line."""
    from metadist.runtime.launch import LocalLaunch, failure_block, launch_local

    model = tmp_path / "model_file.py"
    model.write_text(STUCK_MODEL)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    outcome = launch_local(LocalLaunch(module="metadist.runtime.worker", args=(str(model), "--steps", "1",
                                                                              "--timeout-s", "10"),
                                       nproc=2, log_dir=tmp_path / "logs", name="stuck", show_rank0_stdout=False))
    assert [failure.rank for failure in outcome.failures] == [0] and [rank.rank for rank in outcome.silent] == [1]
    block = failure_block(outcome, "metadist run").splitlines()
    assert block[0] == "metadist run: rank 0 failed during load", block
    at = block.index("  rank 1 recorded no failure: the launcher stopped it during load")
    assert block[at + 1] == f"    at {model}:8 in workload: time.sleep(600)  # this rank never finishes loading", block


def test_a_launch_forks_only_where_asked_and_safe(monkeypatch):
    """Ranks are spawned by default (a caller that ran torch computation must not fork: OpenMP's threads do not
    survive it), and on a machine with a CUDA device or without a fork server (Windows) even when asked; there
    ``metadist run`` starts no server."""
    import multiprocessing

    import torch

    from metadist import forking
    from metadist.runtime.launch import LocalLaunch, fork_is_safe

    assert LocalLaunch(module="m", args=(), nproc=2, log_dir=Path("."), name="n").fork is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not fork_is_safe()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fork_is_safe()
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert not fork_is_safe()
    monkeypatch.setattr(forking, "_SERVER", [])
    forking.start_fork_server("metadist.runtime.worker", 2)
    assert forking._SERVER == []


def test_a_failing_fork_waits_for_its_peers_errors_and_no_longer(tmp_path, monkeypatch):
    """The launcher stops every rank once one exits: a failing forked rank first gives the others time to record
    theirs (the block then names the lowest rank failing that way), up to its grace, and not longer."""
    import time

    from metadist.runtime.launch import _wait_for_peer_errors

    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
    mine = tmp_path / "1" / "error.json"
    mine.write_text("{}")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    started = time.monotonic()
    _wait_for_peer_errors(str(mine), timeout_s=0.3)
    assert time.monotonic() - started >= 0.3  # rank 0 recorded nothing: the whole grace
    (tmp_path / "0" / "error.json").write_text("{}")
    started = time.monotonic()
    _wait_for_peer_errors(str(mine), timeout_s=5.0)
    assert time.monotonic() - started < 1.0  # every rank recorded its error: no waiting


def test_a_second_fork_launch_from_another_environment_is_an_error(monkeypatch):
    """The fork server keeps the environment it started with: a later fork launch of the same process whose
    environment changed is refused, naming what changed, rather than starting ranks with the old one."""
    from metadist import forking

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    started = (dict(os.environ), (forking.FREEZE_MODULE, "metadist.runtime.worker"))
    monkeypatch.setattr(forking, "_SERVER", [started])
    monkeypatch.setenv("CHANGED_AFTER_THE_SERVER_STARTED", "1")
    with pytest.raises(RuntimeError, match="changed: CHANGED_AFTER_THE_SERVER_STARTED"):
        forking.start_fork_server("metadist.runtime.worker", 2)
    monkeypatch.delenv("CHANGED_AFTER_THE_SERVER_STARTED")
    with pytest.raises(RuntimeError, match="the modules, now"):
        forking.start_fork_server("metadist.bench.harness", 2)


def test_the_fork_server_module_imports_no_torch():
    """``metadist run`` starts the fork server before it imports torch, so that the server's imports and its own run
    side by side: the module that starts it must not import torch itself."""
    code = "import sys, metadist.forking; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stdout + result.stderr


def test_ranks_get_one_thread_each_unless_the_user_chose_a_number(monkeypatch):
    # as torchrun does; an empty OMP_NUM_THREADS is no choice (torch would run a thread per core in every rank)
    from metadist.forking import environment, rank_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rank_environment(2) == {"OMP_NUM_THREADS": "1"} and rank_environment(1) == {"OMP_NUM_THREADS": ""}
    for blank in ("", "  "):
        monkeypatch.setenv("OMP_NUM_THREADS", blank)
        assert rank_environment(4) == {"OMP_NUM_THREADS": "1"}
        with environment(**rank_environment(4)):
            assert os.environ["OMP_NUM_THREADS"] == "1"
        assert os.environ["OMP_NUM_THREADS"] == blank
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_environment(4) == {"OMP_NUM_THREADS": ""}
    with environment(**rank_environment(4)):
        assert os.environ["OMP_NUM_THREADS"] == "3"
