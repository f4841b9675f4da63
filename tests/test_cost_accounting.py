"""The cost model counts what the runtime sends: bytes per axis as the rank program moves them."""

from __future__ import annotations

import pytest

from metadist.bench.comm_count import CollectiveCall
from metadist.cost import cluster_for
from metadist.ir import Mesh
from metadist.lowering import lower_for_rank
from metadist.solver import baseline_plan, plan_graph
from test_solver_helpers import mlp_step


def _program_bytes(graph, plan, reduce_scatter_as_all_reduce: bool) -> dict[str, float]:
    """Bytes rank 0's program sends per axis (a gloo reduce-scatter sends an all-reduce's: twice the ring's)."""
    sent = {name: 0.0 for name in plan.mesh.axis_names}
    for (kind, axis), (_, nbytes) in lower_for_rank(graph, plan, 0).predicted_comm().items():
        sent[plan.mesh.axis_names[axis]] += nbytes * (2 if kind == "reduce_scatter" and reduce_scatter_as_all_reduce else 1)
    return sent


@pytest.mark.parametrize("preset,mesh", [("cpu-gloo", (4,)), ("h100-ib", (2, 2))])
def test_estimated_bytes_are_the_rank_programs(preset, mesh):
    graph, rules = mlp_step(64, 32, 128, layers=2)
    cluster = cluster_for(preset, Mesh(mesh))
    gloo = cluster.link(0).reduce_scatter_as_all_reduce
    assert gloo == (preset == "cpu-gloo")
    plans = [plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))]
    plans += [baseline_plan(graph, rules, cluster, kind) for kind in ("dp", "zero2", "zero3")]
    for plan in plans:
        want = _program_bytes(graph, plan, gloo)
        got = plan.estimate["comm_bytes_by_axis"]
        for axis, nbytes in want.items():
            assert got[axis] == pytest.approx(nbytes, rel=1e-9, abs=1e-6), (plan.solver.get("kind"), axis)
    assert sum(sum(_program_bytes(graph, plan, gloo).values()) for plan in plans) > 0


def test_measured_wire_bytes_count_gloo_reduce_scatter_as_all_reduce():
    ring = CollectiveCall(kind="reduce_scatter", payload_bytes=4000, op="c10d::_reduce_scatter_base_", group_size=4)
    gloo = CollectiveCall(kind="reduce_scatter", payload_bytes=4000, op="c10d::_reduce_scatter_base_", group_size=4,
                          reduce_scatter_as_all_reduce=True)
    reduce = CollectiveCall(kind="all_reduce", payload_bytes=4000, op="c10d::allreduce_", group_size=4)
    assert ring.wire_bytes == 3000 and gloo.wire_bytes == reduce.wire_bytes == 6000
