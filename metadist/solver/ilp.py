"""The sharding ILP, solved with HiGHS.

Indices: ``c`` a class of decision units (one unit, or tied repeated units), ``s``/``t`` its
strategies; ``e`` an edge between two classes with several strategies each, ``p``/``q`` the
distinct shardings the producer gives and the consumer needs on that edge.

Variables
    ``x[c, s]`` in {0, 1}: class ``c`` takes strategy ``s``.
    ``y[e, p, q]`` in [0, 1]: on edge ``e`` the value comes out as ``p`` and is needed as ``q``.
    (``y`` is integral at every vertex that matters: its marginals are one-hot, so the only
    feasible ``y`` is their outer product. This is the ``x_u * x_v`` linearization, grouped
    by sharding instead of by strategy, which makes it far smaller.)
    ``z[h]`` in [0, 1]: shared charge ``h`` (a resharding several readers of one value may need, run
    once: :class:`~.problem.SharedCharge`) is paid by a reader other than its first term's. The charge's
    ``seconds[h]`` sit on its first term (``term_0``, on each of that term's variables) and on ``z[h]``, which
    is at least ``term_k - term_0`` for each other term: since ``seconds[h]`` is positive, the charge costs
    ``seconds[h] * (term_0 + max(0, max_k term_k - term_0)) = seconds[h] * max_k term_k`` at every point of
    the relaxation, fractional or not, so its optimum is the one of ``z[h] >= term_k`` for every term,
    with one row less per charge (LLaMA-7B on 8x8: 17,671 charges, 53,496 rows -> 35,825, and the
    relaxation 3.1 -> 1.4 s). A charge priced ``inf`` (forbidden) keeps ``z[h] >= term_k`` for every
    term with ``z[h]`` fixed to 0: no term may hold.
    With recomputation offered: ``r[g]`` in {0, ..., n_g}, how many of a group's ``n_g`` alike layers
    recompute, and ``w[g, c, s]``, ``r[g] * x[c, s]`` linearized (:meth:`ShardingILP.recompute_variables`).

Objective (microseconds, i.e. seconds times ``OBJECTIVE_SCALE``)
    minimize  sum_{c,s} (compute_s[c][s] + linear_comm_s[c][s]) x[c, s]
            + sum_{e,p,q} comm_s[e][p][q] y[e, p, q]  +  sum_h seconds[h] (term_0[h] + z[h])
    ``compute_s``: roofline seconds of the class's nodes; ``linear_comm_s``: resharding
    seconds on edges whose other end has one strategy; ``comm_s``: resharding seconds of the
    edge, summed over tied copies. A resharding is priced once per (value, source, target) however
    many readers need it (:mod:`.problem`), as the lowering runs it, so the objective of every
    choice equals its estimate (``Problem.prices_as_estimate``). Classes with one strategy have no
    variable; their seconds are a constant added back to the reported objective.

Constraints
    one_strategy_per_class:     sum_s x[c, s] = 1                                   for all c
    edge_producer_marginals:    sum_q y[e, p, q] = sum_{s: label_e(s) = p} x[a, s]  for all e, p
    edge_consumer_marginals:    sum_p y[e, p, q] = sum_{t: label_e(t) = q} x[b, t]  for all e, q
    shared_charges:             z[h] >= term_k - term_0                             for all h, terms k >= 1 of h
                                  (a term: y[e, p, q], or sum_{s in S} x[c, s]; term_0's variables carry
                                  seconds[h] in the objective besides their own, see below)
    memory_budget:              sum_{c,s} memory_bytes[k][c][s] x[c, s]
                                  <= memory_budget_bytes - memory_constant_bytes[k]  for each peak k

A resharding a precision policy forbids (a gradient reduced in another dtype, :mod:`.precision`) is priced
``inf``: every variable carrying it is fixed to 0 instead of entering the objective.

The relaxation starts without the memory rows (when no recomputation is offered) and takes them on only if
its optimum breaks one: the budget seldom binds, and its dense rows slow the simplex.

A second mode (``minimize_memory``) replaces the objective by a variable ``M`` bounding every
peak (``memory_budget`` with ``M`` on the right): the smallest footprint any plan reaches, used
to explain an infeasible budget.

Solving: the LP relaxation first. An integral optimum of it is optimal for the ILP. Otherwise its
fractional classes are rounded and improved by local search (:mod:`.local_search`); the relaxation's
optimum bounds every plan from below, so the result's gap to it is exact, and the result is kept
when that gap is at most :data:`ACCEPTED_ROUNDING_GAP` (5 %, which the cost model's own error dwarfs:
on LLaMA-7B's 8x8 problem with its RoPE rules the rounded plan is 3.2 % above the bound, and branch
and bound explored no node in 60 s of one core, its root LP with presolve alone outlasting that).
Otherwise branch and bound runs from the rounded plan within the time limit.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import highspy
import numpy as np

from .errors import SolverError
from .local_search import improve, objective_s, repair, round_relaxation
from .problem import EDGE_TERM, Problem, charge_s, term_active
from .recompute import RecomputeTerms

logger = logging.getLogger(__name__)

OBJECTIVE_SCALE = 1e6
"""Objective units per second: the ILP works in microseconds so that HiGHS's absolute gap means little."""
INTEGRALITY_TOLERANCE = 1e-6
"""How far from 0 or 1 a relaxed strategy variable may be and still count as integral."""
MEMORY_SCALE = 1e-6
"""Memory rows are in megabytes (bytes times this) to keep coefficients well scaled."""
ACCEPTED_ROUNDING_GAP = 0.05
"""A rounded relaxation is kept when its objective is within this fraction of the relaxation's bound."""
MIP_REL_GAP = 1e-4
"""Branch and bound stops when its incumbent is within this fraction of its bound."""
RECOMPUTE_MIP_REL_GAP = 0.01
"""The same for the ILP that chooses how many layers recompute (:func:`metadist.solver.planner.plan_graph`) where it
branches (its relaxation did not finish): its layers are written into the graph and the rewritten graph is planned
again, so its own optimum only steers that choice. LLaMA-70B on 128x8 under 80 GB: 49-60 s of branch and bound (160
nodes) at 1e-4 against 19-22 s (one node) at 1 %, whose final plan cost 0.8 % more."""
MEMORY_ROW_TOLERANCE = 1e-7
"""How far past its bound (in megabytes) a memory row may be in a relaxation solved without the memory rows before
they are added: HiGHS's own primal feasibility tolerance."""
MEMORY_MARGIN_BYTES = 64.0
"""Taken off the budget in the memory rows: HiGHS accepts rows a feasibility tolerance (a few bytes
at MEMORY_SCALE) past their bound, and the planner checks the budget exactly."""


