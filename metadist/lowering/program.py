"""Lower a plan to the program of one rank: local ops on shards, with resharding between them.

:func:`lower` walks the graph in order. Each node becomes a :class:`LocalOp`
(the same op, its shape-carrying arguments rewritten for local shards). Where
a value's current sharding differs from what a consumer requires, a
:class:`Reshard` comes first and defines a new local value; consumers that
need the same sharding share it. Graph inputs start in the plan's input
shardings; graph outputs are resharded to the plan's output shardings, and
an updated state output must end in the sharding of the input it replaces,
so that the next step can read it as it is.

A node whose strategy takes a halo factor (``NodeStrategy.halos``) gets a halo
exchange before it and a trim after it (:mod:`.halo`).

Random ops draw the *global* tensor on every rank (from the same generator
state, in graph order, so each rank sees exactly the values one device would
draw) and keep the rank's slice: see :class:`RandomDraw`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping, Sequence, Union

from ..ir import Graph, Mesh, Node, Partial, Replicate, Role, Shard, TensorSpec, ValueRef, format_sharding
from ..ir.plan import Plan
from .errors import LoweringError
from .halo import halo_exchange_step, halo_trim_step
from .reshard import COLLECTIVE_KINDS, ReshardStep, plan_resharding
from .rewrite import NodeContext, rewrite_node_args
from .shapes import local_shape, mesh_coordinates, piece_lengths

__all__ = ["LocalOp", "RandomDraw", "Reshard", "BucketMember", "CoalescedReshard", "Wait", "ProgramInput", "ProgramOutput",
           "RankProgram", "lower", "lower_for_rank"]

#: Random ops whose first tensor argument gives only a shape (its values are not read).
SHAPE_ONLY_RANDOM_OPS = frozenset({
    "aten.bernoulli.p", "aten.rand_like.default", "aten.randn_like.default", "aten.randint_like.default",
    "aten.randint_like.low_dtype", "aten.uniform.default", "aten.normal.default", "aten.normal_functional.default",
})


@dataclass(frozen=True)
class RandomDraw:
    """A random node runs on global shapes and keeps this rank's slice of each output.

    ``shape_input`` is the global shape that replaces the op's first tensor
    argument (for ops in :data:`SHAPE_ONLY_RANDOM_OPS`; None when the op reads
    its replicated inputs). Cost: every rank draws, and briefly holds, the
    whole random tensor, so results do not depend on the mesh.
    """

    shape_input: tuple[int, ...] | None
    output_shardings: tuple[tuple | None, ...]
    output_global_shapes: tuple[tuple[int, ...] | None, ...]


@dataclass(frozen=True)
class LocalOp:
    """Run ``target`` on local shards. ``args``/``kwargs`` are MetaIR arguments (ValueRef = local value)."""

    node: str
    target: str
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]
    outputs: tuple[str | None, ...]
    output_local_shapes: tuple[tuple[int, ...] | None, ...]
    random: RandomDraw | None = None


@dataclass(frozen=True)
class Reshard:
    """Define local value ``target`` as ``source`` moved from one sharding to another."""

    source: str
    target: str
    spec: TensorSpec
    source_sharding: tuple
    target_sharding: tuple
    steps: tuple[ReshardStep, ...]

    @property
    def comm_bytes(self) -> int:
        return sum(step.comm_bytes for step in self.steps)


@dataclass(frozen=True)
class BucketMember:
    """One value of a coalesced collective: ``target`` is ``source`` after ``pre``, the collective, ``post``."""

    source: str
    target: str
    spec: TensorSpec
    source_sharding: tuple
    target_sharding: tuple
    pre: tuple[ReshardStep, ...]
    collective: ReshardStep
    post: tuple[ReshardStep, ...]

    @property
    def comm_bytes(self) -> int:
        return self.collective.comm_bytes

    @property
    def steps(self) -> tuple[ReshardStep, ...]:
        return (*self.pre, self.collective, *self.post)


@dataclass(frozen=True)
class CoalescedReshard:
    """Several reshards whose collectives run as one ``kind`` collective on mesh ``axis``."""

    kind: str
    axis: int
    op: str | None
    dtype: str
    members: tuple[BucketMember, ...]

    @property
    def comm_bytes(self) -> int:
        """Bytes this rank sends: the members' bytes, each by the ring convention of its own buffer."""
        return sum(member.comm_bytes for member in self.members)

    @property
    def buffer_bytes(self) -> int:
        return sum(buffer_bytes(member.collective, member.spec.itemsize) for member in self.members)


