"""JAX frontend: one plan run by 2 processes of 4 CPU devices each through jax.distributed (gloo collectives)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")

from metadist.frontends.jax import JaxCaptureError, capture_jax  # noqa: E402
from metadist.frontends.jax.multihost import run_jax_multihost  # noqa: E402
from metadist.ir import Mesh, Replicate, Role, Shard  # noqa: E402
from metadist.lowering import replicate_plan  # noqa: E402
from metadist.workloads.jax_builtin import jax_builtin_workload  # noqa: E402

pytestmark = [pytest.mark.jax, pytest.mark.distributed]


def data_and_tensor_parallel_plan(name: str, mesh: Mesh):
    """The batch split over the first axis; the first matmul's output columns over the second; the rest left to XLA."""
    graph = capture_jax(jax_builtin_workload(name)).graph
    base = replicate_plan(graph, mesh, "test")
    batch = {i.value.name: (Shard(0), Replicate()) for i in graph.inputs_by_role(Role.BATCH)}
    first = graph.nodes[0]
    strategies = {first.name: dataclasses.replace(base.node_strategies[first.name], outputs=((Shard(0), Shard(1)),))}
    return dataclasses.replace(base, node_strategies=strategies, input_shardings={**base.input_shardings, **batch})


@pytest.mark.slow  # two JAX processes compiling on this 2-core machine: 11 s idle, ~50 s when it is busy
def test_two_processes_run_the_plan_and_match_one_device():
    plan = data_and_tensor_parallel_plan("jax-mlp", Mesh((2, 4), ("dp", "tp")))
    summary = run_jax_multihost("jax-mlp", processes=2, local_devices=4, plan=plan, check=True, run_timeout_s=300)
    assert [report["process_id"] for report in summary.reports] == [0, 1]
    for report in summary.reports:
        assert report["process_count"] == 2 and report["global_devices"] == 8 and report["local_devices"] == 4
        assert report["check"]["passed"], report
        # The batch is split across the processes: the gradients cross them in XLA's all-reduces.
        assert report["xla_collectives"]["all-reduce"] >= 1
    assert summary.passed is True
    assert summary.reports[0]["loss"] == summary.reports[1]["loss"]
    assert "2 processes x 4 CPU devices" in summary.to_text()


def test_a_plan_for_another_device_count_is_refused():
    plan = data_and_tensor_parallel_plan("jax-mlp", Mesh((2, 2), ("dp", "tp")))
    with pytest.raises(JaxCaptureError, match="has 4 devices, but 2 processes x 4 devices make 8"):
        run_jax_multihost("jax-mlp", processes=2, local_devices=4, plan=plan)


@pytest.mark.slow
def test_cli_runs_a_jax_workload_on_two_processes():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "metadist.cli.main", "run", "jax-mlp-scan", "--nproc", "2", "--devices", "4",
               "--mesh", "2x4", "--check"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("check PASSED") == 2, result.stdout
