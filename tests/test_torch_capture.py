"""The PyTorch frontend: one functional graph per train step that reproduces the eager step exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import metadist
from metadist.frontends.torch import CaptureError, capture_step
from metadist.ir import Role, graph_from_json, graph_to_json
from metadist.workloads import builtin_workload

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def train_step(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def assert_same_as_eager(workload, steps: int = 3, exact: bool = True):
    """Eager steps and graph steps from the same start, same seeds: bit-identical results (``exact``), or
    equal to rounding (rtol 1e-6, atol 1e-7: a reduction may sum in another order)."""

    def same(graph, eager, what):
        if exact:
            diff = (eager.double() - graph.double()).abs().max().item()
            assert torch.equal(eager, graph), f"{what} differs, largest difference {diff:.3g}"
        else:
            torch.testing.assert_close(graph, eager, rtol=1e-6, atol=1e-7, msg=what)

    step = workload.train_step()
    eager_model, graph_model = workload.model, copy.deepcopy(workload.model)
    eager_opt = workload.optimizer(eager_model.parameters())
    graph_opt = workload.optimizer(graph_model.parameters())
    captured = capture_step(step, graph_model, graph_opt, workload.batch)
    for index in range(steps):
        torch.manual_seed(100 + index)
        eager_loss = step(eager_model, eager_opt, workload.batch)
        torch.manual_seed(100 + index)
        graph_loss = captured.run(graph_model, graph_opt, workload.batch)
        same(graph_loss, eager_loss, f"step {index}: loss {eager_loss.item()} vs {graph_loss.item()}")
    for (name, eager), graph in zip(eager_model.state_dict().items(), graph_model.state_dict().values()):
        same(graph, eager, f"{name} after {steps} steps")
    for eager_param, graph_param in zip(eager_model.parameters(), graph_model.parameters()):
        eager_state, graph_state = eager_opt.state[eager_param], graph_opt.state[graph_param]
        assert eager_state.keys() == graph_state.keys()
        for key in eager_state:
            same(graph_state[key], eager_state[key], f"optimizer state {key}")
    return captured


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_builtin_step_reproduces_eager_exactly_adamw(name):
    assert_same_as_eager(builtin_workload(name, optimizer="adamw"))


@pytest.mark.parametrize("name,optimizer", [("mlp", "sgd"), ("cnn", "sgd"), ("gpt2-tiny", "adam"), ("cnn", "adam")])
def test_builtin_step_reproduces_eager_exactly_other_optimizers(name, optimizer):
    assert_same_as_eager(builtin_workload(name, optimizer=optimizer))


OPTIMIZER_VARIANTS = {
    "sgd-plain": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
    "sgd-maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, maximize=True),
    "adam-wd-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.95), foreach=True),
    "adamw-maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, maximize=True, eps=1e-6),
    "adamw-groups": lambda p: torch.optim.AdamW(
        [{"params": (params := list(p))[:2], "lr": 1e-3, "weight_decay": 0.0}, {"params": params[2:]}], lr=1e-2
    ),
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 12)
        self.drop = torch.nn.Dropout(0.25)
        self.norm = torch.nn.BatchNorm1d(12)
        self.fc2 = torch.nn.Linear(12, 3)

    def forward(self, x):  # (B, 6) -> (B, 3)
        return self.fc2(torch.relu(self.norm(self.drop(self.fc1(x)))))


def net_workload(optimizer):
    torch.manual_seed(0)
    model = Net()
    batch = {"x": torch.randn(9, 6), "y": torch.randn(9, 3)}
    return metadist.Workload(
        model=model, batch=batch, optimizer=optimizer,
        loss_fn=lambda model, batch: torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]),
    )


@pytest.mark.parametrize("variant", sorted(OPTIMIZER_VARIANTS))
def test_functional_optimizers_match_torch_eager_bit_for_bit(variant):
    assert_same_as_eager(net_workload(OPTIMIZER_VARIANTS[variant]))


def test_graph_is_one_functional_graph_with_roles_and_links():
    workload = builtin_workload("gpt2-tiny")
    optimizer = workload.optimizer(workload.model.parameters())
    captured = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, keep_grads=True)
    graph = captured.graph
    targets = {node.op.target for node in graph.nodes}
    assert not [t for t in targets if t.split(".")[1].endswith("_")], "in-place ops left in the graph"
    assert "aten.mm.default" in targets and "aten.embedding_dense_backward.default" in targets  # backward is in
    assert "aten.lerp.Tensor" in targets  # the AdamW update is in, its weight (1 - beta1) a live input
    hyper = {graph_input.source for graph_input in graph.inputs_by_role(Role.HYPERPARAMETER)}
    assert hyper == {"0.lr", "0.beta1", "0.beta2", "0.eps", "0.weight_decay"}
    # tied weights: lm_head.weight is transformer.wte.weight, one parameter
    params = {graph_input.source for graph_input in graph.inputs_by_role(Role.PARAM)}
    assert "transformer.wte.weight" in params and "lm_head.weight" not in params
    assert len(params) == len(list(workload.model.parameters()))
    # every parameter and optimizer state is replaced by exactly one output
    replaced = [out.replaces for out in graph.outputs if out.replaces]
    state_inputs = [i.value.name for i in graph.inputs if i.role in (Role.PARAM, Role.OPTIM_STATE)]
    assert sorted(replaced) == sorted(state_inputs)
    assert [out.role for out in graph.outputs].count(Role.LOSS) == 1
    assert len(graph.outputs_by_role(Role.GRAD)) == len(params)
    # dropout is a random op in the graph, not a baked-in mask
    random_nodes = [node for node in graph.nodes if node.op.is_random]
    assert random_nodes and all(node.op.target == "aten.bernoulli.p" for node in random_nodes)
    # the batch is a graph input with its role
    assert {i.source for i in graph.inputs_by_role(Role.BATCH)} == {".input_ids", ".labels"}


def test_buffers_updated_in_place_become_state_outputs():
    workload = builtin_workload("cnn")
    optimizer = workload.optimizer(workload.model.parameters())
    graph = capture_step(workload.train_step(), workload.model, optimizer, workload.batch).graph
    buffers = {i.value.name for i in graph.inputs_by_role(Role.BUFFER)}
    assert any(name.endswith("running_mean") for name in buffers)
    assert buffers == {out.replaces for out in graph.outputs_by_role(Role.BUFFER)}


def test_capture_changes_nothing_of_the_users_objects():
    workload = builtin_workload("mlp")
    before = copy.deepcopy(workload.model.state_dict())
    optimizer = workload.optimizer(workload.model.parameters())
    capture_step(workload.train_step(), workload.model, optimizer, workload.batch)
    assert all(torch.equal(before[k], v) for k, v in workload.model.state_dict().items())
    assert len(optimizer.state) == 0
    assert "step" not in optimizer.__dict__ and "zero_grad" not in optimizer.__dict__


def test_graph_json_round_trip_for_a_real_step():
    workload = builtin_workload("llama-tiny")
    optimizer = workload.optimizer(workload.model.parameters())
    graph = capture_step(workload.train_step(), workload.model, optimizer, workload.batch).graph
    again = graph_from_json(graph_to_json(graph))
    assert again == graph and again.to_text() == graph.to_text()


def test_meta_models_capture_with_fake_tensors_and_refuse_to_run():
    workload = builtin_workload("gpt2-small", batch_size=2, seq_len=64)
    optimizer = workload.optimizer(workload.model.parameters())
    captured = capture_step(workload.train_step(), workload.model, optimizer, workload.batch)
    assert 120e6 < captured.graph.parameter_count() < 130e6
    with pytest.raises(CaptureError, match="meta device"):
        captured.gather_inputs(workload.model, optimizer, workload.batch)


# -- bad input -------------------------------------------------------------------


def simple():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": torch.randn(3, 4)}


def test_data_dependent_control_flow_is_a_clear_error():
    model, optimizer, batch = simple()

    def step(model, optimizer, batch):
        loss = model(batch["x"]).sum()
        if loss > 0:  # a Python decision on a tensor's value
            loss = loss * 2
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(CaptureError, match="data-dependent") as info:
        capture_step(step, model, optimizer, batch)
    assert "test_torch_capture.py" in str(info.value)  # points at the user's line


@pytest.mark.parametrize("draw", ["numpy", "python"])
def test_host_random_numbers_in_the_step_are_a_clear_error(draw):
    """numpy's or Python's global generator drawn while tracing would be frozen into constants: refused.

    (Wav2Vec2's SpecAugment draws its time masks with np.random; captured, every step would mask the same
    positions, silently.)"""
    import random

    import numpy as np

    model, optimizer, batch = simple()

    def step(model, optimizer, batch):
        keep = np.random.rand(3) > 0.5 if draw == "numpy" else [random.random() > 0.5 for _ in range(3)]
        loss = (model(batch["x"]) * torch.tensor(keep, dtype=torch.float32)[:, None]).sum()
        loss.backward()
        optimizer.step()
        return loss

    name = "numpy's `np.random`" if draw == "numpy" else "Python's `random`"
    with pytest.raises(CaptureError, match=f"draws random numbers from {name}.*constants.*torch.rand"):
        capture_step(step, model, optimizer, batch)
    # a step that only reads them (seeded outside, passed in) captures
    captured = capture_step(lambda m, o, b: m(b["x"]).sum(), model, optimizer, batch)
    assert captured.graph.nodes


def test_data_dependent_error_in_generated_code_points_at_the_caller():
    """A data-dependent op under a frame of generated code (`<string>`) names the caller's line, not `<string>`."""
    model, optimizer, batch = simple()
    namespace = {}
    exec("def decide(loss):\n    return bool(loss > 0)\n", namespace)  # a frame whose file is <string>

    def step(model, optimizer, batch):
        loss = model(batch["x"]).sum()
        loss = loss * 2 if namespace["decide"](loss) else loss  # this line is named
        loss.backward()
        return loss

    with pytest.raises(CaptureError, match="data-dependent") as info:
        capture_step(step, model, optimizer, batch)
    assert "<string>" not in str(info.value)
    assert "test_torch_capture.py" in str(info.value) and "namespace[\"decide\"](loss)" in str(info.value)


