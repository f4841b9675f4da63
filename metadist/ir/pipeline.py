"""The pipeline plan: a plan whose mesh has a ``pp`` axis.

The step's graph (captured on one microbatch, gradients marked) is cut into stages. Each stage
runs, per microbatch, a **forward** phase and a **backward** phase, and once per step an
**update** phase on the gradients it accumulated; each stage is sharded on its sub-mesh (the
mesh without the ``pp`` axis) by its own :class:`~metadist.ir.plan.Plan`. Between adjacent
stages, per microbatch, the forward sends values up and the backward sends values down (each rank
to the rank of the same sub-mesh coordinate on the next stage); once per step, gradients
accumulated on one stage and updated parameters held by several stages move by
:class:`Transfer`. Frozen data; JSON round-trips.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from .graph import Graph
from .mesh import Mesh
from .plan import Plan, PlanError, graph_fingerprint

__all__ = ["PIPELINE_FORMAT", "PP_AXIS", "SCHEDULES", "PipelinePlan", "Stage", "Transfer", "sub_mesh"]

PIPELINE_FORMAT = "metadist.pipeline_plan"
PIPELINE_FORMAT_VERSION = 1
PP_AXIS = "pp"
"""The mesh axis name that makes a plan a pipeline."""
SCHEDULES = ("gpipe", "1f1b")
"""``gpipe``: every microbatch's forward, then every backward; ``1f1b``: after a warm-up of forwards, one forward
and one backward alternate, so a stage holds at most ``stages - index`` microbatches' activations."""


def sub_mesh(mesh: Mesh) -> Mesh:
    """The mesh one stage is sharded on: ``mesh`` without its ``pp`` axis (a 1-device axis when nothing is left)."""
    pp = mesh.axis_index(PP_AXIS)
    shape = mesh.shape[:pp] + mesh.shape[pp + 1:]
    names = mesh.axis_names[:pp] + mesh.axis_names[pp + 1:]
    return Mesh(shape, names) if shape else Mesh((1,), ("stage",))


@dataclass(frozen=True)
class Transfer:
    """A value that moves between stages once per step.

    ``kind`` is ``gradient`` (accumulated on ``source`` over the microbatches, read by ``target``'s update) or
    ``parameter`` (updated on ``source``, its owner; ``target`` holds a copy for its forward).
    """

    value: str
    source: int
    target: int
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in ("gradient", "parameter"):
            raise PlanError(f"a transfer is of a gradient or a parameter, not {self.kind!r}")


@dataclass(frozen=True)
class Stage:
    """One stage: its nodes by phase (graph order), the values it holds, receives, sends and accumulates."""

    index: int
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    update: tuple[str, ...]
    state: tuple[str, ...]
    """State inputs (parameters, optimizer states) this stage holds."""
    owned: tuple[str, ...]
    """State inputs this stage updates (the others it holds are copies of another stage's parameters)."""
    drawn: tuple[str, ...]
    """Random values this stage reads (drawn whole for the full batch, sliced per microbatch)."""
    forward_recv: tuple[str, ...]
    forward_send: tuple[str, ...]
    backward_recv: tuple[str, ...]
    backward_send: tuple[str, ...]
    saved: tuple[str, ...]
    """Values the forward phase keeps for the backward phase of the same microbatch."""
    accumulated: tuple[str, ...]
    """Values the backward phase makes that are summed over microbatches (weighted, see ``loss_divisor``)."""
    plan: Plan | None = None
    """The stage's own plan on the sub-mesh (of :func:`metadist.solver.pipeline.stage_graph`)."""

    def to_dict(self) -> dict[str, Any]:
        data = {name: list(getattr(self, name)) for name in _STAGE_LISTS}
        data["index"] = self.index
        data["plan"] = None if self.plan is None else self.plan.to_dict()
        return data

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "Stage":
        plan = data.get("plan")
        return Stage(index=data["index"], plan=None if plan is None else Plan.from_dict(plan),
                     **{name: tuple(data[name]) for name in _STAGE_LISTS})


