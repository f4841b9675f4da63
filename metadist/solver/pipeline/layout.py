"""From a placement to stages: each stage's nodes by phase, and the values that move between stages.

A value read on another stage than the one that makes it travels with the pipeline's messages:

- a forward value read later on a higher stage rides the forward messages up, stage by stage
  (each stage in between passes it on); one read by the backward of a lower stage is kept by its
  maker's forward and rides the backward messages down;
- a backward value rides the backward messages down;
- a value read by a backward phase and made or received by the same stage's forward is *saved*;
- an accumulated value read by another stage's update moves once per step, after the schedule
  (a ``gradient`` :class:`~metadist.ir.pipeline.Transfer`); an updated parameter another stage holds a
  copy of moves once per step after the update (a ``parameter`` transfer).

The loss divisor (see :mod:`.regions`) is read by every stage that accumulates, to weight each
microbatch's gradients. Floating nodes are computed by each stage that reads them: in its forward
phase when its forward or backward reads them (a floating value the backward reads is saved), in
its update phase when its update does.
"""

from __future__ import annotations

from typing import Mapping

from ...ir import Graph, Role
from ...ir.pipeline import Stage, Transfer
from ..errors import PipelineError
from .placement import Placement
from .regions import Regions

__all__ = ["StageLayout", "layout_stages"]


class StageLayout:
    """What :func:`layout_stages` found: the stages (without plans), the transfers and where each gradient is."""

    def __init__(self, stages: tuple[Stage, ...], transfers: tuple[Transfer, ...], grads: Mapping[str, tuple[str, int]]):
        self.stages, self.transfers, self.grads = stages, transfers, grads


