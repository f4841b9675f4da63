"""JAX frontend: plans executed through XLA shardings on 8 CPU devices, checked against one device.

The multi-device runs happen in a subprocess: ``XLA_FLAGS`` must be set before jax
is imported, and other test modules may have imported it already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

jax = pytest.importorskip("jax")

from metadist.frontends.jax.sharded import count_collectives, partition_spec  # noqa: E402
from metadist.ir import Partial, Replicate, Shard  # noqa: E402

pytestmark = pytest.mark.jax

PS = jax.sharding.PartitionSpec


def run_in_subprocess(script: str, timeout: int = 600) -> dict:
    """Run ``script`` with 8 host devices; it prints one JSON line last."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the plan as XLA shardings (no devices needed) -------------------------------


def test_partition_spec_names_the_axes_that_shard_each_dim():
    axes = ("dp", "tp")
    assert partition_spec((Shard(0), Replicate()), 2, axes) == PS("dp", None)
    assert partition_spec((Shard(1), Shard(0)), 2, axes) == PS("tp", "dp")
    assert partition_spec((Shard(0), Shard(0)), 3, axes) == PS(("dp", "tp"), None, None)
    assert partition_spec((Replicate(), Replicate()), 0, axes) == PS()
    assert partition_spec((Partial("sum"), Shard(0)), 2, axes) is None, "Partial cannot be said to XLA"
    assert partition_spec((Partial("sum"), Shard(0)), 2, axes, partial_as_replicate=True) == PS("tp", None)


def test_count_collectives_reads_hlo_text():
    hlo = """
      %all-reduce.1 = f32[4]{0} all-reduce(f32[4]{0} %p), replica_groups={{0,1}}, to_apply=%add
      %ag = f32[8]{0} all-gather-start(f32[4]{0} %q), dimensions={0}
      %agd = f32[8]{0} all-gather-done(%ag)
      %cp = f32[4]{0} collective-permute(f32[4]{0} %r), source_target_pairs={{0,1}}
    """
    assert count_collectives(hlo) == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0,
                                      "collective-permute": 1}


# -- sharded runs on 8 CPU devices -------------------------------------------------

HAND_MADE_PLANS = """
    import dataclasses, json
    from metadist.frontends.jax import capture_jax, run_graph
    from metadist.frontends.jax.cli_support import CheckTolerance, compare_outputs
    from metadist.frontends.jax.sharded import predicted_collectives, run_sharded
    from metadist.ir import Mesh, Partial, Replicate, Role, Shard
    from metadist.ir.plan import NodeStrategy
    from metadist.lowering import replicate_plan
    from metadist.workloads.jax_builtin import jax_builtin_workload

    workload = jax_builtin_workload("jax-mlp")
    step = capture_jax(workload)
    graph = step.graph
    inputs = step.graph_inputs(workload.params, workload.opt_state, workload.batch)
    single = run_graph(graph, inputs)
    base = replicate_plan(graph, Mesh((2, 4), ("dp", "tp")), "test")
    batch = {i.value.name: (Shard(0), Replicate()) for i in graph.inputs_by_role(Role.BATCH)}
    # Data parallel: the batch split over dp; every value left to XLA's propagation.
    dp = dataclasses.replace(base, node_strategies={}, input_shardings={**base.input_shardings, **batch})
    # Explicit constraints: the first matmul's output rows over dp and columns over tp; one value Partial.
    first = graph.nodes[0]
    second = next(node for node in graph.nodes if node.op.target == "jax.lax.dot_general" and node is not first)
    strategies = dict(base.node_strategies)
    strategies[first.name] = dataclasses.replace(strategies[first.name], outputs=((Shard(0), Shard(1)),))
    strategies[second.name] = dataclasses.replace(strategies[second.name], outputs=((Shard(0), Partial("sum")),))
    pinned = dataclasses.replace(base, node_strategies=strategies, input_shardings={**base.input_shardings, **batch})
    report = {}
    for name, plan in (("replicate", base), ("dp", dp), ("pinned", pinned)):
        run = run_sharded(graph, plan, inputs)
        check = compare_outputs(step, run.outputs, single, CheckTolerance())
        report[name] = {"passed": check.passed, "worst": check.worst_output, "xla": run.xla_collectives,
                        "constrained": run.constrained_values, "partial": run.unconstrained_partial,
                        "loss": [check.loss_sharded, check.loss_single],
                        "sharding": str(run.outputs[0].sharding)}
    print(json.dumps(report))
"""


