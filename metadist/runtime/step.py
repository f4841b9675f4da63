"""``CompiledStep``: one distributed training step, run from the user's model, optimizer and batch.

On the first call the step takes the full state from the model and the
optimizer (params, buffers, optimizer states; every rank slices its shard of
the full tensors) and keeps the shards between steps: updated state never
leaves its shards, so the model and optimizer are not touched until
:meth:`CompiledStep.write_back`. Every call slices the rank's piece of the
global batch. The loss (and any other user output) comes back whole.

Weights: a model on a real device is sharded from its full tensors. A model
on the meta device is initialised one module at a time
(:func:`metadist.frontends.torch.materialize.iter_materialized`): each rank
keeps only its shards of each module's tensors, with exactly the values
``materialize(model)`` gives on one device; fresh optimizer state is created
as local zeros. The model itself stays on ``meta``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh

from ..frontends.torch import TorchStep
from ..frontends.torch.materialize import has_meta_tensors, iter_materialized
from ..ir import Replicate, Role, Shard
from ..ir.plan import Plan
from ..lowering import ProgramInput, RankProgram, lower, plan_resharding
from .collectives import Collectives, run_steps
from .errors import RunInputError, RuntimeSetupError
from .graph_module import CheckingInterpreter, build_rank_module

__all__ = ["CompiledStep", "shard_full_tensor"]

log = logging.getLogger(__name__)

_STATE_KINDS = ("param", "buffer", "state", "constant")


class CompiledStep:
    """The distributed step of one rank: lowered program, its GraphModule, and the state shards."""

    def __init__(
        self,
        torch_step: TorchStep,
        plan: Plan,
        device_mesh: DeviceMesh,
        *,
        metadist_version: str,
        check_shapes: bool = False,
        compile_backend: str | None = None,
        init_seed: int = 0,
        init_fn: Callable[[torch.nn.Module], None] | None = None,
        bucket_cap_bytes: int | None = None,
        overlap: bool = True,
    ) -> None:
        """``check_shapes`` runs the program op by op and names the MetaIR node that fails (slower);
        ``compile_backend`` runs it through ``torch.compile`` with that backend (e.g. ``inductor`` on GPUs);
        ``init_seed`` and ``init_fn`` initialise a meta-device model (see :func:`iter_materialized`);
        ``bucket_cap_bytes`` caps the lowering's coalesced collectives (None: the default, 0: no coalescing);
        ``overlap`` issues each collective early and waits for it right before its first reader (False: each
        runs to completion where it stands)."""
        if check_shapes and compile_backend:
            raise RunInputError("check_shapes runs the program op by op; it cannot be combined with torch.compile")
        plan.check_for(torch_step.graph, metadist_version)
        if tuple(device_mesh.shape) != plan.mesh.shape:
            raise RuntimeSetupError(
                f"the plan is for a {plan.mesh} mesh but the device mesh is {tuple(device_mesh.shape)}; "
                "plan for this mesh or launch with the plan's mesh"
            )
        self.torch_step = torch_step
        self.plan = plan
        self.device_mesh = device_mesh
        self.coords = tuple(device_mesh.get_coordinate())
        self.program: RankProgram = lower(torch_step.graph, plan, self.coords, bucket_cap_bytes=bucket_cap_bytes,
                                          overlap=overlap)
        self.comm = Collectives.from_device_mesh(device_mesh)
        self.device = _device_of(device_mesh)
        self.module = build_rank_module(self.program, self.comm, self.device, torch_step.contiguous_values)
        log.info("rank at %s: %d instructions, %d reshards, on %s", self.coords, len(self.program.instructions),
                 len(self.program.reshards()), self.device)
        self._state: dict[str, torch.Tensor] | None = None
        self._grads: dict[str, torch.Tensor] = {}
        self._slots = {slot.name: slot for slot in torch_step.slots}
        self._program_inputs = {program_input.name: program_input for program_input in self.program.inputs}
        self.check_shapes = check_shapes
        self.init_seed, self.init_fn = init_seed, init_fn
        self._forward = torch.compile(self.module, backend=compile_backend) if compile_backend else self.module

    # -- running -------------------------------------------------------------
    def __call__(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> Any:
        """Run one step; returns what the user's step returns (the loss), whole on every rank."""
        if self._state is None:
            self._state = self._load_state(model, optimizer, batch)
        inputs = self._inputs(batch)
        outputs = CheckingInterpreter(self.module).run(*inputs) if self.check_shapes else self._forward(*inputs)
        return self._store(outputs)

    def _load_state(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> dict[str, torch.Tensor]:
        if has_meta_tensors(model):
            return self._load_meta_state(model, optimizer)
        full = self.torch_step.gather_inputs(model, optimizer, batch)
        state = {}
        for program_input, tensor in zip(self.program.inputs, full):
            if self._slots[program_input.name].kind in _STATE_KINDS:
                state[program_input.name] = self._shard(tensor, program_input)
        return state

    def _shard(self, tensor: torch.Tensor, program_input: ProgramInput) -> torch.Tensor:
        return shard_full_tensor(tensor, program_input.sharding, self.plan.mesh.shape, self.coords).to(self.device)

    def _load_meta_state(self, model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
        """The state shards of a model with meta tensors: each unit materialised, sliced, dropped in turn."""
        by_key = {(slot.kind, slot.key): slot.name for slot in self.torch_step.slots if slot.kind in ("param", "buffer")}
        state: dict[str, torch.Tensor] = {}
        for item in iter_materialized(model, seed=self.init_seed, init_fn=self.init_fn):
            name = by_key.get((item.kind, item.name))
            if name is not None:  # tensors the step never reads are not inputs
                state[name] = self._shard(item.tensor, self._program_inputs[name])
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        for program_input in self.program.inputs:
            slot = self._slots[program_input.name]
            if slot.kind not in _STATE_KINDS or program_input.name in state:
                continue
            if slot.kind == "param":
                state[program_input.name] = self._shard(params[slot.key].detach(), program_input)
            elif slot.kind == "buffer":
                state[program_input.name] = self._shard(buffers[slot.key], program_input)
            elif slot.kind == "constant":
                state[program_input.name] = self._shard(self.torch_step.constants[slot.key], program_input)
            else:
                state[program_input.name] = self._fresh_state(optimizer, params[slot.key], slot, program_input)
        return state

    def _fresh_state(self, optimizer: Any, param: torch.Tensor, slot, program_input: ProgramInput) -> torch.Tensor:
        """Optimizer state of a meta parameter: the real existing state's shard, or torch's initial zeros, local."""
        existing = optimizer.state.get(param, {}) if optimizer is not None else {}
        tensor = existing.get(slot.state_key)
        if tensor is None:
            return torch.zeros(program_input.local_shape, dtype=getattr(torch, program_input.spec.dtype), device=self.device)
        if tensor.device.type == "meta":
            raise RuntimeSetupError(
                f"optimizer state {slot.state_key!r} of parameter {slot.key!r} is on the meta device and has no values; "
                "build the optimizer before its first step (MetaDist creates fresh state) or load real state"
            )
        return self._shard(tensor, program_input)

    def _inputs(self, batch: Any) -> list[torch.Tensor]:
        leaves = pytree.tree_flatten(batch)[0]
        inputs = []
        for program_input in self.program.inputs:
            slot = self._slots[program_input.name]
            if slot.kind != "batch":
                inputs.append(self._state[program_input.name])
                continue
            leaf = leaves[slot.index] if slot.index < len(leaves) else None
            if not isinstance(leaf, torch.Tensor) or tuple(leaf.shape) != program_input.spec.shape:
                got = "nothing" if leaf is None else f"{type(leaf).__name__} {tuple(getattr(leaf, 'shape', ()))}"
                raise RunInputError(
                    f"batch leaf {slot.key!r} was captured as {program_input.spec} and planned so; this batch has {got}. "
                    "Batch shapes are part of the plan: capture and plan again for new shapes"
                )
            piece = shard_full_tensor(leaf, program_input.sharding, self.plan.mesh.shape, self.coords)
            inputs.append(piece.to(self.device))
        return inputs

    def _store(self, outputs: tuple[torch.Tensor, ...]) -> Any:
        user_leaves = []
        for graph_output, program_output, tensor in zip(self.torch_step.graph.outputs, self.program.outputs, outputs):
            if graph_output.replaces is not None:
                self._state[graph_output.replaces] = tensor
            elif graph_output.role is Role.GRAD:
                self._grads[graph_output.source.removeprefix("grad:")] = tensor
            else:
                user_leaves.append(self._gather(tensor, graph_output.name, program_output.sharding))
        return pytree.tree_unflatten(user_leaves, self.torch_step.output_tree)

    # -- full tensors on request ---------------------------------------------
    def _gather(self, local: torch.Tensor, value_name: str, sharding: tuple) -> torch.Tensor:
        """The whole tensor from this rank's shard (collectives counted as ``boundary``)."""
        spec = self.torch_step.graph.value(value_name).spec
        whole = tuple(Replicate() for _ in sharding)
        steps = plan_resharding(spec.shape, spec.itemsize, sharding, whole, self.plan.mesh, self.coords, what=f"%{value_name}")
        with self.comm.counting_as("boundary"):
            return run_steps(self.comm, local, steps)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors of every parameter, buffer and optimizer state, by graph input name (collective)."""
        self._require_state()
        return {
            name: self._gather(local, name, self._program_inputs[name].sharding)
            for name, local in self._state.items()
            if self._slots[name].kind != "constant"
        }

    def sharded_state_dict(self) -> dict:
        """Parameters, buffers and optimizer states as DTensors over this rank's shards (no copy, no collective)."""
        from .checkpoint import sharded_state_dict

        return sharded_state_dict(self)

    def save_checkpoint(self, path: Any) -> None:
        """Save the sharded state with torch.distributed.checkpoint (collective); loadable under another plan."""
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path)

    def load_checkpoint(self, path: Any) -> None:
        """Load the state from a torch.distributed.checkpoint directory into the shards (collective)."""
        from .checkpoint import load_checkpoint

        load_checkpoint(self, path)

    def prepare(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> None:
        """Take the state from the model and optimizer (as the first call does) without running a step."""
        if self._state is None:
            self._state = self._load_state(model, optimizer, batch)

    def grads(self) -> dict[str, torch.Tensor]:
        """Full gradients of the last step by parameter name (captured with ``keep_grads=True``; collective)."""
        result = {}
        for graph_output, program_output in zip(self.torch_step.graph.outputs, self.program.outputs):
            if graph_output.role is Role.GRAD:
                name = graph_output.source.removeprefix("grad:")
                result[name] = self._gather(self._grads[name], graph_output.name, program_output.sharding)
        return result

    def write_back(self, model: torch.nn.Module, optimizer: Any) -> None:
        """Copy the full state into the model and the optimizer (collective: every rank must call it)."""
        if has_meta_tensors(model):
            raise RunInputError(
                "the model lives on the meta device, so its full state cannot be written back into it; read the full "
                "tensors with state_dict(), or save the shards with a distributed checkpoint"
            )
        full = self.state_dict()
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        with torch.no_grad():
            for name, tensor in full.items():
                slot = self._slots[name]
                if slot.kind == "param":
                    params[slot.key].copy_(tensor)
                elif slot.kind == "buffer":
                    buffers[slot.key].copy_(tensor)
                elif slot.kind == "state":
                    optimizer.state[params[slot.key]][slot.state_key] = tensor.to(params[slot.key].device)

    def comm_records(self) -> Mapping:
        """Collectives executed so far: (phase, kind, axis) -> CommRecord."""
        return dict(self.comm.records)

    def _require_state(self) -> None:
        if self._state is None:
            raise RunInputError("the compiled step holds no state yet: call it once with (model, optimizer, batch)")


def _device_of(device_mesh: DeviceMesh) -> torch.device:
    """This rank's device: the current CUDA device on a CUDA mesh, else the CPU."""
    if device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_mesh.device_type)


def shard_full_tensor(tensor: torch.Tensor, sharding: tuple, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> torch.Tensor:
    """This rank's shard of a full tensor (nested ``torch.chunk`` pieces in axis order, as DTensor cuts), as its own copy."""
    from ..ir import Mesh
    from ..lowering import local_bounds
    from .collectives import take_bounds

    return take_bounds(tensor, local_bounds(tuple(tensor.shape), sharding, Mesh(tuple(mesh_shape)), coords))
