"""``plan_graph``: the solver's driver, a short recipe.

    build_problem -> solve (ILP or beam) -> check the true memory peak (add it, solve again)
                  -> assignment -> estimate -> explanation data -> Plan
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Mapping

from ..cost import DEFAULT_BUCKET_CAP_BYTES, NO_BUCKETING, Bucketing, Cluster, bucketing_for
from ..cost.comm import waits_by_gap
from ..gc_pause import gc_paused
from ..ir import Graph, Replicate, Rule
from ..ir.plan import Plan, graph_fingerprint
from .beam import beam_search
from .errors import InfeasibleBudgetError, SolverError
from .estimate import Assignment, estimate, node_compute_s, node_facts
from .explain import explanation_data
from .ilp import RECOMPUTE_MIP_REL_GAP, ShardingILP, Solution
from .local_search import objective_s
from .problem import Problem, Restrictions, build_problem, final_output_sharding, with_bucketing, with_peaks

logger = logging.getLogger(__name__)

SOLVERS = ("ilp", "beam")
MAX_PEAK_ROUNDS = 5
"""How many times a plan whose true memory peak breaks the budget is solved again with that peak added."""
SHORT_WAIT_SEARCH_S = 10.0
"""The time limit of a second search (at short waits, :func:`_searched_at_short_waits`; at whole calls,
:func:`_searched_with_whole_calls`), where the caller's is longer. It refines a plan already found, and the estimate
picks between the two, so its branch and bound gets a bounded share of the planning time: on this project's 2-core
machine, mixtral-mini on a 2x2 mesh of 4 processes, the first search was optimal in 1.4 s, the second's branch and
bound ran to the 60 s limit (gap 0.97 %), and its plan was priced above the first's; the whole solve took 68 s."""
BASELINE_CHECK_GAP = 0.005
"""A plan proven within this fraction of optimal is not compared with the baselines' layouts (:func:`_baselines_needed`):
none of them can be cheaper by more."""


def split_rules(rules: Any) -> tuple[Mapping[str, Rule], Mapping[str, str]]:
    """Accept ShardCombine's ``GraphRules`` (``.rules``, ``.missing``) or a plain mapping."""
    if hasattr(rules, "rules"):
        return rules.rules, getattr(rules, "missing", {})
    return rules, {}


