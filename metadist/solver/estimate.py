"""The estimate of a whole assignment: step time (compute, communication per axis), memory.

This evaluates an assignment edge by edge and value by value on the full graph (no tying, no
merging), so the ILP's plan, beam search's plan and the baselines are priced the same way,
bucketed edges included (:mod:`metadist.cost.bucketing`): the reshardings the runtime coalesces
are priced as the calls they make, one fixed cost per bucket of each (kind, axis, reduce op,
dtype) the assignment uses, where the search's objective shares the fixed costs by an estimate
(``coalesced_s`` is the difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..cost import (
    OUTPUT_CONSUMER, Bucketing, Cluster, bucketing_for, collective_seconds, compute_seconds, halo_exchange_bytes, local_nbytes, node_work,
    reshard,
)
from ..cost.comm import fixed_seconds, sync_corrections, waits_by_gap
from ..ir import Graph, Partial
from ..ir.plan import NodeStrategy


@dataclass(frozen=True)
class Assignment:
    """A strategy for every node and a sharding for every graph input."""

    node_strategies: Mapping[str, NodeStrategy]
    input_shardings: Mapping[str, tuple]


def value_shardings(graph: Graph, assignment: Assignment) -> dict[str, tuple]:
    """The sharding each value is produced in."""
    produced = dict(assignment.input_shardings)
    for node in graph.nodes:
        strategy = assignment.node_strategies[node.name]
        for value, sharding in zip(node.outputs, strategy.outputs):
            if value is not None:
                produced[value.name] = sharding
    return produced


class _ShardingNumbers:
    """A small int per distinct sharding (equal shardings, one number), looked up by identity first.

    Hashing a sharding hashes each placement dataclass; the strategies share their sharding objects, so an
    identity hit saves that. Each identity entry holds its object, so an identity is never reused while kept.
    """

    def __init__(self) -> None:
        self.by_identity: dict[int, tuple[int, Any]] = {}
        self.by_value: dict[tuple, int] = {}

    def __call__(self, sharding) -> int:
        hit = self.by_identity.get(id(sharding))
        if hit is not None:
            return hit[0]
        number = self.by_value.setdefault(tuple(sharding), len(self.by_value))
        self.by_identity[id(sharding)] = (number, sharding)
        return number


def _edges(graph: Graph, assignment: Assignment, produced: Mapping[str, tuple], bucketing: Bucketing,
           numbering: _ShardingNumbers | None = None):
    """(spec, source sharding, needed sharding, fixed-cost share, position, bucketed) of every resharding the runtime
    runs, ``position`` the index of the node that reads it first (the node count for a graph output), ``bucketed``
    whether the runtime coalesces it (:meth:`~metadist.cost.bucketing.Bucketing.bucketed`).

    As the lowering does (:meth:`metadist.lowering.program._Lowering.use`), a value resharded to one sharding is
    resharded once, whoever reads it: later readers (and a graph output) that need that sharding share the result,
    so they send nothing more. Each (value, needed sharding) is yielded once, with the share of its first reader.
    """
    from .problem import final_output_sharding

    seen: set[tuple[str, int]] = set()
    number = numbering if numbering is not None else _ShardingNumbers()

    def first(name: str, needed) -> bool:
        key = (name, number(needed))
        if key in seen:
            return False
        seen.add(key)
        return True

    for position, node in enumerate(graph.nodes):
        for name, needed in zip(node.input_names, assignment.node_strategies[node.name].inputs):
            if first(name, needed):
                yield (graph.value(name).spec, produced[name], needed, bucketing.share(name, node.name), position,
                       bucketing.bucketed(name, node.name))
    for graph_output in graph.outputs:
        src = produced[graph_output.name]
        dst = assignment.input_shardings[graph_output.replaces] if graph_output.replaces else final_output_sharding(src)
        if first(graph_output.name, dst):
            yield (graph.value(graph_output.name).spec, src, dst, bucketing.share(graph_output.name, OUTPUT_CONSUMER),
                   len(graph.nodes), bucketing.bucketed(graph_output.name, OUTPUT_CONSUMER))


def communication(graph: Graph, assignment: Assignment, cluster: Cluster, bucketing: Bucketing | None = None,
                  produced: Mapping[str, tuple] | None = None, node_seconds: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Seconds and bytes per mesh axis, and collectives by kind (bucketed edges: see :mod:`metadist.cost.bucketing`).

    ``local_copy_s``: the copies the reshardings' local steps make (a local slice's clone:
    :func:`~metadist.cost.comm.resharding_local_copies`), a part of the step beside its compute and calls.

    A coalesced resharding (:meth:`~metadist.cost.bucketing.Bucketing.bucketed`) is priced by its bytes here; the
    calls the coalesced ones make are priced after: per (kind, axis, reduce op, dtype) they use, one fixed cost
    (:func:`~metadist.cost.comm.fixed_seconds`) per bucket of their bytes, run where the first of them stands (as
    :mod:`metadist.lowering.coalesce` forms them). ``coalesced_s`` is what that adds to the fixed-cost shares the
    reshardings' own prices hold (the search's objective prices the shares: :mod:`metadist.cost.bucketing`).

    ``produced``: :func:`value_shardings` of the assignment, where the caller has it. ``node_seconds`` (node name ->
    compute seconds): with it, on a link that measured :attr:`~metadist.cost.cluster.Link.sync_by_gap`, each call's
    wait is priced by the compute in node order since the call before it (:func:`~metadist.cost.comm.sync_corrections`).
    """
    bucketing = bucketing_for(graph) if bucketing is None else bucketing
    produced = value_shardings(graph, assignment) if produced is None else produced
    number = _ShardingNumbers()
    names = cluster.mesh.axis_names
    comm_s = {name: 0.0 for name in names}
    comm_bytes = {name: 0.0 for name in names}
    kinds: dict[str, int] = {}
    cache: dict[tuple, Any] = {}
    by_gap = node_seconds is not None and waits_by_gap(cluster)
    calls: list[tuple[int, float, int]] = []  # (position, fixed-cost share, axis) of each call, for the waits by gap
    # (kind, axis, reduce op, dtype) of coalesced reshardings -> [first position, bytes sent, their fixed-cost shares]
    coalesced: dict[tuple, list] = {}
    local_copy_s = 0.0
    for position, node in enumerate(graph.nodes):
        strategy = assignment.node_strategies[node.name]
        for axis, halo in enumerate(strategy.halos):
            for name, sharding in zip(node.input_names, strategy.inputs) if halo else ():
                buffer_bytes = halo_exchange_bytes(graph.value(name).spec, sharding, axis, halo, cluster.mesh)
                if buffer_bytes:
                    seconds, sent = collective_seconds("all_gather", buffer_bytes, cluster.mesh.shape[axis], cluster.link(axis))
                    comm_s[names[axis]] += seconds
                    comm_bytes[names[axis]] += sent
                    kinds["halo_exchange"] = kinds.get("halo_exchange", 0) + 1
                    if by_gap:
                        calls.append((position, 1.0, axis))
    for spec, src, dst, share, position, bucketed in _edges(graph, assignment, produced, bucketing, number):
        key = (spec, number(src), number(dst), share)
        if key not in cache:
            cache[key] = reshard(spec, src, dst, cluster, share)
        local_copy_s += cache[key].local_s
        for collective in cache[key].collectives:
            axis = collective.axis
            comm_s[names[axis]] += collective.comm_s
            comm_bytes[names[axis]] += collective.comm_bytes
            kinds[collective.kind] = kinds.get(collective.kind, 0) + 1
            if bucketed and collective.kind != "all_to_all":  # all-to-alls are not coalesced
                placement = src[axis]
                group = (collective.kind, axis, placement.op if isinstance(placement, Partial) else None, spec.dtype)
                entry = coalesced.setdefault(group, [position, 0.0, 0.0])
                entry[0] = min(entry[0], position)
                entry[1] += collective.comm_bytes
                entry[2] += share
            elif by_gap:
                calls.append((position, 1.0, axis))
    coalesced_s = 0.0
    for (kind, axis, _, _), (position, sent, shares) in coalesced.items():  # one fixed cost per (kind, axis)
        buckets = max(1, math.ceil(sent / bucketing.cap_bytes))
        extra = (buckets - shares) * fixed_seconds(kind, cluster.mesh.shape[axis], cluster.link(axis))
        comm_s[names[axis]] += extra
        coalesced_s += extra
        if by_gap:
            calls.extend((position, 1.0, axis) for _ in range(buckets))
    if by_gap and calls:
        _add_waits_by_gap(graph, cluster, node_seconds, calls, comm_s)
    return {"comm_s_by_axis": comm_s, "comm_bytes_by_axis": comm_bytes, "collectives_by_kind": dict(sorted(kinds.items())),
            "coalesced_s": coalesced_s, "local_copy_s": local_copy_s}


