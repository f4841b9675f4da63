"""Rules for a whole graph: group nodes by signature, discover once per signature.

:func:`graph_rules` is what the planner calls. It looks each signature up in a
rule database first (an object with :class:`RuleStore`'s ``get``/``put``; the
SQLite one is ``metadist.shardcombine.database``), discovers the rest, and
stores what it found, rules and 'no rule' reasons alike.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping, Protocol

from ..ir import Graph, Rule
from ..progress import phase
from .discover import DiscoveryConfig, NoRule, discover
from .executor import OpCall, OpExecutor, op_call
from .signature import OpSignature, signature_of

__all__ = ["DiscoveryStats", "GraphRules", "RuleStore", "graph_rules", "rules_from_database", "signature_groups"]

log = logging.getLogger(__name__)


class RuleStore(Protocol):
    """What :func:`graph_rules` needs of a rule database."""

    def get(self, signature_key: str, framework: str, framework_version: str) -> Rule | str | None:
        """The stored rule, the stored 'no rule' reason (a str), or None if never discovered."""
        ...

    def put(self, signature_key: str, framework: str, framework_version: str, rule_or_reason: Rule | str, op_target: str,
            discovery_seconds: float | None = None) -> None:
        """Store a discovered rule, or the reason there is none."""
        ...


@dataclass(frozen=True)
class DiscoveryStats:
    """Counts and time of one :func:`graph_rules` call."""

    ops: int
    """Nodes in the graph."""
    signatures: int
    """Distinct op signatures among them."""
    found_in_db: int
    """Signatures answered by the rule database (rules and reasons)."""
    discovered: int
    """Signatures discovered now (with a rule or a reason)."""
    seconds: float
    """Wall time of the whole call."""
    discovery_seconds: tuple[float, ...] = ()
    """Wall time of each signature discovered now, in the order they finished (graph order in one process)."""


@dataclass(frozen=True)
class GraphRules:
    """The rule of every node that has one, and the reason for every node that has none."""

    rules: Mapping[str, Rule]
    """Node name -> rule."""
    missing: Mapping[str, str]
    """Node name -> why it has no rule."""
    stats: DiscoveryStats
    signatures: Mapping[str, str] = field(default_factory=dict)
    """Node name -> signature key."""

    def __post_init__(self) -> None:
        for name in ("rules", "missing", "signatures"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


def signature_groups(graph: Graph) -> dict[OpSignature, list[OpCall]]:
    """The graph's op calls grouped by signature, in graph order."""
    groups: dict[OpSignature, list[OpCall]] = {}
    for node in graph.nodes:
        call = op_call(graph, node)
        groups.setdefault(signature_of(call), []).append(call)
    return groups


def graph_rules(
    graph: Graph,
    executor: OpExecutor,
    db: RuleStore | None = None,
    progress: bool = False,
    config: DiscoveryConfig = DiscoveryConfig(),
    workers: int | None = None,
) -> GraphRules:
    """The rule (or the reason for none) of every node of ``graph``, discovering once per signature.

    ``workers``: worker processes for the signatures not in ``db`` (:mod:`.pool`); None chooses by the
    executor (only one defining ``worker_env``), this machine's CPUs and the number of new signatures;
    0 or 1 discovers in this process.
    """
    start = time.perf_counter()
    groups = signature_groups(graph)
    outcomes: dict[OpSignature, Rule | str] = {}
    from_db = 0
    seconds: list[float] = []
    with _progress(progress, len(groups)) as advance, phase("discovery", total=len(groups)) as advance_phase:
        pending = []
        for signature, calls in groups.items():
            stored = db.get(signature.key, executor.framework, _version_key(executor)) if db is not None else None
            if stored is not None:
                outcomes[signature] = stored
                from_db += 1
                advance(signature.target)
                advance_phase(signature.target)
            else:
                pending.append((signature, calls[0]))
        for signature, outcome, took in _discover_pending(pending, executor, config, workers):
            outcomes[signature] = outcome
            seconds.append(took)
            if db is not None:
                db.put(signature.key, executor.framework, _version_key(executor), outcome, signature.target,
                       discovery_seconds=took)
            advance(signature.target)
            advance_phase(signature.target)
    rules, missing, keys = {}, {}, {}
    for signature, calls in groups.items():
        for call in calls:
            keys[call.node.name] = signature.key
            outcome = outcomes[signature]
            (missing if isinstance(outcome, str) else rules)[call.node.name] = outcome
    stats = DiscoveryStats(len(graph.nodes), len(groups), from_db, len(groups) - from_db, time.perf_counter() - start,
                           tuple(seconds))
    log.info(
        "rules for %s: %d ops, %d signatures (%d from the database, %d discovered), %d ops without a rule, %.1f s",
        graph.name, stats.ops, stats.signatures, stats.found_in_db, stats.discovered, len(missing), stats.seconds,
    )
    return GraphRules(rules, missing, stats, keys)


