"""Run a plan through XLA: the JAX runtime hands the plan to XLA as shardings.

The captured graph is interpreted inside one ``jax.jit`` on a
``jax.sharding.Mesh`` whose axes carry the plan's mesh axis names:

- ``in_shardings``/``out_shardings`` come from the plan's graph input and output shardings;
- each node's outputs are pinned with ``jax.lax.with_sharding_constraint`` to the
  node strategy's output shardings;
- ``Shard(d)`` on axis ``a`` is a ``PartitionSpec`` entry naming ``a`` for dim ``d``
  (several axes on one dim nest in mesh-axis order, as in the plan);
- ``Partial`` cannot be said to XLA: such values stay unconstrained (XLA inserts
  the reductions), and a ``Partial`` graph output is asked for replicated.

XLA's SPMD partitioner then inserts the collectives; :func:`count_collectives`
reads them back from the compiled HLO, to set beside the plan's prediction.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from ...ir import Graph, Mesh, Node, Partial, Shard
from ...ir.plan import Plan
from .errors import JaxCaptureError
from .execute import jit_graph

__all__ = ["ShardedRun", "count_collectives", "jax_mesh", "partition_spec", "place", "predicted_collectives",
           "run_sharded", "sharded_step"]

log = logging.getLogger(__name__)

#: HLO collective ops, as ``count_collectives`` names them (async ``-start`` forms count once).
HLO_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_HLO_RE = re.compile(r"\b(" + "|".join(HLO_COLLECTIVES) + r")(?:-start)?\(")

#: Plan (lowering) collective kinds, by the HLO op name they become.
PLAN_TO_HLO = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
               "all_to_all": "all-to-all"}


@dataclass(frozen=True)
class ShardedRun:
    """The result of one sharded step and what XLA made of the plan."""

    outputs: list[Any]
    """The graph's outputs (global arrays, sharded as the plan's output shardings)."""
    xla_collectives: dict[str, int]
    """Collectives in the compiled HLO, by HLO op name."""
    compile_seconds: float
    run_seconds: float
    constrained_values: int
    """Node outputs pinned with ``with_sharding_constraint``."""
    unconstrained_partial: int
    """Node outputs the plan leaves ``Partial``: left to XLA."""
    extras: dict = field(default_factory=dict)


def jax_mesh(mesh: Mesh, devices: Sequence[Any] | None = None) -> Any:
    """A ``jax.sharding.Mesh`` of the plan's shape and axis names, on the first ``mesh.size`` devices."""
    import jax
    import numpy as np

    available = list(devices) if devices is not None else jax.devices()
    if len(available) < mesh.size:
        raise JaxCaptureError(
            f"the plan's mesh {mesh} needs {mesh.size} devices and JAX sees {len(available)}; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh.size} before importing jax, or plan for a smaller mesh"
        )
    grid = np.array(available[: mesh.size], dtype=object).reshape(mesh.shape)
    return jax.sharding.Mesh(grid, mesh.axis_names)


def partition_spec(sharding: Sequence[Any], rank: int, axis_names: Sequence[str], *, partial_as_replicate: bool = False) -> Any:
    """The ``PartitionSpec`` of a sharding; None when it holds a ``Partial`` (unless ``partial_as_replicate``)."""
    from jax.sharding import PartitionSpec

    if any(isinstance(placement, Partial) for placement in sharding) and not partial_as_replicate:
        return None
    entries: list[list[str]] = [[] for _ in range(rank)]
    for axis_name, placement in zip(axis_names, sharding):
        if isinstance(placement, Shard):
            if placement.dim >= rank:
                raise JaxCaptureError(f"sharding {sharding} shards dim {placement.dim} of a rank-{rank} value")
            entries[placement.dim].append(axis_name)
    return PartitionSpec(*[None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in entries])


def _named(jmesh: Any, sharding: Sequence[Any], rank: int, **options: Any) -> Any:
    from jax.sharding import NamedSharding

    spec = partition_spec(sharding, rank, jmesh.axis_names, **options)
    return None if spec is None else NamedSharding(jmesh, spec)


@dataclass(frozen=True)
class _Constrainer:
    """The ``constrain`` hook of the interpreter: pins node outputs to the plan's shardings."""

    plan: Plan
    jmesh: Any

    def __call__(self, node: Node, results: list[Any]) -> list[Any]:
        import jax

        strategy = self.plan.node_strategies.get(node.name)
        if strategy is None:
            return results
        pinned = []
        for value, result, sharding in zip(node.outputs, results, strategy.outputs):
            named = None if (value is None or sharding is None) else _named(self.jmesh, sharding, value.spec.rank)
            pinned.append(result if named is None else jax.lax.with_sharding_constraint(result, named))
        return pinned


