"""Launch a local distributed run through torchelastic, and report a failure as one block.

``metadist run`` and ``metadist bench`` start their ranks with torchelastic's launcher
(:func:`torch.distributed.launcher.api.elastic_launch`, what ``torchrun --standalone``
runs) inside the command's own process, so that a failure arrives as data
(``ChildFailedError.failures``: exit code, signal, error file per rank) instead of a
traceback on the terminal. Each rank's output goes to torchelastic's log folder
(``--log-dir``; default: ``runs/`` in MetaDist's cache folder): every stream of every
rank, except rank 0's standard output when the run shows it (its plan, steps and
check). The launcher's own log is ``launcher.log`` in the run's folder.

A failure is told as one block (:func:`failure_block`): the rank that failed first,
what it was doing (its phase, from the phase file every rank keeps, see
:mod:`metadist.runtime.failure`), the exception and the user's line (from the error
file) or the signal that killed it, what to do, and the log that holds its traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..forking import environment, fork_server_exists, rank_environment, start_fork_server
from .failure import ExceptionReport, UserFrame, phase_file_path

__all__ = ["LaunchOutcome", "LocalLaunch", "RankFailure", "SilentRank", "default_log_dir", "failure_block",
           "launch_local"]

#: Run folders kept in the default log folder; older ones are removed when a run starts.
KEEP_RUNS = 20


@dataclass(frozen=True, kw_only=True)
class LocalLaunch:
    """One local run: ``python -u -m MODULE ARGS...`` on ``nproc`` ranks."""

    module: str
    """The per-rank entry point, e.g. ``metadist.runtime.worker``."""
    args: tuple[str, ...]
    """Its arguments (the same on every rank)."""
    nproc: int
    """Ranks to start."""
    log_dir: Path
    """Folder that receives this run's folder."""
    name: str
    """A short name for the run's folder (the model)."""
    show_rank0_stdout: bool = True
    """Rank 0's standard output stays on the terminal; False: it goes to its log like everything else."""
    max_restarts: int = 0
    """Times torchelastic restarts the whole group after a rank fails (each attempt logs in ``attempt_N``)."""
    fork: bool = False
    """Start the ranks as forks of a fork server (:mod:`metadist.forking`: a new interpreter this process starts,
    which imports ``module`` and MetaDist's runtime once and forks a rank on each request), where
    :func:`fork_is_safe`: each rank then skips importing torch and MetaDist, seconds of a short run. The server is
    single-threaded when it forks; this process is not (the launcher's stores serve the ranks from threads of their
    own), and a fork of it could hang on a lock one of those threads held. Otherwise each rank is a new
    ``python -m module``. A process forks its ranks from one environment: a second fork launch in the same process
    with other environment variables is an error (:func:`metadist.forking.start_fork_server`)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {self.nproc}")


def fork_is_safe() -> bool:
    """Whether this machine lets ranks be forked: a fork server exists (POSIX) and no CUDA device does. A rank cannot
    use CUDA in a fork of a process that initialised it, and asking whether a device exists does; where one exists
    the ranks are spawned."""
    import torch

    return fork_server_exists() and not torch.cuda.is_available()


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed."""

    rank: int
    exitcode: int
    """Its exit status; negative: killed by signal ``-exitcode``."""
    phase: str | None
    """The phase it was in (its phase file), or None if it never wrote one."""
    exception: ExceptionReport | None
    """Its exception, read from its error file; None if it died without one (a signal, ``os._exit``)."""
    log: Path
    """Its standard error: tracebacks, warnings, a crash's Python stack."""

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def same_as(self, other: RankFailure) -> bool:
        """The same exception (type and message), or the same exit without one."""
        if self.exception is None or other.exception is None:
            return self.exception is None and other.exception is None and self.exitcode == other.exitcode
        return (self.exception.type, self.exception.message) == (other.exception.type, other.exception.message)

    @property
    def is_consequence(self) -> bool:
        """It failed because another rank did (a broken connection, a timeout, a stop from the launcher)."""
        if self.exception is not None:
            return self.exception.kind == "peer"
        return self.exitcode == -signal.SIGTERM


