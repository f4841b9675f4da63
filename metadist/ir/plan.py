"""The plan: a strategy for every node and the sharding of every graph input and output.

The plan is the seam between the solver and the lowering. It is frozen data,
self-contained (the lowering needs no rules), and round-trips through JSON.

For each node, :class:`NodeStrategy` records the per-axis choice the solver
made (for explanation) and, derived from it and the node's rule, the sharding
each tensor input must have and the sharding each output comes out with.
Everything the lowering needs follows: where a producer's output sharding
differs from a consumer's input sharding, a resharding goes on that edge.

Per-axis choices (:class:`AxisChoice`):

- ``replicate``: on this axis every device computes the whole node on
  replicated inputs; outputs are ``Replicate()``.
- ``factor``: the axis takes factor ``index`` of the node's rule: inputs are
  ``Shard(dim)`` where the factor sits (``Replicate()`` elsewhere), outputs
  ``Shard(dim)``/``Partial(op)``/``Replicate()`` per the factor's combination.
  A halo factor also sets the axis's entry of :attr:`NodeStrategy.halos`: the
  lowering exchanges border elements before the op and trims after it.
- ``partial``: input ``index`` (and the inputs in ``joint``, a joint pass) arrives ``Partial(op)``
  and passes through (a ``PartialPass`` of the rule): other inputs ``Replicate()``, outputs ``Partial(op)``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from .graph import Graph
from .mesh import Mesh
from .placement import Partial, Placement, Replicate, Shard, format_sharding, parse_sharding
from .rule import Concat, Identity, Reduce, Rule, RuleError
from .serialize import graph_to_json

PLAN_FORMAT = "metadist.plan"
PLAN_FORMAT_VERSION = 1

Sharding = tuple  # tuple[Placement, ...], one per mesh axis


class PlanError(ValueError):
    """A plan is malformed, or does not belong to the graph/version it is used with."""


@dataclass(frozen=True)
class AxisChoice:
    kind: str
    index: int = -1
    op: str = "sum"
    joint: tuple[int, ...] = ()
    """A joint partial pass's further inputs (:attr:`metadist.ir.rule.PartialPass.joint`)."""

    def __post_init__(self) -> None:
        if self.kind not in ("replicate", "factor", "partial"):
            raise PlanError(f"AxisChoice.kind must be replicate, factor or partial, got {self.kind!r}")
        if self.kind != "replicate" and self.index < 0:
            raise PlanError(f"AxisChoice {self.kind} needs a non-negative index")
        object.__setattr__(self, "joint", tuple(self.joint))
        if self.joint and self.kind != "partial":
            raise PlanError(f"AxisChoice {self.kind} has joint inputs {list(self.joint)}: only a partial pass has")

    def __str__(self) -> str:
        if self.kind == "replicate":
            return "R"
        if self.kind == "factor":
            return f"f{self.index}"
        return "P" + "+".join(str(index) for index in (self.index, *self.joint)) + f":{self.op}"


REPLICATE = AxisChoice("replicate")


