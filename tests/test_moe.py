"""Mixture-of-experts: the static expert dispatch (metadist.frontends.torch.moe) and the MoE built-ins."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from metadist.frontends.torch import capture_step
from metadist.frontends.torch.errors import CaptureError
from metadist.frontends.torch.moe import (
    capacity_for, group_size, is_experts_module, static_experts, static_experts_forward,
)
from metadist.ir import ExpertRouting, graph_from_json, graph_to_json
from metadist.workloads import builtin_workload

MOE_BUILTINS = ("mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny")


def first_moe_block(model: nn.Module) -> nn.Module:
    """The first module holding a router (``gate``) and an experts module."""
    for module in model.modules():
        if is_experts_module(getattr(module, "experts", None) or nn.Module()) and hasattr(module, "gate"):
            return module
    raise AssertionError("no MoE block")


def routed(block: nn.Module, tokens: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = block.experts.gate_up_proj.shape[-1]
    x = torch.randn(tokens, hidden, generator=generator).requires_grad_(True)  # (T, H)
    _, weights, index = block.gate(x)  # (T, k) each
    return x, weights, index


@pytest.mark.parametrize("name", MOE_BUILTINS)
def test_dropless_dispatch_equals_the_library_output_and_gradients(name):
    """The static formulation against transformers' own default experts path (grouped_mm), fp32."""
    block = first_moe_block(builtin_workload(name).model)
    x, weights, index = routed(block, tokens=64)
    wanted = block.experts(x, index, weights)  # the library's default implementation
    got = static_experts_forward(block.experts, x, index, weights)
    assert block.experts.config._experts_implementation == "grouped_mm"
    torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)
    probe = torch.randn_like(wanted)
    leaves = [x, block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight]
    wanted_grads = torch.autograd.grad((wanted * probe).sum(), leaves, retain_graph=True)
    got_grads = torch.autograd.grad((got * probe).sum(), leaves)
    for leaf_name, got_grad, wanted_grad in zip(("x", "gate_up_proj", "down_proj", "router"), got_grads, wanted_grads):
        torch.testing.assert_close(got_grad, wanted_grad, rtol=1e-4, atol=1e-6, msg=leaf_name)


def test_transposed_biased_interleaved_experts_equal_the_library_too():
    """GPT-OSS experts: weights stored [E, in, out], biases, interleaved gate/up with its own clamped gating."""
    import transformers

    config = transformers.GptOssConfig(vocab_size=1000, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2)
    torch.manual_seed(0)
    block = transformers.GptOssForCausalLM(config).model.layers[0].mlp
    with torch.no_grad():
        for parameter in block.experts.parameters():  # the library initialises the biases to zero
            parameter.normal_(0.0, 0.1)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    _, weights, index = block.router(x)
    wanted = block.experts(x, index, weights)
    got = static_experts_forward(block.experts, x, index, weights)
    assert block.experts.is_transposed and block.experts.has_bias
    torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)


def reference_with_capacity(experts: nn.Module, x, weights, index, group_tokens: int, capacity: int) -> torch.Tensor:
    """The stated drop rule, written as loops: within each group of ``group_tokens`` consecutive tokens,
    expert e takes the first ``capacity`` tokens routed to it (token order); later ones lose e's share only."""
    out = torch.zeros_like(x)
    for start in range(0, x.shape[0], group_tokens):
        taken = [0] * experts.num_experts
        for token in range(start, start + group_tokens):
            for pick in range(index.shape[1]):
                expert = int(index[token, pick])
                if taken[expert] == capacity:
                    continue  # dropped for this expert
                taken[expert] += 1
                gate, up = (experts.gate_up_proj[expert] @ x[token]).chunk(2)
                y = experts.down_proj[expert] @ (experts.act_fn(gate) * up)
                out[token] += weights[token, pick] * y
    return out


