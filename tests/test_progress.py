"""Progress you can see: compile phases marked where they run, shown by listeners (metadist.progress)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from metadist import progress
from metadist.progress import ConsoleListener, PhaseFile, enter, listening, phase, read_phase_file


class Recorder:
    """Every event a listener receives, with the seconds a clock says."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def started(self, state, depth):
        self.events.append(("start", state.name, depth))

    def advanced(self, state, done, label):
        self.events.append(("advance", state.name, done, label))

    def ended(self, state, seconds, ok):
        self.events.append(("end", state.name, round(seconds, 6), ok))


@pytest.fixture
def clock(monkeypatch):
    """A clock that moves only when told to."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    return now


def test_nobody_listening_costs_nothing_and_changes_nothing():
    with phase("discovery", total=2) as advance:
        advance("aten.mm.default")
    enter("capture")  # no error, no output


def test_markers_end_where_the_next_phase_starts_and_nested_time_is_not_counted_twice(clock):
    recorder = Recorder()
    with listening(recorder):
        enter("capture")
        clock[0] += 2.0
        with phase("discovery", total=2) as advance:
            clock[0] += 1.0
            advance("aten.mm.default")
            with phase("probe"):  # nested: 0.5 s of discovery's 3 s belong to it
                clock[0] += 0.5
            clock[0] += 1.5
            advance("aten.add.Tensor")
        enter("solve")
        clock[0] += 0.25
    assert recorder.events == [
        ("start", "capture", 0), ("end", "capture", 2.0, True),
        ("start", "discovery", 0), ("advance", "discovery", 1, "aten.mm.default"),
        ("start", "probe", 1), ("end", "probe", 0.5, True),
        ("advance", "discovery", 2, "aten.add.Tensor"), ("end", "discovery", 2.5, True),
        ("start", "solve", 0), ("end", "solve", 0.25, True),
    ]


def test_an_exception_ends_the_open_phases_as_failed(clock):
    recorder = Recorder()
    with pytest.raises(ValueError), listening(recorder):
        enter("capture")
        with phase("discovery"):
            raise ValueError("boom")
    assert recorder.events == [("start", "capture", 0), ("end", "capture", 0.0, True),  # ended by discovery's start
                               ("start", "discovery", 0), ("end", "discovery", 0.0, False)]
    recorder.events.clear()
    with pytest.raises(ValueError), listening(recorder):
        enter("step 3")
        raise ValueError("boom")
    assert recorder.events == [("start", "step 3", 0), ("end", "step 3", 0.0, False)]  # closed by the listening block


def test_the_phase_file_names_the_phase_in_progress_and_keeps_a_failed_one(tmp_path):
    path = tmp_path / "phase"
    with listening(PhaseFile(path)):
        enter("capture")
        assert read_phase_file(path) == "capture"
        with phase("lowering"):
            with phase("materialise"):
                assert read_phase_file(path) == "materialise"
            assert read_phase_file(path) == "lowering"
        assert read_phase_file(path) == "after lowering"
        enter("step 3", quiet=True)
        assert read_phase_file(path) == "step 3"
    with pytest.raises(RuntimeError), listening(PhaseFile(path)):
        with phase("discovery"):
            raise RuntimeError("a kernel failed")
    assert read_phase_file(path) == "discovery"
    assert read_phase_file(tmp_path / "missing") is None


def test_plain_lines_when_the_console_is_not_a_terminal():
    out = io.StringIO()
    with listening(ConsoleListener(Console(file=out, force_terminal=False))):
        enter("capture")
        with phase("discovery", total=3) as advance:
            for name in ("a", "b", "c"):
                advance(name)
        enter("step 0", quiet=True)  # not shown: the run reports its steps itself
    lines = out.getvalue().splitlines()
    assert [re.sub(r"[0-9.]+ s", "S", line) for line in lines] == ["capture: S", "discovery: S (3/3)"]


def test_a_live_table_on_a_terminal_shows_each_phase_with_its_bar_and_seconds():
    out = io.StringIO()
    with listening(ConsoleListener(Console(file=out, force_terminal=True, width=100, color_system=None))):
        enter("capture")
        with phase("discovery", total=2) as advance:
            advance("aten.mm.default")
            advance("aten.add.Tensor")
        enter("solve")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    final = text.split("\r")[-1]
    assert "done" in text and "capture" in text and "discovery" in text and "solve" in final
    assert "2/2" in text and "━" in text


def test_metadist_plan_shows_its_phases_on_stderr_and_the_plan_on_stdout(capsys):
    from metadist.cli.main import main

    assert main(["plan", "mlp", "--mesh", "2", "--cluster", "a100x8"]) == 0
    captured = capsys.readouterr()
    phases = [line.split(":")[0] for line in captured.err.splitlines()]
    assert phases == ["capture", "discovery", "solve"], captured.err
    assert re.search(r"^discovery: [0-9.]+ s \((\d+)/\1\)$", captured.err, re.MULTILINE)
    assert "parameters of mlp" in captured.out and "capture:" not in captured.out