_STAGE_LISTS = ("forward", "backward", "update", "state", "owned", "drawn", "forward_recv", "forward_send",
                "backward_recv", "backward_send", "saved", "accumulated")


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline plan for one microbatch graph on a mesh with a ``pp`` axis."""

    graph_name: str
    graph_fingerprint: str
    metadist_version: str
    mesh: Mesh
    microbatches: int
    schedule: str
    loss: str
    loss_divisor: str | None
    stages: tuple[Stage, ...]
    transfers: tuple[Transfer, ...] = ()
    grads: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    """Parameter name -> (the value holding its accumulated gradient, the stage holding it)."""
    estimate: Mapping[str, Any] = field(default_factory=dict)
    solver: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown pipeline schedule {self.schedule!r}; choose one of {SCHEDULES}")
        pp = self.mesh.shape[self.mesh.axis_index(PP_AXIS)]
        if pp != len(self.stages):
            raise PlanError(f"the mesh's pp axis has {pp} devices but the plan has {len(self.stages)} stages")
        for lower, upper in zip(self.stages, self.stages[1:]):
            if lower.forward_send != upper.forward_recv or upper.backward_send != lower.backward_recv:
                raise PlanError(f"stages {lower.index} and {upper.index} disagree on the values they exchange")

    @property
    def pp_axis(self) -> int:
        return self.mesh.axis_index(PP_AXIS)

    @property
    def sub_mesh(self) -> Mesh:
        return sub_mesh(self.mesh)

    def __hash__(self) -> int:
        return hash((self.graph_fingerprint, self.mesh, self.microbatches, self.schedule))

    def check_for(self, graph: Graph, metadist_version: str) -> None:
        """Raise a clear error unless this plan was made for ``graph`` (the microbatch graph) by this version."""
        if self.metadist_version != metadist_version:
            raise PlanError(f"this pipeline plan was made by MetaDist {self.metadist_version}, and this is "
                            f"{metadist_version}; plan again")
        if graph_fingerprint(graph) != self.graph_fingerprint:
            raise PlanError(
                f"this pipeline plan was made for another graph ({self.graph_name!r}, fingerprint {self.graph_fingerprint}): "
                "the model, the batch shapes, the microbatch count or the optimizer changed since planning; plan again"
            )

    def decisions_hash(self) -> str:
        """A hash of what every rank must agree on (cuts, schedule, the stage plans' decisions)."""
        data = self.to_dict()
        data.pop("estimate", None)
        data.pop("solver", None)
        for stage in data["stages"]:
            if stage["plan"] is not None:
                stage["plan"].pop("estimate", None)
                stage["plan"].pop("solver", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PIPELINE_FORMAT,
            "version": PIPELINE_FORMAT_VERSION,
            "graph_name": self.graph_name,
            "graph_fingerprint": self.graph_fingerprint,
            "metadist_version": self.metadist_version,
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "loss": self.loss,
            "loss_divisor": self.loss_divisor,
            "stages": [stage.to_dict() for stage in self.stages],
            "transfers": [[t.value, t.source, t.target, t.kind] for t in self.transfers],
            "grads": {name: list(where) for name, where in self.grads.items()},
            "estimate": dict(self.estimate),
            "solver": dict(self.solver),
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "PipelinePlan":
        if data.get("format") != PIPELINE_FORMAT:
            raise PlanError(f"not a MetaDist pipeline plan (expected format {PIPELINE_FORMAT!r})")
        if data.get("version") != PIPELINE_FORMAT_VERSION:
            raise PlanError(f"pipeline plan version {data.get('version')!r} is not supported")
        return PipelinePlan(
            graph_name=data["graph_name"], graph_fingerprint=data["graph_fingerprint"],
            metadist_version=data["metadist_version"],
            mesh=Mesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"])),
            microbatches=data["microbatches"], schedule=data["schedule"], loss=data["loss"],
            loss_divisor=data["loss_divisor"], stages=tuple(Stage.from_dict(item) for item in data["stages"]),
            transfers=tuple(Transfer(*item) for item in data["transfers"]),
            grads={name: (where[0], where[1]) for name, where in data["grads"].items()},
            estimate=data.get("estimate", {}), solver=data.get("solver", {}),
        )

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @staticmethod
    def from_json(text: str) -> "PipelinePlan":
        return PipelinePlan.from_dict(json.loads(text))