@dataclass(frozen=True)
class NodeStrategy:
    """One node's strategy: per-axis choices and the resulting shardings."""

    choices: tuple[AxisChoice, ...]
    inputs: tuple[Sharding, ...]
    """One sharding per tensor input, in the node's flattened input order (``Node.input_names``)."""
    outputs: tuple[Sharding | None, ...]
    """One sharding per output; None where the op produces no tensor."""
    halos: tuple[int, ...] = ()
    """Per mesh axis, the halo width of a halo factor taken there (0: none; empty: no halo anywhere).

    On an axis with width ``h``, every input sharded ``Shard(d)`` on it is extended by ``h`` elements
    of ``d`` from its neighbours on that axis (zeros at the global borders) before the op, and every
    output sharded ``Shard(d)`` on it is trimmed by ``h * m / n`` at each end after it (the halo
    contract of :mod:`metadist.ir.rule`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "halos", tuple(self.halos) if any(self.halos) else ())
        if self.halos and len(self.halos) != len(self.choices):
            raise PlanError(f"a strategy has {len(self.choices)} axis choices but {len(self.halos)} halo widths")

    def to_dict(self) -> dict[str, Any]:
        data = {
            "choices": [[choice.kind, choice.index, choice.op, *([list(choice.joint)] if choice.joint else [])]
                        for choice in self.choices],
            "inputs": [format_sharding(sharding) for sharding in self.inputs],
            "outputs": [None if sharding is None else format_sharding(sharding) for sharding in self.outputs],
        }
        if self.halos:
            data["halos"] = list(self.halos)
        return data

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "NodeStrategy":
        return NodeStrategy(
            choices=tuple(AxisChoice(kind, index, op, tuple(joint[0]) if joint else ())
                          for kind, index, op, *joint in data["choices"]),
            inputs=tuple(parse_sharding(text) for text in data["inputs"]),
            outputs=tuple(None if text is None else parse_sharding(text) for text in data["outputs"]),
            halos=tuple(data.get("halos", ())),
        )


def strategy_from_choices(rule: Rule, choices: tuple[AxisChoice, ...]) -> NodeStrategy:
    """Derive the input and output shardings of a node from its rule and per-axis choices."""
    n_inputs, n_outputs = len(rule.input_ranks), len(rule.output_ranks)
    inputs: list[list[Placement]] = [[] for _ in range(n_inputs)]
    outputs: list[list[Placement]] = [[] for _ in range(n_outputs)]
    halos = [0] * len(choices)
    for axis, choice in enumerate(choices):
        if choice.kind == "replicate":
            in_place = [Replicate()] * n_inputs
            out_place = [Replicate()] * n_outputs
        elif choice.kind == "factor":
            if choice.index >= len(rule.factors):
                raise PlanError(f"choice {choice} names a factor the rule ({rule}) does not have")
            factor = rule.factors[choice.index]
            in_place = [
                Shard(dim) if dim is not None else Partial(factor.partial_op) if index in factor.partial_inputs else Replicate()  # type: ignore[arg-type]
                for index, dim in enumerate(factor.inputs)
            ]
            out_place = []
            for combine in factor.outputs:
                if combine is None:
                    out_place.append(Replicate())
                elif isinstance(combine, Concat):
                    if combine.chunk != 1:
                        raise PlanError(f"factor {factor} recombines block-cyclically (chunk), which a plan cannot express")
                    out_place.append(Shard(combine.dim))
                elif isinstance(combine, Reduce):
                    out_place.append(Partial(combine.op))
                elif isinstance(combine, Identity):
                    out_place.append(Replicate())
                else:  # pragma: no cover - Combine is closed
                    raise RuleError(f"unknown combination {combine!r}")
            if factor.halo:
                if any(other == choice for other in choices[:axis]):
                    raise PlanError(f"halo factor {factor} taken by two mesh axes: the halo's neighbours would not be adjacent")
                halos[axis] = factor.halo
        else:
            passes = {(p.input, p.op, p.joint) for p in rule.partial_passes}
            if (choice.index, choice.op, choice.joint) not in passes:
                raise PlanError(f"choice {choice}: inputs {[choice.index, *choice.joint]} do not pass Partial({choice.op}) "
                                f"in rule {rule}")
            partial = {choice.index, *choice.joint}
            in_place = [Partial(choice.op) if index in partial else Replicate() for index in range(n_inputs)]
            out_place = [Partial(choice.op)] * n_outputs
        for slot, placement in zip(inputs, in_place):
            slot.append(placement)
        for slot, placement in zip(outputs, out_place):
            slot.append(placement)
    return NodeStrategy(
        choices=tuple(choices),
        inputs=tuple(tuple(slot) for slot in inputs),
        outputs=tuple(None if rank is None else tuple(slot) for slot, rank in zip(outputs, rule.output_ranks)),
        halos=tuple(halos),
    )


def graph_fingerprint(graph: Graph) -> str:
    """A hash of the graph's JSON form: a plan is valid only for the graph it was made for."""
    return hashlib.sha256(graph_to_json(graph).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Plan:
    """A frozen, serializable plan for one graph on one mesh."""

    graph_name: str
    graph_fingerprint: str
    metadist_version: str
    mesh: Mesh
    node_strategies: Mapping[str, NodeStrategy]
    input_shardings: Mapping[str, Sharding]
    """Sharding of each graph input at the start of the step (by input value name)."""
    output_shardings: tuple[Sharding, ...]
    """Sharding of each graph output at the end of the step (graph output order)."""
    estimate: Mapping[str, Any] = field(default_factory=dict)
    """Named cost terms with units in their names (``compute_s``, ``comm_s_by_axis``, ``memory_bytes_by_role``...)."""
    solver: Mapping[str, Any] = field(default_factory=dict)
    """Solver statistics (variables, constraints, build/solve seconds, gap)."""
    recompute: tuple[int, ...] = ()
    """The repeated layers that recompute their forward before their backward. The plan is made for the graph
    rewritten so (``metadist.solver.recompute.apply_recompute``), and a run rewrites its captured graph the same way."""

    def __hash__(self) -> int:
        return hash((self.graph_fingerprint, self.mesh))

    def check_for(self, graph: Graph, metadist_version: str) -> None:
        """Raise a clear error unless this plan was made for ``graph`` by this MetaDist version."""
        if self.metadist_version != metadist_version:
            raise PlanError(
                f"this plan was made by MetaDist {self.metadist_version}, and this is {metadist_version}; "
                "plan the graph again with this version"
            )
        fingerprint = graph_fingerprint(graph)
        if fingerprint != self.graph_fingerprint:
            raise PlanError(
                f"this plan was made for another graph (fingerprint {self.graph_fingerprint}, "
                f"graph {self.graph_name!r}), not for {graph.name!r} (fingerprint {fingerprint}); "
                "the model, batch shapes or optimizer changed since planning: plan again"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_FORMAT_VERSION,
            "graph_name": self.graph_name,
            "graph_fingerprint": self.graph_fingerprint,
            "metadist_version": self.metadist_version,
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "node_strategies": {name: strategy.to_dict() for name, strategy in self.node_strategies.items()},
            "input_shardings": {name: format_sharding(sharding) for name, sharding in self.input_shardings.items()},
            "output_shardings": [format_sharding(sharding) for sharding in self.output_shardings],
            "estimate": dict(self.estimate),
            "solver": dict(self.solver),
            "recompute": list(self.recompute),
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "Plan":
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a MetaDist plan document (expected format {PLAN_FORMAT!r})")
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise PlanError(f"plan format version {data.get('version')!r} is not supported (this MetaDist reads {PLAN_FORMAT_VERSION})")
        return Plan(
            graph_name=data["graph_name"],
            graph_fingerprint=data["graph_fingerprint"],
            metadist_version=data["metadist_version"],
            mesh=Mesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"])),
            node_strategies={name: NodeStrategy.from_dict(item) for name, item in data["node_strategies"].items()},
            input_shardings={name: parse_sharding(text) for name, text in data["input_shardings"].items()},
            output_shardings=tuple(parse_sharding(text) for text in data["output_shardings"]),
            estimate=data.get("estimate", {}),
            solver=data.get("solver", {}),
            recompute=tuple(int(layer) for layer in data.get("recompute", ())),
        )

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False, sort_keys=False)

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))
