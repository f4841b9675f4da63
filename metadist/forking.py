"""The fork server that ``metadist run``'s ranks are forked from (``LocalLaunch.fork``).

A rank forked from a process that imported torch and MetaDist skips those imports, seconds of a short run. It
must not be forked from the launching command itself: torchelastic's launcher runs its stores on threads of their
own, and a fork made while one of them holds a lock (the allocator's, the logger's, the store's) can hang in the
child; one rank of four then never joins the process group. Multiprocessing's fork server is a new, single-threaded
interpreter: it imports the modules once and forks a rank on each request.

This module imports no torch, so that a command can start the server first and the server's imports run beside the
command's own.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

__all__ = ["FORK_PRELOAD", "FREEZE_MODULE", "chosen_threads", "environment", "fork_server_exists", "launch_environment",
           "rank_environment", "start_fork_server"]

FORK_PRELOAD = ("metadist.frontends.torch", "metadist.frontends.torch.repeat", "metadist.runtime.build",
                "metadist.runtime.step", "metadist.runtime.check", "metadist.solver", "metadist.ir.plan",
                "metadist.runtime.launch")
"""Modules a forked rank's recipe imports (and the launch module, which holds the rank's entry point), imported once
by the fork server (through :data:`FREEZE_MODULE`) before it forks."""

FREEZE_MODULE = "metadist.forked_heap"
"""The fork server's first import: it imports :data:`FORK_PRELOAD` with the garbage collector paused, then freezes
them out of its sight (:mod:`metadist.forked_heap`), so that a forked rank's full collections skip the server's
objects. The rank's entry point is imported after it."""


def fork_server_exists() -> bool:
    """Whether this platform has multiprocessing's fork server (POSIX does; Windows does not: ranks are spawned)."""
    import multiprocessing

    return "forkserver" in multiprocessing.get_all_start_methods()


def chosen_threads() -> str:
    """The ``OMP_NUM_THREADS`` the user chose, stripped: '' where it is unset, empty or blank (none chosen)."""
    return os.environ.get("OMP_NUM_THREADS", "").strip()


def rank_environment(nproc: int) -> dict[str, str]:
    """The variables a launch of ``nproc`` ranks sets for them (an empty value leaves a variable as it is): as
    torchrun does, one OpenMP thread per rank unless the user chose a number. ``OMP_NUM_THREADS`` set to an empty or
    blank string chooses none: torchrun leaves it as it is, and torch then runs as many threads as the host has cores
    in every rank (the issue's 12-layer GPT on 2 processes of a 2-core machine: each step 4.5-6.3 s against 2.3-2.9)."""
    return {"OMP_NUM_THREADS": "1" if nproc > 1 and not chosen_threads() else ""}


def launch_environment(nproc: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment by default) with the variables :func:`rank_environment` sets for a launch
    of ``nproc`` ranks: the environment to hand a subprocess that launches them (torchrun) itself."""
    env = dict(os.environ if base is None else base)
    env.update({key: value for key, value in rank_environment(nproc).items() if value})
    return env


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables the ranks inherit (an empty value leaves a variable as it is)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_fork_server(module: str, nproc: int) -> None:
    """Start the fork server for ranks of ``module`` (launched ``nproc`` at a time), unless this process started it.

    The server is a new interpreter with this process's environment (with :func:`rank_environment`) and
    ``sys.path`` of now: a rank forked from it sees that environment, plus torchelastic's variables of its rank,
    however this process's environment changes later. So a process forks its ranks from one environment; a launch
    from another raises instead of starting ranks with a stale one. Where no fork server exists, nothing is started
    (the ranks are spawned, :func:`metadist.runtime.launch.fork_is_safe`).
    """
    import multiprocessing

    if not fork_server_exists():
        return
    from multiprocessing import forkserver

    modules = (FREEZE_MODULE, module)
    with environment(**rank_environment(nproc)):
        started = (dict(os.environ), modules)
        if _SERVER and _SERVER[0] != started:
            changed = sorted(name for name in {*started[0], *_SERVER[0][0]}
                             if started[0].get(name) != _SERVER[0][0].get(name))
            raise RuntimeError(
                "this process already forks its ranks from a server started with another environment or entry "
                f"point (changed: {', '.join(changed) or 'the modules, now ' + ', '.join(modules)}); launch with "
                "fork=False, or from a new process")
        multiprocessing.set_forkserver_preload(list(modules))
        forkserver.ensure_running()
        _SERVER[:] = [started]


_SERVER: list[tuple[dict[str, str], tuple[str, ...]]] = []
"""The environment and modules of the fork server this process started (:func:`start_fork_server`), if any."""