@dataclass(frozen=True)
class SilentRank:
    """A rank of a failed attempt that recorded no failure: still running when the launcher stopped it. Where every
    failure is a consequence (a timeout waiting for a peer), such a rank is the one the others waited for."""

    rank: int
    phase: str | None
    """The phase it was in (its phase file), or None if it never wrote one."""
    log: Path
    """Its standard error, which ends with its Python stack when the launcher stopped it (``RankErrorHandler``)."""


@dataclass(frozen=True)
class LaunchOutcome:
    """What a local run left: its folder and its failures (none: it succeeded)."""

    run_folder: Path
    failures: tuple[RankFailure, ...]
    restarts: int = 0
    """Times the group was restarted (its last attempt is the one that succeeded or whose failures these are)."""
    silent: tuple[SilentRank, ...] = ()
    """The last attempt's ranks that recorded no failure: the launcher stopped them when the first failure ended it."""

    @property
    def ok(self) -> bool:
        return not self.failures

    def root_cause(self) -> RankFailure | None:
        """The failure that caused the others: not a consequence, the first recorded; of several ranks that
        failed the same way, the lowest."""
        if not self.failures:
            return None

        def order(failure: RankFailure) -> tuple:
            recorded = failure.exception.time_s if failure.exception is not None else float("-inf")
            return (failure.is_consequence, failure.exception is not None, recorded, failure.rank)

        first = min(self.failures, key=order)
        return min((failure for failure in self.failures if failure.same_as(first)), key=lambda failure: failure.rank)

    def exit_status(self) -> int:
        """0 when every rank succeeded, 2 when bad input stopped it, 1 otherwise."""
        cause = self.root_cause()
        if cause is None:
            return 0
        return 2 if cause.exception is not None and cause.exception.kind == "bad-input" else 1


def default_log_dir(cache_dir: Path) -> Path:
    """Where run folders go unless ``--log-dir`` says otherwise."""
    return cache_dir / "runs"


def launch_local(launch: LocalLaunch) -> LaunchOutcome:
    """Start the ranks, wait for them, and collect their failures."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_folder = _new_run_folder(launch.log_dir, launch.name)
    redirects = {rank: Std.ALL for rank in range(launch.nproc)}
    if launch.show_rank0_stdout:
        redirects[0] = Std.ERR
    fork = launch.fork and fork_is_safe()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=launch.nproc, run_id="ranks", role="rank",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=launch.max_restarts, monitor_interval=0.1,
        start_method="forkserver" if fork else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_folder), redirects=redirects),
    )
    with _launcher_log(run_folder / "launcher.log"), environment(**rank_environment(launch.nproc)):
        try:
            if fork:
                start_fork_server(launch.module, launch.nproc)
                elastic_launch(config, _forked_rank)(launch.module, *launch.args)
            else:
                elastic_launch(config, sys.executable)("-u", "-m", launch.module, *launch.args)
        except ChildFailedError as err:
            exitcodes = {rank: failure.exitcode for rank, failure in err.failures.items()}
            recorded = _recorded_failures(run_folder, launch.nproc)
            if fork:  # torch's process context reports the first rank that exits: the others' error files say the rest
                exitcodes = {**recorded, **exitcodes}
            elif recorded:  # spawned ranks the launcher stopped after a recorded failure did not fail: they were stopped
                exitcodes = {rank: code for rank, code in exitcodes.items()
                             if rank in recorded or code != -signal.SIGTERM}
            failures = tuple(_rank_failure(run_folder, rank, code) for rank, code in sorted(exitcodes.items()))
            silent = tuple(_silent_rank(run_folder, rank) for rank in range(launch.nproc)
                           if rank not in exitcodes and rank not in recorded)
            return LaunchOutcome(run_folder, failures, _restarts(run_folder), silent)
        except SignalException as err:  # Ctrl-C or a scheduler: the agent stopped the ranks
            raise KeyboardInterrupt(f"{err.sigval.name}: the ranks were stopped; their logs are in {run_folder}") from err
    return LaunchOutcome(run_folder, (), _restarts(run_folder))


def _forked_rank(module: str, *args: str) -> None:
    """A forked rank: ``module.main(args)``, what ``python -m module args...`` runs in a spawned rank.

    The fork server started with the launch's environment (``OMP_NUM_THREADS`` included) and forks from before any
    torch computation. Its signal dispositions are those the command inherited, and a command started with SIGINT
    ignored (a background job of a shell without job control) would pass that on: the rank's signals are set to
    Python's defaults first, so that Ctrl-C and the launcher's SIGTERM stop it. Returns on success; a failing rank
    exits non-zero.
    """
    import importlib

    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [module, *args]
    # ``module.main(argv)``, not its ``__main__`` block: that leaves through os._exit, and a forked rank reports its
    # success by returning (multiprocessing ends the fork with os._exit after, skipping C++ teardown all the same)
    code = importlib.import_module(module).main(list(args))
    if code:
        _wait_for_peer_errors(os.environ.get("TORCHELASTIC_ERROR_FILE"), FORKED_FAILURE_GRACE_S)
        sys.exit(code)


FORKED_FAILURE_GRACE_S = 3.0
"""How long a failing forked rank waits, at most, for the other ranks to record errors of their own before it exits
(:func:`_wait_for_peer_errors`). The launcher stops every rank when the first one exits; ranks failing the same way
(the same error in the same code, or an error rank 0 broadcast to them) record theirs within this time even on a busy
machine, so the block names the lowest of them. A spawned rank's slower exit gave the others about a second."""


