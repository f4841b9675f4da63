"""State at the boundary: the step's shards as DTensors, saved and loaded with torch.distributed.checkpoint.

The plan's sharding of each state tensor maps one to one onto DTensor
placements on the step's ``DeviceMesh``: ``Shard(d)`` on a mesh axis is
DTensor's ``Shard(d)`` on that mesh dim, ``Replicate`` is ``Replicate``
(state never starts ``Partial``). Nested shards of one dim follow mesh-axis
order in both. The DTensors wrap the very local tensors the user's model and optimizer hold
(:mod:`.model_state`); a load is staged in copies and written into them only
once every tensor has loaded.

A checkpoint saved under one plan loads under another (another mesh shape
or other shardings): DCP reshards by global offsets.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from ..ir import Replicate, Shard
from ..lowering import contiguous_strides
from .errors import RunInputError

if TYPE_CHECKING:
    from .step import CompiledStep

__all__ = ["dtensor_placements", "load_checkpoint", "metadist_sharding", "save_checkpoint", "sharded_state_dict"]


def dtensor_placements(sharding: tuple) -> tuple:
    """DTensor placements for a MetaIR sharding of a state tensor (one per mesh axis)."""
    placements = []
    for placement in sharding:
        if isinstance(placement, Shard):
            placements.append(TorchShard(placement.dim))
        elif isinstance(placement, Replicate):
            placements.append(TorchReplicate())
        else:
            raise RunInputError(f"state in {placement} has no DTensor placement here; state starts Shard or Replicate")
    return tuple(placements)


def metadist_sharding(placements: tuple) -> tuple:
    """The MetaIR sharding of DTensor placements (``Shard``/``Replicate``; state is never ``Partial``)."""
    sharding = []
    for placement in placements:
        if isinstance(placement, TorchShard):
            sharding.append(Shard(placement.dim))
        elif isinstance(placement, TorchReplicate):
            sharding.append(Replicate())
        else:
            raise RunInputError(f"state placed as {placement} cannot be planned from; state lies Shard or Replicate")
    return tuple(sharding)


def sharded_state_dict(step: "CompiledStep") -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer state of ``step`` as a DTensor over its local shard (no copy).

    Keyed by graph input name (``name`` for parameters and buffers, ``name:key`` for optimizer states);
    the values are the very tensors the model and the optimizer hold. A 0-dim optimizer state (the step
    count) is replicated and stays a plain tensor, as torch keeps it.
    """
    binding = step.binding
    result = {}
    for name, slot in step._slots.items():
        if slot.kind not in ("param", "buffer", "state"):
            continue
        local = binding.read(name)
        if local.dim() == 0 and slot.kind == "state":
            result[name] = local
            continue
        program_input = step._program_inputs[name]
        shape = torch.Size(program_input.spec.shape)
        result[name] = DTensor.from_local(
            local, step.device_mesh, dtensor_placements(program_input.sharding), run_check=False,
            shape=shape, stride=contiguous_strides(shape),
        )
    return result


def save_checkpoint(step: "CompiledStep", path: str | os.PathLike) -> None:
    """Save the step's state to the DCP checkpoint directory ``path`` (collective: every rank calls it)."""
    dcp.save(sharded_state_dict(step), checkpoint_id=os.fspath(path))


def load_checkpoint(step: "CompiledStep", path: str | os.PathLike) -> None:
    """Load the step's state from the DCP checkpoint at ``path`` into its shards (collective).

    Every state tensor of the step must be in the checkpoint with the same
    global shape; a missing or misshapen one is an error and the state is
    left as it was.
    """
    if not os.path.isfile(os.path.join(os.fspath(path), ".metadata")):
        raise RunInputError(f"{os.fspath(path)!r} is not a complete checkpoint (no .metadata): save one with save_checkpoint")
    state = sharded_state_dict(step)
    staged = {name: _staged_copy(tensor) for name, tensor in state.items()}
    try:
        dcp.load(staged, checkpoint_id=os.fspath(path))
    except Exception as err:  # DCP's CheckpointException lists every rank's failure; say what to do
        raise RunInputError(f"loading the checkpoint at {os.fspath(path)!r} failed: {err}. It must hold every parameter, "
                            "buffer and optimizer state of this step with the same global shapes") from err
    with torch.no_grad():
        for name, tensor in staged.items():
            step.binding.read(name).copy_(tensor.to_local() if isinstance(tensor, DTensor) else tensor)


def _staged_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy to load into, so that a failed load leaves the running state as it was."""
    if not isinstance(tensor, DTensor):
        return tensor.clone()
    return DTensor.from_local(tensor.to_local().clone(), tensor.device_mesh, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())

