"""What a run prints (rank 0 only): the plan, each step, bytes per collective, the check."""

from __future__ import annotations

from collections import Counter
from typing import Mapping

from rich.console import Console
from rich.table import Table

from ..cli.common import human_bytes
from ..cost.comm import backend_reduce_scatters_as_all_reduce, carried_bytes
from ..ir import format_sharding
from ..ir.plan import Plan
from ..lowering import CoalescedReshard, RankProgram
from .check import describe_tolerance
from .summary import largest

__all__ = ["Reporter"]


class Reporter:
    """Prints with rich on one rank; does nothing on the others."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.console = Console(stderr=False)

    def note(self, text: str) -> None:
        """A remark the user should see (rank 0 only)."""
        if self.enabled:
            self.console.print(f"note: {text}")

    def plan(self, plan: Plan, plan_hash: str, program: RankProgram) -> None:
        if not self.enabled:
            return
        kinds = Counter(
            "+".join(sorted({choice.kind for choice in strategy.choices})) for strategy in plan.node_strategies.values()
        )
        self.console.print(
            f"[bold]plan[/bold] {plan_hash} for {plan.graph_name!r} on mesh {plan.mesh} "
            f"(source: {plan.solver.get('kind', 'solver')}): {len(plan.node_strategies)} nodes, "
            + ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
        )
        shardings = Counter(format_sharding(s) for s in plan.input_shardings.values())
        self.console.print("input shardings: " + ", ".join(f"{text} x{count}" for text, count in shardings.most_common()))
        calls = sum(count for count, _ in program.predicted_comm().values())
        buckets = sum(1 for item in program.instructions if isinstance(item, CoalescedReshard))
        if plan.recompute:
            self.console.print(f"recompute: layers {', '.join(map(str, plan.recompute))} run their forward again before "
                               "their backward (chosen by the solver to fit the memory budget)")
        self.console.print(f"rank program: {len(program.instructions)} instructions, {len(program.reshards())} reshards, "
                           f"{calls} collective calls per step ({buckets} coalesced)")
        if plan.solver.get("kind", "solver") == "solver" and plan.mesh.size > 1 and not calls and kinds.keys() <= {"replicate"}:
            step_s = plan.estimate.get("step_s")
            self.note(f"the solver's plan runs the whole step on every rank, with no collectives: on cluster "
                      f"{plan.estimate.get('cluster', '?')!r} it predicts that splitting a step this small costs more in "
                      "collectives than it saves" + (f" ({step_s * 1e3:.1f} ms a step this way)" if step_s else "")
                      + "; --plan dp runs data parallelism instead, --cluster FILE plans for another machine")
        self.unruled(plan)

    def unruled(self, plan: Plan) -> None:
        """The ops without a rule: they run replicated; list them with their reason and estimated cost."""
        unruled = plan.solver.get("nodes_without_rule", {})
        if not unruled:
            return
        groups: dict[tuple[str, str], list[float]] = {}
        for item in unruled.values():
            groups.setdefault((item.get("op", "?"), item["reason"]), []).append(item["compute_s"])
        table = Table(title=f"{len(unruled)} node(s) without a rule run replicated")
        for column in ("op", "nodes", "estimated compute", "reason"):
            table.add_column(column, justify="right" if column in ("nodes", "estimated compute") else "left")
        for (op, reason), seconds in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
            table.add_row(op, str(len(seconds)), f"{sum(seconds) * 1e6:.1f} us", reason)
        self.console.print(table)

    def step(self, step: int, loss: float, seconds: float) -> None:
        if self.enabled:
            self.console.print(f"step {step}: loss {loss:.6f}  ({seconds * 1e3:.1f} ms)")

    def comm(self, records: Mapping, predicted: Mapping, steps: int) -> None:
        if not self.enabled:
            return
        table = Table(title=f"collectives per rank over {steps} step(s): measured vs predicted")
        for column in ("phase", "collective", "axis", "count", "measured bytes", "predicted bytes"):
            table.add_column(column, justify="right" if column not in ("phase", "collective") else "left")
        keys = sorted({(phase, kind, axis) for phase, kind, axis in records} | {("step", k, a) for k, a in predicted})
        for phase, kind, axis in keys:
            record = records.get((phase, kind, axis))
            count, nbytes = (record.count, record.bytes) if record else (0, 0)
            want = predicted.get((kind, axis)) if phase == "step" else None
            table.add_row(phase, kind, str(axis), str(count), human_bytes(nbytes),
                          "-" if want is None else human_bytes(want[1] * steps))
        if not keys:
            table.add_row("step", "(none)", "-", "0", "0 B", "0 B")
        self.console.print(table)

    def solver_estimate(self, plan: Plan, records: Mapping, steps: int, backend: str) -> None:
        """The solver's per-axis byte estimate next to what ran (the cost model's check).

        The solver counts the bytes the ``backend`` sends (:func:`metadist.cost.comm.carried_bytes`: on gloo a
        reduce-scatter sends an all-reduce's); the records keep each collective's own ring bytes, and the measured side
        is counted as the solver counts."""
        estimated = plan.estimate.get("comm_bytes_by_axis") if self.enabled else None
        if not estimated:
            return
        as_all_reduce = backend_reduce_scatters_as_all_reduce(backend)
        measured = {name: 0.0 for name in plan.mesh.axis_names}
        for (phase, kind, axis), record in records.items():
            if phase == "step":
                measured[plan.mesh.axis_names[axis]] += carried_bytes(kind, record.bytes, as_all_reduce)
        parts = [f"{name}: measured {human_bytes(measured.get(name, 0) / steps)}, solver {human_bytes(float(value))}"
                 for name, value in estimated.items()]
        self.console.print("bytes per step by axis (solver's estimate): " + "; ".join(parts))

    def check(self, report) -> None:
        if not self.enabled:
            return
        worst = report.worst()
        by_kind: dict[str, tuple[float, float]] = {}
        for d in report.differences:
            kind = d.name.split(":")[0].split("[")[0]
            old = by_kind.get(kind, (0.0, 0.0))
            by_kind[kind] = (largest((old[0], d.max_abs)), largest((old[1], d.max_rel)))  # a NaN shows
        table = Table(title=f"check against one device ({describe_tolerance(report.tolerance)})")
        for column in ("what", "max abs diff", "max rel diff"):
            table.add_column(column)
        for kind, (max_abs, max_rel) in by_kind.items():
            table.add_row(kind, f"{max_abs:.3g}", f"{max_rel:.3g}")
        self.console.print(table)
        verdict = "[green]PASS[/green]" if report.ok else f"[red]FAIL[/red] (worst: {worst.name})"
        excused = [d for d in report.differences if d.excused]
        note = ""
        if excused:
            note = (f"; {sum(d.excused for d in excused)} noise-dominated parameter element(s) excused in "
                    f"{', '.join(d.name for d in excused[:3])}")
        self.console.print(f"check: {verdict} over {len(report.differences)} tensors{note}")
