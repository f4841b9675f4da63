"""Counting the aten ops a module or an optimizer runs, on meta copies (nothing is computed or timed).

torch's tensor parallelism and FSDP2 pay a price per op they run on a DTensor (``Device.dtensor_op_overhead_s``,
``Device.dtensor_module_op_overhead_s``). The calibration (:mod:`.calibrate_worker`) measures that price per op as
counted here, and the bench (:mod:`metadist.bench.torch_counts`) counts a model's ops the same way, so a figure and
the count it multiplies agree on what "an op" is.

Imports torch: like the calibration worker, never imported from :mod:`metadist.cost`'s package namespace.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class MetaOpCounter(TorchDispatchMode):
    """Counts the aten ops that read or write a meta tensor (the ops on the counted tensors, not on a CPU step
    counter or the profiler's records)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(leaf, torch.Tensor) and leaf.device.type == "meta" for leaf in leaves):
            self.count += 1
        return func(*args, **kwargs)


def module_ops(module: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype, input_requires_grad: bool) -> int:
    """The ops of ``module``'s forward and backward on an input of ``input_shape`` (meta copies; the backward seeded
    with a gradient of the output's shape, its parameters' gradients accumulated)."""
    meta = copy.deepcopy(module).to("meta")
    x = torch.empty(input_shape, dtype=dtype, device="meta", requires_grad=input_requires_grad)
    counter = MetaOpCounter()
    with counter:
        y = meta(x)
        seed = torch.empty_like(y)
    with counter:
        y.backward(seed)
    return counter.count - 1  # the seed's allocation is not the module's
