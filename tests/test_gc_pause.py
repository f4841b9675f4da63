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


_FREEZE_PROBE = """
import gc, weakref
from metadist.gc_pause import freeze_survivors

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

gc.disable()  # the garbage cycle below survives until freeze_survivors runs
dead = weakref.ref(cycle())
assert freeze_survivors() == 0 and gc.get_freeze_count() == 0, "a collector turned off: nothing frozen"
gc.enable()
alive = cycle()
frozen = freeze_survivors()
assert dead() is None, "the cycle that was garbage was collected, not frozen"
assert frozen == gc.get_freeze_count() > 0
tracked = {id(o) for o in gc.get_objects()}
assert id(alive) not in tracked and id(alive.other) not in tracked, "what lives is out of the collector's sight"
print("ok")
"""


def test_freeze_survivors_collects_first_then_freezes_what_lives():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr



def test_a_rank_forked_from_the_fork_server_starts_with_its_imports_frozen():
    """The fork server imports torch and MetaDist, then metadist.forked_heap freezes them: a forked process's full
    collections skip those objects (hundreds of thousands)."""
    import subprocess
    import sys

    code = ("import gc, multiprocessing\n"
            "from metadist.forking import start_fork_server\n"
            "start_fork_server('metadist.runtime.worker', 1)\n"
            "with multiprocessing.get_context('forkserver').Pool(1) as pool:\n"
            "    print(pool.apply(gc.get_freeze_count))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(result.stdout.split()[-1]) > 100_000, result.stdout
