"""Compile phases as they happen: which one runs, how far it is, how long each took.

Code that does a long piece of work marks it; whoever runs the program decides who
listens. Nobody listening (the default): marking costs a context-variable read.

- ``with phase("discovery", total=n) as advance:`` marks a block (``advance(label)``
  once per item moves a progress bar); blocks nest.
- ``enter("capture")`` marks from here on, until the next phase of any kind starts:
  a driver that reads like a recipe marks its steps with one line each.
- ``with listening(ConsoleListener(console), PhaseFile(path)):`` installs listeners
  for the code inside it; leaving it ends the phases still open.

A phase's seconds are its own time: a phase nested in it is not counted twice.
:class:`ConsoleListener` draws a live table on a terminal and prints one plain
line per finished phase otherwise (CI logs, pipes). :class:`PhaseFile` keeps the
name of the phase in progress in a small file, so that a launcher can say what a
rank was doing when a signal killed it. This module imports no framework.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from .files import write_atomically

__all__ = ["ConsoleListener", "PhaseFile", "PhaseListener", "PhaseState", "PhaseTimes", "enter", "listening", "phase"]


@dataclass(frozen=True)
class PhaseState:
    """One phase as listeners see it."""

    name: str
    """What runs: ``capture``, ``discovery``, ``solve``, ``lowering``, ``step 3``..."""
    total: int | None = None
    """Items the phase works through (a progress bar), or None."""
    quiet: bool = False
    """Recorded (the phase file) but not displayed (e.g. each training step, which the run reports itself)."""


class PhaseListener(Protocol):
    """What :func:`listening` installs."""

    def started(self, state: PhaseState, depth: int) -> None:
        """``state`` began, ``depth`` phases deep (0: outermost)."""

    def advanced(self, state: PhaseState, done: int, label: str) -> None:
        """``done`` of ``state.total`` items are finished; ``label`` names the last one."""

    def ended(self, state: PhaseState, seconds: float, ok: bool) -> None:
        """``state`` finished after ``seconds`` of its own time (``ok`` False: by an exception)."""


@dataclass
class _Open:
    state: PhaseState
    marker: bool
    """Begun by :func:`enter`: ends when the next phase starts."""
    own_s: float = 0.0
    resumed_at: float = 0.0
    done: int = 0


class _Session:
    """The listeners of one :func:`listening` block and the stack of open phases."""

    def __init__(self, listeners: tuple[PhaseListener, ...]) -> None:
        self.listeners = listeners
        self.stack: list[_Open] = []

    def start(self, state: PhaseState, *, marker: bool) -> _Open:
        if self.stack and self.stack[-1].marker:
            self.end(ok=True)
        now = time.perf_counter()
        if self.stack:
            parent = self.stack[-1]
            parent.own_s += now - parent.resumed_at
        item = _Open(state, marker, resumed_at=now)
        self.stack.append(item)
        for listener in self.listeners:
            listener.started(state, len(self.stack) - 1)
        return item

    def advance(self, item: _Open, label: str) -> None:
        item.done += 1
        for listener in self.listeners:
            listener.advanced(item.state, item.done, label)

    def end(self, *, ok: bool) -> None:
        item = self.stack.pop()
        now = time.perf_counter()
        item.own_s += now - item.resumed_at
        if self.stack:
            self.stack[-1].resumed_at = now
        for listener in self.listeners:
            listener.ended(item.state, item.own_s, ok)

    def close(self, *, ok: bool) -> None:
        while self.stack:
            self.end(ok=ok)


_SESSION: ContextVar[_Session | None] = ContextVar("metadist_progress_session", default=None)


def _ignore(label: str = "") -> None:
    """``advance`` when nobody listens."""


@contextlib.contextmanager
def listening(*listeners: PhaseListener) -> Iterator[None]:
    """Send the phases marked inside this block to ``listeners``; open phases end when it ends."""
    session = _Session(tuple(listeners))
    token = _SESSION.set(session)
    ok = False
    try:
        yield
        ok = True
    finally:
        session.close(ok=ok)
        _SESSION.reset(token)


@contextlib.contextmanager
def phase(name: str, *, total: int | None = None, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """Mark the block as phase ``name``; yields ``advance(label)`` to call once per item of ``total``."""
    session = _SESSION.get()
    if session is None:
        yield _ignore
        return
    item = session.start(PhaseState(name, total, quiet), marker=False)
    ok = False
    try:
        yield lambda label="": session.advance(item, label)
        ok = True
    finally:
        if item in session.stack:  # a listening block that ended inside this one closed it already
            while session.stack[-1] is not item:
                session.end(ok=ok)
            session.end(ok=ok)


def enter(name: str, *, quiet: bool = False) -> None:
    """Phase ``name`` runs from here until the next phase starts (or the listening block ends)."""
    session = _SESSION.get()
    if session is not None:
        session.start(PhaseState(name, None, quiet), marker=True)


# ---------------------------------------------------------------------------- listeners


class PhaseFile:
    """Keeps the name of the phase in progress in one small file (rewritten atomically).

    When a phase ends well, the file names the phase around it, or says ``after NAME``;
    when it ends by an exception the name stays, so the file tells where a rank stopped.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.names: list[str] = []

    def started(self, state: PhaseState, depth: int) -> None:
        del self.names[depth:]
        self.names.append(state.name)
        self._write(state.name)

    def advanced(self, state: PhaseState, done: int, label: str) -> None:
        pass

    def ended(self, state: PhaseState, seconds: float, ok: bool) -> None:
        if not ok:
            return
        if self.names and self.names[-1] == state.name:
            self.names.pop()
        self._write(self.names[-1] if self.names else f"after {state.name}")

    def _write(self, text: str) -> None:
        write_atomically(self.path, text + "\n", sync=False)  # rewritten at every phase; a lost name costs nothing


