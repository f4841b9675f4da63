"""One starting state and one batch on every rank, or a clear error (the DDP convention).

Each process builds its own model, optimizer and batch. Unless every rank seeds
alike, the ranks would train different models on different "global" batches,
and nothing would say so. So when a step is compiled:

* :func:`check_same_structure` proves every rank holds parameters, buffers and
  optimizer state of the same names, shapes and dtypes (different model code on
  different ranks is an error naming the first difference);
* :func:`broadcast_start_state` gives every rank rank 0's values of every real
  parameter, buffer and optimizer state tensor, as DDP does when it wraps a model
  (coalesced into flat buckets; a model on the meta device has nothing to send:
  its seeded initialisation already agrees on every rank);
* :func:`check_same_batch` fingerprints every batch leaf (an order-sensitive
  weighted checksum of its bytes, computed where the tensor lives) and compares
  the fingerprints across ranks, so a batch that differs between ranks stops the
  run with the name of the leaf, instead of training on a mixture.

Rank-local batches (each rank loads its own part, as with a DistributedSampler)
are the other contract: :class:`LocalBatch` reads them as the pieces of a global
batch along dim 0, in rank order.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import RunInputError

__all__ = ["BroadcastReport", "broadcast_rng_state", "broadcast_start_state", "check_same_batch", "check_same_structure",
           "batch_fingerprints", "gather_batch_dim0", "local_batch_shapes"]

log = logging.getLogger(__name__)

BROADCAST_BUCKET_BYTES = 25 << 20
"""Largest flat buffer one broadcast of the starting state carries."""

_SYNCED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
"""Models whose state was broadcast, with the identity and version of every tensor sent then."""


@dataclass(frozen=True)
class BroadcastReport:
    """What :func:`broadcast_start_state` sent."""

    tensors: int
    bytes: int
    calls: int
    seconds: float

    def describe(self) -> str:
        if self.tensors == 0:
            return "starting state: nothing to broadcast (sharded or meta-device state)"
        return (f"starting state: rank 0's {self.tensors} tensors ({self.bytes / (1 << 20):.1f} MiB) broadcast in "
                f"{self.calls} call(s), {self.seconds:.2f} s")


def _state_tensors(model: nn.Module, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and optimizer state tensor, named, in a rank-independent order."""
    named = [(f"param {name}", param) for name, param in model.named_parameters()]
    named += [(f"buffer {name}", buffer) for name, buffer in model.named_buffers()]
    if optimizer is not None:
        names = {id(param): name for name, param in model.named_parameters()}
        for group in optimizer.param_groups:
            for param in group["params"]:
                for key, value in sorted(optimizer.state.get(param, {}).items()):
                    if isinstance(value, torch.Tensor):
                        named.append((f"optimizer state {key!r} of {names.get(id(param), '?')}", value))
    return named


def check_same_structure(model: nn.Module, optimizer: Any) -> None:
    """Every rank holds state tensors of the same names, shapes and dtypes, or an error naming the first difference."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = [(name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in _state_tensors(model, optimizer)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for position in range(max(len(theirs), len(reference))):
            want = reference[position] if position < len(reference) else None
            got = theirs[position] if position < len(theirs) else None
            if want != got:
                raise RunInputError(
                    f"the ranks hold different models: rank 0 has {_describe(want)} where rank {rank} has "
                    f"{_describe(got)}. Every rank must build the same model and optimizer (the same code and "
                    "config); MetaDist then gives them rank 0's values"
                )
    return


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "nothing"
    name, shape, dtype = entry
    return f"{name} {shape} {dtype.removeprefix('torch.')}"


def broadcast_start_state(model: nn.Module, optimizer: Any, device: torch.device) -> BroadcastReport:
    """Give every rank rank 0's parameters, buffers and optimizer state (collective; after :func:`check_same_structure`).

    Only real, unsharded tensors travel (DTensors are sharded state already; meta tensors have no values).
    What travels is each tensor's storage, once, as bytes: tensors that share storage (views, tied weights,
    expanded buffers whose elements overlap) stay consistent, and every dtype goes through one flat buffer.
    A model whose tensors have not changed since its last broadcast is not sent again.
    """
    started = time.perf_counter()
    tensors = [tensor for _, tensor in _state_tensors(model, optimizer)
               if not isinstance(tensor, DTensor) and tensor.device.type != "meta"]
    if not dist.is_initialized() or dist.get_world_size() == 1 or not tensors:
        return BroadcastReport(0, 0, 0, 0.0)
    stamp = tuple((id(tensor), tensor._version) for tensor in tensors)
    if _SYNCED.get(model) == stamp:
        return BroadcastReport(0, 0, 0, 0.0)
    calls, sent = broadcast_storages(tensors, device)
    _SYNCED[model] = tuple((id(tensor), tensor._version) for tensor in tensors)
    report = BroadcastReport(len(tensors), sent, calls, time.perf_counter() - started)
    log.info("%s", report.describe())
    return report


def broadcast_storages(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[int, int]:
    """Overwrite the storage of every tensor with rank 0's, each storage once (collective; returns calls, bytes).

    Storages travel as bytes, coalesced into flat buffers, so tensors that share storage (views, tied
    weights, expanded tensors whose elements overlap) stay consistent and every dtype shares the buffers.
    """
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages.setdefault((storage.device, storage.data_ptr()), storage)
    calls = sent = 0
    for bucket in _buckets([_as_bytes(storage) for storage in storages.values()]):
        flat = torch.cat([raw.to(device) for raw in bucket])
        dist.broadcast(flat, src=0)
        calls, sent = calls + 1, sent + flat.numel()
        offset = 0
        with torch.no_grad():
            for raw in bucket:
                raw.copy_(flat[offset:offset + raw.numel()])
                offset += raw.numel()
    return calls, sent


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage (writes go into it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype into buckets of at most :data:`BROADCAST_BUCKET_BYTES` (a larger tensor goes alone)."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        members, filled = open_bucket.get(tensor.dtype, ([], 0))
        if members and filled + size > BROADCAST_BUCKET_BYTES:
            buckets.append(members)
            members, filled = [], 0
        open_bucket[tensor.dtype] = (members + [tensor], filled + size)
    buckets += [members for members, _ in open_bucket.values() if members]
    return buckets


def broadcast_rng_state(device: torch.device) -> None:
    """Give every rank rank 0's generator state for ``device`` (collective: about 5 KB on the CPU, 16 B on CUDA).

    A compiled step's random ops (dropout) draw each value as a single device would and every rank keeps its
    slice, which is only consistent if every rank's generator is where rank 0's is. Called before each step
    that draws random numbers, so that code between steps that draws differently per rank (augmentation of
    rank-local batches, unseeded processes) cannot make the ranks disagree.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device).to(device)
        dist.broadcast(state, src=0)
        torch.cuda.set_rng_state(state.cpu(), device)
    else:
        state = torch.get_rng_state()
        dist.broadcast(state, src=0)
        torch.set_rng_state(state)


