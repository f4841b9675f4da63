"""The persistent rule database (metadist.shardcombine.database): storage, sharing, recovery, export."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sqlite3
from pathlib import Path

import pytest

from metadist.config import CACHE_DIR_ENV, settings_from_env
from metadist.ir import RULE_FORMAT_VERSION, parse_rule
from metadist.shardcombine.database import DB_SCHEMA_VERSION, EXPORT_FORMAT, RuleDatabase, default_db_path
from metadist.shardcombine.errors import RuleDatabaseError

MM = parse_rule("ab,bc->ac | b:sum")
ADD = parse_rule("ab,ab->ab | pass 0:sum")
LAYER_NORM = parse_rule("a_,_,_->a_,a_,a_")


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "rules.sqlite"


def test_round_trip_rules_reasons_and_unknown(db_path: Path) -> None:
    with RuleDatabase(db_path) as db:
        db.put("mm[f32(8,6),f32(6,4)]", "torch", "2.13.0", MM, "aten.mm.default", discovery_seconds=0.25)
        db.put("rand[f32(8)]", "torch", "2.13.0", "draws random numbers", "aten.rand.default")
        assert db.get("mm[f32(8,6),f32(6,4)]", "torch", "2.13.0") == MM
        assert db.get("rand[f32(8)]", "torch", "2.13.0") == "draws random numbers"
        assert db.get("mm[f32(8,6),f32(6,4)]", "torch", "2.14.0") is None  # another release: rediscover
        assert db.get("never-seen", "torch", "2.13.0") is None
    # a second open (a later process) sees the same rows
    with RuleDatabase(db_path) as db:
        stored = db.rules_for_op("aten.mm.default")
        assert len(stored) == 1 and stored[0].rule == MM and stored[0].reason is None
        assert stored[0].discovery_seconds == pytest.approx(0.25)
        assert db.op_targets() == ("aten.mm.default", "aten.rand.default")


def test_put_replaces_and_keys_include_framework_version(db_path: Path) -> None:
    with RuleDatabase(db_path) as db:
        db.put("k", "torch", "2.13.0", "not yet understood", "aten.add.Tensor")
        db.put("k", "torch", "2.13.0", ADD, "aten.add.Tensor")  # rediscovered: replaces the reason
        db.put("k", "torch", "2.14.0", "no rule in this release", "aten.add.Tensor")
        assert db.get("k", "torch", "2.13.0") == ADD
        assert db.get("k", "torch", "2.14.0") == "no rule in this release"
        stats = db.stats()
    assert (stats.rules, stats.reasons, stats.entries) == (1, 1, 2)
    assert [(c.framework_version, c.rules, c.reasons) for c in stats.by_framework] == [("2.13.0", 1, 0), ("2.14.0", 0, 1)]
    assert [(c.op_target, c.rules, c.reasons) for c in stats.by_op] == [("aten.add.Tensor", 1, 1)]
    assert stats.schema_version == DB_SCHEMA_VERSION and stats.rule_format_version == RULE_FORMAT_VERSION


def test_rows_of_another_rule_format_are_ignored_and_counted_stale(db_path: Path) -> None:
    with RuleDatabase(db_path) as db:
        db.put("k", "torch", "2.13.0", MM, "aten.mm.default")
    with sqlite3.connect(db_path) as raw:
        raw.execute(
            "INSERT INTO rules VALUES ('old', 'torch', '2.13.0', ?, 'aten.mm.default', '{}', NULL, NULL, 0)",
            (RULE_FORMAT_VERSION + 1,),
        )
    raw.close()
    with RuleDatabase(db_path) as db:
        assert db.get("old", "torch", "2.13.0") is None
        stats = db.stats()
        assert (stats.rules, stats.stale_rows) == (1, 1)


def test_unreadable_stored_rule_reads_as_unknown_with_a_warning(db_path: Path, caplog) -> None:
    with RuleDatabase(db_path) as db:
        db.put("k", "torch", "2.13.0", MM, "aten.mm.default")
    raw = sqlite3.connect(db_path)
    with raw:
        raw.execute("UPDATE rules SET rule_json = '{\"factors\": 3}'")
    raw.close()
    with RuleDatabase(db_path) as db, caplog.at_level(logging.WARNING):
        assert db.get("k", "torch", "2.13.0") is None
    assert "unreadable rule for aten.mm.default" in caplog.text


def test_put_rejects_other_values(db_path: Path) -> None:
    with RuleDatabase(db_path) as db, pytest.raises(TypeError, match="Rule or a reason string"):
        db.put("k", "torch", "2.13.0", 42, "aten.mm.default")  # type: ignore[arg-type]


def test_no_pickle_rules_are_json(db_path: Path) -> None:
    with RuleDatabase(db_path) as db:
        db.put("k", "torch", "2.13.0", LAYER_NORM, "aten.native_layer_norm.default")
    raw = sqlite3.connect(db_path)
    (text,) = raw.execute("SELECT rule_json FROM rules").fetchone()
    raw.close()
    assert json.loads(text) == LAYER_NORM.to_dict()


# -- the default location -----------------------------------------------------------


def test_cache_dir_environment_variable_is_honoured(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mycache"))
    assert default_db_path() == tmp_path / "mycache" / "rules.sqlite"
    with RuleDatabase() as db:
        db.put("k", "torch", "2.13.0", MM, "aten.mm.default")
    assert (tmp_path / "mycache" / "rules.sqlite").is_file()


def test_settings_default_to_the_user_cache_dir() -> None:
    import platformdirs

    assert settings_from_env({}).cache_dir == Path(platformdirs.user_cache_dir("metadist"))
    assert settings_from_env({CACHE_DIR_ENV: "/x/y"}).rule_db_path == Path("/x/y/rules.sqlite")


def test_unwritable_folder_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(RuleDatabaseError, match="--db PATH"):
        RuleDatabase(blocker / "rules.sqlite")


# -- corruption and foreign schemas ---------------------------------------------------


def _aside_files(db_path: Path, kind: str) -> list[Path]:
    return sorted(db_path.parent.glob(f"{db_path.name}.{kind}-*"))


def _assert_usable(db_path: Path) -> None:
    with RuleDatabase(db_path) as db:
        assert db.stats().entries == 0
        db.put("k", "torch", "2.13.0", MM, "aten.mm.default")
        assert db.get("k", "torch", "2.13.0") == MM


def test_garbage_file_is_renamed_aside_and_rebuilt(db_path: Path, caplog) -> None:
    db_path.parent.mkdir(parents=True)
    garbage = bytes(range(256)) * 40
    db_path.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="metadist.shardcombine.database"):
        _assert_usable(db_path)
    (aside,) = _aside_files(db_path, "corrupt")
    assert aside.read_bytes() == garbage  # kept, never deleted
    assert str(aside) in caplog.text and "corrupt" in caplog.text


def test_damaged_pages_fail_quick_check_and_are_renamed_aside(db_path: Path, caplog) -> None:
    with RuleDatabase(db_path) as db:
        for index in range(300):
            db.put(f"key-{index}", "torch", "2.13.0", MM, f"aten.op{index % 7}.default")
    raw = sqlite3.connect(db_path)
    (root_page,) = raw.execute("SELECT rootpage FROM sqlite_master WHERE name = 'rules'").fetchone()
    (page_size,) = raw.execute("PRAGMA page_size").fetchone()
    raw.close()
    data = bytearray(db_path.read_bytes())
    start = (root_page - 1) * page_size  # scribble over the rules table's root b-tree page
    data[start : start + 200] = b"\xa5" * 200
    db_path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="metadist.shardcombine.database"):
        _assert_usable(db_path)
    assert len(_aside_files(db_path, "corrupt")) == 1
    assert "renamed it to" in caplog.text


@pytest.mark.parametrize(
    "tamper",
    [
        "UPDATE meta SET value = '999' WHERE key = 'schema_version'",
        "DROP TABLE meta",
    ],
    ids=["newer-schema-version", "no-meta-table"],
)
def test_foreign_schema_is_renamed_aside_and_rebuilt(db_path: Path, caplog, tamper: str) -> None:
    with RuleDatabase(db_path) as db:
        db.put("k", "torch", "2.13.0", MM, "aten.mm.default")
    raw = sqlite3.connect(db_path)
    with raw:
        raw.execute(tamper)
    raw.close()
    with caplog.at_level(logging.WARNING, logger="metadist.shardcombine.database"):
        _assert_usable(db_path)
    (aside,) = _aside_files(db_path, "foreign")
    assert str(aside) in caplog.text and "another schema" in caplog.text
    raw = sqlite3.connect(aside)  # the old rows are still there to recover by hand
    assert raw.execute("SELECT COUNT(*) FROM rules").fetchone() == (1,)
    raw.close()


def test_empty_file_is_initialised_in_place(db_path: Path, caplog) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.touch()
    with caplog.at_level(logging.WARNING):
        _assert_usable(db_path)
    assert not _aside_files(db_path, "corrupt") and "renamed" not in caplog.text


# -- export / import ------------------------------------------------------------------


def test_export_writes_valid_json_and_imports_back(db_path: Path, tmp_path: Path) -> None:
    with RuleDatabase(db_path) as db:
        db.put("mm-key", "torch", "2.13.0", MM, "aten.mm.default", discovery_seconds=1.5)
        db.put("rand-key", "torch", "2.13.0", "draws random numbers", "aten.rand.default")
        count = db.export_json(tmp_path / "out" / "rules.json")
    assert count == 2
    document = json.loads((tmp_path / "out" / "rules.json").read_text())
    assert document["format"] == EXPORT_FORMAT and document["rule_format_version"] == RULE_FORMAT_VERSION
    by_key = {entry["signature_key"]: entry for entry in document["entries"]}
    assert by_key["mm-key"]["rule_text"] == "ab,bc->ac | b:sum" and by_key["mm-key"]["reason"] is None
    assert by_key["rand-key"]["rule"] is None and by_key["rand-key"]["reason"] == "draws random numbers"
    with RuleDatabase(tmp_path / "other.sqlite") as other:
        assert other.import_json(tmp_path / "out" / "rules.json") == 2
        assert other.get("mm-key", "torch", "2.13.0") == MM
        assert other.get("rand-key", "torch", "2.13.0") == "draws random numbers"


def test_export_is_atomic(db_path: Path, tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "rules.json"
    target.write_text("previous export\n")
    with RuleDatabase(db_path) as db:
        db.put("k", "torch", "2.13.0", MM, "aten.mm.default")

        def failing_replace(src, dst):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", failing_replace)
        with pytest.raises(RuleDatabaseError, match="cannot write"):
            db.export_json(target)
    assert target.read_text() == "previous export\n"  # untouched
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".rules.json")] == []  # no temp left


def test_import_rejects_files_that_are_not_exports(db_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with RuleDatabase(db_path) as db:
        with pytest.raises(RuleDatabaseError, match="not a MetaDist rule export"):
            db.import_json(bad)
        with pytest.raises(RuleDatabaseError, match="metadist rules export"):
            db.import_json(tmp_path / "missing.json")


# -- several processes at once ----------------------------------------------------------

WORKERS = 4
ROWS_PER_WORKER = 120
SHARED_KEYS = 20


def _worker(path: str, worker: int, queue) -> None:
    """Write private and shared rows, reading each back at once; report errors through ``queue``."""
    try:
        with RuleDatabase(path) as db:
            for index in range(ROWS_PER_WORKER):
                key = f"w{worker}-{index}"
                db.put(key, "torch", "2.13.0", MM if index % 3 else f"reason {key}", f"aten.op{index % 5}.default")
                stored = db.get(key, "torch", "2.13.0")
                assert stored == (MM if index % 3 else f"reason {key}"), (key, stored)
                shared = f"shared-{index % SHARED_KEYS}"
                db.put(shared, "torch", "2.13.0", ADD, "aten.add.Tensor")
                assert db.get(shared, "torch", "2.13.0") == ADD
                if index % 40 == 0:
                    db.stats()
        queue.put((worker, None))
    except BaseException as err:  # reported to the parent, which fails the test with it
        queue.put((worker, f"{type(err).__name__}: {err}"))


def test_processes_write_and_read_concurrently_without_errors_or_lost_rows(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(str(path), worker, queue)) for worker in range(WORKERS)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert results == {worker: None for worker in range(WORKERS)}
    assert all(process.exitcode == 0 for process in processes)
    with RuleDatabase(path) as db:
        stats = db.stats()
        assert stats.entries == WORKERS * ROWS_PER_WORKER + SHARED_KEYS
        for worker in range(WORKERS):
            for index in range(ROWS_PER_WORKER):
                assert db.get(f"w{worker}-{index}", "torch", "2.13.0") is not None