def buffer_bytes(step: ReshardStep, itemsize: int) -> int:
    """The larger of a collective's input and output, in bytes (what a bucket holds of it).

    Read on the rank with the largest pieces (:attr:`ReshardStep.bound_in`), so that decisions made
    from it (buckets, the in-flight cap) are the same on every rank when pieces are uneven.
    """
    return max(math.prod(step.bound_in), math.prod(step.bound_out)) * itemsize


@dataclass(frozen=True)
class Wait:
    """Wait for a collective issued earlier: from here on its ``targets`` are defined and may be read.

    A :class:`Reshard` (with one collective) or :class:`CoalescedReshard` that some later
    ``Wait`` names is *issued* where it stands and completes at the ``Wait`` (its local
    ``post`` steps run there); one that no ``Wait`` names runs to completion where it stands.
    See :mod:`metadist.lowering.overlap`.
    """

    targets: tuple[str, ...]


Instruction = Union[LocalOp, Reshard, CoalescedReshard, Wait]


@dataclass(frozen=True)
class ProgramInput:
    """A graph input as this rank holds it."""

    name: str
    role: Role
    spec: TensorSpec
    sharding: tuple
    local_shape: tuple[int, ...]


@dataclass(frozen=True)
class ProgramOutput:
    """A graph output: the local value that holds it and its sharding."""

    index: int
    value: str
    sharding: tuple


@dataclass(frozen=True)
class RankProgram:
    """The program of one rank: inputs, instructions in order, outputs."""

    graph_name: str
    mesh: Mesh
    coords: tuple[int, ...]
    inputs: tuple[ProgramInput, ...]
    instructions: tuple[Instruction, ...]
    outputs: tuple[ProgramOutput, ...]

    def reshards(self) -> tuple[Reshard | BucketMember, ...]:
        """Every resharded value: plain reshards and the members of coalesced ones, in program order."""
        result: list[Reshard | BucketMember] = []
        for item in self.instructions:
            if isinstance(item, Reshard):
                result.append(item)
            elif isinstance(item, CoalescedReshard):
                result.extend(item.members)
        return tuple(result)

    def collective_calls(self) -> Iterator[tuple[str, int, int]]:
        """(collective kind, mesh axis, bytes this rank sends) of each collective call, in program order.

        A coalesced reshard is one call; its bytes are its members' (each by the ring convention). A halo exchange
        is a call of kind ``halo_exchange``.
        """
        for _, call in self._ops_and_calls():
            if call is not None:
                yield call

    def compute_between_calls(self, node_seconds: Mapping[str, float]) -> list[float]:
        """The compute before each of :meth:`collective_calls`, since the call before it, and last the compute after
        the last call (``len(calls) + 1`` figures): each local op counts its node's ``node_seconds`` (0 if absent)."""
        gaps, running = [], 0.0
        for node, call in self._ops_and_calls():
            if call is None:
                running += node_seconds.get(node, 0.0)
            else:
                gaps.append(running)
                running = 0.0
        return gaps + [running]

    def _ops_and_calls(self) -> Iterator[tuple[str | None, tuple[str, int, int] | None]]:
        """In program order: (a local op's node, None) for each local op, (None, (kind, axis, bytes sent)) for each
        collective call (:meth:`collective_calls`)."""
        for item in self.instructions:
            if isinstance(item, LocalOp):
                yield item.node, None
            elif isinstance(item, CoalescedReshard):
                yield None, (item.kind, item.axis, item.comm_bytes)
            elif isinstance(item, Reshard):
                for step in item.steps:
                    if step.kind in COLLECTIVE_KINDS or step.kind == "halo_exchange":
                        yield None, (step.kind, step.axis, step.comm_bytes)

    def predicted_comm(self) -> dict[tuple[str, int], tuple[int, int]]:
        """Per (collective kind, mesh axis): (number of collective calls, bytes this rank sends), over
        :meth:`collective_calls`."""
        totals: dict[tuple[str, int], tuple[int, int]] = {}
        for kind, axis, nbytes in self.collective_calls():
            count, total = totals.get((kind, axis), (0, 0))
            totals[(kind, axis)] = (count + 1, total + nbytes)
        return totals

    def to_text(self) -> str:
        lines = [f"program {self.graph_name} on {self.mesh} at {self.coords}"]
        lines += [f"  in  %{i.name} {format_sharding(i.sharding)} local {list(i.local_shape)}" for i in self.inputs]
        for item in self.instructions:
            if isinstance(item, Reshard):
                steps = "; ".join(str(step) for step in item.steps) or "(no steps)"
                lines.append(f"  %{item.target} = reshard %{item.source} {format_sharding(item.source_sharding)} -> "
                             f"{format_sharding(item.target_sharding)}: {steps}")
            elif isinstance(item, CoalescedReshard):
                detail = f", {item.op}" if item.op else ""
                lines.append(f"  coalesced {item.kind}(axis {item.axis}{detail}) {item.dtype} of {len(item.members)}:")
                for member in item.members:
                    steps = "; ".join(str(step) for step in member.steps)
                    lines.append(f"    %{member.target} = %{member.source} {format_sharding(member.source_sharding)} -> "
                                 f"{format_sharding(member.target_sharding)}: {steps}")
            elif isinstance(item, Wait):
                lines.append(f"  wait {', '.join(f'%{target}' for target in item.targets)}")
            else:
                lines.append(f"  {', '.join(f'%{o}' for o in item.outputs if o)} = {item.target}  {item.output_local_shapes}")
        lines += [f"  out %{o.value} {format_sharding(o.sharding)}" for o in self.outputs]
        return "\n".join(lines) + "\n"


