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

import datetime as _dt
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..ir.rule import RULE_FORMAT_VERSION, Rule, RuleError
from .errors import RuleDatabaseError
from .sqlite_file import (
    DB_SCHEMA_VERSION,
    check_existing,
    initialise,
    iso,
    open_connection,
    open_lock,
    rename_aside,
    retry_locked,
    write_atomically,
)

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

_T = TypeVar("_T")

EXPORT_FORMAT = "metadist-rule-db"
"""The ``format`` field of :meth:`RuleDatabase.export_json` files."""

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
        return iso(self.created_at)


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
            "exported_at": iso(time.time()),
            "entries": [_entry_to_json(entry) for entry in entries],
        }
        write_atomically(Path(path), json.dumps(document, indent=1, sort_keys=True) + "\n")
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
        return retry_locked(lambda: operation(self._db()), self.path)

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
            retry_locked(transaction, self.path)
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
        with open_lock(self.path):
            problem = retry_locked(lambda: check_existing(self.path), self.path)
            if problem is not None:
                kind, why = problem
                rename_aside(self.path, kind, why)
            self._connection = open_connection(self.path)
            self._pid = os.getpid()
            retry_locked(lambda: initialise(self._connection), self.path)  # type: ignore[arg-type]


_INSERT = (
    "INSERT OR REPLACE INTO rules (signature_key, framework, framework_version, rule_format, op_target, "
    "rule_json, reason, discovery_seconds, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


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