def _add_waits_by_gap(graph: Graph, cluster: Cluster, node_seconds: Mapping[str, float],
                      calls: list[tuple[int, float, int]], comm_s: dict[str, float]) -> None:
    """Add to ``comm_s`` what each call's wait comes to, priced by the compute before it, beyond its ``sync_s``.

    A call at position ``p`` runs before node ``p``'s compute (a graph output's after all of it); calls are taken in
    that order (stable: halos before the node's other inputs)."""
    before = [0.0]
    for node in graph.nodes:
        before.append(before[-1] + node_seconds.get(node.name, 0.0))
    calls.sort(key=lambda call: call[0])
    ordered, last = [], 0
    for position, share, axis in calls:
        ordered.append((before[position] - before[last], share, cluster.link(axis)))
        last = position
    names = cluster.mesh.axis_names
    for (_, _, axis), correction in zip(calls, sync_corrections(ordered, before[-1] - before[last])):
        comm_s[names[axis]] += correction


def node_compute_s(graph: Graph, node_name: str, strategy: NodeStrategy, cluster: Cluster) -> float:
    node = graph.node(node_name)
    in_specs = [graph.value(name).spec for name in node.input_names]
    out_specs = [v.spec if v else None for v in node.outputs]
    return compute_seconds(node_work(graph, node), in_specs, out_specs, strategy, cluster.mesh, cluster.device)


