"""The planner's memoisation (issue #16, search scale): a kept result always equals a fresh one."""

from __future__ import annotations

import itertools
import re

import pytest

from metadist.cost import cluster_for, comm
from metadist.ir import Mesh, Partial, Replicate, Shard, TensorSpec
from metadist.lowering.errors import LoweringError
from metadist.lowering.reshard import COLLECTIVE_KINDS, _build, origin_collectives, plan_resharding
from metadist.solver import plan_graph
from metadist.solver.estimate import estimate, node_compute_s, total_compute_s
from metadist.solver.planner import _Estimates, assignment_from
from metadist.solver.problem import build_problem
from test_solver_helpers import mlp_step

R, P = Replicate(), Partial()
MESH = Mesh((2, 3))
PLACEMENTS = (R, P, Shard(0), Shard(1))


def _fresh(spec, src, dst, mesh):
    steps = plan_resharding(spec.shape, spec.itemsize, src, dst, mesh, (0,) * mesh.ndim)
    return tuple((step.kind, step.axis, step.comm_bytes) for step in steps if step.kind in COLLECTIVE_KINDS)


def test_kept_resharding_steps_equal_fresh_ones_uneven_pieces_included():
    comm._STEPS.clear()
    specs = (TensorSpec((12, 6), "float32"), TensorSpec((7, 5), "bfloat16"))  # even, then uneven over 2 and 3
    pairs = list(itertools.product(itertools.product(PLACEMENTS, repeat=2), repeat=2))
    for spec in specs:
        for src, dst in pairs:
            first = comm.resharding_collectives(spec, src, dst, MESH)
            assert first == _fresh(spec, src, dst, MESH)
            assert comm.resharding_collectives(spec, list(src), list(dst), MESH) is first  # kept, whatever the sequence type
    # the key holds the item size and shape: float32 and int32 share steps, another shape does not
    a, b = TensorSpec((12, 6), "float32"), TensorSpec((12, 6), "int32")
    assert comm.resharding_collectives(b, (Shard(0), R), (R, R), MESH) is comm.resharding_collectives(a, (Shard(0), R), (R, R), MESH)
    assert comm._STEPS[((12, 6), 4, (Shard(0), R), (R, R), MESH)][0][2] > 0
    assert comm.resharding_collectives(TensorSpec((24, 6), "float32"), (Shard(0), R), (R, R), MESH)[0][2] == 2 * \
        comm.resharding_collectives(a, (Shard(0), R), (R, R), MESH)[0][2]


@pytest.mark.parametrize("mesh", [MESH, Mesh((2, 1, 3)), Mesh((4, 2)), Mesh((2, 2, 2))], ids=str)
def test_even_values_take_their_steps_from_a_shape_free_template_that_equals_the_lowering(mesh):
    from metadist.lowering.copies import step_copies

    comm._STEPS.clear()
    comm._TEMPLATES.clear()
    comm._LOCAL_COPIES.clear()
    comm._LOCAL_TEMPLATES.clear()
    specs = (TensorSpec((24, 12, 8), "float32"), TensorSpec((48, 6, 16), "bfloat16"), TensorSpec((96, 24, 40), "int64"),
             TensorSpec((7, 5, 3), "float32"), TensorSpec((0, 4, 8), "float32"), TensorSpec((12,), "float32"))
    placements = (R, P, Shard(0), Shard(1), Shard(2)) if mesh.ndim == 2 else (R, P, Shard(0), Shard(2))
    checked = 0
    for spec in specs:
        for src, dst in itertools.product(itertools.product(placements, repeat=mesh.ndim), repeat=2):
            try:
                expected = _fresh(spec, src, dst, mesh)
            except LoweringError:
                with pytest.raises(LoweringError, match="which it does not have"):
                    comm.resharding_collectives(spec, src, dst, mesh)
                continue
            assert comm.resharding_collectives(spec, src, dst, mesh) == expected, (spec, src, dst)
            # and the copies of its local steps (slices, pads) as the lowering's steps at the origin make them
            local = [float(elements) for step in plan_resharding(spec.shape, spec.itemsize, src, dst, mesh, (0,) * mesh.ndim)
                     if step.kind not in COLLECTIVE_KINDS for elements in step_copies(step)]
            assert list(comm.resharding_local_copies(spec, src, dst, mesh)) == pytest.approx(local), (spec, src, dst)
            checked += 1
    assert checked > 1000
    # the even values of one rank share their templates (the uneven and the empty ones make none)
    assert 0 < len(comm._TEMPLATES) <= len(placements) ** (2 * mesh.ndim) * 2
    assert 0 < len(comm._LOCAL_TEMPLATES) <= len(placements) ** (2 * mesh.ndim) * 2


