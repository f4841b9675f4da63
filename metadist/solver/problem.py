"""The solver's problem: decision units, their strategies and costs, edges, memory.

A **unit** is what takes one strategy: a graph input (its sharding) or a node together with
the followers merged into it (:mod:`.shrink`). A **class** is a set of tied units (repeated
layers) sharing one set of variables; costs of a class are summed over its units.

Costs, all in seconds: ``compute_s[c][s]`` (roofline of the class's nodes under strategy
``s``, plus the halo exchange a halo factor needs before its node), ``linear_comm_s[c][s]`` (resharding on edges whose other end has a single strategy,
or joins two tied copies of the same class), and one :class:`ClassEdge` for every other
producer/consumer pair, whose cost depends on the producer's output sharding ``p`` and the
consumer's required input sharding ``q`` only: ``comm_s[p][q]``. Memory: at each liveness
peak, ``memory_bytes[peak][c][s]`` plus a constant.

Edges the runtime buckets (:mod:`metadist.cost.bucketing`: update-phase reads of gradients and
of graph inputs, and the graph outputs) pay a share of each collective's fixed cost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..cost import (
    NO_BUCKETING, OUTPUT_CONSUMER, Bucketing, Cluster, Liveness, bucketing_for, compute_seconds, halo_exchange_seconds, liveness, local_nbytes, node_work, reshard,
)
from ..ir import Graph, Partial, Replicate, Rule
from ..ir.plan import NodeStrategy
from ..cost.bucketing import CAST_OPS
from .precision import FORBIDDEN_S, reduces_partial, restricted_values
from .shrink import follower_choice, tie_inputs, tie_nodes
from .strategies import StrategySet, input_strategies, node_strategies

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """Members (node names, or one graph input's value name) taking one joint strategy."""

    members: tuple[str, ...]
    is_input: bool
    strategies: tuple[tuple[NodeStrategy, ...], ...]
    """``strategies[s][m]``: member ``m``'s strategy under unit strategy ``s``."""


@dataclass(frozen=True)
class ClassEdge:
    """Resharding between two classes that both have several strategies."""

    producer: int
    consumer: int
    producer_label: tuple[int, ...]
    """Index of the producer's output sharding, per producer strategy."""
    consumer_label: tuple[int, ...]
    """Index of the consumer's required sharding, per consumer strategy."""
    comm_s: tuple[tuple[float, ...], ...]
    """Seconds, summed over the tied copies of this edge, per (producer label, consumer label)."""


@dataclass(frozen=True)
class Problem:
    """Everything the ILP and beam search need, and the maps back to the graph."""

    graph: Graph
    cluster: Cluster
    units: tuple[Unit, ...]
    member_unit: Mapping[str, tuple[int, int]]
    """Node or input name -> (unit index, member position)."""
    unit_class: tuple[int, ...]
    """Unit index -> the index of its class's representative unit."""
    classes: tuple[int, ...]
    compute_s: Mapping[int, tuple[float, ...]]
    linear_comm_s: Mapping[int, tuple[float, ...]]
    edges: tuple[ClassEdge, ...]
    peaks: tuple[int, ...]
    memory_bytes: tuple[Mapping[int, tuple[float, ...]], ...]
    memory_constant_bytes: tuple[float, ...]
    liveness: Liveness
    excluded_indivisible: int
    missing_rules: Mapping[str, str]
    stats: Mapping[str, Any] = field(default_factory=dict)
    bucketing: Bucketing = NO_BUCKETING
    """The edges priced as bucketed collectives (:mod:`metadist.cost.bucketing`)."""

    def strategy_count(self, class_index: int) -> int:
        return len(self.units[class_index].strategies)


@dataclass(frozen=True)
class Restrictions:
    """Limits on the strategies considered (baselines use them)."""

    input_shardings: Mapping[str, frozenset] = field(default_factory=dict)
    """Graph input name -> the shardings it may take."""
    uneven_shards: bool = True
    """Whether dims may be split unevenly (``torch.chunk`` pieces); False for a runtime that takes even shards only."""
    reduce_dtype: str | None = None
    """A precision policy's gradient reduce dtype: gradient-shaped values reduce in it only (:mod:`.precision`)."""


def _member_strategies(graph: Graph, rules: Mapping[str, Rule], cluster: Cluster, restrictions: Restrictions):
    """Strategies and compute seconds of every node and graph input, with caches by signature."""
    mesh, cache = cluster.mesh, {}
    sets: dict[str, StrategySet] = {}
    compute: dict[str, tuple[float, ...]] = {}
    for graph_input in graph.inputs:
        name = graph_input.value.name
        sets[name] = input_strategies(graph_input.value.spec, mesh, restrictions.input_shardings.get(name),
                                      restrictions.uneven_shards)
        compute[name] = (0.0,) * len(sets[name].strategies)
    for node in graph.nodes:
        in_specs = tuple(graph.value(name).spec for name in node.input_names)
        out_specs = tuple(v.spec if v else None for v in node.outputs)
        key = (rules.get(node.name), node.op.target, node.op.is_view, in_specs, out_specs)
        if key not in cache:
            found = node_strategies(key[0], tuple(s.shape for s in in_specs), tuple(s.shape if s else None for s in out_specs), mesh,
                                    restrictions.uneven_shards)
            work = node_work(graph, node)
            seconds = tuple(
                compute_seconds(work, in_specs, out_specs, st, mesh, cluster.device) + halo_exchange_seconds(in_specs, st, cluster)[0]
                for st in found.strategies
            )
            cache[key] = (found, seconds)
        sets[node.name], compute[node.name] = cache[key]
    return sets, compute


def _output_sharding(unit: Unit, strategy: int, member: int, output_index: int) -> tuple:
    return unit.strategies[strategy][member].outputs[output_index]


class _SetFacts:
    """Facts about one strategy set, computed once per set (sets are shared by signature)."""

    def __init__(self) -> None:
        self.single_input: dict[int, list] = {}
        self.canonical: dict[int, list[int]] = {}
        self.follow: dict[tuple, list[int] | None] = {}
        """Follower choices by (leader set, leader strategy column, output, follower set, spec): layers repeat."""

    def single(self, found: StrategySet) -> list:
        """Per strategy: the one sharding it needs on all its input slots, or None."""
        if id(found) not in self.single_input:
            self.single_input[id(found)] = [
                st.inputs[0] if st.inputs and all(x == st.inputs[0] for x in st.inputs) else None for st in found.strategies
            ]
        return self.single_input[id(found)]

    def canonical_index(self, found: StrategySet) -> list[int]:
        """Per strategy: the first strategy with the same input and output shardings."""
        if id(found) not in self.canonical:
            first: dict[tuple, int] = {}
            self.canonical[id(found)] = [first.setdefault((st.inputs, st.outputs), i) for i, st in enumerate(found.strategies)]
        return self.canonical[id(found)]


def _merge_followers(graph: Graph, sets, compute, price, facts: _SetFacts, restricted: frozenset[str]):
    """Units after follower merging: members, rows[s][m] (strategy index of member m), is_input."""
    members: list[list[str]] = []
    rows: list[list[list[int]]] = []
    is_input: list[bool] = []
    where: dict[str, tuple[int, int]] = {}
    node_names = {node.name for node in graph.nodes}
    for name in [gi.value.name for gi in graph.inputs] + [node.name for node in graph.nodes]:
        if name in node_names and _try_follow(graph, graph.node(name), sets, compute, where, members, rows, price, facts,
                                              restricted):
            continue
        where[name] = (len(members), 0)
        members.append([name]), rows.append([[i] for i in range(len(sets[name].strategies))])
        is_input.append(name not in node_names)
    return members, rows, is_input


def _try_follow(graph, node, sets, compute, where, members, rows, price, facts: _SetFacts, restricted) -> bool:
    """Merge ``node`` into its only input's unit if it can just follow it (see :mod:`.shrink`)."""
    distinct = set(node.input_names)
    if len(distinct) != 1 or len(sets[node.name].strategies) <= 1:
        return False
    if any(value.name in restricted for value in node.output_values):
        return False  # its greedy choice (pass a Partial on) could leave only forbidden reductions: the ILP decides
    value = distinct.pop()
    if node.op.target in CAST_OPS and graph.producer(value) is None:
        return False  # a parameter's cast (mixed precision): cast the shard and gather the copy, or not, is the ILP's
    producer = graph.producer(value)
    leader_name = value if producer is None else producer.name
    output_index = 0 if producer is None else [v.name if v else None for v in producer.outputs].index(value)
    unit, member = where[leader_name]
    leader_set = sets[members[unit][member]]
    column = tuple(row[member] for row in rows[unit])
    spec, limited = graph.value(value).spec, value in restricted
    key = (id(leader_set), column, output_index, id(sets[node.name]), spec, limited)
    if key not in facts.follow:
        leader_outputs = [leader_set.strategies[i].outputs[output_index] for i in column]
        facts.follow[key] = follower_choice(leader_outputs, facts.single(sets[node.name]), compute[node.name],
                                            lambda p, q: price(spec, p, q, restricted=limited))
    choice = facts.follow[key]
    if choice is None:
        return False
    for row, index in zip(rows[unit], choice):
        row.append(index)
    where[node.name] = (unit, len(members[unit]))
    members[unit].append(node.name)
    return True


def _build_units(graph: Graph, sets, compute, price, restricted) -> tuple[list[Unit], list[list[float]]]:
    """Merge followers, then drop strategies whose shardings repeat a cheaper one's (dominated)."""
    facts = _SetFacts()
    members, rows, is_input = _merge_followers(graph, sets, compute, price, facts, restricted)
    units, unit_seconds, memo = [], [], {}
    for names, unit_rows, flag in zip(members, rows, is_input):
        key = (tuple(id(sets[name]) for name in names), tuple(map(tuple, unit_rows)))
        if key not in memo:  # tied layers repeat the same sets and rows
            memo[key] = _dedupe_rows(names, unit_rows, sets, compute, facts)
        strategies, seconds = memo[key]
        units.append(Unit(tuple(names), flag, strategies))
        unit_seconds.append(seconds)
    return units, unit_seconds


def _dedupe_rows(names, unit_rows, sets, compute, facts: _SetFacts):
    """The unit's strategies and seconds, without strategies whose shardings repeat a cheaper one's."""
    canon = [facts.canonical_index(sets[name]) for name in names]
    best: dict[tuple, int] = {}
    seconds = [sum(compute[name][i] for name, i in zip(names, row)) for row in unit_rows]
    for index, row in enumerate(unit_rows):
        key = tuple(c[i] for c, i in zip(canon, row))
        if key not in best or seconds[index] < seconds[best[key]]:
            best[key] = index
    keep = sorted(best.values())
    strategies = tuple(tuple(sets[name].strategies[i] for name, i in zip(names, unit_rows[k])) for k in keep)
    return strategies, [seconds[k] for k in keep]


def _tie_units(graph: Graph, units: list[Unit]) -> list[int]:
    """Class of each unit: the first unit whose members are tied one to one and whose strategies agree."""
    representative = {**tie_inputs(graph), **tie_nodes(graph)}
    classes: dict[tuple, list[int]] = {}
    unit_class = []
    for index, unit in enumerate(units):
        candidates = classes.setdefault(tuple(representative[name] for name in unit.members), [])
        match = next((c for c in candidates if units[c].strategies == unit.strategies), None)
        if match is None:
            candidates.append(index)
            match = index
        unit_class.append(match)
    return unit_class


class _Reshard:
    """Cached resharding seconds.

    Keys are first the identities of (spec, src, dst) (the strategies share their sharding
    objects, so this hits most of the time without hashing dataclasses), then their values.
    Each identity entry holds its objects, so an identity is never reused while cached.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.by_identity, self.by_value = cluster, {}, {}

    def __call__(self, spec, src, dst, fixed_share: float = 1.0, restricted: bool = False) -> float:
        if restricted and reduces_partial(src, dst):
            return FORBIDDEN_S  # a gradient reduced in a dtype the precision policy does not allow
        key = (id(spec), id(src), id(dst), fixed_share)
        hit = self.by_identity.get(key)
        if hit is not None:
            return hit[0]
        value_key = (spec, src, dst, fixed_share)
        seconds = self.by_value.get(value_key)
        if seconds is None:
            seconds = self.by_value[value_key] = reshard(spec, src, dst, self.cluster, fixed_share).comm_s
        self.by_identity[key] = (seconds, spec, src, dst)
        return seconds


def _edge_endpoints(graph: Graph, member_unit, bucketing: Bucketing, restricted: frozenset[str]):
    """(producer (unit, member, output index), consumer (unit, member, slot or -1 for state), spec, fixed-cost share,
    reduce-dtype restricted) per edge."""
    for node in graph.nodes:
        consumer = member_unit[node.name]
        for slot, name in enumerate(node.input_names):
            yield (_producer_of(graph, name, member_unit), (*consumer, slot), graph.value(name).spec,
                   bucketing.share(name, node.name), name in restricted)
    for graph_output in graph.outputs:
        if graph_output.replaces is not None:
            consumer = member_unit[graph_output.replaces]
            yield (_producer_of(graph, graph_output.name, member_unit), (*consumer, -1), graph.value(graph_output.name).spec,
                   bucketing.share(graph_output.name, OUTPUT_CONSUMER), graph_output.name in restricted)


def _producer_of(graph: Graph, value_name: str, member_unit) -> tuple[int, int, int]:
    producer = graph.producer(value_name)
    if producer is None:
        return (*member_unit[value_name], 0)
    return (*member_unit[producer.name], [v.name if v else None for v in producer.outputs].index(value_name))


def _consumer_sharding(unit: Unit, strategy: int, member: int, slot: int) -> tuple:
    row = unit.strategies[strategy][member]
    return row.outputs[0] if slot == -1 else row.inputs[slot]


def _edges(graph, units, member_unit, unit_class, price, bucketing: Bucketing, restricted: frozenset[str]):
    """Linear edge costs per class strategy, and the ClassEdges that need edge variables."""
    linear = {c: [0.0] * len(units[c].strategies) for c in set(unit_class)}
    counts: dict[tuple, int] = {}
    inside: dict[tuple, int] = {}  # edges inside one unit (a follower that reshards its input), by class
    for (pu, pm, pk), (cu, cm, slot), spec, share, limited in _edge_endpoints(graph, member_unit, bucketing, restricted):
        if pu == cu:
            key = (unit_class[pu], pm, pk, cm, slot, spec, share, limited)
            inside[key] = inside.get(key, 0) + 1
            continue
        key = (unit_class[pu], pm, pk, unit_class[cu], cm, slot, spec, share, limited)
        counts[key] = counts.get(key, 0) + 1
    for (c, pm, pk, cm, slot, spec, share, limited), count in inside.items():
        unit = units[c]
        for s in range(len(unit.strategies)):
            linear[c][s] += count * price(spec, _output_sharding(unit, s, pm, pk), _consumer_sharding(unit, s, cm, slot), share,
                                          limited)
    merged: dict[tuple, list[list[float]]] = {}
    priced: dict[tuple, list[list[float]]] = {}  # (spec, shardings, share, limited) -> seconds: many edges carry the same tensor kind
    for (a, pm, pk, b, cm, slot, spec, share, limited), count in counts.items():
        p_all = [_output_sharding(units[a], s, pm, pk) for s in range(len(units[a].strategies))]
        q_all = [_consumer_sharding(units[b], t, cm, slot) for t in range(len(units[b].strategies))]
        p_index, q_index = {p: i for i, p in enumerate(dict.fromkeys(p_all))}, {q: i for i, q in enumerate(dict.fromkeys(q_all))}
        p_list, q_list = tuple(p_index), tuple(q_index)
        key = (spec, p_list, q_list, share, limited)
        seconds = priced.get(key)
        if seconds is None:
            seconds = priced[key] = [[price(spec, p, q, share, limited) for q in q_list] for p in p_list]
        matrix = [[count * x for x in row] for row in seconds]
        p_label = tuple(p_index[p] for p in p_all)
        q_label = tuple(q_index[q] for q in q_all)
        if a == b:
            for s in range(len(p_all)):
                linear[a][s] += matrix[p_label[s]][q_label[s]]
        elif len(q_list) == 1:
            for s in range(len(p_all)):
                linear[a][s] += matrix[p_label[s]][0]
        elif len(p_list) == 1:
            for t in range(len(q_all)):
                linear[b][t] += matrix[0][q_label[t]]
        elif any(any(row) for row in matrix):
            slot_key = (a, b, p_label, q_label)
            if slot_key in merged:
                old = merged[slot_key]
                matrix = [[x + y for x, y in zip(r1, r2)] for r1, r2 in zip(old, matrix)]
            merged[slot_key] = matrix
    edges = tuple(
        ClassEdge(a, b, p_label, q_label, tuple(tuple(row) for row in matrix)) for (a, b, p_label, q_label), matrix in merged.items()
    )
    return linear, edges


def _output_linear(graph, units, member_unit, unit_class, price, linear, bucketing: Bucketing, restricted) -> None:
    """Outputs that do not replace state end replicated where they come out Partial: charge it."""
    for graph_output in graph.outputs:
        if graph_output.replaces is not None:
            continue
        unit_index, member, k = _producer_of(graph, graph_output.name, member_unit)
        spec = graph.value(graph_output.name).spec
        share = bucketing.share(graph_output.name, OUTPUT_CONSUMER)
        for s in range(len(units[unit_index].strategies)):
            src = _output_sharding(units[unit_index], s, member, k)
            linear[unit_class[unit_index]][s] += price(spec, src, final_output_sharding(src), share,
                                                       graph_output.name in restricted)


def final_output_sharding(sharding: tuple) -> tuple:
    """A non-state output leaves the step with its Partial axes reduced (Replicate)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in sharding)