# -- the batch ---------------------------------------------------------------------

_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)  # the 64-bit golden-ratio constant, as a signed int64


def batch_fingerprints(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per leaf, an order-sensitive checksum of its bytes (int64 arithmetic wraps) and its element count.

    Every byte is weighted by a different odd multiplier of its position, so reordered rows
    (a sampler shuffled differently on two ranks) change the checksum as different values do.
    """
    rows = []
    for leaf in leaves:
        data = leaf.detach().contiguous().reshape(-1)
        raw = (data.view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)).to(torch.int64)
        positions = torch.arange(raw.numel(), dtype=torch.int64, device=raw.device)
        weights = positions * _MULTIPLIER + 0x632BE5AB
        rows.append(torch.stack([(raw * (weights | 1)).sum(), torch.tensor(leaf.numel(), device=raw.device)]).cpu())
    return torch.stack(rows) if rows else torch.zeros((0, 2), dtype=torch.int64)


def check_same_batch(leaves: Sequence[torch.Tensor], paths: Sequence[str], device: torch.device) -> None:
    """Stop with an error naming the first leaf that differs between ranks (collective: an all-gather of checksums)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not leaves:
        return
    mine = batch_fingerprints(leaves).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    for index, path in enumerate(paths):
        differing = [rank for rank, theirs in enumerate(everyone) if not torch.equal(theirs[index], everyone[0][index])]
        if differing:
            raise RunInputError(
                f"the batch differs between ranks: batch{path} on rank(s) {differing} is not rank 0's. A compiled step "
                "takes the global batch, the same on every rank: seed the data pipeline alike on every rank "
                "(torch.manual_seed / a DataLoader generator), or give each rank its own slice and compile with "
                "metadist.compile(batch='local')"
            )


def local_batch_shapes(leaves: Sequence[torch.Tensor], paths: Sequence[str]) -> list[tuple[int, ...]]:
    """Global shapes of rank-local batch leaves (dim 0 concatenated over the ranks); all ranks must agree."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = [tuple(leaf.shape) for leaf in leaves]
    everyone: list = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    for index, path in enumerate(paths):
        shapes = [theirs[index] for theirs in everyone]
        if not mine[index]:
            raise RunInputError(f"batch{path} is a 0-dim tensor; with batch='local' every leaf is split along dim 0")
        if len(set(shapes)) != 1:
            raise RunInputError(
                f"with batch='local' every rank passes a slice of the same shape; batch{path} has shapes {shapes} on "
                "ranks 0..N-1. Drop the last incomplete batch (DataLoader(drop_last=True)) or pad it"
            )
    return [(shape[0] * world,) + shape[1:] for shape in mine]


def gather_batch_dim0(leaf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The global leaf from every rank's slice along dim 0, in rank order (collective)."""
    local = leaf.to(device).contiguous()
    world = dist.get_world_size()
    whole = torch.empty((local.shape[0] * world,) + tuple(local.shape[1:]), dtype=local.dtype, device=device)
    dist.all_gather_into_tensor(whole, local)
    return whole
