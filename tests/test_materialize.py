"""Meta-device models get their values one module at a time, independent of the mesh (CPU, one process)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from metadist.frontends.torch.materialize import MaterializeError, has_meta_tensors, iter_materialized, materialize
from metadist.workloads import builtin_workload


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny", "cnn"])
def test_buffers_equal_a_real_build_and_norms_start_at_one(name):
    meta = builtin_workload(name, device="meta").model
    real = builtin_workload(name).model
    model = materialize(meta)
    assert not has_meta_tensors(model)
    real_buffers = dict(real.named_buffers())
    for key, buffer in model.named_buffers():
        assert torch.equal(buffer, real_buffers[key]), key  # rotary inv_freq, position ids, BatchNorm statistics
    for key, param in model.named_parameters():
        assert torch.isfinite(param).all(), key
        if key.endswith(("ln_1.weight", "ln_2.weight", "norm.weight", "LayerNorm.weight")):
            assert torch.equal(param, torch.ones_like(param)), key


def test_hf_ancestor_init_reaches_the_unit_gpt2_scaled_residual_projection():
    model = materialize(builtin_workload("gpt2-tiny", device="meta").model)
    config = model.config
    scaled = config.initializer_range / math.sqrt(2 * config.n_layer)
    projection = torch.cat([model.transformer.h[i].attn.c_proj.weight.flatten() for i in range(config.n_layer)])
    attention = torch.cat([model.transformer.h[i].attn.c_attn.weight.flatten() for i in range(config.n_layer)])
    assert abs(projection.std().item() - scaled) < 0.1 * scaled  # GPT2Attention's init rewrote its child's weight
    assert abs(attention.std().item() - config.initializer_range) < 0.1 * config.initializer_range
    assert model.lm_head.weight is model.transformer.wte.weight  # tied weights stay one tensor


def test_values_depend_on_the_seed_and_unit_name_only():
    meta = builtin_workload("llama-tiny", device="meta").model
    first = {item.name: item.tensor for item in iter_materialized(meta, seed=5)}
    assert has_meta_tensors(meta), "iter_materialized leaves the model on meta"
    again = {item.name: item.tensor for item in iter_materialized(copy.deepcopy(meta), seed=5)}
    other = {item.name: item.tensor for item in iter_materialized(meta, seed=6)}
    assert first.keys() == again.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    weights = [key for key in first if key.endswith("q_proj.weight")]
    assert weights and all(not torch.equal(first[key], other[key]) for key in weights)


def test_a_unit_keeps_its_values_when_other_modules_are_added():
    def build(extra: bool) -> nn.Module:
        with torch.device("meta"):
            layers = {"a": nn.Linear(8, 8), "b": nn.Linear(8, 4)}
            if extra:
                layers = {"z": nn.Linear(16, 16), **layers}
            return nn.ModuleDict(layers)

    small = materialize(build(False))
    large = materialize(build(True))
    assert torch.equal(small["a"].weight, large["a"].weight) and torch.equal(small["b"].bias, large["b"].bias)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(4))

    def forward(self, x):
        return x * self.gain


def test_a_module_without_an_init_is_a_clear_error_and_init_fn_fixes_it():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(MaterializeError, match=r"module '1' \(Scale\) owns meta tensors \(1\.gain\).*reset_parameters.*init_fn"):
        materialize(copy.deepcopy(model))

    def init_fn(module: nn.Module) -> None:
        if isinstance(module, Scale):
            nn.init.constant_(module.gain, 2.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    done = materialize(model, init_fn=init_fn)
    assert torch.equal(done[1].gain, torch.full((4,), 2.0))
    assert done[0].weight.abs().max() <= 0.5 + 1e-6  # Linear's kaiming-uniform bound 1/sqrt(4)
