"""The hand-written baselines, each built from the same source model on every rank.

=========  ==================================================================================
method     what runs
=========  ==================================================================================
single     one device (rank 0), the whole batch; the other ranks wait
ddp        ``DistributedDataParallel``: replicated model, batch split over all ranks
zero2      FSDP2 ``fully_shard(reshard_after_forward=False)`` per block and at the root:
           optimizer states, gradients and (at rest) parameters sharded, parameters kept
           gathered from forward to backward (ZeRO-2's communication pattern)
zero3      FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters re-gathered in backward
tp         Megatron-style tensor parallelism over all ranks (:mod:`.tp_plans`), whole batch
tp-dp      2-D mesh ``(dp, tp)``: Megatron TP on ``tp``, FSDP2 (ZeRO-2 style) on ``dp``
=========  ==================================================================================

Every method's step returns this rank's *contribution* to the global loss, so that the sum
over ranks is the single-device loss of the whole batch (see :func:`loss_scale`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..workload import Workload
from ..workloads.builtin import CAUSAL_FAMILIES
from .tp_plans import TensorParallelUnavailable, convert_gpt2_for_tp, megatron_plan

log = logging.getLogger(__name__)

BASELINE_METHODS = ("single", "ddp", "zero2", "zero3", "tp", "tp-dp")


class MethodUnavailable(RuntimeError):
    """A method cannot run on this model, mesh or software; the message says why."""


@dataclass(frozen=True)
class RankContext:
    """Who this process is."""

    rank: int
    world_size: int
    device: torch.device
    mesh_shape: tuple[int, ...]
    """The mesh of the 2-D methods (tp-dp, MetaDist on a 2-D mesh): (dp, tp)."""
    cluster: str | None = None
    """The cost model's cluster (preset or JSON file) for MetaDist; None: ``cpu-gloo`` on CPU."""


@dataclass(frozen=True)
class Prepared:
    """A method ready to run on this rank."""

    method: str
    step: Callable[[], torch.Tensor]
    """One training step; returns this rank's contribution to the global loss (detached)."""
    holders: tuple
    """Objects that hold the method's state (model, optimizer...), kept alive while it runs."""
    mesh_shape: tuple[int, ...]
    note: str = ""
    build: Callable[[], None] | None = None
    """The part of the build that allocates the method's state, when it is not done yet: run inside the
    measured window, so the state figure counts the model copy the method is given and what it frees."""


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0 (modules and float ``*dropout*`` attributes), in place."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def target_count(batch: dict, family: str) -> int:
    """How many targets the mean loss averages over (tokens with labels, or rows)."""
    labels = batch.get("labels")
    if labels is None:
        return int(next(iter(batch.values())).shape[0])
    if family in CAUSAL_FAMILIES:
        labels = labels[:, 1:]  # causal LMs shift the labels
    return int((labels != -100).sum())


def loss_scale(local: dict, whole: dict, family: str, dp_size: int) -> float:
    """Factor that makes the mean of ``dp_size`` local losses equal the loss of the whole batch.

    A local mean loss is ``sum_local / count_local``; times ``dp_size * count_local / count_whole``
    it becomes ``dp_size * sum_local / count_whole``, whose mean over the data-parallel ranks (what
    DDP and FSDP average gradients by) is ``sum_whole / count_whole``. The factor is exactly 1
    whenever every shard has as many targets, as for the causal LMs and classifiers.
    """
    return dp_size * target_count(local, family) / target_count(whole, family)


def local_batch(batch: dict, parts: int, index: int) -> dict:
    """This data-parallel rank's rows of the global batch."""
    rows = next(iter(batch.values())).shape[0]
    if rows % parts:
        raise MethodUnavailable(f"the global batch has {rows} rows, which do not split over {parts} data-parallel ranks; "
                                f"pass a batch size divisible by {parts}")
    return {key: value.chunk(parts)[index] for key, value in batch.items()}


def build_baseline(method: str, workload: Workload, ctx: RankContext) -> Prepared:
    """Build ``method`` from a private copy of ``workload.model`` on this rank."""
    builders = {"single": _single, "ddp": _ddp, "zero2": _zero, "zero3": _zero, "tp": _tp, "tp-dp": _tp_dp}
    if method not in builders:
        raise MethodUnavailable(f"unknown baseline {method!r}; choose from {', '.join(BASELINE_METHODS)}")
    return builders[method](method, workload, ctx)


def _copy_model(workload: Workload, ctx: RankContext) -> nn.Module:
    return copy.deepcopy(workload.model).to(ctx.device)