@gc_paused()
def plan_graph(
    graph: Graph,
    rules: Any,
    cluster: Cluster,
    memory_budget_bytes: float | None = None,
    solver: str = "ilp",
    time_limit_s: float = 60.0,
    beam_width: int = 16,
    restrictions: Restrictions = Restrictions(),
    bucket_cap_bytes: float | None = None,
    uneven_shards: bool = True,
    reduce_dtype: str | None = None,
    recompute: bool = True,
    budget_footprint: bool = True,
    explain: bool = True,
) -> Plan:
    """Plan ``graph`` on ``cluster``: the cheapest strategies that fit ``memory_budget_bytes`` per device.

    ``rules``: node name -> Rule, or ShardCombine's GraphRules (nodes without a rule replicate).
    ``memory_budget_bytes``: None for the device's capacity; ``float('inf')`` for no budget.
    ``bucket_cap_bytes``: the runtime's coalescing bucket (the lowering's ``bucket_cap_bytes``; None: its default, 0: off),
    which decides how update-phase collectives are priced (:mod:`metadist.cost.bucketing`).
    ``uneven_shards``: False plans even splits only, for a runtime that cannot hold ``torch.chunk`` pieces
    (JAX: ``jit``'s in and out shardings must divide every dim).
    ``reduce_dtype``: a precision policy's gradient reduce dtype (:mod:`.precision`); None leaves it free.
    ``recompute``: when no plan fits the budget, offer the ILP each repeated layer's recomputation
    (:func:`_plan_with_recompute`); the plan then records the layers (``Plan.recompute``) and is made for the
    rewritten graph (:func:`~metadist.solver.recompute.apply_recompute`).
    ``budget_footprint``: a budget error says the smallest footprint any plan reaches (a second ILP); False leaves it
    out, for a caller that tries something else on that error.
    ``explain``: record why each node got its strategy (``plan.solver["explain"]``, read by :func:`.explain.explain`);
    False leaves it out, for a caller that will not ask (LLaMA-7B on 8x8: 0.23 s of the solve).
    """
    if solver not in SOLVERS:
        raise SolverError(f"unknown solver {solver!r}; choose one of {SOLVERS}")
    check_device_dtypes(graph, cluster)
    rule_map, missing = split_rules(rules)
    if not uneven_shards:
        restrictions = replace(restrictions, uneven_shards=False)
    if reduce_dtype is not None:
        restrictions = replace(restrictions, reduce_dtype=reduce_dtype)
    budget = cluster.device.memory_capacity_bytes if memory_budget_bytes is None else memory_budget_bytes
    budget = None if budget == float("inf") else float(budget)
    can_recompute = recompute and budget is not None and solver == "ilp"
    footprint = budget_footprint and not can_recompute  # recomputation comes first: the footprint when it fails too
    problem = build_problem(graph, rule_map, cluster, restrictions, missing, bucketing_for(graph, DEFAULT_BUCKET_CAP_BYTES if bucket_cap_bytes is None else bucket_cap_bytes))
    ilp = None
    try:
        for round_index in range(MAX_PEAK_ROUNDS):
            if round_index:
                logger.info("true memory peak at position %d breaks the budget: adding it and solving again", position)
                problem = with_peaks(problem, tuple(sorted({*problem.peaks, position})))
            estimates = _Estimates(problem)
            solution, ilp = _solve(problem, budget, solver, time_limit_s, beam_width, footprint=footprint, before=ilp)
            figures = estimates.figures(solution.choice)
            position = figures["memory_peak_position"]
            if budget is None or figures["memory_bytes_peak"] <= budget * (1 + 1e-9) or position in problem.peaks:
                break
    except InfeasibleBudgetError as error:
        if not can_recompute:
            raise
        return _plan_with_recompute(graph, rule_map, missing, cluster, problem, budget, error,
                                    dict(time_limit_s=time_limit_s, restrictions=restrictions,
                                         bucket_cap_bytes=bucket_cap_bytes, uneven_shards=uneven_shards, explain=explain),
                                    budget_footprint)
    if ilp is not None:  # once, on the last round's problem: the rounds before it only found the true peaks
        solution = _searched_with_whole_calls(problem, solution, estimates, rule_map, missing, restrictions, budget,
                                              time_limit_s)
        solution = _checked_against_baselines(problem, ilp, solution, time_limit_s, estimates, budget)
        if waits_by_gap(cluster):
            problem, solution, estimates = _searched_at_short_waits(problem, solution, estimates, rule_map, missing,
                                                                    restrictions, budget, time_limit_s)
        figures = estimates.figures(solution.choice)
    assignment = assignment_from(problem, solution.choice)
    if budget is not None and figures["memory_bytes_peak"] > budget * (1 + 1e-9):
        logger.warning(
            "after %d rounds the plan's memory peak (%.0f bytes at %s) still exceeds the budget (%.0f bytes); "
            "the plan is kept and the excess recorded in plan.solver['memory_budget_exceeded_bytes']",
            MAX_PEAK_ROUNDS, figures["memory_bytes_peak"], figures["memory_peak_node"], budget,
        )
    return _make_plan(graph, problem, solution, assignment, figures, budget, explain)