class _Builder:
    def __init__(self, graph: Graph, regions: Regions, placement: Placement) -> None:
        self.graph, self.regions, self.placement = graph, regions, placement
        count = placement.stages
        self.sets = {key: [set() for _ in range(count)] for key in (
            "forward", "backward", "update", "state", "drawn", "forward_send", "backward_send", "saved", "accumulated")}
        self.transfers: set[Transfer] = set()
        self.made_by = {value.name: node.name for node in graph.nodes for value in node.output_values}
        self.order = {gi.value.name: index for index, gi in enumerate(graph.inputs)}
        for index, node in enumerate(graph.nodes):
            for value in node.output_values:
                self.order[value.name] = len(graph.inputs) + index
        self.node_order = {node.name: index for index, node in enumerate(graph.nodes)}
        self.floating = set(regions.floating)
        self.random = set(regions.random)
        self.state_inputs = {gi.value.name for gi in graph.inputs if gi.role in (Role.PARAM, Role.OPTIM_STATE)}

    def build(self) -> StageLayout:
        placement = self.placement
        for name, stage in placement.stage.items():
            self.sets[placement.phase[name]][stage].add(name)
        for name, stage in list(placement.stage.items()):
            for value in self.graph.node(name).input_names:
                self.read(value, stage, placement.phase[name])
        self.read_floating()
        for value in placement.accumulated:
            self.sets["accumulated"][placement.stage[self.made_by[value]]].add(value)
        if self.regions.loss_divisor is not None:
            for stage in range(placement.stages):
                if self.sets["accumulated"][stage]:
                    self.read(self.regions.loss_divisor, stage, "backward")
        self.parameter_transfers()
        return StageLayout(self.stages(), tuple(sorted(self.transfers, key=lambda t: (self.order[t.value], t.target))),
                           self.grad_places())

    # -- reads -----------------------------------------------------------------------------
    def read(self, value: str, stage: int, phase: str) -> None:
        """Make ``value`` available to ``phase`` of ``stage``."""
        if value in self.state_inputs:
            self.sets["state"][stage].add(value)
            return
        maker = self.made_by.get(value)
        if maker is None or maker in self.floating:
            return  # an anywhere input, or computed here (read_floating)
        if maker in self.random:
            self.sets["drawn"][stage].add(value)
            return
        source, source_phase = self.placement.stage[maker], self.placement.phase[maker]
        if source_phase == "update" or phase == "update":
            self.read_in_update(value, source, source_phase, stage, phase)
        elif source_phase == "forward":
            self.read_forward_value(value, source, stage, phase)
        else:  # a backward value, read by a backward phase
            if stage > source:
                raise PipelineError(f"internal: backward value %{value} of stage {source} read by stage {stage}")
            self.relay_down(value, source, stage)

    def read_forward_value(self, value: str, source: int, stage: int, phase: str) -> None:
        if stage >= source:
            for upper in range(source, stage):
                self.sets["forward_send"][upper].add(value)
            if phase == "backward":
                self.sets["saved"][stage].add(value)
        else:
            if phase == "forward":
                raise PipelineError(f"internal: forward value %{value} of stage {source} read by stage {stage}'s forward")
            self.sets["saved"][source].add(value)
            self.relay_down(value, source, stage)

    def relay_down(self, value: str, source: int, stage: int) -> None:
        for upper in range(stage + 1, source + 1):
            self.sets["backward_send"][upper].add(value)

    def read_in_update(self, value: str, source: int, source_phase: str, stage: int, phase: str) -> None:
        if phase == "update" and source_phase == "backward":
            if value not in self.placement.accumulated:
                raise PipelineError(f"internal: the update reads %{value}, which is not accumulated")
            if source != stage:
                self.transfers.add(Transfer(value, source, stage, "gradient"))
            return
        if phase == "update" and source_phase == "update":
            if source != stage:
                raise PipelineError(f"the update of stage {stage} reads %{value}, made by the update of stage {source}: "
                                    "updates that combine stages are not supported with a pp axis")
            return
        raise PipelineError(f"internal: %{value} ({source_phase} of stage {source}) read by the {phase} of stage {stage}")

    def read_floating(self) -> None:
        """Each stage computes the floating nodes it reads, with their floating inputs."""
        for stage in range(self.placement.stages):
            for phase, target in (("forward", "forward"), ("backward", "forward"), ("update", "update")):
                pending = [value for name in self.sets[phase][stage] for value in self.graph.node(name).input_names]
                if phase == "backward":  # computed by the forward phase, kept for the backward of the same microbatch
                    self.sets["saved"][stage].update(value for value in pending if self.made_by.get(value) in self.floating)
                while pending:
                    value = pending.pop()
                    maker = self.made_by.get(value)
                    if maker in self.random:
                        self.sets["drawn"][stage].add(value)
                    if maker not in self.floating or maker in self.sets[target][stage]:
                        continue
                    self.sets[target][stage].add(maker)
                    pending.extend(self.graph.node(maker).input_names)

    def parameter_transfers(self) -> None:
        """Copies of a parameter on other stages than its owner's, refreshed after each update."""
        replaced = {out.replaces for out in self.graph.outputs if out.replaces}
        for name, holders in self.placement.holders.items():
            owner = self.placement.owner.get(name)
            for stage in holders:
                if stage != owner and name in replaced:
                    self.transfers.add(Transfer(name, owner, stage, "parameter"))

    # -- results ---------------------------------------------------------------------------
    def sorted_values(self, values) -> tuple[str, ...]:
        return tuple(sorted(values, key=lambda value: self.order[value]))

    def sorted_nodes(self, names) -> tuple[str, ...]:
        return tuple(sorted(names, key=lambda name: self.node_order[name]))

    def stages(self) -> tuple[Stage, ...]:
        count = self.placement.stages
        sets = self.sets
        owned = [set() for _ in range(count)]
        for name, stage in self.placement.owner.items():
            owned[stage].add(name)
        result = []
        for s in range(count):
            result.append(Stage(
                index=s,
                forward=self.sorted_nodes(sets["forward"][s]),
                backward=self.sorted_nodes(sets["backward"][s]),
                update=self.sorted_nodes(sets["update"][s]),
                state=self.sorted_values(sets["state"][s] | owned[s]),
                owned=self.sorted_values(owned[s]),
                drawn=self.sorted_values(sets["drawn"][s]),
                forward_recv=self.sorted_values(sets["forward_send"][s - 1]) if s else (),
                forward_send=self.sorted_values(sets["forward_send"][s]),
                backward_recv=self.sorted_values(sets["backward_send"][s + 1]) if s + 1 < count else (),
                backward_send=self.sorted_values(sets["backward_send"][s]),
                saved=self.sorted_values(sets["saved"][s]),
                accumulated=self.sorted_values(sets["accumulated"][s]),
            ))
        return tuple(result)

    def grad_places(self) -> dict[str, tuple[str, int]]:
        """Parameter -> (the value that is its accumulated gradient, its stage)."""
        places = {}
        for output in self.graph.outputs_by_role(Role.GRAD):
            maker = self.made_by.get(output.name)
            stage = self.placement.stage.get(maker, 0) if maker is not None else 0
            places[output.source.removeprefix("grad:")] = (output.name, stage)
        return places


def layout_stages(graph: Graph, regions: Regions, placement: Placement) -> StageLayout:
    """The stages of ``placement``: nodes by phase, state, messages, saved and accumulated values, transfers."""
    return _Builder(graph, regions, placement).build()