def rules_from_database(graph: Graph, executor: OpExecutor, rules_db: str | None = None, progress: bool = False) -> GraphRules:
    """:func:`graph_rules` through the SQLite rule database at ``rules_db`` (default: the user cache)."""
    from .database import RuleDatabase

    with RuleDatabase(rules_db) as db:
        return graph_rules(graph, executor, db=db, progress=progress)


def _discover_pending(pending: list[tuple[OpSignature, OpCall]], executor: OpExecutor, config: DiscoveryConfig,
                      workers: int | None) -> Iterator[tuple[OpSignature, Rule | str, float]]:
    """``(signature, rule or reason, seconds)`` for each pending signature: in worker processes or in this one."""
    from . import pool

    count = pool.worker_count(executor, len(pending)) if workers is None else workers
    if count >= 2:
        try:
            workers_pool = pool.WorkerPool(executor, config, count)
        except pool.NotSendable as refused:
            log.info("discovering in this process: the executor cannot be sent to worker processes (%s)", refused)
        else:
            log.info("discovering %d signatures in %d worker processes", len(pending), count)
            yield from workers_pool.discover(pending)
            return
    for signature, call in pending:
        started = time.perf_counter()
        outcome = _discover_one(signature, call, executor, config)
        yield signature, outcome, time.perf_counter() - started


def _discover_one(signature: OpSignature, call: OpCall, executor: OpExecutor, config: DiscoveryConfig) -> Rule | str:
    started = time.perf_counter()
    try:
        rule = discover(call, executor, config=config)
    except NoRule as err:
        log.info("no rule for %s: %s", signature.key, err.reason)
        return err.reason
    log.debug("%s: %s (%.3f s)", signature.key, rule, time.perf_counter() - started)
    return rule


class _progress:
    """A rich progress bar over signatures, or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self.bar = enabled, total, None

    def __enter__(self):
        if not self.enabled:
            return lambda description: None
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.__enter__()
        task = self.bar.add_task("discovering rules", total=self.total)
        return lambda description: self.bar.update(task, advance=1, description=description)  # type: ignore[union-attr]

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


#: Bumped whenever discovery changes what it accepts (new soundness checks, new derived rules), so
#: that rules found by an older discovery are not served from the database: they are found again.
DISCOVERY_VERSION = 9
"""3: affine factors (``addmm``'s ``k`` with the bias ``Partial(sum)``); 4: halo factors of windowed ops;
5: attention (SDPA) ops: shape validation, their own stand-ins, proportional (grouped-query) heads
factors, GPU kernels by equivalence; ops that crash or hang in the isolated worker get a reason;
6: the torch executor keeps 0-d inputs 0-d (``aten.fill.Tensor`` had no rule);
7: ops with scalar float inputs get one more draw with scalars above 1 (``lerp.Tensor``'s max/min pass
of its start held only for weights below 1); 8: a partial pass is judged in the coarser of the output's and the
partial input's dtype (a bfloat16 gradient's float32 cast passes Partial(sum): its reduction may run in float32), and
the torch executor draws 0-d bfloat16/float16 inputs (they failed as numpy scalars: those ops had no rule);
9: stand-in shapes keep the dims whose real sizes the op's arguments refer to (``executor.kept_dims``: RoPE's
slices of the head dim and their ``slice_backward`` had no rule at stand-in shapes)."""


def _version_key(executor: OpExecutor) -> str:
    """The database's version key: the framework's version and the discovery's."""
    return f"{executor.framework_version}+discovery{DISCOVERY_VERSION}"
