"""A worker process for untrusted kernels: a crash or a hang costs one execution, not the caller.

Discovery runs ops on pieces of candidate splits, and some framework kernels trust their inputs'
shapes: given pieces that disagree, they corrupt memory and abort or segfault (an unchecked
attention backward did, killing the CLI and rank 0). An executor hands such ops to a
:class:`KernelWorker`: a child process forked from the caller (so it has the framework loaded and
starts in milliseconds) that runs one execution per request. When the kernel kills the child (a
signal, an abort, an exit) or runs past ``timeout_s``, :meth:`KernelWorker.run` raises
:class:`ExecutionCrashed` naming the signal or the timeout, and the next request forks a fresh
child. Discovery treats :class:`ExecutionCrashed` like any refused execution: the candidate is
refused, or, when even the whole inputs do not run, the op gets no rule and the reason says why.

The child's standard error goes to a temporary file, so a C library's last words ("double free
or corruption") end up in the reason instead of on the terminal. The child exits with
``os._exit`` (no ``atexit`` handlers, no flushing of the parent's buffers). POSIX only (``fork``).
Framework-free: the function the child runs is the executor's.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import weakref
from multiprocessing.connection import Connection, Pipe
from typing import Any, Callable, Sequence

from .executor import ExecutionRefused, OpCall

__all__ = ["ExecutionCrashed", "KernelWorker"]

log = logging.getLogger(__name__)

MAX_CRASHES_PER_OP = 64
"""After this many crashes of one op until :meth:`KernelWorker.close`, its further executions are refused
without running (said in the reason)."""


class ExecutionCrashed(ExecutionRefused):
    """The kernel killed its worker process (a signal or an exit) or ran past the timeout."""


class KernelWorker:
    """Runs ``function(call, inputs)`` in a forked child process, one request at a time.

    ``setup`` runs once in each fresh child (e.g. single-threaded kernels). ``timeout_s`` bounds
    one execution; an op that timed out once is refused until :meth:`close` (a hang costs the
    timeout once per discovery session, not once per candidate), and so is an op that crashed
    :data:`MAX_CRASHES_PER_OP` times. Use :meth:`close` (or ``with``) to stop the child.
    """

    def __init__(self, function: Callable[[OpCall, list], list], *, timeout_s: float = 60.0,
                 setup: Callable[[], None] | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.function, self.setup, self.timeout_s = function, setup, timeout_s
        self.crashes: dict[str, int] = {}
        """Op target -> how many executions of it crashed or hung."""
        self.last_reason: dict[str, str] = {}
        """Op target -> the reason of its latest crash."""
        self.forks = 0
        """How many worker processes were started (the first request, and one after each crash)."""
        self._child: _Child | None = None
        self._hung: dict[str, str] = {}
        self._session_crashes: dict[str, int] = {}
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------- requests
    def run(self, call: OpCall, inputs: Sequence[Any]) -> list:
        """The function's result in the child; raises :class:`ExecutionCrashed`, or the child's error."""
        refused = self._refused_before(call)
        if refused:
            raise ExecutionCrashed(refused)
        connection = self._start()
        try:
            connection.send((call, list(inputs)))
            ready = connection.poll(self.timeout_s)
        except (OSError, EOFError):  # the child died while reading the request
            raise self._died(call) from None
        if not ready:
            self._stop()
            reason = f"{call.target} did not finish within {self.timeout_s:g} s on input shapes {_shapes(inputs)}; its worker was stopped"
            self._hung[call.target] = reason
            self._count(call, reason)
            raise ExecutionCrashed(reason)
        try:
            reply = connection.recv()
        except (OSError, EOFError):  # the child died in the kernel
            raise self._died(call) from None
        return _unpack(reply, call)

    def close(self) -> None:
        """Stop the child process (a later request forks a new one) and forget which ops were refused."""
        self._stop()
        self._hung.clear()
        self._session_crashes.clear()

    def report_crashes(self, since: dict[str, int]) -> None:
        """One warning per op whose executions crashed or hung after the counts in ``since`` (a copy of :attr:`crashes`)."""
        for target, count in self.crashes.items():
            new = count - since.get(target, 0)
            if new:
                log.warning("%s: %d execution(s) on candidate pieces crashed or hung in the isolated worker and were "
                            "refused (last: %s)", target, new, self.last_reason[target])

    def __enter__(self) -> "KernelWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- the child
    def _start(self) -> Connection:
        if self._child is None:
            self._child = _Child.fork(self.function, self.setup)
            self.forks += 1
            self._finalizer = weakref.finalize(self, self._child.terminate)
        return self._child.connection

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._child = self._finalizer = None

    def _died(self, call: OpCall) -> ExecutionCrashed:
        child = self._child
        assert child is not None
        how, last_words = child.reap(), child.last_words()
        self._stop()
        reason = f"{call.target} crashed its discovery worker ({how})" + (f": {last_words}" if last_words else "")
        self._count(call, reason)
        log.info("%s on input shapes %s; the execution is refused and the worker restarted", reason, call.input_shapes)
        return ExecutionCrashed(reason)

    def _count(self, call: OpCall, reason: str) -> None:
        self.crashes[call.target] = self.crashes.get(call.target, 0) + 1
        self._session_crashes[call.target] = self._session_crashes.get(call.target, 0) + 1
        self.last_reason[call.target] = reason

    def _refused_before(self, call: OpCall) -> str | None:
        if call.target in self._hung:
            return f"refused without running: earlier, {self._hung[call.target]}"
        if self._session_crashes.get(call.target, 0) >= MAX_CRASHES_PER_OP:
            return (f"refused without running: {call.target} crashed {self._session_crashes[call.target]} times "
                    f"(last: {self.last_reason[call.target]})")
        return None


def _serve(connection: Connection, function: Callable, setup: Callable[[], None] | None, stderr_fd: int) -> None:
    """The child's loop: one reply per request; exits through ``os._exit`` whatever happens."""
    status = 0
    try:
        os.dup2(stderr_fd, 2)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the child
        import faulthandler

        faulthandler.disable()
        if setup is not None:
            setup()
        while True:
            message = connection.recv()
            if message is None:
                break
            call, inputs = message
            try:
                reply: tuple = ("ok", function(call, inputs))
            except ExecutionRefused as err:
                reply = ("refused", str(err))
            except Exception as err:  # the kernel's own error goes back to the caller, who decides
                reply = ("error", type(err).__name__, str(err))
            connection.send(reply)
    except BaseException:  # the parent went away (EOF) or the loop broke: leave quietly
        status = 1
    finally:
        os._exit(status)