def _wait_for_peer_errors(error_file: str | None, timeout_s: float) -> None:
    """Until every rank of this host has an error file beside ``error_file`` (``.../attempt_N/<local rank>/error.json``,
    torchelastic's), or ``timeout_s`` passes."""
    if not error_file:
        return
    attempt = Path(error_file).parent.parent
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all((attempt / str(rank) / "error.json").exists() for rank in range(local)):
            return
        time.sleep(0.05)


def _recorded_failures(run_folder: Path, nproc: int) -> dict[int, int]:
    """Ranks of the last attempt that recorded an exception in their error file, with exit status 1 (their status is
    not known: the launcher stopped them after the first rank's failure)."""
    found = {}
    for rank in range(nproc):
        try:
            folder = rank_folder(run_folder, rank)
        except FileNotFoundError:
            continue
        if (folder / "error.json").exists():
            found[rank] = 1
    return found


def _restarts(run_folder: Path) -> int:
    """Attempts torchelastic made beyond the first (one ``attempt_N`` folder each)."""
    return max(len(list(run_folder.glob("ranks_*/attempt_*"))) - 1, 0)


def _new_run_folder(log_dir: Path, name: str) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(name.split(":")[0]).stem or name).strip("-")[:40] or "run"
    folder = log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{os.getpid()}"
    folder.mkdir()
    return folder


def prune_runs(log_dir: Path, keep: int = KEEP_RUNS) -> None:
    """Remove all but the newest ``keep`` run folders in ``log_dir`` (the ones :func:`launch_local` makes)."""
    import shutil

    runs = sorted((p for p in log_dir.glob("*-*-*") if p.is_dir() and (p / "launcher.log").exists()),
                  key=lambda p: p.stat().st_mtime)
    for old in runs[:-keep] if keep > 0 else runs:
        shutil.rmtree(old)


def rank_folder(run_folder: Path, rank: int) -> Path:
    """Torchelastic's folder of ``rank``'s logs in the last attempt: ``RUN/ranks_*/attempt_N/RANK``."""
    found = sorted(run_folder.glob(f"ranks_*/attempt_*/{rank}"), key=lambda path: int(path.parent.name.split("_")[1]))
    if not found:
        raise FileNotFoundError(f"no log folder of rank {rank} under {run_folder}")
    return found[-1]


def _rank_failure(run_folder: Path, rank: int, exitcode: int) -> RankFailure:
    import json

    folder = rank_folder(run_folder, rank)
    exception = None
    error_file = folder / "error.json"
    if error_file.exists():
        extra = json.loads(error_file.read_text())["message"].get("extraInfo", {})
        if "metadist" in extra:
            exception = ExceptionReport.from_dict(extra["metadist"])
    from ..progress import read_phase_file

    return RankFailure(rank=rank, exitcode=exitcode, phase=read_phase_file(phase_file_path(error_file)),
                       exception=exception, log=folder / "stderr.log")