@dataclass(frozen=True)
class Solution:
    """A strategy index per class, and how the solver got there."""

    choice: dict[int, int]
    objective_s: float
    stats: dict
    recompute: tuple[int, ...] = ()
    """The layers the plan recomputes (their indices, :mod:`.recompute`); empty when none was offered or taken."""


SOLVER_THREADS = 1
"""HiGHS's thread count in every instance MetaDist makes (one count for all: HiGHS refuses to run an instance whose
count differs from the one its process-wide scheduler started with). One: the parallel dual simplex (PAMI) solved
LLaMA-7B 8x8's relaxation in 1.8-2.3 s against 2.3-3.0 s alone on 2 cores, but four processes solving at once (as the
bench's ranks price the baselines) took 56-63 s each against 6-7 s serially: its threads wait on each other."""


def quiet_highs() -> highspy.Highs:
    """A Highs instance with logging off; its constructor's banner (C stdout) is swallowed."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            highs = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("threads", SOLVER_THREADS)
    return highs


def run_highs(highs: highspy.Highs) -> None:
    """``highs.run()``, with a clear error where HiGHS refuses to start (bad options: it then solves nothing)."""
    if highs.run() == highspy.HighsStatus.kError and highs.getModelStatus() == highspy.HighsModelStatus.kNotset:
        raise SolverError(f"HiGHS refused to solve the planning problem: an option it rejects, such as a 'threads' count "
                          f"other than the one its process-wide scheduler started with (code in this process that "
                          f"started HiGHS first with another count); MetaDist's instances use {SOLVER_THREADS}: give "
                          f"HiGHS that count there too")


def _rowwise(rows: list[tuple[list[int], list[float], float, float]]) -> tuple[np.ndarray, ...]:
    """``rows`` as HiGHS takes them: row lower and upper bounds, then the row-wise matrix (starts, with the end
    after the last row, indices and values)."""
    return (np.array([row[2] for row in rows]), np.array([row[3] for row in rows]),
            np.cumsum([0] + [len(row[0]) for row in rows]).astype(np.int32),
            np.array([i for row in rows for i in row[0]], dtype=np.int32), np.array([v for row in rows for v in row[1]]))


class ShardingILP:
    """Builds and solves the ILP written out in the module docstring.

    ``mip_rel_gap``: where branch and bound may stop. ``round_recompute_up``: a fractional relaxation with recomputation
    offered gives its answer at once, each group's layer count rounded up and each class's heaviest strategy, instead
    of going to branch and bound: for a caller that plans the rewritten graph next (:func:`~.planner.plan_graph`), to
    which only the layers matter. Rounding up recomputes at most one layer more per group than the relaxation, and
    only frees more memory; LLaMA-70B on 128x8 under 80 GB: the same 80 layers as branch and bound, which took 11 s more.
    """

    def __init__(self, problem: Problem, memory_budget_bytes: float | None, minimize_memory: bool = False,
                 recompute: RecomputeTerms | None = None, mip_rel_gap: float = MIP_REL_GAP,
                 round_recompute_up: bool = False) -> None:
        started = time.perf_counter()
        self.problem, self.budget, self.minimize_memory = problem, memory_budget_bytes, minimize_memory
        self.mip_rel_gap, self.round_recompute_up = mip_rel_gap, round_recompute_up
        self.recompute = recompute
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[list[int], list[float], float, float]] = []
        self.memory_rows: list[tuple[list[int], list[float], float, float]] = []
        """The budget's rows (:meth:`memory_budget`); the relaxation takes them only once its optimum breaks one."""
        self.x: dict[int, list[int]] = {}
        self.y: list[list[list[int]]] = []
        self.strategy_variables()
        self.edge_variables()
        self.z: list[int] = []
        self.charge_variables()
        self.r: list[int] = []
        self.w: list[dict[int, list[int]]] = []
        self.groups: list[tuple[int, ...]] = []
        """Per ``r[g]``: the candidate layers (indices into ``recompute.layers``) it counts."""
        self.recompute_variables()
        self.memory_variable = self._new_variable(1.0, False) if minimize_memory else None
        if self.memory_variable is not None:
            self.upper[self.memory_variable] = highspy.kHighsInf
        self.one_strategy_per_class()
        self.edge_producer_marginals()
        self.edge_consumer_marginals()
        self.shared_charges()
        self.recompute_links()
        self.memory_budget()
        self.build_s = time.perf_counter() - started
        self._relaxation: highspy.Highs | None = None
        self._lacking_memory_rows: highspy.Highs | None = None
        """The relaxation solved without the memory rows so far (:meth:`_run_lp`), if any."""
        self._solve_on = False
        """The next :meth:`solve` runs the solved relaxation on (:meth:`add_peaks`) instead of building it again."""

    def add_peaks(self, problem: Problem) -> None:
        """Become the ILP of ``problem``: this one's with memory rows at more peaks (:func:`~.problem.with_peaks`).

        The new peaks' rows join the relaxation already solved, and the next :meth:`solve` runs it on from its basis:
        the planner adds a plan's true memory peak and solves again, where building and solving the relaxation afresh
        took 10-12 s on LLaMA-70B's rewritten graph (128x8, 80 GB).
        """
        old = self.problem
        if (problem.graph is not old.graph or problem.units is not old.units or problem.classes != old.classes
                or not set(old.peaks) <= set(problem.peaks) or self.recompute is not None or self.minimize_memory):
            raise SolverError("add_peaks takes the same problem with more peaks (with_peaks), for an ILP of strategies only")
        self.problem, self.memory_rows = problem, []
        self.memory_budget()
        highs = self._relaxation
        if highs is not None and highs is not self._lacking_memory_rows:
            known = set(old.peaks)
            added = [row for peak, row in zip(problem.peaks, self.memory_rows) if peak not in known]
            if added:
                lower, upper, starts, index, value = _rowwise(added)
                highs.addRows(len(added), lower, upper, len(index), starts[:-1], index, value)
        self._solve_on = highs is not None

    def _new_variable(self, cost: float, integer: bool, weight: float = 1.0) -> int:
        """A variable of objective coefficient ``weight * cost``; fixed to 0 when ``cost`` is forbidden (inf)."""
        forbidden = math.isinf(cost)
        self.cost.append(0.0 if forbidden else weight * cost)
        self.upper.append(0.0 if forbidden else 1.0)
        self.integer.append(integer)
        return len(self.cost) - 1

    # -- variables ------------------------------------------------------------
    def strategy_variables(self) -> None:
        """``x[c, s]``, binary, for every class with more than one strategy."""
        weight = 0.0 if self.minimize_memory else OBJECTIVE_SCALE
        for c in self.problem.classes:
            compute, comm = self.problem.compute_s[c], self.problem.linear_comm_s[c]
            if len(compute) > 1:
                self.x[c] = [self._new_variable(a + b, True, weight) for a, b in zip(compute, comm)]

    def edge_variables(self) -> None:
        """``y[e, p, q]`` in [0, 1] for every edge between two classes with choices."""
        weight = 0.0 if self.minimize_memory else OBJECTIVE_SCALE
        for edge in self.problem.edges:
            self.y.append([[self._new_variable(cost, False, weight) for cost in row] for row in edge.comm_s])

    def charge_variables(self) -> None:
        """``z[h]`` in [0, 1] for every shared charge (:meth:`shared_charges` bounds it below by its terms); none when
        minimising memory, which they do not touch."""
        if not self.minimize_memory:
            self.z = [self._new_variable(charge.seconds, False, OBJECTIVE_SCALE) for charge in self.problem.charges]

    def recompute_variables(self) -> None:
        """``r[g]`` in {0, ..., n_g}: how many layers of group ``g`` recompute; ``w[g, c, s]`` in [0, n_g]: how many of
        them do while class ``c`` takes ``s``.

        A group is the candidate layers whose recomputation costs the same seconds and frees the same bytes at every
        peak, strategy by strategy (:func:`_layer_groups`): tied repeated layers, whose classes are shared. Choosing
        which of them recompute changes nothing the model prices, so one integer per group stands for their binaries,
        and the LP has no copies of one layer's terms to branch over (LLaMA-70B on 128x8: 80 layers, one binary each,
        ran past 5 minutes of HiGHS). The recomputed forward's seconds and freed bytes depend on the sharding: they
        sit on ``w`` (``r[g]`` itself for classes with one strategy), which :meth:`recompute_links` ties to ``r`` and ``x``.
        """
        if self.recompute is None:
            return
        weight = 0.0 if self.minimize_memory else OBJECTIVE_SCALE
        self.groups = _layer_groups(self.recompute)
        for members in self.groups:
            first = members[0]
            seconds = self.recompute.seconds[first]
            constant = sum(row[0] for c, row in seconds.items() if c not in self.x)
            r = self._new_variable(constant, True, weight)
            self.upper[r] = float(len(members))
            self.r.append(r)
            classes = {c for c in seconds if c in self.x}
            classes |= {c for per_peak in self.recompute.freed for c in per_peak[first] if c in self.x}
            w = {c: [self._new_variable(seconds.get(c, (0.0,) * len(self.x[c]))[s], False, weight)
                     for s in range(len(self.x[c]))] for c in sorted(classes)}
            for variables in w.values():
                for variable in variables:
                    self.upper[variable] *= len(members)  # 0 where forbidden
            self.w.append(w)

    # -- constraints ------------------------------------------------------------
    def recompute_links(self) -> None:
        """``sum_s w[g, c, s] = r[g]`` and ``w[g, c, s] <= n_g x[c, s]``: ``w`` is ``r[g] * x[c, s]`` at every integral point."""
        for members, r, w in zip(self.groups, self.r, self.w):
            for c, variables in w.items():
                self.rows.append((variables + [r], [1.0] * len(variables) + [-1.0], 0.0, 0.0))
                for variable, x in zip(variables, self.x[c]):
                    self.rows.append(([variable, x], [1.0, -float(len(members))], -highspy.kHighsInf, 0.0))

    def one_strategy_per_class(self) -> None:
        for variables in self.x.values():
            self.rows.append((variables, [1.0] * len(variables), 1.0, 1.0))

    def edge_producer_marginals(self) -> None:
        for edge, y in zip(self.problem.edges, self.y):
            for p, row in enumerate(y):
                xs = [self.x[edge.producer][s] for s, label in enumerate(edge.producer_label) if label == p]
                self.rows.append((row + xs, [1.0] * len(row) + [-1.0] * len(xs), 0.0, 0.0))

    def edge_consumer_marginals(self) -> None:
        for edge, y in zip(self.problem.edges, self.y):
            for q in range(len(y[0])):
                column = [row[q] for row in y]
                xs = [self.x[edge.consumer][t] for t, label in enumerate(edge.consumer_label) if label == q]
                self.rows.append((column + xs, [1.0] * len(column) + [-1.0] * len(xs), 0.0, 0.0))

    def _term_variables(self, term: tuple) -> list[int]:
        """The variables whose sum is a charge's term: ``y[e, p, q]``, or ``x[c, s]`` for ``s`` in its strategies."""
        if term[0] == EDGE_TERM:
            _, e, p, q = term
            return [self.y[e][p][q]]
        return [self.x[term[1]][s] for s in term[2]]

    def shared_charges(self) -> None:
        """Charge ``h`` paid once when any reader needs that resharding: its seconds on its first term's variables and
        ``z[h] >= term_k - term_0`` for the others (see the module docstring); ``z[h] >= term_k`` for every term where
        the charge is forbidden (``z[h]`` fixed to 0)."""
        for charge, z in zip(self.problem.charges, self.z):
            terms = [self._term_variables(term) for term in charge.terms]
            if self.upper[z] == 0.0:  # priced inf: no term may hold
                for variables in terms:
                    self.rows.append(([z] + variables, [1.0] + [-1.0] * len(variables), 0.0, highspy.kHighsInf))
                continue
            first = terms[0]
            for variable in first:
                self.cost[variable] += self.cost[z]
            for variables in terms[1:]:
                coefficients = {z: 1.0}
                for variable in variables:
                    coefficients[variable] = coefficients.get(variable, 0.0) - 1.0
                for variable in first:
                    coefficients[variable] = coefficients.get(variable, 0.0) + 1.0
                kept = [(variable, value) for variable, value in coefficients.items() if value != 0.0]
                self.rows.append(([variable for variable, _ in kept], [value for _, value in kept], 0.0, highspy.kHighsInf))

    def memory_budget(self) -> None:
        if self.budget is None and self.memory_variable is None:
            return
        for peak, (coefficients, constant) in enumerate(zip(self.problem.memory_bytes, self.problem.memory_constant_bytes)):
            index, value = [], []
            for c, row in coefficients.items():
                index += self.x[c]
                value += [MEMORY_SCALE * size for size in row]
            per_layer = self.recompute.freed[peak] if self.recompute else ()
            for members, r, w in zip(self.groups, self.r, self.w):
                freed = per_layer[members[0]]
                index.append(r)
                value.append(-MEMORY_SCALE * sum(row[0] for c, row in freed.items() if c not in self.x))
                for c, row in freed.items():
                    if c in self.x:
                        index += w[c]
                        value += [-MEMORY_SCALE * size for size in row]
            if self.memory_variable is not None:
                self.rows.append((index + [self.memory_variable], value + [-1.0], -highspy.kHighsInf, -MEMORY_SCALE * constant))
            else:
                self.memory_rows.append((index, value, -highspy.kHighsInf,
                                         MEMORY_SCALE * (self.budget - MEMORY_MARGIN_BYTES - constant)))

    # -- solving ----------------------------------------------------------------
    def _model(self, with_memory_rows: bool = True) -> highspy.HighsLp:
        rows = self.rows + self.memory_rows if with_memory_rows else self.rows
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(self.cost), len(rows)
        lp.col_cost_ = np.array(self.cost)
        lp.col_lower_ = np.zeros(len(self.cost))
        lp.col_upper_ = np.array(self.upper)
        lp.row_lower_, lp.row_upper_, starts, index, value = _rowwise(rows)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = starts, index, value
        lp.integrality_ = [highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous for flag in self.integer]
        return lp

    def _run(self, time_limit_s: float, relax: bool, start: dict[int, int] | None = None) -> highspy.Highs:
        """A Highs solved within ``time_limit_s``: the LP relaxation (``relax``) or branch and bound from ``start``.

        The relaxation leaves the memory rows out while no recomputation is offered (:meth:`_run_lp` adds them when its
        optimum breaks one): a budget the unconstrained optimum meets costs the simplex nothing, where its dense rows
        over every strategy variable slowed it (LLaMA-7B 8x8 under an 80 GB budget: 6.2 -> 3.8 s).
        """
        started = time.perf_counter()
        highs = quiet_highs()
        highs.setOptionValue("time_limit", float(time_limit_s))
        highs.setOptionValue("random_seed", 0)
        highs.setOptionValue("mip_rel_gap", self.mip_rel_gap)
        lazy = relax and self.recompute is None and bool(self.memory_rows)
        model = self._model(with_memory_rows=not lazy)
        if relax:
            model.integrality_ = []
            highs.setOptionValue("presolve", "off")  # LLaMA-7B 8x8: 1.5 s of CPU without presolve, 3.3 s with it
        highs.passModel(model)
        if start is not None:
            solution = highspy.HighsSolution()
            solution.col_value = list(self._values_of(start))
            highs.setSolution(solution)
        if lazy:
            self._lacking_memory_rows = highs
            self._run_lp(highs, started + time_limit_s)
        else:
            run_highs(highs)
        return highs

    def _run_lp(self, highs: highspy.Highs, deadline: float) -> None:
        """Run the relaxation ``highs``; if it lacks the memory rows and its optimum breaks one, add them all and run on
        from its basis (an optimum that meets them is optimal with them too: it is feasible there and the problem
        without them is a relaxation of the one with them)."""
        run_highs(highs)
        if highs is not self._lacking_memory_rows or highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return
        values = np.array(highs.getSolution().col_value)
        if all(float(np.dot(values[index], value)) <= upper + MEMORY_ROW_TOLERANCE for index, value, _, upper in self.memory_rows):
            return
        self._lacking_memory_rows = None
        lower, upper, starts, index, value = _rowwise(self.memory_rows)
        highs.addRows(len(self.memory_rows), lower, upper, len(index), starts[:-1], index, value)
        logger.info("ILP: the relaxation's optimum breaks the memory budget; solving on with its rows")
        highs.setOptionValue("time_limit", max(1.0, deadline - time.perf_counter()))
        run_highs(highs)

    def _values_of(self, choice: dict[int, int]) -> np.ndarray:
        """The variables' values of one strategy per class (a starting point for branch and bound), every layer
        recomputing where recomputation is offered (what frees the most memory)."""
        values = np.zeros(len(self.cost))
        for c, variables in self.x.items():
            values[variables[choice[c]]] = 1.0
        for members, r, w in zip(self.groups, self.r, self.w):  # with recomputation offered: every layer recomputes
            values[r] = len(members)
            for c, variables in w.items():
                values[variables[choice[c]]] = len(members)
        for edge, y in zip(self.problem.edges, self.y):
            values[y[edge.producer_label[choice[edge.producer]]][edge.consumer_label[choice[edge.consumer]]]] = 1.0
        for charge, z in zip(self.problem.charges, self.z):  # paid by a term other than the first (shared_charges)
            values[z] = 1.0 if charge_s(self.problem, charge, choice) and not term_active(self.problem, charge.terms[0], choice) else 0.0
        return values

    def rounded(self, values: np.ndarray, bound_s: float, started: float,
                allowed: dict[int, frozenset[int]] | None = None) -> Solution | None:
        """The relaxation rounded and improved by local search, with its exact gap to ``bound_s``; None if it breaks the budget."""
        weights = {c: values[variables] for c, variables in self.x.items()}
        budget = None if self.budget is None else self.budget - MEMORY_MARGIN_BYTES
        choice = round_relaxation(self.problem, weights)
        if budget is not None:
            choice = repair(self.problem, choice, budget, allowed=allowed)
            if choice is None:
                return None
        choice = improve(self.problem, choice, budget, allowed=allowed)
        seconds = objective_s(self.problem, choice)
        gap = max(0.0, seconds - bound_s) / max(abs(seconds), 1e-12)
        stats = self._stats(time.perf_counter() - started, "Optimal" if gap == 0.0 else "Feasible", gap, 0,
                            "LP relaxation, rounded and improved by local search")
        return Solution(choice=choice, objective_s=seconds, stats=stats)

    def restricted(self, allowed: dict[int, frozenset[int]], time_limit_s: float = 60.0) -> Solution | None:
        """The best plan found with classes limited to ``allowed`` strategies (a baseline's): None if none fits.

        The LP relaxation with the other strategies' variables fixed at 0; an integral optimum is
        the restricted problem's optimum, otherwise it is rounded and improved within the restriction.
        """
        if self.r:
            raise SolverError("restricted solves know strategies only: build the ILP without recomputation for them")
        if self._floor_breaks_budget(allowed):
            return None
        started = time.perf_counter()
        fixed = np.array([variable for c, ok in allowed.items() for s, variable in enumerate(self.x.get(c, ())) if s not in ok],
                         dtype=np.int32)
        highs = self._relaxation  # the relaxation solved last: its basis warm-starts the restricted one
        if highs is None:
            highs = self._relaxation = self._run(time_limit_s, relax=True)
        highs.setOptionValue("time_limit", float(time_limit_s))
        highs.changeColsBounds(len(fixed), fixed, np.zeros(len(fixed)), np.zeros(len(fixed)))
        try:
            self._run_lp(highs, started + time_limit_s)
            if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return None
            values = np.array(highs.getSolution().col_value)
            bound_s = self._bound_s(highs)
        finally:
            highs.changeColsBounds(len(fixed), fixed, np.zeros(len(fixed)), np.ones(len(fixed)))
        if self._integral(values):
            choice = {c: 0 for c in self.problem.classes}
            for c, variables in self.x.items():
                choice[c] = int(np.argmax(values[variables]))
            stats = self._stats(time.perf_counter() - started, "Optimal", 0.0, 0, "LP relaxation (integral), restricted")
            return Solution(choice=choice, objective_s=objective_s(self.problem, choice), stats=stats)
        return self.rounded(values, bound_s, started, allowed)

    def memory_floor_bytes(self, allowed: Mapping[int, frozenset[int]] | None = None) -> list[float]:
        """Per peak, the bytes it holds at least: each class at its smallest there, whatever the others take; with
        ``allowed`` (a restriction, as :meth:`restricted` takes), at its smallest among the strategies it may take.
        Above the budget, no plan fits, with nothing solved (LLaMA-70B on 128x8 under 80 GB: 266 GB at a peak, where
        the relaxation took 5-6 s to find it infeasible; its data-parallel, ZeRO-2 and Megatron layouts, whose
        restricted relaxations took ~16 s each to find so)."""
        allowed = allowed or {}
        return [constant + sum(min(row[s] for s in allowed[c]) if c in allowed else min(row)
                               for c, row in coefficients.items())
                for coefficients, constant in zip(self.problem.memory_bytes, self.problem.memory_constant_bytes)]

    def _floor_breaks_budget(self, allowed: Mapping[int, frozenset[int]] | None = None) -> bool:
        """Whether a peak's floor (:meth:`memory_floor_bytes`, under ``allowed`` where given) is over the budget: then no
        plan fits, and nothing need be solved to say so (logged). False without a budget or when minimizing memory."""
        if self.budget is None or self.minimize_memory:
            return False
        floor = max(self.memory_floor_bytes(allowed), default=0.0)
        if floor <= self.budget - MEMORY_MARGIN_BYTES:
            return False
        logger.info("ILP: no plan fits: a peak holds at least %.4g bytes %s, over the budget of %.4g", floor,
                    "under the restriction" if allowed else "whatever the strategies", self.budget)
        return True

    def _bound_s(self, highs: highspy.Highs) -> float:
        """The solved relaxation's objective in seconds, the single-strategy classes' included: a bound below every plan's."""
        return float(highs.getInfo().objective_function_value) / OBJECTIVE_SCALE + self.constant_s()

    def _integral(self, values: np.ndarray) -> bool:
        binaries = [i for i, flag in enumerate(self.integer) if flag]
        return bool(np.all(np.abs(values[binaries] - np.round(values[binaries])) <= INTEGRALITY_TOLERANCE))

    def solve(self, time_limit_s: float = 60.0, start: Mapping[int, int] | None = None) -> Solution | None:
        """Solve; None when infeasible. The best incumbent is returned at the time limit.

        The LP relaxation is solved first: the marginal linearization is tight, so its optimum
        is usually integral, and an integral optimum of the relaxation is optimal for the ILP.
        Otherwise the MIP runs (branch and bound) within what is left of the time limit.

        ``start``: a plan (one strategy per class) known to fit the budget, such as an earlier search's; ignored where
        recomputation is offered (a start there sets every layer recomputing). Branch and bound starts from it where
        its objective is lower than the rounded relaxation's, where rounding finds no plan, or where the relaxation ran
        out of time, so that a search its time limit stops ends with a plan no dearer than ``start``.
        """
        if math.isinf(self.constant_s()):
            raise SolverError("no plan reduces every gradient in the precision policy's reduce dtype: a node with a "
                              "single strategy reduces one in another dtype; choose another reduce dtype")
        if not self.cost:
            return Solution(choice={c: 0 for c in self.problem.classes}, objective_s=self.constant_s(),
                            stats=self._stats(0.0, "Optimal", 0.0, 0, "no choices"))
        started = time.perf_counter()
        if self.recompute is None and self._floor_breaks_budget():
            return None
        method = "LP relaxation (integral)"
        if self._solve_on:  # peaks added to the relaxation solved last: on from its basis
            highs, self._solve_on = self._relaxation, False
            highs.setOptionValue("time_limit", float(time_limit_s))
            self._run_lp(highs, started + time_limit_s)
        else:
            highs = self._run(time_limit_s, relax=True)
        self._relaxation = highs
        lp_status = highs.getModelStatus()
        if lp_status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
            return None
        values = np.array(highs.getSolution().col_value)
        given, start = start, None
        fractional = (lp_status == highspy.HighsModelStatus.kOptimal and not self._integral(values)
                      and not self.minimize_memory)
        if fractional and not self.r:  # rounding knows strategies only: a relaxation with recomputation goes to branch and bound
            rounded = self.rounded(values, self._bound_s(highs), started)
            if rounded is not None and rounded.stats["mip_gap"] <= ACCEPTED_ROUNDING_GAP:
                logger.info("ILP: %s", rounded.stats)
                return rounded
            start = None if rounded is None else rounded.choice
            given_s = None if given is None else objective_s(self.problem, given)
            if given_s is not None and (start is None or given_s < rounded.objective_s):
                start = dict(given)
                logger.info("ILP: branch and bound starts from the plan given, priced %.6g s", given_s)
            else:
                logger.info("ILP: branch and bound starts from %s", "the replicated plan" if rounded is None else rounded.stats)
        elif fractional:
            heaviest = round_relaxation(self.problem, {c: values[variables] for c, variables in self.x.items()})
            if self.round_recompute_up:
                stats = self._stats(time.perf_counter() - started, "Feasible", None, 0,
                                    "LP relaxation, recompute counts rounded up")
                logger.info("ILP: %s", stats)
                return Solution(choice=heaviest, objective_s=self._bound_s(highs), stats=stats,
                                recompute=self._recomputed(values, up=True))
            # branch and bound starts from the relaxation's heaviest strategies with every layer recomputing: where
            # that fits the budget, it ends with a plan at worst (LLaMA-70B on 128x8 under 80 GB needed 100+ nodes)
            start = heaviest
        if lp_status != highspy.HighsModelStatus.kOptimal and start is None:
            # the relaxation did not finish in time: branch and bound starts from the plan given, else from every
            # class's first strategy (the replicated one: strategy sets start with it), so that it ends with that plan
            # at worst instead of none; its status and gap say how far it got
            from_given = given is not None and not self.r
            start = dict(given) if from_given else {c: 0 for c in self.problem.classes}
            logger.warning("ILP: the LP relaxation stopped (%s) after %.1f s; branch and bound starts from the %s",
                           highs.modelStatusToString(lp_status), time.perf_counter() - started,
                           "plan given" if from_given else "replicated plan")
        if lp_status != highspy.HighsModelStatus.kOptimal or not self._integral(values):
            remaining = max(1.0, time_limit_s - (time.perf_counter() - started))
            highs, method = self._run(remaining, relax=False, start=start), "branch and bound"
        status, info = highs.getModelStatus(), highs.getInfo()
        if info.primal_solution_status != 2:
            if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
                return None
            raise SolverError(
                f"HiGHS found no plan within {time_limit_s} s (status {highs.modelStatusToString(status)}); "
                "raise --time-limit or try --solver beam"
            )
        values = np.array(highs.getSolution().col_value)
        choice = {c: 0 for c in self.problem.classes}
        for c, variables in self.x.items():
            choice[c] = int(np.argmax(values[variables]))
        gap = 0.0 if method.startswith("LP") else float(info.mip_gap) if info.mip_gap < highspy.kHighsInf else None
        stats = self._stats(time.perf_counter() - started, highs.modelStatusToString(status), gap, int(max(info.mip_node_count, 0)), method)
        logger.info("ILP: %s", stats)
        objective = float(info.objective_function_value)
        recompute = self._recomputed(values)
        if self.minimize_memory:
            return Solution(choice=choice, objective_s=objective / MEMORY_SCALE, stats=stats, recompute=recompute)
        return Solution(choice=choice, objective_s=objective / OBJECTIVE_SCALE + self.constant_s(), stats=stats,
                        recompute=recompute)

    def _recomputed(self, values: np.ndarray, up: bool = False) -> tuple[int, ...]:
        """The layers that recompute: of each group, the first ``r[g]`` in layer order (the model prices them alike);
        ``up``: ``r[g]`` of a relaxation, rounded up."""
        if self.recompute is None:
            return ()
        count = (lambda value: math.ceil(value - INTEGRALITY_TOLERANCE)) if up else (lambda value: int(round(value)))
        chosen = [index for members, r in zip(self.groups, self.r) for index in members[: count(values[r])]]
        return tuple(self.recompute.layers[index] for index in sorted(chosen))

    def _stats(self, solve_s: float, status: str, gap: float | None, nodes: int, method: str) -> dict:
        return {
            "solver": "ilp",
            "variables": len(self.cost),
            "binary_variables": sum(self.integer),
            "constraints": len(self.rows) + len(self.memory_rows),
            "build_s": round(self.build_s, 4),
            "solve_s": round(solve_s, 4),
            "status": status,
            "method": method,
            "mip_gap": gap,
            "nodes_explored": nodes,
        }

    def constant_s(self) -> float:
        """Seconds of the classes with a single strategy (no variable carries them)."""
        return sum(
            self.problem.compute_s[c][0] + self.problem.linear_comm_s[c][0] for c in self.problem.classes if c not in self.x
        )


def _layer_groups(terms: RecomputeTerms) -> list[tuple[int, ...]]:
    """The candidate layers (indices into ``terms.layers``) grouped by equal terms: the same seconds and the same bytes
    freed at every peak, class by class and strategy by strategy; groups in order of their first layer."""
    groups: dict[tuple, list[int]] = {}
    for index in range(len(terms.layers)):
        key = (tuple(sorted(terms.seconds[index].items())),
               tuple(tuple(sorted(per_peak[index].items())) for per_peak in terms.freed))
        groups.setdefault(key, []).append(index)
    return [tuple(members) for members in groups.values()]
