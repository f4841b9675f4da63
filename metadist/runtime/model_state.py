"""The user's model and optimizer hold the training state, sharded in place (the FSDP2 convention).

When a step is compiled, every parameter and buffer the step reads is replaced,
in the user's model, by a DTensor on the plan's ``DeviceMesh`` and placements
whose local tensor is this rank's shard; the optimizer's ``param_groups`` refer
to the new parameters and its ``state`` holds DTensors of the same shardings
(the step count, a 0-dim replicated value, stays a plain tensor as in FSDP2).
The full tensors are dropped. So ``model.state_dict()``,
``optimizer.state_dict()``, ``model.named_parameters()`` and
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` are current
after every step, with nothing to call.

A compiled step reads its inputs from these DTensors at every call
(:meth:`StateBinding.read`) and writes the updated shards back by rebinding each
DTensor's local tensor (:meth:`StateBinding.write`): the rank program is
functional, so its outputs are new tensors, and rebinding costs nothing where a
copy would stream the whole state through memory once per step. FSDP2 reaches
into ``DTensor._local_tensor`` the same way; it is the one private attribute
this module relies on. Hence a reference the user holds to ``param.to_local()``
is the shard of that moment, not a live view; ``param`` itself stays current.

In-place changes the user makes between steps (``with torch.no_grad():
p.mul_(0.5)``, ``dcp.load``, ``set_model_state_dict``) write into the local
tensors and are picked up by the next call. A parameter *replaced* by another
object is refused with an error that says how to do it instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..lowering import contiguous_strides
from .errors import RunInputError

__all__ = ["Holder", "StateBinding", "StateSlot", "as_dtensor", "holders_of", "install", "is_sharded_here", "place", "set_local"]


@dataclass(frozen=True)
class Holder:
    """One place a parameter or buffer lives: ``module._parameters[attr]`` or ``module._buffers[attr]``."""

    module: nn.Module
    kind: str
    """``param`` or ``buffer``."""
    attr: str

    def get(self) -> torch.Tensor | None:
        table = self.module._parameters if self.kind == "param" else self.module._buffers
        return table.get(self.attr)

    def set(self, tensor: torch.Tensor) -> None:
        table = self.module._parameters if self.kind == "param" else self.module._buffers
        table[self.attr] = tensor


def holders_of(model: nn.Module) -> dict[tuple[str, str], list[Holder]]:
    """``(kind, name)`` -> every place that tensor lives, named as ``named_parameters``/``named_buffers`` name it.

    A tied weight (one tensor held by several modules) is one entry with several holders.
    """
    canonical: dict[tuple[str, int], str] = {}
    for name, param in model.named_parameters():
        canonical.setdefault(("param", id(param)), name)
    for name, buffer in model.named_buffers():
        canonical.setdefault(("buffer", id(buffer)), name)
    result: dict[tuple[str, str], list[Holder]] = defaultdict(list)
    for module in model.modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                if tensor is None:
                    continue
                name = canonical.get((kind, id(tensor)))
                if name is not None:
                    result[(kind, name)].append(Holder(module, kind, attr))
    return dict(result)


def is_sharded_here(tensor: Any, device_mesh: DeviceMesh) -> bool:
    """Whether ``tensor`` is a DTensor on ``device_mesh``."""
    return isinstance(tensor, DTensor) and tensor.device_mesh == device_mesh


def set_local(tensor: DTensor, local: torch.Tensor, slot: StateSlot) -> None:
    """Make ``local`` the local shard of ``tensor`` (same shape, dtype and device; see the module docstring).

    ``slot``, the input the tensor fills, names it in the error (named only then: a compiled step rebinds every state
    tensor at every call)."""
    current = tensor._local_tensor
    if local.shape != current.shape or local.dtype != current.dtype or local.device != current.device:
        what = f"optimizer state {slot.state_key!r} of {slot.key!r}" if slot.kind == "state" else f"{slot.kind} {slot.key!r}"
        raise RunInputError(
            f"internal: the new shard of {what} is {tuple(local.shape)} {local.dtype} on {local.device}, "
            f"the held one {tuple(current.shape)} {current.dtype} on {current.device}"
        )
    _rebind(tensor, local)


def _rebind(tensor: DTensor, local: torch.Tensor) -> None:
    tensor._local_tensor = local if local.is_contiguous() else local.contiguous()


def as_dtensor(local: torch.Tensor, device_mesh: DeviceMesh, placements: tuple, global_shape: tuple[int, ...]) -> DTensor:
    """A DTensor over this rank's ``local`` shard of a tensor of ``global_shape`` (no copy, no collective)."""
    shape = torch.Size(global_shape)
    return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=shape,
                              stride=contiguous_strides(shape))


