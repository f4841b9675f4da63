"""The oracle's data: one-axis strategies in DTensor's words, findings, execution checks and reports.

Also our side of the comparison (a rule as one-axis strategies) and the
aggregation of per-signature comparisons into per-op counts. See
:mod:`metadist.shardcombine.oracle` for the comparison itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from ..ir import Concat, Factor, PartialPass, Reduce, Rule
from .errors import OracleError

__all__ = [
    "DTENSOR_WRONG",
    "REPLICATE",
    "ExecutionCheck",
    "OpReport",
    "OracleReport",
    "SignatureComparison",
    "Strategy",
    "StrategyFinding",
    "factor_strategy",
    "merge_reports",
    "report_of",
    "rule_strategies",
]

REPLICATE = "R"

DTENSOR_WRONG = "WRONG in DTensor"
"""How the reason of a DTensor-only strategy that fails the execution re-check begins."""


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True, order=True)
class Strategy:
    """One placement strategy on one mesh axis, in DTensor's words: ``S(d)``, ``R``, ``P(op)`` (``None``: no tensor)."""

    inputs: tuple[str, ...]
    outputs: tuple[str | None, ...]

    def __str__(self) -> str:
        return f"{', '.join(self.inputs)} -> {', '.join('-' if out is None else out for out in self.outputs)}"

    @property
    def partial_inputs(self) -> tuple[int, ...]:
        return tuple(index for index, placement in enumerate(self.inputs) if placement.startswith("P("))

    @property
    def is_trivial(self) -> bool:
        """All inputs replicated: every op has it, it says nothing."""
        return all(placement == REPLICATE for placement in self.inputs)


@dataclass(frozen=True)
class StrategyFinding:
    """A strategy one side has and the other lacks, with why (when known)."""

    strategy: Strategy
    reason: str


@dataclass(frozen=True)
class ExecutionCheck:
    """One factor (or partial pass) of our rule, re-run on real shards and recombined."""

    what: str
    """The factor as a strategy (``S(0), R -> S(0)``), or ``pass 0:sum``."""
    shards: int
    ok: bool | None
    """True: recombined output matches; False: the rule is wrong; None: not checkable here (see detail)."""
    max_abs_error: float
    detail: str = ""


@dataclass(frozen=True)
class SignatureComparison:
    """Our rule against DTensor for one op signature (op, input shapes and dtypes, other arguments)."""

    op_target: str
    signature: str
    example_node: str
    rule_text: str
    dtensor: str
    """``"registered"``, or why DTensor could not be asked (no strategy for the op, it raised...)."""
    agreements: tuple[Strategy, ...]
    only_ours: tuple[StrategyFinding, ...]
    only_dtensor: tuple[StrategyFinding, ...]
    checks: tuple[ExecutionCheck, ...]

    @property
    def wrong(self) -> tuple[ExecutionCheck, ...]:
        return tuple(check for check in self.checks if check.ok is False)

    @property
    def dtensor_wrong(self) -> tuple[StrategyFinding, ...]:
        """DTensor-only strategies that fail the execution re-check (DTensor bugs)."""
        return tuple(finding for finding in self.only_dtensor if finding.reason.startswith(DTENSOR_WRONG))


@dataclass(frozen=True)
class OpReport:
    """Counts for one op target over all its signatures."""

    op_target: str
    signatures: int
    dtensor_registered: int
    """Signatures DTensor could answer."""
    agreements: int
    only_ours: int
    only_dtensor: int
    checks_passed: int
    checks_failed: int
    checks_skipped: int
    dtensor_wrong: int
    """DTensor-only strategies that fail the execution re-check."""
    examples: tuple[str, ...] = ()
    """A few only-ours / only-DTensor / wrong lines, with reasons, for the report."""


@dataclass(frozen=True)
class OracleReport:
    """The verification of a set of graphs' rules; counts summed over :attr:`ops`."""

    models: tuple[str, ...]
    nodes: int
    nodes_with_rule: int
    mesh_size: int
    ops: tuple[OpReport, ...]
    comparisons: tuple[SignatureComparison, ...]

    def _total(self, name: str) -> int:
        return sum(getattr(op, name) for op in self.ops)

    @property
    def signatures(self) -> int:
        return self._total("signatures")

    @property
    def dtensor_registered(self) -> int:
        return self._total("dtensor_registered")

    @property
    def agreements(self) -> int:
        return self._total("agreements")

    @property
    def only_ours(self) -> int:
        return self._total("only_ours")

    @property
    def only_dtensor(self) -> int:
        return self._total("only_dtensor")

    @property
    def checks_passed(self) -> int:
        return self._total("checks_passed")

    @property
    def checks_failed(self) -> int:
        return self._total("checks_failed")

    @property
    def checks_skipped(self) -> int:
        return self._total("checks_skipped")

    @property
    def dtensor_wrong(self) -> int:
        return self._total("dtensor_wrong")

    @property
    def wrong_rules(self) -> tuple[SignatureComparison, ...]:
        return tuple(comparison for comparison in self.comparisons if comparison.wrong)

    def only_dtensor_reasons(self) -> dict[str, int]:
        """How many only-DTensor strategies each kind of reason explains (details in parentheses dropped)."""
        counts: dict[str, int] = defaultdict(int)
        for comparison in self.comparisons:
            for finding in comparison.only_dtensor:
                counts[finding.reason.split(" (", 1)[0]] += 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))


