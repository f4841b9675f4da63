"""What torch's FSDP2 and TP run per step beyond the model's compute, counted on the model (:mod:`metadist.bench.torch_counts`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from metadist.bench.baselines import local_batch, shard_units
from metadist.bench.torch_counts import eager_optimizer_ops, module_ops, tensor_parallel_counts
from metadist.bench.tp_plans import megatron_plan
from metadist.solver.baselines import fsdp_unit_bytes
from metadist.workload import Workload


def _workload(model: nn.Module, optimizer, batch: dict, loss_fn) -> Workload:
    return Workload(name="counted", model=model, optimizer=optimizer, batch=batch, loss_fn=loss_fn)


class _Embedded(nn.Module):
    """An embedding (so the first parallel linear's input needs a gradient), then fc1 -> relu -> fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.embed(ids))))


def test_the_eager_optimizer_ops_are_counted_per_parameter_on_meta_copies():
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(2), requires_grad=False)]
    before = [p.detach().clone() for p in params]
    unused = nn.Linear(1, 1)

    def loss(model, batch):
        return model(batch)

    adamw = _workload(unused, lambda ps: torch.optim.AdamW(ps, lr=1e-3), {}, loss)
    sgd = _workload(unused, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}, loss)
    plain_sgd = _workload(unused, lambda ps: torch.optim.SGD(ps, lr=0.1), {}, loss)
    # torch's single-tensor AdamW: mul_ (weight decay), lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_ per parameter;
    # its step counters are CPU tensors and not counted; a frozen parameter has no step
    assert eager_optimizer_ops(adamw, params) == 2 * 8
    assert eager_optimizer_ops(adamw, params[:1]) == 8
    assert eager_optimizer_ops(sgd, params) == 2 * eager_optimizer_ops(sgd, params[1:2]) > eager_optimizer_ops(plain_sgd, params)
    assert eager_optimizer_ops(adamw, []) == 0
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and all(p.grad is None for p in params)


def test_a_modules_forward_and_backward_ops_are_counted_on_a_meta_copy():
    linear = nn.Linear(16, 32)
    with_grad = module_ops(linear, (2, 5, 16), torch.float32, True)
    without = module_ops(linear, (2, 5, 16), torch.float32, False)
    assert with_grad > without > 0  # the input's gradient is one matmul more
    assert linear.weight.device.type == "cpu" and linear.weight.grad is None


def test_tp_counts_the_activation_all_reduces_the_modules_ops_and_the_local_units():
    """The all-reduces torch's TP makes: each row-wise output (forward), each column-wise input that needs a gradient
    (backward); the bytes from one forward of the model; FSDP2's units of the parameters as TP splits them."""
    torch.manual_seed(0)
    model = _Embedded()
    batch = {"ids": torch.randint(0, 50, (4, 6))}
    workload = _workload(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), batch, lambda m, b: m(b["ids"]).sum())
    plan = megatron_plan(nn.ModuleDict({"fc1": model.fc1, "fc2": model.fc2}), "mlp", 2)
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    counts = tensor_parallel_counts(workload, model, plan, 2, batch, [model.fc1, model], with_fsdp=False)
    # fc2's output (4x6x16 floats) forward; fc1's input (the embedding's output, 4x6x16) backward
    assert counts.activation_reduces == (4 * 6 * 16 * 4.0, 4 * 6 * 16 * 4.0)
    assert counts.module_dtensor_ops == module_ops(model.fc1, (4, 6, 16), torch.float32, True) + \
        module_ops(model.fc2, (4, 6, 32), torch.float32, True)
    assert counts.optimizer_dtensor_ops == 4 * 8  # TP alone: only the parallel modules' parameters are DTensors
    # fc1 column-wise: weight (32, 16) -> (16, 16), bias (16,); fc2 row-wise: weight (16, 32) -> (16, 16), bias whole
    assert counts.local_units == ((((16, 16), 4), ((16,), 4)), (((50, 16), 4), ((16, 16), 4), ((16,), 4)))
    assert fsdp_unit_bytes(counts.local_units, 2) == [16 * 17 * 4.0, (50 * 16 + 16 * 17) * 4.0]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()) and torch.equal(torch.get_rng_state(), rng)
    with_fsdp = tensor_parallel_counts(workload, model, plan, 2, batch, [model.fc1, model], with_fsdp=True)
    assert with_fsdp.optimizer_dtensor_ops == 5 * 8  # FSDP2 makes every parameter a DTensor
    # an input that needs no gradient: no backward all-reduce
    holder = nn.Module()
    holder.fc1, holder.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
    direct = _workload(holder, lambda ps: torch.optim.SGD(ps, lr=0.1), {"x": torch.randn(3, 16)},
                       lambda m, b: m.fc2(torch.relu(m.fc1(b["x"]))).sum())
    counts = tensor_parallel_counts(direct, holder, megatron_plan(holder, "mlp", 2), 2, direct.batch, [holder], with_fsdp=False)
    assert counts.activation_reduces == (3 * 16 * 4.0,)
    with pytest.raises(ValueError, match="lacks: nope"):
        tensor_parallel_counts(direct, holder, {"nope": plan["fc1"]}, 2, direct.batch, [holder], with_fsdp=False)


def test_tp_counts_on_gpt2_match_what_the_bench_measured_of_torchs_tp():
    """gpt2-tiny's Megatron plan on a 2x2 mesh: the bench measured 8 all-reduces of 8 KiB and FSDP2 gathering
    523,520 bytes (docs/bench/results/gpt2-tiny-4proc.json, tp-dp); GPT-2's Conv1D counted as the Linear TP runs."""
    from metadist.workloads.loader import load_workload

    workload = load_workload("gpt2-tiny")
    model = copy.deepcopy(workload.model)
    plan = megatron_plan(model, workload.extras["family"], 2)
    counts = tensor_parallel_counts(workload, model, plan, 2, local_batch(workload.batch, 2, 0),
                                    [*shard_units(model), model], with_fsdp=True)
    assert counts.activation_reduces == (8192.0,) * 8
    assert sum(fsdp_unit_bytes(counts.local_units, 2)) == 523520
    assert counts.optimizer_dtensor_ops == 8 * len(list(model.parameters()))


def test_a_model_without_a_tp_plan_gets_a_prediction_that_says_why():
    from metadist.bench.baselines import RankContext
    from metadist.bench.metadist_method import _torch_tp_priced

    model = nn.Sequential(nn.Conv2d(1, 2, 3))
    workload = Workload(name="cnn", model=model, batch={"x": torch.randn(2, 1, 4, 4)}, loss_fn=lambda m, b: m(b["x"]).sum(),
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), extras={"family": "cnn"})
    ctx = RankContext(rank=0, world_size=4, device=torch.device("cpu"), mesh_shape=(2, 2))
    why = _torch_tp_priced(workload, ctx, model, graph=None, cluster=None, plan=None)
    assert isinstance(why, str) and "no Megatron-style plan for the 'cnn' family" in why
