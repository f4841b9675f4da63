"""Why a node's strategy won: its cost next to the runner-up's, with everything else fixed.

For each class the solver decided, every alternative strategy is priced with all other
classes held at the solution: compute, resharding on every incident edge and shared charge, and the memory at
each checked peak. A node's runner-up is the cheapest alternative that changes that node's
own strategy. The data is stored in ``plan.solver["explain"]`` (node name -> record) so a
plan explains itself without the graph or the rules; :func:`explain` writes it out.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..ir.plan import Plan
from .errors import SolverError
from .problem import Problem, charge_classes, charge_row


def _class_costs(problem: Problem, c: int, choice: Mapping[int, int], charges=(), edges=None) -> tuple[list[float], list[float]]:
    """(compute seconds, communication seconds) of every strategy of class ``c``, the rest fixed. ``edges``: the
    problem's edges that touch ``c`` (None: found among all of them)."""
    count = problem.strategy_count(c)
    compute = list(problem.compute_s[c])
    comm = list(problem.linear_comm_s[c])
    for edge in problem.edges if edges is None else edges:
        if edge.producer == c:
            q = edge.consumer_label[choice[edge.consumer]]
            for s in range(count):
                comm[s] += edge.comm_s[edge.producer_label[s]][q]
        elif edge.consumer == c:
            p = edge.producer_label[choice[edge.producer]]
            for s in range(count):
                comm[s] += edge.comm_s[p][edge.consumer_label[s]]
    for charge in charges:  # the shared charges class ``c`` takes part in
        for s, seconds in enumerate(charge_row(problem, charge, choice, c)):
            comm[s] += seconds
    return compute, comm


def _overshoot(problem: Problem, c: int, s: int, totals: list[float], chosen: int, budget: float | None) -> float:
    if budget is None:
        return 0.0
    worst = 0.0
    for total, coefficients in zip(totals, problem.memory_bytes):
        row = coefficients.get(c)
        if row is not None:
            worst = max(worst, total - row[chosen] + row[s] - budget)
    return worst


def explanation_data(problem: Problem, choice: Mapping[int, int], budget: float | None) -> dict[str, dict[str, Any]]:
    """node name -> {chosen, runner_up, their costs, memory overshoot of the runner-up}."""
    totals = [
        constant + sum(row[choice[c]] for c, row in coefficients.items())
        for constant, coefficients in zip(problem.memory_constant_bytes, problem.memory_bytes)
    ]
    tied = {}
    for index, c in enumerate(problem.unit_class):
        tied[c] = tied.get(c, 0) + 1
    records: dict[str, dict[str, Any]] = {}
    charges: dict[int, list] = {}
    for charge in problem.charges:
        for c in charge_classes(problem, charge):
            charges.setdefault(c, []).append(charge)
    edges: dict[int, list] = {}  # per class, the edges it is an end of (LLaMA-7B 8x8: 284 classes, 431 edges)
    for edge in problem.edges:
        edges.setdefault(edge.producer, []).append(edge)
        if edge.consumer != edge.producer:
            edges.setdefault(edge.consumer, []).append(edge)
    for c in problem.classes:
        if problem.strategy_count(c) == 1:
            continue
        compute, comm = _class_costs(problem, c, choice, charges.get(c, ()), edges.get(c, ()))
        chosen, unit = choice[c], problem.units[c]
        for member, name in enumerate(unit.members):
            mine = unit.strategies[chosen][member]
            others = [s for s in range(len(compute))  # forbidden alternatives (inf: a precision policy's) are no runner-up
                      if unit.strategies[s][member] != mine and math.isfinite(compute[s] + comm[s])]
            record = {"tied_copies": tied[c], "unit_size": len(unit.members), "chosen": _describe(mine),
                      "compute_s": compute[chosen], "comm_s": comm[chosen]}
            if others:
                best = min(others, key=lambda s: (compute[s] + comm[s], s))
                record.update(runner_up=_describe(unit.strategies[best][member]), runner_up_compute_s=compute[best],
                              runner_up_comm_s=comm[best],
                              runner_up_over_budget_bytes=_overshoot(problem, c, best, totals, chosen, budget))
            records[name] = record
    return records


def _describe(strategy) -> str:
    if not strategy.choices:
        return "sharding (" + ", ".join(str(p) for p in strategy.outputs[0]) + ")"
    choices = " ".join(str(choice) for choice in strategy.choices)
    inputs = " ".join("(" + ",".join(str(p) for p in sharding) + ")" for sharding in strategy.inputs)
    return f"[{choices}] inputs {inputs}"


def explain(plan: Plan, name: str) -> str:
    """Why node (or graph input) ``name`` got its strategy, and what the runner-up would cost."""
    records = plan.solver.get("explain")
    if records is None:
        raise SolverError(f"plan {plan.graph_name!r} was made without its explanations (plan_graph(..., explain=False)); "
                          "plan it again with explain=True (`metadist plan --explain NODE`, or --json FILE to keep them)")
    if name not in records:
        if name in plan.node_strategies or name in plan.input_shardings:
            return f"{name}: a single strategy was possible (no rule, a scalar, or a follower that just takes its input's sharding)"
        raise SolverError(f"{name!r} is neither a node nor a graph input of plan {plan.graph_name!r}")
    r = records[name]
    scope = f"(costs of its decision unit of {r['unit_size']} node(s) x {r['tied_copies']} tied cop(ies))"
    lines = [f"{name}: chose {r['chosen']}", f"  cost {r['compute_s'] + r['comm_s']:.6g} s = compute {r['compute_s']:.6g} s + communication {r['comm_s']:.6g} s {scope}"]
    if plan.solver.get("short_waits", {}).get("kept") == "short waits":
        lines.append("  priced as the search that chose the plan priced it: every collective at its link's short wait "
                     "(the plan's estimate prices each call's wait by the compute before it; plan.solver['short_waits'])")
    if "runner_up" not in r:
        lines.append("  no alternative strategy changes this node")
        return "\n".join(lines)
    runner = r["runner_up_compute_s"] + r["runner_up_comm_s"]
    lines.append(f"  runner-up {r['runner_up']}: {runner:.6g} s = compute {r['runner_up_compute_s']:.6g} s + communication {r['runner_up_comm_s']:.6g} s")
    if r["runner_up_over_budget_bytes"] > 0:
        lines.append(f"  the runner-up was rejected: it breaks the memory budget by {r['runner_up_over_budget_bytes'] / 2**20:.1f} MiB per device")
    elif runner >= r["compute_s"] + r["comm_s"]:
        lines.append(f"  the chosen strategy is {runner - r['compute_s'] - r['comm_s']:.6g} s cheaper with everything else fixed")
    else:
        lines.append("  the runner-up is cheaper on its own, but not jointly: the optimum moves neighbouring strategies "
                     "(or the memory budget) along with this one")
    return "\n".join(lines)
