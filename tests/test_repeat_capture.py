"""Capturing a deep model on four of its layers and expanding the graph to all of them."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from metadist.frontends.torch import capture_step
from metadist.frontends.torch.repeat import capture_repeated, find_repeated_layers
from metadist.ir.expand import ExpansionError, canonical_names, expand_layers, op_base_name

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    def __init__(self, width: int, index: int = 0, window: int | None = None) -> None:
        super().__init__()
        self.layer_idx = index  # the index alone does not make layers differ
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.window = window

    def forward(self, x):
        y = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return x + (y if self.window is None else y.clamp(-self.window, self.window))


class Deep(nn.Module):
    def __init__(self, layers: int, width: int = 8, odd_layer: int | None = None, windowed: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(Block(width, i, 1 if i == windowed else None) for i in range(layers))
        self.head = nn.Linear(width, 16)
        self.odd_layer = odd_layer

    def forward(self, tokens):
        x = self.embed(tokens)
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index == self.odd_layer:  # the step treats one layer differently, invisibly to the layers themselves
                x = 2 * x
        return self.head(x)


def step(model, optimizer, batch):
    logits = model(batch["tokens"])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _inputs(layers: int, odd_layer: int | None = None):
    torch.manual_seed(0)
    model = Deep(layers, odd_layer=odd_layer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 16, (2, 5))
    return model, optimizer, {"tokens": tokens, "labels": tokens}


def test_expanded_graph_equals_the_whole_capture(caplog):
    model, optimizer, batch = _inputs(6)
    with caplog.at_level(logging.INFO, logger="metadist.frontends.torch.repeat"):
        expanded = capture_repeated(step, model, optimizer, batch, name="deep", min_layers=5)
    assert "on 4 of its 6 layers" in caplog.text
    whole = capture_step(step, model, optimizer, batch, name="deep").graph
    assert expanded == whole  # same nodes, names, inputs, outputs: the same fingerprint
    assert len(model.blocks) == 6 and len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_expanded_graph_with_raw_gradients_equals_the_whole_capture(caplog):
    """What a pipeline plans from: the step on one microbatch with each gradient as autograd accumulated it."""
    from metadist.frontends.torch.capture import loss_divisor_of

    model, optimizer, batch = _inputs(6)
    with caplog.at_level(logging.INFO, logger="metadist.frontends.torch.repeat"):
        expanded = capture_repeated(step, model, optimizer, batch, name="deep", min_layers=5, raw_grads=True)
    assert "on 4 of its 6 layers" in caplog.text
    whole = capture_step(step, model, optimizer, batch, name="deep", raw_grads=True)
    assert expanded == whole.graph
    assert whole.loss_divisor is not None and loss_divisor_of(expanded) == whole.loss_divisor


def lm_step(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _library_gpt2(layers: int):
    """A tiny GPT-2 with the library's defaults (its KV cache on), SGD, and a batch of tokens for :func:`lm_step`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=layers, n_head=2))
    tokens = torch.randint(0, 32, (2, 8))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), {"input_ids": tokens, "labels": tokens}


def test_a_library_model_with_its_default_kv_cache_expands_to_the_whole_capture(caplog):
    """GPT-2 with the library's defaults (use_cache on): each layer's trace creates its cache's empty tensors, per-layer
    tensor constants the expansion copies for every layer and numbers as the whole capture does."""
    model, optimizer, batch = _library_gpt2(layers=5)
    with caplog.at_level(logging.INFO, logger="metadist.frontends.torch.repeat"):
        expanded = capture_repeated(lm_step, model, optimizer, batch, name="gpt2", min_layers=5)
    assert "on 4 of its 5 layers" in caplog.text
    whole = capture_step(lm_step, model, optimizer, batch, name="gpt2").graph
    constants = [gi.value.name for gi in whole.inputs if gi.role.value == "constant"]
    assert len(constants) >= 5  # the cache's tensors of every layer
    assert expanded == whole


def _same_step(expanded, whole) -> None:
    """Every field a run reads of the step agrees: graph, slots, constants (tensor for tensor), layouts, the rest."""
    assert expanded.graph == whole.graph
    assert expanded.slots == whole.slots
    assert expanded.constants.keys() == whole.constants.keys()
    for name, tensor in whole.constants.items():
        assert expanded.constants[name].dtype == tensor.dtype and torch.equal(expanded.constants[name], tensor), name
    assert expanded.contiguous_values == whole.contiguous_values
    assert expanded.left_grads == whole.left_grads
    assert expanded.optimizer_structure == whole.optimizer_structure
    assert expanded.loss_divisor == whole.loss_divisor
    assert expanded.output_tree == whole.output_tree
    assert expanded.graph_module is None


@pytest.mark.parametrize("grads", ["none", "keep", "raw"])
def test_an_expanded_step_is_the_whole_capture_and_runs_as_it(caplog, grads):
    """What ``metadist run`` (and, with raw gradients, a pipeline's ranks) captures: a library GPT-2 of 6 layers (its KV
    cache constants on) on 4 layers, expanded to a step a run executes; both steps run from the same state to the same
    loss and state."""
    from metadist.frontends.torch.repeat import capture_repeated_step

    options = dict(keep_grads=grads == "keep", raw_grads=grads == "raw")
    model, optimizer, batch = _library_gpt2(layers=6)
    with caplog.at_level(logging.INFO, logger="metadist.frontends.torch.repeat"):
        expanded = capture_repeated_step(lm_step, model, optimizer, batch, name="gpt2", min_layers=5, **options)
    assert "on 4 of its 6 layers" in caplog.text
    whole = capture_step(lm_step, model, optimizer, batch, name="gpt2", **options)
    _same_step(expanded, whole)
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=1e-3)
    torch.manual_seed(1)
    loss = expanded.run(model, optimizer, batch)
    torch.manual_seed(1)
    twin_loss = whole.run(twin, twin_optimizer, batch)
    assert torch.equal(loss, twin_loss)
    for (name, param), twin_param in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(param, twin_param), name