def test_batch_that_is_not_tensors_is_a_clear_error():
    model, optimizer, _ = simple()
    with pytest.raises(CaptureError, match=r"batch holds a int at batch\['n'\]"):
        capture_step(lambda m, o, b: m(b["x"]).sum(), model, optimizer, {"x": torch.randn(3, 4), "n": 3})


def test_unsupported_optimizer_is_a_clear_error():
    model, _, batch = simple()
    with pytest.raises(CaptureError, match="cannot be captured.*SGD, torch.optim.Adam"):
        capture_step(lambda m, o, b: m(b["x"]).sum(), model, torch.optim.RMSprop(model.parameters()), batch)
    with pytest.raises(CaptureError, match="fused=True"):
        capture_step(lambda m, o, b: m(b["x"]).sum(), model, torch.optim.Adam(model.parameters(), fused=True), batch)


def test_non_module_model_and_stale_gradients_are_clear_errors():
    model, optimizer, batch = simple()
    with pytest.raises(CaptureError, match="torch.nn.Module"):
        capture_step(lambda m, o, b: None, object(), optimizer, batch)
    model(batch["x"]).sum().backward()
    with pytest.raises(CaptureError, match="already holds a gradient"):
        capture_step(lambda m, o, b: m(b["x"]).sum(), model, optimizer, batch)


