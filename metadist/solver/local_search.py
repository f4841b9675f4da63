"""Rounding the ILP's relaxation and improving it by local search.

When the LP relaxation of the sharding ILP is not integral, a few classes split their weight
over several strategies. :func:`round_relaxation` gives each class its heaviest strategy;
:func:`improve` then visits the classes again and again, moving each to the strategy that is
cheapest given its neighbours' current strategies (compute, linear resharding, every edge
to another class and every shared resharding it takes part in), as long as every memory peak stays within the budget, until no move helps.
Each move lowers the objective, so the search ends.

The relaxation's optimum is a lower bound on every plan's objective, so the gap of the result
to that bound is known exactly; the ILP accepts the result when the gap is small
(:data:`metadist.solver.ilp.ACCEPTED_ROUNDING_GAP`) and runs branch and bound from it otherwise.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .problem import ClassEdge, Problem, SharedCharge, charge_classes, charge_row, charge_s


def round_relaxation(problem: Problem, weights: Mapping[int, Sequence[float]]) -> dict[int, int]:
    """Each class's heaviest strategy (``weights[c][s]``: the relaxation's ``x[c, s]``); classes without weights take 0."""
    choice = {c: 0 for c in problem.classes}
    for c, row in weights.items():
        choice[c] = max(range(len(row)), key=lambda s: (row[s], -s))
    return choice


def objective_s(problem: Problem, choice: Mapping[int, int]) -> float:
    """The ILP's objective of ``choice`` in seconds, the single-strategy classes' constant seconds included."""
    total = sum(problem.compute_s[c][choice[c]] + problem.linear_comm_s[c][choice[c]] for c in problem.classes)
    total += sum(_edge_s(edge, choice[edge.producer], choice[edge.consumer]) for edge in problem.edges)
    return total + sum(charge_s(problem, charge, choice) for charge in problem.charges)


def memory_at_peaks(problem: Problem, choice: Mapping[int, int]) -> list[float]:
    """Bytes per device at each of the problem's peaks."""
    return [
        constant + sum(row[choice[c]] for c, row in coefficients.items())
        for coefficients, constant in zip(problem.memory_bytes, problem.memory_constant_bytes)
    ]


def improve(problem: Problem, choice: Mapping[int, int], budget_bytes: float | None, max_rounds: int = 50,
            allowed: Mapping[int, frozenset[int]] | None = None) -> dict[int, int]:
    """Move one class at a time to its cheapest strategy given the others, within the budget, until nothing improves.

    ``allowed``: classes limited to some of their strategies (a baseline's); the others may take any.
    """
    allowed = allowed or {}
    choice = dict(choice)
    touching, charges = _neighbourhoods(problem)
    peaks = [(k, coefficients) for k, coefficients in enumerate(problem.memory_bytes)]
    used = memory_at_peaks(problem, choice)
    movable = [c for c in problem.classes if problem.strategy_count(c) > 1]
    for _ in range(max_rounds):
        moved = False
        for c in movable:
            current = choice[c]
            shared = _charges_row(problem, charges[c], choice, c)
            best, best_s = _class_s(problem, touching[c], choice, c, current) + shared[current], current
            for s in range(problem.strategy_count(c)):
                if s == current or (c in allowed and s not in allowed[c]):
                    continue
                seconds = _class_s(problem, touching[c], choice, c, s) + shared[s]
                if seconds < best - 1e-12 and _fits(peaks, used, c, current, s, budget_bytes):
                    best, best_s = seconds, s
            if best_s != current:
                for k, coefficients in peaks:
                    row = coefficients.get(c)
                    if row is not None:
                        used[k] += row[best_s] - row[current]
                choice[c] = best_s
                moved = True
        if not moved:
            break
    return choice


