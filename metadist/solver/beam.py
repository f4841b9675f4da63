"""Beam search over the same problem as the ILP: a fast, approximate alternative.

Classes are visited in graph order (graph inputs first). Each beam state is a partial
assignment; extending it by one class adds that class's compute and linear costs and the
resharding on every edge to an already-assigned class, and every shared resharding whose
classes are then all assigned. States whose memory at some peak
cannot fit the budget (even with the cheapest memory for the rest) are dropped. The
``width`` cheapest states survive each step; ties break by visiting order, so the search is
deterministic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .ilp import Solution
from .problem import Problem, charge_classes, charge_row


@dataclass(frozen=True)
class _State:
    cost_s: float
    memory_bytes: tuple[float, ...]
    choices: tuple[int, ...]
    """Strategy of each class visited so far, in visiting order."""


def _order(problem: Problem) -> list[int]:
    first_position = {}
    graph_position = {node.name: index for index, node in enumerate(problem.graph.nodes)}
    for c in problem.classes:
        unit = problem.units[c]
        first_position[c] = -1 if unit.is_input else graph_position[unit.members[0]]
    return sorted(problem.classes, key=lambda c: (first_position[c], c))


def _minimum_memory_suffix(problem: Problem, order: list[int]) -> list[list[float]]:
    """suffix[i][k]: the least memory classes order[i:] can add at peak k."""
    suffix = [[0.0] * len(problem.peaks) for _ in range(len(order) + 1)]
    for i in range(len(order) - 1, -1, -1):
        for k, coefficients in enumerate(problem.memory_bytes):
            row = coefficients.get(order[i])
            suffix[i][k] = suffix[i + 1][k] + (min(row) if row else 0.0)
    return suffix


def beam_search(problem: Problem, memory_budget_bytes: float | None, width: int = 16) -> Solution | None:
    """The cheapest assignment beam search finds; None when every state breaks the budget."""
    started = time.perf_counter()
    order = _order(problem)
    rank = {c: i for i, c in enumerate(order)}
    incoming: dict[int, list] = {c: [] for c in order}
    for edge in problem.edges:
        later, earlier = (edge.consumer, edge.producer) if rank[edge.consumer] > rank[edge.producer] else (edge.producer, edge.consumer)
        incoming[later].append((edge, earlier))
    settled: dict[int, list] = {c: [] for c in order}  # a shared charge is priced at its last class in visiting order
    for charge in problem.charges:
        settled[max(charge_classes(problem, charge), key=rank.__getitem__)].append(charge)
    suffix = _minimum_memory_suffix(problem, order)
    beam = [_State(0.0, tuple(problem.memory_constant_bytes), ())]
    for i, c in enumerate(order):
        candidates = []
        for parent, state in enumerate(beam):
            shared = [0.0] * problem.strategy_count(c)
            if settled[c]:
                partial = dict(zip(order, state.choices))  # the classes visited so far
                for charge in settled[c]:
                    for s, seconds in enumerate(charge_row(problem, charge, partial, c)):
                        shared[s] += seconds
            for s in range(problem.strategy_count(c)):
                cost = state.cost_s + problem.compute_s[c][s] + problem.linear_comm_s[c][s]
                for edge, other in incoming[c]:
                    cost += _edge_cost(edge, c, s, state.choices[rank[other]])
                cost += shared[s]
                memory = tuple(
                    used + (coefficients[c][s] if c in coefficients else 0.0)
                    for used, coefficients in zip(state.memory_bytes, problem.memory_bytes)
                )
                if memory_budget_bytes is not None and any(m + rest > memory_budget_bytes for m, rest in zip(memory, suffix[i + 1])):
                    continue
                candidates.append((cost, parent, s, memory))
        if not candidates:
            return None
        candidates.sort(key=lambda item: (item[0], item[1], item[2]))
        beam = [_State(cost, memory, beam[parent].choices + (s,)) for cost, parent, s, memory in candidates[:width]]
    best = beam[0]
    choice = {c: best.choices[rank[c]] for c in order}
    stats = {"solver": "beam", "beam_width": width, "solve_s": round(time.perf_counter() - started, 4), "build_s": 0.0,
             "variables": 0, "constraints": 0, "mip_gap": None, "status": "heuristic"}
    return Solution(choice=choice, objective_s=best.cost_s, stats=stats)


def _edge_cost(edge, c: int, s: int, other_strategy: int) -> float:
    if edge.producer == c:
        return edge.comm_s[edge.producer_label[s]][edge.consumer_label[other_strategy]]
    return edge.comm_s[edge.producer_label[other_strategy]][edge.consumer_label[s]]
