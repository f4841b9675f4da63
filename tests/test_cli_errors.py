"""One clear error: a failed distributed run is told as one block (rank, phase, exception, the user's line,
what to do, the log), never as torchrun's tracebacks.

The first tests read exceptions, error files and crash logs in this process; the last ones run
``metadist run`` on 2 gloo ranks with model files that fail on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from metadist.runtime.failure import ExceptionReport, RankErrorHandler, UserFrame, describe_exception, user_frame
from metadist.runtime.launch import LaunchOutcome, RankFailure, SilentRank, failure_block

#: Lines torchrun prints when it reports a failure itself.
TORCHRUN_BANNERS = ("ChildFailedError", "Root Cause", "torch.distributed.elastic", "OMP_NUM_THREADS", "*****")


def _import_file(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_exception_raised_in_user_code_is_shown_with_its_line(tmp_path):
    user = tmp_path / "user_model.py"
    user.write_text("def forward(x):\n    raise ValueError(f'width {x} does not fit')\n")
    module = _import_file(user, "user_model")
    try:
        try:
            module.forward(3)
        except ValueError as err:  # the way capture wraps a failure while tracing
            raise RuntimeError(f"the training step failed while being traced: {err}") from err
    except RuntimeError as err:
        report = describe_exception(err)
        frame = user_frame(err)
    assert (report.type, report.message, report.kind) == ("ValueError", "width 3 does not fit", "user-code")
    assert frame == UserFrame(str(user), 2, "forward", "raise ValueError(f'width {x} does not fit')")


def test_metadists_own_errors_are_bad_input_or_internal_and_point_at_the_caller():
    from metadist.ir import Mesh, MeshError

    with pytest.raises(MeshError) as info:
        Mesh.parse("2x")  # raised inside MetaDist: shown as MetaDist raised it, the line is the caller's
    report = describe_exception(info.value)
    assert (report.type, report.kind) == ("MeshError", "bad-input")
    assert report.user_frame is not None and report.user_frame.source == 'Mesh.parse("2x")  # raised inside MetaDist: ' \
        "shown as MetaDist raised it, the line is the caller's"
    unraised = describe_exception(KeyError("x"))
    assert (unraised.kind, unraised.user_frame) == ("internal", None)


def test_the_error_file_is_torchelastics_with_metadists_reading_added(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    handler = RankErrorHandler()
    try:
        raise OSError("disk full")
    except OSError as err:
        handler.record_exception(err)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "OSError: disk full" and failure.timestamp > 0  # torchelastic reads it
    extra = json.loads(error_file.read_text())["message"]["extraInfo"]
    assert "Traceback" in extra["py_callstack"]
    assert ExceptionReport.from_dict(extra["metadist"]).message == "disk full"
    assert handler.phase_file() == tmp_path / "phase"


def _failure(rank, exitcode=1, *, type_="ValueError", message="bad width", kind="user-code", phase="capture",
             time_s=10.0, log=Path("log")):
    exception = None if type_ is None else ExceptionReport(type=type_, message=message, kind=kind,
                                                           user_frame=UserFrame("m.py", 9, "forward", "raise X"),
                                                           time_s=time_s)
    return RankFailure(rank=rank, exitcode=exitcode, phase=phase, exception=exception, log=log)


def test_the_block_names_rank_phase_exception_line_hint_and_log():
    outcome = LaunchOutcome(Path("runs/r1"), (_failure(1, time_s=10.0), _failure(0, time_s=10.1)))
    block = failure_block(outcome, "metadist run")
    assert block.splitlines()[0] == "metadist run: rank 0 failed during capture"  # same error: the lowest rank
    assert "  ValueError: bad width" in block and "  at m.py:9 in forward: raise X" in block
    assert "what to do: fix the training step at that line" in block
    assert "rank 1 (the same error during capture)" in block and "logs of every rank: runs/r1" in block
    assert outcome.exit_status() == 1


def test_the_rank_that_failed_first_is_the_cause_not_the_peers_it_broke():
    peer = _failure(0, type_="RuntimeError", message="Connection closed by peer", kind="peer", phase="step 2", time_s=1.0)
    killed = _failure(1, exitcode=-signal.SIGKILL, type_=None, phase="step 2")
    outcome = LaunchOutcome(Path("runs/r2"), (peer, killed))
    assert outcome.root_cause() is killed
    block = failure_block(outcome, "metadist run")
    assert block.startswith("metadist run: rank 1 was killed by signal SIGKILL (9) during step 2")
    assert "out-of-memory killer" in block and "rank 0 (RuntimeError: Connection closed by peer during step 2)" in block
    bad_input = _failure(0, type_="PlanError", kind="bad-input")
    assert LaunchOutcome(Path("r"), (bad_input,)).exit_status() == 2


def test_a_native_crash_is_told_from_faulthandlers_stack(tmp_path):
    script = tmp_path / "crashing_model.py"
    script.write_text(textwrap.dedent("""\
        import faulthandler, os, sys

        def step():
            sys.stderr.write("free(): invalid pointer\\n"); sys.stderr.flush()
            os.abort()

        faulthandler.enable()
        step()
    """))
    log = tmp_path / "stderr.log"
    with open(log, "w") as handle:
        status = subprocess.run([sys.executable, str(script)], stderr=handle, timeout=60).returncode
    assert status == -signal.SIGABRT
    outcome = LaunchOutcome(tmp_path, (_failure(1, exitcode=status, type_=None, phase="discovery", log=log),))
    block = failure_block(outcome, "metadist run")
    assert block.startswith("metadist run: rank 1 was killed by signal SIGABRT (6) during discovery")
    assert "its last words: free(): invalid pointer" in block
    assert f"at {script}:5 in step: os.abort()" in block and "crashed in native code" in block
    assert "Traceback" not in block and "Fatal Python error" not in block


# ---------------------------------------------------------------------------- end to end, 2 gloo ranks

RAISING_MODEL = '''
import torch, metadist

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc(x)
        raise ValueError("the hidden size 4 does not match the head")

def workload():
    return metadist.Workload(model=Net(), batch={"x": torch.randn(4, 8)}, loss_fn=lambda m, b: m(b["x"]).sum(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
'''

KILLED_MODEL = '''
import os, signal
import torch, metadist

@torch.library.custom_op("metadist_test::die_on_rank_1", mutates_args=())
def die_on_rank_1(x: torch.Tensor) -> torch.Tensor:
    if os.environ.get("RANK") == "1":  # runs for real only in the steps (capture runs the fake kernel)
        os.kill(os.getpid(), signal.SIGKILL)
    return x.clone()

@die_on_rank_1.register_fake
def _(x):
    return torch.empty_like(x)

die_on_rank_1.register_autograd(lambda ctx, grad: grad)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return die_on_rank_1(self.fc(x))

def workload():
    return metadist.Workload(model=Net(), batch={"x": torch.randn(4, 8)}, loss_fn=lambda m, b: m(b["x"]).sum(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
'''


def _metadist_run(tmp_path: Path, model_text: str) -> tuple[subprocess.CompletedProcess, Path]:
    model = tmp_path / "model_file.py"
    model.write_text(model_text)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", str(model), "--nproc", "2",
                             "--steps", "2", "--timeout-s", "60", "--log-dir", str(tmp_path / "logs")],
                            capture_output=True, text=True, timeout=600, env=env)
    return result, model


def _log_path(stderr: str) -> Path:
    line = next(line for line in stderr.splitlines() if line.startswith("  log: "))
    return Path(line.removeprefix("  log: "))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_the_others_timed_out_waiting_for_is_named_with_where_it_was(tmp_path):
    """Every failure is a timeout waiting for a peer, and one rank recorded none: the launcher stopped it, and its log
    ends with the Python stacks faulthandler wrote at the SIGTERM. The block names that rank, its phase and the user's
    line it was on, whichever thread's stack comes first."""
    script = tmp_path / "stuck_model.py"
    script.write_text(textwrap.dedent("""\
        import faulthandler, signal, sys, threading, time

        def wait_forever():
            time.sleep(600)

        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        print("loading", file=sys.stderr, flush=True)
        wait_forever()
    """))
    log = tmp_path / "stderr.log"
    with open(log, "w") as handle:
        stuck = subprocess.Popen([sys.executable, str(script)], stderr=handle)
        deadline = time.monotonic() + 60
        while "loading" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        stuck.terminate()
        assert stuck.wait(timeout=60) == -signal.SIGTERM
    assert log.read_text().count("(most recent call first):") == 2  # both threads' stacks
    timeout = "DistStoreError: wait timeout after 120000ms, keys: /default_pg/0//cpu//0/3"
    peers = tuple(_failure(rank, type_="DistStoreError", message=timeout, kind="peer", phase="setup", time_s=5.0)
                  for rank in (0, 1, 2))
    outcome = LaunchOutcome(Path("runs/r3"), peers, silent=(SilentRank(rank=3, phase="setup", log=log),))
    block = failure_block(outcome, "metadist run").splitlines()
    assert block[0] == "metadist run: rank 0 failed during setup"
    at = block.index("  rank 3 recorded no failure: the launcher stopped it during setup")
    assert block[at + 1] == f"    at {script}:4 in wait_forever: time.sleep(600)", block
    assert block[at + 2] == f"    its log, which ends with its Python stack: {log}"
    # a rank that failed on its own is the cause: the ranks stopped after it are no news
    own = LaunchOutcome(Path("runs/r4"), (_failure(0),), silent=(SilentRank(rank=1, phase="capture", log=log),))
    assert "recorded no failure" not in failure_block(own, "metadist run")


