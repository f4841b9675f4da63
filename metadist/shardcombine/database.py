"""The persistent rule database: discovery runs once per op signature, not once per model.

One SQLite file (stdlib ``sqlite3``) holds, for every key

    (signature key, framework, framework version, MetaDist rule-format version)

the op target, either the discovered :class:`~metadist.ir.rule.Rule` (as JSON via
``Rule.to_dict``; nothing is pickled) or the reason the op has no rule, the discovery
time in seconds and when the row was written.

Several processes (the ranks of one job, several jobs) share the file: it runs in WAL
mode with a busy timeout, every write is one short ``INSERT OR REPLACE`` transaction,
and "database is locked" is retried with backoff. A ``meta`` table records the schema
version. At open, a file that is not a SQLite database, fails ``PRAGMA quick_check``,
or carries another schema version is renamed aside (``rules.sqlite.corrupt-<time>`` or
``rules.sqlite.foreign-<time>``, never deleted), a warning names the renamed file, and a
fresh database is built in its place.

The default location is ``Settings.rule_db_path`` (``METADIST_CACHE_DIR`` or the user's
cache folder, see :mod:`metadist.config`); the CLI's ``--db PATH`` overrides it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import random
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from ..ir.rule import RULE_FORMAT_VERSION, Rule, RuleError
from .errors import RuleDatabaseError

try:  # POSIX: serialise the open-time check-and-rebuild between processes
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DB_SCHEMA_VERSION",
    "EXPORT_FORMAT",
    "DatabaseStats",
    "FrameworkCount",
    "OpCount",
    "RuleDatabase",
    "StoredRule",
    "default_db_path",
]

logger = logging.getLogger(__name__)

DB_SCHEMA_VERSION = 1
"""Version of the table layout below; a file with another version is renamed aside and rebuilt."""

EXPORT_FORMAT = "metadist-rule-db"
"""The ``format`` field of :meth:`RuleDatabase.export_json` files."""

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


def default_db_path() -> Path:
    """The rule database's default path: ``METADIST_CACHE_DIR/rules.sqlite`` or the user cache folder."""
    from ..config import settings_from_env

    return settings_from_env().rule_db_path


@dataclass(frozen=True)
class StoredRule:
    """One row of the database: a rule, or the reason an op signature has none."""

    signature_key: str
    framework: str
    framework_version: str
    op_target: str
    rule: Rule | None
    """The discovered rule; ``None`` when :attr:`reason` is set."""
    reason: str | None
    """Why the op has no rule; ``None`` when :attr:`rule` is set."""
    discovery_seconds: float | None
    created_at: float
    """Unix time the row was written."""

    @property
    def created_iso(self) -> str:
        return _iso(self.created_at)


@dataclass(frozen=True)
class FrameworkCount:
    """Rows of one framework release."""

    framework: str
    framework_version: str
    rules: int
    reasons: int


@dataclass(frozen=True)
class OpCount:
    """Rows of one op target (all frameworks)."""

    op_target: str
    rules: int
    reasons: int


@dataclass(frozen=True)
class DatabaseStats:
    """What the database holds, for the current rule-format version."""

    path: str
    schema_version: int
    rule_format_version: int
    rules: int
    """Signatures with a rule."""
    reasons: int
    """Signatures recorded as having no rule."""
    stale_rows: int
    """Rows written under another rule-format version (ignored by :meth:`RuleDatabase.get`)."""
    discovery_seconds: float
    """Total discovery time of the rows counted."""
    by_framework: tuple[FrameworkCount, ...]
    by_op: tuple[OpCount, ...]

    @property
    def entries(self) -> int:
        return self.rules + self.reasons


