"""Discover many signatures at once, in worker processes.

Discovery is CPU-bound and each signature's is independent of the others', so a graph's new
signatures can be spread over processes. It pays where one execution is dear: JAX compiles every
primitive for every piece shape with XLA (~60-90 ms a compile on a 2-core machine, ~8 compiles a
signature), so discovering GPT-2's 180 JAX signatures took 150-160 s in one process.

An executor opts in by defining ``worker_env() -> dict[str, str]``: the environment its workers need on
top of the caller's (JAX's: CPU only, discovery never runs on an accelerator). It must pickle. Each
worker is a fresh interpreter (``python -m metadist.shardcombine.pool``), not a fork: a forked child of
a process whose framework runs threads (XLA does) may deadlock, and ``multiprocessing``'s spawn would
run the user's script again in every worker. Requests and replies are length-prefixed pickles over
the worker's standard input and a copy of its standard output (the worker's prints go to standard error).

A worker that dies while discovering a signature gives that signature no rule, with a reason that
says so (like an execution that crashes the isolated kernel worker, :mod:`.isolation`), and a fresh
worker takes the next signature. An error in discovery itself (a bug, not a refused execution) stops
the whole call with the worker's traceback, as it would in one process.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO, Iterator, Sequence

__all__ = ["DiscoveryWorkerError", "MAX_WORKERS", "NotSendable", "SIGNATURES_PER_WORKER", "WorkerPool", "worker_count"]

log = logging.getLogger(__name__)

MAX_WORKERS = 8
"""At most this many worker processes."""

SIGNATURES_PER_WORKER = 8
"""A worker is started only for this many new signatures: starting one (a fresh interpreter importing the
framework) costs ~2-3 s on a 2-core machine, about as much as discovering 3 JAX signatures."""

_HEADER = struct.Struct("!Q")


class DiscoveryWorkerError(RuntimeError):
    """A worker process could not start, or discovery itself raised in it (the worker's traceback is the message)."""


class NotSendable(ValueError):
    """The executor or config does not pickle, so it cannot be sent to a worker (the message says why)."""


def worker_count(executor: Any, pending: int) -> int:
    """How many worker processes to discover ``pending`` signatures with (0 or 1: discover in this process)."""
    if not callable(getattr(executor, "worker_env", None)):
        return 0
    from ..config import usable_cores

    return max(0, min(usable_cores(), MAX_WORKERS, pending // SIGNATURES_PER_WORKER))


class WorkerPool:
    """``workers`` worker processes discovering signatures with ``executor`` and ``config``; raises
    :class:`NotSendable` when those do not pickle."""

    def __init__(self, executor: Any, config: Any, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {workers}")
        self.workers = workers
        try:
            self._setup = pickle.dumps((executor, config))
        except Exception as err:  # noqa: BLE001 - any pickling error: the caller discovers in its own process
            raise NotSendable(f"{type(err).__name__}: {err}") from err
        self._env = {**os.environ, **executor.worker_env(),
                     "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}

    def discover(self, items: Sequence[tuple[Any, Any]]) -> Iterator[tuple[Any, Any, float]]:
        """``(signature, outcome, seconds)`` for each ``(signature, call)`` of ``items``, as they finish.

        ``outcome`` is the rule, or the reason (a str) there is none. Raises :class:`DiscoveryWorkerError`.
        """
        tasks: queue.SimpleQueue = queue.SimpleQueue()
        for item in items:
            tasks.put(item)
        results: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()
        threads = [threading.Thread(target=self._drive, args=(tasks, results, stop), daemon=True,
                                    name=f"discovery-worker-{index}") for index in range(min(self.workers, len(items)))]
        for thread in threads:
            thread.start()
        try:
            for _ in range(len(items)):
                result = results.get()
                if isinstance(result, BaseException):
                    raise result
                yield result
        finally:
            stop.set()
            for thread in threads:
                thread.join()

    # -------------------------------------------------------------- one worker's thread
    def _drive(self, tasks: queue.SimpleQueue, results: queue.SimpleQueue, stop: threading.Event) -> None:
        worker: _Worker | None = None
        try:
            while not stop.is_set():
                try:
                    signature, call = tasks.get_nowait()
                except queue.Empty:
                    return
                if worker is None:
                    worker = _Worker.start(self._setup, self._env)
                reply = worker.ask((signature, call))
                if reply is None and stop.is_set():  # the caller stopped (an error elsewhere, an interrupt)
                    return
                if reply is None:  # the worker died in this signature's discovery
                    code = worker.stop()
                    worker = None
                    reason = (f"{signature.target} killed its discovery worker process (exit code {code}) on signature "
                              f"{signature.key}; the worker's last messages are on standard error")
                    log.warning("%s", reason)
                    results.put((signature, reason, 0.0))
                elif reply[0] == "ok":
                    results.put((signature, reply[1], reply[2]))
                else:
                    results.put(DiscoveryWorkerError(f"discovering {signature.key} raised in a worker process:\n{reply[1]}"))
                    return
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, which raises it
            results.put(err)
        finally:
            if worker is not None:
                worker.close()


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    @classmethod
    def start(cls, setup: bytes, env: dict[str, str]) -> "_Worker":
        process = subprocess.Popen([sys.executable, "-m", "metadist.shardcombine.pool"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=env)
        worker = cls(process)
        assert process.stdin is not None and process.stdout is not None
        try:
            _write_raw(process.stdin, setup)
            ready = _read(process.stdout)
        except (BrokenPipeError, EOFError, OSError):
            ready = None
        if ready != ("ready",):
            code = worker.stop()
            raise DiscoveryWorkerError(f"a discovery worker process did not start (exit code {code}); its messages are on "
                                       "standard error above")
        return worker

    def ask(self, request: Any) -> tuple | None:
        """The worker's reply, or None if it died."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            _write(self.process.stdin, request)
            return _read(self.process.stdout)
        except (BrokenPipeError, EOFError, OSError):
            return None

    def close(self) -> None:
        """Ask the worker to exit (end of input), then make sure it has."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.stop()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def stop(self) -> int | None:
        """Kill the worker; its exit code."""
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        return code


# ------------------------------------------------------------------ framing


def _write(stream: BinaryIO, message: Any) -> None:
    _write_raw(stream, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _write_raw(stream: BinaryIO, data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the other end closed the pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other end closed the pipe mid-message")
    return pickle.loads(data)


# ------------------------------------------------------------------ the worker's side


def _serve() -> None:
    """The worker: read the executor and config, then discover one signature per request until end of input."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints must not corrupt the replies
    requests = sys.stdin.buffer
    from .api import _discover_one

    executor, config = _read(requests)
    _write(replies, ("ready",))
    while True:
        try:
            signature, call = _read(requests)
        except EOFError:
            return
        started = time.perf_counter()
        try:
            outcome = _discover_one(signature, call, executor, config)
        except Exception:  # noqa: BLE001 - sent to the caller, which raises it
            _write(replies, ("error", traceback.format_exc()))
            continue
        _write(replies, ("ok", outcome, time.perf_counter() - started))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="discovery worker: %(levelname)s %(name)s: %(message)s")
    _serve()
