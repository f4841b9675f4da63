"""What torch's FSDP2 and tensor parallelism do per step beyond the captured graph's compute, counted on the model.

The cost model prices those baselines as they run (:func:`metadist.solver.baselines.torch_fsdp_estimate`,
:func:`~metadist.solver.baselines.torch_tp_estimate`): every op they run on a DTensor pays the calibrated
``Device.dtensor_op_overhead_s`` (an optimizer's elementwise op) or ``dtensor_module_op_overhead_s`` (an op of a
parallel module's forward and backward), and torch's TP all-reduces activations at fixed points of its parallel
modules, each paying ``dtensor_collective_overhead_s`` beyond its link's price.
These counts come from the model and optimizer themselves, run where nothing is timed: the optimizer's ops on meta
copies of the parameters, a parallel module's forward and backward on a meta copy, and one forward of the model with
hooks for the shapes of the parallel modules' inputs and outputs. What counts as an op is one definition
(:mod:`metadist.cost.op_counts`), shared with the calibration that prices it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..cost.op_counts import MetaOpCounter, module_ops
from ..workload import Workload

__all__ = ["TensorParallelCounts", "eager_optimizer_ops", "module_ops", "tensor_parallel_counts"]


def eager_optimizer_ops(workload: Workload, parameters: Iterable[torch.Tensor]) -> int:
    """The ops one eager step of the workload's optimizer runs on ``parameters`` (their gradients and states
    included): on DTensor parameters, each is one DTensor op. Counted on meta copies, on the second step (the first
    also creates the states)."""
    copies = [nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in parameters]
    copies = [p for p in copies if p.requires_grad]
    if not copies:
        return 0
    for p in copies:
        p.grad = torch.zeros_like(p)
    optimizer = workload.optimizer(copies)
    optimizer.step()
    counter = MetaOpCounter()
    with counter:
        optimizer.step()
    return counter.count


@dataclass(frozen=True)
class TensorParallelCounts:
    """What torch's TP (and FSDP2 beside it on a 2-D mesh) does on one rank per step, beyond the model's compute."""

    activation_reduces: tuple[float, ...]
    """Bytes of each all-reduce of activations (a row-wise module's output in the forward, a column-wise module's
    input gradient in the backward)."""
    module_dtensor_ops: int
    """The parallel modules' forward and backward ops (each a DTensor op)."""
    optimizer_dtensor_ops: int
    """The eager optimizer's ops on DTensor parameters (the parallel modules' with TP alone; all with FSDP2)."""
    local_units: tuple[tuple[tuple[tuple[int, ...], int], ...], ...]
    """FSDP2's units as TP leaves their parameters on a rank: per unit, (local shape, item size) of each parameter."""


def tensor_parallel_counts(workload: Workload, model: nn.Module, plan: Mapping[str, Any], tp: int,
                           batch: Mapping[str, torch.Tensor], units: list[nn.Module], with_fsdp: bool) -> TensorParallelCounts:
    """Count torch's TP per step on ``model`` (a private copy of the workload's: its forward runs once) under
    ``plan`` (module path -> ``ColwiseParallel`` or ``RowwiseParallel``, :func:`.tp_plans.megatron_plan`) over ``tp``
    ranks, running one forward on ``batch`` (a TP rank's rows) with hooks, the random generators' states restored
    after it. ``units``: FSDP2's units of ``model`` (the root last); ``with_fsdp``: whether FSDP2 shards every
    parameter over the other axis (all become DTensors)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    missing = sorted(path for path in plan if path not in modules)
    if missing:
        raise ValueError(f"the TP plan names modules the model lacks: {', '.join(missing)}")
    seen: dict[str, tuple[torch.Size, torch.dtype, bool, torch.Size, torch.dtype]] = {}
    hooks = []
    for path in plan:
        def record(module, args, output, path=path):
            x = args[0]
            seen[path] = (x.shape, x.dtype, bool(x.requires_grad), output.shape, output.dtype)
        hooks.append(modules[path].register_forward_hook(record))
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            workload.loss_fn(model, dict(batch))
    finally:
        for hook in hooks:
            hook.remove()
    reduces: list[float] = []
    module_count = 0
    cache: dict[tuple, int] = {}
    for path, style in plan.items():
        if path not in seen:
            raise ValueError(f"the TP plan's module {path} did not run in the model's forward")
        in_shape, in_dtype, in_grad, out_shape, out_dtype = seen[path]
        if isinstance(style, RowwiseParallel):
            reduces.append(float(torch.Size(out_shape).numel() * _itemsize(out_dtype)))
        elif isinstance(style, ColwiseParallel):
            if in_grad:
                reduces.append(float(torch.Size(in_shape).numel() * _itemsize(in_dtype)))
        else:
            raise ValueError(f"tensor_parallel_counts knows column- and row-wise styles, not {type(style).__name__} ({path})")
        module = _as_linear(modules[path])
        key = (tuple(module.weight.shape), module.bias is not None, tuple(in_shape), in_dtype, in_grad)
        if key not in cache:
            cache[key] = module_ops(module, tuple(in_shape), in_dtype, in_grad)
        module_count += cache[key]
    styled = {id(p): (style, name, _is_conv1d(modules[path]))
              for path, style in plan.items() for name, p in modules[path].named_parameters()}
    dtensor_params = [p for p in model.parameters() if with_fsdp or id(p) in styled]
    local_units = []
    taken: set[int] = set()
    for unit in units:
        mine = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in mine)
        local_units.append(tuple((_local_shape(p, styled.get(id(p)), tp), p.element_size()) for p in mine))
    return TensorParallelCounts(activation_reduces=tuple(reduces), module_dtensor_ops=module_count,
                                optimizer_dtensor_ops=eager_optimizer_ops(workload, dtensor_params),
                                local_units=tuple(local_units))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"  # transformers' GPT-2 projection: weight (in, out)


def _as_linear(module: nn.Module) -> nn.Module:
    """The module as TP runs it: GPT-2's ``Conv1D`` as the equivalent ``nn.Linear`` (:func:`.tp_plans.convert_gpt2_for_tp`)."""
    if _is_conv1d(module):
        from .tp_plans import _linear_from_conv1d

        return _linear_from_conv1d(module)
    return module


def _local_shape(p: torch.Tensor, styled: tuple[Any, str, bool] | None, tp: int) -> tuple[int, ...]:
    """``p``'s shape on a TP rank (as ``nn.Linear`` holds it: GPT-2's ``Conv1D`` weight transposed): a column-wise
    module's weight and bias split on their output dim, a row-wise module's weight on its input dim."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    shape = list(p.shape)
    if styled is None:
        return tuple(shape)
    style, name, conv1d = styled
    if conv1d and name == "weight":
        shape = shape[::-1]
    if isinstance(style, ColwiseParallel):
        shape[0] //= tp
    elif name == "weight":
        shape[1] //= tp
    return tuple(shape)