def lower_for_rank(graph: Graph, plan: Plan, rank: int, *, bucket_cap_bytes: int | None = None,
                   overlap: bool = False) -> RankProgram:
    """:func:`lower` for the rank's coordinates on the plan's mesh."""
    return lower(graph, plan, mesh_coordinates(plan.mesh, rank), bucket_cap_bytes=bucket_cap_bytes, overlap=overlap)


def lower(graph: Graph, plan: Plan, coords: Sequence[int], *, bucket_cap_bytes: int | None = None,
          overlap: bool = False, partial_inputs: frozenset[str] = frozenset()) -> RankProgram:
    """Lower ``plan`` for ``graph`` to the program of the rank at ``coords`` on the plan's mesh.

    Reshards are then coalesced into buckets of at most ``bucket_cap_bytes`` (None: the default,
    :data:`~metadist.lowering.coalesce.DEFAULT_BUCKET_CAP_BYTES`; 0: one collective per reshard);
    see :mod:`metadist.lowering.coalesce`. With ``overlap`` every collective is issued as early as
    its sources allow and waited on right before its first reader (:mod:`metadist.lowering.overlap`);
    without it each runs to completion where it stands. ``partial_inputs``: graph inputs that may start
    ``Partial`` (each rank holds a summand: a pipeline stage's gradients accumulated over microbatches, reduced
    once by the update); any other input starting ``Partial`` is an error.
    """
    from .coalesce import DEFAULT_BUCKET_CAP_BYTES, coalesce  # coalesce builds on this module's instructions
    from .overlap import in_flight_cap_for, schedule_overlap

    _check_plan_covers(graph, plan)
    lowering = _Lowering(graph, plan, tuple(coords), partial_inputs)
    inputs = lowering.inputs()
    for node in graph.nodes:
        lowering.node(node)
    outputs = lowering.outputs()
    program = RankProgram(graph.name, plan.mesh, tuple(coords), inputs, tuple(lowering.instructions), outputs)
    cap = DEFAULT_BUCKET_CAP_BYTES if bucket_cap_bytes is None else bucket_cap_bytes
    program = coalesce(program, cap)
    return schedule_overlap(program, in_flight_cap_for(cap)) if overlap else program