def test_user_exception_points_at_user_code():
    model, optimizer, batch = simple()

    def step(model, optimizer, batch):
        return model(batch["x"].t()).sum()  # wrong shape

    with pytest.raises(CaptureError, match="failed while being traced.*test_torch_capture.py") as info:
        capture_step(step, model, optimizer, batch)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_step_returning_non_tensor_is_a_clear_error():
    model, optimizer, batch = simple()
    with pytest.raises(CaptureError, match="may return tensors only"):
        capture_step(lambda m, o, b: (m(b["x"]).sum(), "done"), model, optimizer, batch)


def test_public_api_capture_returns_the_graph():
    model, optimizer, batch = simple()
    graph = metadist.capture(lambda m, o, b: m(b["x"]).sum(), model, optimizer, batch)
    assert isinstance(graph, metadist.Graph)
    assert graph.outputs[0].role is Role.LOSS


class StrideTrap(torch.nn.Module):
    """GroupNorm after a transpose: fake tensors call the gradient reaching GroupNorm's backward
    contiguous while the real one is not, and native_group_norm_backward on CPU is wrong for a
    non-contiguous gradient. The captured graph must still match eager exactly."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, kernel_size=3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):  # (B, 4, L)
        h = torch.nn.functional.softplus(self.norm(self.conv(x))).transpose(1, 2)  # (B, L, 8)
        h = h + self.proj(h)
        return torch.cumsum(h, dim=1).amax(dim=1)  # (B, 8)


def test_real_layouts_follow_the_traced_layouts():
    torch.manual_seed(0)
    workload = metadist.Workload(
        model=StrideTrap(), batch={"x": torch.randn(8, 4, 12), "y": torch.randn(8, 8)},
        loss_fn=lambda model, batch: torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    assert_same_as_eager(workload)


class TransposedExperts(torch.nn.Module):
    """Experts as one 3-D weight read transposed by a batched matmul, as Mixtral's are: autograd's bmm backward gives
    the weight's gradient in the transposed layout, and eagerly AccumulateGrad copies it into the weight's (the
    gradient layout contract) before the optimizer reads it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 24, 16) / 4)  # (experts, out, in)

    def forward(self, x):  # (experts, tokens, in)
        return torch.bmm(x, self.weight.transpose(1, 2)).tanh().sum()


