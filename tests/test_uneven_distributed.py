"""Uneven shards on gloo processes: padded collectives, empty shards, whole steps and checkpoints against one device.

A batch of 6 over 4 ranks (rows 2, 2, 2, 0: the last rank's shard is empty), hidden and class
dims that 4 does not divide, and GPT-2 with a vocabulary of 1001 split over 2 ranks (501 and
500 rows), each trained three steps under ``--check``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_runtime_support import run_distributed

pytestmark = [pytest.mark.distributed]

UNEVEN_MLP = textwrap.dedent(
    """
    import torch, metadist

    def workload():
        torch.manual_seed(0)
        # widths 250 and 1002 split unevenly over 4 ranks, and the optimizer's update of 250k weights is worth sharding
        model = torch.nn.Sequential(torch.nn.Linear(250, 1002), torch.nn.GELU(), torch.nn.Linear(1002, 7))
        batch = {"x": torch.randn(6, 250), "y": torch.randint(0, 7, (6,))}  # 6 rows: 2, 2, 2, 0 over 4 ranks
        return metadist.Workload(
            model=model, batch=batch,
            loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),  # at 1e-2 it fits the 6 rows in one step:
        )  # its gradients then vanish and AdamW's update of rounding noise is all the check would compare
    """
)

GPT2_VOCAB_1001 = textwrap.dedent(
    """
    import torch, transformers, metadist

    def workload():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1001, n_positions=64,
                                         bos_token_id=1000, eos_token_id=1000, attn_implementation="eager",
                                         use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"
        ids = torch.randint(0, 1001, (4, 16), generator=torch.Generator().manual_seed(0))
        return metadist.Workload(model=model, batch={"input_ids": ids, "labels": ids.clone()},
                                 loss_fn=lambda model, batch: model(**batch).loss,
                                 optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    """
)


def run_metadist(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def assert_check_passed(result: subprocess.CompletedProcess) -> None:
    text = result.stdout.replace("\n", " ")
    assert result.returncode == 0, result.stdout[-2500:] + result.stderr[-2500:]
    assert "check: PASS" in text, result.stdout[-2500:]
    assert "step 2: loss" in text


# ---------------------------------------------------------------- collectives on real process groups


def _reshard_session(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> dict:
    """Every sharding pair of an uneven tensor through gloo: pieces are torch.chunk's, bytes as predicted."""
    import torch

    from metadist.ir import Mesh, Partial, Replicate, Shard
    from metadist.lowering import plan_resharding
    from metadist.runtime.collectives import Collectives, run_steps
    from metadist.runtime.env import read_torchrun_env
    from metadist.runtime.setup import setup_device_mesh
    from metadist.runtime.step import shard_full_tensor

    torch.set_num_threads(1)
    mesh = Mesh(mesh_shape)
    device_mesh = setup_device_mesh(mesh, read_torchrun_env(), timeout_s=60)
    coords = tuple(device_mesh.get_coordinate())
    comm = Collectives.from_device_mesh(device_mesh)
    whole = torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape) - 9.0
    placements = [Replicate(), Shard(0), Shard(1), Partial("sum")]
    shardings = list(itertools.product(placements, repeat=mesh.ndim))
    predicted, failures, empty = 0, [], 0
    for source, target in itertools.product(shardings, repeat=2):
        piece = _source_piece(whole, source, mesh, coords)
        empty += piece.numel() == 0
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
    return {"failures": failures, "measured": measured, "predicted": predicted, "empty": empty,
            "coalesced": _coalesced_check(comm, mesh, coords)}


def _source_piece(whole, sharding, mesh, coords):
    """This rank's piece by torch.chunk (missing chunks are empty) and partial shares."""
    import torch

    from metadist.ir import Partial, Shard

    piece = whole
    for axis, placement in enumerate(sharding):
        c, k = coords[axis], mesh.shape[axis]
        if isinstance(placement, Shard):
            chunks = piece.chunk(k, dim=placement.dim)
            piece = chunks[c] if c < len(chunks) else piece.narrow(placement.dim, 0, 0)
        elif isinstance(placement, Partial):
            piece = piece * (0.25 if c < k - 1 else 1 - 0.25 * (k - 1))
    return piece.clone()