def _unpack(reply: tuple, call: OpCall) -> list:
    kind = reply[0]
    if kind == "ok":
        return reply[1]
    if kind == "refused":
        raise ExecutionRefused(reply[1])
    raise WorkerError(reply[1], reply[2])


class WorkerError(RuntimeError):
    """The kernel raised an error in the worker; ``kind`` is its class name there."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class _Child:
    """One forked worker: its pid, its end of the pipe, its standard error file."""

    def __init__(self, pid: int, connection: Connection, stderr: Any) -> None:
        self.pid, self.connection, self.stderr = pid, connection, stderr
        self.status: int | None = None
        self.reaped = False

    @staticmethod
    def fork(function: Callable, setup: Callable[[], None] | None) -> "_Child":
        parent_end, child_end = Pipe(duplex=True)
        stderr = tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:  # the child: serve requests until told to stop; never returns
            parent_end.close()
            _serve(child_end, function, setup, stderr.fileno())
        child_end.close()
        return _Child(pid, parent_end, stderr)

    def reap(self) -> str:
        """Wait for the (dead or dying) child and say how it ended."""
        if not self.reaped:
            _, self.status = os.waitpid(self.pid, 0)
            self.reaped = True
        return _status_text(self.status)

    def last_words(self, limit: int = 300) -> str:
        """The last non-empty line the child wrote to its standard error, shortened."""
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1][:limit] if lines else ""

    def terminate(self) -> None:
        """Kill the child if it still runs (never a reaped pid: it may belong to another process by now)."""
        self.connection.close()
        if not self.reaped:
            os.kill(self.pid, signal.SIGKILL)
            self.reap()
        self.stderr.close()


def _status_text(status: int | None) -> str:
    if status is None:
        return "it exited"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"signal {signal.Signals(number).name}"
        except ValueError:
            return f"signal {number}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _shapes(inputs: Sequence[Any]) -> list:
    return [tuple(getattr(x, "shape", ())) for x in inputs]