def test_a_gradient_the_backward_lays_out_transposed_reaches_the_update_in_its_parameters_layout():
    """MetaIR keeps the layout contract's copy as a clone into the contiguous format (the fresh tensor it copied into
    left out), so the optimizer's elementwise ops read a dense operand, as eagerly (on Mixtral's experts a transposed
    operand made AdamW's lerp and addcmul 5-12x slower), and the cost model prices the copy as a relayout, with the
    same results as eager."""
    from metadist.cost.compute import node_work
    torch.manual_seed(0)
    workload = metadist.Workload(
        model=TransposedExperts(), batch={"x": torch.randn(4, 10, 16)},
        loss_fn=lambda model, batch: model(batch["x"]),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    model = copy.deepcopy(workload.model)
    step = capture_step(workload.train_step(), model, workload.optimizer(model.parameters()), workload.batch)
    graph = step.graph
    lerps = [node for node in graph.nodes if node.op.target == "aten.lerp.Tensor"]
    assert len(lerps) == 1  # AdamW's first moment: lerp(exp_avg, grad, 1 - beta1)
    grad = lerps[0].input_names[1]
    relayout = graph.producer(grad)
    assert relayout.op.target == "aten.clone.default"  # the gradient as its parameter lays out, read by the update
    assert dict(relayout.kwargs)["memory_format"].value == "contiguous_format"
    assert graph.producer(relayout.input_names[0]).op.target == "aten.transpose.int"  # of the backward's layout
    assert node_work(graph, relayout).relayout  # priced as the transposed copy it is
    assert grad in step.contiguous_values
    assert not [node for node in graph.nodes if "empty" in node.op.target]  # the tensor it copied into: unread, gone
    assert_same_as_eager(workload)


def test_boolean_mask_assignment_is_captured_and_matches_eager():
    """`x[mask] = value` (a parameter, a scalar): eagerly its backward gathers grad[mask], a data-dependent shape;
    captured as a where, with the same loss, gradients and update as eager (Wav2Vec2 masks frames this way)."""

    class Masker(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 6)
            self.fill = torch.nn.Parameter(torch.randn(6))  # like Wav2Vec2's masked_spec_embed

        def forward(self, x, mask, pad):
            hidden = self.proj(x)  # (B, T, 6)
            hidden[mask] = self.fill  # masked positions take the learned vector
            hidden[pad] = 0.0  # padded positions are zeroed
            scores = hidden.sum(-1)  # (B, T)
            scores[(scores > 0.5,)] = 0.5  # a mask computed in the step, as a 1-tuple index
            return scores.pow(2).mean()

    torch.manual_seed(0)
    model = Masker()
    batch = {"x": torch.randn(3, 5, 6), "mask": torch.rand(3, 5) < 0.4, "pad": torch.rand(3, 5) < 0.2}
    workload = metadist.Workload(model=model, batch=batch, loss_fn=lambda m, b: m(**b),
                                 optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    captured = assert_same_as_eager_close(workload)
    targets = {node.op.target for node in captured.graph.nodes}
    assert not any("nonzero" in target or "index_put" in target for target in targets), targets


def test_other_indexed_assignments_are_left_to_torch():
    from metadist.frontends.torch.masked_assignment import as_where

    x = torch.zeros(3, 4)
    assert not as_where(x, torch.tensor([0, 2]), 1.0)  # integer index
    assert not as_where(x, torch.ones(4, dtype=torch.bool), 1.0)  # a mask over a trailing dim
    assert not as_where(x, torch.ones(3, dtype=torch.bool), torch.ones(2, 4))  # one value per masked row
    assert not as_where(x, torch.ones(3, 4, dtype=torch.bool), "text")
    assert torch.equal(x, torch.zeros(3, 4))
    mask = torch.tensor([True, False, True])
    assert as_where(x, mask, torch.arange(4.0))
    assert torch.equal(x, torch.stack([torch.arange(4.0), torch.zeros(4), torch.arange(4.0)]))


def assert_same_as_eager_close(workload, steps: int = 3):
    """Eager steps and graph steps agree to rounding (a reduction may sum in another order)."""
    return assert_same_as_eager(workload, steps, exact=False)


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):  # (B, 4) -> (B, 4)
        h = self.fc(x)
        if h.sum() > 0:  # a Python decision on a value: not capturable
            return h * 2
        return h


def _plain_step(model, optimizer, batch):
    loss = model(batch["x"]).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_step_that_cannot_be_captured_names_the_line_the_module_and_the_way_out():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Branchy())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError) as caught:
        capture_step(_plain_step, model, optimizer, {"x": torch.randn(2, 4)})
    message = str(caught.value)
    assert "test_torch_capture.py" in message and "if h.sum() > 0" in message
    assert "in module '1' (_Branchy)" in message and "torch.where" in message


