"""The oracle over every op of the built-in workloads' steps: no rule of ours is shown wrong.

Each tiny built-in's step (with AdamW, and SGD for the ones whose ops differ)
is captured, its rules discovered (or read from the session's rule database, as
in real use), and every distinct signature compared with
DTensor's registered strategies and re-checked by execution on fresh shapes
(metadist.shardcombine.oracle). A rule the re-check shows wrong fails the test.
"""

from __future__ import annotations

import pytest

from metadist.frontends.torch import capture_step
from metadist.frontends.torch.discovery import TorchExecutor
from metadist.shardcombine.api import graph_rules
from metadist.shardcombine.database import RuleDatabase, default_db_path
from metadist.shardcombine.oracle import DTensorOracle, merge_reports, verify_graph
from metadist.workloads import builtin_workload

STEPS = [("mlp", "adamw"), ("cnn", "adamw"), ("cnn", "sgd"), ("gpt2-tiny", "adamw"), ("llama-tiny", "adamw"),
         ("bert-tiny", "adamw"), ("bert-tiny", "sgd")]


@pytest.mark.slow
def test_no_rule_of_the_builtin_steps_is_shown_wrong():
    executor = TorchExecutor()
    reports = []
    # the session's rule database (conftest): a signature the steps share, or an earlier test discovered, is
    # discovered once, as in real use (7 steps without it: 20 s of CPU in discovery; sharing among them alone: 10 s)
    with DTensorOracle(mesh_size=2) as oracle, RuleDatabase(default_db_path()) as db:
        for name, optimizer in STEPS:
            workload = builtin_workload(name, optimizer=optimizer)
            opt = workload.optimizer(workload.model.parameters())
            graph = capture_step(workload.train_step(), workload.model, opt, workload.batch, name=name).graph
            rules = graph_rules(graph, executor, db=db).rules
            reports.append(verify_graph(graph, rules, oracle, executor, model=f"{name}/{optimizer}"))
    report = merge_reports(reports)
    wrong = [f"{comparison.signature}: {[check.what for check in comparison.wrong]}" for comparison in report.wrong_rules]
    assert not wrong, "rules shown wrong by the execution re-check:\n" + "\n".join(wrong)
    assert report.signatures > 250 and report.agreements > 500  # the comparison covered the steps' ops
