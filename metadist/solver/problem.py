"""The solver's problem: decision units, their strategies and costs, edges, memory.

A **unit** is what takes one strategy: a graph input (its sharding) or a node together with
the followers merged into it (:mod:`.shrink`). A **class** is a set of tied units (repeated
layers) sharing one set of variables; costs of a class are summed over its units.

Costs, all in seconds: ``compute_s[c][s]`` (roofline of the class's nodes under strategy
``s``, plus the halo exchange a halo factor needs before its node). Reshardings are priced as the
lowering runs them: a value is resharded to a given sharding once, however many readers need it
(:class:`_Pricing`). Per value and target sharding, the price from each source sharding lands on
the indicator that some reader needs it: ``linear_comm_s[c][s]`` where that indicator is one class's
strategies (the other end has a single strategy or one label, or the two ends are tied copies of one
class), a :class:`ClassEdge` cell ``comm_s[p][q]`` where it is a producer/reader pair of classes
(``p`` the producer's output sharding, ``q`` the reader's required one), and a
:class:`SharedCharge`, paid once when any of its terms holds, where several distinct readers may need
the same target. Memory: at each liveness peak, ``memory_bytes[peak][c][s]`` plus a constant (values
at their produced sharding: a resharded copy is transient, as in the estimate).

Edges the runtime buckets (:mod:`metadist.cost.bucketing`: update-phase reads of gradients and
of graph inputs, and the graph outputs) pay a share of each collective's fixed cost.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..cost import (
    NO_BUCKETING, OUTPUT_CONSUMER, Bucketing, Cluster, Liveness, bucketing_for, compute_seconds, halo_exchange_seconds, liveness, local_nbytes, node_work, reshard,
)
from ..ir import Graph, Node, Partial, Replicate, Rule, ValueRef
from ..ir.plan import NodeStrategy
from ..cost.bucketing import CAST_OPS, update_start
from ..cost.comm import waits_by_gap
from .precision import FORBIDDEN_S, reduces_partial, restricted_values
from .shrink import follower_choice, tie_inputs, tie_nodes
from .recompute import CLONE_SUFFIX, loss_position
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
    charges: tuple["SharedCharge", ...] = ()
    """Reshardings that several readers may share, each paid once (:class:`SharedCharge`)."""
    prices_as_estimate: bool = True
    """Whether every choice's objective equals its :func:`~metadist.solver.estimate.estimate` step time (False where a
    bucketed reader of a value comes before an unbucketed one that may need the same sharding: see :class:`_Pricing`)."""

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


def _member_strategies(graph: Graph, rules: Mapping[str, Rule], cluster: Cluster, restrictions: Restrictions,
                       update_position: int):
    """Strategies and compute seconds of every node and graph input, with caches by signature.

    Joint partial passes (``add`` of two ``Partial(sum)`` operands) are offered only to nodes that sum a
    parameter's gradient: after the loss, their outputs read by the update alone (a tied weight's two
    contributions). Offered to every node, they made cheaper plans at a price in search time: llama-7b on 8x8
    2.8 % cheaper a step by the cost model (its 96 sums of the residual stream's gradient in the backward),
    with 31 % more variables and 1.7-2.4x the LP's seconds; llama-70b on 128x8 1.3 % cheaper, 340 k -> 450 k
    variables, its solve phase 38 -> 59 s (the issue's minute for the whole command is then broken).
    """
    mesh, cache = cluster.mesh, {}
    gradient_sums = _gradient_sums(graph, update_position)
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
        rule = rules.get(node.name)
        if rule is not None and node.name not in gradient_sums and any(partial.joint for partial in rule.partial_passes):
            rule = replace(rule, partial_passes=tuple(partial for partial in rule.partial_passes if not partial.joint))
        key = (rule, node.op.target, node.op.is_view, in_specs, out_specs)
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


def _gradient_sums(graph: Graph, start: int) -> frozenset[str]:
    """Nodes after the loss whose outputs are read by update-phase nodes only (from position ``start``,
    :func:`metadist.cost.bucketing.update_start`)."""
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    loss = loss_position(graph)
    found = set()
    for node in graph.nodes[loss + 1:start]:
        readers = [reader for value in node.output_values for reader in graph.users(value.name)]
        if readers and all(position[reader.name] >= start for reader in readers):
            found.add(node.name)
    return frozenset(found)


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
    value = distinct.pop()
    if value not in restricted and any(output.name in restricted for output in node.output_values):
        # a restricted output of an unrestricted input: its greedy choice (pass a Partial on) could leave only forbidden
        # reductions where reducing here, in the input's dtype, was allowed: the ILP decides. A restricted input
        # cannot be reduced here either, so following it gives up nothing
        return False
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
    """Class of each unit: the first unit whose strategies agree and whose members are tied one to one.

    A unit's leader (its first member) is tied by :func:`.shrink.tie_inputs` / :func:`.shrink.tie_nodes`. Its
    followers are compared by what they do inside the unit (:func:`_follower_key`): the backward's transpose of a
    layer's activation follows that layer's forward op, but runs in the next layer's backward run, so the run-by-run
    tying does not see it tied. A recomputed forward's clone (:mod:`.recompute`) ties to its original, as the
    recompute ILP prices it (clones take their originals' strategies): left free they made LLaMA-tiny bf16 with every
    layer recomputed, on 2x2, an LP of 553 classes HiGHS took 33 s over; tied, 507 classes, 6 s, the same optimum.
    Tying is a constraint (every tied unit keeps its own compute and edge prices), so it only has to tie what the
    ILP would solve alike.
    """
    representative = {**tie_inputs(graph), **tie_nodes(graph)}
    for name in representative:
        if name.endswith(CLONE_SUFFIX) and name[: -len(CLONE_SUFFIX)] in representative:
            representative[name] = representative[name[: -len(CLONE_SUFFIX)]]
    classes: dict[tuple, list[int]] = {}
    unit_class = []
    for index, unit in enumerate(units):
        local = {name: position for position, name in enumerate(unit.members)}
        key = (representative[unit.members[0]],) + tuple(_follower_key(graph, graph.node(name), local)
                                                          for name in unit.members[1:])
        candidates = classes.setdefault(key, [])
        match = next((c for c in candidates if units[c].strategies == unit.strategies), None)
        if match is None:
            candidates.append(index)
            match = index
        unit_class.append(match)
    return unit_class


def _follower_key(graph: Graph, node: Node, local: Mapping[str, int]) -> tuple:
    """What a follower does inside its unit: its op, its arguments (the value it reads as the member that makes it
    and the output index), and its outputs' specs."""

    def arg_key(arg):
        if isinstance(arg, ValueRef):
            producer = graph.producer(arg.name)
            if producer is None:
                return ("member", local[arg.name], 0)
            return ("member", local[producer.name], [v.name if v else None for v in producer.outputs].index(arg.name))
        if isinstance(arg, tuple):
            return tuple(arg_key(item) for item in arg)
        return arg

    return (node.op.target, tuple(arg_key(arg) for arg in node.args),
            tuple((key, arg_key(arg)) for key, arg in node.kwargs), tuple(v.spec if v else None for v in node.outputs))


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


CLASS_TERM, EDGE_TERM = 0, 1
"""Kinds of a :class:`SharedCharge` term (ints, so that sets of terms iterate in the same order in every process)."""


@dataclass(frozen=True)
class SharedCharge:
    """A resharding several readers of one value may need: paid once when any of them needs it, as the lowering runs it.

    The lowering reshards a value to a given sharding once and hands the result to every reader that needs it
    (:func:`metadist.solver.estimate._edges`), so ``seconds`` is paid when at least one of ``terms`` holds. A term is
    the indicator that one reader needs this target while the producer gives this source: ``(EDGE_TERM, e, p, q)``, edge
    ``e``'s variable ``y[e, p, q]``, or ``(CLASS_TERM, c, strategies)``, class ``c`` taking one of ``strategies`` (a reader tied to the producer's class, or
    one end with a single strategy or label). A target only one distinct reader can need is priced on that reader's
    edge or strategies instead: charges exist where readers really can share.
    """

    seconds: float
    """Summed over the tied copies of the value."""
    terms: tuple[tuple, ...]


def term_active(problem: "Problem", term: tuple, choice: Mapping[int, int], moved: tuple[int, int] | None = None) -> bool:
    """Whether a :class:`SharedCharge` term holds under ``choice`` (one strategy per class), with ``moved`` = (class,
    strategy) taking that strategy instead."""
    def pick(c: int) -> int:
        return moved[1] if moved is not None and moved[0] == c else choice[c]

    if term[0] == EDGE_TERM:
        _, e, p, q = term
        edge = problem.edges[e]
        return edge.producer_label[pick(edge.producer)] == p and edge.consumer_label[pick(edge.consumer)] == q
    return pick(term[1]) in term[2]


def charge_s(problem: "Problem", charge: SharedCharge, choice: Mapping[int, int], moved: tuple[int, int] | None = None) -> float:
    """The seconds ``charge`` adds under ``choice`` (``moved``: see :func:`term_active`): its price when any term holds."""
    return charge.seconds if any(term_active(problem, term, choice, moved) for term in charge.terms) else 0.0


def charge_row(problem: "Problem", charge: SharedCharge, choice: Mapping[int, int], c: int) -> list[float]:
    """The seconds ``charge`` adds for each strategy of class ``c``, every other class at ``choice``."""
    count = problem.strategy_count(c)
    active = [False] * count
    for term in charge.terms:
        if term[0] == CLASS_TERM:
            if term[1] != c:
                if choice[term[1]] in term[2]:
                    return [charge.seconds] * count
                continue
            for s in term[2]:
                active[s] = True
            continue
        _, e, source, q = term
        edge = problem.edges[e]
        if edge.producer == c:
            if edge.consumer_label[choice[edge.consumer]] == q:
                for s, p in enumerate(edge.producer_label):
                    active[s] = active[s] or p == source
        elif edge.consumer == c:
            if edge.producer_label[choice[edge.producer]] == source:
                for s, label in enumerate(edge.consumer_label):
                    active[s] = active[s] or label == q
        elif term_active(problem, term, choice):
            return [charge.seconds] * count
    return [charge.seconds if flag else 0.0 for flag in active]


def charge_classes(problem: "Problem", charge: SharedCharge) -> frozenset[int]:
    """The classes whose strategies decide ``charge``."""
    found = set()
    for term in charge.terms:
        if term[0] == EDGE_TERM:
            edge = problem.edges[term[1]]
            found.update((edge.producer, edge.consumer))
        else:
            found.add(term[1])
    return frozenset(found)


FINAL = -2
"""Reader slot of a graph output that replaces no state: it needs its value's sharding with the Partial axes reduced."""


def _value_readers(graph: Graph, member_unit, bucketing: Bucketing, restricted: frozenset[str]):
    """Per value that is read: (producer (unit, member, output index), spec, reduce-dtype restricted, readers).

    Readers are (unit, member, slot, fixed-cost share) in the order the lowering meets them (nodes in graph order,
    then the graph outputs); slot -1 is a state output (it needs its replaced input's sharding), :data:`FINAL` a
    graph output that replaces nothing (its producer's sharding with the Partial axes reduced).
    """
    readers: dict[str, list[tuple]] = {}
    for node in graph.nodes:
        consumer = member_unit[node.name]
        for slot, name in enumerate(node.input_names):
            readers.setdefault(name, []).append((*consumer, slot, bucketing.share(name, node.name)))
    for graph_output in graph.outputs:
        name, share = graph_output.name, bucketing.share(graph_output.name, OUTPUT_CONSUMER)
        if graph_output.replaces is not None:
            readers.setdefault(name, []).append((*member_unit[graph_output.replaces], -1, share))
        else:
            unit, member, _ = _producer_of(graph, name, member_unit)
            readers.setdefault(name, []).append((unit, member, FINAL, share))
    for name, found in readers.items():
        yield _producer_of(graph, name, member_unit), graph.value(name).spec, name in restricted, found


def _producer_of(graph: Graph, value_name: str, member_unit) -> tuple[int, int, int]:
    producer = graph.producer(value_name)
    if producer is None:
        return (*member_unit[value_name], 0)
    return (*member_unit[producer.name], [v.name if v else None for v in producer.outputs].index(value_name))


def _consumer_sharding(unit: Unit, strategy: int, member: int, slot: int) -> tuple:
    row = unit.strategies[strategy][member]
    return row.outputs[0] if slot == -1 else row.inputs[slot]


@dataclass
class _Reader:
    """One distinct way a value is read: the reader's class and the sharding it needs per strategy of that class."""

    cls: int
    label: tuple[int, ...]
    """Index into ``index`` of the needed sharding, per strategy of ``cls``."""
    index: dict
    """Needed sharding -> its label."""
    share: float
    """The largest fixed-cost share of the readers it stands for."""
    strategies: dict = field(default_factory=dict)
    """Strategies of ``cls`` per needed label, or per (source label, needed label) when ``cls`` is the producer's class."""


class _Pricing:
    """Reshardings priced as the lowering runs them: once per (value, source, target), whoever reads it.

    Per value, the distinct readers (:class:`_Reader`); per target sharding some of them may need, the price from
    each source sharding is paid when at least one reader needs it. A target only one distinct reader can need goes on
    that reader's term directly (a class's strategies, or an edge variable's cell); several make a
    :class:`SharedCharge`. Readers with different fixed-cost shares (bucketed and not) pay the largest share among those
    that need the target, in tiers; the lowering pays its first reader's share, the same unless a bucketed reader comes
    first (``exact`` turns False, and the planner checks the baselines).

    One charge per source: grouping the sources of equal price into one charge is exact at integral points too, but
    its relaxation is weaker (the readers' fractional needs add up within a group); on LLaMA-70B 128x8 it turned an
    integral relaxation fractional.
    """

    def __init__(self, units, price, linear) -> None:
        self.units, self.price, self.linear = units, price, linear
        self.pairs: dict[tuple, list[list[float]]] = {}
        self.charges: dict[frozenset, float] = {}
        self.prices: dict[tuple, dict] = {}
        self.exact = True

    def value(self, a: int, pm: int, pk: int, spec, limited: bool, readers: tuple, count: int) -> None:
        """Price one value (``count`` tied copies): producer class ``a``, readers (class, member, slot, share)."""
        units, unit = self.units, self.units[a]
        p_all = [_output_sharding(unit, s, pm, pk) for s in range(len(unit.strategies))]
        p_index = {p: i for i, p in enumerate(dict.fromkeys(p_all))}
        p_label = tuple(p_index[p] for p in p_all)
        p_strategies = _strategies_by(p_label)
        distinct: dict[tuple, _Reader] = {}
        order: list[tuple[_Reader, float]] = []  # per reader in graph order: its distinct reader and its share
        for b, cm, slot, share in readers:
            if slot == FINAL:
                q_all = [final_output_sharding(p) for p in p_all]
            else:
                q_all = [_consumer_sharding(units[b], t, cm, slot) for t in range(len(units[b].strategies))]
            q_index = {q: i for i, q in enumerate(dict.fromkeys(q_all))}
            label = tuple(q_index[q] for q in q_all)
            key = (b, label, tuple(q_index))
            reader = distinct.get(key)
            if reader is None:
                reader = distinct[key] = _Reader(b, label, q_index, share)
                reader.strategies = _strategies_by(tuple(zip(p_label, label)) if b == a else label)
            reader.share = max(reader.share, share)
            order.append((reader, share))
        p_list, every_source = tuple(p_index), tuple(range(len(p_index)))
        for target in dict.fromkeys(q for reader in distinct.values() for q in reader.index):
            needing = [r for r in distinct.values() if target in r.index]
            if all(r.cls == a for r in needing):  # tied to the producer: only the sources its strategies pair with target
                wanted = sorted({pi for r in needing for pi, qi in r.strategies if qi == r.index[target]})
            else:
                wanted = every_source
            if len(needing) > 1:
                raw = [share for reader, share in order if target in reader.index]
                if any(x < y for x, y in zip(raw, raw[1:])):
                    self.exact = False  # a bucketed reader first: the lowering pays its share, the tiers the largest
            shares = tuple(sorted({r.share for r in needing}, reverse=True))
            if len(needing) == 1:  # one reader: each source's price on its term, no sharing to find
                reader = needing[0]
                qi = reader.index[target]
                for _, seconds, pi in self._prices(spec, p_list, limited, target, shares, wanted):
                    term = self._term(a, p_label, p_strategies, pi, reader, qi)
                    if term is not None:
                        self._pay(count * seconds, term)
                continue
            for share, seconds, pi in self._prices(spec, p_list, limited, target, shares, wanted):
                terms = set()
                for reader in needing:
                    if reader.share >= share:
                        term = self._term(a, p_label, p_strategies, pi, reader, reader.index[target])
                        if term is not None:
                            terms.add(term)
                if terms:
                    self._charge(count * seconds, terms, a, p_strategies[pi])

    def _prices(self, spec, p_list: tuple, limited: bool, target, shares: tuple, wanted) -> list[tuple[float, float, int]]:
        """(share tier, seconds, source label) of each resharding of ``spec`` from a source in ``wanted`` to ``target`` that
        costs something, per tier of readers with at least that share (kept per producer layout and target: tied
        layers repeat them)."""
        sources = self.prices.setdefault((spec, p_list, limited), {}).setdefault((target, shares), {})
        found = []
        for pi in wanted:
            tiers = sources.get(pi)
            if tiers is None:
                costs = [self.price(spec, p_list[pi], target, share, limited) for share in shares]
                if math.isinf(costs[-1]):
                    tiers = [(shares[-1], math.inf)]
                else:
                    tiers = [(share, cost - (costs[k + 1] if k + 1 < len(costs) else 0.0))
                             for k, (share, cost) in enumerate(zip(shares, costs))]
                tiers = sources[pi] = [(share, seconds, pi) for share, seconds in tiers if seconds != 0.0]
            found += tiers
        return found

    @staticmethod
    def _term(a, p_label, p_strategies, pi, reader: _Reader, qi):
        """The indicator that the producer gives label ``pi`` and ``reader`` needs label ``qi`` (None: never)."""
        if reader.cls == a:
            chosen = reader.strategies.get((pi, qi))
            return None if chosen is None else (CLASS_TERM, a, chosen)
        if len(reader.index) == 1:
            return (CLASS_TERM, a, p_strategies[pi])
        if len(p_strategies) == 1:
            return (CLASS_TERM, reader.cls, reader.strategies[qi])
        return (EDGE_TERM, (a, reader.cls, p_label, reader.label), pi, qi)

    def _charge(self, seconds: float, terms: set, a: int, own: tuple) -> None:
        """Pay ``seconds`` when any of ``terms`` holds: on the one term, or as a shared charge (``own``: the producer's
        strategies giving this source, which every term implies)."""
        if len(terms) > 1:
            xs = [t for t in terms if t[0] == CLASS_TERM]
            always = min((t for t in xs if len(t[2]) == len(self.units[t[1]].strategies)), default=None)
            if always is not None:
                terms = {always}  # a term every strategy of its class makes true: the resharding always runs
            elif any(t[1] == a and set(own) <= set(t[2]) for t in xs):
                terms = {(CLASS_TERM, a, own)}  # the producer's own label implies every other term
            elif len(xs) > 1:  # a class's term inside another term of that class says nothing more
                terms = {t for t in terms if not (t[0] == CLASS_TERM and any(o[1] == t[1] and set(t[2]) < set(o[2]) for o in xs))}
        if len(terms) == 1:
            self._pay(seconds, next(iter(terms)))
            return
        for term in sorted(terms):  # edges in a reproducible order: the terms hold ints only, so does their hash
            if term[0] == EDGE_TERM:
                self._pair(term[1])
        key = frozenset(terms)
        self.charges[key] = self.charges.get(key, 0.0) + seconds

    def _pay(self, seconds: float, term: tuple) -> None:
        """Pay ``seconds`` whenever ``term`` holds: on its class's strategies, or on its edge variable."""
        if term[0] == CLASS_TERM:
            row = self.linear[term[1]]
            for s in term[2]:
                row[s] += seconds
        else:
            self._pair(term[1])[term[2]][term[3]] += seconds

    def _pair(self, key) -> list[list[float]]:
        matrix = self.pairs.get(key)
        if matrix is None:
            matrix = self.pairs[key] = [[0.0] * (max(key[3]) + 1) for _ in range(max(key[2]) + 1)]
        return matrix


def _strategies_by(labels: tuple) -> dict:
    """Label -> the strategies (indices) that have it."""
    found: dict = {}
    for s, label in enumerate(labels):
        found.setdefault(label, []).append(s)
    return {label: tuple(strategies) for label, strategies in found.items()}


def _edges(graph, units, member_unit, unit_class, price, bucketing: Bucketing, restricted: frozenset[str]):
    """Linear resharding seconds per class strategy, the ClassEdges that need edge variables, the shared charges,
    and whether this pricing equals the estimate's for every choice (:class:`_Pricing`)."""
    pricing = _Pricing(units, price, {c: [0.0] * len(units[c].strategies) for c in set(unit_class)})
    signatures: dict[tuple, int] = {}  # tied layers repeat a value's producer and readers: priced once, times the count
    for (pu, pm, pk), spec, limited, readers in _value_readers(graph, member_unit, bucketing, restricted):
        key = (unit_class[pu], pm, pk, spec, limited, tuple((unit_class[cu], cm, slot, share) for cu, cm, slot, share in readers))
        signatures[key] = signatures.get(key, 0) + 1
    for (a, pm, pk, spec, limited, readers), count in signatures.items():
        pricing.value(a, pm, pk, spec, limited, readers, count)
    position, edges = {}, []
    for key, matrix in pricing.pairs.items():
        position[key] = len(edges)
        edges.append(ClassEdge(*key, tuple(tuple(row) for row in matrix)))
    charges = tuple(
        SharedCharge(seconds, tuple(sorted(t if t[0] == CLASS_TERM else (EDGE_TERM, position[t[1]], t[2], t[3]) for t in terms)))
        for terms, seconds in pricing.charges.items()
    )
    return pricing.linear, tuple(edges), charges, pricing.exact


def final_output_sharding(sharding: tuple) -> tuple:
    """A non-state output leaves the step with its Partial axes reduced (Replicate)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in sharding)


def with_bucketing(problem: Problem, restrictions: Restrictions, bucketing: Bucketing) -> Problem | None:
    """``problem`` (built under ``restrictions``) with its reshardings priced under ``bucketing`` instead: what
    :func:`build_problem` of the same graph, rules and cluster returns under ``bucketing``, its strategies, units,
    classes, compute and memory rows (the peaks added to ``problem`` included) reused and only the edges priced again.
    None where ``bucketing`` starts the update phase elsewhere: the strategies offered depend on that position
    (:func:`_member_strategies`), so the problem must be built again."""
    graph = problem.graph
    if _update_position(graph, bucketing) != _update_position(graph, problem.bucketing):
        return None
    started = time.perf_counter()
    priced, edge_stats = _priced_edges(graph, problem.units, problem.member_unit, problem.unit_class,
                                       _Reshard(problem.cluster), bucketing,
                                       restricted_values(graph, restrictions.reduce_dtype))
    stats = {**problem.stats, **edge_stats, "problem_build_s": round(time.perf_counter() - started, 4)}
    logger.info("problem for %s priced again under other bucketing: %s", graph.name, stats)
    return replace(problem, **priced, stats=stats)


def with_peaks(problem: Problem, peaks: tuple[int, ...]) -> Problem:
    """The same problem with memory budget rows at ``peaks`` (positions in graph order)."""
    memory, constants = _memory(problem.graph, problem.units, problem.member_unit, problem.unit_class, problem.liveness,
                                problem.cluster.mesh, peaks)
    return replace(problem, peaks=tuple(peaks), memory_bytes=memory, memory_constant_bytes=constants)


def _memory(graph, units, member_unit, unit_class, lives: Liveness, mesh, peaks):
    per_peak, constants = [], []
    found: dict[str, tuple[int, list[float]]] = {}  # a value lives at several peaks: its sizes are found once
    for peak in peaks:
        coefficients: dict[int, list[float]] = {}
        constant = 0.0
        for life in lives.live_at(peak):
            known = found.get(life.name)
            if known is None:
                unit_index, member, k = _producer_of(graph, life.name, member_unit)
                unit = units[unit_index]
                known = found[life.name] = (unit_index, [local_nbytes(life.spec, _output_sharding(unit, s, member, k), mesh)
                                                         for s in range(len(unit.strategies))])
            unit_index, sizes = known
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
    sets, compute = _member_strategies(graph, rules, cluster, restrictions, _update_position(graph, bucketing))
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
    priced, edge_stats = _priced_edges(graph, units, member_unit, unit_class, price, bucketing, restricted)
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
        **edge_stats,
        "problem_build_s": round(time.perf_counter() - started, 4),
    }
    logger.info("problem for %s: %s", graph.name, stats)
    return Problem(
        graph=graph, cluster=cluster, units=tuple(units), member_unit=member_unit, unit_class=tuple(unit_class),
        classes=classes, compute_s={c: tuple(v) for c, v in compute_s.items()}, peaks=lives.peaks,
        memory_bytes=memory, memory_constant_bytes=constants, liveness=lives,
        excluded_indivisible=sum(s.excluded_indivisible for s in sets.values()), missing_rules=missing_rules,
        stats={**stats, "excluded_inexpressible_strategies": sum(s.excluded_inexpressible for s in sets.values()),
               **_uneven_stats(sets.values())},
        **priced,
    )


def _update_position(graph: Graph, bucketing: Bucketing) -> int:
    """Where the update phase starts for ``bucketing`` (:data:`NO_BUCKETING` marks none: the graph's own start): the
    strategies offered depend on it (:func:`_member_strategies`)."""
    return update_start(graph) if bucketing is NO_BUCKETING else bucketing.update_start


def _priced_edges(graph, units, member_unit, unit_class, price: "_Reshard", bucketing: Bucketing,
                  restricted: frozenset[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The :class:`Problem` fields that price its reshardings under ``bucketing`` (linear seconds, class edges, shared
    charges, the bucketing, whether the objective prices as the estimate), and their stats."""
    linear, edges, charges, exact = _edges(graph, units, member_unit, unit_class, price, bucketing, restricted)
    fields = {"linear_comm_s": {c: tuple(v) for c, v in linear.items()}, "edges": edges, "charges": charges,
              "bucketing": bucketing, "prices_as_estimate": exact and not waits_by_gap(price.cluster)}
    stats = {"class_edges": len(edges), "shared_charges": len(charges), "bucketed_edges": len(bucketing.edges),
             "bucketed_fixed_share": round(bucketing.fixed_share, 6)}
    return fields, stats