def test_an_op_without_a_fake_kernel_is_named_with_the_way_out():
    library = torch.library.Library("metadist_test_nofake", "DEF")
    library.define("double(Tensor x) -> Tensor")
    library.impl("double", lambda x: x * 2, "CPU")

    class Doubler(torch.nn.Module):
        def forward(self, x):
            return torch.ops.metadist_test_nofake.double(x)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Doubler())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError) as caught:
        capture_step(_plain_step, model, optimizer, {"x": torch.randn(2, 4)})
    message = str(caught.value)
    assert "metadist_test_nofake.double" in message and "no fake (meta) kernel" in message, message
    assert "in module '1' (Doubler)" in message and "register_fake" in message, message


@pytest.mark.parametrize("weighted", [False, True])
def test_a_mean_cross_entropy_counts_its_targets_from_the_targets_and_matches_eager_exactly(weighted):
    """The mean ``nll_loss`` is captured as its sum over the total weight. Without class weights the total weight is
    the count of targets not ignored, taken from the targets themselves (a plan can count them where the batch is
    whole, with no all-reduce in the middle of the step); with class weights it stays the op's own output. Both give
    the eager step's loss, gradients and update bit for bit, ignored targets included."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    model.criterion = torch.nn.CrossEntropyLoss(  # the class weights: a buffer of the model
        weight=torch.tensor([1.0, 0.5, 2.0, 1.5, 0.25]) if weighted else None, ignore_index=-100)

    def step(model, optimizer, batch):
        loss = model.criterion(model.net(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    batch = {"x": torch.randn(12, 8), "y": torch.tensor([0, 1, -100, 3, 4, -100, 2, 2, 1, 0, -100, 3])}
    eager_model, graph_model = model, copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=0.1)
    graph_opt = torch.optim.AdamW(graph_model.parameters(), lr=0.1)
    captured = capture_step(step, graph_model, graph_opt, batch)
    graph = captured.graph
    backward = next(node for node in graph.nodes if node.op.target == "aten.nll_loss_backward.default")
    count = graph.producer(backward.input_names[-1])
    while count.op.target == "aten._to_copy.default":
        count = graph.producer(count.input_names[0])
    assert count.op.target == ("aten.nll_loss_forward.default" if weighted else "aten.sum.default")
    if not weighted:
        assert graph.producer(count.input_names[0]).op.target == "aten.ne.Scalar"
    # a pipeline weights each microbatch by that count: it is still found (class weights: none, as before)
    assert (captured.loss_divisor is None) == weighted
    for _ in range(3):
        eager_loss = step(eager_model, eager_opt, batch)
        graph_loss = captured.run(graph_model, graph_opt, batch)
        assert torch.equal(graph_loss, eager_loss)
    for eager, graph_param in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(graph_param, eager)


def _functional_as_is(f, *tensors):
    """``capture._functional_as_is`` on the make_fx trace of ``f`` (fake tensors), with its fake mode."""
    import importlib

    from torch.fx.experimental.proxy_tensor import make_fx

    capture_module = importlib.import_module("metadist.frontends.torch.capture")
    traced = make_fx(f, tracing_mode="fake")(*tensors)
    fake_mode = next(node.meta["val"].fake_mode for node in traced.graph.nodes if node.op == "placeholder")
    return traced, capture_module._functional_as_is(traced, fake_mode)


def test_writes_into_inputs_are_made_functional_without_a_retrace_and_anything_else_keeps_it():
    def writes(p, q, x):  # reads before the writes, writes in another order than the inputs'
        total = p.sum() + q.t().sum()
        q.copy_(x.t() * 3)
        p.copy_(x * 2)
        return total

    p, q, x = torch.randn(3, 4), torch.randn(4, 3), torch.randn(3, 4)
    traced, as_is = _functional_as_is(writes, p, q, x)
    assert as_is is traced
    calls = [node for node in as_is.graph.nodes if node.op == "call_function"]
    inputs = [node for node in as_is.graph.nodes if node.op == "placeholder"]
    assert [node.target for node in calls].count(torch.ops.aten.copy.default) == 2
    for write, written in zip(calls[-2:], inputs[:2]):  # one write each at the end, in the inputs' order
        assert write.target is torch.ops.aten.copy_.default and write.args[0] is written
        assert write.args[1].target is torch.ops.aten.copy.default and write.args[1].args[0] is written
    want_p, want_q = p.clone(), q.clone()
    want = writes(want_p, want_q, x)
    got_p, got_q = p.clone(), q.clone()
    got = as_is(got_p, got_q, x)
    assert torch.equal(got, want) and torch.equal(got_p, want_p) and torch.equal(got_q, want_q)

    def view_read_after_the_write(p, x):
        rows = p.view(-1)
        p.copy_(x)
        return rows.sum()  # sees the written values through the view: functionalization must regenerate it

    def written_twice(p, x):
        p.copy_(x)
        p.copy_(x * 2)

    def write_result_read(p, x):
        return p.copy_(x).sum()

    def in_place_on_a_view(p, x):
        y = x.clone()
        y[0].add_(1)  # writes into y through the view
        p.copy_(y)

    def in_place_on_a_tensor_with_a_view(p, x):
        y = x.clone()
        rows = y.view(-1)
        y.mul_(2)
        return rows.sum()

    def in_place_on_an_input(p, x):
        p.add_(x)

    def view_of_an_in_place_result(p, x):  # functionalization makes the view again where it is read
        rows = x.clone().mul_(2).view(-1)
        p.copy_(x + 1)
        return rows.sum()

    refusals = (view_read_after_the_write, written_twice, write_result_read, in_place_on_a_view,
                in_place_on_a_tensor_with_a_view, in_place_on_an_input, view_of_an_in_place_result)
    for refused in refusals:
        assert _functional_as_is(refused, torch.randn(3, 4), torch.randn(3, 4))[1] is None, refused.__name__


def test_in_place_ops_on_a_fresh_tensor_become_their_functional_variants_and_later_readers_read_the_result():
    def chain(p, x):
        y = x.clone()
        before = y.sum()  # reads y before the writes: the original values
        y.mul_(2).add_(x, alpha=3)  # a chain: add_ writes what mul_ returned
        p.copy_(y)
        return before + y.sum()  # reads y after them: the result

    p, x = torch.randn(3, 4), torch.randn(3, 4)
    traced, as_is = _functional_as_is(chain, p, x)
    assert as_is is traced
    ops = [node.target for node in as_is.graph.nodes if node.op == "call_function"]
    assert torch.ops.aten.mul.Tensor in ops and torch.ops.aten.add.Tensor in ops
    assert [op for op in ops if op._schema.is_mutable] == [torch.ops.aten.copy_.default]
    want_p, got_p = p.clone(), p.clone()
    assert torch.equal(as_is(got_p, x), chain(want_p, x)) and torch.equal(got_p, want_p)


@pytest.mark.parametrize("name", ["llama-tiny", "zoo:llama", "mlp", "gpt2-tiny"])
def test_the_capture_without_a_retrace_gives_the_retraced_graph(name, monkeypatch):
    """The MetaIR graph, constants, slots and layouts are the re-trace's where the capture takes the shortcut:
    llama-tiny, the zoo's LLaMA (SDPA) and mlp write only into inputs; gpt2-tiny makes its dropout masks in place."""
    import importlib

    from metadist.workloads import load_workload

    capture_module = importlib.import_module("metadist.frontends.torch.capture")
    taken = []
    shortcut = capture_module._functional_as_is
    monkeypatch.setattr(capture_module, "_functional_as_is", lambda *args: taken.append(shortcut(*args)) or taken[-1])
    steps = []
    for retrace in (True, False):
        monkeypatch.setattr(capture_module, "_ALWAYS_RETRACE", retrace)
        workload = load_workload(name)
        steps.append(capture_step(workload.train_step(), workload.model, workload.optimizer(workload.model.parameters()),
                                  workload.batch))
    assert taken[-1] is not None
    retraced, as_is = steps
    assert as_is.graph == retraced.graph
    assert as_is.slots == retraced.slots and as_is.contiguous_values == retraced.contiguous_values
    assert as_is.constants.keys() == retraced.constants.keys()
    assert all(torch.equal(as_is.constants[key], retraced.constants[key]) for key in retraced.constants)