def _coalesced_check(comm, mesh, coords) -> list:
    """Uneven members of one coalesced all-gather and reduce-scatter (each on its own dim) give torch.chunk pieces."""
    import torch

    from metadist.ir import Partial, Replicate, Shard, TensorSpec
    from metadist.lowering import CoalescedReshard, plan_resharding
    from metadist.lowering.coalesce import _as_member
    from metadist.lowering.program import Reshard
    from metadist.runtime.collectives import run_coalesced
    from metadist.runtime.step import shard_full_tensor

    axis0 = lambda p: tuple(p if a == 0 else Replicate() for a in range(mesh.ndim))  # noqa: E731
    wholes = [torch.arange(35.0).reshape(7, 5), torch.arange(18.0).reshape(3, 6), torch.arange(8.0).reshape(2, 4)]
    dims = [0, 1, 0]
    failures = []
    for kind, source, target in (("all_gather", lambda d: axis0(Shard(d)), lambda d: axis0(Replicate())),
                                 ("reduce_scatter", lambda d: axis0(Partial("sum")), lambda d: axis0(Shard(d)))):
        members, inputs = [], []
        for index, (whole, dim) in enumerate(zip(wholes, dims)):
            src, dst = source(dim), target(dim)
            steps = plan_resharding(whole.shape, 4, src, dst, mesh, coords)
            spec = TensorSpec(tuple(whole.shape), "float32")
            members.append(_as_member(Reshard(f"v{index}", f"v{index}~0", spec, src, dst, steps)))
            inputs.append(_source_piece(whole, src, mesh, coords).float())
        results = run_coalesced(comm, inputs, CoalescedReshard(kind, 0, members[0].collective.op, "float32", tuple(members)))
        for whole, dim, got in zip(wholes, dims, results):
            if not torch.equal(got, shard_full_tensor(whole, target(dim), mesh.shape, coords)):
                failures.append((kind, tuple(whole.shape), dim))
    return failures


@pytest.mark.parametrize("mesh_shape,shape", [((4,), (6, 5)), ((2, 2), (5, 3))])
def test_uneven_reshards_run_on_gloo_with_empty_shards(mesh_shape, shape):
    results = run_distributed(_reshard_session, 4, mesh_shape, shape)
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:5]}"
        assert result["coalesced"] == [], f"rank {rank}: {result['coalesced']}"
        assert result["measured"] == result["predicted"], rank
    assert any(result["empty"] for result in results)  # some rank held an empty piece


# ---------------------------------------------------------------- whole steps under --check


@pytest.mark.parametrize("nproc,mesh", [(4, "4"), (2, "2"), (4, "2x2")])
def test_a_batch_and_dims_the_mesh_does_not_divide_pass_check(tmp_path, nproc, mesh):
    model = tmp_path / "uneven_mlp.py"
    model.write_text(UNEVEN_MLP)
    result = run_metadist(str(model), "--nproc", str(nproc), "--mesh", mesh, "--check", "--timeout-s", "120")
    assert_check_passed(result)


def test_the_solver_plans_the_uneven_batch_and_state(tmp_path):
    import metadist
    from metadist.api import capture_and_discover
    from metadist.ir import Mesh
    from metadist.lowering import is_even
    from metadist.workloads.loader import load_workload

    path = tmp_path / "uneven_mlp.py"
    path.write_text(UNEVEN_MLP)
    graph, _ = capture_and_discover(load_workload(str(path)))
    plan = metadist.plan(str(path), Mesh((4,)), cluster="cpu-gloo")
    specs = {gi.value.name: gi.value.spec for gi in graph.inputs}
    uneven = sorted(name for name, sharding in plan.input_shardings.items() if not is_even(specs[name].shape, sharding, plan.mesh))
    # which inputs go uneven is the cost model's call (the batch on one version, optimizer state on another);
    # that some do, with uneven node strategies in the plan, is the point
    assert uneven and plan.solver["uneven_strategies"] > 0, uneven


