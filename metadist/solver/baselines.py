"""Baseline plans built with the same machinery: the same problem, ILP and cost model.

Each baseline fixes how graph inputs start the step and lets the ILP choose everything
else, so the baselines are priced by exactly the model that prices the solver's plan:

- ``dp``: data parallel. Parameters and optimizer states replicated; the batch split on
  dim 0 over every axis that divides it.
- ``zero2``: as ``dp``, with the optimizer states sharded over the whole mesh (gradients
  follow: the solver reduce-scatters them into the sharded update).
- ``zero3``: as ``zero2``, with the parameters sharded too (FSDP-like).
- ``megatron``: tensor parallel on the LAST mesh axis (its split of each parameter chosen by
  the solver: column or row), data parallel on the others.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

from ..cost import Cluster, compute_seconds, node_work
from ..ir import Graph, Mesh, Replicate, Role, Shard, TensorSpec
from ..ir.plan import Plan
from .errors import SolverError
from .planner import plan_graph
from .problem import Restrictions

BASELINES = ("dp", "zero2", "zero3", "megatron")


def _split_over(spec: TensorSpec, mesh: Mesh, axes: tuple[int, ...], dims: tuple[int, ...]) -> tuple:
    """Shard the first dim in ``dims`` that the product of ``axes`` divides; else greedily axis by axis."""
    for dim in dims:
        count = 1
        for axis in axes:
            count *= mesh.shape[axis]
        if spec.shape[dim] % count == 0:
            return tuple(Shard(dim) if axis in axes else Replicate() for axis in range(mesh.ndim))
    sharding, pieces = [Replicate()] * mesh.ndim, [1] * spec.rank
    for axis in axes:
        for dim in dims:
            if spec.shape[dim] % (pieces[dim] * mesh.shape[axis]) == 0:
                sharding[axis], pieces[dim] = Shard(dim), pieces[dim] * mesh.shape[axis]
                break
    return tuple(sharding)


def _restrictions(graph: Graph, mesh: Mesh, kind: str) -> Restrictions:
    all_axes = tuple(range(mesh.ndim))
    data_axes = all_axes[:-1] if kind == "megatron" else all_axes
    replicated = tuple(Replicate() for _ in all_axes)
    allowed: dict[str, frozenset] = {}
    for graph_input in graph.inputs:
        spec, role = graph_input.value.spec, graph_input.role
        dims = tuple(range(spec.rank))
        if role is Role.BATCH:
            choice = {_split_over(spec, mesh, data_axes, dims[:1])} if spec.rank else {replicated}
        elif role in (Role.PARAM, Role.OPTIM_STATE) and kind == "megatron":
            choice = {replicated} | {replicated[:-1] + (Shard(d),) for d in dims}
        elif (role is Role.OPTIM_STATE and kind in ("zero2", "zero3")) or (role is Role.PARAM and kind == "zero3"):
            choice = {_split_over(spec, mesh, all_axes, dims)} if spec.rank else {replicated}
        else:
            choice = {replicated}
        allowed[graph_input.value.name] = frozenset(choice)
    return Restrictions(input_shardings=allowed)


def baseline_choices(problem: Any, kind: str) -> dict[int, frozenset[int]] | None:
    """The strategies each input class may take under the ``kind`` baseline, on an unrestricted problem.

    None where a baseline's starting layout is not among a class's strategies. The planner solves the
    problem so restricted next to its own search when that search is not proven optimal
    (:func:`metadist.solver.planner.plan_graph`), so its plan never costs more than a baseline's.
    """
    restrictions = _restrictions(problem.graph, problem.cluster.mesh, kind)
    allowed: dict[int, frozenset[int]] = {}
    for index, unit in enumerate(problem.units):
        shardings = restrictions.input_shardings.get(unit.members[0]) if unit.is_input else None
        if shardings is None:
            continue
        ok = frozenset(s for s, row in enumerate(unit.strategies) if row[0].outputs[0] in shardings)
        if not ok:
            return None
        c = problem.unit_class[index]
        allowed[c] = allowed.get(c, ok) & ok
        if not allowed[c]:
            return None
    return allowed


def baseline_plan(graph: Graph, rules: Any, cluster: Cluster, kind: str, time_limit_s: float = 60.0,
                  uneven_shards: bool = True, reduce_dtype: str | None = None, recompute: bool = False,
                  explain: bool = True) -> Plan:
    """The ``kind`` baseline (one of :data:`BASELINES`), planned without a memory budget.

    Graph inputs start evenly split, as the baselines' systems split them; ``uneven_shards`` lets the
    solver split the nodes in between unevenly (False: even splits only, see :func:`plan_graph`).
    ``recompute``: every repeated layer recomputes its forward (full activation checkpointing, as FSDP or
    DeepSpeed users switch it on); the plan records them (``Plan.recompute``) and is named ``<kind>+recompute``.
    ``explain``: as :func:`~.planner.plan_graph`'s.
    """
    if kind not in BASELINES:
        raise SolverError(f"unknown baseline {kind!r}; choose one of {BASELINES}")
    layers: tuple[int, ...] = ()
    if recompute:
        from types import SimpleNamespace

        from .planner import recomputed_rules, split_rules
        from .recompute import CLONE_SUFFIX, apply_recompute, recompute_layers

        layers = tuple(layer.layer for layer in recompute_layers(graph))
        if not layers:
            raise SolverError(f"graph {graph.name!r} has no repeated layer that can recompute: no {kind}+recompute baseline")
        graph = apply_recompute(graph, layers)
        rule_map, missing = split_rules(rules)
        rule_map, without = recomputed_rules(graph, rule_map)
        rules = SimpleNamespace(rules=rule_map, missing={**missing, **{name: missing.get(name[: -len(CLONE_SUFFIX)], "no rule given")
                                                                       for name in without}})
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"), time_limit_s=time_limit_s,
                      restrictions=_restrictions(graph, cluster.mesh, kind), uneven_shards=uneven_shards,
                      reduce_dtype=reduce_dtype, explain=explain)
    return replace(plan, solver={**plan.solver, "kind": f"{kind}+recompute" if recompute else kind}, recompute=layers)


DDP_FIRST_BUCKET_BYTES = 1024 * 1024
"""The first gradient bucket of torch's DDP when its bucket cap is the default (``torch.distributed.
_DEFAULT_FIRST_BUCKET_BYTES``): small, so that the gradients ready first are reduced early."""


def ddp_buckets(param_bytes: Sequence[float], cap: float, first_cap: float) -> list[float]:
    """The bytes of each gradient bucket torch's DDP reduces, one all-reduce each, from its second step on (after it
    rebuilt its buckets in the order the gradients became ready): the parameters (``param_bytes``, in the model's
    order) taken from the last, the one the backward reaches first, each bucket closed once it holds at least its
    limit (``first_cap``, then ``cap``); a parameter is never split. On this project's bench the counts are the ones
    measured: bert-tiny 2 (1.08 and 1.12 MiB; ``ceil(bytes / cap)`` gave 1), mixtral-mini 2, gpt2-small 13 (its
    tied embedding, 147 MiB, in the last bucket with the first layers', 168 MiB; ``ceil`` gave 19)."""
    buckets: list[float] = []
    filled = 0.0
    for size in reversed(param_bytes):
        if size <= 0:
            continue
        filled += size
        if filled >= (first_cap if not buckets else cap):
            buckets.append(filled)
            filled = 0.0
    if filled:
        buckets.append(filled)
    return buckets


def torch_ddp_estimate(graph: Graph, cluster: Cluster, dp_estimate: Any, bucket_cap_bytes: float | None = None,
                       dp_plan: Plan | None = None) -> dict[str, Any]:
    """The cost model's price of torch's own DistributedDataParallel on ``graph``: not the solver's ``dp`` layout.

    torch DDP runs the model eagerly on every rank with its share of the batch and reduces the gradients in buckets
    (:func:`ddp_buckets`: of ``bucket_cap_bytes``, 25 MiB, the first of 1 MiB when the cap is torch's default), one
    all-reduce per bucket over all ranks, and nothing else. So: the compute
    of the ``dp`` layout (``dp_estimate``, its nodes split as DDP splits them) at the eager per-node cost
    (:attr:`metadist.cost.cluster.Device.eager_op_overhead_s`, where the calibration measured one) instead of the
    runtime's, plus the buckets' all-reduces, each paying its full fixed cost and its in-step wait at the compute
    before it, the calls spread evenly over the step (:func:`spread_waits`). No overlap with the
    backward is assumed (on CPU processes sharing cores, gloo's threads take cores the backward needs).
    Each bucket also pays two copies of its gradients (``copy_s``): DDP (``gradient_as_bucket_view=False``, its
    default) writes each gradient into its bucket, divided by the world size as it goes, and copies the reduced bucket
    back into the gradients (:func:`metadist.cost.compute.copy_seconds`).
    With ``dp_plan`` (the ``dp`` layout's plan), random ops are priced as DDP draws them, each rank its own share
    (:func:`eager_random_discount`); the layout's estimate prices them whole, as MetaDist's runtime draws them.
    """
    from ..cost.comm import collective_seconds
    from ..cost.compute import copy_seconds
    from ..ir import DTYPE_BYTES
    from ..lowering.coalesce import DEFAULT_BUCKET_CAP_BYTES

    cap = float(DEFAULT_BUCKET_CAP_BYTES if bucket_cap_bytes is None else bucket_cap_bytes)
    compute_s = _eager_compute_s(graph, cluster, dp_estimate, dp_plan)
    world = cluster.mesh.size
    comm_s = comm_bytes = 0.0
    pieces = ddp_buckets([float(item.value.spec.nbytes) for item in graph.inputs if item.role is Role.PARAM], cap,
                         DDP_FIRST_BUCKET_BYTES if bucket_cap_bytes is None else cap) if world > 1 else []
    buckets = len(pieces)
    # a copy's bytes are the bucket's whatever its dtype; the dtype picks the elementwise curve they are priced on:
    # the parameters', or float32's where their dtypes mix
    dtypes = {item.value.spec.dtype for item in graph.inputs if item.role is Role.PARAM}
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    copy_s = 0.0
    for piece in pieces:
        seconds, sent = collective_seconds("all_reduce", piece, world, cluster.link(0))
        comm_s, comm_bytes = comm_s + seconds, comm_bytes + sent
        copy_s += 2 * copy_seconds(cluster.device, dtype, piece / DTYPE_BYTES[dtype])
    comm_s += spread_waits(compute_s, buckets, [cluster.link(0)] * buckets)
    return {"step_s": compute_s + comm_s + copy_s, "compute_s": compute_s, "comm_s": comm_s, "copy_s": copy_s,
            "comm_bytes_by_axis": {cluster.mesh.axis_names[0]: comm_bytes},
            "memory_bytes_peak": dp_estimate.get("memory_bytes_peak"),
            "collectives_by_kind": {"all_reduce": buckets} if buckets else {}, "cluster": cluster.name}


def fsdp_unit_bytes(units: Sequence[Sequence[tuple[Sequence[int], int]]], world: int) -> list[float]:
    """Bytes of each FSDP unit's flat parameter as torch's FSDP2 gathers it over ``world`` ranks: every parameter's
    dim 0 padded up to a multiple of ``world`` (a 0-d parameter counts as one row). ``units[u]``: unit ``u``'s
    parameters as (shape, item size) pairs (each parameter in one unit only)."""
    def padded(shape: Sequence[int], itemsize: int) -> int:
        rows = shape[0] if shape else 1
        return -(-rows // world) * world * math.prod(shape[1:]) * itemsize

    return [float(sum(padded(shape, itemsize) for shape, itemsize in unit)) for unit in units]


def _eager_compute_s(graph: Graph, cluster: Cluster, layout_estimate: Any, layout_plan: Plan | None) -> float:
    """A layout's compute as torch runs it eagerly: at the eager per-node cost instead of the runtime's (where the
    calibration measured one), each rank drawing only its share of the random ops (with ``layout_plan``)."""
    device = cluster.device
    compute_s = float(layout_estimate["compute_s"])
    if layout_plan is not None:
        compute_s -= eager_random_discount(graph, layout_plan, cluster)
    if device.eager_op_overhead_s > 0:
        compute_s += len(graph.nodes) * (device.eager_op_overhead_s - device.op_overhead_s)
    return compute_s


def _fsdp_comm(unit_bytes: Sequence[float], world: int, link: Any, reshard_after_forward: bool) -> tuple[float, float, dict[str, int], int]:
    """(seconds, bytes sent, calls by kind, calls priced one by one) of FSDP2's collectives over ``world`` ranks on
    ``link``: per unit, its all-gathers (two when ``reshard_after_forward``) and one reduce-scatter. Where the link
    carries a measured cost of FSDP2's units (:attr:`~metadist.cost.cluster.Link.fsdp_unit_costs`), a unit takes that:
    its collectives with FSDP2's copies into and out of their buffers and its hooks, as they ran together, their waits
    included (no call priced one by one); elsewhere each collective pays its full fixed cost and in-step wait
    (``sync_s``, which the caller reprices by the compute before it, :func:`spread_waits`) and nothing else is
    priced."""
    from ..cost.comm import collective_seconds

    gathers = 2 if reshard_after_forward else 1
    measured = link.fsdp_unit_cost("zero3" if reshard_after_forward else "zero2")
    comm_s = comm_bytes = 0.0
    calls: dict[str, int] = {}
    for size in (size for size in unit_bytes if size > 0 and world > 1):
        unit_s = 0.0
        for kind, buffer, count in (("all_gather", size / world, gathers), ("reduce_scatter", size, 1)):
            seconds, sent = collective_seconds(kind, buffer, world, link)
            unit_s, comm_bytes = unit_s + count * seconds, comm_bytes + count * sent
            calls[kind] = calls.get(kind, 0) + count
        comm_s += unit_s if measured is None else measured[0] + size / measured[1]
    return comm_s, comm_bytes, calls, 0 if measured is not None else sum(calls.values())


def spread_waits(compute_s: float, calls: int, waiting: Sequence[Any]) -> float:
    """What the in-step waits of torch's collectives come to beyond the ``sync_s`` their prices hold, with the step's
    ``calls`` collective calls spread evenly over its ``compute_s`` (each follows ``compute_s / calls`` of compute):
    ``waiting`` holds the link of each call priced at ``sync_s`` (the others, FSDP2's measured units, hold their waits).

    Where a link measured :attr:`~metadist.cost.cluster.Link.sync_by_gap` a call that follows little compute waits
    less (:func:`metadist.cost.comm.sync_corrections`); MetaDist's rows are priced by the gaps of their lowered program,
    torch's calls sit where its hooks put them (TP's at each row-wise linear's output and column-wise linear's input
    gradient, FSDP2's at each unit's start and end, DDP's as buckets fill), which the estimate does not follow call by
    call: spread evenly, a step of many calls pays short waits, one of a few calls the long one."""
    from ..cost.comm import sync_corrections

    if calls < len(waiting):
        raise ValueError(f"spread_waits: {len(waiting)} waiting calls of only {calls} calls")
    if not waiting:
        return 0.0
    gap = compute_s / calls
    return sum(sync_corrections([(gap, 1.0, link) for link in waiting], 0.0))


def torch_fsdp_estimate(graph: Graph, cluster: Cluster, layout_estimate: Any, unit_bytes: Sequence[float],
                        reshard_after_forward: bool, layout_plan: Plan | None = None,
                        dtensor_ops: int = 0) -> dict[str, Any]:
    """The cost model's price of torch's FSDP2 (``fully_shard`` per unit and at the root) on ``graph`` over all of
    ``cluster``'s ranks on one axis (``cluster.mesh`` one-dimensional): not the solver's ``zero2``/``zero3`` layout.

    Each unit (``unit_bytes``: its padded flat parameter, :func:`fsdp_unit_bytes`) all-gathers its parameters before
    its forward, again before its backward when ``reshard_after_forward`` (ZeRO-3; ZeRO-2 keeps them gathered), and
    reduce-scatters its gradients after its backward (carried out as an all-reduce of the whole gradient on gloo):
    one call each, paying its full fixed cost and its in-step wait spread over the step (:func:`spread_waits`); on a
    link that carries FSDP2's measured unit costs
    (calibration version 14), a unit costs what FSDP2 was measured to add per unit of its bytes instead, copies and
    hooks included (:func:`_fsdp_comm`). Compute: the layout's (``layout_estimate``, the update on
    each rank's shard) at the eager per-node cost, random ops drawn per rank (``layout_plan``), as
    :func:`torch_ddp_estimate` prices DDP's, plus ``dtensor_ops`` ops on DTensors (the eager optimizer's ops on the
    sharded parameters, :func:`dtensor_seconds`); no overlap is assumed."""
    if cluster.mesh.ndim != 1:
        raise ValueError(f"torch_fsdp_estimate prices FSDP over all ranks on one axis; got mesh {cluster.mesh}")
    dtensor_s = dtensor_seconds(cluster, dtensor_ops)
    compute_s = _eager_compute_s(graph, cluster, layout_estimate, layout_plan) + dtensor_s
    comm_s, comm_bytes, calls, waiting = _fsdp_comm(unit_bytes, cluster.mesh.size, cluster.link(0), reshard_after_forward)
    comm_s += spread_waits(compute_s, sum(calls.values()), [cluster.link(0)] * waiting)
    return {"step_s": compute_s + comm_s, "compute_s": compute_s, "comm_s": comm_s, "dtensor_s": dtensor_s,
            "comm_bytes_by_axis": {cluster.mesh.axis_names[0]: comm_bytes},
            "memory_bytes_peak": layout_estimate.get("memory_bytes_peak"),
            "collectives_by_kind": calls, "cluster": cluster.name}


def dtensor_seconds(cluster: Cluster, ops: int, module_ops: int = 0, collectives: int = 0) -> float:
    """What ``ops`` elementwise ops on DTensors (an eager optimizer's) and ``module_ops`` ops of tensor-parallel
    modules' forward and backward cost beyond the same ops on plain tensors
    (:attr:`metadist.cost.cluster.Device.dtensor_op_overhead_s` and ``dtensor_module_op_overhead_s``, the module
    ops at the first where the calibration did not measure the second; 0 where it measured neither), and what
    ``collectives`` all-reduces those modules issue through DTensor cost the calling thread beyond the plain calls the
    links price (``dtensor_collective_overhead_s``)."""
    if ops < 0 or module_ops < 0 or collectives < 0:
        raise ValueError(f"a count of DTensor ops must be >= 0, got {ops} and {module_ops} module ops and "
                         f"{collectives} collectives")
    device = cluster.device
    module_op_s = device.dtensor_module_op_overhead_s or device.dtensor_op_overhead_s
    return ops * device.dtensor_op_overhead_s + module_ops * module_op_s + collectives * device.dtensor_collective_overhead_s


def torch_tp_estimate(graph: Graph, cluster: Cluster, layout_estimate: Any, activation_reduces: Sequence[float],
                      dtensor_ops: int, fsdp_unit_bytes: Sequence[float] = (), layout_plan: Plan | None = None,
                      module_ops: int = 0) -> dict[str, Any]:
    """The cost model's price of torch's Megatron-style tensor parallelism (``parallelize_module`` with column- and
    row-wise linears) on the LAST axis of ``cluster``'s mesh, with FSDP2 (ZeRO-2: parameters kept gathered after
    the forward) over the axis before it when the mesh is 2-D: not the solver's ``megatron`` layout, which MetaDist's
    runtime would run with its own collectives.

    torch's TP all-reduces activations where a row-wise linear ends (forward) and where a column-wise linear's input
    gradient is summed (backward), one blocking call each, between compute phases: ``activation_reduces`` holds each
    call's bytes per rank, each priced as one all-reduce paying its full fixed cost and its in-step wait at the compute
    before it, the step's calls spread evenly over its compute (:func:`spread_waits`). FSDP2's units
    (``fsdp_unit_bytes``, of the parameters as TP leaves them on a rank) are priced as :func:`torch_fsdp_estimate`
    prices them. Compute: the layout's (``layout_estimate``) at the eager per-node cost, random ops drawn per rank
    (``layout_plan``), plus the ops on DTensors (:func:`dtensor_seconds`): ``module_ops`` of the parallel modules'
    forward and backward, ``dtensor_ops`` of the eager optimizer on the DTensor parameters, and what DTensor adds to
    each activation all-reduce in the calling thread. No overlap is assumed."""
    from ..cost.comm import collective_seconds

    mesh = cluster.mesh
    if mesh.ndim not in (1, 2):
        raise ValueError(f"torch_tp_estimate prices TP on the last axis of a 1-D or 2-D mesh; got mesh {mesh}")
    if mesh.ndim == 1 and fsdp_unit_bytes:
        raise ValueError("torch_tp_estimate: FSDP units need a 2-D mesh (dp, tp)")
    tp_axis = mesh.ndim - 1
    reduced = [size for size in activation_reduces if size > 0 and mesh.shape[tp_axis] > 1]
    dtensor_s = dtensor_seconds(cluster, dtensor_ops, module_ops, collectives=len(reduced))
    compute_s = _eager_compute_s(graph, cluster, layout_estimate, layout_plan) + dtensor_s
    bytes_by_axis = {name: 0.0 for name in mesh.axis_names}
    calls: dict[str, int] = {}
    waiting = []
    comm_s = 0.0
    for size in reduced:
        seconds, sent = collective_seconds("all_reduce", size, mesh.shape[tp_axis], cluster.link(tp_axis))
        comm_s += seconds
        bytes_by_axis[mesh.axis_names[tp_axis]] += sent
        calls["all_reduce"] = calls.get("all_reduce", 0) + 1
        waiting.append(cluster.link(tp_axis))
    if mesh.ndim == 2:
        seconds, sent, fsdp_calls, fsdp_waiting = _fsdp_comm(fsdp_unit_bytes, mesh.shape[0], cluster.link(0),
                                                              reshard_after_forward=False)
        comm_s += seconds
        bytes_by_axis[mesh.axis_names[0]] += sent
        for kind, count in fsdp_calls.items():
            calls[kind] = calls.get(kind, 0) + count
        waiting += [cluster.link(0)] * fsdp_waiting
    comm_s += spread_waits(compute_s, sum(calls.values()), waiting)
    return {"step_s": compute_s + comm_s, "compute_s": compute_s, "comm_s": comm_s, "dtensor_s": dtensor_s,
            "comm_bytes_by_axis": bytes_by_axis, "memory_bytes_peak": layout_estimate.get("memory_bytes_peak"),
            "collectives_by_kind": calls, "cluster": cluster.name}


def eager_random_discount(graph: Graph, plan: Plan, cluster: Cluster) -> float:
    """Seconds less that ``plan``'s random ops take when each rank draws only its own share, as torch runs a model
    eagerly under DDP or FSDP (other values than one device's), against MetaDist's runtime, which draws every random
    tensor whole on every rank and keeps its slice (:attr:`metadist.cost.compute.Work.draws_whole`). Priced on
    ``plan``'s own mesh with ``cluster``'s device (the torch estimates price their collectives over all ranks on one
    axis, whatever mesh the layout was planned on)."""
    saved = 0.0
    for node in graph.nodes:
        if not node.op.is_random:
            continue
        strategy = plan.node_strategies[node.name]
        in_specs = [graph.value(name).spec for name in node.input_names]
        out_specs = [v.spec if v else None for v in node.outputs]
        work = node_work(graph, node)
        whole = compute_seconds(work, in_specs, out_specs, strategy, plan.mesh, cluster.device)
        share = compute_seconds(replace(work, draws_whole=False), in_specs, out_specs, strategy, plan.mesh, cluster.device)
        saved += whole - share
    return saved
