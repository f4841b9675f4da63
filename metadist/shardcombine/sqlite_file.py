"""The SQLite file under the rule database: opening, schema, health checks, locking, atomic writes.

:class:`~metadist.shardcombine.database.RuleDatabase` holds the rules; this
module keeps the file safe to share: WAL mode and a busy timeout, a schema
version in a ``meta`` table, an advisory lock while one process checks and
rebuilds, unusable files renamed aside (never deleted), "database is locked"
retried with backoff, and exports written to a temporary file then renamed.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import random
import sqlite3
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from .. import files
from .errors import RuleDatabaseError

try:  # POSIX: serialise the open-time check-and-rebuild between processes
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DB_SCHEMA_VERSION",
    "check_existing",
    "initialise",
    "iso",
    "open_connection",
    "open_lock",
    "rename_aside",
    "retry_locked",
    "write_atomically",
]

logger = logging.getLogger("metadist.shardcombine.database")

DB_SCHEMA_VERSION = 1
"""Version of the table layout below; a file with another version is renamed aside and rebuilt."""

_APPLICATION = "metadist-rules"
_BUSY_TIMEOUT_MS = 30_000
_LOCK_RETRY_SECONDS = 120.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rules (
    signature_key     TEXT    NOT NULL,
    framework         TEXT    NOT NULL,
    framework_version TEXT    NOT NULL,
    rule_format       INTEGER NOT NULL,
    op_target         TEXT    NOT NULL,
    rule_json         TEXT,
    reason            TEXT,
    discovery_seconds REAL,
    created_at        REAL    NOT NULL,
    PRIMARY KEY (signature_key, framework, framework_version, rule_format),
    CHECK ((rule_json IS NULL) <> (reason IS NULL))
);
CREATE INDEX IF NOT EXISTS rules_by_op ON rules (op_target);
"""

_T = TypeVar("_T")



def open_connection(path: Path) -> sqlite3.Connection:
    try:
        connection = sqlite3.connect(str(path), timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    except sqlite3.OperationalError as err:
        raise RuleDatabaseError(
            f"cannot open the rule database {str(path)!r}: {err}; pass a writable path with --db PATH "
            "or set METADIST_CACHE_DIR"
        ) from err
    connection.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
    return connection


def initialise(connection: sqlite3.Connection) -> None:
    mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        logger.warning("the rule database could not switch to WAL mode (it is in %s mode); concurrent use is slower", mode)
    connection.execute("PRAGMA synchronous = NORMAL")
    connection.execute("BEGIN IMMEDIATE")
    try:
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                connection.execute(statement)
        connection.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?), ('application', ?), ('created_at', ?)",
            (str(DB_SCHEMA_VERSION), _APPLICATION, iso(time.time())),
        )
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def check_existing(path: Path) -> tuple[str, str] | None:
    """``None`` if ``path`` is absent, empty, or a healthy database of ours; else (kind, why) to rename it aside."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    connection = None
    try:
        connection = sqlite3.connect(str(path), timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        connection.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        check = connection.execute("PRAGMA quick_check").fetchall()
        if [row[0] for row in check] != ["ok"]:
            return "corrupt", "PRAGMA quick_check reports: " + "; ".join(str(row[0]) for row in check[:5])
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return None  # an empty database: initialise it
        if "meta" not in tables:
            return "foreign", f"it has tables {sorted(tables)} but no MetaDist 'meta' table"
        meta = dict(connection.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("application") != _APPLICATION or meta.get("schema_version") != str(DB_SCHEMA_VERSION):
            return "foreign", (
                f"its schema is {meta.get('application')!r} version {meta.get('schema_version')!r}, "
                f"this MetaDist uses {_APPLICATION!r} version {DB_SCHEMA_VERSION}"
            )
        return None
    except sqlite3.DatabaseError as err:  # "file is not a database", "database disk image is malformed"
        if _is_locked(err):
            raise
        return "corrupt", f"SQLite cannot read it: {err}"
    finally:
        if connection is not None:
            connection.close()


def rename_aside(path: Path, kind: str, why: str) -> Path:
    """Move a bad database (and its WAL sidecars) to ``<name>.<kind>-<time>``; never deletes."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside = path.with_name(f"{path.name}.{kind}-{stamp}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return aside  # another process moved it first
    except OSError as err:
        raise RuleDatabaseError(
            f"the rule database {str(path)!r} is unusable ({why}) and cannot be renamed aside: {err}; "
            "move or delete it by hand, or pass another path with --db PATH"
        ) from err
    for suffix in ("-wal", "-shm"):
        sidecar = path.with_name(path.name + suffix)
        with contextlib.suppress(FileNotFoundError):
            os.replace(sidecar, aside.with_name(aside.name + suffix))
    logger.warning(
        "the rule database %s is %s (%s); renamed it to %s and started an empty one (rules will be rediscovered)",
        path,
        "corrupt" if kind == "corrupt" else "from another schema",
        why,
        aside,
    )
    return aside


@contextlib.contextmanager
def open_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``<db>.lock`` while one process checks, renames and initialises."""
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    lock_path = path.with_name(path.name + ".lock")
    try:
        handle = open(lock_path, "a")
    except OSError as err:
        raise RuleDatabaseError(
            f"cannot create the lock file {str(lock_path)!r} next to the rule database: {err}; "
            "pass a writable path with --db PATH or set METADIST_CACHE_DIR"
        ) from err
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _is_locked(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def retry_locked(operation: Callable[[], _T], path: Path) -> _T:
    """Run ``operation``; on "database is locked"/"busy" wait with jittered backoff and try again."""
    deadline = time.monotonic() + _LOCK_RETRY_SECONDS
    delay = 0.005
    attempts = 0
    while True:
        try:
            return operation()
        except sqlite3.OperationalError as err:
            attempts += 1
            if not _is_locked(err):
                raise
            if time.monotonic() > deadline:
                raise RuleDatabaseError(
                    f"the rule database {str(path)!r} stayed locked for {_LOCK_RETRY_SECONDS:.0f} s "
                    f"({attempts} attempts): {err}; another process may hold a long transaction; retry, "
                    "or pass a separate path with --db PATH"
                ) from err
            logger.debug("rule database %s is locked (attempt %d); retrying in %.3f s", path, attempts, delay)
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 0.5)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all (:func:`metadist.files.write_atomically`, flushed to disk before the rename);
    a file system error is the rule database's error, naming the path."""
    try:
        files.write_atomically(path, text)
    except OSError as err:
        raise RuleDatabaseError(f"cannot write {str(path)!r}: {err}; choose a writable location") from err


def iso(timestamp: float) -> str:
    return _dt.datetime.fromtimestamp(timestamp, _dt.timezone.utc).isoformat(timespec="seconds")