def test_capacity_drops_exactly_the_tokens_past_it():
    block = first_moe_block(builtin_workload("mixtral-tiny").model)
    x, weights, index = routed(block, tokens=32, seed=1)
    group_tokens = group_size(32)
    capacity = capacity_for(group_tokens, top_k=2, num_experts=4, capacity_factor=1.0)
    assert (group_tokens, capacity) == (16, 8)
    record: list[ExpertRouting] = []
    with torch.no_grad():
        got = static_experts_forward(block.experts, x, index, weights, capacity_factor=1.0, record=record)
        wanted = reference_with_capacity(block.experts, x, weights, index, group_tokens, capacity)
        dropless = static_experts_forward(block.experts, x, index, weights)
    torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, dropless), "this routing overflows a capacity of 8: some token must be dropped"
    assert record == [ExpertRouting(module="", num_experts=4, top_k=2, tokens=32, groups=2, group_tokens=16,
                                    capacity=8)]
    assert not record[0].dropless and "tokens past it dropped" in record[0].describe()


def test_group_size_and_capacity_arithmetic():
    assert [group_size(t) for t in (64, 48, 10, 17, 1)] == [16, 16, 10, 17, 1]
    assert capacity_for(16, top_k=2, num_experts=4, capacity_factor=None) == 16  # dropless
    assert capacity_for(16, top_k=2, num_experts=4, capacity_factor=1.25) == 10
    assert capacity_for(16, top_k=2, num_experts=4, capacity_factor=100.0) == 16
    with pytest.raises(CaptureError, match="capacity_factor must be positive"):
        capacity_for(16, top_k=2, num_experts=4, capacity_factor=0.0)


def capture(workload):
    optimizer = workload.optimizer(workload.model.parameters())
    return capture_step(workload.train_step(), workload.model, optimizer, workload.batch, name=workload.name)


def test_moe_step_is_captured_with_static_dispatch_and_the_experts_dim_in_bmm():
    workload = builtin_workload("deepseek-v3-tiny")
    step = capture(workload)
    routing = step.graph.routing  # MetaIR states the static dispatch
    assert [record.module for record in routing] == ["model.layers.1.mlp.experts"]  # layer 0 is dense
    assert routing[0].dropless and (routing[0].tokens, routing[0].groups) == (64, 4)
    targets = {node.op.target for node in step.graph.nodes}
    assert not targets & {"aten.nonzero.default", "aten._grouped_mm.default", "aten.index_add.default"}
    experts = [node for node in step.graph.nodes if node.op.target == "aten.bmm.default"
               and step.graph.value(node.input_names[1]).spec.shape[0] == 4]  # [E, ...] expert weights
    assert experts, "the experts run as bmm over the experts dim"
    assert graph_from_json(graph_to_json(step.graph)).routing == routing
    assert "routing model.layers.1.mlp.experts: 4 experts, top-2, 64 tokens in 4 groups of 16, dropless" in step.graph.to_text()
    experts_module = workload.model.model.layers[1].mlp.experts
    assert "forward" not in experts_module.__dict__, "the library's forward is restored after capture"


def test_capacity_factor_is_captured_and_stated_in_the_graph():
    workload = builtin_workload("qwen3-moe-tiny")
    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, expert_capacity_factor=1.0)
    assert [(record.group_tokens, record.capacity, record.dropless) for record in step.graph.routing] == [(16, 8, False)] * 2
    assert "capacity 8 of 16 per expert and group (tokens past it dropped)" in step.graph.to_text()


