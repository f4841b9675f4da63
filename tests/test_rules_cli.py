"""`metadist rules ...`: discover, show, stats, export, verify, and their error paths (exit 2, one clear line)."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

from metadist.cli.main import main
from metadist.ir import parse_rule
from metadist.shardcombine.database import RuleDatabase

MM = parse_rule("ab,bc->ac | b:sum")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "rules.sqlite"


@pytest.fixture
def filled_db(db: Path) -> Path:
    with RuleDatabase(db) as store:
        store.put("aten.mm.default(T0, T1) :: float32[a,b] float32[b,c] -> float32/2", "torch", "2.13.0", MM, "aten.mm.default", discovery_seconds=0.5)
        store.put("aten.mm.out(T0, T1) :: float32[a,b] float32[b,c] -> float32/2", "torch", "2.13.0", MM, "aten.mm.out")
        store.put("aten.full.default([], 0.0) ::  -> float32/0", "torch", "2.13.0", "no tensor inputs: a factory", "aten.full.default")
    return db


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the CLI; stdout comes back with whitespace runs (rich's line wrapping) folded to one space."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, " ".join(captured.out.split()), " ".join(captured.err.split())


def test_show_prints_rules_in_factor_notation(filled_db: Path, capsys) -> None:
    code, out, _ = run(capsys, "rules", "show", "aten.mm.default", "--db", str(filled_db))
    assert code == 0
    assert "ab,bc->ac | b:sum" in out and "float32[a,b] float32[b,c]" in out  # [a,b] is not eaten as markup
    assert "aten.mm.out" not in out
    code, out, _ = run(capsys, "rules", "show", "mm", "--db", str(filled_db))  # short name: every overload
    assert code == 0 and "aten.mm.default" in out and "aten.mm.out" in out
    code, out, _ = run(capsys, "rules", "show", "aten.full", "--db", str(filled_db))
    assert code == 0 and "no rule: no tensor inputs" in out


def test_show_unknown_op_suggests_discover(filled_db: Path, capsys) -> None:
    code, out, err = run(capsys, "rules", "show", "aten.conv9d.default", "--db", str(filled_db))
    assert code == 2 and out == ""
    assert "no rules for op 'aten.conv9d.default'" in err and "metadist rules discover MODEL" in err
    assert "Traceback" not in err


def test_stats_counts_rules_and_reasons(filled_db: Path, capsys) -> None:
    code, out, _ = run(capsys, "rules", "stats", "--db", str(filled_db))
    assert code == 0
    assert "3 signatures, 2 with a rule, 1 without" in out
    assert "aten.full.default" in out and "2.13.0" in out


def test_stats_of_an_empty_database_says_how_to_fill_it(db: Path, capsys) -> None:
    code, out, _ = run(capsys, "rules", "stats", "--db", str(db))
    assert code == 0 and "0 signatures" in out and "metadist rules discover MODEL" in out


def test_export_writes_json(filled_db: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "out" / "rules.json"
    code, out, _ = run(capsys, "rules", "export", str(target), "--db", str(filled_db))
    assert code == 0 and "3 entries written" in out
    document = json.loads(target.read_text())
    assert document["format"] == "metadist-rule-db" and len(document["entries"]) == 3


@pytest.mark.parametrize("command", [["stats"], ["show", "mm"], ["export", "x.json"]])
def test_db_path_that_is_a_folder_is_a_clear_error(tmp_path: Path, capsys, command: list[str]) -> None:
    code, _, err = run(capsys, "rules", *command, "--db", str(tmp_path))
    assert code == 2 and "is a folder" in err and "rules.sqlite" in err


def test_export_to_a_folder_is_a_clear_error(filled_db: Path, tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, "rules", "export", str(tmp_path), "--db", str(filled_db))
    assert code == 2 and "is a folder" in err


def test_corrupt_database_is_set_aside_and_the_command_still_works(db: Path, capsys, caplog) -> None:
    db.write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.WARNING, logger="metadist.shardcombine.database"):
        code, out, _ = run(capsys, "rules", "stats", "--db", str(db))
    assert code == 0 and "0 signatures" in out
    assert len(list(db.parent.glob("rules.sqlite.corrupt-*"))) == 1 and "renamed it to" in caplog.text


def test_default_database_follows_metadist_cache_dir(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("METADIST_CACHE_DIR", str(tmp_path / "cache"))
    code, out, _ = run(capsys, "rules", "stats")
    assert code == 0 and str(tmp_path / "cache" / "rules.sqlite") in out


def test_unknown_model_is_a_clear_error(db: Path, capsys) -> None:
    code, _, err = run(capsys, "rules", "discover", "gpt9-tiny", "--db", str(db))
    assert code == 2 and "unknown built-in workload 'gpt9-tiny'" in err


def test_verify_mesh_size_must_be_at_least_two(db: Path, capsys) -> None:
    code, _, err = run(capsys, "rules", "verify", "mlp", "--mesh-size", "1", "--db", str(db))
    assert code == 2 and "--mesh-size must be at least 2" in err


SMALL_MODEL = textwrap.dedent(
    """
    import torch
    import metadist

    def workload():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        batch = (torch.randn(12, 8), torch.randn(12, 4))
        return metadist.Workload(
            model=model, batch=batch,
            loss_fn=lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        )
    """
)


def test_discover_then_reuse_then_show_and_verify(tmp_path: Path, db: Path, capsys) -> None:
    model = tmp_path / "small_model.py"
    model.write_text(SMALL_MODEL)
    code, out, _ = run(capsys, "rules", "discover", str(model), "--optimizer", "sgd", "--db", str(db))
    assert code == 0
    first = out
    assert "0 found in the database" in first and "newly discovered" in first and "have a rule" in first
    code, out, _ = run(capsys, "rules", "discover", str(model), "--optimizer", "sgd", "--db", str(db))
    second = out
    assert code == 0 and " 0 newly discovered" in second  # every signature now comes from the database
    code, out, _ = run(capsys, "rules", "show", "aten.mm.default", "--db", str(db))
    assert code == 0 and "b:sum" in out
    code, out, _ = run(capsys, "rules", "verify", str(model), "--db", str(db))
    text = out
    assert code == 0
    assert "agree with DTensor" in text and "execution re-check" in text and "per op" in text
    assert "aten.mm.default" in text and "0 failed" in text


def test_the_console_command_leaves_quickly_after_its_output_and_exit_handlers(filled_db: Path, tmp_path: Path) -> None:
    """``metadist`` (console_main) skips only the interpreter's module teardown: the output is whole, ``atexit``
    handlers run, a failure keeps its status."""
    import subprocess
    import sys

    script = ("import atexit, sys; atexit.register(lambda: print('exit handler ran', flush=True)); "
              "sys.argv = ['metadist', *sys.argv[1:]]; from metadist.cli.main import console_main; console_main(); "
              "print('not reached')")
    done = subprocess.run([sys.executable, "-c", script, "rules", "stats", "--db", str(filled_db)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "3" in done.stdout and done.stdout.rstrip().endswith("exit handler ran") and "not reached" not in done.stdout
    failed = subprocess.run([sys.executable, "-c", script, "rules", "stats", "--db", str(tmp_path)],  # a folder
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and "is a folder" in failed.stderr and "exit handler ran" in failed.stdout
