"""Discovery cannot take the process down: kernels that crash or hang on candidate pieces cost a candidate.

Custom ops (``torch.library``) play the kernels that trust their inputs: one aborts always, one
segfaults when its two inputs' shapes differ while its fake kernel accepts them (as the SDPA
backward's did), one never returns. Discovery runs such ops in a forked worker
(``metadist.shardcombine.isolation``); the tests show the caller survives, the rule of the
unchecked op is still found (and trains correctly under ``--check``), and the op that always
aborts is reported with the reason.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from metadist.ir import MetaOp, Node, TensorSpec, Value, ValueRef
from metadist.shardcombine.discover import NoRule, discover
from metadist.shardcombine.executor import OpCall
from metadist.shardcombine.isolation import ExecutionCrashed, KernelWorker

MODEL_FILE = '''
"""Custom ops whose kernels crash, and workloads that use them on the batch (no gradient needed)."""
import ctypes
import os

import torch
import metadist


def _define():
    if hasattr(torch.ops.metadist_test, "unchecked_mul"):
        return

    @torch.library.custom_op("metadist_test::unchecked_mul", mutates_args=())
    def unchecked_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.shape != b.shape:  # a kernel that trusts its inputs: memory it does not own
            ctypes.string_at(0)
        return a * b + 0.5

    @unchecked_mul.register_fake
    def _(a, b):
        return torch.empty_like(a)  # accepts any shapes, as the SDPA backward's meta kernel did

    @torch.library.custom_op("metadist_test::abort_always", mutates_args=())
    def abort_always(a: torch.Tensor) -> torch.Tensor:
        os.abort()

    @abort_always.register_fake
    def _(a):
        return torch.empty_like(a)

    @torch.library.custom_op("metadist_test::hang", mutates_args=())
    def hang(a: torch.Tensor) -> torch.Tensor:
        while True:
            pass

    @hang.register_fake
    def _(a):
        return torch.empty_like(a)


_define()


def _workload(op):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    batch = {"x": torch.randn(8, 6, 12), "scale": torch.rand(8, 6, 12) + 0.5, "y": torch.randint(0, 4, (8, 6))}

    def loss_fn(model, batch):
        x = op(batch["x"], batch["scale"])
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), batch["y"].flatten())

    return metadist.Workload(model=model, batch=batch, loss_fn=loss_fn,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))


def unchecked():
    return _workload(torch.ops.metadist_test.unchecked_mul)


def aborting():
    return _workload(lambda x, scale: x + torch.ops.metadist_test.abort_always(scale))
'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("isolation") / "crashing_ops.py"
    path.write_text(MODEL_FILE)
    return path


@pytest.fixture(scope="module")
def ops(model_file):
    """The custom ops, registered in this process by loading the model file once."""
    from metadist.workloads.loader import load_workload

    load_workload(f"{model_file}:unchecked")
    import torch

    return torch.ops.metadist_test


def _call(target: str, shapes) -> OpCall:
    specs = tuple(TensorSpec(shape, "float32") for shape in shapes)
    refs = tuple(ValueRef(f"x{index}") for index in range(len(shapes)))
    out = Value("out", TensorSpec(shapes[0], "float32"))
    return OpCall(Node("n", MetaOp(target), refs, (), (out,)), specs)


# ---------------------------------------------------------------- the worker alone


def _abort(call, inputs):
    os.abort()


def _segfault(call, inputs):
    ctypes.string_at(0)


def _spin(call, inputs):
    while True:
        pass


def _double(call, inputs):
    return [inputs[0] * 2]


def test_the_worker_survives_an_abort_a_segfault_and_a_hang_and_restarts():
    call = _call("test.op.default", [(2, 3)])
    x = np.ones((2, 3), dtype=np.float32)
    for function, words in ((_abort, "SIGABRT"), (_segfault, "SIGSEGV")):
        with KernelWorker(function) as worker:
            with pytest.raises(ExecutionCrashed, match=words):
                worker.run(call, [x])
            assert worker.crashes == {"test.op.default": 1}
    with KernelWorker(_spin, timeout_s=0.5) as worker:
        started = time.perf_counter()
        with pytest.raises(ExecutionCrashed, match="did not finish within 0.5 s"):
            worker.run(call, [x])
        with pytest.raises(ExecutionCrashed, match="refused without running"):  # a hang costs its timeout once
            worker.run(call, [x])
        assert time.perf_counter() - started < 5
    with KernelWorker(_double) as worker:
        assert np.array_equal(worker.run(call, [x])[0], 2 * x)
        worker.close()
        assert np.array_equal(worker.run(call, [x])[0], 2 * x)  # a fresh child after close
        assert worker.forks == 2


def test_an_op_that_keeps_crashing_is_refused_until_the_session_ends(monkeypatch):
    from metadist.shardcombine import isolation

    monkeypatch.setattr(isolation, "MAX_CRASHES_PER_OP", 2)
    call = _call("test.op.default", [(2, 3)])
    x = np.ones((2, 3), dtype=np.float32)
    with KernelWorker(_abort) as worker:
        for _ in range(2):
            with pytest.raises(ExecutionCrashed, match="SIGABRT"):
                worker.run(call, [x])
        with pytest.raises(ExecutionCrashed, match="refused without running: test.op.default crashed 2 times"):
            worker.run(call, [x])
        assert worker.forks == 2  # the refusal forked nothing
        worker.close()
        with pytest.raises(ExecutionCrashed, match="SIGABRT"):  # a new session runs it again
            worker.run(call, [x])
        assert worker.crashes == {"test.op.default": 3}


# ---------------------------------------------------------------- discovery


def test_discovery_refuses_the_candidates_that_crash_and_finds_the_rule(ops):
    from metadist.frontends.torch.discovery import TorchExecutor

    executor = TorchExecutor()
    call = _call("metadist_test.unchecked_mul.default", [(8, 6, 12), (8, 6, 12)])
    rule = discover(call, executor)
    assert rule.to_text() == "abc,abc->abc"  # elementwise: every dim, both inputs split alike
    assert executor.worker.crashes.get("metadist_test.unchecked_mul.default", 0) > 0  # one-sided splits crashed


def test_the_plan_splits_the_unchecked_op(model_file, ops):
    from metadist.api import capture_and_discover
    from metadist.cost.cluster import resolve_cluster
    from metadist.ir import Mesh, Shard
    from metadist.solver import baseline_plan

    graph, rules = capture_and_discover(f"{model_file}:unchecked")
    (node,) = [node for node in graph.nodes if node.op.target == "metadist_test.unchecked_mul.default"]
    assert rules.rules[node.name].to_text() == "abc,abc->abc"
    # data parallel splits the batch; with its discovered rule the op runs on the pieces (the free search finds this
    # tiny step cheapest with the op replicated, which says nothing about the rule)
    plan = baseline_plan(graph, rules, resolve_cluster("cpu-gloo", Mesh((2,))), "dp")
    assert isinstance(plan.node_strategies[node.name].inputs[0][0], Shard)


def test_an_op_that_always_aborts_gets_no_rule_and_the_reason_names_the_signal(ops):
    from metadist.frontends.torch.discovery import TorchExecutor

    with pytest.raises(NoRule, match=r"metadist_test.abort_always.default crashed its discovery worker \(signal SIGABRT\)"):
        discover(_call("metadist_test.abort_always.default", [(8, 6, 12)]), TorchExecutor())


def test_a_hanging_op_costs_its_timeout_once_and_gets_a_reason(ops):
    from metadist.frontends.torch.discovery import TorchExecutor

    started = time.perf_counter()
    with pytest.raises(NoRule, match="did not finish within 1 s"):
        discover(_call("metadist_test.hang.default", [(8, 6, 12)]), TorchExecutor(timeout_s=1.0))
    assert time.perf_counter() - started < 15


def test_ops_known_to_check_their_inputs_run_in_process():
    from metadist.api import capture_and_discover
    from metadist.frontends.torch.discovery import TorchExecutor
    from metadist.frontends.torch.safe_ops import runs_in_process
    import metadist

    graph, rules = capture_and_discover(metadist.builtin_workload("mlp"))
    assert all(runs_in_process(node.op.target) for node in graph.nodes if node.input_names and not node.op.is_random)
    assert not runs_in_process("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
    assert not runs_in_process("metadist_test.unchecked_mul.default")
    executor = TorchExecutor()
    from metadist.shardcombine.api import graph_rules

    graph_rules(graph, executor)
    assert executor.worker.forks == 0


# ---------------------------------------------------------------- the command line


def _cli(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "metadist.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_rules_discover_and_plan_finish_and_report_the_aborting_op(model_file, tmp_path):
    result = _cli("rules", "discover", f"{model_file}:aborting", "--db", str(tmp_path / "rules.db"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = " ".join(result.stdout.split())
    assert "metadist_test.abort_always.default" in report and "crashed its discovery worker (signal SIGABRT)" in report
    result = _cli("plan", f"{model_file}:aborting", "--mesh", "2", "--rules-db", str(tmp_path / "rules.db"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_unchecked_op_is_split_and_trains_like_one_device(model_file, tmp_path):
    result = _cli("run", f"{model_file}:unchecked", "--nproc", "2", "--steps", "3", "--check", "--timeout-s", "120",
                  "--log-dir", str(tmp_path))
    assert result.returncode == 0 and "check: PASS" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
