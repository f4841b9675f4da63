"""Multi-process gloo tests: every resharding collective, and whole MLP steps checked against one device.

One spawned session per mesh (2 ranks: mesh (2,); 4 ranks: mesh (2, 2)) runs
all of its checks, to keep process start-up (a few seconds each) rare.
"""

from __future__ import annotations

import copy
import itertools

import pytest

from test_runtime_support import greedy_plan, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TP_1D = {"fc1.weight": "(S(0))", "fc1.bias": "(S(0))", "fc1.weight:momentum_buffer": "(S(0))",
         "fc1.bias:momentum_buffer": "(S(0))", "fc2.weight": "(S(1))", "fc2.weight:momentum_buffer": "(S(1))"}
DP_1D = {"batch.inputs": "(S(0))", "batch.targets": "(S(0))"}
DP_TP_2D = {"batch.inputs": "(S(0), R)", "batch.targets": "(S(0), R)",
            **{name: f"(R, {text[1:-1]})" for name, text in TP_1D.items()}}
TP_DP_2D = {"batch.inputs": "(R, S(0))", "batch.targets": "(R, S(0))",
            **{name: f"({text[1:-1]}, R)" for name, text in TP_1D.items()}}


def _session(mesh_shape: tuple[int, ...], plan_inputs: dict) -> dict:
    """One rank: the resharding sweep, then an MLP step under every plan, checked against one device."""
    import torch

    from metadist.ir import Mesh
    from metadist.runtime.env import read_torchrun_env
    from metadist.runtime.setup import setup_device_mesh

    torch.set_num_threads(1)
    mesh = Mesh(mesh_shape)
    device_mesh = setup_device_mesh(mesh, read_torchrun_env(), timeout_s=60)
    return {"collectives": _reshard_sweep(mesh, device_mesh), "plans": _mlp_plans(mesh, device_mesh, plan_inputs)}


def _reshard_sweep(mesh, device_mesh) -> dict:
    """Every (source, target) sharding pair of a (4, 8) tensor: result pieces match, bytes match the prediction."""
    import torch

    from metadist.ir import Partial, Replicate, Shard
    from metadist.lowering import plan_resharding
    from metadist.runtime.collectives import Collectives, run_steps
    from metadist.runtime.step import shard_full_tensor

    placements = [Replicate(), Shard(0), Shard(1), Partial("sum")] + ([Partial("max")] if mesh.ndim == 1 else [])
    shardings = list(itertools.product(placements, repeat=mesh.ndim))
    coords = tuple(device_mesh.get_coordinate())
    comm = Collectives.from_device_mesh(device_mesh)
    whole = torch.arange(32, dtype=torch.float64).reshape(4, 8) - 9.0
    predicted, failures = 0, []
    for source, target in itertools.product(shardings, repeat=2):
        piece = _source_piece(whole, source, mesh, coords)
        steps = plan_resharding(whole.shape, 8, source, target, mesh, coords)
        predicted += sum(step.comm_bytes for step in steps)
        got = run_steps(comm, piece, steps)
        if not any(isinstance(p, Partial) for p in target) and not torch.equal(got, shard_full_tensor(whole, target, mesh.shape, coords)):
            failures.append((str(source), str(target)))
        back = plan_resharding(whole.shape, 8, target, tuple(Replicate() for _ in target), mesh, coords)
        predicted += sum(step.comm_bytes for step in back)
        if not torch.equal(run_steps(comm, got, back), whole):
            failures.append((str(source), str(target), "round trip"))
    measured = sum(record.bytes for record in comm.records.values())
    kinds = sorted({kind for _, kind, _ in comm.records})
    return {"failures": failures, "measured": measured, "predicted": predicted, "kinds": kinds, "pairs": len(shardings) ** 2}


def _source_piece(whole, sharding, mesh, coords):
    from metadist.ir import Partial, Shard

    piece = whole
    for axis, placement in enumerate(sharding):
        c, k = coords[axis], mesh.shape[axis]
        if isinstance(placement, Shard):
            piece = piece.chunk(k, dim=placement.dim)[c]
        elif isinstance(placement, Partial) and placement.op == "sum":
            piece = piece * (0.25 if c < k - 1 else 1 - 0.25 * (k - 1))
        elif isinstance(placement, Partial):
            piece = piece if c == 0 else piece - 7.0
    return piece.clone()