GPT2_HEADS_6 = GPT2_VOCAB_1001.replace("n_embd=64, n_head=4", "n_embd=48, n_head=6").replace(
    "use_cache=False)", "use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)")


def _forced_plan(path: str, out: str, size: int, nproc: int, rows_of: str | None = None) -> list[str]:
    """The solver's plan on ``nproc`` ranks, with every (non-random) node that has a factor of ``size`` split along it.

    ``rows_of``: graph inputs named so (and their optimizer states) start with dim 0 split.
    The plan is made for the step with gradient outputs, the graph ``metadist run --check`` captures, so that the
    check compares the gradients too: their largest difference sets the noise floor below which a parameter's
    update is rounding noise amplified by AdamW (GPT-2's key biases have a gradient of exactly zero in exact
    arithmetic), excused as ``metadist/runtime/check.py`` documents. A plan for the step without gradients compares
    no gradients, has no noise floor, and holds those elements to the tolerance, which they meet only by chance.
    """
    from dataclasses import replace

    from metadist.cost.cluster import resolve_cluster
    from metadist.frontends.torch.discovery import TorchExecutor
    from metadist.frontends.torch.repeat import capture_repeated
    from metadist.ir import Concat, Mesh, Shard
    from metadist.ir.plan import AxisChoice, strategy_from_choices
    from metadist.shardcombine.api import rules_from_database
    from metadist.solver import plan_graph
    from metadist.solver.problem import Restrictions
    from metadist.workloads.loader import load_workload

    workload = load_workload(path)
    graph = capture_repeated(workload.train_step(), workload.model, workload.optimizer(workload.model.parameters()),
                             workload.batch, name=workload.name or "step", keep_grads=True)
    rules = rules_from_database(graph, TorchExecutor(), None)
    mesh = Mesh((nproc,))
    rows = {gi.value.name: frozenset({(Shard(0),)}) for gi in graph.inputs
            if rows_of and gi.value.name.startswith(rows_of) and gi.value.spec.rank == 2}
    plan = plan_graph(graph, rules, resolve_cluster("cpu-gloo", mesh), restrictions=Restrictions(rows))
    strategies, forced = dict(plan.node_strategies), []
    for node in graph.nodes:
        rule = rules.rules.get(node.name)
        if rule is None or node.op.is_random:
            continue
        shapes = [graph.value(name).spec.shape for name in node.input_names]
        outs = [None if value is None else value.spec.shape for value in node.outputs]
        for index, factor in enumerate(rule.factors):
            sizes = {shapes[i][d] for i, d in enumerate(factor.inputs) if d is not None}
            sizes |= {outs[i][c.dim] for i, c in enumerate(factor.outputs) if isinstance(c, Concat) and outs[i] is not None}
            if sizes == {size} and not factor.halo:
                strategies[node.name] = strategy_from_choices(rule, (AxisChoice("factor", index),))
                forced.append(node.op.target)
                break
    with open(out, "w") as handle:
        handle.write(replace(plan, node_strategies=strategies).to_json())
    return forced


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_gpt2_with_a_vocabulary_of_1001_split_over_the_ranks_passes_check(tmp_path, nproc):
    model, plan_file = tmp_path / "gpt2_vocab_1001.py", tmp_path / "plan.json"
    model.write_text(GPT2_VOCAB_1001)
    forced = _forced_plan(str(model), str(plan_file), 1001, nproc, rows_of="transformer.wte.weight")
    # the logits matmul and its two backward matmuls split the 1001 rows (501, 500 on 2 ranks; 251, 251, 251, 248 on 4)
    assert forced.count("aten.mm.default") == 3, forced
    assert json.loads(plan_file.read_text())["input_shardings"]["transformer.wte.weight"] == "(S(0))"
    result = run_metadist(str(model), "--nproc", str(nproc), "--plan", str(plan_file), "--check", "--timeout-s", "120")
    assert_check_passed(result)
    assert "without gradient outputs" not in result.stdout  # the gradients were compared (see _forced_plan)


