"""Follower merging keeps a value as its producer made it: slicing a replicated value is the ILP's choice."""

from __future__ import annotations

from metadist.ir import Mesh, Replicate, Shard
from metadist.solver.shrink import follower_choice

R, S0 = (Replicate(),), (Shard(0),)


def test_a_follower_of_a_replicated_value_stays_replicated_even_when_slicing_is_cheaper():
    # follower strategies: 0 takes R (full compute), 1 takes S(0) (half the compute, free to slice from R)
    choice = follower_choice([R, S0], [R, S0], [2e-6, 1e-6], lambda p, q: 1.0)
    assert choice == [0, 1], "R stays R (a later reader needing it whole would pay a gather); S(0) stays S(0)"


def test_a_follower_that_cannot_take_the_value_as_produced_still_slices_for_free():
    choice = follower_choice([R], [S0], [1e-6], lambda p, q: 1.0)
    assert choice == [0]


def test_a_follower_of_a_graph_input_keeps_it_as_held():
    """Whether to slice the batch every rank holds is the input's own choice (its strategies), which the ILP makes."""
    assert follower_choice([R, S0], [R, S0], [2e-6, 1e-6], lambda p, q: 1.0) == [0, 1]


def test_a_follower_pays_the_cheapest_resharding_when_nothing_is_free():
    # produced S(0); strategies take R (needs a gather, priced 5) or S(1) (an all-to-all, priced 1)
    S1 = (Shard(1),)
    prices = {(S0, R): 5.0, (S0, S1): 1.0}
    assert follower_choice([S0], [R, S1], [1e-6, 1e-6], lambda p, q: prices[(p, q)]) == [1]


def test_gpt2_position_ids_stay_replicated_and_the_plan_moves_nothing_but_its_update():
    """gpt2-tiny (library defaults) on 2 devices: the position and mask chain is not sliced then gathered."""
    from metadist.cost.cluster import resolve_cluster
    from metadist.frontends.torch import capture_step
    from metadist.frontends.torch.discovery import TorchExecutor
    from metadist.lowering import lower
    from metadist.shardcombine.api import rules_from_database
    from metadist.solver import plan_graph
    from metadist.workloads import builtin_workload

    workload = builtin_workload("gpt2-tiny")
    optimizer = workload.optimizer(workload.model.parameters())
    graph = capture_step(workload.train_step(), workload.model, optimizer, workload.batch).graph
    plan = plan_graph(graph, rules_from_database(graph, TorchExecutor(), None), resolve_cluster("cpu-gloo", Mesh((2,))))
    add = next(node for node in graph.nodes if node.op.target == "aten.add.Tensor" and node.input_names == ("arange",))
    assert plan.node_strategies[add.name].outputs == (R,)
    comm = lower(graph, plan, (0,)).predicted_comm()
    assert not any(kind == "all_to_all" for kind, _ in comm), comm
    assert sum(count for count, _ in comm.values()) <= 2, comm