def _mlp_plans(mesh, device_mesh, plan_inputs: dict) -> dict:
    """Two SGD steps of the MLP under each plan, compared with the same steps on one device."""
    import torch

    from metadist.frontends.torch import capture_step
    from metadist.lowering import replicate_plan
    import math
    from dataclasses import replace

    from metadist.runtime.check import compare_runs, reference_run
    from metadist.runtime.errors import CheckError
    from metadist.runtime.report import Reporter
    from metadist.runtime.step import CompiledStep
    from metadist.runtime.worker import ON_RANK_ZERO, compare_on_rank_zero
    from metadist.workloads import builtin_workload

    workload = builtin_workload("mlp", optimizer="sgd")
    train_step = workload.train_step()
    reference = reference_run(train_step, workload.model, workload.optimizer, workload.batch, steps=2, seed=0)
    results = {}
    for name, inputs in {"replicate": None, **plan_inputs}.items():
        model = copy.deepcopy(workload.model)
        optimizer = workload.optimizer(model.parameters())
        torch_step = capture_step(train_step, model, optimizer, workload.batch, keep_grads=True)
        graph = torch_step.graph
        plan = replicate_plan(graph, mesh, "test") if inputs is None else greedy_plan(graph, mesh, inputs)
        compiled = CompiledStep(torch_step, plan, device_mesh, metadist_version="test")
        losses = [float(compiled(model, optimizer, workload.batch)) for _ in range(2)]
        measured = sum(r.bytes for (phase, _, _), r in compiled.comm_records().items() if phase == "step")
        predicted = 2 * sum(nbytes for _, nbytes in compiled.program.predicted_comm().values())
        state, grads = compiled.state_dict(), compiled.grads()
        report = compare_runs(reference, losses, state, grads)
        worst = report.worst()
        # the check's own gathering: the whole tensors on the first device only, equal to gathering everywhere
        first = (dict(compiled.state_one_by_one().pairs), dict(compiled.grads_one_by_one().pairs))
        if any(compiled.coords):
            first_rank_only = first == ({}, {})
        else:
            first_rank_only = all(mine.keys() == whole.keys() and all(torch.equal(mine[k], whole[k]) for k in whole)
                                  for mine, whole in zip(first, (state, grads)))
        # the check as `metadist run` makes it: the whole tensors gathered to the first device one at a time as it
        # compares them, the same report; a comparison stopped by an error still takes every rank's pieces
        mine = reference if not any(compiled.coords) else ON_RANK_ZERO
        streamed = compare_on_rank_zero(mine, losses, compiled.state_one_by_one(), compiled.grads_one_by_one(),
                                        Reporter(enabled=False))
        streamed_same = streamed is None if any(compiled.coords) else streamed.differences == report.differences
        short = mine if mine is ON_RANK_ZERO else replace(reference, state=dict(list(reference.state.items())[1:]))
        try:
            compare_on_rank_zero(short, losses, compiled.state_one_by_one(), compiled.grads_one_by_one(),
                                 Reporter(enabled=False))
            refused = any(compiled.coords)
        except CheckError as err:
            refused = "different state tensors" in str(err)
        after = [float(compiled(model, optimizer, workload.batch))]  # the ranks' collectives still in step
        results[name] = {"ok": report.ok, "worst": (worst.name, worst.max_abs, worst.max_rel),
                         "measured": measured, "predicted": predicted, "tensors": len(report.differences),
                         "first_rank_only": first_rank_only, "streamed": streamed_same, "refused": refused,
                         "after": math.isfinite(after[0])}
    return results


def _assert_session(results: list[dict], plan_names: list[str]) -> None:
    for rank, result in enumerate(results):
        sweep = result["collectives"]
        assert sweep["failures"] == [], f"rank {rank}: resharding failures {sweep['failures'][:5]}"
        assert sweep["measured"] == sweep["predicted"]
        assert sweep["kinds"] == ["all_gather", "all_reduce", "all_to_all", "reduce_scatter"]
        for name in ["replicate", *plan_names]:
            outcome = result["plans"][name]
            assert outcome["ok"], f"rank {rank}, plan {name}: worst difference {outcome['worst']}"
            assert outcome["measured"] == outcome["predicted"], (rank, name, outcome)
            assert outcome["first_rank_only"], (rank, name)
            assert outcome["streamed"] and outcome["refused"] and outcome["after"], (rank, name, outcome)
        assert result["plans"]["replicate"]["measured"] == 0
        assert all(result["plans"][name]["measured"] > 0 for name in plan_names)


def test_two_ranks_reshard_and_run_mlp_plans():
    plans = {"data_parallel": DP_1D, "tensor_parallel": TP_1D}
    _assert_session(run_distributed(_session, 2, (2,), plans), list(plans))


def test_four_ranks_on_a_2x2_mesh():
    plans = {"dp_x_tp": DP_TP_2D, "tp_x_dp": TP_DP_2D}
    _assert_session(run_distributed(_session, 4, (2, 2), plans, timeout_s=240), list(plans))


def _failure_session(mode: str) -> dict:
    """``mismatch``: ranks hold different plans. ``abandon``: rank 1 leaves before a collective."""
    import time

    from metadist.ir import Mesh
    from metadist.runtime.env import read_torchrun_env
    from metadist.runtime.errors import RuntimeSetupError
    from metadist.runtime.setup import check_same_everywhere, setup_device_mesh

    env = read_torchrun_env()
    setup_device_mesh(Mesh((2,)), env, timeout_s=10)
    if mode == "abandon" and env.rank == 1:
        return {"left": True}
    started = time.perf_counter()
    try:
        check_same_everywhere(f"plan of rank {env.rank}" if mode == "mismatch" else "same plan", "plan")
    except RuntimeSetupError as err:
        return {"error": "RuntimeSetupError", "message": str(err), "seconds": time.perf_counter() - started}
    except RuntimeError as err:  # gloo reports a vanished peer or a timeout as RuntimeError
        return {"error": type(err).__name__, "message": str(err), "seconds": time.perf_counter() - started}
    return {"error": None, "seconds": time.perf_counter() - started}


def test_ranks_with_different_plans_all_fail_clearly():
    results = run_distributed(_failure_session, 2, "mismatch")
    assert all(r["error"] == "RuntimeSetupError" and "hold different plans" in r["message"] for r in results)


def test_a_rank_that_leaves_does_not_hang_the_others():
    first, second = run_distributed(_failure_session, 2, "abandon", timeout_s=90)
    assert second == {"left": True}
    assert first["error"] is not None and first["seconds"] < 30, first