@pytest.mark.slow
def test_six_heads_over_four_ranks_with_an_empty_rank_pass_check(tmp_path):
    model, plan_file = tmp_path / "gpt2_heads_6.py", tmp_path / "plan.json"
    model.write_text(GPT2_HEADS_6)
    forced = _forced_plan(str(model), str(plan_file), 6, 4)  # heads 2, 2, 2, 0: rank 3 runs attention on no heads
    assert {"aten._softmax.default", "aten._softmax_backward_data.default"} <= set(forced), forced
    result = run_metadist(str(model), "--nproc", "4", "--plan", str(plan_file), "--check", "--timeout-s", "120")
    assert_check_passed(result)
    assert "without gradient outputs" not in result.stdout  # the gradients were compared (see _forced_plan)


# ---------------------------------------------------------------- DTensors and DCP checkpoints of uneven shards

CHECKPOINT_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    import metadist
    from metadist.workloads.loader import load_workload

    MODEL, CKPT = sys.argv[1], sys.argv[2]
    workload = load_workload(MODEL)
    model, optimizer = workload.model, workload.optimizer(workload.model.parameters())
    train_step = workload.train_step()
    step = metadist.compile(train_step, mesh=(4,), plan="solver", cluster="cpu-gloo")
    for _ in range(2):
        step(model, optimizer, workload.batch)
    shards, full = step.sharded_state_dict(), step.state_dict()
    uneven = 0
    for name, tensor in shards.items():
        if name.endswith(":step"):  # the optimizer's step count: 0-dim, replicated, plain as torch keeps it
            assert not isinstance(tensor, DTensor) and torch.equal(tensor, full[name]), name
            continue
        assert isinstance(tensor, DTensor) and tuple(tensor.shape) == tuple(full[name].shape), name
        for placement, size in zip(tensor.placements, tensor.device_mesh.shape):
            if isinstance(placement, Shard) and tensor.shape[placement.dim] % size:
                uneven += 1
        assert torch.equal(tensor.full_tensor(), full[name]), f"{name}: DTensor of uneven shards differs"
    assert uneven >= 2, f"the plan should shard some state unevenly, got {uneven}"
    step.save(CKPT)
    torch.manual_seed(5)
    loss = step(model, optimizer, workload.batch).item()
    after = step.state_dict()

    other = load_workload(MODEL)
    other_optimizer = other.optimizer(other.model.parameters())
    resumed = metadist.compile(train_step, mesh=(4,), plan="replicate")
    resumed.prepare(other.model, other_optimizer, other.batch)
    resumed.load(CKPT)
    torch.manual_seed(5)
    loss_b = resumed(other.model, other_optimizer, other.batch).item()
    assert abs(loss - loss_b) <= 1e-5 * abs(loss), (loss, loss_b)
    worst = max((after[k] - v).abs().max().item() for k, v in resumed.state_dict().items())
    assert worst < 1e-5, worst
    if dist.get_rank() == 0:
        print(f"UNEVEN-CKPT-OK uneven={uneven} loss={loss:.6f} resumed={loss_b:.6f} max state diff {worst:.1e}")
    dist.destroy_process_group()
    from metadist.runtime.setup import exit_process
    exit_process(0)
    """
)


def test_uneven_shards_are_dtensors_and_a_checkpoint_resumes_under_another_plan(tmp_path):
    model, script = tmp_path / "uneven_mlp.py", tmp_path / "train.py"
    model.write_text(UNEVEN_MLP)
    script.write_text(CHECKPOINT_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script), str(model),
         str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "UNEVEN-CKPT-OK" in result.stdout
