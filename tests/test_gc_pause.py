"""The collector pause around capture and planning (issue #16, search scale): off inside, as it was after."""

from __future__ import annotations

import gc

import pytest

from metadist.gc_pause import gc_paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_off_inside_and_back_on_after_even_on_an_error(collector_on):
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner pause leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("inside")
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collector_on):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


class _Seen(Exception):
    pass


def test_capture_and_planning_run_with_the_collector_paused(collector_on, monkeypatch):
    import sys

    import metadist.cli.plan as cli_plan
    from metadist.frontends.torch.capture import capture_step
    from metadist.frontends.torch.repeat import capture_repeated
    from metadist.solver import plan_graph

    seen = []

    def record(*args, **kwargs):
        seen.append(gc.isenabled())
        raise _Seen

    calls = (
        (sys.modules["metadist.solver.planner"], "check_device_dtypes", lambda: plan_graph(None, None, None)),
        (sys.modules["metadist.frontends.torch.capture"], "_capture", lambda: capture_step(None, None, None, None)),
        (sys.modules["metadist.frontends.torch.repeat"], "find_repeated_layers", lambda: capture_repeated(None, None, None, None)),
    )
    for module, name, call in calls:
        monkeypatch.setattr(module, name, record)
        with pytest.raises(_Seen):
            call()
        assert gc.isenabled()
    assert seen == [False, False, False]
    assert cli_plan.run.__wrapped__.__name__ == "run"  # the plan command: wrapped by the pause
