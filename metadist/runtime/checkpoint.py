"""State at the boundary: the step's shards as DTensors, saved and loaded with torch.distributed.checkpoint.

The plan's sharding of each state tensor maps one to one onto DTensor
placements on the step's ``DeviceMesh``: ``Shard(d)`` on a mesh axis is
DTensor's ``Shard(d)`` on that mesh dim, ``Replicate`` is ``Replicate``
(state never starts ``Partial``). Nested shards of one dim follow mesh-axis
order in both. The DTensors wrap the very local tensors the user's model and optimizer hold
(:mod:`.model_state`); a load is staged in copies and written into them only
once every tensor has loaded.

Checkpoints hold ``{"model": ..., "optim": ...}`` as
``torch.distributed.checkpoint.state_dict`` gives them for the user's model and
optimizer (the torchtitan layout), so a checkpoint written by plain DCP calls
loads into a MetaDist run and the other way round. A checkpoint saved under one
plan loads under another (another mesh shape or other shardings): DCP reshards
by global offsets. A save goes to a partial directory renamed at the end, so a
save cut short by a dying process never looks complete.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from ..ir import Replicate, Shard
from ..lowering import contiguous_strides
from .errors import RunInputError

if TYPE_CHECKING:
    from .step import CompiledStep

__all__ = ["dtensor_placements", "load_checkpoint", "metadist_sharding", "require_complete", "save_checkpoint",
           "save_state_atomically", "sharded_state_dict", "training_state_dict"]


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


def training_state_dict(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as torch.distributed.checkpoint.state_dict gives them (FQN keys, DTensor values).

    The layout torchtitan and plain DCP users write, so checkpoints move freely between a MetaDist run and
    code that calls DCP on the model and optimizer itself.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_checkpoint(step: "CompiledStep", path: str | os.PathLike, extra: dict | None = None) -> None:
    """Save the model's and optimizer's state (and ``extra`` entries) to the DCP directory ``path`` (collective).

    Written to a partial directory beside ``path`` and renamed when every rank has finished, so a directory
    at ``path`` is always a complete checkpoint; an older checkpoint at ``path`` is replaced only then.
    """
    binding = step.binding
    state = training_state_dict(binding.model, binding.optimizer)
    state.update(extra or {})
    save_state_atomically(state, path)


def save_state_atomically(state: dict, path: str | os.PathLike, *, overwrite: bool = True) -> None:
    """``dcp.save(state)`` into ``path`` through a partial directory renamed at the end (collective).

    Every rank must see the same filesystem at ``path`` (one machine, or a shared filesystem across machines).
    """
    import shutil

    import torch.distributed as dist

    final = Path(path)
    partial = final.parent / f".{final.name}.partial"
    is_coordinator = not dist.is_initialized() or dist.get_rank() == 0
    if final.exists() and not overwrite:
        raise RunInputError(f"{str(final)!r} exists; nothing was written. Choose another path or remove it first")
    if is_coordinator:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
    _barrier()
    dcp.save(state, checkpoint_id=os.fspath(partial))
    _barrier()
    if is_coordinator:
        retired = final.parent / f".{final.name}.old"
        if final.exists():
            shutil.rmtree(retired, ignore_errors=True)
            final.rename(retired)
        partial.rename(final)
        shutil.rmtree(retired, ignore_errors=True)
    _barrier()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def require_complete(path: str | os.PathLike) -> None:
    """A clear error unless ``path`` is a complete DCP checkpoint directory."""
    where = os.fspath(path)
    if not os.path.isdir(where):
        raise RunInputError(f"no checkpoint at {where!r}: the directory does not exist")
    if not os.path.isfile(os.path.join(where, ".metadata")):
        raise RunInputError(f"{where!r} is not a complete checkpoint (no .metadata): it was never finished; "
                            "load an earlier checkpoint")


def load_checkpoint(step: "CompiledStep", path: str | os.PathLike, extra: dict | None = None) -> None:
    """Load the model's and optimizer's state (and ``extra`` entries, in place) from the DCP checkpoint at ``path``.

    The checkpoint may come from another plan, mesh or world size (DCP reshards by global offsets), or from
    plain DCP calls on a model and optimizer (``training_state_dict``'s layout). Everything is loaded into
    copies first: a checkpoint that lacks a tensor of this model or holds another shape is an error that
    leaves the running state as it was.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    require_complete(path)
    binding = step.binding
    staged = {key: _staged(value) for key, value in training_state_dict(binding.model, binding.optimizer).items()}
    staged.update(extra or {})
    try:
        dcp.load(staged, checkpoint_id=os.fspath(path))
    except (Exception, CheckpointException) as err:  # CheckpointException (a BaseException) lists every rank's failure
        raise RunInputError(
            f"loading the checkpoint at {os.fspath(path)!r} failed: {_first_line(err)}. It must hold every parameter, "
            "buffer and optimizer state of this model with the same global shapes (was it saved from another model?)"
        ) from err
    set_model_state_dict(binding.model, staged["model"])
    if binding.optimizer is not None:
        set_optimizer_state_dict(binding.model, binding.optimizer, staged["optim"])


def _first_line(err: BaseException) -> str:
    failures = getattr(err, "failures", None)  # CheckpointException: rank -> the exception it raised
    if failures:
        rank, cause = sorted(failures.items())[0]
        return f"rank {rank}: {type(cause).__name__}: {_first_line(cause)}"
    text = str(err).strip()
    return text.splitlines()[0][:500] if text else type(err).__name__


def _staged(value: Any) -> Any:
    """A deep copy to load into (tensors cloned, DTensors as DTensors), so that a failed load changes nothing."""
    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local().clone(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _staged(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_staged(item) for item in value]
    return value