class _Lowering:
    """The walk over the graph: current sharding of every value, instructions so far."""

    def __init__(self, graph: Graph, plan: Plan, coords: tuple[int, ...], partial_inputs: frozenset[str] = frozenset()) -> None:
        self.graph, self.plan, self.mesh, self.coords = graph, plan, plan.mesh, coords
        self.partial_inputs = partial_inputs
        self.sharding: dict[str, tuple] = {}
        self.resharded: dict[tuple[str, tuple], str] = {}
        self.instructions: list[Instruction] = []

    def inputs(self) -> tuple[ProgramInput, ...]:
        result = []
        for graph_input in self.graph.inputs:
            name, spec = graph_input.value.name, graph_input.value.spec
            sharding = tuple(self.plan.input_shardings[name])
            if any(isinstance(p, Partial) for p in sharding) and name not in self.partial_inputs:
                raise LoweringError(f"graph input %{name} starts {format_sharding(sharding)}; inputs cannot start Partial")
            what = f"{graph_input.role} input %{name}"
            result.append(ProgramInput(name, graph_input.role, spec, sharding,
                                       local_shape(spec.shape, sharding, self.mesh, self.coords, what=what)))
            self.sharding[name] = sharding
        return tuple(result)

    def _refuse_whole_outputs_of_empty_pieces(self, node: Node, strategy) -> None:
        """A plan that splits an input of ``node`` so that a piece is empty, on an axis where an output must still come
        whole from every piece (``Replicate``) or as its max or min (``Partial(max/min)``), is refused: ShardCombine
        verifies rules on non-empty pieces only, and a kernel given an empty input may skip the work the output needs
        (``convolution_backward`` on no input channel returned a zero bias gradient). The solver never plans such a
        split (:mod:`metadist.solver.strategies`: ``empty_identity``, ``empty_max_min``); a plan file made before it
        excluded them is refused here, on every rank."""
        for axis, choice in enumerate(strategy.choices):
            if choice.kind != "factor":
                continue
            whole = [slot for slot, (value, sharding) in enumerate(zip(node.outputs, strategy.outputs))
                     if value is not None and sharding is not None and (isinstance(sharding[axis], Replicate) or (
                         isinstance(sharding[axis], Partial) and sharding[axis].op != "sum"))]
            if not whole:
                continue
            for index, name in enumerate(node.input_names):
                placement = strategy.inputs[index][axis]
                if not isinstance(placement, Shard):
                    continue
                size = self.graph.value(name).spec.shape[placement.dim]
                axes = [self.mesh.shape[other] for other, item in enumerate(strategy.inputs[index]) if item == placement]
                if 0 in piece_lengths(size, axes):
                    raise LoweringError(
                        f"node {node.name!r} ({node.op.target}): the plan splits input {index} (%{name}) along dim "
                        f"{placement.dim} of size {size} over mesh axes of sizes {axes}, which leaves a piece empty, while "
                        f"output(s) {whole} must come whole, or as a max or min, from every piece; a kernel given an "
                        "empty input may skip that work. Plan again with this MetaDist (its solver excludes such splits)")

    def use(self, name: str, wanted: tuple, what: str) -> str:
        """The local value that holds ``name`` in sharding ``wanted``, resharding on first need."""
        current = self.sharding[name]
        wanted = tuple(wanted)
        if current == wanted:
            return name
        key = (name, wanted)
        if key not in self.resharded:
            spec = self.graph.value(name).spec
            steps = plan_resharding(spec.shape, spec.itemsize, current, wanted, self.mesh, self.coords, what=what)
            target = f"{name}~{len(self.resharded)}"
            self.instructions.append(Reshard(name, target, spec, current, wanted, steps))
            self.resharded[key] = target
            self.sharding[target] = wanted
        return self.resharded[key]

    def node(self, node: Node) -> None:
        strategy = self.plan.node_strategies[node.name]
        names = node.input_names
        if len(strategy.inputs) != len(names) or len(strategy.outputs) != len(node.outputs):
            raise LoweringError(
                f"the plan's strategy for node {node.name!r} has {len(strategy.inputs)} input and "
                f"{len(strategy.outputs)} output shardings; the node has {len(names)} and {len(node.outputs)}. "
                "The plan was made for another graph: plan again"
            )
        self._refuse_whole_outputs_of_empty_pieces(node, strategy)
        counter = iter(range(len(names)))
        shape_only = node.op.is_random and node.op.target in SHAPE_ONLY_RANDOM_OPS

        def rename(arg: Any) -> Any:
            if isinstance(arg, ValueRef):
                index = next(counter)
                if shape_only and index == 0:
                    return arg  # only its dtype and device are read: no resharding
                what = f"input {index} (%{arg.name}) of node {node.name!r}"
                return ValueRef(self._halo_input(node, strategy, index, self.use(arg.name, strategy.inputs[index], what), what))
            if isinstance(arg, tuple):
                return tuple(rename(item) for item in arg)
            return arg

        args = tuple(rename(arg) for arg in node.args)
        kwargs = {key: rename(arg) for key, arg in node.kwargs}
        ctx = self._context(node, strategy)
        random = self._random(node, ctx) if node.op.is_random else None
        target, args, kwargs = (node.op.target, args, kwargs) if random else rewrite_node_args(ctx, args, kwargs)
        outputs = tuple(None if value is None else value.name for value in node.outputs)
        for value, sharding in zip(node.outputs, strategy.outputs):
            if value is not None:
                self.sharding[value.name] = tuple(sharding)
        if strategy.halos:
            self._halo_op(node, strategy, LocalOp(node.name, target, args, tuple(kwargs.items()), outputs, ctx.output_local_shapes, random))
            return
        self.instructions.append(LocalOp(node.name, target, args, tuple(kwargs.items()), outputs, ctx.output_local_shapes, random))

    # -- halo factors (see metadist.lowering.halo) ---------------------------------------------
    def _halo_input(self, node: Node, strategy, index: int, name: str, what: str) -> str:
        """``name`` extended by its neighbours' border elements on every halo axis that shards it."""
        sharding = tuple(strategy.inputs[index])
        steps = []
        spec = self.graph.value(node.input_names[index]).spec
        local = local_shape(spec.shape, sharding, self.mesh, self.coords, what=what)
        for axis, halo in enumerate(strategy.halos):
            if halo and isinstance(sharding[axis], Shard):
                steps.append(halo_exchange_step(spec, sharding, local, axis, halo, self.mesh, self.coords, what))
                local = steps[-1].local_shape_out
        if not steps:
            return name
        target = f"{name}~halo.{node.name}.{index}"
        self.instructions.append(Reshard(name, target, spec, sharding, sharding, tuple(steps)))
        return target

    def _halo_op(self, node: Node, strategy, op: LocalOp) -> None:
        """The op on extended pieces (outputs 2t longer, named ``<output>~halo``), then each output trimmed."""
        trims: list[tuple[str, str, TensorSpec, tuple, tuple[ReshardStep, ...]]] = []
        shapes = []
        for value, sharding, local in zip(node.outputs, strategy.outputs, op.output_local_shapes):
            if value is None:
                shapes.append(local)
                continue
            what = f"output %{value.name} of node {node.name!r}"
            steps, current = [], tuple(local)
            for axis, halo in reversed(list(enumerate(strategy.halos))):
                if halo and isinstance(sharding[axis], Shard):
                    size = self._halo_factor_size(node, strategy, axis)
                    step = halo_trim_step(current, sharding[axis].dim, axis, halo, size, value.spec.shape[sharding[axis].dim],
                                          self.mesh, self.coords, what)
                    steps.insert(0, step)
                    current = step.local_shape_in
            shapes.append(current)
            if steps:
                trims.append((f"{value.name}~halo", value.name, value.spec, tuple(sharding), tuple(steps)))
        renamed = {target: source for source, target, *_ in trims}
        outputs = tuple(None if name is None else renamed.get(name, name) for name in op.outputs)
        self.instructions.append(replace(op, outputs=outputs, output_local_shapes=tuple(shapes)))
        for source, target, spec, sharding, steps in trims:
            self.instructions.append(Reshard(source, target, spec, sharding, sharding, steps))

    def _halo_factor_size(self, node: Node, strategy, axis: int) -> int:
        """The global size of the dim a halo axis splits (read from the first input it shards)."""
        for name, sharding in zip(node.input_names, strategy.inputs):
            if isinstance(sharding[axis], Shard):
                return self.graph.value(name).spec.shape[sharding[axis].dim]
        raise LoweringError(f"node {node.name!r}: a halo on mesh axis {axis} but no input sharded on it; plan again")

    def _context(self, node: Node, strategy) -> NodeContext:
        input_specs = tuple(self.graph.value(name).spec for name in node.input_names)
        output_specs = tuple(None if value is None else value.spec for value in node.outputs)
        local_shapes = []
        for value, sharding in zip(node.outputs, strategy.outputs):
            if value is None:
                local_shapes.append(None)
                continue
            what = f"output %{value.name} of node {node.name!r}"
            local_shapes.append(local_shape(value.spec.shape, sharding, self.mesh, self.coords, what=what))
        input_local = tuple(
            local_shape(spec.shape, sharding, self.mesh, self.coords, what=f"input {index} of node {node.name!r}")
            for index, (spec, sharding) in enumerate(zip(input_specs, strategy.inputs))
        )
        return NodeContext(node, input_specs, tuple(map(tuple, strategy.inputs)), input_local, output_specs,
                           tuple(None if s is None else tuple(s) for s in strategy.outputs), tuple(local_shapes),
                           self.mesh, self.coords)

    def _random(self, node: Node, ctx: NodeContext) -> RandomDraw:
        shape_only = node.op.target in SHAPE_ONLY_RANDOM_OPS
        for index, sharding in enumerate(ctx.input_shardings):
            if shape_only and index == 0:
                continue
            if any(not isinstance(p, Replicate) for p in sharding):
                raise LoweringError(
                    f"random node {node.name!r} ({node.op.target}) reads input {index} as {format_sharding(sharding)}; "
                    "MetaDist draws random tensors whole on every rank and needs that input replicated. "
                    "Plan this node with a replicated strategy"
                )
        for sharding in ctx.output_shardings:
            if sharding is not None and any(isinstance(p, Partial) for p in sharding):
                raise LoweringError(f"random node {node.name!r} cannot produce a Partial output {format_sharding(sharding)}")
        return RandomDraw(
            shape_input=ctx.input_specs[0].shape if shape_only else None,
            output_shardings=ctx.output_shardings,
            output_global_shapes=tuple(None if spec is None else spec.shape for spec in ctx.output_specs),
        )

    def outputs(self) -> tuple[ProgramOutput, ...]:
        result = []
        for index, (graph_output, sharding) in enumerate(zip(self.graph.outputs, self.plan.output_shardings)):
            sharding = tuple(sharding)
            if graph_output.replaces is not None:
                start = tuple(self.plan.input_shardings[graph_output.replaces])
                if start != sharding:
                    raise LoweringError(
                        f"the plan ends state output %{graph_output.name} in {format_sharding(sharding)}, but the input "
                        f"it replaces (%{graph_output.replaces}) starts in {format_sharding(start)}; updated state must "
                        "end where it starts. The plan is inconsistent: plan again"
                    )
            what = f"graph output %{graph_output.name} ({graph_output.role})"
            result.append(ProgramOutput(index, self.use(graph_output.name, sharding, what), sharding))
        return tuple(result)


def _check_plan_covers(graph: Graph, plan: Plan) -> None:
    missing = [node.name for node in graph.nodes if node.name not in plan.node_strategies]
    missing_inputs = [i.value.name for i in graph.inputs if i.value.name not in plan.input_shardings]
    if missing or missing_inputs or len(plan.output_shardings) != len(graph.outputs):
        raise LoweringError(
            f"the plan does not cover graph {graph.name!r}: {len(missing)} node(s) without a strategy "
            f"(e.g. {missing[:3]}), {len(missing_inputs)} input(s) without a sharding (e.g. {missing_inputs[:3]}), "
            f"{len(plan.output_shardings)} output shardings for {len(graph.outputs)} outputs. Plan this graph again"
        )
