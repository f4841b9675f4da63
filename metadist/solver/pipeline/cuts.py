"""Where the forward pass may be cut into stages, and the cuts that balance the stages.

A **cut candidate** is a position in the forward order (between two forward nodes) where exactly
one value made before it is read after it, floating and random values aside: a layer boundary,
where the residual stream alone crosses (mid-layer positions cross several values). The
**segments** between consecutive candidates are the finest stages; ``len(candidates) + 1`` is
the most stages the step can be cut into.

:func:`balanced_cuts` chooses ``stages - 1`` candidates by dynamic programming over the
segments: minimise the slowest stage's seconds (its segments' compute plus the transfer of the
activation that crosses its end), then the total bytes crossing. Segment seconds come from
:func:`segment_costs`, which prices each node alone on one device of the cluster (roofline),
after placing backward and update nodes with the finest segments as stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ...cost import Cluster, compute_seconds, node_work
from ...ir import Graph, Mesh, Replicate
from ...ir.plan import AxisChoice, NodeStrategy
from ..errors import PipelineError
from .regions import Regions

__all__ = ["CutCandidates", "balanced_cuts", "cut_candidates", "node_seconds"]


@dataclass(frozen=True)
class CutCandidates:
    """Positions (in the forward order) before which the forward pass may be cut, and what crosses there."""

    positions: tuple[int, ...]
    crossing: tuple[str, ...]
    """The one value crossing at each position."""
    crossing_bytes: tuple[int, ...]

    @property
    def max_stages(self) -> int:
        return len(self.positions) + 1


def cut_candidates(graph: Graph, regions: Regions) -> CutCandidates:
    """Every position of the forward order where exactly one (non-floating, non-random) value crosses."""
    order = {name: index for index, name in enumerate(regions.forward)}
    born: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, name in enumerate(regions.forward):
        node = graph.node(name)
        for value in node.input_names:
            if value in born:
                last[value] = index
        if name in regions.parameter_only:
            continue  # runs on its reader's stage: never crosses a cut
        for value in node.output_values:
            born[value.name] = index
    opens: dict[int, list[str]] = {}
    closes: dict[int, list[str]] = {}
    for value, start in born.items():
        end = last.get(value, start)
        if end > start:  # a cut before any position in start+1..end separates the value from a reader
            opens.setdefault(start + 1, []).append(value)
            closes.setdefault(end + 1, []).append(value)
    active: dict[str, None] = {}
    positions, crossing, crossing_bytes = [], [], []
    for position in range(1, len(order)):
        for value in closes.get(position, ()):
            active.pop(value, None)
        for value in opens.get(position, ()):
            active[value] = None
        if len(active) == 1 and regions.forward[position] not in regions.parameter_only:
            value = next(iter(active))
            positions.append(position)
            crossing.append(value)
            crossing_bytes.append(graph.value(value).spec.nbytes)
    return CutCandidates(tuple(positions), tuple(crossing), tuple(crossing_bytes))


def check_stage_count(candidates: CutCandidates, stages: int) -> None:
    """A clear error when the step cannot be cut into ``stages`` stages."""
    if stages < 1:
        raise PipelineError(f"a pipeline has at least 1 stage, got pp={stages}")
    if stages > candidates.max_stages:
        raise PipelineError(
            f"pp={stages} needs {stages - 1} cuts, but this step's forward pass has only {len(candidates.positions)} "
            f"places where one activation alone crosses (layer boundaries), so at most pp={candidates.max_stages} "
            "stages fit; use a smaller pp degree or a model with more layers"
        )


def node_seconds(graph: Graph, name: str, cluster: Cluster) -> float:
    """The node's roofline seconds on one device of ``cluster`` (nothing split)."""
    node = graph.node(name)
    mesh = Mesh((1,))
    strategy = NodeStrategy(
        choices=(AxisChoice("replicate"),),
        inputs=tuple((Replicate(),) for _ in node.input_names),
        outputs=tuple(None if value is None else (Replicate(),) for value in node.outputs),
    )
    in_specs = [graph.value(value).spec for value in node.input_names]
    out_specs = [value.spec if value else None for value in node.outputs]
    return compute_seconds(node_work(graph, node), in_specs, out_specs, strategy, mesh, cluster.device)


def balanced_cuts(
    segment_seconds: Sequence[float],
    crossing_seconds: Sequence[float],
    stages: int,
) -> tuple[int, ...]:
    """Indices (into the candidates) of the ``stages - 1`` cuts that minimise the slowest stage.

    ``segment_seconds[k]``: seconds of segment ``k`` (``len(candidates) + 1`` segments);
    ``crossing_seconds[k]``: seconds to send, one way, the value crossing candidate ``k`` (after segment ``k``).
    A stage's seconds are its segments' plus what it sends: the activation crossing its end (up to the next
    stage) and the gradient of the one crossing its start (down to the previous stage), as
    :func:`.planner.pipeline_estimate` charges them.
    """
    segments = len(segment_seconds)
    if stages > segments:
        raise PipelineError(f"{stages} stages from {segments} segments")
    prefix = [0.0]
    for seconds in segment_seconds:
        prefix.append(prefix[-1] + seconds)

    def stage_cost(first: int, last: int) -> float:  # segments first..last inclusive
        up = crossing_seconds[last] if last < segments - 1 else 0.0
        down = crossing_seconds[first - 1] if first > 0 else 0.0
        return prefix[last + 1] - prefix[first] + up + down

    infinity = float("inf")
    # best[s][k]: (slowest stage, total crossing) of s+1 stages covering segments 0..k; choice[s][k]: first segment of the last
    best = [[(infinity, infinity)] * segments for _ in range(stages)]
    choice = [[0] * segments for _ in range(stages)]
    for k in range(segments):
        best[0][k] = (stage_cost(0, k), 0.0)
    for s in range(1, stages):
        for k in range(s, segments):
            for first in range(s, k + 1):
                previous = best[s - 1][first - 1]
                candidate = (max(previous[0], stage_cost(first, k)), previous[1] + crossing_seconds[first - 1])
                if candidate < best[s][k]:
                    best[s][k], choice[s][k] = candidate, first
    cuts, k = [], segments - 1
    for s in range(stages - 1, 0, -1):
        first = choice[s][k]
        cuts.append(first - 1)
        k = first - 1
    return tuple(reversed(cuts))


def stage_of_forward(regions: Regions, positions: Sequence[int]) -> Mapping[str, int]:
    """Each forward node's stage when the forward order is cut before ``positions`` (sorted)."""
    result, stage = {}, 0
    cuts = list(positions)
    for index, name in enumerate(regions.forward):
        while stage < len(cuts) and index >= cuts[stage]:
            stage += 1
        result[name] = stage
    return result


def parameter_only_stages(graph: Graph, regions: Regions, stage: dict[str, int]) -> None:
    """Give each parameter-only forward node the stage of its first forward reader (in place)."""
    forward = set(regions.forward)
    for name in reversed(regions.forward):
        if name in regions.parameter_only:
            readers = [stage[user.name] for value in graph.node(name).output_values for user in graph.users(value.name)
                       if user.name in forward and user.name in stage]
            stage[name] = min(readers) if readers else stage[name]
