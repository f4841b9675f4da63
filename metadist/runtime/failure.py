"""What a failing rank leaves for its launcher, through torchelastic's own error file.

torchrun gives every rank an error file (``TORCHELASTIC_ERROR_FILE``) and reads it back
when the rank fails (``ProcessFailure``). :class:`RankErrorHandler` is torchelastic's
``ErrorHandler`` (installed with its ``record`` decorator) that writes the same JSON,
with MetaDist's reading of the exception added under ``extraInfo.metadist``
(:func:`describe_exception`): the exception to show, the line of the user's code it
comes from, and what kind of failure it is, from which the launcher says what to do.

Next to the error file each rank keeps a phase file (:func:`phase_file_path`,
written by :class:`metadist.progress.PhaseFile`), which names the phase a rank was
in when a signal killed it and no error file could be written.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ..files import write_atomically

__all__ = ["ExceptionReport", "RankErrorHandler", "UserFrame", "describe_exception", "is_library_file", "is_user_file",
           "phase_file_path", "run_rank", "user_frame"]

#: Kinds of failure, from which the launcher chooses what to tell the user.
KINDS = ("user-code", "bad-input", "check", "peer", "internal")

PHASE_FILE_NAME = "phase"


@dataclass(frozen=True)
class UserFrame:
    """A line of the user's code."""

    file: str
    line: int
    function: str
    source: str

    def where(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class ExceptionReport:
    """MetaDist's reading of a rank's exception, as the launcher receives it."""

    type: str
    """Type name of the exception to show (the user's own exception when it was raised in the user's code)."""
    message: str
    """Its message."""
    kind: str
    """One of :data:`KINDS`."""
    user_frame: UserFrame | None
    """The innermost line of the user's code in the exception's chain, if any."""
    time_s: float
    """When it was recorded (seconds since the epoch): the first failure is the cause of the others."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ExceptionReport:
        frame = data.get("user_frame")
        return cls(type=data["type"], message=data["message"], kind=data["kind"],
                   user_frame=UserFrame(**frame) if frame else None, time_s=float(data["time_s"]))


def phase_file_path(error_file: str | os.PathLike) -> Path:
    """Where a rank whose torchelastic error file is ``error_file`` keeps its phase file."""
    return Path(error_file).with_name(PHASE_FILE_NAME)


class RankErrorHandler(ErrorHandler):
    """torchelastic's error handler (``TORCHELASTIC_ERROR_FILE``), its JSON with ``extraInfo.metadist`` added.

    ``initialize`` (run by ``record``) enables ``faulthandler``: a rank that crashes in native code leaves its Python
    stack in its log (the base class's), and so does a rank that the launcher stops with SIGTERM once another rank
    failed: where it was, which says why a rank the others timed out waiting for never came.
    """

    def initialize(self) -> None:
        import faulthandler
        import signal

        super().initialize()
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # chain: the signal still ends the rank

    def phase_file(self) -> Path | None:
        """Where this rank keeps its phase file; None when not started by torchelastic."""
        error_file = self._get_error_file_path()
        return phase_file_path(error_file) if error_file else None

    def record_exception(self, e: BaseException) -> None:
        error_file = self._get_error_file_path()
        if not error_file:
            return  # not started by torchelastic: the traceback on stderr is the record
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": "".join(traceback.format_exception(e)),
                    "timestamp": str(int(time.time())),
                    "metadist": describe_exception(e).to_dict(),
                },
            }
        }
        write_atomically(error_file, json.dumps(data))


def run_rank(body: Callable[[], int], *, show_phases: bool, listeners: tuple = ()) -> int:
    """Run one rank's ``body`` under torchelastic's ``record``; returns its exit status.

    Its phases go to its phase file, to ``listeners`` and, with ``show_phases``, rank 0's to its stdout.
    A failure is recorded in the error file (:class:`RankErrorHandler`) and its traceback
    printed to stderr (the rank's log under a launcher); the status is then 2 for bad input
    (the user's to fix, e.g. a mesh that does not fit) and 1 otherwise, so that the
    launcher stops the other ranks.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    from ..cli.main import user_error_types
    from .errors import USER_ERRORS

    handler = RankErrorHandler()
    try:
        return record(_with_listeners, error_handler=handler)(body, handler, show_phases, listeners)
    except Exception as err:  # recorded by the handler; the traceback goes to this rank's log
        print(f"rank {os.environ.get('RANK', '?')} failed:", file=sys.stderr)
        traceback.print_exc()
        return 2 if isinstance(err, user_error_types() + USER_ERRORS) else 1


def _with_listeners(body: Callable[[], int], handler: RankErrorHandler, show_phases: bool, extra: tuple) -> int:
    from rich.console import Console

    from ..progress import ConsoleListener, PhaseFile, listening
    from .env import read_torchrun_env

    listeners: list = [PhaseFile(path) for path in [handler.phase_file()] if path is not None]
    listeners.extend(extra)
    if show_phases and read_torchrun_env().rank == 0:
        listeners.append(ConsoleListener(Console()))
    with listening(*listeners):
        return body()


def describe_exception(err: BaseException) -> ExceptionReport:
    """The exception to show, its kind and the user's line (see :class:`ExceptionReport`)."""
    chain = _chain(err)
    shown = next((item for item in reversed(chain) if _raised_in_user_code(item)), err)
    return ExceptionReport(type=type(shown).__name__, message=str(shown), kind=_kind(err, shown),
                           user_frame=user_frame(err), time_s=time.time())


def user_frame(err: BaseException) -> UserFrame | None:
    """The innermost frame of the user's code in ``err``'s chain (causes first), else of a third-party library.

    The user's code is anything outside MetaDist, the standard library and installed packages;
    failing that, the innermost frame outside MetaDist and the standard library (a model
    library such as transformers) is the best pointer there is.
    """
    frames = [frame for item in reversed(_chain(err)) for frame in reversed(traceback.extract_tb(item.__traceback__))]
    for accept in (is_user_file, is_library_file):
        for frame in frames:
            if accept(frame.filename):
                return UserFrame(frame.filename, frame.lineno or 0, frame.name, (frame.line or "").strip())
    return None


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return chain


def _raised_in_user_code(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and is_user_file(frames[-1].filename)


def _kind(err: BaseException, shown: BaseException) -> str:
    from ..cli.main import user_error_types
    from .errors import USER_ERRORS, CheckError

    if _raised_in_user_code(shown):
        return "user-code"
    if isinstance(err, CheckError):
        return "check"
    if isinstance(err, user_error_types() + USER_ERRORS):
        return "bad-input"
    if _is_peer_failure(err):
        return "peer"
    return "internal"


def _is_peer_failure(err: BaseException) -> bool:
    """A collective or the store failed: most often because another rank died first."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        part in text for part in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out")
    )


def _internal_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {Path(__file__).resolve().parents[1]}  # the metadist package
    roots.update(Path(paths[key]).resolve() for key in ("stdlib", "platstdlib") if key in paths)
    return tuple(f"{root}{os.sep}" for root in roots)


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({f"{Path(paths[key]).resolve()}{os.sep}" for key in ("purelib", "platlib") if key in paths})


def is_library_file(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen runpy>, <string>
        return False
    path = str(Path(filename).resolve())
    return not path.startswith(_internal_roots())


def is_user_file(filename: str) -> bool:
    return is_library_file(filename) and not str(Path(filename).resolve()).startswith(_library_roots())
