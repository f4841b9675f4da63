"""Resharding on torch.distributed: functional collectives on one mesh axis, with a byte counter.

:class:`Collectives` is an ``nn.Module`` so that a rank's ``GraphModule``
holds it as the submodule ``comm`` and calls its methods from generated code.
Each method runs one functional collective on the process group of one mesh
axis (``DeviceMesh.get_group(axis)``, passed by name) and records the bytes
this rank sends, by the ring convention of :mod:`metadist.lowering.reshard`,
so that measured bytes can be compared with the plan's prediction.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from ..lowering import ReshardStep, comm_bytes

__all__ = ["Collectives", "CommRecord", "local_slice", "zero_partial", "run_steps"]


@dataclass(frozen=True)
class CommRecord:
    """Collectives executed so far of one (phase, kind, axis): how many, and the bytes this rank sent."""

    count: int
    bytes: int


class Collectives(torch.nn.Module):
    """The collectives of one rank, one process group per mesh axis, counting what they move."""

    def __init__(self, group_names: Sequence[str], axis_sizes: Sequence[int]) -> None:
        super().__init__()
        self.group_names = tuple(group_names)
        self.axis_sizes = tuple(axis_sizes)
        self.records: dict[tuple[str, str, int], CommRecord] = {}
        self.phase = "step"

    @staticmethod
    def from_device_mesh(device_mesh: DeviceMesh) -> "Collectives":
        groups = [device_mesh.get_group(axis).group_name for axis in range(device_mesh.ndim)]
        return Collectives(groups, tuple(device_mesh.shape))

    @contextlib.contextmanager
    def counting_as(self, phase: str) -> Iterator[None]:
        """Count the collectives inside under ``phase`` (e.g. ``"boundary"`` for gathers outside the step)."""
        saved, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = saved

    def reset(self) -> None:
        self.records.clear()

    def _record(self, kind: str, axis: int, bytes_in: int, bytes_out: int) -> None:
        key = (self.phase, kind, axis)
        old = self.records.get(key, CommRecord(0, 0))
        sent = comm_bytes(kind, self.axis_sizes[axis], bytes_in, bytes_out)
        self.records[key] = CommRecord(old.count + 1, old.bytes + sent)

    def all_gather(self, tensor: torch.Tensor, axis: int, dim: int) -> torch.Tensor:
        out = funcol.wait_tensor(funcol.all_gather_single(tensor.contiguous(), dim, self.group_names[axis]))
        self._record("all_gather", axis, _nbytes(tensor), _nbytes(out))
        return out

    def all_reduce(self, tensor: torch.Tensor, axis: int, op: str) -> torch.Tensor:
        out = funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), op, self.group_names[axis]))
        self._record("all_reduce", axis, _nbytes(tensor), _nbytes(out))
        return out

    def reduce_scatter(self, tensor: torch.Tensor, axis: int, op: str, dim: int) -> torch.Tensor:
        out = funcol.wait_tensor(funcol.reduce_scatter_single(tensor.contiguous(), op, dim, self.group_names[axis]))
        self._record("reduce_scatter", axis, _nbytes(tensor), _nbytes(out))
        return out

    def all_to_all(self, tensor: torch.Tensor, axis: int, gather_dim: int, split_dim: int) -> torch.Tensor:
        """``Shard(gather_dim) -> Shard(split_dim)`` on one axis: send piece r of ``split_dim`` to rank r."""
        size = self.axis_sizes[axis]
        pieces = torch.stack(tensor.chunk(size, dim=split_dim), dim=0).contiguous()  # (k, ..., n_split/k, ...)
        received = funcol.wait_tensor(funcol.all_to_all_single(pieces, None, None, self.group_names[axis]))
        out = torch.cat(received.unbind(0), dim=gather_dim)  # (..., n_gather, ..., n_split/k, ...)
        self._record("all_to_all", axis, _nbytes(tensor), _nbytes(out))
        return out


def local_slice(tensor: torch.Tensor, dim: int, coordinate: int, parts: int) -> torch.Tensor:
    """This rank's piece ``coordinate`` of ``parts`` along ``dim`` (a copy, so the whole can be freed)."""
    length = tensor.shape[dim] // parts
    return tensor.narrow(dim, coordinate * length, length).clone()


def zero_partial(tensor: torch.Tensor, coordinate: int) -> torch.Tensor:
    """``Replicate -> Partial(sum)``: coordinate 0 keeps the value, the others hold zeros."""
    return tensor if coordinate == 0 else torch.zeros_like(tensor)


def run_steps(comm: Collectives, tensor: torch.Tensor, steps: Sequence[ReshardStep]) -> torch.Tensor:
    """Apply resharding steps eagerly (outside a GraphModule)."""
    for step in steps:
        tensor = apply_step(comm, tensor, step)
    return tensor


def apply_step(comm: Collectives, tensor: torch.Tensor, step: ReshardStep) -> torch.Tensor:
    """One resharding step on a concrete tensor."""
    if step.kind == "all_gather":
        return comm.all_gather(tensor, step.axis, step.dim)
    if step.kind == "all_reduce":
        return comm.all_reduce(tensor, step.axis, step.op)
    if step.kind == "reduce_scatter":
        return comm.reduce_scatter(tensor, step.axis, step.op, step.dim)
    if step.kind == "all_to_all":
        return comm.all_to_all(tensor, step.axis, step.dim, step.split_dim)
    if step.kind == "local_slice":
        return local_slice(tensor, step.dim, step.coordinate, step.axis_size)
    if step.kind == "zero_partial":
        return zero_partial(tensor, step.coordinate)
    raise ValueError(f"unknown resharding step kind {step.kind!r}")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
