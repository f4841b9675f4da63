"""The strategy solver: one ILP over the whole graph and the whole N-D mesh.

``plan_graph(graph, rules, cluster, memory_budget_bytes=None, solver="ilp"|"beam")`` returns a
:class:`metadist.ir.plan.Plan`; ``baseline_plan`` builds data-parallel, ZeRO-2, ZeRO-3 and
Megatron-TP plans with the same machinery; ``explain(plan, node_name)`` says why a strategy won.
Framework-free: imports neither torch nor jax.
"""

from .baselines import BASELINES, baseline_plan
from .errors import USER_ERRORS, InfeasibleBudgetError, SolverError
from .explain import explain
from .planner import SOLVERS, plan_graph, smallest_memory_bytes
from .problem import Problem, Restrictions, build_problem

__all__ = [
    "BASELINES",
    "SOLVERS",
    "USER_ERRORS",
    "InfeasibleBudgetError",
    "Problem",
    "Restrictions",
    "SolverError",
    "baseline_plan",
    "build_problem",
    "explain",
    "plan_graph",
    "smallest_memory_bytes",
]
