"""Runtime tests in one process: environment errors, the rank GraphModule, the check's tolerances, the CLI's checks."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from metadist.frontends.torch.execute import execute_graph
from metadist.ir import Mesh, parse_sharding
from metadist.lowering import lower, replicate_plan
from metadist.runtime.check import ReferenceRun, compare_runs
from metadist.runtime.collectives import Collectives, local_slice, zero_partial
from metadist.runtime.env import read_torchrun_env
from metadist.runtime.errors import CheckError, RuntimeSetupError
from metadist.runtime.graph_module import build_rank_module, draw_random
from metadist.runtime.setup import check_mesh_size
from metadist.runtime.step import shard_full_tensor

from test_runtime_support import greedy_plan


def test_missing_torchrun_environment_is_a_clear_error():
    with pytest.raises(RuntimeSetupError, match=r"RANK, WORLD_SIZE.*not set.*metadist run MODEL --nproc N"):
        read_torchrun_env({"LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    env = read_torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.master_port) == (1, 2, 29500)


def test_world_size_must_match_the_mesh_naming_both_numbers():
    with pytest.raises(RuntimeSetupError, match=r"has 4 devices but the job has 2 processes"):
        check_mesh_size(Mesh((2, 2)), 2)


def test_shard_full_tensor_nests_axes():
    whole = torch.arange(16.0).reshape(8, 2)
    piece = shard_full_tensor(whole, parse_sharding("(S(0), S(0))"), (2, 2), (1, 0))
    assert piece.tolist() == [[8.0, 9.0], [10.0, 11.0]]
    assert local_slice(whole, 1, 1, 2).tolist() == [[float(v)] for v in range(1, 16, 2)]
    assert zero_partial(whole, 1).abs().sum() == 0 and zero_partial(whole, 0) is whole


def test_all_to_all_buffers_equal_chunk_stack_and_cat_and_take_no_copy_along_dim_zero():
    from metadist.runtime.collectives import all_to_all_pieces, unpack_all_to_all

    whole = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    for tensor in (whole, whole.transpose(0, 2).contiguous().transpose(0, 2)):  # contiguous, and not
        for k in (2, 4):
            for dim in range(3):
                if tensor.shape[dim] % k:
                    with pytest.raises(ValueError, match="must divide"):
                        all_to_all_pieces(tensor, k, dim)
                    continue
                pieces = all_to_all_pieces(tensor, k, dim)
                assert pieces.is_contiguous() and torch.equal(pieces, torch.stack(tensor.chunk(k, dim=dim)))
                # along dim 0 of a contiguous tensor the buffer is the tensor's own memory
                assert (pieces.data_ptr() == tensor.data_ptr()) == (dim == 0 and tensor.is_contiguous())
                joined = unpack_all_to_all(pieces, dim)
                assert joined.is_contiguous() and torch.equal(joined, tensor)
                assert (joined.data_ptr() == pieces.data_ptr()) == (dim == 0)

def test_random_ops_draw_the_global_tensor_and_keep_the_slice():
    like = torch.empty(4, 6)
    torch.manual_seed(3)
    whole = torch.ops.aten.bernoulli.p(torch.empty(4, 6), 0.5)
    torch.manual_seed(3)
    piece = draw_random("aten.bernoulli.p", (4, 6), (((0, 1, 2),),), 1, like[:2], 0.5)
    assert torch.equal(piece, whole[2:])


def _mlp_graph():
    from metadist.frontends.torch import capture_step
    from metadist.workloads import builtin_workload

    workload = builtin_workload("mlp", optimizer="sgd")
    optimizer = workload.optimizer(workload.model.parameters())
    return capture_step(workload.train_step(), workload.model, optimizer, workload.batch)


def test_rank_program_is_an_fx_graph_module_with_collectives():
    step = _mlp_graph()
    plan = greedy_plan(step.graph, Mesh((2,)), {"batch.inputs": "(S(0))", "batch.targets": "(S(0))"})
    program = lower(step.graph, plan, (0,), bucket_cap_bytes=0)
    module = build_rank_module(program, Collectives(("g0",), (2,)))
    assert isinstance(module, torch.fx.GraphModule)
    methods = {node.target for node in module.graph.nodes if node.op == "call_method"}
    assert methods == {"all_gather", "all_reduce"}
    assert "comm.all_reduce" in module.code or "all_reduce(" in module.code
    # coalesced (the default): the gradients' all-reduces become one call on a list of tensors
    module = build_rank_module(lower(step.graph, plan, (0,)), Collectives(("g0",), (2,)))
    calls = [node for node in module.graph.nodes if node.op == "call_method"]
    assert {node.target for node in calls} == {"all_gather", "coalesced_all_reduce"}
    (bucket,) = [node for node in calls if node.target == "coalesced_all_reduce"]
    assert len(bucket.args[1]) == 6, "the MLP's six gradients share one all-reduce"


def test_replicated_rank_program_reproduces_the_single_device_step():
    """On a 1-device mesh the rank program runs no collective and must match TorchStep.run exactly."""
    from metadist.frontends.torch import capture_step
    from metadist.workloads import builtin_workload

    workload = builtin_workload("mlp", optimizer="adamw")
    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch)
    program = lower(step.graph, replicate_plan(step.graph, Mesh((1,)), "test"), (0,))
    module = build_rank_module(program, Collectives(("unused",), (1,)))
    inputs = step.gather_inputs(workload.model, optimizer, workload.batch)
    got = module(*inputs)
    want = execute_graph(step.graph, inputs, step.constants)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_first_run_takes_out_only_the_layout_calls_that_did_nothing():
    """A ``contiguous`` call on a value already contiguous is taken out after the probing run; one on a transposed
    value stays, and the module computes the same afterwards."""
    from metadist.runtime.graph_module import FirstRunProbe, apply_first_run

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    summed = graph.call_method("contiguous", (graph.call_function(torch.ops.aten.add.Tensor, (x, x)),))
    flipped = graph.call_method("contiguous", (graph.call_function(torch.ops.aten.t.default, (x,)),))
    graph.output((summed, graph.call_function(torch.ops.aten.mul.Tensor, (flipped, 2.0))))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    data = torch.arange(6.0).reshape(2, 3)
    probe = FirstRunProbe(module)
    want = probe.run(data)
    assert [node.args[0].target for node in probe.no_ops] == [torch.ops.aten.add.Tensor]
    assert apply_first_run(module, probe) == (1, 3)
    calls = [node for node in module.graph.nodes if node.op == "call_method"]
    assert [node.args[0].target for node in calls] == [torch.t]
    got = module(data)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[1].is_contiguous()


def _replica_drift(model_name: str, mesh: tuple) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import metadist
    from metadist.workloads import builtin_workload

    workload = builtin_workload(model_name)
    model, step = workload.model, workload.train_step()
    optimizer = workload.optimizer(model.parameters())
    compiled = metadist.compile(step, mesh=mesh, plan="replicate", cluster="cpu-gloo")
    compiled(model, optimizer, workload.batch)
    inner = compiled.compiled
    found = {"clean": inner.replica_disagreements()}
    name, param = next((name, param) for name, param in model.named_parameters()
                       if isinstance(param, DTensor) and param._local_tensor.numel() > 3)
    local = param._local_tensor.view(-1)
    with torch.no_grad():
        if dist.get_rank() == 1:  # two elements swapped: the same sum and absolute sum
            local[0], local[1] = local[1].clone(), local[0].clone()
    found["swapped"] = inner.replica_disagreements()
    with torch.no_grad():
        if dist.get_rank() == 1:
            local[0], local[1] = local[1].clone(), local[0].clone()
            local[2] += 1e-3 * local.abs().sum()
    found["moved"] = inner.replica_disagreements()
    found["name"] = name
    return found


@pytest.mark.distributed
def test_replicated_copies_that_drift_apart_on_one_rank_are_found():
    """The check reads the first device's copy of a replicated value; every rank's copies are also compared through
    fingerprints (a kernel that computed a whole output from an empty piece did so on one rank of four: its
    replicated parameters drifted while rank 0's stayed right). An element moved, or two swapped, on rank 1 is
    found and named; copies left alone agree."""
    from test_runtime_support import run_distributed

    for result in run_distributed(_replica_drift, 2, "mlp", (2,), timeout_s=300):
        assert result["clean"] == []
        for case in ("swapped", "moved"):
            assert [(name, rank) for name, _, rank in result[case]] == [(result["name"], 1)], (case, result[case])
            assert result[case][0][1] > 1e-5
    reference = ReferenceRun((1.0,), {"w": torch.ones(2)}, {"w": torch.ones(2)})
    report = compare_runs(reference, [1.0], {"w": torch.ones(2)}, {"w": torch.ones(2)}, replicas=[("w", 0.5, 3)])
    assert not report.ok and report.worst().name == "replicas:w@rank3"
    with pytest.raises(CheckError, match="replicas:w@rank3"):
        report.raise_if_failed()


def _three_steps_compiled_and_eager(model_name: str, mesh: tuple) -> dict:
    import copy

    import metadist
    from metadist.workloads import builtin_workload

    workload = builtin_workload(model_name)
    eager_model, model = workload.model, copy.deepcopy(workload.model)
    eager_opt, opt = workload.optimizer(eager_model.parameters()), workload.optimizer(model.parameters())
    step = workload.train_step()
    compiled = metadist.compile(step, mesh=mesh, plan="solver", cluster="cpu-gloo")
    losses, layout_calls = [], []
    for _ in range(3):
        losses.append((float(compiled(model, opt, workload.batch)), float(step(eager_model, eager_opt, workload.batch))))
        layout_calls.append(sum(node.op == "call_method" and node.target == "contiguous"
                                for node in compiled.compiled.module.graph.nodes))
    worst = max((param.full_tensor() - eager).abs().max().item()
                for param, eager in zip(model.parameters(), eager_model.parameters()))
    return {"losses": losses, "layout_calls": layout_calls, "traced_contiguous": len(compiled.torch_step.contiguous_values),
            "worst": worst}


@pytest.mark.distributed
def test_a_compiled_step_drops_its_idle_layout_calls_after_the_first_call_and_keeps_the_eager_result():
    """The first call probes the layouts; later calls run the module without the idle ``contiguous`` calls, and
    three steps of a model with transposed weights and gradients still equal the eager ones (2 processes)."""
    from test_runtime_support import run_distributed

    for result in run_distributed(_three_steps_compiled_and_eager, 2, "llama-tiny", (2,), timeout_s=300):
        for got, want in result["losses"]:
            assert abs(got - want) <= 1e-5 * abs(want), result["losses"]
        calls = result["layout_calls"]
        assert calls[0] == calls[1] == calls[2] < result["traced_contiguous"], (calls, result["traced_contiguous"])
        assert result["worst"] < 1e-4, result["worst"]


def test_check_tolerances_and_report():
    reference = ReferenceRun((1.0,), {"w": torch.tensor([1.0, 2.0, 0.0])}, {"w": torch.tensor([0.5, 0.5, 0.5])})
    close = compare_runs(reference, [1.0 + 1e-6], {"w": torch.tensor([1.00001, 2.0, 5e-6])}, {"w": torch.tensor([0.5, 0.5, 0.5])})
    assert close.ok
    assert close.worst().name == "state:w" and close.worst().max_abs == pytest.approx(1e-5, rel=1e-2)
    far = compare_runs(reference, [1.0], {"w": torch.tensor([1.0, 2.1, 0.0])}, {"w": torch.tensor([0.5, 0.5, 0.5])})
    assert not far.ok
    with pytest.raises(CheckError, match=r"state:w: max abs 0.1"):
        far.raise_if_failed()
    # a parameter element whose gradient is at the noise level may miss: counted, not failed
    noisy = ReferenceRun((1.0,), {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 1e-9])})
    report = compare_runs(noisy, [1.0], {"w": torch.tensor([1.0, 2.001])}, {"w": torch.tensor([0.5, 2e-9])})
    assert report.ok and [d.excused for d in report.differences if d.name == "state:w"] == [1]
    report = compare_runs(noisy, [1.0], {"w": torch.tensor([1.001, 2.0])}, {"w": torch.tensor([0.5, 2e-9])})
    assert not report.ok
    with pytest.raises(CheckError, match="different state tensors"):
        compare_runs(reference, [1.0], {"v": torch.zeros(3)}, reference.grads)


def test_check_compares_tensors_that_come_one_at_a_time_gradients_first_and_runs_them_out_on_an_error():
    import weakref

    from metadist.runtime.check import TensorStream

    reference = ReferenceRun((1.0,), {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])},
                             {"w": torch.tensor([0.5, 1e-9]), "b": torch.tensor([0.25])})
    state = {"w": torch.tensor([1.0, 2.001]), "b": torch.tensor([3.0])}
    grads = {"w": torch.tensor([0.5, 2e-9]), "b": torch.tensor([0.25])}
    order: list[str] = []
    held: list[bool] = []  # per tensor after the first: whether the one before it was still alive when it was made

    def stream(kind, tensors):
        def pairs():
            previous = None
            for name in ("w", "b"):  # not sorted: the report orders its differences itself
                held.append(previous is not None and previous() is not None)
                tensor = tensors[name].clone()
                previous = weakref.ref(tensor)
                order.append(f"{kind}:{name}")
                yield name, tensor
                del tensor
        return TensorStream(frozenset(tensors), pairs())

    whole = compare_runs(reference, [1.0], state, grads)
    streamed = compare_runs(reference, [1.0], stream("state", state), stream("grad", grads))
    assert streamed.differences == whole.differences and streamed.ok  # the noise floor from the gradients, as whole
    assert order == ["grad:w", "grad:b", "state:w", "state:b"]
    assert held == [False] * 4  # each let go before the next was made
    # a comparison stopped by an error still runs both streams to their end (other ranks are sending them)
    order.clear()
    short = ReferenceRun((1.0,), {"w": reference.state["w"]}, reference.grads)
    with pytest.raises(CheckError, match="different state tensors"):
        compare_runs(short, [1.0], stream("state", state), stream("grad", grads))
    assert order == ["grad:w", "grad:b", "state:w", "state:b"]


def test_check_compares_integers_float64_and_float32_to_the_tolerance():
    grads = {"w": torch.tensor([0.5, 0.5])}
    counter = ReferenceRun((1.0,), {"step": torch.tensor(12, dtype=torch.int64), "w": torch.ones(2)}, grads)
    off_by_one = compare_runs(counter, [1.0], {"step": torch.tensor(11, dtype=torch.int64), "w": torch.ones(2)}, grads)
    assert not off_by_one.ok and off_by_one.worst().name == "state:step" and off_by_one.worst().max_abs == 1.0
    wide = ReferenceRun((1.0,), {"w": torch.tensor([1e9 + 1.0, 1.0], dtype=torch.float64)}, grads)
    assert not compare_runs(wide, [1.0], {"w": torch.tensor([1e9 + 2e5 + 1.0, 1.0], dtype=torch.float64)}, grads).ok
    assert compare_runs(wide, [1.0], {"w": torch.tensor([1e9 + 5e4, 1.0], dtype=torch.float64)}, grads).ok
    # float32 at the bound's edge: 1e-4 relative plus 1e-5 passes, twice that fails
    base = torch.tensor([3.0, -7.0, 1e-3])
    reference = ReferenceRun((1.0,), {"w": base}, {"w": torch.ones(3)})
    assert compare_runs(reference, [1.0], {"w": base + (1e-5 + 1e-4 * base.abs()) * 0.9}, {"w": torch.ones(3)}).ok
    assert not compare_runs(reference, [1.0], {"w": base - (1e-5 + 1e-4 * base.abs()) * 2}, {"w": torch.ones(3)}).ok


def test_check_fails_a_nan_or_infinity_the_reference_does_not_have(capsys):
    inf, nan = float("inf"), float("nan")
    want = torch.tensor([1.0, 2.0, inf, -inf, nan, 0.0])
    tiny_grads = {"w": torch.full((6,), 1e-12)}  # every element's update is noise-level: misses would be excused
    reference = ReferenceRun((1.0,), {"w": want}, tiny_grads)
    agreeing = want.clone()
    agreeing[0] += 1e-6
    report = compare_runs(reference, [1.0], {"w": agreeing}, tiny_grads)
    assert report.ok and report.worst().max_abs == pytest.approx(1e-6, rel=0.1)  # NaN and infinities in both: equal
    for changed, value in ((0, nan), (2, -inf), (2, 1e30), (4, 3.0), (5, inf)):
        got = want.clone()
        got[changed] = value
        report = compare_runs(reference, [1.0], {"w": got}, tiny_grads)
        assert not report.ok, (changed, value)
        assert [d.excused for d in report.differences if d.name == "state:w"] == [0]
    from metadist.runtime.summary import check_summary

    nan_loss = compare_runs(reference, [nan], {"w": want.clone()}, tiny_grads)
    assert not nan_loss.ok and math.isnan(check_summary(nan_loss).max_abs)  # whatever order the tensors come in
    from metadist.runtime.report import Reporter

    capsys.readouterr()
    Reporter(enabled=True).check(nan_loss)
    loss_row = next(line for line in capsys.readouterr().out.splitlines() if "loss" in line)
    assert "nan" in loss_row  # the check's table shows it too
    assert not compare_runs(reference, [1.0], {"w": want.clone()}, {"w": torch.tensor([1e-12] * 5 + [nan])}).ok


def test_the_checks_one_pass_answer_equals_the_element_by_element_one():
    from metadist.runtime.check import TOLERANCES, _difference, _difference_closely

    generator = torch.Generator().manual_seed(0)
    want = torch.randn(4096, generator=generator) * torch.logspace(-8, 2, 4096)
    for scale in (0.0, 1e-7, 1e-5):  # within every bound, then some elements missing theirs
        got = want + scale * torch.randn(4096, generator=generator)
        for tolerance in (TOLERANCES["float32"], TOLERANCES["bfloat16"]):
            fast = _difference("w", got, want, tolerance)
            close = _difference_closely("w", got, want, tolerance, None, 0.0)
            assert (fast.max_abs, fast.max_rel, fast.ok) == (close.max_abs, close.max_rel, close.ok)
    assert not _difference("w", want + 1e-5 * torch.randn(4096, generator=generator), want, TOLERANCES["float32"]).ok


def test_the_reference_run_of_the_distributed_runs_own_capture_equals_a_fresh_capture():
    from metadist.frontends.torch import capture_step
    from metadist.runtime.check import reference_run
    from metadist.workloads import builtin_workload

    workload = builtin_workload("mlp")
    optimizer = workload.optimizer(workload.model.parameters())
    captured = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, keep_grads=True)
    args = (workload.train_step(), workload.model, workload.optimizer, workload.batch)
    fresh, reused = reference_run(*args, steps=2, seed=0), reference_run(*args, steps=2, seed=0, captured=captured)
    assert fresh.losses == reused.losses and fresh.losses[0] != fresh.losses[1]
    for mine, theirs in ((fresh.grads, reused.grads), (fresh.state, reused.state)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[name], theirs[name]) for name in mine)
    assert all(torch.equal(a, b) for a, b in zip(workload.model.parameters(), builtin_workload("mlp").model.parameters()))
    without_grads = capture_step(workload.train_step(), workload.model, optimizer, workload.batch)
    with pytest.raises(ValueError, match="gradient outputs"):
        reference_run(*args, steps=1, seed=0, captured=without_grads)


def test_cli_rejects_a_mesh_that_does_not_fit_nproc():
    import argparse

    from metadist.cli import run as run_command
    from metadist.cli.main import UsageError

    parser = argparse.ArgumentParser()
    run_command.register(parser.add_subparsers())
    args = parser.parse_args(["run", "mlp", "--nproc", "3", "--mesh", "2x2"])
    with pytest.raises(UsageError, match=r"the mesh 2x2 \(axis0, axis1\) has 4 devices but --nproc is 3"):
        args.handler(args)
    command = run_command.worker_command(parser.parse_args(["run", "mlp", "--nproc", "2", "--check", "--plan", "dp"]))
    assert command[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    assert command[7:9] == ["metadist.runtime.worker", "mlp"] and "--check" in command
    command = run_command.worker_command(parser.parse_args(
        ["run", "gpt2-tiny", "--nproc", "2", "--meta-init", "--init-seed", "4", "--bucket-cap-mb", "0"]))
    flags = {command[i]: command[i + 1] for i in range(len(command) - 1) if command[i].startswith("--")}
    assert (flags["--bucket-cap-mb"], flags["--device"], flags["--init-seed"]) == ("0.0", "meta", "4")
    worker_args = command[command.index("metadist.runtime.worker") + 1:]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
            patch.setenv(name, value)
        from metadist.runtime.worker import parse_args

        config = parse_args(worker_args)
    assert (config.device, config.init_seed, config.bucket_cap_bytes) == ("meta", 4, 0)
    args = parser.parse_args(["run", "mlp", "--nproc", "2", "--bucket-cap-mb", "-1"])
    with pytest.raises(UsageError, match="--bucket-cap-mb must be 0"):
        args.handler(args)


def test_worker_without_torchrun_says_how_to_launch():
    result = subprocess.run([sys.executable, "-m", "metadist.runtime.worker", "mlp"], capture_output=True, text=True,
                            timeout=120, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert result.returncode == 2
    assert "not started by torchrun" in result.stderr


def test_a_run_says_why_the_solvers_plan_replicates_the_whole_step(capsys):
    from dataclasses import replace

    from metadist.ir import Mesh
    from metadist.lowering.plans import replicate_plan
    from metadist.lowering.program import lower
    from metadist.runtime.report import Reporter
    from test_solver_helpers import mlp_step

    graph, _ = mlp_step(8, 16, 32)
    solved = {"solver": {"kind": "solver"}, "estimate": {"step_s": 0.0269, "cluster": "calibrated-gloo"}}
    replicated = replicate_plan(graph, Mesh((2, 2)), "0.1.0")
    one_device = replace(replicate_plan(graph, Mesh((1,)), "0.1.0"), **solved)
    for plan, said in ((replace(replicated, **solved), True), (replicated, False), (one_device, False)):
        program = lower(graph, plan, (0,) * len(plan.mesh.shape))
        Reporter(enabled=True).plan(plan, "h", program)
        out = " ".join(capsys.readouterr().out.split())
        assert ("runs the whole step on every rank" in out) is said, out
        if said:
            assert "'calibrated-gloo'" in out and "26.9 ms a step" in out and "--plan dp" in out


def test_the_solver_byte_line_counts_a_gloo_reduce_scatter_as_the_all_reduce_it_runs(capsys):
    """The solver prices gloo's reduce-scatter as the all-reduce gloo runs (twice the ring reduce-scatter's bytes); the
    records keep the ring convention of each call, so the line comparing them doubles those on gloo, not on NCCL."""
    from dataclasses import replace

    from metadist.lowering.plans import replicate_plan
    from metadist.runtime.collectives import CommRecord
    from metadist.runtime.report import Reporter
    from test_solver_helpers import mlp_step

    graph, _ = mlp_step(8, 16, 32)
    plan = replace(replicate_plan(graph, Mesh((2,)), "0.1.0"), estimate={"comm_bytes_by_axis": {"axis0": 3 * 2**20}})
    records = {("step", "reduce_scatter", 0): CommRecord(4, 2 * 2**20), ("step", "all_gather", 0): CommRecord(4, 4 * 2**20),
               ("boundary", "all_gather", 0): CommRecord(1, 64 * 2**20)}
    for backend, measured in (("gloo", "4.00 MiB"), ("nccl", "3.00 MiB")):
        Reporter(enabled=True).solver_estimate(plan, records, 2, backend)
        out = " ".join(capsys.readouterr().out.split())
        assert f"axis0: measured {measured}, solver 3.00 MiB" in out, out


def test_a_narrow_matmul_gets_its_operand_in_the_layout_the_capture_read():
    """A reshard hands a matmul a fresh row-major tensor where the capture read a transposed view; a CPU's bfloat16
    kernels run the two layouts at rates an order of magnitude apart, and the cost model prices the captured one. The
    rank module lays such an operand out as captured (same values, the capture's strides): free where it already is."""
    from metadist.frontends.torch import capture_step
    from metadist.runtime.graph_module import as_transposed, narrow_transposed_operands
    from metadist.workloads import builtin_workload

    weight = torch.randn(16, 8).to(torch.bfloat16)
    view = weight.t()  # [8, 16], read transposed as a linear layer's forward reads its weight
    assert as_transposed(view) is view
    fresh = view.contiguous()  # what an all-gather of the view would give: row-major
    laid = as_transposed(fresh)
    assert torch.equal(laid, view) and laid.stride() == view.stride()
    x = torch.randn(4, 8).to(torch.bfloat16)
    assert torch.equal(torch.mm(x, laid), torch.mm(x, view))
    assert as_transposed(torch.randn(5)).dim() == 1

    workload = builtin_workload("mlp", optimizer="sgd")
    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, precision="bf16")
    operands = narrow_transposed_operands(step.graph)
    targets = {step.graph.node(name).op.target for name in operands}
    assert operands and targets <= {"aten.mm.default", "aten.addmm.default"}
    assert all(position in (0, 1, 2) for position in operands.values())
    plain = capture_step(workload.train_step(), workload.model, workload.optimizer(workload.model.parameters()),
                         workload.batch)
    assert narrow_transposed_operands(plain.graph) == {}  # float32 matmuls keep what they are given
    program = lower(step.graph, replicate_plan(step.graph, Mesh((1,)), "test"), (0,))
    module = build_rank_module(program, Collectives(("unused",), (1,)), transposed=operands)
    wrapped = [node for node in module.graph.nodes if node.op == "call_function" and node.target is as_transposed]
    assert len(wrapped) == len(operands)
    inputs = step.gather_inputs(workload.model, optimizer, workload.batch)
    got = module(*inputs)
    want = execute_graph(step.graph, inputs, step.constants)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