def test_the_rewrite_writes_every_call_as_functionalization_records_it():
    """Defaults left out or given, keyword arguments, chains of in-place ops, a write into an input: the rewritten
    graph is the graph ``torch.func.functionalize`` traces, call for call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(p, x):
        y = x.clone()
        y.bernoulli_()  # p left at the in-place op's default; the functional variant has none
        y.add_(x)
        y.mul_(2)
        z = x.clone().bernoulli_(0.3)
        y.div_(3, rounding_mode=None)
        y.add_(x, alpha=1)
        y.clamp_(min=0.1)
        p.copy_(y + z)
        return y.sum()

    def calls(module):
        index: dict = {}
        found = []
        for node in module.graph.nodes:
            index[node] = len(index)
            if node.op == "call_function":
                name = lambda arg: ("node", index[arg]) if isinstance(arg, torch.fx.Node) else arg  # noqa: E731
                found.append((node.target, tuple(name(a) for a in node.args),
                              tuple(sorted((k, name(v)) for k, v in node.kwargs.items()))))
        return found

    tensors = (torch.randn(3, 4), torch.randn(3, 4))
    traced = make_fx(step, tracing_mode="fake")(*tensors)
    fake_mode = next(node.meta["val"].fake_mode for node in traced.graph.nodes if node.op == "placeholder")
    fakes = [node.meta["val"].detach() for node in traced.graph.nodes if node.op == "placeholder"]
    with fake_mode:
        functionalized = make_fx(torch.func.functionalize(traced, remove="mutations"), tracing_mode="real")(*fakes)
    functionalized.graph.eliminate_dead_code()
    _, as_is = _functional_as_is(step, *tensors)
    assert as_is is not None and calls(as_is) == calls(functionalized)