def test_an_exception_in_the_users_forward_is_one_block(tmp_path):
    result, model = _metadist_run(tmp_path, RAISING_MODEL)
    terminal = result.stdout + result.stderr
    assert result.returncode == 1, terminal
    assert result.stderr.startswith("metadist run: rank 0 failed during capture"), terminal
    assert "ValueError: the hidden size 4 does not match the head" in result.stderr
    assert f"at {model}:11 in forward" in result.stderr
    assert "what to do: fix the training step at that line" in result.stderr
    log = _log_path(result.stderr)
    assert log.is_relative_to(tmp_path / "logs") and "Traceback (most recent call last)" in log.read_text()
    assert "Traceback" not in terminal and not any(banner in terminal for banner in TORCHRUN_BANNERS), terminal
    assert "capture: " in result.stdout  # rank 0's phases, plain lines when not on a terminal


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_with_the_signal_and_its_phase(tmp_path):
    result, _ = _metadist_run(tmp_path, KILLED_MODEL)
    terminal = result.stdout + result.stderr
    assert result.returncode == 1, terminal
    assert "metadist run: rank 1 was killed by signal SIGKILL (9) during step 0" in result.stderr, terminal
    assert _log_path(result.stderr).exists()
    assert "Traceback" not in terminal and not any(banner in terminal for banner in TORCHRUN_BANNERS), terminal
    assert "discovery: " in result.stdout and "lowering: " in result.stdout


def test_old_run_folders_are_pruned_and_nothing_else_is_touched(tmp_path):
    import time as clock

    from metadist.runtime.launch import prune_runs

    runs = []
    for index in range(4):
        folder = tmp_path / f"20260101-00000{index}-mlp-{100 + index}"
        folder.mkdir()
        (folder / "launcher.log").write_text("")
        os.utime(folder, (clock.time() - 100 + index, clock.time() - 100 + index))
        runs.append(folder)
    other = tmp_path / "my-own-notes-folder"
    other.mkdir()
    prune_runs(tmp_path, keep=2)
    assert [folder.exists() for folder in runs] == [False, False, True, True] and other.exists()
