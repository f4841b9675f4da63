"""Build a rank's program as an ordinary ``torch.fx.GraphModule``.

The module takes the rank's local input shards (graph input order) and
returns the local output shards (graph output order). Local ops are
``call_function`` nodes on the same ATen operators; resharding steps are
``call_method`` nodes on the ``comm`` submodule (:class:`Collectives`) or
``call_function`` nodes for local slices. A coalesced reshard is one
``call_method`` node (``coalesced_all_reduce`` etc.) on the list of its members'
tensors, read back with ``getitem``. A collective that a later :class:`~metadist.lowering.Wait`
completes (:mod:`metadist.lowering.overlap`) is two nodes apart: ``issue_*`` where it stands
(starts the collective, returns its raw output) and ``comm.wait_tensor`` at the ``Wait``,
followed by the ``unpack_*`` of its members and their local steps. Nothing in it is specific to CPU:
``torch.compile`` may be applied to it on GPUs.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from ..frontends.torch.execute import materialize, resolve_op
from ..shardcombine.attention import is_attention
from ..ir import Graph, Shard
from ..lowering import COLLECTIVE_KINDS, CoalescedReshard, LocalOp, RankProgram, Reshard, ReshardStep, Wait
from .collectives import (
    Collectives, halo_trim, local_slice, pack_flat, pack_for_reduce_scatter, pad_to, unpack_all_gather, unpack_all_reduce,
    unpack_all_to_all, unpack_reduce_scatter, unpad_to, zero_partial,
)
from .batching import batch_elementwise, merge_duplicates
from .bindings import binding_for
from .random_ops import draw_random
from .errors import LocalOpError

log = logging.getLogger(__name__)

__all__ = ["build_rank_module", "draw_random", "CheckingInterpreter", "FirstRunProbe", "apply_first_run", "as_transposed",
           "narrow_transposed_operands"]


def build_rank_module(
    program: RankProgram,
    comm: Collectives,
    device: torch.device | None = None,
    contiguous_values: frozenset[str] = frozenset(),
    batch: bool = True,
    transposed: Mapping[str, int] | None = None,
) -> torch.fx.GraphModule:
    """The fx GraphModule that runs ``program`` with the collectives of ``comm``.

    ``device``: where factory ops create tensors (the captured graph names the
    capture's device, the CPU); None keeps the graph's devices.
    ``contiguous_values``: values made contiguous after their op, so real layouts
    follow the capture's (``TorchStep.contiguous_values``).
    ``batch``: run small independent elementwise ops as ``_foreach`` calls
    (:mod:`metadist.runtime.batching`); False keeps one node per op, as
    :class:`CheckingInterpreter` needs to name the op that fails.
    ``transposed``: node name -> the operand of a matmul that the capture read as a transposed view
    (:func:`narrow_transposed_operands`); the module hands it to the op in that layout when a reshard has made it
    row-major (:func:`as_transposed`).
    """
    root = torch.nn.Module()
    root.comm = comm
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for program_input in program.inputs:
        env[program_input.name] = graph.placeholder(_identifier(program_input.name))
    comm_node = graph.get_attr("comm")
    awaited = {target for item in program.instructions if isinstance(item, Wait) for target in item.targets}
    issued: dict[str, _Issued] = {}
    for instruction in program.instructions:
        if isinstance(instruction, Wait):
            _emit_wait(graph, comm_node, env, issued, instruction)
        elif isinstance(instruction, (Reshard, CoalescedReshard)) and _first_target(instruction) in awaited:
            _emit_issue(graph, comm_node, env, issued, instruction, program.mesh.shape)
        elif isinstance(instruction, Reshard):
            node = env[instruction.source]
            for step in instruction.steps:
                node = _emit_step(graph, comm_node, node, step)
            env[instruction.target] = node
        elif isinstance(instruction, CoalescedReshard):
            _emit_coalesced(graph, comm_node, env, instruction)
        else:
            _emit_local_op(graph, env, instruction, program, device, transposed or {})
            for name in instruction.outputs:
                if name is not None and name in contiguous_values:
                    env[name] = graph.call_method("contiguous", (env[name],))
    graph.output(tuple(env[output.value] for output in program.outputs))
    graph.lint()
    if batch:
        merged = merge_duplicates(graph)
        graph, stats = batch_elementwise(graph)
        log.info("rank at %s: %d repeated ops merged; %s", program.coords, merged, stats)
    return torch.fx.GraphModule(root, graph, class_name=f"Rank{'_'.join(map(str, program.coords))}Program")


def _emit_coalesced(graph: torch.fx.Graph, comm: torch.fx.Node, env: dict, coalesced: CoalescedReshard) -> None:
    """Members' ``pre`` steps, one collective on the list of their tensors, then each member's ``post`` steps."""
    sources = []
    for member in coalesced.members:
        node = env[member.source]
        for step in member.pre:
            node = _emit_step(graph, comm, node, step)
        sources.append(node)
    dims = [member.collective.dim for member in coalesced.members]
    if coalesced.kind == "all_reduce":
        results = graph.call_method("coalesced_all_reduce", (comm, sources, coalesced.axis, coalesced.op))
    elif coalesced.kind == "all_gather":
        results = graph.call_method("coalesced_all_gather", (comm, sources, coalesced.axis, dims))
    elif coalesced.kind == "reduce_scatter":
        results = graph.call_method("coalesced_reduce_scatter", (comm, sources, coalesced.axis, coalesced.op, dims))
    else:
        raise ValueError(f"collective kind {coalesced.kind!r} does not coalesce")
    for index, member in enumerate(coalesced.members):
        node = graph.call_function(operator.getitem, (results, index))
        for step in member.post:
            node = _emit_step(graph, comm, node, step)
        env[member.target] = node


@dataclass(frozen=True)
class _Issued:
    """A collective issued in the graph and not yet waited for: its raw output node and how to unpack it."""

    raw: torch.fx.Node
    step: ReshardStep
    """The collective (of the first member; kind and axis are shared)."""
    members: tuple[tuple[str, ReshardStep, tuple[ReshardStep, ...]], ...]
    """(target, its collective step, its local steps after the collective), per member."""


def _first_target(item: Reshard | CoalescedReshard) -> str:
    return item.members[0].target if isinstance(item, CoalescedReshard) else item.target


def _emit_issue(graph: torch.fx.Graph, comm: torch.fx.Node, env: dict, issued: dict, item: Reshard | CoalescedReshard,
                mesh_shape: tuple[int, ...]) -> None:
    """Members' local steps before the collective, then one ``issue_*`` node that starts it without waiting."""
    if isinstance(item, CoalescedReshard):
        members = [(member.source, member.target, member.pre, member.collective, member.post) for member in item.members]
    else:
        (position,) = [index for index, step in enumerate(item.steps) if step.kind in COLLECTIVE_KINDS]
        members = [(item.source, item.target, item.steps[:position], item.steps[position], item.steps[position + 1:])]
    sources = []
    for source, _, pre, _, _ in members:
        node = env[source]
        for step in pre:
            node = _emit_step(graph, comm, node, step)
        sources.append(node)
    step = members[0][3]
    numels = [math.prod(collective.local_shape_in) for _, _, _, collective, _ in members]
    # packing is a node of its own: once it has run, the members' tensors can be freed
    if step.kind == "all_reduce":
        flat = graph.call_function(pack_flat, (sources,))
        raw = graph.call_method("issue_all_reduce", (comm, flat, step.axis, step.op, numels))
    elif step.kind == "all_gather":
        flat = graph.call_function(pack_flat, (sources,))
        raw = graph.call_method("issue_all_gather", (comm, flat, step.axis, numels))
    elif step.kind == "reduce_scatter":
        dims = [collective.dim for _, _, _, collective, _ in members]
        buffer = graph.call_function(pack_for_reduce_scatter, (sources, step.axis_size, dims))
        raw = graph.call_method("issue_reduce_scatter", (comm, buffer, step.axis, step.op, numels))
    elif step.kind == "all_to_all" and len(sources) == 1:
        raw = graph.call_method("issue_all_to_all", (comm, sources[0], step.axis, step.split_dim))
    else:
        raise ValueError(f"collective kind {step.kind!r} cannot be issued for {len(sources)} tensors")
    record = _Issued(raw, step, tuple((target, collective, post) for _, target, _, collective, post in members))
    for _, target, _, _, _ in members:
        issued[target] = record


def _emit_wait(graph: torch.fx.Graph, comm: torch.fx.Node, env: dict, issued: dict, wait: Wait) -> None:
    """One ``comm.wait_tensor`` node on the issued collective's raw output, its unpacking, each member's ``post`` steps."""
    record = issued.pop(wait.targets[0])
    if [target for target, _, _ in record.members] != list(wait.targets):
        raise ValueError(f"wait for {wait.targets} does not match the collective issued for "
                         f"{[target for target, _, _ in record.members]}")
    for target in wait.targets[1:]:
        issued.pop(target)
    done = graph.call_method("wait_tensor", (comm, record.raw))
    step = record.step
    if step.kind == "all_to_all":
        results = [graph.call_function(unpack_all_to_all, (done, step.dim))]
    else:
        if step.kind == "all_reduce":
            unpacked = graph.call_function(unpack_all_reduce, (done, [c.local_shape_in for _, c, _ in record.members]))
        elif step.kind == "all_gather":
            unpacked = graph.call_function(unpack_all_gather, (done, step.axis_size, [c.local_shape_in for _, c, _ in record.members],
                                                               [c.dim for _, c, _ in record.members]))
        else:
            unpacked = graph.call_function(unpack_reduce_scatter, (done, [c.local_shape_out for _, c, _ in record.members]))
        results = [graph.call_function(operator.getitem, (unpacked, index)) for index in range(len(record.members))]
    for node, (target, _, post) in zip(results, record.members):
        for post_step in post:
            node = _emit_step(graph, None, node, post_step)
        env[target] = node


def _emit_step(graph: torch.fx.Graph, comm: torch.fx.Node, node: torch.fx.Node, step: ReshardStep) -> torch.fx.Node:
    if step.kind == "all_gather":
        return graph.call_method("all_gather", (comm, node, step.axis, step.dim))
    if step.kind == "all_reduce":
        return graph.call_method("all_reduce", (comm, node, step.axis, step.op))
    if step.kind == "reduce_scatter":
        return graph.call_method("reduce_scatter", (comm, node, step.axis, step.op, step.dim))
    if step.kind == "all_to_all":
        return graph.call_method("all_to_all", (comm, node, step.axis, step.dim, step.split_dim))
    if step.kind == "local_slice":
        return graph.call_function(local_slice, (node, step.dim, step.coordinate, step.axis_size))
    if step.kind == "zero_partial":
        return graph.call_function(zero_partial, (node, step.coordinate))
    if step.kind == "pad":  # uneven pieces padded to equal ones around a collective (metadist.lowering.reshard)
        return graph.call_function(pad_to, (node, step.local_shape_out))
    if step.kind == "unpad":
        return graph.call_function(unpad_to, (node, step.local_shape_out))
    if step.kind in ("halo_exchange", "halo_trim"):
        return _emit_halo_step(graph, comm, node, step)
    raise ValueError(f"unknown resharding step kind {step.kind!r}")


def _emit_halo_step(graph: torch.fx.Graph, comm: torch.fx.Node, node: torch.fx.Node, step: ReshardStep) -> torch.fx.Node:
    """A halo exchange (a ``comm`` method) or the local trim after a halo op (:mod:`metadist.lowering.halo`)."""
    if step.kind == "halo_exchange":
        halo = (step.local_shape_out[step.dim] - step.local_shape_in[step.dim]) // 2
        return graph.call_method("halo_exchange", (comm, node, step.axis, step.dim, halo, step.coordinate))
    trim = (step.local_shape_in[step.dim] - step.local_shape_out[step.dim]) // 2
    return graph.call_function(halo_trim, (node, step.dim, trim))


def _emit_local_op(graph: torch.fx.Graph, env: dict, op: LocalOp, program: RankProgram, device: torch.device | None,
                   transposed: Mapping[str, int]) -> None:
    args = tuple(_on_device(materialize(arg, env), device) for arg in op.args)
    position = transposed.get(op.node)
    if position is not None and position < len(args) and isinstance(args[position], torch.fx.Node):
        args = (*args[:position], graph.call_function(as_transposed, (args[position],)), *args[position + 1:])
    kwargs = {key: _on_device(materialize(arg, env), device) for key, arg in op.kwargs}
    if op.random is not None:
        slices = tuple(
            None if sharding is None else _slices(shape, sharding, program)
            for shape, sharding in zip(op.random.output_global_shapes, op.random.output_shardings)
        )
        node = graph.call_function(draw_random, (op.target, op.random.shape_input, slices, len(op.outputs), *args), kwargs)
    elif is_attention(op.target):
        node = graph.call_function(attention_or_zeros, (op.target, *args), kwargs)
    else:
        node = graph.call_function(resolve_op(op.target), args, kwargs)
    node.meta["metadist_node"] = op.node
    node.meta["metadist_local_shapes"] = op.output_local_shapes
    if len(op.outputs) == 1:
        env[op.outputs[0]] = node
        return
    for index, name in enumerate(op.outputs):
        if name is not None:
            env[name] = graph.call_function(operator.getitem, (node, index))


def narrow_transposed_operands(graph: Graph) -> dict[str, int]:
    """Per bfloat16 or float16 matmul that reads an operand as a transposed view (:func:`metadist.cost.compute.matmul_layout`
    ``"nt"`` or ``"tn"``), that operand's position.

    A CPU's narrow matmul kernels run such a layout several times faster than row-major by row-major (bfloat16 here,
    one thread: ~1.3 GFLOP/s row-major, 5.6 with the second operand transposed, 18 with the first), and the cost model
    prices the node in its captured layout. A reshard between the view and the matmul hands the op a fresh row-major
    tensor instead (mixtral-mini's experts on 2x2 under bf16: two `tn` backward matmuls priced at 11 ms ran at 111),
    so the runtime lays such an operand out as the capture read it (:func:`as_transposed`); float32 kernels run every
    layout at one rate and keep what the reshard gives.
    """
    from ..cost.matmul_times import narrow_matmuls

    return {node.name: work.operands[1] if work.layout == "nt" else work.operands[0]
            for node, work, _ in narrow_matmuls(graph) if work.layout in ("nt", "tn")}


def as_transposed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` laid out as a transposed view of a row-major buffer (its last two dims swapped in memory): itself
    where it already is, else a copy so laid out. Same values and shape; only the strides differ."""
    if tensor.dim() < 2 or tensor.mT.is_contiguous():
        return tensor
    return tensor.mT.contiguous().mT


def _on_device(value: Any, device: torch.device | None) -> Any:
    """A device argument moved to ``device`` (lists searched too)."""
    if device is None:
        return value
    if isinstance(value, torch.device):
        return device
    if isinstance(value, list):
        return [_on_device(item, device) for item in value]
    return value


def _slices(global_shape: Sequence[int], sharding: tuple, program: RankProgram) -> tuple[tuple[int, int, int], ...]:
    """(dim, coordinate, parts) per sharded axis, in axis order: the nested slices of this rank."""
    return tuple(
        (placement.dim, program.coords[axis], program.mesh.shape[axis])
        for axis, placement in enumerate(sharding)
        if isinstance(placement, Shard)
    )


def attention_or_zeros(target: str, *args: Any, **kwargs: Any) -> Any:
    """An attention (SDPA) kernel on this rank's pieces; on an empty piece, zeros of its outputs' shapes.

    Uneven shards leave some ranks no heads, or no query or key positions, and the CPU kernels
    divide by zero there (SIGFPE). Zeros are what the op computes on such a piece: its outputs are
    empty, or partial sums over no rows (the key/value gradients of a query-length piece, the query
    gradient of a key-length piece). Shapes and dtypes come from the op's meta kernel.
    """
    op = resolve_op(target)
    tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
    if all(tensor.numel() for tensor in tensors):
        return op(*args, **kwargs)
    device = tensors[0].device
    on_meta = lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value  # noqa: E731
    shapes = op(*(on_meta(value) for value in args), **{key: on_meta(value) for key, value in kwargs.items()})
    return tuple(torch.zeros(out.shape, dtype=out.dtype, device=device) if isinstance(out, torch.Tensor) else out
                 for out in shapes)


def _identifier(name: str) -> str:
    cleaned = "".join(ch if ch.isalnum() else "_" for ch in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"v_{cleaned}"


class FirstRunProbe(torch.fx.Interpreter):
    """Runs a rank module once, op by op, noting what :func:`apply_first_run` then changes in it.

    - **Layout calls that do nothing.** The module makes every value the trace saw contiguous so after its op
      (``TorchStep.contiguous_values``), because fake tensors do not always predict a kernel's strides. Most of those
      calls do nothing (810 of 1,774 calls of llama-tiny's step, all of them there). A kernel's output strides follow
      from its inputs' shapes and strides alone, so with the same input layouts (the compiled step passes contiguous
      inputs) a call that did nothing on this run does nothing on every run.
    - **Ops with a faster call.** Each ATen op whose Python binding makes the very same call (:mod:`.bindings`).
    """

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.no_ops: list[torch.fx.Node] = []
        self.bindings: dict[torch.fx.Node, Any] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op == "call_method" and node.target == "contiguous":
            value = self.env[node.args[0]]
            if isinstance(value, torch.Tensor) and value.is_contiguous():
                self.no_ops.append(node)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            binding = binding_for(node.target, args, kwargs)
            if binding is not None:
                self.bindings[node] = binding
        return super().run_node(node)


def apply_first_run(module: torch.fx.GraphModule, probe: FirstRunProbe) -> tuple[int, int]:
    """Take the probe's idle ``contiguous`` calls out of ``module`` and call its ops through their bindings;
    how many of each."""
    for node in probe.no_ops:
        node.replace_all_uses_with(node.args[0])
        module.graph.erase_node(node)
    for node, binding in probe.bindings.items():
        node.target = binding
    if probe.no_ops or probe.bindings:
        module.recompile()
    return len(probe.no_ops), len(probe.bindings)


class CheckingInterpreter(torch.fx.Interpreter):
    """Runs a rank module node by node, checking each op's local output shapes against the lowering's.

    Slower than the module's generated code; a failure names the MetaIR node,
    its op, and the shapes it got, instead of a line of generated code.
    """

    def run_node(self, node: torch.fx.Node) -> Any:
        try:
            result = super().run_node(node)
        except Exception as err:  # re-raised with the MetaIR node named, the cause chained
            if "metadist_node" not in node.meta:
                raise
            shapes = [tuple(arg.shape) for arg in self.fetch_args_kwargs_from_env(node)[0] if isinstance(arg, torch.Tensor)]
            raise LocalOpError(
                f"node {node.meta['metadist_node']!r} ({node.target}) failed on local inputs of shapes {shapes}: {err}"
            ) from err
        expected = node.meta.get("metadist_local_shapes")
        if expected is not None:
            results = result if isinstance(result, (tuple, list)) else (result,)
            got = tuple(tuple(r.shape) if isinstance(r, torch.Tensor) else None for r in results)
            want = tuple(None if shape is None else tuple(shape) for shape in expected)
            if len(got) == len(want) and any(w is not None and g != w for g, w in zip(got, want)):
                raise LocalOpError(f"node {node.meta['metadist_node']!r} ({node.target}) made local shapes {got}, the lowering expects {want}")
        return result
