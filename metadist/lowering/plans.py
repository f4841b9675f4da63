"""Plans the lowering can build without a solver: the all-replicate plan.

Every device runs the whole step on whole tensors: no communication at all.
It is the reference point of a run's check and a fallback for development.
"""

from __future__ import annotations

from ..ir import Graph, Mesh, Replicate
from ..ir.plan import REPLICATE, NodeStrategy, Plan, graph_fingerprint

__all__ = ["replicate_plan"]


def replicate_plan(graph: Graph, mesh: Mesh, metadist_version: str) -> Plan:
    """The plan that replicates every value on every mesh axis."""
    replicated = tuple(Replicate() for _ in mesh.shape)
    strategies = {
        node.name: NodeStrategy(
            choices=tuple(REPLICATE for _ in mesh.shape),
            inputs=tuple(replicated for _ in node.input_names),
            outputs=tuple(None if value is None else replicated for value in node.outputs),
        )
        for node in graph.nodes
    }
    return Plan(
        graph_name=graph.name,
        graph_fingerprint=graph_fingerprint(graph),
        metadist_version=metadist_version,
        mesh=mesh,
        node_strategies=strategies,
        input_shardings={graph_input.value.name: replicated for graph_input in graph.inputs},
        output_shardings=tuple(replicated for _ in graph.outputs),
        solver={"kind": "replicate"},
    )
