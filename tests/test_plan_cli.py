"""``metadist plan``: the table, the JSON, the budget error (captured built-in ``mlp``)."""

from __future__ import annotations

import pytest

from metadist.cli.main import main
from metadist.ir.plan import Plan


@pytest.fixture(scope="module")
def rules_db():
    from metadist.shardcombine.database import default_db_path

    return str(default_db_path())  # discovery runs once per machine, not once per test run


def test_plan_prints_parameters_estimate_and_writes_json(tmp_path, rules_db, capsys):
    out = tmp_path / "plan.json"
    status = main(["plan", "mlp", "--mesh", "2x2", "--cluster", "a100x8", "--rules-db", rules_db, "--json", str(out),
                   "--explain", "addmm"])
    text = capsys.readouterr().out
    assert status == 0
    assert "parameters of mlp" in text and "step time" in text and "solver: solver=ilp" in text
    assert "addmm: chose" in text or "single strategy" in text
    plan = Plan.from_json(out.read_text())
    assert plan.mesh.shape == (2, 2) and plan.estimate["step_s"] > 0
    assert plan.solver["explain"]  # a plan file explains itself (without --json or --explain none is worked out)


def test_infeasible_budget_is_a_clear_user_error(rules_db, capsys):
    status = main(["plan", "mlp", "--mesh", "4", "--memory-gb", "0.00001", "--rules-db", rules_db])
    err = capsys.readouterr().err
    assert status == 2
    assert "no plan fits the memory budget" in err and "Raise --memory-gb to at least" in err


def test_unknown_cluster_is_a_clear_user_error(capsys):
    assert main(["plan", "mlp", "--mesh", "4", "--cluster", "nowhere"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_parameters_of_layers_sharded_alike_share_a_row():
    from metadist.cli.plan import layer_rows

    alike, other = ("f32[8, 8]", "(R, S(0))", ""), ("f32[8, 8]", "(S(0), R)", "")
    rows = [("embed.weight", alike)]
    for layer in range(6):
        rows += [(f"model.layers.{layer}.attn.weight", other if layer == 4 else alike),
                 (f"model.layers.{layer}.norm.weight", alike)]
    rows += [("blocks.0.sub.3.weight", alike), ("head.weight", alike)]
    assert layer_rows(rows) == [
        ("embed.weight", alike),
        ("model.layers.{0-3,5}.attn.weight", alike),
        ("model.layers.{0-5}.norm.weight", alike),
        ("model.layers.4.attn.weight", other),  # a layer sharded otherwise: a row of its own, where it first comes
        ("blocks.0.sub.3.weight", alike),  # one numbered name: as it is
        ("head.weight", alike),
    ]