@dataclass(frozen=True)
class StateSlot:
    """One state input of a compiled step, where it lives, and how it is sharded."""

    name: str
    kind: str
    """``param``, ``buffer`` or ``state``."""
    key: str
    """The parameter or buffer name (for a state: its parameter's)."""
    state_key: str
    placements: tuple
    """DTensor placements on the step's mesh."""
    shape: tuple[int, ...]
    """The global shape."""


class StateBinding:
    """The state inputs of one compiled step, bound to one model and optimizer.

    Built after :meth:`install` (or for a model already holding DTensors on the
    same mesh and placements); :meth:`read` gives the local shards in program
    order, :meth:`write` rebinds them to the step's outputs.
    """

    def __init__(self, model: nn.Module, optimizer: Any, device_mesh: DeviceMesh, slots: list[StateSlot]) -> None:
        """``slots``: the step's state inputs; the model must hold them as DTensors (see :func:`install`)."""
        self.model, self.optimizer, self.device_mesh = model, optimizer, device_mesh
        holders = holders_of(model)
        self._holders = {slot.name: holders[(slot.kind, slot.key)] for slot in slots if slot.kind in ("param", "buffer")}
        self._tables = {name: tuple((holder.module._parameters if holder.kind == "param" else holder.module._buffers,
                                     holder.attr, holder) for holder in entry)
                        for name, entry in self._holders.items()}
        """Per parameter or buffer input: the ``(table, attr, holder)`` of each place it lives (read at every call)."""
        self._tensors: dict[str, torch.Tensor] = {}
        for slot in slots:
            if slot.kind in ("param", "buffer"):
                self._tensors[slot.name] = self._holders[slot.name][0].get()
        self._slots = {slot.name: slot for slot in slots}
        self._written: dict[str, DTensor] = {}
        """Per state input, the DTensor it was last written to (checked then; a tensor the optimizer holds anew, as
        after ``load_state_dict``, is checked again)."""
        self._placed: dict[str, DTensor] = {}
        """Per state input: the optimizer's DTensor last found placed as the step needs it. While the optimizer
        holds that very object it is read as it is (a DTensor's shape and placements do not change)."""

    def param(self, key: str) -> torch.Tensor:
        """The bound parameter named ``key`` (a DTensor after install)."""
        return self._tensors[key]

    def read(self, name: str) -> torch.Tensor:
        """The local shard of the state input ``name``, as the model or optimizer holds it now."""
        slot = self._slots[name]
        if slot.kind == "state":
            return self._state_local(slot)
        expected = self._tensors[name]
        for table, attr, holder in self._tables[name]:
            if table.get(attr) is not expected:
                raise _replaced_error(slot, holder)
        return expected._local_tensor

    def write(self, name: str, local: torch.Tensor) -> None:
        """Rebind the state input ``name`` to its updated shard ``local``.

        The first write into each held DTensor checks the shard's shape, dtype and device against the held one
        (through :func:`set_local`); the program's outputs are the same at every call, so later writes only rebind."""
        slot = self._slots[name]
        if slot.kind == "state":
            state = self.optimizer.state[self._tensors[slot.key]]
            held = state[slot.state_key]
            if not isinstance(held, DTensor):
                state[slot.state_key] = local
                return
        else:
            held = self._tensors[name]
        if self._written.get(name) is held:
            _rebind(held, local)
        else:
            set_local(held, local, slot)
            self._written[name] = held

    def _state_local(self, slot: StateSlot) -> torch.Tensor:
        """The local shard of an optimizer state, placed as the step needs it.

        ``optimizer.load_state_dict`` may have put other tensors there: full plain tensors or DTensors of
        other placements are resharded (no data leaves the rank for plain ones: each takes its slice).
        """
        state = self.optimizer.state.get(self._tensors[slot.key])
        held = None if state is None else state.get(slot.state_key)
        if held is not None and held is self._placed.get(slot.name):
            return held._local_tensor
        if state is None or slot.state_key not in state:
            raise RunInputError(
                f"the optimizer holds no {slot.state_key!r} state for parameter {slot.key!r} any more (was its state "
                "cleared or loaded from another optimizer?); load a state dict of this optimizer, or compile again"
            )
        tensor = state[slot.state_key]
        if len(slot.shape) == 0:
            return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if tuple(tensor.shape) != slot.shape:
            raise RunInputError(
                f"optimizer state {slot.state_key!r} of {slot.key!r} has shape {tuple(tensor.shape)}, the parameter "
                f"{slot.shape}; was the state loaded from another model?"
            )
        if not is_sharded_here(tensor, self.device_mesh) or tuple(tensor.placements) != slot.placements:
            tensor = place(tensor, self.device_mesh, slot.placements)
            state[slot.state_key] = tensor
        if isinstance(tensor, DTensor):
            self._placed[slot.name] = tensor
        return tensor._local_tensor