def _batch_on(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def _training_step(model: nn.Module, optimizer: Any, loss_fn: Callable, batch: dict, factor: float) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = loss_fn(model, batch) * factor
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def _family(workload: Workload) -> str:
    return workload.extras.get("family", "")


def _single(method: str, workload: Workload, ctx: RankContext) -> Prepared:
    if ctx.rank != 0:
        return Prepared(method, step=lambda: torch.zeros((), device=ctx.device), holders=(), mesh_shape=(1,),
                        note="rank 0 only")
    model = _copy_model(workload, ctx)
    optimizer = workload.optimizer(model.parameters())
    batch = _batch_on(workload.batch, ctx.device)
    step = _training_step(model, optimizer, workload.loss_fn, batch, 1.0)
    return Prepared(method, step=step, holders=(model, optimizer), mesh_shape=(1,), note="rank 0 only")


def _data_parallel_batch(workload: Workload, ctx: RankContext, dp_size: int, dp_index: int) -> tuple[dict, float]:
    """This rank's rows and the factor of its loss (:func:`loss_scale`)."""
    local = local_batch(workload.batch, dp_size, dp_index)
    return _batch_on(local, ctx.device), loss_scale(local, workload.batch, _family(workload), dp_size)


def _ddp(method: str, workload: Workload, ctx: RankContext) -> Prepared:
    model = _copy_model(workload, ctx)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer = workload.optimizer(ddp.parameters())
    batch, factor = _data_parallel_batch(workload, ctx, ctx.world_size, ctx.rank)
    contribution = _contribution(_training_step(ddp, optimizer, workload.loss_fn, batch, factor), ctx.world_size)
    return Prepared(method, step=contribution, holders=(ddp, optimizer), mesh_shape=(ctx.world_size,))


def _contribution(step: Callable[[], torch.Tensor], divisor: float) -> Callable[[], torch.Tensor]:
    """Train with the loss as the method needs it, report it divided by ``divisor``."""
    return lambda: step() / divisor


def shard_units(model: nn.Module) -> list[nn.Module]:
    """FSDP units: the blocks of every ``nn.ModuleList``; without one, each child that has parameters."""
    units = [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]
    if units:
        return units
    return [child for child in model.children() if any(True for _ in child.parameters())]


def _fully_shard(model: nn.Module, mesh: Any, reshard_after_forward: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _zero(method: str, workload: Workload, ctx: RankContext) -> Prepared:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = _fully_shard(_copy_model(workload, ctx), mesh, reshard_after_forward=(method == "zero3"))
    optimizer = workload.optimizer(model.parameters())
    batch, factor = _data_parallel_batch(workload, ctx, ctx.world_size, ctx.rank)
    contribution = _contribution(_training_step(model, optimizer, workload.loss_fn, batch, factor), ctx.world_size)
    return Prepared(method, step=contribution, holders=(model, optimizer, mesh), mesh_shape=(ctx.world_size,))


def _tensor_parallel(workload: Workload, ctx: RankContext, tp_mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    model = _copy_model(workload, ctx)
    family = _family(workload)
    tp_degree = tp_mesh.size()
    plan = megatron_plan(model, family, tp_degree)
    if family == "gpt2":
        convert_gpt2_for_tp(model, tp_degree)
    return parallelize_module(model, tp_mesh, plan)


def _optimizer_for_mixed(workload: Workload, model: nn.Module) -> Any:
    """The workload's optimizer over DTensor and plain parameters together (per-tensor loop, not foreach)."""
    return workload.optimizer([{"params": list(model.parameters()), "foreach": False}])


def _tp(method: str, workload: Workload, ctx: RankContext) -> Prepared:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("tp",))
    try:
        model = _tensor_parallel(workload, ctx, mesh)
    except TensorParallelUnavailable as err:
        raise MethodUnavailable(str(err)) from err
    optimizer = _optimizer_for_mixed(workload, model)
    batch = _batch_on(workload.batch, ctx.device)
    contribution = _contribution(_training_step(model, optimizer, workload.loss_fn, batch, 1.0), ctx.world_size)
    return Prepared(method, step=contribution, holders=(model, optimizer, mesh), mesh_shape=(ctx.world_size,))


def _tp_dp(method: str, workload: Workload, ctx: RankContext) -> Prepared:
    from torch.distributed.device_mesh import init_device_mesh

    if len(ctx.mesh_shape) != 2 or ctx.mesh_shape[0] * ctx.mesh_shape[1] != ctx.world_size or 1 in ctx.mesh_shape:
        raise MethodUnavailable(f"tp-dp needs a 2-D mesh (dp, tp) of {ctx.world_size} ranks with both axes > 1, "
                                f"got {ctx.mesh_shape}; pass --mesh DPxTP, e.g. 2x2 on 4 ranks")
    mesh = init_device_mesh(ctx.device.type, ctx.mesh_shape, mesh_dim_names=("dp", "tp"))
    try:
        model = _tensor_parallel(workload, ctx, mesh["tp"])
    except TensorParallelUnavailable as err:
        raise MethodUnavailable(str(err)) from err
    model = _fully_shard(model, mesh["dp"], reshard_after_forward=False)
    optimizer = _optimizer_for_mixed(workload, model)
    dp_size, dp_index = ctx.mesh_shape[0], mesh.get_coordinate()[0]
    batch, factor = _data_parallel_batch(workload, ctx, dp_size, dp_index)
    contribution = _contribution(_training_step(model, optimizer, workload.loss_fn, batch, factor), ctx.world_size)
    return Prepared(method, step=contribution, holders=(model, optimizer, mesh), mesh_shape=ctx.mesh_shape)