def test_capacity_factor_options_are_checked_and_passed_to_every_rank(capsys):
    import argparse

    from metadist.api import CompileOptions
    from metadist.cli.main import main
    from metadist.cli.run import worker_args

    for command in ("run", "plan"):
        assert main([command, "mixtral-tiny", "--nproc" if command == "run" else "--mesh", "2",
                     "--expert-capacity-factor", "0"]) == 2
        assert "--expert-capacity-factor must be positive" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expert_capacity_factor=-1.0"):
        CompileOptions(expert_capacity_factor=-1.0)
    args = argparse.Namespace(model="mixtral-tiny", steps=3, plan="solver", optimizer="adamw", seed=0, timeout_s=120.0,
                              mesh="", memory_gb=None, cluster=None, check=True, compile=None, check_shapes=False,
                              expert_capacity_factor=1.25)
    command = worker_args(args)
    assert command[command.index("--expert-capacity-factor") + 1] == "1.25"


class LoopExperts(nn.Module):
    """An MoE layer routing with data-dependent shapes (a Python loop over nonzero), which is not covered."""

    def __init__(self, hidden: int = 8, experts: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return out


def test_uncovered_router_is_one_line_naming_the_module_and_the_way_out():
    model = nn.Sequential(nn.Linear(8, 8), LoopExperts())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, optimizer, batch):
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    with pytest.raises(CaptureError) as info:
        capture_step(step, model, optimizer, torch.randn(4, 8))
    message = str(info.value)
    assert "\n" not in message
    assert "module '1' (LoopExperts)" in message
    assert "mixture-of-experts layer" in message and "@use_experts_implementation" in message


def test_experts_options_not_covered_are_refused_by_name():
    model = builtin_workload("mixtral-tiny").model
    experts = model.model.layers[0].mlp.experts
    experts.has_post_expert_norm = True
    with pytest.raises(CaptureError, match=r"'model.layers.0.mlp.experts' \(MixtralExperts\) applies a norm"):
        with static_experts(model):
            pass
    experts.has_post_expert_norm = False
    experts._is_expert_parallel = True
    with pytest.raises(CaptureError, match="already expert-parallel"):
        with static_experts(model):
            pass


def expert_weight_shardings(plan) -> dict[str, tuple[str, ...]]:
    return {name: tuple(str(placement) for placement in sharding) for name, sharding in plan.input_shardings.items()
            if name.endswith(("experts.gate_up_proj", "experts.down_proj"))}


@pytest.mark.parametrize("name,mesh,expert_parallel", [("mixtral-mini", (4,), True), ("mixtral-tiny", (2,), False)])
def test_the_ilp_chooses_expert_parallelism_where_it_wins(name, mesh, expert_parallel):
    """mixtral-mini's expert weights (8 x 3 x 128 x 512 per layer) cost more to reduce than its 128 tokens cost
    to move by all-to-all: the ILP shards the experts dim. mixtral-tiny's small experts stay data parallel."""
    import metadist
    from metadist.ir import Mesh

    plan = metadist.plan(name, Mesh(mesh), cluster="cpu-gloo")
    shardings = expert_weight_shardings(plan)
    assert len(shardings) == 4
    if expert_parallel:
        assert set(shardings.values()) == {("S(0)",)}, shardings
    else:
        assert ("S(0)",) not in set(shardings.values()), shardings


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("model,nproc,mesh,collective", [
    # the ILP's plan shards the experts dim (test_the_ilp_chooses_expert_parallelism_where_it_wins); on cpu-gloo it
    # gathers each layer's experts rather than moving its 128 tokens by all-to-all (17 all-gathers and 4 all-reduces
    # against 12 all-to-alls, 29 all-gathers and 16 reduce-scatters, 50 ms against 62 ms by the cost model)
    ("mixtral-mini", 4, "4", "all_gather"),
    ("deepseek-v3-tiny", 4, "2x2", None),  # dense first layer, grouped routing, a shared expert
])
def test_moe_trains_distributed_and_matches_one_device(model, nproc, mesh, collective):
    from test_run_matrix import assert_check_passed, run_metadist

    result = run_metadist(model, "--nproc", str(nproc), "--mesh", mesh, "--steps", "3", "--check", "--timeout-s", "120")
    assert_check_passed(result)
    if collective is not None:
        assert collective in result.stdout