def _silent_rank(run_folder: Path, rank: int) -> SilentRank:
    from ..progress import read_phase_file

    folder = rank_folder(run_folder, rank)
    return SilentRank(rank=rank, phase=read_phase_file(phase_file_path(folder / "error.json")),
                      log=folder / "stderr.log")


@contextlib.contextmanager
def _launcher_log(path: Path) -> Iterator[None]:
    """torch.distributed's log records (the elastic agent's) and torch.multiprocessing's (a forked group's: "Terminating
    process ... via signal SIGTERM" when a rank fails) go to ``path`` during the launch, not to the terminal.

    torch's logging setup gives the ``torch.distributed`` logger its own stderr handler; each logger's state is set
    aside for the launch and put back after.
    """
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = {}
    for name in _LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.propagate, logger.level)
        logger.handlers = [handler]
        logger.propagate, logger.level = False, logging.INFO
    try:
        yield
    finally:
        handler.close()
        for name, (handlers, propagate, level) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate, logger.level = handlers, propagate, level


_LAUNCHER_LOGGERS = ("torch.distributed", "torch.multiprocessing")
"""The loggers whose records the launch keeps in its ``launcher.log``."""


# ---------------------------------------------------------------------------- the block


def failure_block(outcome: LaunchOutcome, command: str) -> str:
    """The failure as the terminal shows it: one block, no traceback."""
    cause = outcome.root_cause()
    if cause is None:
        raise ValueError("the run succeeded: there is no failure to report")
    during = f" during {cause.phase}" if cause.phase else ""
    lines: list[str] = []
    if cause.exception is not None:
        lines.append(f"{command}: rank {cause.rank} failed{during}")
        lines += _indent(f"{cause.exception.type}: {cause.exception.message}")
        frame = cause.exception.user_frame
        hint = _exception_hint(cause.exception, cause.phase)
    else:
        native, frame = _crash_details(cause.log)
        lines.append(f"{command}: rank {cause.rank} {_death(cause)}{during}")
        if native:
            lines.append(f"  its last words: {native}")
        hint = _exit_hint(cause)
    if frame is not None:
        lines.append(f"  at {frame.where()}" + (f": {frame.source}" if frame.source else ""))
    lines.append(f"  what to do: {hint}")
    lines.append(f"  log: {cause.log}")
    others = [failure for failure in outcome.failures if failure is not cause]
    if others:
        lines.append("  also failed: " + "; ".join(_short(failure, cause) for failure in others))
    if cause.is_consequence:
        for rank in outcome.silent:  # the rank the others waited for, and where it was
            lines.append(f"  rank {rank.rank} recorded no failure: the launcher stopped it "
                         + (f"during {rank.phase}" if rank.phase else "before its first phase"))
            frame = _stop_frame(rank.log)
            if frame is not None:
                lines.append(f"    at {frame.where()}" + (f": {frame.source}" if frame.source else ""))
            lines.append(f"    its log, which ends with its Python stack: {rank.log}")
    lines.append(f"  logs of every rank: {outcome.run_folder}")
    return "\n".join(lines)


def _indent(text: str, limit: int = 20) -> list[str]:
    lines = text.splitlines() or [""]
    shown = [f"  {line}" for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"  ... ({len(lines) - limit} more lines in the log)")
    return shown


def _death(failure: RankFailure) -> str:
    if failure.signal_name is not None:
        return f"was killed by signal {failure.signal_name} ({-failure.exitcode})"
    return f"exited with status {failure.exitcode} without a Python exception"


def _short(failure: RankFailure, cause: RankFailure) -> str:
    if failure.same_as(cause):
        what = "the same error"
    elif failure.exception is not None:
        what = f"{failure.exception.type}: {_first_line(failure.exception.message)}"
    else:
        what = _death(failure).replace("was killed by", "killed by")
    during = f" during {failure.phase}" if failure.phase else ""
    return f"rank {failure.rank} ({what}{during})"