# ---------------------------------------------------------------------------- our side


def rule_strategies(rule: Rule) -> tuple[dict[Strategy, str], dict[Strategy, str]]:
    """Our rule as one-axis strategies: ``(comparable, not_comparable)``, each strategy -> the factor's text.

    Factors with block-cyclic (``chunk``) or overlapping (``halo``) outputs have no DTensor
    placement; they land in ``not_comparable``.
    """
    comparable: dict[Strategy, str] = {}
    other: dict[Strategy, str] = {}
    for factor in rule.factors:
        strategy, plain = factor_strategy(factor)
        (comparable if plain else other)[strategy] = str(strategy)
    for partial in rule.partial_passes:
        strategy = _pass_strategy(rule, partial)
        comparable[strategy] = f"pass {partial}"
    return comparable, other


def factor_strategy(factor: Factor) -> tuple[Strategy, bool]:
    inputs = tuple(
        f"S({dim})" if dim is not None else f"P({factor.partial_op})" if index in factor.partial_inputs else REPLICATE
        for index, dim in enumerate(factor.inputs)
    )
    outputs: list[str | None] = []
    plain = True
    for out in factor.outputs:
        if out is None:
            outputs.append(None)
        elif isinstance(out, Concat):
            plain = plain and out.chunk == 1 and out.halo == 0
            outputs.append(f"S({out.dim})" if out.chunk == 1 and out.halo == 0 else f"S({out.dim},chunk={out.chunk},halo={out.halo})")
        elif isinstance(out, Reduce):
            outputs.append(f"P({out.op})")
        else:
            outputs.append(REPLICATE)
    return Strategy(inputs, tuple(outputs)), plain


def _pass_strategy(rule: Rule, partial: PartialPass) -> Strategy:
    inputs = tuple(f"P({partial.op})" if index in partial.inputs else REPLICATE for index in range(len(rule.input_ranks)))
    outputs = tuple(None if rank is None else f"P({partial.op})" for rank in rule.output_ranks)
    return Strategy(inputs, outputs)


# ---------------------------------------------------------------------------- reports


def merge_reports(reports: Iterable[OracleReport]) -> OracleReport:
    """One report over several graphs; a signature shared by two graphs is counted once."""
    reports = list(reports)
    if not reports:
        raise OracleError("there are no reports to merge: verify at least one model")
    seen: dict[str, SignatureComparison] = {}
    for report in reports:
        for comparison in report.comparisons:
            seen.setdefault(comparison.signature, comparison)
    return report_of(
        tuple(model for report in reports for model in report.models),
        sum(report.nodes for report in reports),
        sum(report.nodes_with_rule for report in reports),
        reports[0].mesh_size,
        seen.values(),
    )


def report_of(models: tuple[str, ...], nodes: int, nodes_with_rule: int, mesh_size: int, comparisons: Iterable[SignatureComparison]) -> OracleReport:
    by_op: dict[str, list[SignatureComparison]] = defaultdict(list)
    for comparison in comparisons:
        by_op[comparison.op_target].append(comparison)
    ops = []
    for op_target in sorted(by_op):
        group = by_op[op_target]
        checks = [check for comparison in group for check in comparison.checks]
        examples: list[str] = []
        for comparison in group:
            examples += [f"wrong: {check.what} ({check.detail}, max error {check.max_abs_error:.3g})" for check in comparison.wrong]
            examples += [f"only ours: {finding.strategy} ({finding.reason})" for finding in comparison.only_ours]
            examples += [f"only DTensor: {finding.strategy} ({finding.reason})" for finding in comparison.only_dtensor]
        ops.append(
            OpReport(
                op_target=op_target,
                signatures=len(group),
                dtensor_registered=sum(comparison.dtensor == "registered" for comparison in group),
                agreements=sum(len(comparison.agreements) for comparison in group),
                only_ours=sum(len(comparison.only_ours) for comparison in group),
                only_dtensor=sum(len(comparison.only_dtensor) for comparison in group),
                checks_passed=sum(check.ok is True for check in checks),
                checks_failed=sum(check.ok is False for check in checks),
                checks_skipped=sum(check.ok is None for check in checks),
                dtensor_wrong=sum(len(comparison.dtensor_wrong) for comparison in group),
                examples=tuple(dict.fromkeys(examples))[:6],
            )
        )
    ordered = tuple(sorted(comparisons, key=lambda comparison: (comparison.op_target, comparison.signature)))
    return OracleReport(models, nodes, nodes_with_rule, mesh_size, tuple(ops), ordered)