def _plan_with_recompute(graph: Graph, rules: Mapping[str, Rule], missing: Mapping[str, str], cluster: Cluster,
                         problem: Problem, budget: float, error: InfeasibleBudgetError, options: dict,
                         footprint: bool = True) -> Plan:
    """No plan fits without recomputation: let the ILP choose the layers to recompute, then plan the rewritten graph.

    The ILP (:class:`ShardingILP` with :class:`~.recompute.RecomputeTerms`) gets a count per group of alike repeated
    layers: recomputing adds a layer's forward compute under the chosen sharding and frees its saved activations at the
    peaks they span. A fractional relaxation gives its counts rounded up (``round_recompute_up``). Its layers are then
    written into the graph (:func:`~.recompute.apply_recompute`) and the rewritten graph is planned as any other, so
    every reshard of the recomputed forward and the true memory peaks are priced; should the ILP's layers still not fit
    there, every layer recomputes. No layer that can recompute, or no fit even so, is the
    original error, with the smallest footprint recomputation reaches (``footprint``: found by an ILP that minimizes
    memory, run only for this error; ``error`` comes without it, :func:`_solve`).
    """
    from .recompute import CLONE_SUFFIX, apply_recompute, recompute_layers, recompute_terms

    original = problem
    candidates = recompute_layers(graph)
    if not candidates:
        raise _with_footprint(error, original, options["time_limit_s"], footprint)
    every = tuple(layer.layer for layer in candidates)
    problem = with_peaks(problem, tuple(sorted({*problem.peaks, *_peaks_after_recompute(graph, every)})))
    terms = recompute_terms(problem, candidates)
    solution = ShardingILP(problem, budget, recompute=terms, mip_rel_gap=RECOMPUTE_MIP_REL_GAP,
                           round_recompute_up=True).solve(options["time_limit_s"])
    if solution is None:
        smallest = _smallest(ShardingILP(problem, None, minimize_memory=True, recompute=terms), options["time_limit_s"]) \
            if footprint else None
        raise InfeasibleBudgetError(budget, smallest,
                                    f" (even recomputing all {len(candidates)} repeated layers' forward)") from error
    for layers in dict.fromkeys((solution.recompute, every)):
        rewritten = apply_recompute(graph, layers)
        clone_rules, without = recomputed_rules(rewritten, rules)
        clone_missing = {**missing, **{name: missing.get(name[: -len(CLONE_SUFFIX)], "no rule given") for name in without}}
        try:
            plan = plan_graph(rewritten, SimpleNamespace(rules=clone_rules, missing=clone_missing), cluster, budget, "ilp",
                              recompute=False, budget_footprint=False, **options)
        except InfeasibleBudgetError:
            logger.info("recomputing layers %s does not fit on the rewritten graph; trying every layer", list(layers))
            continue
        chosen = {"layers": list(layers), "candidates": list(every), "ilp_layers": list(solution.recompute),
                  "ilp_objective_s": solution.objective_s}
        return replace(plan, recompute=tuple(layers), solver={**plan.solver, "recompute": chosen})
    raise _with_footprint(error, original, options["time_limit_s"], footprint)


def _with_footprint(error: InfeasibleBudgetError, problem: Problem, time_limit_s: float,
                    footprint: bool) -> InfeasibleBudgetError:
    """``error`` (raised without its footprint, :func:`_solve`) with the smallest footprint any plan of ``problem``
    reaches, where ``footprint`` asks for it."""
    if error.minimum_bytes is not None or not footprint:
        return error
    return InfeasibleBudgetError(error.budget_bytes, smallest_memory_bytes(problem, time_limit_s))