def _first_line(message: str, limit: int = 100) -> str:
    """A message's first line, without a C++ source location in brackets (gloo's), cut to ``limit``."""
    line = re.sub(r"^\[[^\]]*\]\s*", "", message.splitlines()[0] if message else "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _exception_hint(exception: ExceptionReport, phase: str | None) -> str:
    if exception.kind == "user-code":
        if phase == "load":
            return "fix the model file at that line: building the workload failed"
        if phase == "capture":
            return ("fix the training step at that line. MetaDist runs the step once to capture it, on fake tensors "
                    "(shapes and dtypes, no values)")
        return "fix your code at that line"
    if exception.kind == "bad-input":
        return "the message above says what to change"
    if exception.kind == "check":
        return ("the sharded run differs from the single-device run: unless the model is nondeterministic, this is a "
                "MetaDist bug; please report it with the log below")
    if exception.kind == "peer":
        return "another rank failed or stopped answering first; its log says why (see the folder of every rank)"
    return "this looks like a MetaDist bug: please report it with the log below, which holds the traceback"


def _exit_hint(failure: RankFailure) -> str:
    name = failure.signal_name
    if name == "SIGKILL":
        return ("something outside the process killed it, most often the kernel's out-of-memory killer (`dmesg` "
                "says): try a smaller batch, a memory budget (--memory-gb) or building the model on meta (--meta-init)")
    if name in ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL"):
        return ("it crashed in native code (a kernel, an extension or the communication library); the log holds "
                "the Python stack at the crash")
    if name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        return "it was stopped from outside (Ctrl-C, a job scheduler, the launcher after another failure)"
    if name is not None:
        return "the log holds what it wrote before the signal"
    return "something called exit without an exception (os._exit or a library); the log holds its last output"


_FATAL = re.compile(r"^Fatal Python error: (.*)$")
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")


def _crash_details(log: Path) -> tuple[str | None, UserFrame | None]:
    """From a crashed rank's log: the native library's message before the crash, and the user's line in
    the Python stack that ``faulthandler`` wrote (torchelastic's error handler enables it)."""
    from .failure import is_library_file, is_user_file

    lines = _log_tail(log)
    fatal = next((i for i in range(len(lines) - 1, -1, -1) if _FATAL.match(lines[i])), None)
    if fatal is None:
        return None, None
    before = [line.strip() for line in lines[:fatal] if line.strip()]
    native = before[-1] if before and not _FRAME.match(lines[fatal - 1]) else None
    frames = []
    for line in lines[fatal + 1:]:
        if line.startswith("Thread ") and frames:
            break  # the current thread's stack comes first; other threads follow
        frame = _frame_of(line)
        if frame is not None:
            frames.append(frame)
    for accept in (is_user_file, is_library_file):
        for frame in frames:
            if accept(frame.file):
                return native, _with_source(frame)
    return native, None


def _stop_frame(log: Path) -> UserFrame | None:
    """The user's line (else the innermost line) in the Python stacks a stopped rank's log ends with: what
    ``faulthandler`` wrote when the launcher's SIGTERM reached it (:class:`~metadist.runtime.failure.RankErrorHandler`
    registers it)."""
    from .failure import is_user_file

    lines = _log_tail(log)
    headers = [i for i, line in enumerate(lines) if _THREAD.match(line)]
    if not headers:
        return None
    start = headers[-1]  # the dump's first thread: earlier headers separated from it by frames and blank lines only
    for header in reversed(headers[:-1]):
        if not all(_FRAME.match(line) or not line.strip() for line in lines[header + 1:start]):
            break
        start = header
    frames = []
    for line in lines[start:]:
        frame = _frame_of(line)
        if frame is not None:
            frames.append(frame)
        elif line.strip() and not _THREAD.match(line):
            break
    shown = next((frame for frame in frames if is_user_file(frame.file)), frames[0] if frames else None)
    return _with_source(shown) if shown is not None else None


def _frame_of(line: str) -> UserFrame | None:
    """A frame of a ``faulthandler`` stack (``  File "f.py", line 9 in step``), without its source line."""
    match = _FRAME.match(line)
    return UserFrame(match[1], int(match[2]), match[3].strip(), "") if match else None


def _log_tail(log: Path) -> list[str]:
    """The last 64 KiB of a rank's log, as lines ([] if it has none)."""
    try:
        with open(log, "rb") as handle:
            handle.seek(max(0, os.path.getsize(log) - 65536))
            return handle.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def _with_source(frame: UserFrame) -> UserFrame:
    import linecache

    return UserFrame(frame.file, frame.line, frame.function, linecache.getline(frame.file, frame.line).strip())