def test_the_collectives_at_the_origin_are_the_planned_steps_on_a_mesh_with_an_axis_of_one():
    mesh = Mesh((2, 1, 3))  # the axis of size 1 holds the whole value whatever its placement
    for spec in (TensorSpec((12, 6), "float32"), TensorSpec((7, 5), "bfloat16"), TensorSpec((9,), "float32")):  # 1-D: Shard(1) is rejected
        for src, dst in itertools.product(itertools.product(PLACEMENTS, repeat=3), repeat=2):
            try:
                expected = _fresh(spec, src, dst, mesh)
            except LoweringError as err:
                with pytest.raises(LoweringError, match=re.escape(str(err))):
                    origin_collectives(spec.shape, spec.itemsize, src, dst, mesh)
                continue
            assert origin_collectives(spec.shape, spec.itemsize, src, dst, mesh) == expected


def test_a_rejected_resharding_raises_each_time_and_is_not_kept():
    comm._STEPS.clear()
    spec = TensorSpec((4,), "float32")
    for _ in range(2):
        with pytest.raises(LoweringError):
            comm.resharding_collectives(spec, (R, R), (Shard(1), R), MESH)  # dim 1 of a 1-D value
    assert not comm._STEPS


def test_the_steps_at_the_origin_are_built_once_and_equal_a_second_build():
    spec = TensorSpec((7, 5), "float32")
    for src, dst in itertools.product(itertools.product(PLACEMENTS, repeat=2), repeat=2):
        try:
            steps = plan_resharding(spec.shape, spec.itemsize, src, dst, MESH, (0, 0))
        except LoweringError:
            continue
        again = _build(spec.shape, spec.itemsize, tuple(src), tuple(dst), MESH, (0, 0), "a value") if steps else []
        assert [(s.kind, s.local_shape_in, s.local_shape_out, s.comm_bytes) for s in steps] == \
            [(s.kind, s.local_shape_in, s.local_shape_out, s.comm_bytes) for s in again]
        assert all(s.bound_shape_in == s.local_shape_in and s.bound_shape_out == s.local_shape_out for s in steps)


def test_compute_priced_once_per_distinct_node_equals_the_sum_over_nodes():
    graph, rules = mlp_step(64, 96, 192, layers=3)
    cluster = cluster_for("h100-ib", Mesh((2, 4)))
    plan = plan_graph(graph, rules, cluster, memory_budget_bytes=float("inf"))
    problem = build_problem(graph, rules, cluster)
    for choice in ({c: 0 for c in problem.classes}, {c: problem.strategy_count(c) - 1 for c in problem.classes}):
        assignment = assignment_from(problem, choice)
        expected = sum(node_compute_s(graph, name, st, cluster) for name, st in assignment.node_strategies.items())
        assert total_compute_s(graph, assignment, cluster) == expected
    assert plan.estimate["compute_s"] > 0


def test_each_choice_is_estimated_once_and_as_estimate_does(monkeypatch):
    import metadist.solver.planner as planner

    graph, rules = mlp_step(64, 96, 192, layers=2)
    cluster = cluster_for("h100-ib", Mesh((2, 4)))
    problem = build_problem(graph, rules, cluster)
    calls = []
    monkeypatch.setattr(planner, "estimate", lambda *args: calls.append(1) or estimate(*args))
    estimates = _Estimates(problem)
    choice = {c: 0 for c in problem.classes}
    figures = estimates.figures(choice)
    assert figures == estimate(graph, assignment_from(problem, choice), cluster, problem.liveness, problem.bucketing)
    assert estimates.step_s(dict(reversed(list(choice.items())))) == figures["step_s"]  # same choice, other order
    other = {c: problem.strategy_count(c) - 1 for c in problem.classes}
    estimates.step_s(other)
    assert len(calls) == 2