def test_a_step_leaving_gradients_behind_expands_them_for_every_layer():
    """A step that never zeroes its gradients leaves every layer's behind (a run refuses it, naming them all)."""
    from metadist.frontends.torch.repeat import capture_repeated_step

    def step_without_zero_grad(model, optimizer, batch):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        return loss

    model, optimizer, batch = _library_gpt2(layers=6)
    expanded = capture_repeated_step(step_without_zero_grad, model, optimizer, batch, min_layers=5)
    whole = capture_step(step_without_zero_grad, model, optimizer, batch)
    assert len(whole.left_grads) == len(list(model.parameters()))
    _same_step(expanded, whole)


def test_what_the_whole_capture_refuses_is_refused_not_expanded_without_it():
    """An optimizer step hook: the cut optimizer would not carry it over, so the expansion would silently drop it;
    the whole capture's error is raised instead."""
    from metadist.frontends.torch import CaptureError
    from metadist.frontends.torch.repeat import capture_repeated_step

    model, optimizer, batch = _library_gpt2(layers=6)
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: None)
    try:
        with pytest.raises(CaptureError, match="step hook"):
            capture_repeated_step(lm_step, model, optimizer, batch, min_layers=5)
    finally:
        handle.remove()
    assert len(model.transformer.h) == 6


def test_a_raw_gradient_capture_of_a_library_model_has_canonical_names():
    """Copies dropped from the gradient outputs leave no gaps in the numbering (a few captured layers expand to it)."""
    from metadist.ir.expand import canonical_names
    from metadist.workloads import load_workload

    workload = load_workload("llama-tiny")
    optimizer = workload.optimizer(workload.model.parameters())
    graph = capture_step(workload.train_step(), workload.model, optimizer, workload.batch, raw_grads=True).graph
    assert canonical_names(graph)[0] == graph


def test_a_layer_that_behaves_differently_is_caught_and_captured_whole(caplog):
    model, optimizer, batch = _inputs(6, odd_layer=2)  # layer 2 doubles its branch: the self-check sees it
    with caplog.at_level(logging.INFO, logger="metadist.frontends.torch.repeat"):
        graph = capture_repeated(step, model, optimizer, batch, name="deep", min_layers=5)
    assert "capturing deep whole" in caplog.text and "do not expand" in caplog.text
    assert graph == capture_step(step, model, optimizer, batch, name="deep").graph


def test_shallow_models_are_captured_whole(caplog):
    model, optimizer, batch = _inputs(5)
    with caplog.at_level(logging.INFO, logger="metadist.frontends.torch.repeat"):
        capture_repeated(step, model, optimizer, batch, name="deep")  # fewer than MIN_LAYERS_TO_EXPAND
    assert "expanded" not in caplog.text


def test_repeated_layers_are_found_only_when_identical_and_unshared():
    assert find_repeated_layers(Deep(3)).path == "blocks"
    mixed = Deep(3)
    mixed.blocks[1] = nn.Sequential(nn.Linear(8, 8))
    assert find_repeated_layers(mixed) is None
    shared = Deep(3)
    shared.blocks[2].up.weight = shared.blocks[0].up.weight
    assert find_repeated_layers(shared) is None
    # one layer set apart by a setting beyond the four captured ones (as a global layer every sixth)
    assert find_repeated_layers(Deep(8, windowed=5)) is None


def test_expansion_refuses_a_graph_without_the_captured_layers():
    model, optimizer, batch = _inputs(3)
    graph = capture_step(step, model, optimizer, batch).graph
    with pytest.raises(ExpansionError, match="belong to layers \\[0, 1, 2\\]"):
        expand_layers(graph, "blocks.", 10)


def test_canonical_names_depend_on_the_op_sequence_only():
    model, optimizer, batch = _inputs(2)
    graph = capture_step(step, model, optimizer, batch).graph
    again, renamed = canonical_names(graph)
    assert again == graph and all(old == new for old, new in renamed.items())  # captures are canonical already
    seen: dict[str, int] = {}
    for node in graph.nodes:
        base = op_base_name(node.op.target)
        assert node.name == (base if base not in seen else f"{base}_{seen[base]}")
        seen[base] = seen.get(base, 0) + 1


def test_layers_reading_their_own_kv_cache_constants_still_tie():
    """Each layer's cache tensors are distinct constants (numbered by the trace); tying treats constants of one spec
    alike, so the layers' runs tie as they do without a cache (llama-13b with the cache: 1,153 classes untied, 416 tied)."""
    from metadist.solver.shrink import tie_inputs, tie_nodes

    model, optimizer, batch = _library_gpt2(layers=4)
    graph = capture_step(lm_step, model, optimizer, batch).graph
    constants = [gi.value.name for gi in graph.inputs if gi.role.value == "constant"]
    assert len(constants) >= 4
    inputs = tie_inputs(graph)
    assert len({inputs[name] for name in constants}) < len(constants)  # constants of one spec share a representative
    readers = [node.name for node in graph.nodes if any(name in constants for name in node.input_names)]
    nodes = tie_nodes(graph)
    tied = [name for name in readers if nodes[name] != name]
    assert len(tied) >= len(readers) // 2  # the later layers' cache readers are tied to the first layer's
