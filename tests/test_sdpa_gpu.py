"""The GPU attention kernels' rules, stated by equivalence with the CPU kernel, re-run on the real kernels.

``metadist.shardcombine.attention`` gives ``_scaled_dot_product_flash_attention``,
``_scaled_dot_product_efficient_attention`` and ``_scaled_dot_product_cudnn_attention`` (and their
backwards) the CPU kernel's batch and heads factors. Here every such factor is checked the way
discovery checks a factor, on the GPU: the kernel on the whole inputs against the kernel on the
pieces, recombined. Inputs of the backward kernels come from a real forward. Skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metadist.frontends.torch.discovery import TorchExecutor, _to_numpy
from metadist.shardcombine.discover import discover
from metadist.shardcombine.verify import check_factor
from test_sdpa import op_call

pytestmark = pytest.mark.gpu

aten = torch.ops.aten
B, H, L, E = 4, 8, 64, 64


def _tensors(kv_heads: int, dtype: torch.dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    draw = lambda *shape: torch.randn(shape, generator=generator, device="cuda", dtype=dtype)  # noqa: E731
    return draw(B, H, L, E), draw(B, kv_heads, L, E), draw(B, kv_heads, L, E), draw(B, H, L, E)


def _cases():
    """name -> (dtype, key/value heads, forward: q, k, v -> (op, arguments)) for each GPU kernel."""
    return {
        "flash-causal": (torch.float16, H, lambda q, k, v: (aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.0, True))),
        "flash-gqa": (torch.float16, 2, lambda q, k, v: (aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.0, False))),
        "efficient-bias": (torch.float32, H, lambda q, k, v: (
            aten._scaled_dot_product_efficient_attention.default,
            (q, k, v, torch.randn(B, 1, L, L, device="cuda", dtype=torch.float32), True, 0.0, False))),
        "cudnn-causal": (torch.bfloat16, H, lambda q, k, v: (aten._scaled_dot_product_cudnn_attention.default,
                                                            (q, k, v, None, True, 0.0, True))),
    }


def _backward(name: str, forward_args: tuple, outputs: tuple, grad: torch.Tensor):
    q, k, v = forward_args[:3]
    if name.startswith("flash"):
        out, lse, _, _, max_q, max_k, seed, offset, _ = outputs
        return aten._scaled_dot_product_flash_attention_backward.default, (
            grad, q, k, v, out, lse, None, None, max_q, max_k, 0.0, forward_args[4], seed, offset)
    if name.startswith("efficient"):
        out, lse, seed, offset = outputs
        return aten._scaled_dot_product_efficient_attention_backward.default, (
            grad, q, k, v, forward_args[3], out, lse, seed, offset, 0.0, [True, True, True, False], False)
    out, lse, _, _, max_q, max_k, seed, offset, _ = outputs
    return aten._scaled_dot_product_cudnn_attention_backward.default, (
        grad, q, k, v, out, lse, seed, offset, None, None, None, max_q, max_k, 0.0, True)


def _check_every_factor(op, args) -> int:
    call = op_call(op, *args)  # runs the kernel once on the GPU: shapes and dtypes of its outputs
    rule = discover(call, TorchExecutor())  # the stated rule (the CPU kernel's batch and heads factors)
    inputs = [_to_numpy(arg) for arg in _flat_tensors(args)]
    gpu = TorchExecutor(device="cuda")  # every input on the GPU (philox seed and offset are not read without dropout)
    assert rule.factors, call.target
    for factor in rule.factors:
        size = factor.size(call.input_shapes)
        for shards in [count for count in (2, 4) if size % count == 0]:
            mismatch = check_factor(call, gpu, factor, inputs, shards)
            assert mismatch is None, f"{call.target} {factor} on {shards} shards: {mismatch}"
    return len(rule.factors)


def _flat_tensors(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from (item for item in arg if isinstance(item, torch.Tensor))


@pytest.mark.parametrize("name", list(_cases()))
def test_gpu_attention_rules_hold_on_the_gpu_kernels(name):
    dtype, kv_heads, forward = _cases()[name]
    q, k, v, grad = _tensors(kv_heads, dtype)
    op, args = forward(q, k, v)
    try:
        outputs = op(*args)
    except RuntimeError as err:  # e.g. cuDNN attention not supported on this GPU or build
        pytest.skip(f"{op} does not run here: {str(err).splitlines()[0]}")
    assert _check_every_factor(op, args) == 2  # batch and heads
    backward, backward_args = _backward(name, args, outputs, grad)
    assert _check_every_factor(backward, backward_args) == 2
    assert np.isfinite(_to_numpy(outputs[0])).all()