class RuleDatabase:
    """The persistent, process-shared rule store (see the module docstring).

    ``RuleDatabase()`` opens the default path; ``RuleDatabase(path)`` an explicit one. Use it
    as a context manager, or call :meth:`close`. A connection is opened lazily and again after
    a ``fork``, so an instance may be created before worker processes start.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_db_path()
        self._connection: sqlite3.Connection | None = None
        self._pid = -1
        self._connect()

    # -- life cycle ----------------------------------------------------------
    def close(self) -> None:
        """Close the connection (a later call reopens it)."""
        if self._connection is not None and self._pid == os.getpid():
            self._connection.close()
        self._connection = None

    def __enter__(self) -> "RuleDatabase":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RuleDatabase({str(self.path)!r})"

    # -- the discovery interface ---------------------------------------------
    def get(self, signature_key: str, framework: str, framework_version: str) -> Rule | str | None:
        """The rule stored for a signature, the stored reason it has none (a ``str``), or ``None`` if unknown."""
        row = self._run(
            lambda db: db.execute(
                "SELECT rule_json, reason, op_target FROM rules WHERE signature_key = ? AND framework = ? "
                "AND framework_version = ? AND rule_format = ?",
                (signature_key, framework, framework_version, RULE_FORMAT_VERSION),
            ).fetchone()
        )
        if row is None:
            return None
        rule_json, reason, op_target = row
        if reason is not None:
            return str(reason)
        rule = _decode_rule(rule_json, signature_key, op_target)
        return rule

    def put(
        self,
        signature_key: str,
        framework: str,
        framework_version: str,
        rule_or_reason: Rule | str,
        op_target: str,
        discovery_seconds: float | None = None,
    ) -> None:
        """Store a rule (or the reason there is none) for a signature, replacing any earlier row."""
        if isinstance(rule_or_reason, Rule):
            rule_json, reason = json.dumps(rule_or_reason.to_dict(), sort_keys=True, separators=(",", ":")), None
        elif isinstance(rule_or_reason, str):
            rule_json, reason = None, rule_or_reason
        else:
            raise TypeError(f"put() stores a Rule or a reason string, got {type(rule_or_reason).__name__}")
        row = (
            signature_key,
            framework,
            framework_version,
            RULE_FORMAT_VERSION,
            op_target,
            rule_json,
            reason,
            None if discovery_seconds is None else float(discovery_seconds),
            time.time(),
        )
        self._write(lambda db: db.execute(_INSERT, row))

    # -- queries ---------------------------------------------------------------
    def entries(self, op_target: str | None = None) -> tuple[StoredRule, ...]:
        """Every row of the current rule format (or of one op target), ordered by op, framework, signature."""
        where, params = "rule_format = ?", [RULE_FORMAT_VERSION]
        if op_target is not None:
            where += " AND op_target = ?"
            params.append(op_target)  # type: ignore[arg-type]
        rows = self._run(
            lambda db: db.execute(
                "SELECT signature_key, framework, framework_version, op_target, rule_json, reason, "
                f"discovery_seconds, created_at FROM rules WHERE {where} "
                "ORDER BY op_target, framework, framework_version, signature_key",
                params,
            ).fetchall()
        )
        stored = []
        for key, framework, version, target, rule_json, reason, seconds, created in rows:
            rule = None if rule_json is None else _decode_rule(rule_json, key, target)
            if rule is None and reason is None:
                continue  # undecodable row, already warned about
            stored.append(StoredRule(key, framework, version, target, rule, reason, seconds, created))
        return tuple(stored)

    def rules_for_op(self, op_target: str) -> tuple[StoredRule, ...]:
        """The rows (rules and reasons) of one op target, e.g. ``"aten.mm.default"``."""
        return self.entries(op_target)

    def op_targets(self) -> tuple[str, ...]:
        """The distinct op targets with rows of the current rule format, sorted."""
        rows = self._run(
            lambda db: db.execute(
                "SELECT DISTINCT op_target FROM rules WHERE rule_format = ? ORDER BY op_target", (RULE_FORMAT_VERSION,)
            ).fetchall()
        )
        return tuple(row[0] for row in rows)

    def stats(self) -> DatabaseStats:
        """Counts by framework release and by op, rules versus reasons."""

        def query(db: sqlite3.Connection) -> tuple[list, list, int, float]:
            current = (RULE_FORMAT_VERSION,)
            frameworks = db.execute(
                "SELECT framework, framework_version, COUNT(rule_json), COUNT(reason) FROM rules "
                "WHERE rule_format = ? GROUP BY framework, framework_version ORDER BY framework, framework_version",
                current,
            ).fetchall()
            ops = db.execute(
                "SELECT op_target, COUNT(rule_json), COUNT(reason) FROM rules WHERE rule_format = ? "
                "GROUP BY op_target ORDER BY op_target",
                current,
            ).fetchall()
            stale = db.execute("SELECT COUNT(*) FROM rules WHERE rule_format <> ?", current).fetchone()[0]
            seconds = db.execute(
                "SELECT COALESCE(SUM(discovery_seconds), 0) FROM rules WHERE rule_format = ?", current
            ).fetchone()[0]
            return frameworks, ops, stale, seconds

        frameworks, ops, stale, seconds = self._run(query)
        return DatabaseStats(
            path=str(self.path),
            schema_version=DB_SCHEMA_VERSION,
            rule_format_version=RULE_FORMAT_VERSION,
            rules=sum(row[2] for row in frameworks),
            reasons=sum(row[3] for row in frameworks),
            stale_rows=int(stale),
            discovery_seconds=float(seconds),
            by_framework=tuple(FrameworkCount(*row) for row in frameworks),
            by_op=tuple(OpCount(*row) for row in ops),
        )

    # -- export / import -------------------------------------------------------
    def export_json(self, path: str | os.PathLike[str]) -> int:
        """Write every current-format row to ``path`` as JSON (atomically); returns the number of entries."""
        entries = self.entries()
        document = {
            "format": EXPORT_FORMAT,
            "schema_version": DB_SCHEMA_VERSION,
            "rule_format_version": RULE_FORMAT_VERSION,
            "exported_at": _iso(time.time()),
            "entries": [_entry_to_json(entry) for entry in entries],
        }
        _write_atomically(Path(path), json.dumps(document, indent=1, sort_keys=True) + "\n")
        logger.info("exported %d rule-database entries to %s", len(entries), path)
        return len(entries)

    def import_json(self, path: str | os.PathLike[str]) -> int:
        """Load entries written by :meth:`export_json` (replacing rows with the same key); returns the count."""
        source = Path(path)
        try:
            document = json.loads(source.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RuleDatabaseError(
                f"cannot import rules from {str(source)!r}: {err}; pass a file written by 'metadist rules export'"
            ) from err
        if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
            raise RuleDatabaseError(
                f"{str(source)!r} is not a MetaDist rule export (its 'format' field is not {EXPORT_FORMAT!r}); "
                "pass a file written by 'metadist rules export'"
            )
        if document.get("rule_format_version") != RULE_FORMAT_VERSION:
            raise RuleDatabaseError(
                f"{str(source)!r} holds rules in format version {document.get('rule_format_version')!r}, this MetaDist "
                f"reads version {RULE_FORMAT_VERSION}; re-export it with a matching MetaDist, or rediscover the rules"
            )
        try:
            rows = [_entry_from_json(entry) for entry in document["entries"]]
        except (KeyError, TypeError, ValueError) as err:
            raise RuleDatabaseError(f"{str(source)!r} has a malformed entry ({err}); re-export it") from err

        def insert_all(db: sqlite3.Connection) -> None:
            db.executemany(_INSERT, rows)

        self._write(insert_all)
        return len(rows)

    # -- connection, retries and recovery ---------------------------------------
    def _db(self) -> sqlite3.Connection:
        if self._connection is None or self._pid != os.getpid():
            self._connection = None  # a connection inherited through fork must not be used
            self._connect()
        assert self._connection is not None
        return self._connection

    def _run(self, operation: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run a read, retrying while another process holds a lock."""
        return _retry_locked(lambda: operation(self._db()), self.path)

    def _write(self, operation: Callable[[sqlite3.Connection], Any]) -> None:
        """Run ``operation`` in one short ``BEGIN IMMEDIATE`` transaction, retrying while locked."""

        def transaction() -> None:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                operation(db)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

        try:
            _retry_locked(transaction, self.path)
        except sqlite3.OperationalError as err:  # read-only file, disk full...
            raise RuleDatabaseError(
                f"cannot write the rule database {str(self.path)!r}: {err}; check that the file and its folder are "
                "writable and the disk has space, or pass another path with --db PATH (or METADIST_CACHE_DIR)"
            ) from err

    def _connect(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RuleDatabaseError(
                f"cannot create the folder {str(self.path.parent)!r} for the rule database: {err}; "
                "pass a writable path with --db PATH or set METADIST_CACHE_DIR"
            ) from err
        with _open_lock(self.path):
            problem = _retry_locked(lambda: _check_existing(self.path), self.path)
            if problem is not None:
                kind, why = problem
                _rename_aside(self.path, kind, why)
            self._connection = _open_connection(self.path)
            self._pid = os.getpid()
            _retry_locked(lambda: _initialise(self._connection), self.path)  # type: ignore[arg-type]


_INSERT = (
    "INSERT OR REPLACE INTO rules (signature_key, framework, framework_version, rule_format, op_target, "
    "rule_json, reason, discovery_seconds, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _open_connection(path: Path) -> sqlite3.Connection:
    try:
        connection = sqlite3.connect(str(path), timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    except sqlite3.OperationalError as err:
        raise RuleDatabaseError(
            f"cannot open the rule database {str(path)!r}: {err}; pass a writable path with --db PATH "
            "or set METADIST_CACHE_DIR"
        ) from err
    connection.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
    return connection


def _initialise(connection: sqlite3.Connection) -> None:
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
            (str(DB_SCHEMA_VERSION), _APPLICATION, _iso(time.time())),
        )
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def _check_existing(path: Path) -> tuple[str, str] | None:
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


def _rename_aside(path: Path, kind: str, why: str) -> Path:
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
def _open_lock(path: Path) -> Iterator[None]:
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


def _retry_locked(operation: Callable[[], _T], path: Path) -> _T:
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


def _decode_rule(rule_json: str, signature_key: str, op_target: str) -> Rule | None:
    try:
        return Rule.from_dict(json.loads(rule_json))
    except (json.JSONDecodeError, RuleError, KeyError, TypeError, ValueError) as err:
        logger.warning(
            "the rule database holds an unreadable rule for %s (signature %s): %s; treating it as unknown, "
            "discovery will overwrite it",
            op_target,
            signature_key,
            err,
        )
        return None


def _entry_to_json(entry: StoredRule) -> dict[str, Any]:
    return {
        "signature_key": entry.signature_key,
        "framework": entry.framework,
        "framework_version": entry.framework_version,
        "op_target": entry.op_target,
        "rule": None if entry.rule is None else entry.rule.to_dict(),
        "rule_text": None if entry.rule is None else entry.rule.to_text(),
        "reason": entry.reason,
        "discovery_seconds": entry.discovery_seconds,
        "created_at": entry.created_iso,
    }


def _entry_from_json(entry: dict[str, Any]) -> tuple:
    rule = entry.get("rule")
    reason = entry.get("reason")
    if (rule is None) == (reason is None):
        raise ValueError(f"entry {entry.get('signature_key')!r} must have exactly one of 'rule' and 'reason'")
    rule_json = None
    if rule is not None:
        rule_json = json.dumps(Rule.from_dict(rule).to_dict(), sort_keys=True, separators=(",", ":"))
    created = _dt.datetime.fromisoformat(entry["created_at"]).timestamp() if entry.get("created_at") else time.time()
    seconds = entry.get("discovery_seconds")
    return (
        str(entry["signature_key"]),
        str(entry["framework"]),
        str(entry["framework_version"]),
        RULE_FORMAT_VERSION,
        str(entry["op_target"]),
        rule_json,
        None if reason is None else str(reason),
        None if seconds is None else float(seconds),
        created,
    )


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file in ``path``'s folder, flush it to disk, then rename it over ``path``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise RuleDatabaseError(f"cannot write {str(path)!r}: {err}; choose a writable location") from err
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise RuleDatabaseError(f"cannot write {str(path)!r}: {err}; choose a writable location") from err
        raise


def _iso(timestamp: float) -> str:
    return _dt.datetime.fromtimestamp(timestamp, _dt.timezone.utc).isoformat(timespec="seconds")