class PhaseTimes:
    """Keeps each finished phase's own seconds by name (a name that recurs adds up), for run summaries."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def started(self, state: PhaseState, depth: int) -> None:
        pass

    def advanced(self, state: PhaseState, done: int, label: str) -> None:
        pass

    def ended(self, state: PhaseState, seconds: float, ok: bool) -> None:
        self.seconds[state.name] = self.seconds.get(state.name, 0.0) + seconds


def read_phase_file(path: str | os.PathLike) -> str | None:
    """The phase a :class:`PhaseFile` last recorded, or None if there is no such file."""
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None


@dataclass
class _Row:
    state: PhaseState
    started_at: float
    seconds: float | None = None
    ok: bool = True
    done: int = 0
    label: str = ""
    paused_s: float = 0.0
    paused_since: float | None = None
    """Set while a phase nested in this one runs: its time is not this phase's."""

    def own_seconds(self, now: float) -> float:
        pausing = 0.0 if self.paused_since is None else now - self.paused_since
        return now - self.started_at - self.paused_s - pausing


class ConsoleListener:
    """The phases on a ``rich`` console: a live table on a terminal, one plain line per phase otherwise."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.live_display = bool(console.is_terminal) and not console.is_dumb_terminal
        self.rows: list[_Row] = []
        self.open: list[_Row] = []
        self.lock = threading.Lock()
        self.live: Any = None

    def started(self, state: PhaseState, depth: int) -> None:
        if state.quiet:
            return
        now = time.perf_counter()
        with self.lock:
            if self.open:
                self.open[-1].paused_since = now
            row = _Row(state, now)
            self.rows.append(row)
            self.open.append(row)
        if self.live_display and self.live is None:
            from rich.live import Live

            self.live = Live(self, console=self.console, refresh_per_second=8, transient=False)
            self.live.start()

    def advanced(self, state: PhaseState, done: int, label: str) -> None:
        row = self._open_row(state)
        if row is not None:
            row.done, row.label = done, label

    def ended(self, state: PhaseState, seconds: float, ok: bool) -> None:
        row = self._open_row(state)
        if row is None:
            return
        now = time.perf_counter()
        with self.lock:
            row.seconds, row.ok = seconds, ok
            self.open.remove(row)
            if self.open and self.open[-1].paused_since is not None:
                parent = self.open[-1]
                parent.paused_s += now - parent.paused_since
                parent.paused_since = None
        if self.live is not None and not self.open:
            self.live.stop()  # the last drawing stays on the screen
            self.live, self.rows = None, []
        elif not self.live_display:
            self.console.print(_plain_line(row), markup=False, highlight=False, soft_wrap=True)

    def _open_row(self, state: PhaseState) -> _Row | None:
        for row in reversed(self.open):
            if row.state is state:
                return row
        return None

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table.grid(padding=(0, 1))
        for width in (6, 18, 30, 9):  # status, name, bar, seconds: the same in every phase's drawing
            table.add_column(min_width=width, justify="right" if width == 9 else "left")
        table.add_column(overflow="ellipsis", no_wrap=True)  # the item in progress
        with self.lock:
            for row in self.rows:
                table.add_row(*_live_cells(row))
        return table


def _detail(row: _Row) -> str:
    if row.state.total is None:
        return ""
    return f"{row.done}/{row.state.total}"


def _plain_line(row: _Row) -> str:
    detail = f" ({_detail(row)})" if row.state.total is not None else ""
    verdict = "" if row.ok else " (failed)"
    return f"{row.state.name}: {row.seconds:.2f} s{detail}{verdict}"


def _live_cells(row: _Row) -> tuple:
    from rich.progress_bar import ProgressBar
    from rich.spinner import Spinner
    from rich.text import Text

    if row.seconds is None:
        status: Any = Spinner("dots", style="cyan")
        seconds = row.own_seconds(time.perf_counter())
    else:
        status = Text("done" if row.ok else "failed", style="green" if row.ok else "red")
        seconds = row.seconds
    bar: Any = ""
    if row.state.total is not None:
        bar = ProgressBar(total=max(row.state.total, 1), completed=row.done, width=30)
    label = Text(f"{_detail(row)} {row.label if row.seconds is None else ''}".strip(), style="dim", overflow="ellipsis",
                 no_wrap=True)
    return status, Text(row.state.name, style="bold"), bar, Text(f"{seconds:.2f} s"), label