def test_hand_made_plans_run_sharded_and_match_one_device():
    report = run_in_subprocess(HAND_MADE_PLANS)
    for name, result in report.items():
        assert result["passed"], (name, result)
    assert sum(report["replicate"]["xla"].values()) == 0, "a replicated plan needs no communication"
    assert report["dp"]["xla"]["all-reduce"] >= 1, "data parallelism all-reduces the gradients"
    assert report["pinned"]["partial"] == 1 and report["pinned"]["constrained"] > 0
    assert sum(report["pinned"]["xla"].values()) > 0


PIPELINE = """
    import json, sys
    from metadist.frontends.jax.cli_support import run_jax
    summary = run_jax(sys.argv[1], devices=8, check=True, mesh=sys.argv[2], db=sys.argv[3], baseline=sys.argv[4] or None)
    print(summary.to_text(), file=sys.stderr)
    print(json.dumps({"passed": summary.check.passed, "xla": summary.xla_collectives,
                      "planned": summary.planned_collectives, "text": summary.to_text()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh, baseline", [("jax-mlp", "8", "zero3"), ("jax-gpt2-tiny", "2x4", "")])
def test_pipeline_discovers_plans_runs_and_checks(jax_rules_db, name, mesh, baseline):
    # the rule database is shared (conftest): the rules test_jax_discovery discovered for GPT-2 are read back here
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    command = [sys.executable, "-c", textwrap.dedent(PIPELINE), name, mesh, jax_rules_db, baseline]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["passed"], report["text"]
    assert "check PASSED" in report["text"]


CONTROL_FLOW_AND_DROPOUT = """
    import dataclasses, json
    from metadist.frontends.jax import capture_jax, run_graph
    from metadist.frontends.jax.cli_support import CheckTolerance, compare_outputs
    from metadist.frontends.jax.sharded import run_sharded
    from metadist.ir import Mesh, Replicate, Role, Shard
    from metadist.lowering import replicate_plan
    from metadist.workloads.jax_builtin import jax_builtin_workload

    report = {}
    for name in ("jax-mlp-scan", "jax-mlp-dropout"):
        workload = jax_builtin_workload(name)
        step = capture_jax(workload)
        graph = step.graph
        inputs = step.graph_inputs(workload.params, workload.opt_state, workload.batch)
        single = run_graph(graph, inputs)
        base = replicate_plan(graph, Mesh((2, 4), ("dp", "tp")), "test")
        batch = {i.value.name: (Shard(0), Replicate()) for i in graph.inputs_by_role(Role.BATCH)
                 if i.value.spec.rank == 2}
        strategies = dict(base.node_strategies)
        # Pin every node whose first output is (B, H): rows over dp, columns over tp (the unrolled layers,
        # and for dropout the threefry counters and the random bits themselves).
        pinned = 0
        for node in graph.nodes:
            value = node.outputs[0]
            if value is not None and value.spec.shape in ((32, 128), (32, 256)):  # (B, H)
                outputs = ((Shard(0), Shard(1)),) + tuple(strategies[node.name].outputs[1:])
                strategies[node.name] = dataclasses.replace(strategies[node.name], outputs=outputs)
                pinned += 1
        plan = dataclasses.replace(base, node_strategies=strategies, input_shardings={**base.input_shardings, **batch})
        run = run_sharded(graph, plan, inputs)
        check = compare_outputs(step, run.outputs, single, CheckTolerance())
        report[name] = {"passed": check.passed, "worst": check.worst_output, "pinned": pinned,
                        "pinned_threefry": sum(1 for n in graph.nodes if n.op.target == "jax.lax.threefry2x32"
                                               and strategies[n.name].outputs[0] == (Shard(0), Shard(1))),
                        "xla": run.xla_collectives, "loss": [check.loss_sharded, check.loss_single]}
    print(json.dumps(report))
"""


def test_scanned_and_dropout_steps_run_sharded_and_match_one_device():
    """Unrolled scan layers and dropout bits computed in pieces on a 2x4 mesh give the one-device step."""
    report = run_in_subprocess(CONTROL_FLOW_AND_DROPOUT)
    for name, result in report.items():
        assert result["passed"], (name, result)
        assert result["pinned"] > 4 and sum(result["xla"].values()) > 0, (name, result)
    assert report["jax-mlp-dropout"]["pinned_threefry"] >= 2, "the dropout bits themselves are drawn sharded"


JAX_CLI = [sys.executable, "-m", "metadist.cli.main", "run"]


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh", [("jax-mlp-scan", "2x4"), ("jax-mlp-dropout", "8")])
def test_cli_plans_runs_and_checks_scan_and_dropout(name, mesh):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([*JAX_CLI, name, "--devices", "8", "--mesh", mesh, "--check"], capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "check PASSED" in result.stdout
