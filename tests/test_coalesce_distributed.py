"""Coalesced collectives on 2 gloo processes: the flat per-rank layout, and whole MLP steps checked against one device.

One spawned session runs every check: each coalesced collective against the same
members run one by one (equal results and bytes, one call), then two SGD steps of the
MLP under a data-parallel plan and a ZeRO-3 plan with coalescing on (the default),
compared with one device; the calls counted must equal the lowering's coalesced
prediction and be fewer than without coalescing. The runtime's all-gather, which gloo carries out as an all-to-all,
must give what torch's own all-gather gives.
"""

from __future__ import annotations

import copy

import pytest

from test_coalesce import DP, ZERO3, zero3_plan
from test_runtime_support import run_distributed

pytestmark = [pytest.mark.distributed]


def _session() -> dict:
    import torch

    from metadist.ir import Mesh
    from metadist.runtime.env import read_torchrun_env
    from metadist.runtime.setup import setup_device_mesh

    torch.set_num_threads(1)
    device_mesh = setup_device_mesh(Mesh((2,)), read_torchrun_env(), timeout_s=60)
    return {"collectives": _coalesced_vs_one_by_one(device_mesh), "plans": _mlp_steps(device_mesh),
            "gather": _gather_against_torch(device_mesh)}


def _gather_against_torch(device_mesh) -> dict:
    """The runtime's all-gather (an all-to-all on gloo) against torch's own, on several dtypes and shapes."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from metadist.runtime.collectives import gathers_by_all_to_all, start_all_gather

    group, rank = device_mesh.get_group(0), device_mesh.get_rank()
    generator = torch.Generator().manual_seed(10 + rank)
    tensors = [torch.randn(3, 5, generator=generator, dtype=torch.float64),
               torch.randn(2, 3, 4, generator=generator).to(torch.bfloat16),
               torch.randint(-9, 9, (4,), generator=generator)]
    equal, ops = [], set()
    for tensor in tensors:
        want = tensor.new_empty((2 * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(want, tensor, group=group)
        got = torch.full_like(want, 7)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start_all_gather(got, tensor, group, 2).wait()
        ops |= {event.name for event in prof.events() if event.name.startswith("c10d::")}
        rows = tensor.shape[0]
        equal.append(torch.equal(want, got) and torch.equal(got[rank * rows:(rank + 1) * rows], tensor))
    return {"equal": equal, "by_all_to_all": gathers_by_all_to_all(group, tensors[0]), "ops": sorted(ops)}


def _coalesced_vs_one_by_one(device_mesh) -> dict:
    """Members of several shapes and dims: the coalesced call gives exactly what separate calls give."""
    import torch

    from metadist.runtime.collectives import Collectives

    rank = device_mesh.get_rank()
    generator = torch.Generator().manual_seed(rank)
    shapes = [(4, 6), (2, 8, 4), (6,), (2, 2)]
    tensors = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    one, many = Collectives.from_device_mesh(device_mesh), Collectives.from_device_mesh(device_mesh)
    cases = {
        "all_gather": (lambda: [one.all_gather(t, 0, d) for t, d in zip(tensors, [1, 2, 0, 0])],
                       lambda: many.coalesced_all_gather(tensors, 0, [1, 2, 0, 0])),
        "reduce_scatter": (lambda: [one.reduce_scatter(t, 0, "sum", d) for t, d in zip(tensors, [0, 1, 0, 1])],
                           lambda: many.coalesced_reduce_scatter(tensors, 0, "sum", [0, 1, 0, 1])),
        "all_reduce": (lambda: [one.all_reduce(t, 0, "max") for t in tensors],
                       lambda: many.coalesced_all_reduce(tensors, 0, "max")),
    }
    result = {}
    for kind, (separately, together) in cases.items():
        want, got = separately(), together()
        result[kind] = {
            "equal": len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got)),
            "shapes": [tuple(t.shape) for t in got],
            "calls": (one.records[("step", kind, 0)].count, many.records[("step", kind, 0)].count),
            "bytes": (one.records[("step", kind, 0)].bytes, many.records[("step", kind, 0)].bytes),
        }
    return result


def _mlp_steps(device_mesh) -> dict:
    """Two SGD steps of the MLP under each plan, coalesced, against the same steps on one device."""
    from metadist.frontends.torch import capture_step
    from metadist.ir import Mesh
    from metadist.lowering import CoalescedReshard, lower
    from metadist.runtime.check import compare_runs, reference_run
    from metadist.runtime.step import CompiledStep
    from metadist.workloads import builtin_workload

    workload = builtin_workload("mlp", optimizer="sgd")
    train_step = workload.train_step()
    reference = reference_run(train_step, workload.model, workload.optimizer, workload.batch, steps=2, seed=0)
    results = {}
    for name, inputs in {"dp": DP, "zero3": ZERO3}.items():
        model = copy.deepcopy(workload.model)
        optimizer = workload.optimizer(model.parameters())
        torch_step = capture_step(train_step, model, optimizer, workload.batch, keep_grads=True)
        plan = zero3_plan(torch_step.graph, Mesh((2,)), inputs)
        compiled = CompiledStep(torch_step, plan, device_mesh, metadist_version="test")
        losses = [float(compiled(model, optimizer, workload.batch)) for _ in range(2)]
        records = {(kind, axis): r for (phase, kind, axis), r in compiled.comm_records().items() if phase == "step"}
        predicted = compiled.program.predicted_comm()
        uncoalesced = lower(torch_step.graph, plan, compiled.coords, bucket_cap_bytes=0).predicted_comm()
        report = compare_runs(reference, losses, compiled.state_dict(), compiled.grads())
        worst = report.worst()
        results[name] = {
            "ok": report.ok, "worst": (worst.name, worst.max_abs, worst.max_rel),
            "measured": {f"{kind}@{axis}": (r.count, r.bytes) for (kind, axis), r in records.items()},
            "predicted": {f"{kind}@{axis}": (2 * count, 2 * nbytes) for (kind, axis), (count, nbytes) in predicted.items()},
            "calls_uncoalesced": 2 * sum(count for count, _ in uncoalesced.values()),
            "bytes_uncoalesced": 2 * sum(nbytes for _, nbytes in uncoalesced.values()),
            "bucket_kinds": sorted({item.kind for item in compiled.program.instructions if isinstance(item, CoalescedReshard)}),
        }
    return results


def test_coalesced_collectives_and_mlp_plans_on_two_ranks():
    for rank, result in enumerate(run_distributed(_session, 2, timeout_s=240)):
        for kind, outcome in result["collectives"].items():
            assert outcome["equal"], f"rank {rank}: coalesced {kind} differs from one call per tensor"
            assert outcome["calls"] == (4, 1), (rank, kind, outcome)
            assert outcome["bytes"][0] == outcome["bytes"][1], (rank, kind, outcome)
        assert result["collectives"]["all_gather"]["shapes"] == [(4, 12), (2, 8, 8), (12,), (4, 2)]
        assert result["collectives"]["reduce_scatter"]["shapes"] == [(2, 6), (2, 4, 4), (3,), (2, 1)]
        for name, outcome in result["plans"].items():
            assert outcome["ok"], f"rank {rank}, plan {name}: worst difference {outcome['worst']}"
            assert outcome["measured"] == outcome["predicted"], (rank, name, outcome)
            calls = sum(count for count, _ in outcome["measured"].values())
            assert calls < outcome["calls_uncoalesced"], (rank, name, outcome)
            assert sum(nbytes for _, nbytes in outcome["measured"].values()) == outcome["bytes_uncoalesced"]
        assert result["gather"]["equal"] == [True, True, True], (rank, result["gather"])
        assert result["gather"]["by_all_to_all"], "gloo: the runtime gathers by an all-to-all"
        assert result["gather"]["ops"] == ["c10d::alltoall_base_"], result["gather"]["ops"]
        assert result["plans"]["dp"]["bucket_kinds"] == ["all_reduce"]
        assert result["plans"]["zero3"]["bucket_kinds"] == ["all_gather", "all_reduce", "reduce_scatter"]
