"""Overlapped collectives on gloo processes: the same results as waiting at once, and as one device.

One spawned session per mesh runs the MLP for two SGD steps under each plan twice, with overlap
on (issue early, wait late) and off, from the same weights: both must pass the check against
one device, give bitwise-equal losses, gradients and state, and count exactly the collectives
the lowering predicts. The 2x2 plan also shares a collective between two reshards of one value.
"""

from __future__ import annotations

import copy

import pytest

from test_coalesce import DP, MLP_PLANS, ZERO3, zero3_plan
from test_runtime_support import run_distributed

pytestmark = [pytest.mark.distributed]


def _session(mesh_shape: tuple[int, ...], plans: dict) -> dict:
    import torch

    from metadist.frontends.torch import capture_step
    from metadist.ir import Mesh
    from metadist.lowering import Wait
    from metadist.runtime.check import compare_runs, reference_run
    from metadist.runtime.env import read_torchrun_env
    from metadist.runtime.setup import setup_device_mesh
    from metadist.runtime.step import CompiledStep
    from metadist.workloads import builtin_workload

    torch.set_num_threads(1)
    device_mesh = setup_device_mesh(Mesh(mesh_shape), read_torchrun_env(), timeout_s=60)
    workload = builtin_workload("mlp", optimizer="sgd")
    train_step = workload.train_step()
    reference = reference_run(train_step, workload.model, workload.optimizer, workload.batch, steps=2, seed=0)
    results = {}
    for name, inputs in plans.items():
        runs = {}
        for overlap in (True, False):
            model = copy.deepcopy(workload.model)
            optimizer = workload.optimizer(model.parameters())
            torch_step = capture_step(train_step, model, optimizer, workload.batch, keep_grads=True)
            plan = zero3_plan(torch_step.graph, Mesh(mesh_shape), inputs)
            compiled = CompiledStep(torch_step, plan, device_mesh, metadist_version="test", overlap=overlap)
            losses = [compiled(model, optimizer, workload.batch) for _ in range(2)]
            records = {(kind, axis): r for (phase, kind, axis), r in compiled.comm_records().items() if phase == "step"}
            nodes = list(compiled.module.graph.nodes)
            issues = [index for index, node in enumerate(nodes) if node.op == "call_method" and str(node.target).startswith("issue_")]
            waits = [index for index, node in enumerate(nodes) if node.op == "call_method" and node.target == "wait_tensor"]
            runs[overlap] = {
                "losses": losses, "state": compiled.state_dict(), "grads": compiled.grads(),
                "measured": {f"{kind}@{axis}": (r.count, r.bytes) for (kind, axis), r in records.items()},
                "predicted": {f"{kind}@{axis}": (2 * count, 2 * nbytes)
                              for (kind, axis), (count, nbytes) in compiled.program.predicted_comm().items()},
                "waits": sum(isinstance(item, Wait) for item in compiled.program.instructions),
                "fx_issues": len(issues), "fx_waits": len(waits),
                "ops_in_flight": sum(any("metadist_node" in nodes[i].meta for i in range(nodes.index(nodes[wait].args[1]), wait))
                                     for wait in waits),  # waits whose collective overlaps a local op
            }
        on, off = runs[True], runs[False]
        report = compare_runs(reference, [float(loss) for loss in on["losses"]], on["state"], on["grads"])
        worst = report.worst()
        equal = (all(torch.equal(a, b) for a, b in zip(on["losses"], off["losses"]))
                 and on["state"].keys() == off["state"].keys() and on["grads"].keys() == off["grads"].keys()
                 and all(torch.equal(on["state"][key], off["state"][key]) for key in on["state"])
                 and all(torch.equal(on["grads"][key], off["grads"][key]) for key in on["grads"]))
        results[name] = {
            "ok": report.ok, "worst": (worst.name, worst.max_abs, worst.max_rel), "equal": equal,
            **{f"{key}_{label}": run[key] for label, run in (("on", on), ("off", off))
               for key in ("measured", "predicted", "waits", "fx_issues", "fx_waits", "ops_in_flight")},
        }
    return results


def _check(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for name, outcome in result.items():
            where = f"rank {rank}, plan {name}"
            assert outcome["ok"], f"{where}: overlap on differs from one device, worst {outcome['worst']}"
            assert outcome["equal"], f"{where}: overlap on and off give different losses, gradients or state"
            for label in ("on", "off"):
                assert outcome[f"measured_{label}"] == outcome[f"predicted_{label}"], (where, label, outcome)
            assert outcome["measured_on"] == outcome["measured_off"], (where, outcome)
            assert outcome["waits_off"] == outcome["fx_issues_off"] == outcome["fx_waits_off"] == 0, (where, outcome)
            assert outcome["waits_on"] == outcome["fx_issues_on"] == outcome["fx_waits_on"] > 0, (where, outcome)
            assert outcome["ops_in_flight_on"] > 0, f"{where}: no op runs while a collective is in flight"


def test_overlap_on_two_ranks_passes_the_check_and_equals_overlap_off():
    _check(run_distributed(_session, 2, (2,), {"dp": DP, "zero3": ZERO3}, timeout_s=240))


def test_overlap_and_shared_collectives_on_a_2x2_mesh():
    mesh_shape, inputs = MLP_PLANS["dp2d_zero3"]
    _check(run_distributed(_session, 4, mesh_shape, {"dp2d_zero3": inputs}, timeout_s=240))