NodeFacts = Mapping[str, tuple]
"""Per node name: (signature, work, input specs, output specs); equal signatures, equal (work, specs)."""


def node_facts(graph: Graph) -> NodeFacts:
    """What pricing a node's compute reads of the graph (:func:`.compute_seconds` besides the strategy and cluster)."""
    signatures: dict[tuple, int] = {}
    facts = {}
    for node in graph.nodes:
        in_specs = tuple(graph.value(value).spec for value in node.input_names)
        out_specs = tuple(value.spec if value else None for value in node.outputs)
        work = node_work(graph, node)
        signature = signatures.setdefault((work, in_specs, out_specs), len(signatures))
        facts[node.name] = (signature, work, in_specs, out_specs)
    return facts


def total_compute_s(graph: Graph, assignment: Assignment, cluster: Cluster, facts: NodeFacts | None = None) -> float:
    """The sum of :func:`node_compute_seconds`."""
    return sum(node_compute_seconds(graph, assignment, cluster, facts).values())


def node_compute_seconds(graph: Graph, assignment: Assignment, cluster: Cluster,
                         facts: NodeFacts | None = None) -> dict[str, float]:
    """:func:`node_compute_s` of each of the assignment's nodes, each distinct (strategy, work, specs) priced once.

    A deep model's layers repeat the same nodes under the same strategies, so most nodes hit: the key is the
    strategy object's identity (the assignment holds every strategy for the call, so an identity is never reused
    within it) with the node's signature in ``facts`` (:func:`node_facts`, computed here if not given).
    """
    facts = node_facts(graph) if facts is None else facts
    seconds: dict[tuple, float] = {}
    by_node = {}
    for name, strategy in assignment.node_strategies.items():
        signature, work, in_specs, out_specs = facts[name]
        key = (id(strategy), signature)
        found = seconds.get(key)
        if found is None:
            found = seconds[key] = compute_seconds(work, in_specs, out_specs, strategy, cluster.mesh, cluster.device)
        by_node[name] = found
    return by_node


def memory(graph: Graph, assignment: Assignment, cluster: Cluster, lives, produced: Mapping[str, tuple] | None = None) -> dict[str, Any]:
    """The per-device memory curve's peak, where it is, and its make-up by category (``produced``: see :func:`communication`)."""
    produced = value_shardings(graph, assignment) if produced is None else produced
    end = len(graph.nodes)
    delta = [0.0] * (end + 3)
    sizes = {}
    for life in lives.values:
        if life.holds_memory:
            sizes[life.name] = local_nbytes(life.spec, produced[life.name], cluster.mesh)
            delta[life.start + 1] += sizes[life.name]
            delta[life.end + 2] -= sizes[life.name]
    running, peak, peak_position = 0.0, -1.0, -1
    for position in range(-1, end + 1):
        running += delta[position + 1]
        if running > peak:
            peak, peak_position = running, position
    by_category: dict[str, float] = {}
    for life in lives.live_at(peak_position):
        by_category[life.category] = by_category.get(life.category, 0.0) + sizes[life.name]
    return {
        "memory_bytes_peak": peak,
        "memory_peak_position": peak_position,
        "memory_peak_node": graph.nodes[peak_position].name if 0 <= peak_position < end else "(step start/end)",
        "memory_bytes_by_role": dict(sorted(by_category.items())),
    }


def estimate(graph: Graph, assignment: Assignment, cluster: Cluster, lives, bucketing: Bucketing | None = None,
             facts: "NodeFacts | None" = None) -> dict[str, Any]:
    """Step time (compute + communication + the reshardings' local copies, no overlap assumed) and memory per device.

    ``facts``: :func:`node_facts` of ``graph``, for a caller that estimates many assignments of one graph.
    """
    node_seconds = node_compute_seconds(graph, assignment, cluster, facts)
    compute_s = sum(node_seconds.values())
    produced = value_shardings(graph, assignment)
    comm = communication(graph, assignment, cluster, bucketing, produced, node_seconds)
    comm_s = sum(comm["comm_s_by_axis"].values())
    result: dict[str, Any] = {"step_s": compute_s + comm_s + comm["local_copy_s"], "compute_s": compute_s, "comm_s": comm_s}
    result.update(comm)
    result.update(memory(graph, assignment, cluster, lives, produced))
    return result