def sharded_step(graph: Graph, plan: Plan, *, raw_params: Any = None, devices: Sequence[Any] | None = None) -> tuple[Any, list[Any]]:
    """The jitted, sharded step of ``plan`` and the input shardings to place its arguments with."""
    jmesh = jax_mesh(plan.mesh, devices)
    replicated = tuple(_replicate(plan.mesh))
    in_shardings = [
        _named(jmesh, plan.input_shardings.get(graph_input.value.name, replicated), graph_input.value.spec.rank,
               partial_as_replicate=True)
        for graph_input in graph.inputs
    ]
    out_shardings = [
        _named(jmesh, sharding, graph.value(graph_output.name).spec.rank, partial_as_replicate=True)
        for graph_output, sharding in zip(graph.outputs, plan.output_shardings)
    ]
    jitted = jit_graph(graph, raw_params=raw_params, constrain=_Constrainer(plan, jmesh),
                       in_shardings=tuple(in_shardings), out_shardings=tuple(out_shardings))
    return jitted, in_shardings


def run_sharded(graph: Graph, plan: Plan, inputs: Sequence[Any], *, raw_params: Any = None,
                devices: Sequence[Any] | None = None) -> ShardedRun:
    """Place ``inputs`` per the plan, compile the sharded step, run it once, and count XLA's collectives."""
    import jax

    jitted, in_shardings = sharded_step(graph, plan, raw_params=raw_params, devices=devices)
    placed = [place(array, sharding) for array, sharding in zip(inputs, in_shardings)]
    started = time.perf_counter()
    compiled = jitted.lower(*placed).compile()
    compile_seconds = time.perf_counter() - started
    started = time.perf_counter()
    outputs = jax.block_until_ready(compiled(*placed))
    run_seconds = time.perf_counter() - started
    constrained, partial = _constraint_counts(graph, plan)
    collectives = count_collectives(compiled.as_text())
    log.info("sharded %s on %s: compiled in %.2f s, ran in %.3f s; XLA collectives %s",
             graph.name, plan.mesh, compile_seconds, run_seconds, collectives)
    return ShardedRun(list(outputs), collectives, compile_seconds, run_seconds, constrained, partial)


def place(array: Any, sharding: Any) -> Any:
    """``array`` (the whole value, the same on every process) as a global array laid out as ``sharding``.

    With several processes (``jax.distributed``) a sharding spans devices this process
    cannot address: each process builds its own shards with ``jax.make_array_from_callback``.
    """
    import jax
    import numpy as np

    if sharding.is_fully_addressable:
        return jax.device_put(array, sharding)
    if isinstance(array, jax.Array) and array.sharding == sharding:
        return array
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collectives in an HLO module's text, by op name (every kind listed, zeros included)."""
    counts = Counter(match.group(1) for match in _HLO_RE.finditer(hlo_text))
    return {kind: counts.get(kind, 0) for kind in HLO_COLLECTIVES}


def predicted_collectives(graph: Graph, plan: Plan) -> dict[str, int] | None:
    """The collectives the plan's lowering inserts on rank 0, by HLO op name; None if it cannot be lowered."""
    from ...lowering import LoweringError, lower_for_rank

    try:
        program = lower_for_rank(graph, plan, 0)
    except LoweringError as err:
        log.warning("cannot lower the plan to count its collectives: %s", err)
        return None
    counts = {kind: 0 for kind in HLO_COLLECTIVES}
    for (kind, _axis), (count, _bytes) in program.predicted_comm().items():
        counts[PLAN_TO_HLO[kind]] += count
    return counts


def _constraint_counts(graph: Graph, plan: Plan) -> tuple[int, int]:
    constrained = partial = 0
    for node in graph.nodes:
        strategy = plan.node_strategies.get(node.name)
        for sharding in (strategy.outputs if strategy else ()):
            if sharding is None:
                continue
            if any(isinstance(placement, Partial) for placement in sharding):
                partial += 1
            else:
                constrained += 1
    return constrained, partial


def _replicate(mesh: Mesh) -> list[Any]:
    from ...ir import Replicate

    return [Replicate() for _ in mesh.shape]