def with_peaks(problem: Problem, peaks: tuple[int, ...]) -> Problem:
    """The same problem with memory budget rows at ``peaks`` (positions in graph order)."""
    memory, constants = _memory(problem.graph, problem.units, problem.member_unit, problem.unit_class, problem.liveness,
                                problem.cluster.mesh, peaks)
    return replace(problem, peaks=tuple(peaks), memory_bytes=memory, memory_constant_bytes=constants)


def _memory(graph, units, member_unit, unit_class, lives: Liveness, mesh, peaks):
    per_peak, constants = [], []
    for peak in peaks:
        coefficients: dict[int, list[float]] = {}
        constant = 0.0
        for life in lives.live_at(peak):
            unit_index, member, k = _producer_of(graph, life.name, member_unit)
            unit = units[unit_index]
            sizes = [local_nbytes(life.spec, _output_sharding(unit, s, member, k), mesh) for s in range(len(unit.strategies))]
            if len(sizes) == 1:
                constant += sizes[0]
                continue
            row = coefficients.setdefault(unit_class[unit_index], [0.0] * len(sizes))
            for s, size in enumerate(sizes):
                row[s] += size
        per_peak.append({c: tuple(row) for c, row in coefficients.items()})
        constants.append(constant)
    return tuple(per_peak), tuple(constants)


