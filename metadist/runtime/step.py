"""``CompiledStep``: one distributed training step, run on the state the user's model and optimizer hold.

On the first call the step places the state: every rank checks that all ranks
hold the same model structure and takes rank 0's values (:mod:`.start_state`),
slices its shard of each parameter, buffer and optimizer state, and puts the
shards into the model and the optimizer as DTensors (:mod:`.model_state`); the
full tensors are dropped. A model built on the meta device is initialised one
module at a time instead (:func:`metadist.frontends.torch.materialize.iter_materialized`),
each rank keeping only its shards, with the values ``materialize(model)`` gives
on one device; fresh optimizer state is created as local zeros.

Every call then reads the shards from the model and optimizer, the live
hyperparameters from ``optimizer.param_groups`` and this rank's piece of the
batch, runs the rank program, and rebinds the updated shards in place. The loss
(and any other user output) comes back whole.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh

from ..frontends.torch import TorchStep
from ..frontends.torch.capture import hyperparameter_tensor
from ..frontends.torch.materialize import iter_materialized
from ..frontends.torch.optim import hyperparameter_values, optimizer_spec, optimizer_structure
from ..frontends.torch.precision import SUBNORMAL_METRIC, underflow_warning
from ..frontends.torch.scaler import scaler_settings, scaler_state, write_scaler_state
from ..ir import Replicate, Role, Shard
from ..ir.plan import Plan
from ..lowering import ProgramInput, RankProgram, local_bounds, lower, mesh_coordinates, plan_resharding
from .check import TensorStream
from .checkpoint import dtensor_placements
from .collectives import Collectives, bounds_view, run_steps, take_bounds
from .errors import RunInputError, RuntimeSetupError
from .graph_module import CheckingInterpreter, FirstRunProbe, apply_first_run, build_rank_module
from .host_memory import keep_freed_host_memory
from .model_state import StateBinding, StateSlot, holders_of, install, is_sharded_here, place
from .outside import enable_outside_forward
from .precision_check import check_device_precision
from .replicas import REPLICA_TOLERANCE, replica_disagreements
from .start_state import (
    BroadcastReport, broadcast_rng_state, broadcast_start_state, check_same_batch, check_same_structure, gather_batch_dim0,
)

__all__ = ["BATCH_MODES", "CompiledStep", "shard_full_tensor"]

log = logging.getLogger(__name__)

_STATE_KINDS = ("param", "buffer", "state")

BATCH_MODES = ("global", "local")
"""``global``: every rank passes the whole batch (checked alike); ``local``: each rank its slice along dim 0."""

class CompiledStep:
    """The distributed step of one rank: lowered program, its GraphModule, bound to the user's model and optimizer."""

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
        batch_mode: str = "global",
        verify_batch: str = "first",
        keep_host_memory: bool = True,
    ) -> None:
        """``check_shapes`` runs the program op by op and names the MetaIR node that fails (slower);
        ``compile_backend`` runs it through ``torch.compile`` with that backend (e.g. ``inductor`` on GPUs);
        ``init_seed`` and ``init_fn`` initialise a meta-device model (see :func:`iter_materialized`);
        ``bucket_cap_bytes`` caps the lowering's coalesced collectives (None: the default, 0: no coalescing);
        ``overlap`` issues each collective early and waits for it right before its first reader (False: each
        runs to completion where it stands); ``batch_mode`` is one of :data:`BATCH_MODES`; ``verify_batch``
        (``first``, ``always`` or ``never``) says when a global batch is checked to be the same on every rank;
        ``keep_host_memory``: on CPU, have the C library keep freed memory for reuse (the program allocates every
        updated tensor anew; :mod:`.host_memory`)."""
        if check_shapes and compile_backend:
            raise RunInputError("check_shapes runs the program op by op; it cannot be combined with torch.compile")
        if batch_mode not in BATCH_MODES:
            raise RunInputError(f"batch={batch_mode!r}: choose one of {BATCH_MODES}")
        if verify_batch not in ("first", "always", "never"):
            raise RunInputError(f"verify_batch={verify_batch!r}: choose first, always or never")
        if torch_step.left_grads:
            raise RunInputError(_left_grads_message(torch_step.left_grads))
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
        check_device_precision(torch_step.precision, _device_of(device_mesh))
        self.program: RankProgram = lower(torch_step.graph, plan, self.coords, bucket_cap_bytes=bucket_cap_bytes,
                                          overlap=overlap)
        # torch.compile traces the functional collectives; run as is, the rank calls torch.distributed itself
        self.comm = Collectives.from_device_mesh(device_mesh, direct=compile_backend is None)
        self.device = _device_of(device_mesh)
        if keep_host_memory and self.device.type == "cpu":
            keep_freed_host_memory()
        self.module = build_rank_module(self.program, self.comm, self.device, torch_step.contiguous_values,
                                        batch=not check_shapes, transposed=_cpu_transposed(torch_step.graph, self.device))
        log.info("rank at %s: %d instructions, %d reshards, on %s", self.coords, len(self.program.instructions),
                 len(self.program.reshards()), self.device)
        self._slots = {slot.name: slot for slot in torch_step.slots}
        self._program_inputs = {program_input.name: program_input for program_input in self.program.inputs}
        self.check_shapes = check_shapes
        self.init_seed, self.init_fn = init_seed, init_fn
        self.batch_mode, self.verify_batch = batch_mode, verify_batch
        self._forward = torch.compile(self.module, backend=compile_backend) if compile_backend else self.module
        self._probe = compile_backend is None and not check_shapes
        """The next run goes through a :class:`.graph_module.FirstRunProbe` (once)."""
        self._hyper_tensors: dict[str, tuple[type, Any, torch.Tensor]] = {}
        self._batch_bounds: dict[str, tuple[tuple[int, int], ...]] = {}
        self._gather_steps: dict[tuple[str, tuple], tuple] = {}
        self._actions = self._output_actions()
        self._binding: StateBinding | None = None
        self._bound_to: tuple[int, int] | None = None
        self._constants: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] = {}
        self._batch_checked = False
        self._gathered_said: set[str] = set()
        self._draws_random = any(node.op.is_random for node in torch_step.graph.nodes)
        self.broadcast: BroadcastReport | None = None
        """What placing the state broadcast (None until the state is placed)."""
        self.metrics: dict[str, float] = {}
        """The step's metric outputs after the last call (the float16 subnormal-gradient count), by source."""
        self.precision_warning: str | None = None
        """The float16 underflow warning of the first call, if its gradients underflowed."""
        self._underflow_checked = False

    # -- running -------------------------------------------------------------
    def __call__(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> Any:
        """Run one step; returns what the user's step returns (the loss), whole on every rank."""
        self.prepare(model, optimizer, batch)
        if optimizer_structure(optimizer) != self.torch_step.optimizer_structure:
            raise RunInputError(
                "the optimizer changed shape since this step was compiled (a parameter group added or removed, a flag "
                "such as amsgrad/nesterov/maximize flipped, or weight decay/momentum turned on or off); compile again "
                "(metadist.compile does so by itself)"
            )
        inputs = self._inputs(optimizer, batch)
        if self._draws_random:
            broadcast_rng_state(self.device)  # every rank draws as rank 0 (see broadcast_rng_state)
        if self.check_shapes:
            outputs = CheckingInterpreter(self.module).run(*inputs)
        elif self._probe:
            outputs = self._run_probing(inputs)
        else:
            outputs = self._forward(*inputs)
        result = self._store(outputs)
        if optimizer is not None:
            optimizer._opt_called = True  # what optimizer.step() records; LR schedulers read it
        return result

    def _run_probing(self, inputs: list[torch.Tensor]) -> Any:
        """The first run: op by op, noting the layout calls that did nothing and the ops that have a faster call,
        then changed so in the module (:class:`.graph_module.FirstRunProbe`)."""
        probe = FirstRunProbe(self.module)
        outputs = probe.run(*inputs)
        dropped, bound = apply_first_run(self.module, probe)
        self._forward = self.module
        self._probe = False
        log.info("rank at %s: %d layout calls did nothing on the first run and were taken out; %d ops called through "
                 "their Python bindings", self.coords, dropped, bound)
        return outputs

    def prepare(self, model: torch.nn.Module, optimizer: Any, batch: Any = None) -> None:
        """Place the state in the model and the optimizer for this plan (first call), without running a step."""
        if self._bound_to == (id(model), id(optimizer)):
            return
        slots = self._state_slots()
        self._place_state(model, optimizer, slots)
        self._binding = StateBinding(model, optimizer, self.device_mesh, slots)
        self._constants = {name: self._shard(self.torch_step.constants[slot.key], self._program_inputs[name])
                           for name, slot in self._slots.items() if slot.kind == "constant"}
        enable_outside_forward(model)
        self._bound_to = (id(model), id(optimizer))

    def _state_slots(self) -> list[StateSlot]:
        slots = []
        for program_input in self.program.inputs:
            slot = self._slots[program_input.name]
            if slot.kind in _STATE_KINDS:
                slots.append(StateSlot(slot.name, slot.kind, slot.key, slot.state_key,
                                       dtensor_placements(program_input.sharding), program_input.spec.shape))
        return slots

    def _place_state(self, model: torch.nn.Module, optimizer: Any, slots: list[StateSlot]) -> None:
        """Shard every state tensor the model or optimizer does not already hold as this plan places it."""
        holders = holders_of(model)
        current = {slot.name: self._current(holders, optimizer, slot) for slot in slots}
        on_meta = [slot for slot in slots if current[slot.name] is not None and current[slot.name].device.type == "meta"]
        materialized: dict[str, torch.Tensor] = {}
        if on_meta:
            self.broadcast = BroadcastReport(0, 0, 0, 0.0)  # seeded initialisation agrees on every rank
            materialized = self._materialized(model, on_meta)
        else:
            check_same_structure(model, optimizer)
            self.broadcast = broadcast_start_state(model, optimizer, self.device)
        shards = []
        for slot in slots:
            tensor = current[slot.name]
            if slot.name in materialized:
                shards.append((slot, materialized[slot.name]))
            elif not (tensor is not None and is_sharded_here(tensor, self.device_mesh)
                      and tuple(tensor.placements) == slot.placements):
                shards.append((slot, self._local_shard(tensor, slot)))
        install(model, optimizer, self.device_mesh, shards)

    @staticmethod
    def _current(holders: dict, optimizer: Any, slot: StateSlot) -> torch.Tensor | None:
        """The tensor the model or optimizer holds for ``slot`` now (None: optimizer state not created yet)."""
        if slot.kind in ("param", "buffer"):
            return holders[(slot.kind, slot.key)][0].get()
        param = holders[("param", slot.key)][0].get()
        return optimizer.state.get(param, {}).get(slot.state_key) if optimizer is not None else None

    def _materialized(self, model: torch.nn.Module, on_meta: list[StateSlot]) -> dict[str, torch.Tensor]:
        """This rank's shards of the meta tensors, each unit materialised, sliced and dropped in turn."""
        state = [slot for slot in on_meta if slot.kind == "state"]
        if state:
            raise RuntimeSetupError(
                f"optimizer state {state[0].state_key!r} of parameter {state[0].key!r} is on the meta device and has "
                "no values; build the optimizer before its first step (MetaDist creates fresh state) or load real state"
            )
        wanted = {(slot.kind, slot.key): slot for slot in on_meta}
        shards = {}
        for item in iter_materialized(model, seed=self.init_seed, init_fn=self.init_fn):
            slot = wanted.get((item.kind, item.name))
            if slot is not None:  # tensors the step never reads are not inputs
                shards[slot.name] = self._shard(item.tensor, self._program_inputs[slot.name])
        missing = [slot.key for slot in on_meta if slot.name not in shards]
        if missing:
            raise RuntimeSetupError(f"internal: the meta-device tensors {missing[:3]} were not materialised")
        return shards

    def _local_shard(self, tensor: torch.Tensor | None, slot: StateSlot) -> torch.Tensor:
        """This rank's shard of ``tensor`` for ``slot``: fresh optimizer state, a full tensor, or another placement."""
        program_input = self._program_inputs[slot.name]
        if tensor is None:  # optimizer state torch creates lazily: zeros, and a float32 step count of 0
            return torch.zeros(program_input.local_shape, dtype=getattr(torch, program_input.spec.dtype), device=self.device)
        if hasattr(tensor, "device_mesh"):
            return place(tensor, self.device_mesh, slot.placements)._local_tensor.to(self.device)
        return self._shard(tensor.detach(), program_input)

    def _shard(self, tensor: torch.Tensor, program_input: ProgramInput) -> torch.Tensor:
        return shard_full_tensor(tensor, program_input.sharding, self.plan.mesh.shape, self.coords).to(self.device)

    def _inputs(self, optimizer: Any, batch: Any) -> list[torch.Tensor]:
        leaves = pytree.tree_flatten(batch)[0]
        self._check_batch(leaves)
        hyper = hyperparameter_values(optimizer_spec(optimizer), optimizer) if optimizer is not None else []
        inputs = []
        for program_input in self.program.inputs:
            slot = self._slots[program_input.name]
            if slot.kind in _STATE_KINDS:
                inputs.append(self._binding.read(program_input.name))
            elif slot.kind == "hyper":
                inputs.append(self._hyperparameter(hyper, slot))
            elif slot.kind == "constant":
                inputs.append(self._constants[program_input.name])
            elif slot.kind == "scaler":
                inputs.append(self._scaler_input(slot))
            else:
                inputs.append(self._batch_piece(leaves, slot, program_input))
        # every run sees contiguous inputs, so the layout calls the first run found doing nothing stay so
        return [tensor if tensor.is_contiguous() else tensor.contiguous() for tensor in inputs]

    def _hyperparameter(self, hyper: list[dict[str, float]], slot) -> torch.Tensor:
        """The 0-dim tensor of a hyperparameter's live value; the last one again while the value stays (the program
        never writes its inputs), a new one when the user changed it (a scheduler's learning rate)."""
        value = hyper[slot.index][slot.state_key]
        held = self._hyper_tensors.get(slot.name)
        if held is not None and type(value) is held[0] and value == held[1]:
            return held[2]
        tensor = hyperparameter_tensor(hyper, slot).to(self.device)
        if type(value) in (float, int, bool):
            self._hyper_tensors[slot.name] = (type(value), value, tensor)
        return tensor

    def _scaler_input(self, slot) -> torch.Tensor:
        """The GradScaler's scale or growth tracker (replicated), after checking its constants did not change."""
        scaler = self.torch_step.scaler
        if scaler_settings(scaler) != self.torch_step.scaler_settings:
            raise RunInputError(
                f"the GradScaler's growth factor, backoff factor or growth interval changed since the step was captured "
                f"({self.torch_step.scaler_settings} -> {scaler_settings(scaler)}); they are constants of the compiled step: "
                "compile the step again"
            )
        return scaler_state(scaler, slot.state_key).to(self.device)

    def _check_batch(self, leaves: list) -> None:
        if self.batch_mode != "global" or self.verify_batch == "never" or (self._batch_checked and self.verify_batch == "first"):
            return
        slots = sorted((slot for slot in self._slots.values() if slot.kind == "batch"), key=lambda slot: slot.index)
        tensors = [leaves[slot.index] for slot in slots if slot.index < len(leaves) and isinstance(leaves[slot.index], torch.Tensor)]
        if len(tensors) == len(slots):
            check_same_batch(tensors, [slot.key for slot in slots], self.device)
        self._batch_checked = True

    def _batch_piece(self, leaves: list, slot, program_input: ProgramInput) -> torch.Tensor:
        leaf = leaves[slot.index] if slot.index < len(leaves) else None
        expected = program_input.spec.shape
        if self.batch_mode == "local":
            return self._local_batch_piece(leaf, slot, program_input)
        if not isinstance(leaf, torch.Tensor) or tuple(leaf.shape) != expected:
            raise _batch_shape_error(slot, program_input, leaf)
        bounds = self._batch_bounds.get(program_input.name)
        if bounds is None:
            bounds = self._batch_bounds[program_input.name] = local_bounds(expected, program_input.sharding,
                                                                           self.plan.mesh, self.coords)
        return take_bounds(leaf, bounds).to(self.device)

    def _local_batch_piece(self, leaf: Any, slot, program_input: ProgramInput) -> torch.Tensor:
        """With ``batch='local'``: this rank's slice is its piece when the plan splits dim 0 over every axis in
        rank order; otherwise the slices are all-gathered into the global leaf, then sharded as planned."""
        world = self.plan.mesh.size
        local_shape = (program_input.spec.shape[0] // world,) + tuple(program_input.spec.shape[1:])
        if not isinstance(leaf, torch.Tensor) or tuple(leaf.shape) != local_shape:
            got = "nothing" if leaf is None else f"{type(leaf).__name__} {tuple(getattr(leaf, 'shape', ()))}"
            raise RunInputError(
                f"batch leaf {slot.key!r}: with batch='local' each rank passes its slice {local_shape} of the global "
                f"{program_input.spec.shape}; this rank passed {got}. New shapes compile again through metadist.compile"
            )
        if local_batch_is_own_piece(program_input.sharding, program_input.spec.shape, self.plan.mesh.shape):
            return leaf.to(self.device)
        if slot.key not in self._gathered_said:
            self._gathered_said.add(slot.key)
            log.warning("batch='local': the plan places batch leaf %r as %s, not split along dim 0 over every axis "
                        "in rank order, so each step all-gathers the ranks' slices of it first", slot.key,
                        _describe_sharding(program_input.sharding))
        whole = gather_batch_dim0(leaf, self.device)
        return shard_full_tensor(whole, program_input.sharding, self.plan.mesh.shape, self.coords)

    def _output_actions(self) -> list[tuple[str, Any, Any]]:
        """Per program output, what :meth:`_store` does with it: ``(what, key, sharding)``."""
        actions = []
        for graph_output, program_output in zip(self.torch_step.graph.outputs, self.program.outputs):
            slot = self._slots.get(graph_output.replaces)
            if slot is not None and slot.kind == "scaler":
                actions.append(("scaler", slot.state_key, None))
            elif graph_output.replaces is not None:
                actions.append(("state", graph_output.replaces, None))
            elif graph_output.role is Role.GRAD:
                actions.append(("grad", graph_output.source.removeprefix("grad:"), None))
            elif graph_output.role is Role.METRIC:
                actions.append(("metric", (graph_output.source, graph_output.name), program_output.sharding))
            else:
                actions.append(("user", graph_output.name, program_output.sharding))
        return actions

    def _store(self, outputs: tuple[torch.Tensor, ...]) -> Any:
        user_leaves = []
        write = self._binding.write
        for (what, key, sharding), tensor in zip(self._actions, outputs):
            if what == "state":
                write(key, tensor)
            elif what == "grad":
                self._grads[key] = tensor
            elif what == "user":
                user_leaves.append(self._gather(tensor, key, sharding))
            elif what == "scaler":
                write_scaler_state(self.torch_step.scaler, key, tensor)
            else:
                self.metrics[key[0]] = float(self._gather(tensor, key[1], sharding))
        self._warn_underflow()
        return pytree.tree_unflatten(user_leaves, self.torch_step.output_tree)

    def _warn_underflow(self) -> None:
        """Warn once (rank 0) when a float16 step without loss scaling has underflowing gradients."""
        if SUBNORMAL_METRIC not in self.metrics or self._underflow_checked:
            return
        self._underflow_checked = True
        self.precision_warning = underflow_warning(int(self.metrics[SUBNORMAL_METRIC]), self.torch_step.watched_grad_elements)
        if self.precision_warning is not None and not any(self.coords):
            warnings.warn(self.precision_warning, stacklevel=3)

    # -- full tensors on request ---------------------------------------------
    def _gather(self, local: torch.Tensor, value_name: str, sharding: tuple) -> torch.Tensor:
        """The whole tensor from this rank's shard (collectives counted as ``boundary``)."""
        steps = self._gather_steps.get((value_name, sharding))
        if steps is None:
            spec = self.torch_step.graph.value(value_name).spec
            whole = tuple(Replicate() for _ in sharding)
            steps = self._gather_steps[(value_name, sharding)] = plan_resharding(
                spec.shape, spec.itemsize, sharding, whole, self.plan.mesh, self.coords, what=f"%{value_name}")
        with self.comm.counting_as("boundary"):
            return run_steps(self.comm, local, steps)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors of every parameter, buffer and optimizer state, by graph input name (collective)."""
        return self._wholes(self._state_items())

    def state_one_by_one(self) -> TensorStream:
        """:meth:`state_dict` on the mesh's first device alone (every coordinate 0: rank 0 under ``metadist run``), one
        whole tensor at a time, what a check that compares on one rank needs (see :meth:`_each_to_first`)."""
        return self._stream(self._state_items())

    def _state_items(self) -> list[tuple[str, torch.Tensor, str, tuple]]:
        self._require_state()
        return [(name, self._binding.read(name), name, self._program_inputs[name].sharding)
                for name, slot in self._slots.items() if slot.kind in _STATE_KINDS]

    def replica_disagreements(self, tolerance: float = REPLICA_TOLERANCE) -> list[tuple[str, float, int]]:
        """The state and gradient values whose copies disagree across the ranks that should hold the same piece
        (collective; every rank gets the answer): ``(name, relative difference, rank)`` of the worst copy of each
        (:func:`.replicas.replica_disagreements`)."""
        if self.plan.mesh.size != torch.distributed.get_world_size():
            raise RuntimeSetupError(f"replica_disagreements compares the copies of a mesh of every process; this mesh "
                                    f"has {self.plan.mesh.size} of {torch.distributed.get_world_size()}")
        items = [(key, local, sharding) for key, local, _, sharding in self._state_items()]
        items += [(f"grad:{key}", local, sharding) for key, local, _, sharding in self._grad_items()]
        return replica_disagreements(items, self.coords, tolerance=tolerance)

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

    def grads(self) -> dict[str, torch.Tensor]:
        """Full gradients of the last step by parameter name (captured with ``keep_grads=True``; collective)."""
        return self._wholes(self._grad_items())

    def grads_one_by_one(self) -> TensorStream:
        """:meth:`grads` as :meth:`state_one_by_one` hands the state over."""
        return self._stream(self._grad_items())

    def _grad_items(self) -> list[tuple[str, torch.Tensor, str, tuple]]:
        items = []
        for graph_output, program_output in zip(self.torch_step.graph.outputs, self.program.outputs):
            if graph_output.role is Role.GRAD:
                name = graph_output.source.removeprefix("grad:")
                items.append((name, self._grads[name], graph_output.name, program_output.sharding))
        return items

    def _wholes(self, items: list[tuple[str, torch.Tensor, str, tuple]]) -> dict[str, torch.Tensor]:
        """``{key: whole tensor}`` of ``(key, local shard, value name, sharding)`` items, on every rank."""
        return {key: self._gather(local, value_name, sharding) for key, local, value_name, sharding in items}

    def _stream(self, items: list[tuple[str, torch.Tensor, str, tuple]]) -> TensorStream:
        return TensorStream(frozenset(key for key, *_ in items), self._each_to_first(items))

    def _each_to_first(self, items: list[tuple[str, torch.Tensor, str, tuple]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, whole tensor)`` of each ``(key, local shard, value name, sharding)`` item on the mesh's first device,
        in item order, one at a time; nothing on the others (collective: every rank runs it to its end, with the same
        items).

        Each piece goes to the first device once, from the rank that holds it at coordinate 0 of every axis the value is
        not split over, and lands in place there (:func:`~metadist.lowering.local_bounds`), straight into the whole
        tensor where its place there is contiguous; a replicated value moves nothing. Gathering everywhere
        (:meth:`_gather`) moves every piece to every rank and rebuilds the whole tensor on each: gpt-85m's check on 2
        ranks gathered 340 MB so, 2.5 s of each rank's report. A value with a Partial axis is gathered everywhere still
        (its pieces are summed, not placed), at its turn on every rank.

        A consumer that lets each tensor go before asking for the next holds one whole tensor at a time, and each is
        made in memory the last one freed: on this machine a whole tensor made in memory the process never touched
        costs its page faults (gpt-85m's gradients gathered after its state, all held: 1.4 s against 0.4 s).
        """
        mesh, first = self.plan.mesh, (0,) * len(self.plan.mesh.shape)
        here = self.coords == first
        destination = int(self.device_mesh.mesh[first])
        sends = []
        for key, local, value_name, sharding in items:
            if any(not isinstance(placement, (Shard, Replicate)) for placement in sharding):
                whole = self._gather(local, value_name, sharding)
                if here:
                    yield key, whole
                del whole
                continue
            if all(isinstance(placement, Replicate) for placement in sharding):
                if here:
                    yield key, local
                continue
            shape = tuple(self.torch_step.graph.value(value_name).spec.shape)
            # the ranks at coordinate 0 of every axis the value is replicated over hold its pieces, each once
            holders = [coords for coords in (mesh_coordinates(mesh, rank) for rank in range(mesh.size))
                       if all(c == 0 for c, placement in zip(coords, sharding) if isinstance(placement, Replicate))]
            if not here:
                if self.coords in holders and local.numel():
                    sends.append(torch.distributed.isend(local.contiguous(), dst=destination))
                continue
            whole = torch.empty(shape, dtype=local.dtype, device=local.device)
            received = []
            for coords in holders:
                bounds = local_bounds(shape, sharding, mesh, coords, what=f"%{value_name}")
                if any(length == 0 for _, length in bounds):
                    continue
                place = bounds_view(whole, bounds)
                if coords == first:
                    place.copy_(local)
                    continue
                piece = place if place.is_contiguous() else torch.empty(place.shape, dtype=local.dtype, device=local.device)
                received.append((place, piece, torch.distributed.irecv(piece, src=int(self.device_mesh.mesh[coords]))))
            for place, piece, work in received:
                work.wait()
                if piece is not place:
                    place.copy_(piece)
            received = place = piece = None  # no view of the whole tensor outlives it here
            yield key, whole
            del whole
        for work in sends:
            work.wait()

    def comm_records(self) -> Mapping:
        """Collectives executed so far: (phase, kind, axis) -> CommRecord."""
        return dict(self.comm.records)

    @property
    def binding(self) -> StateBinding:
        self._require_state()
        return self._binding

    def _require_state(self) -> None:
        if self._binding is None:
            raise RunInputError("the compiled step holds no state yet: call it once with (model, optimizer, batch)")


def local_batch_is_own_piece(sharding: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Whether a rank's dim-0 slice in rank order is exactly its piece under ``sharding``.

    True when dim 0 is split over every mesh axis, in axis order, evenly: the piece
    index is then the row-major mesh coordinate, which is the rank.
    """
    size = 1
    for placement, axis_size in zip(sharding, mesh_shape):
        if not (isinstance(placement, Shard) and placement.dim == 0) and axis_size > 1:
            return False
        size *= axis_size
    return bool(shape) and shape[0] % size == 0


def _describe_sharding(sharding: tuple) -> str:
    return "(" + ", ".join(f"S({p.dim})" if isinstance(p, Shard) else "R" for p in sharding) + ")"


def batch_layout(step: "CompiledStep") -> dict[str, str]:
    """How the plan splits each batch leaf, by its path: what a user of ``batch='local'`` passes and what moves."""
    layout = {}
    for program_input in step.program.inputs:
        slot = step._slots[program_input.name]
        if slot.kind != "batch":
            continue
        own = local_batch_is_own_piece(program_input.sharding, program_input.spec.shape, step.plan.mesh.shape)
        layout[slot.key] = (f"{_describe_sharding(program_input.sharding)} of {program_input.spec.shape}: "
                            + ("each rank's dim-0 slice is its piece" if own else "slices are all-gathered each step"))
    return layout


def _left_grads_message(names: tuple[str, ...]) -> str:
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"the training step leaves gradients behind on {listed}: they are not in the optimizer, or zero_grad() is not "
        "called after optimizer.step(). Run eagerly, the next step would add its gradients to them; a compiled step "
        "starts every step from no gradients, so it refuses rather than differ. Exclude such parameters from autograd "
        "(param.requires_grad_(False)), give them to the optimizer, or end the step with optimizer.zero_grad() and "
        "model.zero_grad()"
    )


def _batch_shape_error(slot, program_input: ProgramInput, leaf: Any) -> RunInputError:
    got = "nothing" if leaf is None else f"{type(leaf).__name__} {tuple(getattr(leaf, 'shape', ()))}"
    return RunInputError(
        f"batch leaf {slot.key!r} was captured as {program_input.spec} and planned so; this batch has {got}. "
        "Batch shapes are part of the plan: metadist.compile compiles again for new shapes; a plan file is for one shape"
    )


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


def _cpu_transposed(graph, device: torch.device) -> dict[str, int]:
    """The narrow matmuls' operands the rank module lays out as the capture read them, on a CPU (its kernels' speed
    depends on the layout: :func:`.graph_module.narrow_transposed_operands`); none elsewhere."""
    from .graph_module import narrow_transposed_operands

    return narrow_transposed_operands(graph) if device.type == "cpu" else {}
