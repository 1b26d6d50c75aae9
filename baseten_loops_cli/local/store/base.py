"""The plumbing every table of the store shares (see the package's docstring for the design):
one connection per thread, nested transactions, row decoding, fresh ids, the statuses' names."""

from __future__ import annotations

import json
import secrets
import sqlite3
import string
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, TypeVar

SCHEMA_VERSION = 1

_BASE36 = string.digits + string.ascii_lowercase
_ALNUM = string.digits + string.ascii_letters

# Run statuses (LoopsRunStatus).
RUN_ACTIVE = "ACTIVE"
RUN_INACTIVE = "INACTIVE"

# Trainer deployment statuses (LoopsDeploymentStatus). "Live" = CREATED, DEPLOYING, RUNNING.
DEPLOY_CREATED = "CREATED"
DEPLOY_DEPLOYING = "DEPLOYING"
DEPLOY_RUNNING = "RUNNING"
DEPLOY_SCALED_TO_ZERO = "SCALED_TO_ZERO"
DEPLOY_FAILED = "FAILED"
DEPLOY_STOPPED = "STOPPED"
TERMINAL_DEPLOY_STATUSES = frozenset({DEPLOY_FAILED, DEPLOY_STOPPED, "PREEMPTED"})

# Sampler / inference deployment statuses (a subset of DeploymentStatusV1).
SAMPLER_ACTIVE = "ACTIVE"
SAMPLER_SCALED_TO_ZERO = "SCALED_TO_ZERO"
SAMPLER_INACTIVE = "INACTIVE"

# Operation statuses. "done" and "error" are the wire values of a finished op.
OP_PENDING = "pending"
OP_RUNNING = "running"
OP_DONE = "done"
OP_ERROR = "error"
# A finished op whose result was dropped after the retention window. Its row stays a
# while longer so a retried submit with the same Idempotency-Key is still deduplicated.
OP_EXPIRED = "expired"
FINISHED_OP_STATUSES = frozenset({OP_DONE, OP_ERROR, OP_EXPIRED})

TARGET_TRAINER = "trainer"
TARGET_SAMPLER = "sampler"


def new_short_id(length: int = 7) -> str:
    """A lowercase base36 id (runs, sessions, samplers, deployments; 8 for model ids)."""
    return "".join(secrets.choice(_BASE36) for _ in range(length))


def new_checkpoint_pk() -> str:
    """An 8-char mixed-case alphanumeric checkpoint primary key (e.g. ``vL3pQrS8``)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(8))


def iso(ts: float | None) -> str | None:
    """Epoch seconds -> timezone-aware ISO 8601 (what every ``created_at`` on the wire is)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


RowT = TypeVar("RowT")

_JSON_COLUMNS = {"manifest"}


def _row(cls: type[RowT], row: sqlite3.Row) -> RowT:
    return cls(**{k: json.loads(row[k]) if k in _JSON_COLUMNS else row[k] for k in row.keys()})


class StoreBase:
    """The connection plumbing of :class:`~baseten_loops_cli.local.store.Store` (one SQLite file,
    one connection per thread), which each table's methods share. Safe to use from any thread."""

    def __init__(self, path: Path, schema: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        # executescript() manages its own transaction (it COMMITs first).
        conn = self._conn()
        conn.executescript(schema)
        self._add_missing_columns(conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # ── connection plumbing ──

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode = WAL")
            # NORMAL is durable across application crashes in WAL mode; only a power
            # loss can drop the last transactions, which is fine for a dev backend.
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    class _Tx:
        """A write transaction on this thread's connection. A nested one is a savepoint of the
        outermost, which alone commits: see :meth:`transaction`. A nested one that fails
        undoes its own writes only, as it would have on its own."""

        def __init__(self, local: threading.local, conn: sqlite3.Connection) -> None:
            self.local = local
            self.conn = conn
            self.savepoint = ""

        def __enter__(self) -> sqlite3.Connection:
            depth = getattr(self.local, "depth", 0)
            if depth == 0:
                self.conn.execute("BEGIN IMMEDIATE")
            else:
                self.savepoint = f"nested_{depth}"
                self.conn.execute(f"SAVEPOINT {self.savepoint}")
            self.local.depth = depth + 1
            return self.conn

        def __exit__(self, exc_type, exc, tb) -> None:
            self.local.depth -= 1
            if self.savepoint:
                if exc_type:
                    self.conn.execute(f"ROLLBACK TO {self.savepoint}")
                self.conn.execute(f"RELEASE {self.savepoint}")
            else:
                self.conn.execute("ROLLBACK" if exc_type else "COMMIT")

    def _tx(self) -> "StoreBase._Tx":
        return StoreBase._Tx(self._local, self._conn())

    def transaction(self) -> "StoreBase._Tx":
        """Several writes, one commit: every write inside joins this transaction (used for
        an op's bookkeeping, which is on the path between two ops of a run)."""
        return self._tx()

    def _one(self, cls: type[RowT], sql: str, args: Iterable[Any] = ()) -> RowT | None:
        row = self._conn().execute(sql, tuple(args)).fetchone()
        return None if row is None else _row(cls, row)

    def _all(self, cls: type[RowT], sql: str, args: Iterable[Any] = ()) -> list[RowT]:
        return [_row(cls, r) for r in self._conn().execute(sql, tuple(args)).fetchall()]

    def _insert_with_fresh_id(self, make_id, sql: str, args_for) -> str:
        """Insert a row under a random id, drawing again on the (rare) collision."""
        for _ in range(20):
            new_id = make_id()
            try:
                with self._tx() as db:
                    db.execute(sql, args_for(new_id))
                return new_id
            except sqlite3.IntegrityError as exc:
                if "UNIQUE" not in str(exc) and "PRIMARY" not in str(exc):
                    raise
        raise RuntimeError("could not allocate a unique id")  # pragma: no cover

    # Columns added after a table first shipped: a data dir made by an earlier build gets
    # them on open instead of failing on the first query.
    _ADDED_COLUMNS = (
        ("runs", "published_checkpoint_pk", "TEXT"),
        ("runs", "published_version", "INTEGER NOT NULL DEFAULT 0"),
        ("runs", "pending_grad_ops", "INTEGER NOT NULL DEFAULT 0"),
        ("runs", "gradients_lost", "INTEGER NOT NULL DEFAULT 0"),
        ("checkpoints", "manifest", "TEXT NOT NULL DEFAULT '{}'"),
    )

    def _add_missing_columns(self, conn: sqlite3.Connection) -> None:
        for table, column, ddl in self._ADDED_COLUMNS:
            existing = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
            if column not in existing:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")

    def close(self) -> None:
        with self._connections_lock:
            for conn in self._connections:
                try:
                    conn.close()
                except sqlite3.ProgrammingError:  # closed from another thread
                    pass
            self._connections.clear()
        self._local = threading.local()

    # Which columns _update may set, per table: the Store fills it (it knows every table's row).
    _UPDATABLE: dict[str, set[str]] = {}

    def _update(self, table: str, key: str, key_value: str, fields: dict[str, Any]) -> None:
        if not fields:
            return
        unknown = set(fields) - self._UPDATABLE[table]
        if unknown:  # column names are interpolated below, so refuse anything unexpected
            raise ValueError(f"cannot update {table}.{sorted(unknown)}")
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as db:
            db.execute(f"UPDATE {table} SET {cols} WHERE {key} = ?", (*fields.values(), key_value))