def _uneven_stats(sets) -> dict[str, int]:
    """Strategies with uneven splits: kept, and excluded by reason (``excluded_uneven_<reason>``)."""
    stats = {"uneven_strategies": 0}
    for found in sets:
        stats["uneven_strategies"] += found.uneven
        for reason, count in found.excluded_uneven:
            stats[f"excluded_uneven_{reason}"] = stats.get(f"excluded_uneven_{reason}", 0) + count
    return stats


def build_problem(
    graph: Graph,
    rules: Mapping[str, Rule],
    cluster: Cluster,
    restrictions: Restrictions = Restrictions(),
    missing: Mapping[str, str] | None = None,
    bucketing: Bucketing | None = None,
) -> Problem:
    """Enumerate, merge, tie and price: the whole problem, ready for the ILP or beam search.

    ``bucketing``: which edges the runtime coalesces (None: :func:`~metadist.cost.bucketing_for` the graph
    with the runtime's default cap; :data:`~metadist.cost.NO_BUCKETING` prices every collective alone).
    """
    started = time.perf_counter()
    bucketing = bucketing_for(graph) if bucketing is None else bucketing
    sets, compute = _member_strategies(graph, rules, cluster, restrictions)
    price = _Reshard(cluster)
    restricted = restricted_values(graph, restrictions.reduce_dtype)
    units, unit_seconds = _build_units(graph, sets, compute, price, restricted)
    member_unit = {name: (index, position) for index, unit in enumerate(units) for position, name in enumerate(unit.members)}
    unit_class = _tie_units(graph, units)
    classes = tuple(sorted(set(unit_class)))
    compute_s = {c: [0.0] * len(units[c].strategies) for c in classes}
    for index, seconds in enumerate(unit_seconds):
        row = compute_s[unit_class[index]]
        for s, value in enumerate(seconds):
            row[s] += value
    linear, edges = _edges(graph, units, member_unit, unit_class, price, bucketing, restricted)
    _output_linear(graph, units, member_unit, unit_class, price, linear, bucketing, restricted)
    lives = liveness(graph)
    memory, constants = _memory(graph, units, member_unit, unit_class, lives, cluster.mesh, lives.peaks)
    missing_rules = dict(missing or {})
    for node in graph.nodes:
        if node.name not in rules and node.name not in missing_rules:
            missing_rules[node.name] = "no rule given"
    stats = {
        "graph_nodes": len(graph.nodes),
        "graph_inputs": len(graph.inputs),
        "units_after_merging": len(units),
        "classes_after_tying": len(classes),
        "classes_with_choices": sum(1 for c in classes if len(units[c].strategies) > 1),
        "class_edges": len(edges),
        "bucketed_edges": len(bucketing.edges),
        "bucketed_fixed_share": round(bucketing.fixed_share, 6),
        "problem_build_s": round(time.perf_counter() - started, 4),
    }
    logger.info("problem for %s: %s", graph.name, stats)
    return Problem(
        graph=graph, cluster=cluster, units=tuple(units), member_unit=member_unit, unit_class=tuple(unit_class),
        classes=classes, compute_s={c: tuple(v) for c, v in compute_s.items()},
        linear_comm_s={c: tuple(v) for c, v in linear.items()}, edges=edges, peaks=lives.peaks,
        memory_bytes=memory, memory_constant_bytes=constants, liveness=lives,
        excluded_indivisible=sum(s.excluded_indivisible for s in sets.values()), missing_rules=missing_rules,
        stats={**stats, "excluded_inexpressible_strategies": sum(s.excluded_inexpressible for s in sets.values()),
               **_uneven_stats(sets.values())},
        bucketing=bucketing,
    )