def place(tensor: torch.Tensor, device_mesh: DeviceMesh, placements: tuple) -> DTensor:
    """``tensor`` (a full tensor present on every rank, or a DTensor) as a DTensor of ``placements``.

    A full tensor is taken as replicated and each rank keeps its slice (no collective).
    """
    from torch.distributed.tensor import Replicate

    if not isinstance(tensor, DTensor):
        tensor = DTensor.from_local(tensor, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
    elif tensor.device_mesh != device_mesh:
        tensor = DTensor.from_local(tensor.full_tensor(), device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
    return tensor.redistribute(device_mesh, placements)


def _replaced_error(slot: StateSlot, holder: Holder) -> RunInputError:
    return RunInputError(
        f"{slot.kind} {slot.key!r} was replaced by another tensor object between steps (at "
        f"{type(holder.module).__name__}.{holder.attr}); the compiled step keeps the model's state in place. Change "
        "values in place instead (with torch.no_grad(): param.copy_(...), or set_model_state_dict), or build a new "
        "model and compile a new step for it"
    )


def install(
    model: nn.Module,
    optimizer: Any,
    device_mesh: DeviceMesh,
    shards: list[tuple[StateSlot, torch.Tensor]],
) -> None:
    """Put the shards into the model and the optimizer as DTensors.

    ``shards``: each state input with this rank's local shard. Parameters are
    replaced in every module that holds them (tied weights stay tied), the optimizer's ``param_groups``
    and ``state`` are re-keyed to the new parameters, and the old full tensors are dropped.
    """
    holders = holders_of(model)
    replaced: dict[int, nn.Parameter] = {}
    states: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for slot, local in shards:
        if slot.kind == "state":
            value = local if len(slot.shape) == 0 else as_dtensor(local, device_mesh, slot.placements, slot.shape)
            states[slot.key][slot.state_key] = value
            continue
        entry = holders[(slot.kind, slot.key)]
        old = entry[0].get()
        tensor = as_dtensor(local, device_mesh, slot.placements, slot.shape)
        if slot.kind == "param":
            tensor = nn.Parameter(tensor, requires_grad=old.requires_grad)
            replaced[id(old)] = tensor
        for holder in entry:
            holder.set(tensor)
    if optimizer is not None:
        _rekey_optimizer(optimizer, replaced, states, dict(model.named_parameters()))


def _rekey_optimizer(optimizer: Any, replaced: dict[int, nn.Parameter], states: dict[str, dict], params_by_name: dict) -> None:
    """The optimizer's groups and state follow the replaced parameters; state entries not placed anew are kept."""
    old_state = optimizer.state
    name_of = {id(param): name for name, param in params_by_name.items()}
    new_state: defaultdict = defaultdict(dict)
    for group in optimizer.param_groups:
        new_params = []
        for param in group["params"]:
            new = replaced.get(id(param), param)
            new_params.append(new)
            merged = dict(old_state.get(param, {}))
            merged.update(states.get(name_of.get(id(new), ""), {}))
            if merged:
                new_state[new] = merged
        group["params"] = new_params
    optimizer.state = new_state
