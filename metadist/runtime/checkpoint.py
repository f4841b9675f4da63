"""State at the boundary: the step's shards as DTensors, saved and loaded with torch.distributed.checkpoint.

The plan's sharding of each state tensor maps one to one onto DTensor
placements on the step's ``DeviceMesh``: ``Shard(d)`` on a mesh axis is
DTensor's ``Shard(d)`` on that mesh dim, ``Replicate`` is ``Replicate``
(state never starts ``Partial``). Nested shards of one dim follow mesh-axis
order in both. The DTensors wrap the step's own local tensors, so DCP's
in-place load writes straight into the running state.

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

__all__ = ["dtensor_placements", "load_checkpoint", "save_checkpoint", "sharded_state_dict"]


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


def sharded_state_dict(step: "CompiledStep") -> dict[str, DTensor]:
    """Every parameter, buffer and optimizer state of ``step`` as a DTensor over its local shard (no copy)."""
    step._require_state()
    result = {}
    for name, local in step._state.items():
        if step._slots[name].kind == "constant":
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
    staged = {name: DTensor.from_local(tensor.to_local().clone(), tensor.device_mesh, tensor.placements, run_check=False,
                                       shape=tensor.shape, stride=tensor.stride())
              for name, tensor in state.items()}
    try:
        dcp.load(staged, checkpoint_id=os.fspath(path))
    except Exception as err:  # DCP's CheckpointException lists every rank's failure; say what to do
        raise RunInputError(f"loading the checkpoint at {os.fspath(path)!r} failed: {err}. It must hold every parameter, "
                            "buffer and optimizer state of this step with the same global shapes") from err
    for name, tensor in staged.items():
        step._state[name].copy_(tensor.to_local())

