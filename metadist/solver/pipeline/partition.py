"""Cut the step into ``stages`` stages: balanced cuts, then every node placed, then the stages laid out."""

from __future__ import annotations

from dataclasses import dataclass

from ...cost import Cluster, Link
from ...ir import Graph
from .cuts import CutCandidates, balanced_cuts, check_stage_count, cut_candidates, node_seconds, stage_of_forward
from .layout import StageLayout, layout_stages
from .placement import Placement, place_nodes
from .regions import Regions

__all__ = ["Partition", "partition"]


@dataclass(frozen=True)
class Partition:
    """The chosen cuts and what follows from them."""

    positions: tuple[int, ...]
    """Cut positions in the forward order (before ``regions.forward[position]``)."""
    placement: Placement
    layout: StageLayout
    candidates: CutCandidates
    segment_seconds: tuple[float, ...]
    """Seconds of each finest segment over a step (its forward and backward nodes per microbatch, its update once,
    on one device)."""


def partition(graph: Graph, regions: Regions, stages: int, cluster: Cluster, pp_link: Link,
              candidates: CutCandidates | None = None, microbatches: int = 1) -> Partition:
    """Cuts that balance the stages' seconds over a step of ``microbatches`` on one device of ``cluster``, sends over
    ``pp_link`` priced in: a stage's forward and backward nodes and its sends count once per microbatch, its update once."""
    candidates = cut_candidates(graph, regions) if candidates is None else candidates
    check_stage_count(candidates, stages)
    segments = segment_seconds(graph, regions, candidates, cluster, microbatches)
    crossing = [microbatches * (pp_link.call_overhead_s + pp_link.latency_s + nbytes / pp_link.bandwidth_bytes_per_s)
                for nbytes in candidates.crossing_bytes]  # one way: the activation up (the stage below sends it), its
    # gradient down (the stage above sends it)
    chosen = balanced_cuts(segments, crossing, stages)
    positions = tuple(candidates.positions[index] for index in chosen)
    placement = place_nodes(graph, regions, stage_of_forward(regions, positions), stages)
    return Partition(positions, placement, layout_stages(graph, regions, placement), candidates, tuple(segments))


def segment_seconds(graph: Graph, regions: Regions, candidates: CutCandidates, cluster: Cluster,
                    microbatches: int = 1) -> list[float]:
    """Seconds of each finest segment over a step: nodes placed with every candidate cut taken, priced on one device,
    forward and backward nodes ``microbatches`` times, update nodes once."""
    count = candidates.max_stages
    placement = place_nodes(graph, regions, stage_of_forward(regions, candidates.positions), count)
    seconds = [0.0] * count
    for name, segment in placement.stage.items():
        times = 1 if placement.phase[name] == "update" else microbatches
        seconds[segment] += times * node_seconds(graph, name, cluster)
    return seconds
