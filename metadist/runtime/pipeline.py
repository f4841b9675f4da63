"""A pipeline plan run across processes: each rank runs its stage's phases on its sub-mesh.

A :class:`~metadist.ir.pipeline.PipelinePlan` cuts the step (captured on one microbatch,
gradients marked) into stages; this module runs it on a ``DeviceMesh`` whose ``pp`` axis holds
the stages. A rank at pp index ``i`` and sub-mesh coordinate ``c``:

- **lowers** its stage's three phases (:func:`~metadist.ir.stage_graphs.phase_graphs`) with the
  ordinary lowering (:func:`~metadist.lowering.lower`) on the sub-mesh, each phase planned by
  the stage's own plan: node strategies as the stage plan chose them; a phase input starts in the
  stage plan's sharding of that value (a stage-graph input's, else its producer's, a ``Partial``
  made ``Replicate``); a value sent to another stage ends in the receiving stage plan's input
  sharding, so the sender reshards it on its sub-mesh and the receiver takes the pieces as they
  come; the loss and its divisor end replicated;
- **runs the schedule** (:func:`schedule_order`): GPipe (every forward, then every backward) or
  1F1B (``pp - 1 - i`` warm-up forwards, then one forward and one backward in turn, then the
  remaining backwards). Activations go up and gradients down by point-to-point messages between
  the ranks of the same sub-mesh coordinate on adjacent stages (``torch.distributed`` ``isend``
  / ``irecv``; sends are waited for at the end of the step, receives at once), one tag per
  (microbatch, direction, value) (:func:`message_tags`);
- **weights** each microbatch by its loss divisor (the count a mean loss divides by) over the
  sum of all of them, as :mod:`metadist.frontends.torch.pipeline_reference` does: the divisor is
  made on one stage, travels up with the activations and down with the gradients, so every stage
  knows each microbatch's count by its backward; accumulated values sum ``count * gradient`` and
  are divided by the total before the update (``1 / m`` without a divisor);
- **updates** once: the gradients other stages accumulated for its parameters (tied weights)
  arrive whole, its updated parameters that other stages hold copies of leave whole;
- **draws random values** (dropout masks) as one device draws them: every rank draws each random
  node of the step captured on the **whole** batch, in graph order, from rank 0's generator
  state, and each microbatch reads its slice along dim 0.

The state lives in this object (each rank its stage's shards), not in the user's model;
:meth:`PipelineStep.state_dict` and :meth:`PipelineStep.grads` gather it whole for ``--check``.

Why not ``torch.distributed.pipelining``: its schedules drive ``PipelineStage`` modules through
autograd (``stage.forward`` / ``backward`` of an ``nn.Module`` split by ``pipeline()`` tracing);
a MetaDist stage is a captured graph whose backward is an explicit phase graph with its own
sharded program, and whose optimizer runs inside the step, which its stages cannot express.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..ir import Graph, Partial, Replicate, Role
from ..ir.pipeline import PP_AXIS, PipelinePlan
from ..ir.plan import Plan, graph_fingerprint
from ..ir.stage_graphs import phase_graphs
from ..ir.subgraph import extract
from ..lowering import lower
from ..solver.pipeline.regions import ANYWHERE_ROLES
from .check import TensorStream
from .collectives import Collectives
from .errors import RunInputError
from .graph_module import build_rank_module
from .step import _cpu_transposed, _device_of, shard_full_tensor

__all__ = ["PipelineStep", "message_tags", "schedule_order"]

log = logging.getLogger(__name__)

FORWARD, BACKWARD = "F", "B"


def schedule_order(schedule: str, stages: int, index: int, microbatches: int) -> list[tuple[str, int]]:
    """The phases stage ``index`` of ``stages`` runs, in order: ``(F or B, microbatch)``.

    ``gpipe``: every forward, then every backward, microbatches in order. ``1f1b``: ``min(stages - 1 - index, m)``
    warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
    """
    m = microbatches
    if schedule == "gpipe":
        return [(FORWARD, k) for k in range(m)] + [(BACKWARD, k) for k in range(m)]
    if schedule != "1f1b":
        raise RunInputError(f"unknown pipeline schedule {schedule!r}; choose gpipe or 1f1b")
    warmup = min(stages - 1 - index, m)
    order = [(FORWARD, k) for k in range(warmup)]
    for k in range(m - warmup):
        order += [(FORWARD, warmup + k), (BACKWARD, k)]
    order += [(BACKWARD, k) for k in range(m - warmup, m)]
    return order


def message_tags(microbatch: int, direction: str, count: int) -> list[int]:
    """The tags of the ``count`` messages one microbatch sends in one direction (distinct over a step)."""
    base = (2 * microbatch + (0 if direction == FORWARD else 1)) * 1024
    if count > 1024:
        raise RunInputError(f"a stage boundary carries {count} values per microbatch; at most 1024 are supported")
    return [base + k for k in range(count)]


@dataclass(frozen=True)
class _Phase:
    graph: Graph
    plan: Plan
    module: torch.fx.GraphModule
    inputs: tuple  # ProgramInput per graph input
    output_names: tuple[str, ...]


def _replicated(sharding: tuple) -> tuple:
    return tuple(Replicate() for _ in sharding)


def _no_partial(sharding: tuple) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in sharding)


class PipelineStep:
    """This rank's share of a pipeline plan: its stage's phases lowered on its sub-mesh, the schedule, the messages.

    ``torch_step``: the step captured on one microbatch with ``raw_grads=True`` (the plan's graph);
    ``whole_graph``: the step captured on the whole batch, needed only when the step draws random numbers (each
    random node is drawn whole as one device draws it); ``device_mesh``: the whole mesh, its ``pp`` axis included
    (with nothing else, a 1-device ``stage`` axis after it).
    """

    def __init__(self, torch_step: Any, plan: PipelinePlan, device_mesh: Any, *, whole_graph: Graph | None = None,
                 bucket_cap_bytes: int | None = None, overlap: bool = True, schedule: str | None = None,
                 keep_host_memory: bool = True) -> None:
        """``keep_host_memory``: on CPU, have the C library keep freed memory for reuse (:mod:`.host_memory`)."""
        from .. import __version__

        plan.check_for(torch_step.graph, __version__)
        graph = torch_step.graph
        self.torch_step, self.plan, self.graph = torch_step, plan, graph
        self.schedule = schedule or plan.schedule
        names = tuple(device_mesh.mesh_dim_names or ())
        if PP_AXIS not in names:
            raise RunInputError(f"the device mesh {names} has no {PP_AXIS!r} axis: a pipeline runs on one")
        pp_dim = names.index(PP_AXIS)
        coords = tuple(device_mesh.get_coordinate())
        self.index = coords[pp_dim]
        self.stages = device_mesh.shape[pp_dim]
        self.stage = plan.stages[self.index]
        sub_names = names[:pp_dim] + names[pp_dim + 1:]
        if not sub_names:
            raise RunInputError(f"the device mesh {names} has only a pp axis: give it a 1-device axis for the stages' "
                                "sub-mesh, e.g. init_device_mesh(type, (pp, 1), mesh_dim_names=('pp', 'stage'))")
        self.sub_coords = coords[:pp_dim] + coords[pp_dim + 1:]
        self.sub_device_mesh = device_mesh[sub_names if len(sub_names) > 1 else sub_names[0]]
        if tuple(self.sub_device_mesh.shape) != plan.sub_mesh.shape:
            raise RunInputError(f"the stages' sub-mesh is {plan.sub_mesh} but the device mesh gives each stage "
                                f"{tuple(self.sub_device_mesh.shape)}; launch with the plan's mesh")
        ranks = device_mesh.mesh

        def rank_at(stage: int, sub: Sequence[int]) -> int:
            index = list(sub[:pp_dim]) + [stage] + list(sub[pp_dim:])
            return int(ranks[tuple(index)])

        self.rank_of_stage = [rank_at(s, self.sub_coords) for s in range(self.stages)]
        self.lead_rank_of_stage = [rank_at(s, (0,) * len(self.sub_coords)) for s in range(self.stages)]
        self.device = _device_of(device_mesh)
        if keep_host_memory and self.device.type == "cpu":
            from .host_memory import keep_freed_host_memory

            keep_freed_host_memory()
        self.comm = Collectives.from_device_mesh(self.sub_device_mesh)
        self.sub_mesh_shape = tuple(self.sub_device_mesh.shape)
        self.stage_plans = [stage.plan for stage in plan.stages]
        if any(p is None for p in self.stage_plans):
            raise RunInputError("the pipeline plan holds a stage without its plan; plan again")
        self.phase_graphs = phase_graphs(graph, self.stage, plan.loss, plan.loss_divisor, plan.transfers)
        self.phases = {
            "forward": self._lower(self.phase_graphs.forward, bucket_cap_bytes, overlap),
            "backward": self._lower(self.phase_graphs.backward, bucket_cap_bytes, overlap),
            "update": self._lower(self.phase_graphs.update, bucket_cap_bytes, overlap),
        }
        self.divisor_stage = self._divisor_stage()
        self.loss_stage = next((s.index for s in plan.stages if plan.loss in _made(graph, s.forward)), None)
        if self.loss_stage is None:
            raise RunInputError("no stage's forward computes the loss; the pipeline plan is inconsistent: plan again")
        self.everywhere = {gi.value.name for gi in graph.inputs if gi.role in ANYWHERE_ROLES}
        self.random = _RandomDraws(graph, whole_graph, plan.microbatches) if any(
            node.op.is_random for node in graph.nodes) else None
        self.local_state: dict[str, torch.Tensor] | None = None
        self._grads_local: dict[str, torch.Tensor] = {}
        self._update_grads: dict[str, torch.Tensor] = {}
        self.sent_bytes = 0
        """Bytes this rank sent to other stages (point to point) over the steps so far."""

    # -- lowering -------------------------------------------------------------------------------
    def _sharding_in(self, stage_index: int, value: str) -> tuple:
        """The sharding stage ``stage_index``'s plan gives ``value``: a stage-graph input's, else its producer's
        (``Partial`` kept for this stage's accumulated values, which are summed as they are and reduced once by the
        update; made ``Replicate`` for any other)."""
        plan = self.stage_plans[stage_index]
        if value in plan.input_shardings:
            return tuple(plan.input_shardings[value])
        producer = self.graph.producer(value)
        if producer is None or producer.name not in plan.node_strategies:
            raise RunInputError(f"stage {stage_index}'s plan gives %{value} no sharding; the pipeline plan is inconsistent")
        position = [v.name if v is not None else None for v in producer.outputs].index(value)
        sharding = tuple(plan.node_strategies[producer.name].outputs[position])
        linear = all(p.op in ("sum", "avg") for p in sharding if isinstance(p, Partial))
        return sharding if linear and stage_index == self.index and value in self.stage.accumulated else _no_partial(sharding)

    def _output_sharding(self, value: str, role: Role) -> tuple:
        stage, plan = self.stage, self.plan
        if value in (plan.loss, plan.loss_divisor) or role is Role.GRAD:
            return _replicated(self._sharding_in(self.index, value))
        if value in stage.forward_send:
            return tuple(self.stage_plans[self.index + 1].input_shardings[value])
        if value in stage.backward_send:
            return tuple(self.stage_plans[self.index - 1].input_shardings[value])
        return self._sharding_in(self.index, value)

    def _lower(self, phase: Graph, bucket_cap_bytes: int | None, overlap: bool) -> _Phase:
        from .. import __version__

        stage_plan = self.stage.plan
        outputs = []
        for output in phase.outputs:
            if output.replaces is not None:
                outputs.append(tuple(stage_plan.input_shardings[output.replaces]))
            else:
                outputs.append(self._output_sharding(output.name, output.role))
        phase_plan = Plan(
            graph_name=phase.name, graph_fingerprint=graph_fingerprint(phase), metadist_version=__version__,
            mesh=stage_plan.mesh, node_strategies={node.name: stage_plan.node_strategies[node.name] for node in phase.nodes},
            input_shardings={gi.value.name: self._sharding_in(self.index, gi.value.name) for gi in phase.inputs},
            output_shardings=tuple(outputs),
        )
        program = lower(phase, phase_plan, self.sub_coords, bucket_cap_bytes=bucket_cap_bytes, overlap=overlap,
                        partial_inputs=frozenset(self.stage.accumulated))
        module = build_rank_module(program, self.comm, self.device, self.torch_step.contiguous_values,
                                   transposed=_cpu_transposed(self.torch_step.graph, self.device))
        return _Phase(phase, phase_plan, module, program.inputs, tuple(o.name for o in phase.outputs))

    def _divisor_stage(self) -> int | None:
        divisor = self.plan.loss_divisor
        if divisor is None:
            return None
        makers = [s.index for s in self.plan.stages if divisor in _made(self.graph, s.forward)]
        if not makers:
            raise RunInputError(f"no stage's forward computes the loss divisor %{divisor}; plan again")
        return makers[0]

    # -- state ----------------------------------------------------------------------------------
    def _shard(self, tensor: torch.Tensor, sharding: tuple) -> torch.Tensor:
        return shard_full_tensor(tensor.to(self.device), sharding, self.sub_mesh_shape, self.sub_coords)

    def _full(self, local: torch.Tensor, sharding: tuple, shape: Sequence[int]) -> torch.Tensor:
        """The whole tensor from this stage's pieces (collective over the sub-mesh)."""
        if all(isinstance(p, Replicate) for p in sharding):
            return local
        from torch.distributed.tensor import DTensor, Partial as TorchPartial, Replicate as TorchReplicate
        from torch.distributed.tensor import Shard as TorchShard

        from ..ir import Shard

        placements = tuple(TorchShard(p.dim) if isinstance(p, Shard) else TorchPartial(p.op) if isinstance(p, Partial)
                           else TorchReplicate() for p in sharding)
        shape = tuple(shape)
        stride = tuple(int(torch.tensor(shape[i + 1:], dtype=torch.int64).prod()) for i in range(len(shape)))
        return DTensor.from_local(local.contiguous(), self.sub_device_mesh, placements,
                                  shape=torch.Size(shape), stride=stride, run_check=False).full_tensor()

    def _place_state(self, full: Mapping[str, torch.Tensor]) -> None:
        self.local_state = {name: self._shard(full[name], self._sharding_in(self.index, name)) for name in self.stage.state}

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> torch.Tensor:
        """Run one step; returns the loss (the weighted mean over microbatches), whole on every rank."""
        from ..frontends.torch.microbatch import batch_size_of
        from .start_state import broadcast_rng_state

        m = self.plan.microbatches
        size = batch_size_of(batch)
        if size % m:
            raise RunInputError(f"{m} microbatches do not divide the batch of {size}")
        part = size // m
        slices = [pytree.tree_map(lambda leaf, k=k: leaf[k * part:(k + 1) * part] if isinstance(leaf, torch.Tensor)
                                  else leaf, batch) for k in range(m)]
        names = [gi.value.name for gi in self.graph.inputs]
        inputs = [dict(zip(names, self.torch_step.gather_inputs(model, optimizer, s))) for s in slices]
        if self.local_state is None:
            self._place_state(inputs[0])
        drawn = None
        if self.random is not None:
            broadcast_rng_state(self.device)
            drawn = self.random.draw(self.device)
        counts: dict[int, torch.Tensor] = {}
        losses: dict[int, torch.Tensor] = {}
        saved: dict[int, dict[str, torch.Tensor]] = {}
        sums: dict[str, torch.Tensor] = {}
        pending: list[Any] = []

        def held(k: int, phase: _Phase) -> dict[str, torch.Tensor]:
            env = {}
            for program_input in phase.inputs:
                name = program_input.name
                if name in self.local_state:
                    env[name] = self.local_state[name]
                elif name in self.everywhere:
                    env[name] = self._shard(inputs[k][name], program_input.sharding)
                elif drawn is not None and name in drawn:
                    env[name] = self._shard(drawn[name][k], program_input.sharding)
            return env

        for kind, k in schedule_order(self.schedule, self.stages, self.index, m):
            if kind == FORWARD:
                phase = self.phases["forward"]
                env = held(k, phase)
                if self.index:
                    env.update(self._receive(phase, self.stage.forward_recv, k, FORWARD, self.index - 1,
                                             counts, with_divisor=self._divisor_up(self.index - 1)))
                results = self._run(phase, env)
                if self.plan.loss_divisor in results:
                    counts.setdefault(k, results[self.plan.loss_divisor])
                if self.plan.loss in results:
                    losses[k] = results[self.plan.loss]
                saved[k] = {v: results[v] for v in self.stage.saved}
                if self.index + 1 < self.stages:
                    pending += self._send([results[v] for v in self.stage.forward_send], k, FORWARD, self.index + 1,
                                          counts if self._divisor_up(self.index) else None)
            else:
                phase = self.phases["backward"]
                env = held(k, phase)
                env.update(saved.pop(k))
                if self.index + 1 < self.stages:
                    env.update(self._receive(phase, self.stage.backward_recv, k, BACKWARD, self.index + 1,
                                             counts, with_divisor=self._divisor_down(self.index + 1)))
                divisor = self.plan.loss_divisor
                if divisor is not None and divisor not in env and divisor in {p.name for p in phase.inputs}:
                    env[divisor] = counts[k]
                results = self._run(phase, env)
                if self.index:
                    pending += self._send([results[v] for v in self.stage.backward_send], k, BACKWARD, self.index - 1,
                                          counts if self._divisor_down(self.index) else None)
                weight = counts[k] if divisor is not None else None
                for value in self.stage.accumulated:
                    part = results[value] if weight is None else results[value] * weight.to(results[value].dtype)
                    sums[value] = part if value not in sums else sums[value] + part
        total = (sum(counts[k] for k in range(m)) if self.plan.loss_divisor is not None
                 else torch.tensor(float(m)))
        accumulated = {name: value / total.to(value.dtype) for name, value in sums.items()}
        for work in pending:
            work.wait()
        loss = self._loss(losses, counts, total)
        self._update(inputs[0], accumulated)
        if optimizer is not None:
            optimizer._opt_called = True
        return loss

    def _divisor_up(self, sender: int) -> bool:
        """Whether ``sender``'s forward messages carry the microbatch's loss divisor (it knows it by then)."""
        return self.divisor_stage is not None and sender >= self.divisor_stage

    def _divisor_down(self, sender: int) -> bool:
        return self.divisor_stage is not None and sender <= self.divisor_stage

    def _send(self, tensors: list[torch.Tensor], k: int, direction: str, stage: int,
              counts: dict[int, torch.Tensor] | None) -> list[Any]:
        if counts is not None:
            tensors = [*tensors, counts[k].reshape(())]
        works = []
        for tensor, tag in zip(tensors, message_tags(k, direction, len(tensors))):
            tensor = tensor.contiguous()
            self.sent_bytes += tensor.numel() * tensor.element_size()
            works.append(dist.isend(tensor, dst=self.rank_of_stage[stage], tag=tag))
        return works

    def _receive(self, phase: _Phase, values: Sequence[str], k: int, direction: str, stage: int,
                 counts: dict[int, torch.Tensor], *, with_divisor: bool) -> dict[str, torch.Tensor]:
        by_name = {p.name: p for p in phase.inputs}
        buffers = [torch.empty(by_name[v].local_shape, dtype=getattr(torch, by_name[v].spec.dtype), device=self.device)
                   for v in values]
        if with_divisor:
            spec = self.graph.value(self.plan.loss_divisor).spec
            buffers.append(torch.empty((), dtype=getattr(torch, spec.dtype), device=self.device))
        works = [dist.irecv(buffer, src=self.rank_of_stage[stage], tag=tag)
                 for buffer, tag in zip(buffers, message_tags(k, direction, len(buffers)))]
        for work in works:
            work.wait()
        if with_divisor:
            counts.setdefault(k, buffers.pop())
        return dict(zip(values, buffers))

    def _run(self, phase: _Phase, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [p.name for p in phase.inputs if p.name not in env]
        if missing:
            raise RunInputError(f"phase {phase.graph.name!r} reads {missing[:3]}, which its stage neither holds nor "
                                "was sent; the pipeline plan is inconsistent: plan again")
        outputs = phase.module(*(env[p.name] for p in phase.inputs))
        return dict(zip(phase.output_names, outputs))

    def _loss(self, losses: dict[int, torch.Tensor], counts: dict[int, torch.Tensor], total: torch.Tensor) -> torch.Tensor:
        spec = self.graph.value(self.plan.loss).spec
        loss = torch.zeros((), dtype=getattr(torch, spec.dtype), device=self.device)
        if self.index == self.loss_stage:
            for k, value in sorted(losses.items()):
                weight = counts[k] / total if self.plan.loss_divisor is not None else 1.0 / self.plan.microbatches
                loss = loss + value * (weight.to(value.dtype) if isinstance(weight, torch.Tensor) else weight)
        dist.broadcast(loss, src=self.lead_rank_of_stage[self.loss_stage])
        return loss

    def _update(self, first: Mapping[str, torch.Tensor], accumulated: dict[str, torch.Tensor]) -> None:
        """The update phase once, after the gradients of tied weights moved to their owners; copies refreshed after."""
        phase = self.phases["update"]
        env: dict[str, torch.Tensor] = {}
        for program_input in phase.inputs:
            name = program_input.name
            if name in self.local_state:
                env[name] = self.local_state[name]
            elif name in self.everywhere:
                env[name] = self._shard(first[name], program_input.sharding)
        env.update(accumulated)
        self._grads_local = dict(accumulated)
        self._exchange_whole("gradient", 1 << 20, accumulated, env)  # gradients go whole to the owner's stage
        results = self._run(phase, env)
        self._update_grads = {}
        for output in phase.graph.outputs:
            if output.replaces is not None:
                self.local_state[output.replaces] = results[output.name]
            elif output.role is Role.GRAD:
                self._update_grads[output.source.removeprefix("grad:")] = results[output.name]
        # updated parameters to the stages holding copies
        self._exchange_whole("parameter", 1 << 21, self.local_state, self.local_state)

    def _exchange_whole(self, kind: str, tag: int, held: Mapping[str, torch.Tensor], received: dict[str, torch.Tensor]) -> None:
        """Send every ``kind`` transfer this stage is the source of whole (its shards, from ``held``, gathered) and put
        those it is the target of into ``received`` as this stage's shards; message tags are ``tag | transfer index``."""
        works = []
        for index, transfer in enumerate(self.plan.transfers):
            if transfer.kind == kind and transfer.source == self.index:
                full = self._full(held[transfer.value], self._sharding_in(self.index, transfer.value),
                                  self.graph.value(transfer.value).spec.shape).contiguous()
                self.sent_bytes += full.numel() * full.element_size()
                works.append(dist.isend(full, dst=self.rank_of_stage[transfer.target], tag=tag | index))
        for index, transfer in enumerate(self.plan.transfers):
            if transfer.kind == kind and transfer.target == self.index:
                spec = self.graph.value(transfer.value).spec
                full = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=self.device)
                dist.irecv(full, src=self.rank_of_stage[transfer.source], tag=tag | index).wait()
                received[transfer.value] = self._shard(full, self._sharding_in(self.index, transfer.value))
        for work in works:
            work.wait()

    # -- what --check compares --------------------------------------------------------------------
    def state_dict(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> dict[str, torch.Tensor]:
        """Every stage's updated state whole, and the buffers, by graph input name, on every rank (collective)."""
        return self._gather_leads({key: make().detach().cpu() for key, *_, make in self._state_makers(model, optimizer, batch)})

    def state_one_by_one(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> TensorStream:
        """:meth:`state_dict` on rank 0 alone, one whole tensor at a time (see :meth:`_each_to_first`): what
        ``--check`` compares there."""
        return self._each_to_first(self._state_makers(model, optimizer, batch))

    def _state_makers(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> list[_Maker]:
        """This stage's updated state by graph input name (made whole by a collective over the stage's sub-mesh), and
        the buffers on the first stage."""
        makers = [self._whole_of(name, self.local_state[name], name) for name in self.stage.owned]
        if self.index == 0:
            from ..frontends.torch.microbatch import first_microbatch

            tensors = self.torch_step.gather_inputs(model, optimizer, first_microbatch(batch, self.plan.microbatches))
            makers += [_held(slot.name, tensor) for slot, tensor in zip(self.torch_step.slots, tensors) if slot.kind == "buffer"]
        return makers

    def _whole_of(self, key: str, local: torch.Tensor, value: str) -> "_Maker":
        shape = tuple(self.graph.value(value).spec.shape)
        return key, shape, local.dtype, lambda: self._full(local, self._sharding_in(self.index, value), shape)

    def write_back(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> None:
        """Put every stage's updated state, whole, into ``model`` and ``optimizer`` on every rank (collective).

        What a checkpoint saves (DCP writes the whole tensors once, the same on every rank), so that it loads under
        any plan, pipelined or not; it costs every rank the whole state for a moment.
        """
        state = self.state_dict(model, optimizer, batch)
        params = dict(model.named_parameters())
        for slot in self.torch_step.slots:
            if slot.name not in state:
                continue
            tensor = state[slot.name].to(self.device)
            if slot.kind == "param":
                with torch.no_grad():
                    params[slot.key].copy_(tensor)
            elif slot.kind == "state" and optimizer is not None:
                optimizer.state[params[slot.key]][slot.state_key] = tensor.clone()

    def grads(self) -> dict[str, torch.Tensor]:
        """Each parameter's gradient accumulated over the step's microbatches, whole, by parameter name (collective)."""
        return self._gather_leads({key: make().detach().cpu() for key, *_, make in self._grad_makers()})

    def grads_one_by_one(self) -> TensorStream:
        """:meth:`grads` as :meth:`state_one_by_one` hands the state over."""
        return self._each_to_first(self._grad_makers())

    def replica_disagreements(self) -> list[tuple[str, float, int]]:
        """The state and gradient values whose copies disagree across the ranks of a stage's sub-mesh that should hold
        the same piece (collective over every process; every rank gets the answer): ``(name, relative difference,
        rank)`` of the worst copy of each (:func:`.replicas.replica_disagreements`, each stage's sub-mesh on its own)."""
        from .replicas import replica_disagreements

        whole = tuple(Replicate() for _ in self.sub_coords)
        items = [(name, self.local_state[name], self._sharding_in(self.index, name)) for name in self.stage.owned]
        items += [(f"grad:{parameter}", self._grads_local[value], self._sharding_in(self.index, value))
                  for parameter, (value, where) in self.plan.grads.items()
                  if where == self.index and parameter not in self._update_grads]
        items += [(f"grad:{parameter}", tensor, whole) for parameter, tensor in self._update_grads.items()]
        return replica_disagreements(items, self.sub_coords, scope=self.index)

    def _grad_makers(self) -> list[_Maker]:
        makers = [self._whole_of(parameter, self._grads_local[value], value) for parameter, (value, where) in self.plan.grads.items()
                  if where == self.index and parameter not in self._update_grads]
        return makers + [_held(parameter, tensor) for parameter, tensor in self._update_grads.items()]

    def _each_to_first(self, makers: list[_Maker]) -> TensorStream:
        """``(key, whole tensor)`` of every stage's ``makers`` on rank 0, one at a time, stage after stage; nothing on
        the other ranks (collective: every rank runs the stream to its end).

        The stages' leads first tell every rank their keys, shapes and dtypes (small objects). Then each stage makes
        its tensors whole in turn (a collective over its sub-mesh) and its lead sends each to rank 0, which receives
        it into a tensor of its own: rank 0 and every lead hold one whole tensor at a time, where :meth:`state_dict`
        gives every rank every stage's whole tensors at once.
        """
        lead = all(c == 0 for c in self.sub_coords)
        shown: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shown, (self.index, [(key, shape, dtype) for key, shape, dtype, _ in makers]) if lead else None)
        order = sorted((entry for entry in shown if entry is not None), key=lambda entry: entry[0])
        names = frozenset(key for _, stage_keys in order for key, *_ in stage_keys)
        if len(names) != sum(len(stage_keys) for _, stage_keys in order):
            raise RunInputError("two pipeline stages name the same tensor for --check; the pipeline plan is inconsistent: "
                                "plan again")
        return TensorStream(names, self._pieces_to_first(order, makers))

    def _pieces_to_first(self, order: list[tuple[int, list]], makers: list[_Maker]) -> Iterator[tuple[str, torch.Tensor]]:
        rank, tag = dist.get_rank(), 1 << 22
        for stage, stage_keys in order:
            source, mine = self.lead_rank_of_stage[stage], stage == self.index
            if mine and [entry[:3] for entry in makers] != list(stage_keys):
                raise RunInputError(f"the ranks of pipeline stage {stage} would hand --check different tensors; the "
                                    "pipeline plan is inconsistent: plan again")
            for index, (key, shape, dtype) in enumerate(stage_keys):
                whole = None
                if mine:  # every rank of the stage: making it whole may be a collective over the stage's sub-mesh
                    whole = makers[index][3]().detach().contiguous()
                    if tuple(whole.shape) != shape or whole.dtype != dtype:
                        raise RunInputError(f"stage {stage} made {key} {tuple(whole.shape)} {whole.dtype} for --check, "
                                            f"not the {shape} {dtype} it announced; the pipeline plan is inconsistent")
                    if rank == source and source != 0:
                        dist.send(whole, dst=0, tag=tag | index)
                if rank == 0:
                    if source != 0:
                        whole = torch.empty(shape, dtype=dtype, device=self.device)
                        dist.recv(whole, src=source, tag=tag | index)
                    yield key, whole.cpu()
                del whole

    def _gather_leads(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        lead = all(c == 0 for c in self.sub_coords)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine if lead else {})
        result: dict[str, torch.Tensor] = {}
        for part in gathered:
            result.update(part)
        return result


_Maker = tuple  # (key, whole shape, dtype, make): ``make()`` returns the whole tensor (collective over the stage's sub-mesh)


def _held(key: str, tensor: torch.Tensor) -> _Maker:
    """A maker of a tensor this rank already holds whole."""
    return key, tuple(tensor.shape), tensor.dtype, lambda: tensor


def _made(graph: Graph, nodes: Sequence[str]) -> set[str]:
    return {value.name for name in nodes for value in graph.node(name).output_values}


class _RandomDraws:
    """The random nodes of the step drawn whole for the batch, as one device draws them, sliced per microbatch.

    The microbatch graph's random nodes are matched, in graph order, with those of the step captured on the whole
    batch: the same op and arguments, the whole output ``microbatches`` times the microbatch's along dim 0. A step
    whose random tensors do not follow the batch along dim 0 is refused (its draws could not be sliced).
    """

    def __init__(self, graph: Graph, whole: Graph | None, microbatches: int) -> None:
        if whole is None:
            raise RunInputError("the step draws random numbers (dropout): a pipeline needs the step captured on the "
                                "whole batch to draw them as one device does")
        mine = [node for node in graph.nodes if node.op.is_random]
        theirs = [node for node in whole.nodes if node.op.is_random]
        if len(mine) != len(theirs):
            raise RunInputError(f"the step draws {len(theirs)} random tensors on the whole batch but {len(mine)} on a "
                                "microbatch; a pipeline cannot draw them as one device does. Plan without a pp axis")
        self.pairs: list[tuple[str, str]] = []
        for a, b in zip(mine, theirs):
            outs_a, outs_b = a.output_values, b.output_values
            ok = a.op.target == b.op.target and len(outs_a) == len(outs_b) == 1
            if ok:
                sa, sb = outs_a[0].spec.shape, outs_b[0].spec.shape
                ok = len(sa) == len(sb) and len(sa) > 0 and sb[0] == sa[0] * microbatches and sa[1:] == sb[1:]
            if not ok:
                raise RunInputError(
                    f"random node {a.name!r} ({a.op.target}) does not draw along the batch's dim 0 (one microbatch: "
                    f"{[v.spec.shape for v in outs_a]}, the whole batch: {[v.spec.shape for v in outs_b]}); a pipeline "
                    "draws each random tensor whole and slices it per microbatch. Plan without a pp axis")
            self.pairs.append((outs_a[0].name, outs_b[0].name))
        names = [b.name for b in theirs]
        self.draws = extract(whole, names, [_output(v) for _, v in self.pairs], name=f"{whole.name}.random")
        self.microbatches = microbatches

    def draw(self, device: torch.device) -> dict[str, list[torch.Tensor]]:
        """Per microbatch random value: its slice for each microbatch (the same on every rank)."""
        from ..frontends.torch.execute import execute_graph

        inputs = [torch.empty(gi.value.spec.shape, dtype=getattr(torch, gi.value.spec.dtype), device=device)
                  for gi in self.draws.inputs]
        results = execute_graph(self.draws, inputs)
        return {mine: list(torch.chunk(whole, self.microbatches, dim=0)) for (mine, _), whole in zip(self.pairs, results)}


def _output(value: str):
    from ..ir import GraphOutput

    return GraphOutput(value, Role.ACTIVATION)