def repair(problem: Problem, choice: Mapping[int, int], budget_bytes: float,
           allowed: Mapping[int, frozenset[int]] | None = None, max_moves: int = 10_000) -> dict[int, int] | None:
    """``choice`` moved into the budget, one class at a time, or None if no move brings it closer.

    Each move takes the class and strategy that cost the fewest seconds per byte of excess they remove (the bytes by
    which the peaks exceed ``budget_bytes``, summed; a move may not raise it). A rounded relaxation under a tight budget
    usually breaks it by a little at a few peaks (LLaMA-70B on 128x8 under 80 GB): the moves that repair it are few and
    cheap, where branch and bound took a minute to find any plan.
    """
    allowed = allowed or {}
    choice = dict(choice)
    used = memory_at_peaks(problem, choice)
    if max(used, default=0.0) <= budget_bytes:
        return choice
    touching, charges = _neighbourhoods(problem)
    at: dict[int, list[tuple[int, Sequence[float]]]] = {}
    for k, coefficients in enumerate(problem.memory_bytes):
        for c, row in coefficients.items():
            at.setdefault(c, []).append((k, row))
    movable = [c for c in problem.classes if problem.strategy_count(c) > 1 and c in at]
    for _ in range(max_moves):
        if max(used) <= budget_bytes:
            return choice
        best: tuple[float, int, int] | None = None
        for c in movable:
            current = choice[c]
            rows = at[c]
            if all(used[k] <= budget_bytes for k, _ in rows):  # at no peak over the budget: moving it removes nothing
                continue
            seconds_row = None
            for s in range(problem.strategy_count(c)):
                if s == current or (c in allowed and s not in allowed[c]):
                    continue
                removed = 0.0
                for k, row in rows:
                    after = used[k] + row[s] - row[current]
                    removed += max(0.0, used[k] - budget_bytes) - max(0.0, after - budget_bytes)
                if removed <= 0.0:
                    continue
                if seconds_row is None:
                    shared = _charges_row(problem, charges[c], choice, c)
                    seconds_row = [_class_s(problem, touching[c], choice, c, t) + shared[t]
                                   for t in range(problem.strategy_count(c))]
                price = (seconds_row[s] - seconds_row[current]) / removed
                if best is None or price < best[0]:
                    best = (price, c, s)
        if best is None:
            return None
        _, c, s = best
        for k, row in at[c]:
            used[k] += row[s] - row[choice[c]]
        choice[c] = s
    return choice if max(used) <= budget_bytes else None


def _neighbourhoods(problem: Problem) -> tuple[dict[int, list[ClassEdge]], dict[int, list[SharedCharge]]]:
    """Per class: the edges touching it, and the shared charges it takes part in."""
    touching: dict[int, list[ClassEdge]] = {c: [] for c in problem.classes}
    for edge in problem.edges:
        touching[edge.producer].append(edge)
        touching[edge.consumer].append(edge)
    charges: dict[int, list[SharedCharge]] = {c: [] for c in problem.classes}
    for charge in problem.charges:
        for c in charge_classes(problem, charge):
            charges[c].append(charge)
    return touching, charges


def _class_s(problem: Problem, edges: Sequence[ClassEdge], choice: Mapping[int, int], c: int, s: int) -> float:
    """The objective terms that depend on class ``c`` but its shared charges (:func:`_charges_row`), with ``c`` taking ``s``."""
    seconds = problem.compute_s[c][s] + problem.linear_comm_s[c][s]
    for edge in edges:
        producer = s if edge.producer == c else choice[edge.producer]
        consumer = s if edge.consumer == c else choice[edge.consumer]
        seconds += _edge_s(edge, producer, consumer)
    return seconds


def _charges_row(problem: Problem, charges: Sequence[SharedCharge], choice: Mapping[int, int], c: int) -> list[float]:
    """The shared charges' seconds for each strategy of class ``c``, the others at ``choice``."""
    row = [0.0] * problem.strategy_count(c)
    for charge in charges:
        for s, seconds in enumerate(charge_row(problem, charge, choice, c)):
            row[s] += seconds
    return row


def _edge_s(edge: ClassEdge, producer_strategy: int, consumer_strategy: int) -> float:
    return edge.comm_s[edge.producer_label[producer_strategy]][edge.consumer_label[consumer_strategy]]


def _fits(peaks, used: Sequence[float], c: int, current: int, candidate: int, budget_bytes: float | None) -> bool:
    if budget_bytes is None:
        return True
    for k, coefficients in peaks:
        row = coefficients.get(c)
        if row is not None and used[k] + row[candidate] - row[current] > budget_bytes:
            return False
    return True
