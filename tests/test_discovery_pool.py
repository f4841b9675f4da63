"""Discovery in worker processes (metadist.shardcombine.pool): the same rules as in one process, a worker that
dies costs one signature (with a reason), a bug in discovery stops the call with the worker's traceback.

The executor here runs numpy ops named by module-level functions, so that it pickles: the workers import this
module by name (pytest puts the tests folder on ``sys.path``, which the pool passes on).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from metadist.ir import Graph, GraphInput, GraphOutput, MetaOp, Node, Role, TensorSpec, Value, ValueRef
from metadist.shardcombine import graph_rules
from metadist.shardcombine.api import _discover_pending, signature_groups
from metadist.shardcombine.discover import DiscoveryConfig
from metadist.shardcombine.pool import MAX_WORKERS, SIGNATURES_PER_WORKER, DiscoveryWorkerError, worker_count
from numpy_executor import NumpyExecutor


def _matmul(a, b):
    return [a @ b]


def _sum0(a):
    return [a.sum(axis=0)]


def _max1(a):
    return [a.max(axis=1)]


def _exp(a):
    return [np.exp(a)]


def _cumsum1(a):
    return [np.cumsum(a, axis=1)]


def _add(a, b):
    return [a + b]


def _die(a):
    os._exit(3)  # a kernel that kills its process


OPS = {"np.matmul": _matmul, "np.sum0": _sum0, "np.max1": _max1, "np.exp": _exp, "np.cumsum1": _cumsum1,
       "np.add": _add, "np.die": _die}


class PoolExecutor(NumpyExecutor):
    """The numpy executor, sent to worker processes."""

    def __init__(self) -> None:
        super().__init__(OPS)

    def worker_env(self) -> dict[str, str]:
        return {"METADIST_TEST_POOL_WORKER": "1"}


class BuggyExecutor(PoolExecutor):
    """An executor whose discovery session fails: a bug, not a refused execution (discovery refuses those)."""

    def session(self):
        raise RuntimeError("a bug in the executor, not a refusal")


class InProcessExecutor(NumpyExecutor):
    """An executor without ``worker_env``: never sent to workers."""

    def __init__(self) -> None:
        super().__init__(OPS)


def _graph(targets: list[str]) -> Graph:
    """One chain per target over a [6, 12] input (a [12, 12] second operand for binary ops)."""
    x = Value("x", TensorSpec((6, 12), "float64"))
    w = Value("w", TensorSpec((12, 12), "float64"))
    nodes, outputs = [], []
    for index, target in enumerate(targets):
        binary = target in ("np.matmul", "np.add")
        shape = {"np.sum0": (12,), "np.max1": (6,)}.get(target, (6, 12))
        if target == "np.add":
            args = (ValueRef("x"), ValueRef("x"))
        else:
            args = (ValueRef("x"), ValueRef("w")) if binary else (ValueRef("x"),)
        out = Value(f"y{index}", TensorSpec(shape, "float64"))
        nodes.append(Node(f"n{index}", MetaOp(target), args, (), (out,)))
        outputs.append(GraphOutput(out.name, Role.ACTIVATION))
    return Graph((GraphInput(x, Role.BATCH), GraphInput(w, Role.PARAM)), tuple(nodes), tuple(outputs))


GOOD = ["np.matmul", "np.sum0", "np.max1", "np.exp", "np.cumsum1", "np.add"]


def test_workers_find_the_rules_one_process_finds():
    graph = _graph(GOOD)
    alone = graph_rules(graph, PoolExecutor(), workers=0)
    pooled = graph_rules(graph, PoolExecutor(), workers=2)
    assert dict(pooled.rules) == dict(alone.rules) and dict(pooled.missing) == dict(alone.missing)
    assert len(pooled.rules) == len(GOOD) and pooled.stats.discovered == len(GOOD)
    assert len(pooled.stats.discovery_seconds) == len(GOOD) and all(s > 0 for s in pooled.stats.discovery_seconds)


def test_a_worker_that_dies_costs_its_signature_only(caplog):
    graph = _graph(["np.matmul", "np.die", "np.exp", "np.sum0"])
    with caplog.at_level(logging.WARNING, logger="metadist.shardcombine.pool"):
        rules = graph_rules(graph, PoolExecutor(), workers=2)
    assert set(rules.rules) == {"n0", "n2", "n3"}
    reason = rules.missing["n1"]
    assert "np.die killed its discovery worker process (exit code 3)" in reason
    assert any("killed its discovery worker" in record.getMessage() for record in caplog.records)


def test_a_bug_in_discovery_stops_the_call_with_the_workers_traceback():
    graph = _graph(["np.exp", "np.sum0", "np.cumsum1"])
    with pytest.raises(RuntimeError, match="a bug in the executor"):  # in one process: the error itself
        graph_rules(graph, BuggyExecutor(), workers=0)
    with pytest.raises(DiscoveryWorkerError, match=r"(?s)raised in a worker process.*RuntimeError: a bug in the executor"):
        graph_rules(graph, BuggyExecutor(), workers=2)


def test_the_number_of_workers():
    cpus = len(os.sched_getaffinity(0))
    assert worker_count(InProcessExecutor(), 1000) == 0  # no worker_env: never in workers
    assert worker_count(PoolExecutor(), SIGNATURES_PER_WORKER - 1) == 0
    assert worker_count(PoolExecutor(), 2 * SIGNATURES_PER_WORKER) == min(2, cpus)
    assert worker_count(PoolExecutor(), 1000) == min(cpus, MAX_WORKERS)


def test_an_executor_that_does_not_pickle_discovers_in_this_process_and_says_so(caplog):
    executor = PoolExecutor()
    executor.ops = {**OPS, "np.exp": lambda a: [np.exp(a)]}  # a lambda does not pickle
    graph = _graph(["np.exp", "np.sum0"])
    pending = [(signature, calls[0]) for signature, calls in signature_groups(graph).items()]
    with caplog.at_level(logging.INFO, logger="metadist.shardcombine.api"):
        found = list(_discover_pending(pending, executor, DiscoveryConfig(), workers=2))
    assert len(found) == 2 and all(not isinstance(outcome, str) for _, outcome, _ in found)
    assert any("cannot be sent to worker processes" in record.getMessage() for record in caplog.records)


def test_the_jax_executor_goes_to_workers_without_its_memo():
    pytest.importorskip("jax")
    import pickle

    import jax

    from metadist.frontends.jax.discovery import JaxOpExecutor

    executor = JaxOpExecutor()
    executor._adapted["anything"] = "cached"
    copy = pickle.loads(pickle.dumps(executor))
    assert copy == executor and copy._adapted == {} and copy.worker_env() == {"JAX_PLATFORMS": "cpu"}
    before = jax.config.jax_traceback_filtering
    with executor.session():
        assert jax.config.jax_traceback_filtering == "off"
    assert jax.config.jax_traceback_filtering == before