def _peaks_after_recompute(graph: Graph, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The memory peaks of ``graph`` with ``layers`` recomputing, as positions of ``graph`` (a clone at the node it runs before)."""
    from ..cost import liveness
    from .recompute import CLONE_SUFFIX, apply_recompute

    rewritten = apply_recompute(graph, layers)
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    found = set()
    for peak in liveness(rewritten).peaks:
        while 0 <= peak < len(rewritten.nodes) and rewritten.nodes[peak].name.endswith(CLONE_SUFFIX):
            peak += 1
        found.add(peak if peak < 0 else position[rewritten.nodes[peak].name] if peak < len(rewritten.nodes) else len(graph.nodes))
    return tuple(sorted(found))


def recomputed_rules(graph: Graph, rules: Mapping[str, Rule]) -> tuple[dict[str, Rule], tuple[str, ...]]:
    """``rules`` with each clone of a recomputed node (:mod:`.recompute`) given its original's rule, and the clones without one."""
    from .recompute import CLONE_SUFFIX

    found, without = dict(rules), []
    for node in graph.nodes:
        if node.name.endswith(CLONE_SUFFIX) and node.name not in found:
            original = node.name[: -len(CLONE_SUFFIX)]
            if original in rules:
                found[node.name] = rules[original]
            else:
                without.append(node.name)
    return found, tuple(without)


def check_device_dtypes(graph: Graph, cluster: Cluster) -> None:
    """A clear error when the step computes in a dtype the cluster's device lacks (bfloat16 on a V100)."""
    used = {value.spec.dtype for value in graph.iter_values()}
    lacking = sorted(dtype for dtype in used if not cluster.device.supports(dtype))
    if lacking:
        raise SolverError(
            f"the step computes in {', '.join(lacking)}, which the {cluster.device.name or 'device'} of cluster "
            f"{cluster.name!r} does not support; train in a precision it has (fp16 with a GradScaler, or fp32) or plan "
            "for another --cluster"
        )


def _solve(problem: Problem, budget: float | None, solver: str, time_limit_s: float, beam_width: int,
           footprint: bool = True, before: ShardingILP | None = None) -> tuple[Solution, ShardingILP | None]:
    """The search's solution, and its ILP (None for beam search) for :func:`_checked_against_baselines`; raises
    :class:`InfeasibleBudgetError` when nothing fits, with the smallest footprint any plan reaches if ``footprint`` (a
    second ILP: the caller may go on to recomputation instead, and ask for it then). ``before``: the last round's ILP,
    of the same problem with fewer peaks, which solves on (:meth:`ShardingILP.add_peaks`)."""
    ilp = None
    if solver == "beam":
        solution = beam_search(problem, budget, beam_width)
    else:
        if before is None:
            ilp = ShardingILP(problem, budget)
        else:
            ilp = before
            ilp.add_peaks(problem)
        solution = ilp.solve(time_limit_s)
    if solution is None:
        raise InfeasibleBudgetError(budget, smallest_memory_bytes(problem, time_limit_s) if footprint else None)
    return solution, ilp


def _searched_again(problem: Problem, solution: Solution, cluster: Cluster, bucketing: Bucketing,
                    rules: Mapping[str, Rule], missing: Mapping[str, str], restrictions: Restrictions,
                    budget: float | None, time_limit_s: float) -> tuple[Problem, Solution | None, float]:
    """A second search of ``problem``'s graph priced on ``cluster`` and ``bucketing``: (its problem, with the peaks the
    rounds added; its solution, None where it found none; its time limit, at most :data:`SHORT_WAIT_SEARCH_S`). On the
    same cluster the problem is ``problem`` repriced under ``bucketing`` (:func:`.problem.with_bucketing`), else built
    again.

    Branch and bound starts from ``solution`` carried into the new problem where the rounded relaxation is dearer:
    stopped by its limit, the search still ends with a plan no dearer, by its own prices, than that one."""
    other = with_bucketing(problem, restrictions, bucketing) if cluster == problem.cluster else None
    if other is None:  # priced on another cluster (or the update phase starts elsewhere): built again
        other = build_problem(problem.graph, rules, cluster, restrictions, missing, bucketing)
    if other.peaks != problem.peaks:
        other = with_peaks(other, problem.peaks)
    limit_s = min(time_limit_s, SHORT_WAIT_SEARCH_S)
    return other, ShardingILP(other, budget).solve(limit_s, start=choice_in(problem, solution.choice, other)), limit_s


def _searched_at_short_waits(problem: Problem, solution: Solution, estimates: "_Estimates", rules: Mapping[str, Rule],
                             missing: Mapping[str, str], restrictions: Restrictions, budget: float | None,
                             time_limit_s: float) -> tuple[Problem, Solution, "_Estimates"]:
    """The plan, or the plan of a second search that prices every call at its link's shortest-gap wait, whichever the
    estimate prices lower (and fits ``budget``), with the second search's figures in ``solver['short_waits']``.

    A link that measured :attr:`~metadist.cost.cluster.Link.sync_by_gap` waits little on a call that follows another
    and most on one after a long stretch of compute. The search's objective is linear, so it prices every call at the
    long wait (``sync_s``), and a plan whose calls come in runs (an experts layer's dispatch and combine) looks dearer
    to it than it runs; priced at the short wait, every call looks cheaper than it runs. The estimate, which prices
    each call's wait by the compute before it, picks between the two plans (and the baselines, checked before).
    """
    cluster = problem.cluster
    short = replace(cluster, axis_links=tuple(replace(link, sync_s=link.sync_by_gap[0][1]) if link.sync_by_gap else link
                                              for link in cluster.axis_links))
    started = time.perf_counter()
    other, found, limit_s = _searched_again(problem, solution, short, problem.bucketing, rules, missing, restrictions,
                                            budget, time_limit_s)
    kept_s = estimates.step_s(solution.choice)
    report: dict[str, Any] = {"step_s_at_long_waits": round(kept_s, 9), "time_limit_s": limit_s}
    if found is None:
        report["step_s"] = None
        logger.info("the search at short waits found no plan within %.0f s; keeping the plan", limit_s)
        return problem, Solution(solution.choice, solution.objective_s, {**solution.stats, "short_waits": report}), estimates
    other_estimates = _Estimates(other)
    figures = other_estimates.figures(found.choice)
    fits = budget is None or figures["memory_bytes_peak"] <= budget * (1 + 1e-9)
    report.update(step_s=round(figures["step_s"], 9), fits=fits, search_s=round(time.perf_counter() - started, 4))
    if fits and figures["step_s"] < kept_s * (1 - 1e-9):
        report["kept"] = "short waits"
        return other, Solution(found.choice, found.objective_s, {**solution.stats, **found.stats, "short_waits": report,
                                                                 "baselines_checked": solution.stats.get("baselines_checked", {}),
                                                                 "baselines_reason": solution.stats.get("baselines_reason", "")}), other_estimates
    report["kept"] = "long waits"
    return problem, Solution(solution.choice, solution.objective_s, {**solution.stats, "short_waits": report}), estimates


def _searched_with_whole_calls(problem: Problem, solution: Solution, estimates: "_Estimates", rules: Mapping[str, Rule],
                               missing: Mapping[str, str], restrictions: Restrictions, budget: float | None,
                               time_limit_s: float) -> Solution:
    """The plan, or the plan of a second search that prices every coalesced resharding as a call of its own, whichever
    the estimate prices lower (and fits ``budget``), with the second search's figures in ``solver['whole_calls']``.

    The objective prices a coalesced resharding at a share of a call's fixed cost (``buckets / values``), as if every
    update-phase value joined the same calls; a plan that makes few such calls pays each whole (the estimate prices
    the calls a plan makes, ``coalesced_s`` beyond the shares). The shares price such a call from below, a call of its
    own from above: where the plan's calls cost more than their shares by over :data:`BASELINE_CHECK_GAP` of its step,
    the problem is solved again at the upper price, and the estimate picks between the two plans. llama-tiny on 2x2 (4
    processes sharing 2 cores) planned one coalesced all-gather priced at 1/120 of a call: estimate 21.2 ms, where the
    second search's plan (every value replicated) is priced 13.8 and ran 13.8 ms a step against the first plan's 19.5
    (planning notes, fiftieth session). Not run where nothing is coalesced (``NO_BUCKETING``) or on the plan of beam
    search (the caller runs it on ILP plans only), nor on a baseline's problem (inputs pinned, ``Restrictions``): a
    baseline is the objective's optimum under its restriction, as defined. Run before the baselines are compared
    (:func:`_baselines_needed` always compares a plan this search found: the bound below the shares' objective does not
    hold for it)."""
    figures = estimates.figures(solution.choice)
    if problem.bucketing.cap_bytes <= 0 or restrictions.input_shardings \
            or figures["coalesced_s"] <= BASELINE_CHECK_GAP * figures["step_s"]:
        return solution
    started = time.perf_counter()
    other, found, limit_s = _searched_again(problem, solution, problem.cluster, NO_BUCKETING, rules, missing,
                                            restrictions, budget, time_limit_s)
    report: dict[str, Any] = {"step_s_at_shares": round(figures["step_s"], 9), "time_limit_s": limit_s}
    mapped = None if found is None else choice_in(other, found.choice, problem)
    if mapped is None:
        report["step_s"] = None
        logger.info("the search pricing whole calls found no plan within %.0f s; keeping the plan", limit_s)
        return Solution(solution.choice, solution.objective_s, {**solution.stats, "whole_calls": report})
    found_figures = estimates.figures(mapped)
    fits = budget is None or found_figures["memory_bytes_peak"] <= budget * (1 + 1e-9)
    report.update(step_s=round(found_figures["step_s"], 9), fits=fits, search_s=round(time.perf_counter() - started, 4))
    if fits and found_figures["step_s"] < figures["step_s"] * (1 - 1e-9):
        report["kept"] = "whole calls"
        return Solution(mapped, objective_s(problem, mapped),  # its stats are the second search's (its gap to its bound)
                        {**solution.stats, **found.stats, "whole_calls": report,
                         "method": f"{found.stats.get('method', 'ILP')}, every coalesced resharding priced as a call of its own"})
    report["kept"] = "shares"
    return Solution(solution.choice, solution.objective_s, {**solution.stats, "whole_calls": report})


def _checked_against_baselines(problem: Problem, ilp: ShardingILP, solution: Solution, time_limit_s: float,
                               estimates: "_Estimates", budget: float | None) -> Solution:
    """The ILP's ``solution``, or a baseline's layout where that costs less and fits ``budget``
    (:func:`_no_worse_than_baselines`), with why the baselines were or were not solved."""
    reason = _baselines_needed(problem, solution, estimates)
    if reason is None:
        gap = solution.stats.get("mip_gap")
        why = ("optimal, and the objective prices what the estimate prices" if gap == 0.0 else
               f"within {gap:.3%} of a bound below every plan's objective, a baseline's too, and the objective prices "
               "what the estimate prices")
        return Solution(solution.choice, solution.objective_s, {**solution.stats, "baselines_checked": {},
                                                                "baselines_reason": f"not needed: {why}"})
    return _no_worse_than_baselines(problem, ilp, solution, time_limit_s, estimates, reason, budget)


class _Estimates:
    """:func:`.estimate.estimate` of each choice of one problem, computed once per choice.

    The planner prices its plan's choice up to three times (does the objective match it? is a baseline cheaper? the
    plan's figures) and a baseline's restricted solve often lands on a choice already priced.
    """

    def __init__(self, problem: Problem) -> None:
        self.problem, self.by_choice, self.facts = problem, {}, node_facts(problem.graph)

    def figures(self, choice: Mapping[int, int]) -> dict[str, Any]:
        key = tuple(sorted(choice.items()))
        figures = self.by_choice.get(key)
        if figures is None:
            problem = self.problem
            figures = self.by_choice[key] = estimate(problem.graph, assignment_from(problem, choice), problem.cluster,
                                                     problem.liveness, problem.bucketing, self.facts)
        return figures

    def step_s(self, choice: Mapping[int, int]) -> float:
        """The step time of a choice as the runtime runs it (a resharding shared by readers once)."""
        return self.figures(choice)["step_s"]


def _baselines_needed(problem: Problem, solution: Solution, estimates: _Estimates) -> str | None:
    """Why the plan must be compared with the baselines' layouts, or None when it provably costs no more than any of them.

    The ILP prices every choice as the estimate does (a resharding once per value, source and target,
    ``Problem.prices_as_estimate``), and a baseline's layout is a choice of the same problem: an optimal plan is then
    no dearer than any baseline, by the estimate, with nothing more solved. A plan within a gap of a bound below every
    feasible choice's objective (the relaxation's, or branch and bound's) is at most that fraction dearer than any
    baseline that fits: within :data:`BASELINE_CHECK_GAP`, not worth solving four baselines for (LLaMA-70B on 128x8
    under 80 GB: ~23 s of the plan's ~78 for a plan 0.08 % above the bound). Otherwise (a wider gap or none; a problem
    whose pricing differs from the estimate's; an objective that disagrees with the plan's estimate, which the
    pricing rules out, so it is logged as a warning) the baselines are solved.

    The objective shares a coalesced call's fixed cost among the reshardings that may join it; the estimate prices the
    calls the plan makes (``coalesced_s``, :func:`.estimate.communication`), the one difference the pricing allows.
    Where those calls cost more than :data:`BASELINE_CHECK_GAP` of the step beyond their shares, a baseline may be
    cheaper by the estimate and the baselines are solved.
    """
    if solution.stats.get("whole_calls", {}).get("kept") == "whole calls":
        return "the plan is the second search's, at whole calls, not the objective's optimum"
    gap = solution.stats.get("mip_gap")
    if gap is None or gap > BASELINE_CHECK_GAP:
        return "not proven optimal" if gap is None else f"not proven within {BASELINE_CHECK_GAP:.1%} of optimal (gap {gap:.3%})"
    if waits_by_gap(problem.cluster):
        return "the estimate prices each collective's wait by the compute before it, the objective every call alike"
    if not problem.prices_as_estimate:
        return "a bucketed reader shares a resharding first: the objective prices its largest share, the estimate its first"
    figures = estimates.figures(solution.choice)
    objective, step, coalesced = objective_s(problem, solution.choice), figures["step_s"], figures["coalesced_s"]
    if abs(objective - (step - coalesced)) > 1e-6 * max(abs(step), 1e-12):
        logger.warning("the ILP's objective of the plan (%.9g s) differs from its estimate (%.9g s, of which %.9g s its "
                       "coalesced calls beyond their shares): comparing with the baselines' layouts", objective, step,
                       coalesced)
        return f"objective {objective:.9g} s differs from the estimate {step:.9g} s"
    if coalesced > BASELINE_CHECK_GAP * step:
        return (f"the plan's coalesced calls cost {coalesced:.6g} s beyond the shares of them the objective prices "
                f"({coalesced / step:.1%} of its step)")
    return None


def replicated_choice(problem: Problem) -> dict[int, int] | None:
    """Every class at its strategy that replicates everything (every rank runs the whole step, no collective): the
    layout of one device's step on each rank. None where a class offers no such strategy (a restriction left it
    none, such as an input pinned sharded)."""
    choice = {}
    for c in problem.classes:
        for s, row in enumerate(problem.units[c].strategies):
            if all(isinstance(placement, Replicate) for strategy in row for sharding in (*strategy.inputs, *strategy.outputs)
                   if sharding is not None for placement in sharding):
                choice[c] = s
                break
        else:
            return None
    return choice


REPLICATED = "replicated"
"""The key of the replicated layout (:func:`replicated_choice`) in ``solver['baselines_checked']``."""


def _no_worse_than_baselines(problem: Problem, ilp: ShardingILP, solution: Solution, time_limit_s: float,
                             estimates: _Estimates, reason: str = "", budget: float | None = None) -> Solution:
    """The search's plan, or a baseline's layout (data parallel, ZeRO, Megatron) solved on the same problem, or the
    replicated layout (:func:`replicated_choice`), where it costs less.

    Run when :func:`_baselines_needed` gives a ``reason``: above all when the search is not proven optimal (a rounded
    relaxation within its accepted gap, or branch and bound stopped at the time limit). A baseline is the problem with
    its inputs' layouts fixed; plans are compared by their step time as the runtime runs them
    (:meth:`_Estimates.step_s`). ``solver['baselines_checked']`` has the baselines' seconds (empty when none was
    needed), ``solver['baselines_reason']`` why they were solved, or not, and ``solver['baselines_over_budget']`` those
    whose layout breaks ``budget`` at a node outside the problem's peaks (never chosen).

    The replicated layout needs no solve: it is one choice, priced by the estimate, under :data:`REPLICATED`. Where
    the objective misprices a plan's calls it may beat every plan the search and the baselines find: llama-tiny on
    2x2 (4 processes sharing 2 cores) planned one coalesced all-gather that the objective priced at a share of 1/120
    of a call; the plan's estimate was 21.2 ms, the replicated layout's 13.7, and the plan ran 19.5 ms a step against
    15.0 for the replicated one (planning notes, fiftieth session). Over the budget, it is never chosen.
    """
    from .baselines import BASELINES, baseline_choices

    def candidates():  # (key, its solution or None, how it was made), each solved only when its turn comes
        for kind in BASELINES:
            allowed = baseline_choices(problem, kind)
            yield (kind, None if allowed is None else ilp.restricted(allowed, time_limit_s),
                   f"{kind} layout, solved on the same problem")
        replicated = replicated_choice(problem)
        if replicated is not None:
            yield (REPLICATED, Solution(replicated, objective_s(problem, replicated), {}),
                   "replicated layout: every rank runs the whole step, no collective")

    best, best_s, checked, over = solution, estimates.step_s(solution.choice), {}, []
    for key, candidate, method in candidates():
        candidate_s = None if candidate is None else estimates.step_s(candidate.choice)
        checked[key] = None if candidate_s is None else round(candidate_s, 9)
        if candidate_s is not None and budget is not None \
                and estimates.figures(candidate.choice)["memory_bytes_peak"] > budget * (1 + 1e-9):
            over.append(key)  # its true peak (for a baseline, at a node outside the problem's peaks) breaks the budget
        elif candidate_s is not None and candidate_s < best_s * (1 - 1e-9):
            best, best_s = Solution(candidate.choice, candidate.objective_s,
                                    {**solution.stats, "method": f"{method} (the search's plan cost more)"}), candidate_s
    return Solution(best.choice, best.objective_s, {**best.stats, "baselines_checked": checked, "baselines_reason": reason,
                                                    "baselines_over_budget": over})


def smallest_memory_bytes(problem: Problem, time_limit_s: float = 60.0) -> float | None:
    """The smallest per-device footprint at the problem's peaks that any plan reaches; None when the ILP finds none in
    ``time_limit_s`` (logged: the footprint only informs a budget error, which then says it could not be computed)."""
    return _smallest(ShardingILP(problem, None, minimize_memory=True), time_limit_s)


def _smallest(ilp: ShardingILP, time_limit_s: float) -> float | None:
    """The objective of a memory-minimizing ILP; None, logged, when it finds no plan in ``time_limit_s``."""
    try:
        solution = ilp.solve(time_limit_s)
    except SolverError as err:
        logger.warning("the smallest footprint of any plan was not found: %s", err)
        return None
    return None if solution is None else solution.objective_s


def choice_in(source: Problem, choice: Mapping[int, int], target: Problem) -> dict[int, int] | None:
    """The plan ``choice`` of ``source`` as one strategy per class of ``target`` (a problem of the same graph built on
    other figures): each target class takes the strategy its representative unit has in ``source``. None where a
    representative is not a unit of ``source`` or lacks that strategy there."""
    rows = {unit.members: unit.strategies[choice[source.unit_class[index]]] for index, unit in enumerate(source.units)}
    mapped = {}
    for c in target.classes:
        unit = target.units[c]
        row = rows.get(unit.members)
        if row is None:
            return None
        try:
            mapped[c] = unit.strategies.index(row)
        except ValueError:  # the target offers that unit other strategies (another mesh)
            return None
    return mapped


def assignment_from(problem: Problem, choice: Mapping[int, int]) -> Assignment:
    """Every node's strategy and every input's sharding from one strategy per class."""
    nodes, inputs = {}, {}
    for index, unit in enumerate(problem.units):
        row = unit.strategies[choice[problem.unit_class[index]]]
        for position, (name, strategy) in enumerate(zip(unit.members, row)):
            if unit.is_input and position == 0:
                inputs[name] = strategy.outputs[0]
            else:
                nodes[name] = strategy
    ordered_nodes = {node.name: nodes[node.name] for node in problem.graph.nodes}
    ordered_inputs = {gi.value.name: inputs[gi.value.name] for gi in problem.graph.inputs}
    return Assignment(ordered_nodes, ordered_inputs)


def _output_shardings(graph: Graph, assignment: Assignment) -> tuple:
    produced = dict(assignment.input_shardings)
    for node in graph.nodes:
        for value, sharding in zip(node.outputs, assignment.node_strategies[node.name].outputs):
            if value is not None:
                produced[value.name] = sharding
    return tuple(
        assignment.input_shardings[out.replaces] if out.replaces else final_output_sharding(produced[out.name])
        for out in graph.outputs
    )


def _make_plan(graph, problem: Problem, solution: Solution, assignment: Assignment, figures, budget,
               explain: bool = True) -> Plan:
    from .. import __version__

    started = time.perf_counter()
    unruled = {
        name: {"op": graph.node(name).op.target, "reason": reason,
               "compute_s": node_compute_s(graph, name, assignment.node_strategies[name], problem.cluster)}
        for name, reason in problem.missing_rules.items()
    }
    stats = dict(problem.stats)
    stats.update(solution.stats)
    stats.update(
        kind="solver",
        objective_s=solution.objective_s,
        memory_budget_bytes=budget,
        memory_budget_exceeded_bytes=max(0.0, figures["memory_bytes_peak"] - budget) if budget is not None else 0.0,
        memory_peaks_checked=list(problem.peaks),
        excluded_indivisible_strategies=problem.excluded_indivisible,
        nodes_without_rule=unruled,
    )
    if explain:
        stats["explain"] = explanation_data(problem, solution.choice, budget)
        stats["explain_s"] = round(time.perf_counter() - started, 4)
    figures = dict(figures, cluster=problem.cluster.name, memory_budget_bytes=budget)
    return Plan(
        graph_name=graph.name,
        graph_fingerprint=graph_fingerprint(graph),
        metadist_version=__version__,
        mesh=problem.cluster.mesh,
        node_strategies=assignment.node_strategies,
        input_shardings=assignment.input_shardings,
        output_shardings=_output_shardings(graph, assignment),
        estimate=figures,
        solver=stats,
    )
