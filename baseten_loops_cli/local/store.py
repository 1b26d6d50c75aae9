"""SQLite state of the local backend: sessions, runs, samplers, checkpoints, operations, ...

One database file (``<data_dir>/loops.db``) in WAL mode, so readers never block the writer.
Each thread gets its own connection (sqlite3 connections must not be shared across threads
without a lock); in practice the server writes from its event-loop thread only and the
compute threads hand their results back to it.

Rows come back as small frozen dataclasses (``RunRow``, ``CheckpointRow``, ...) rather than
dicts, so the rest of the server reads typed attributes and the column list lives here only.
Times are stored as float epoch seconds; :func:`iso` renders them for the wire.

IDs follow the hosted product's shapes so clients that (wrongly) pattern-match them still
work: runs, sessions, samplers and deployments are 7-char lowercase base36, model ids are
8-char lowercase base36, checkpoint primary keys are 8-char mixed-case alphanumerics.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sqlite3
import string
import threading
import time
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


# ── Row types ──────────────────────────────────────────────────────────────────────────


@dataclasses.dataclass(frozen=True)
class SessionRow:
    id: str
    team_id: str | None
    training_project_id: str | None
    created_at: float


@dataclasses.dataclass(frozen=True)
class RunRow:
    id: str
    session_id: str
    team_id: str | None
    name: str
    base_model: str
    lora_rank: int
    max_seq_len: int
    seed: int | None
    scale_down_delay_seconds: int
    availability_model: str
    replicas: int
    init_path: str | None
    deployment_id: str
    status: str
    policy_version: int
    # The sampler-weights checkpoint last published with bump_version (what the paired
    # sampler serves) and the policy version it was published at (0 = serve the base).
    published_checkpoint_pk: str | None
    published_version: int
    # forward_backward ops applied since the last optim_step: gradients that exist only in
    # memory. Persisted so a restart can tell the next optim_step they were lost.
    pending_grad_ops: int
    gradients_lost: int
    created_at: float
    last_active_at: float
    deactivated_at: float | None


@dataclasses.dataclass(frozen=True)
class DeploymentRow:
    """A trainer deployment (``kind="trainer"``) or an inference deployment made from
    checkpoints (``kind="inference"``, with ``model_id`` and ``checkpoint_pks``)."""

    id: str
    kind: str
    run_id: str | None
    model_id: str | None
    name: str | None
    base_model: str
    status: str
    status_reason: str | None
    checkpoint_pks: tuple[str, ...]
    created_at: float
    updated_at: float


@dataclasses.dataclass(frozen=True)
class SamplerRow:
    id: str
    session_id: str | None
    team_id: str | None
    run_id: str | None
    base_model: str
    model_path: str | None
    checkpoint_pk: str | None
    max_seq_length: int | None
    num_replicas: int | None
    model_id: str
    deployment_id: str
    status: str
    policy_version: int
    live_checkpoint_pk: str | None
    scale_down_delay_seconds: int
    created_at: float
    last_active_at: float
    deactivated_at: float | None


@dataclasses.dataclass(frozen=True)
class CheckpointRow:
    pk: str
    run_id: str
    name: str
    target: str
    base_model: str
    lora_rank: int
    policy_version: int
    size_bytes: int
    storage_dir: str  # relative to the data dir
    created_at: float
    expires_at: float | None
    # {relative file path: sha256 hex} computed when saved, so downloads can be verified.
    manifest: dict[str, str]

    @property
    def bt_path(self) -> str:
        folder = "weights" if self.target == TARGET_TRAINER else "sampler_weights"
        return f"bt://loops:{self.run_id}/{folder}/{self.name}"


@dataclasses.dataclass(frozen=True)
class OperationRow:
    run_id: str
    id: str
    op: str
    idempotency_key: str | None
    seq_id: int | None
    status: str
    # The result as the JSON text stored and answered: encoded once, when the op finishes,
    # and never decoded on the way to a poller.
    result_json: str | None
    error: str | None
    error_class: str | None
    submitted_at: float
    started_at: float | None
    finished_at: float | None

    @property
    def result(self) -> Any:
        return json.loads(self.result_json) if self.result_json else None


@dataclasses.dataclass(frozen=True)
class UsageRow:
    owner_id: str
    owner_kind: str  # "run" | "sampler" | "deployment"
    tokens_trained: int
    tokens_sampled: int
    compute_seconds: float
    operations: int
    sample_requests: int


@dataclasses.dataclass(frozen=True)
class LogRow:
    id: int
    deployment_id: str
    ts_ns: int
    level: str
    message: str
    request_id: str | None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    team_id TEXT,
    training_project_id TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    team_id TEXT,
    name TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_rank INTEGER NOT NULL,
    max_seq_len INTEGER NOT NULL,
    seed INTEGER,
    scale_down_delay_seconds INTEGER NOT NULL,
    availability_model TEXT NOT NULL,
    replicas INTEGER NOT NULL,
    init_path TEXT,
    deployment_id TEXT NOT NULL,
    status TEXT NOT NULL,
    policy_version INTEGER NOT NULL DEFAULT 0,
    published_checkpoint_pk TEXT,
    published_version INTEGER NOT NULL DEFAULT 0,
    pending_grad_ops INTEGER NOT NULL DEFAULT 0,
    gradients_lost INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    deactivated_at REAL
);
CREATE TABLE IF NOT EXISTS deployments (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    run_id TEXT,
    model_id TEXT,
    name TEXT,
    base_model TEXT NOT NULL,
    status TEXT NOT NULL,
    status_reason TEXT,
    checkpoint_pks TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS samplers (
    id TEXT PRIMARY KEY,
    session_id TEXT,
    team_id TEXT,
    run_id TEXT,
    base_model TEXT NOT NULL,
    model_path TEXT,
    checkpoint_pk TEXT,
    max_seq_length INTEGER,
    num_replicas INTEGER,
    model_id TEXT NOT NULL,
    deployment_id TEXT NOT NULL,
    status TEXT NOT NULL,
    policy_version INTEGER NOT NULL DEFAULT 0,
    live_checkpoint_pk TEXT,
    scale_down_delay_seconds INTEGER NOT NULL,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    deactivated_at REAL
);
CREATE INDEX IF NOT EXISTS samplers_by_run ON samplers(run_id);
CREATE TABLE IF NOT EXISTS checkpoints (
    pk TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    name TEXT NOT NULL,
    target TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_rank INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    storage_dir TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    manifest TEXT NOT NULL DEFAULT '{}',
    UNIQUE (run_id, target, name)
);
CREATE TABLE IF NOT EXISTS operations (
    run_id TEXT NOT NULL,
    id TEXT NOT NULL,
    op TEXT NOT NULL,
    idempotency_key TEXT,
    seq_id INTEGER,
    status TEXT NOT NULL,
    result TEXT,
    error TEXT,
    error_class TEXT,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    PRIMARY KEY (run_id, id)
);
-- The janitor expires results by (status, finish time) every tick. With an index on status
-- alone SQLite reads every finished row to test finished_at, which lies behind the result
-- blob: ~30 ms per 10,000 ops of the last hour, blocking the event loop each tick. The same
-- index serves the lookups by status alone (restart recovery, listings).
DROP INDEX IF EXISTS operations_by_status;
CREATE INDEX IF NOT EXISTS operations_by_status_finish ON operations(status, finished_at);
-- The purge forgets ops by finish time alone.
CREATE INDEX IF NOT EXISTS operations_by_finish ON operations(finished_at);
CREATE TABLE IF NOT EXISTS usage (
    owner_id TEXT PRIMARY KEY,
    owner_kind TEXT NOT NULL,
    tokens_trained INTEGER NOT NULL DEFAULT 0,
    tokens_sampled INTEGER NOT NULL DEFAULT 0,
    compute_seconds REAL NOT NULL DEFAULT 0,
    operations INTEGER NOT NULL DEFAULT 0,
    sample_requests INTEGER NOT NULL DEFAULT 0
);
-- Sampling of a run's checkpoints by someone other than the run itself (a standalone sampler:
-- `loops sample`, `loops eval`; a deployment), so `loops usage --by-run` counts it for the run
-- while each allocation's own row keeps what it served.
CREATE TABLE IF NOT EXISTS checkpoint_sampling (
    run_id TEXT NOT NULL,
    owner_id TEXT NOT NULL,
    owner_kind TEXT NOT NULL,
    tokens_sampled INTEGER NOT NULL DEFAULT 0,
    sample_requests INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, owner_id)
);
-- The same counters by the minute they were used (epoch seconds, a multiple of 60), so
-- `loops usage --since/--until` can sum a window. run_id: the run the use counts for (the owner
-- itself, or the run whose checkpoint a sampler or deployment served; '' when none).
CREATE TABLE IF NOT EXISTS usage_minutes (
    owner_id TEXT NOT NULL,
    owner_kind TEXT NOT NULL,
    run_id TEXT NOT NULL DEFAULT '',
    minute INTEGER NOT NULL,
    tokens_trained INTEGER NOT NULL DEFAULT 0,
    tokens_sampled INTEGER NOT NULL DEFAULT 0,
    compute_seconds REAL NOT NULL DEFAULT 0,
    operations INTEGER NOT NULL DEFAULT 0,
    sample_requests INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner_id, run_id, minute)
);
CREATE INDEX IF NOT EXISTS usage_minutes_by_minute ON usage_minutes(minute);
CREATE TABLE IF NOT EXISTS logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    deployment_id TEXT NOT NULL,
    ts_ns INTEGER NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    request_id TEXT
);
CREATE INDEX IF NOT EXISTS logs_by_deployment ON logs(deployment_id, ts_ns);
CREATE TABLE IF NOT EXISTS user_config (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    trainer_accelerator_priority TEXT,
    sampler_accelerator_priority TEXT
);
"""

RowT = TypeVar("RowT")


_JSON_COLUMNS = {"manifest"}


def _row(cls: type[RowT], row: sqlite3.Row | None) -> RowT | None:
    if row is None:
        return None
    return cls(**{k: json.loads(row[k]) if k in _JSON_COLUMNS else row[k] for k in row.keys()})


class Store:
    """The local backend's database. Safe to use from any thread."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        # executescript() manages its own transaction (it COMMITs first).
        conn = self._conn()
        conn.executescript(_SCHEMA)
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

    def _tx(self) -> "Store._Tx":
        return Store._Tx(self._local, self._conn())

    def transaction(self) -> "Store._Tx":
        """Several writes, one commit: every write inside joins this transaction (used for
        an op's bookkeeping, which is on the path between two ops of a run)."""
        return self._tx()

    def _one(self, cls: type[RowT], sql: str, args: Iterable[Any] = ()) -> RowT | None:
        return _row(cls, self._conn().execute(sql, tuple(args)).fetchone())

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

    # ── sessions ──

    def create_session(self, team_id: str | None, training_project_id: str | None) -> SessionRow:
        now = time.time()
        sid = self._insert_with_fresh_id(
            new_short_id,
            "INSERT INTO sessions (id, team_id, training_project_id, created_at) VALUES (?,?,?,?)",
            lambda i: (i, team_id, training_project_id, now),
        )
        return self.get_session(sid)  # type: ignore[return-value]

    def get_session(self, session_id: str) -> SessionRow | None:
        return self._one(SessionRow, "SELECT * FROM sessions WHERE id = ?", (session_id,))

    # ── runs + their trainer deployments ──

    def create_run(
        self,
        *,
        session_id: str,
        team_id: str | None,
        name: str,
        base_model: str,
        lora_rank: int,
        max_seq_len: int,
        seed: int | None,
        scale_down_delay_seconds: int,
        availability_model: str,
        replicas: int,
        init_path: str | None,
    ) -> RunRow:
        """Create a run and its trainer deployment (status CREATED) in one transaction."""
        now = time.time()
        for _ in range(20):
            run_id, deployment_id = new_short_id(), new_short_id()
            try:
                with self._tx() as db:
                    db.execute(
                        "INSERT INTO deployments (id, kind, run_id, model_id, name, base_model,"
                        " status, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?)",
                        (deployment_id, "trainer", run_id, None, name, base_model,
                         DEPLOY_CREATED, now, now),
                    )
                    db.execute(
                        "INSERT INTO runs (id, session_id, team_id, name, base_model, lora_rank,"
                        " max_seq_len, seed, scale_down_delay_seconds, availability_model,"
                        " replicas, init_path, deployment_id, status, policy_version,"
                        " created_at, last_active_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,0,?,?)",
                        (run_id, session_id, team_id, name, base_model, lora_rank, max_seq_len,
                         seed, scale_down_delay_seconds, availability_model, replicas,
                         init_path, deployment_id, RUN_ACTIVE, now, now),
                    )
                    db.execute(
                        "INSERT INTO usage (owner_id, owner_kind) VALUES (?, 'run')", (run_id,)
                    )
                return self.get_run(run_id)  # type: ignore[return-value]
            except sqlite3.IntegrityError:
                continue
        raise RuntimeError("could not allocate a unique run id")  # pragma: no cover

    def get_run(self, run_id: str) -> RunRow | None:
        return self._one(RunRow, "SELECT * FROM runs WHERE id = ?", (run_id,))

    def list_runs(
        self, *, run_id: str | None = None, base_model: str | None = None,
        team_id: str | None = None, status: str | None = None,
    ) -> list[RunRow]:
        clauses, args = [], []
        for column, value in (("id", run_id), ("base_model", base_model),
                              ("team_id", team_id), ("status", status)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        return self._all(RunRow, f"SELECT * FROM runs {where} ORDER BY created_at DESC", args)

    def run_base_models(self) -> list[str]:
        """Every base model a run was created on (names and local folders), first used first."""
        rows = self._conn().execute(
            "SELECT base_model FROM runs GROUP BY base_model ORDER BY MIN(created_at)").fetchall()
        return [row[0] for row in rows]

    def update_run(self, run_id: str, **fields: Any) -> None:
        self._update("runs", "id", run_id, fields)

    def touch_run(self, run_id: str, now: float | None = None) -> None:
        self.update_run(run_id, last_active_at=now or time.time())

    # ── deployments ──

    def create_inference_deployment(
        self, *, name: str, base_model: str, checkpoint_pks: list[str]
    ) -> DeploymentRow:
        now = time.time()
        model_id = new_short_id(8)
        dep_id = self._insert_with_fresh_id(
            new_short_id,
            "INSERT INTO deployments (id, kind, run_id, model_id, name, base_model, status,"
            " checkpoint_pks, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
            lambda i: (i, "inference", None, model_id, name, base_model, SAMPLER_ACTIVE,
                       json.dumps(checkpoint_pks), now, now),
        )
        return self.get_deployment(dep_id)  # type: ignore[return-value]

    def _deployment(self, row: sqlite3.Row | None) -> DeploymentRow | None:
        if row is None:
            return None
        values = {k: row[k] for k in row.keys()}
        values["checkpoint_pks"] = tuple(json.loads(values["checkpoint_pks"] or "[]"))
        return DeploymentRow(**values)

    def get_deployment(self, deployment_id: str) -> DeploymentRow | None:
        return self._deployment(
            self._conn().execute("SELECT * FROM deployments WHERE id = ?", (deployment_id,))
            .fetchone()
        )

    def list_deployments(self, kind: str | None = None) -> list[DeploymentRow]:
        sql = "SELECT * FROM deployments"
        args: tuple = ()
        if kind is not None:
            sql += " WHERE kind = ?"
            args = (kind,)
        rows = self._conn().execute(sql + " ORDER BY created_at DESC", args).fetchall()
        return [self._deployment(r) for r in rows]  # type: ignore[misc]

    def set_deployment_status(
        self, deployment_id: str, status: str, reason: str | None = None
    ) -> None:
        self._update("deployments", "id", deployment_id,
                     {"status": status, "status_reason": reason, "updated_at": time.time()})

    def deactivate_run(self, run_id: str, deployment_id: str) -> None:
        """A run, its trainer deployment and its paired samplers go down together (one
        transaction: a crash never leaves an inactive run with a live trainer or sampler)."""
        now = time.time()
        with self._tx() as db:
            db.execute("UPDATE runs SET status = ?, deactivated_at = ? WHERE id = ?",
                       (RUN_INACTIVE, now, run_id))
            db.execute("UPDATE deployments SET status = ?, status_reason = ?, updated_at = ?"
                       " WHERE id = ?", (DEPLOY_STOPPED, "deactivated", now, deployment_id))
            db.execute("UPDATE samplers SET status = ?, deactivated_at = ? WHERE run_id = ?"
                       " AND status != ?", (SAMPLER_INACTIVE, now, run_id, SAMPLER_INACTIVE))

    def reconcile_after_restart(self) -> list[tuple[str, str]]:
        """Statuses true again after a restart or crash, when nothing is in memory: live
        trainers and samplers are scaled to zero (the next op or sample wakes them), and
        anything left of a deactivated run is down. Returns (deployment id, new status)
        of each trainer or sampler deployment it changed, for their logs."""
        live_trainer = (DEPLOY_CREATED, DEPLOY_DEPLOYING, DEPLOY_RUNNING)
        now = time.time()
        changed: list[tuple[str, str]] = []
        with self._tx() as db:
            def rows(sql: str, *args: Any) -> list[str]:
                return [r[0] for r in db.execute(sql, args).fetchall()]

            for dep in rows("SELECT d.id FROM deployments d JOIN runs r ON d.run_id = r.id"
                            " WHERE d.kind = 'trainer' AND r.status = ? AND d.status IN (?,?,?)",
                            RUN_ACTIVE, *live_trainer):
                changed.append((dep, DEPLOY_SCALED_TO_ZERO))
            for dep in rows("SELECT d.id FROM deployments d JOIN runs r ON d.run_id = r.id"
                            " WHERE d.kind = 'trainer' AND r.status = ? AND d.status NOT IN (?,?,?)",
                            RUN_INACTIVE, *TERMINAL_DEPLOY_STATUSES):
                changed.append((dep, DEPLOY_STOPPED))
            for dep, status in changed:
                db.execute("UPDATE deployments SET status = ?, updated_at = ? WHERE id = ?",
                           (status, now, dep))
            down = rows("SELECT s.deployment_id FROM samplers s JOIN runs r ON s.run_id = r.id"
                        " WHERE r.status = ? AND s.status != ?", RUN_INACTIVE, SAMPLER_INACTIVE)
            db.execute("UPDATE samplers SET status = ?, deactivated_at = ? WHERE status != ? AND"
                       " run_id IN (SELECT id FROM runs WHERE status = ?)",
                       (SAMPLER_INACTIVE, now, SAMPLER_INACTIVE, RUN_INACTIVE))
            idle = rows("SELECT deployment_id FROM samplers WHERE status = ?", SAMPLER_ACTIVE)
            db.execute("UPDATE samplers SET status = ? WHERE status = ?",
                       (SAMPLER_SCALED_TO_ZERO, SAMPLER_ACTIVE))
        return (changed + [(d, SAMPLER_INACTIVE) for d in down]
                + [(d, SAMPLER_SCALED_TO_ZERO) for d in idle])

    # ── samplers ──

    def create_sampler(
        self,
        *,
        session_id: str | None,
        team_id: str | None,
        run_id: str | None,
        base_model: str,
        model_path: str | None,
        checkpoint_pk: str | None,
        max_seq_length: int | None,
        num_replicas: int | None,
        scale_down_delay_seconds: int,
        policy_version: int = 0,
    ) -> SamplerRow:
        now = time.time()
        model_id, deployment_id = new_short_id(8), new_short_id()
        sid = self._insert_with_fresh_id(
            new_short_id,
            "INSERT INTO samplers (id, session_id, team_id, run_id, base_model, model_path,"
            " checkpoint_pk, max_seq_length, num_replicas, model_id, deployment_id, status,"
            " policy_version, live_checkpoint_pk, scale_down_delay_seconds, created_at,"
            " last_active_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            lambda i: (i, session_id, team_id, run_id, base_model, model_path, checkpoint_pk,
                       max_seq_length, num_replicas, model_id, deployment_id, SAMPLER_ACTIVE,
                       policy_version, checkpoint_pk, scale_down_delay_seconds, now, now),
        )
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO usage (owner_id, owner_kind) VALUES (?, 'sampler')",
                       (sid,))
        return self.get_sampler(sid)  # type: ignore[return-value]

    def get_sampler(self, sampler_id: str) -> SamplerRow | None:
        return self._one(SamplerRow, "SELECT * FROM samplers WHERE id = ?", (sampler_id,))

    def get_sampler_by_model(self, model_id: str, deployment_id: str) -> SamplerRow | None:
        return self._one(SamplerRow,
                         "SELECT * FROM samplers WHERE model_id = ? AND deployment_id = ?",
                         (model_id, deployment_id))

    def paired_sampler(self, run_id: str, *, live_only: bool = True) -> SamplerRow | None:
        sql = "SELECT * FROM samplers WHERE run_id = ?"
        if live_only:
            sql += f" AND status != '{SAMPLER_INACTIVE}'"
        return self._one(SamplerRow, sql + " ORDER BY created_at DESC LIMIT 1", (run_id,))

    def list_samplers(self, team_id: str | None = None) -> list[SamplerRow]:
        if team_id is None:
            return self._all(SamplerRow, "SELECT * FROM samplers ORDER BY created_at DESC")
        return self._all(SamplerRow,
                         "SELECT * FROM samplers WHERE team_id = ? ORDER BY created_at DESC",
                         (team_id,))

    def update_sampler(self, sampler_id: str, **fields: Any) -> None:
        self._update("samplers", "id", sampler_id, fields)

    # ── checkpoints ──

    def upsert_checkpoint(
        self,
        *,
        run_id: str,
        name: str,
        target: str,
        base_model: str,
        lora_rank: int,
        policy_version: int,
        size_bytes: int,
        storage_dir: str,
        expires_at: float | None,
        manifest: dict[str, str] | None = None,
    ) -> CheckpointRow:
        """Record a save. Saving a name again replaces that checkpoint (same pk, new
        files, new time): a dedicated sampler re-reads one directory per name, and the
        SDK resolves names to exactly one checkpoint per target."""
        now = time.time()
        existing = self._one(
            CheckpointRow,
            "SELECT * FROM checkpoints WHERE run_id = ? AND target = ? AND name = ?",
            (run_id, target, name),
        )
        if existing is not None:
            self._update("checkpoints", "pk", existing.pk, {
                "lora_rank": lora_rank, "policy_version": policy_version,
                "size_bytes": size_bytes, "storage_dir": storage_dir,
                "created_at": now, "expires_at": expires_at,
                "manifest": json.dumps(manifest or {}),
            })
            return self.get_checkpoint(existing.pk)  # type: ignore[return-value]
        pk = self._insert_with_fresh_id(
            new_checkpoint_pk,
            "INSERT INTO checkpoints (pk, run_id, name, target, base_model, lora_rank,"
            " policy_version, size_bytes, storage_dir, created_at, expires_at, manifest)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            lambda i: (i, run_id, name, target, base_model, lora_rank, policy_version,
                       size_bytes, storage_dir, now, expires_at, json.dumps(manifest or {})),
        )
        return self.get_checkpoint(pk)  # type: ignore[return-value]

    def get_checkpoint(self, pk: str) -> CheckpointRow | None:
        return self._one(CheckpointRow, "SELECT * FROM checkpoints WHERE pk = ?", (pk,))

    def find_checkpoint(self, run_id: str, target: str, name: str) -> CheckpointRow | None:
        return self._one(
            CheckpointRow,
            "SELECT * FROM checkpoints WHERE run_id = ? AND target = ? AND name = ?",
            (run_id, target, name),
        )

    def list_checkpoints(
        self, *, run_id: str | None = None, base_model: str | None = None
    ) -> list[CheckpointRow]:
        """Newest first, as the hosted API returns them."""
        if run_id is not None:
            return self._all(CheckpointRow,
                             "SELECT * FROM checkpoints WHERE run_id = ?"
                             " ORDER BY created_at DESC, pk", (run_id,))
        if base_model is not None:
            return self._all(CheckpointRow,
                             "SELECT * FROM checkpoints WHERE base_model = ?"
                             " ORDER BY created_at DESC, pk", (base_model,))
        return self._all(CheckpointRow, "SELECT * FROM checkpoints ORDER BY created_at DESC")

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        return self._all(CheckpointRow,
                         "SELECT * FROM checkpoints WHERE expires_at IS NOT NULL"
                         " AND expires_at <= ?", (now,))

    def delete_checkpoint(self, pk: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM checkpoints WHERE pk = ?", (pk,))

    # ── operations ──

    def insert_operation(
        self, *, run_id: str, op_id: str, op: str, idempotency_key: str | None,
        seq_id: int | None,
    ) -> OperationRow:
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO operations (run_id, id, op, idempotency_key, seq_id, status,"
                " submitted_at) VALUES (?,?,?,?,?,?,?)",
                (run_id, op_id, op, idempotency_key, seq_id, OP_PENDING, now),
            )
        return self.get_operation(run_id, op_id)  # type: ignore[return-value]

    def _operation(self, row: sqlite3.Row | None) -> OperationRow | None:
        if row is None:
            return None
        values = {k: row[k] for k in row.keys()}
        values["result_json"] = values.pop("result")
        return OperationRow(**values)

    def get_operation(self, run_id: str, op_id: str) -> OperationRow | None:
        return self._operation(self._conn().execute(
            "SELECT * FROM operations WHERE run_id = ? AND id = ?", (run_id, op_id)).fetchone())

    def list_operations(
        self, *, run_id: str | None = None, statuses: Iterable[str] | None = None,
        since: float | None = None,
    ) -> list[OperationRow]:
        clauses, args = [], []
        if run_id is not None:
            clauses.append("run_id = ?")
            args.append(run_id)
        if statuses is not None:
            statuses = list(statuses)
            clauses.append(f"status IN ({','.join('?' * len(statuses))})")
            args.extend(statuses)
        if since is not None:
            clauses.append("submitted_at >= ?")
            args.append(since)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._conn().execute(
            f"SELECT * FROM operations {where} ORDER BY submitted_at", args).fetchall()
        return [self._operation(r) for r in rows]  # type: ignore[misc]

    def mark_operation_running(self, run_id: str, op_id: str) -> None:
        self._update_op(run_id, op_id, {"status": OP_RUNNING, "started_at": time.time()})

    def finish_operation(
        self, run_id: str, op_id: str, *, result_json: str | None = None, error: str | None = None,
        error_class: str | None = None, finished_at: float | None = None,
    ) -> None:
        """Record how an op ended: done with ``result_json`` (JSON text), or ``error``."""
        fields: dict[str, Any] = {"finished_at": finished_at or time.time()}
        if error is None:
            fields.update(status=OP_DONE, result=result_json)
        else:
            fields.update(status=OP_ERROR, error=error, error_class=error_class or "Error")
        self._update_op(run_id, op_id, fields)

    def fail_unfinished_operations(self, error: str, error_class: str) -> int:
        """Used at startup: ops that were queued or running when the server stopped can
        never finish; they answer with this error instead of hanging their pollers."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE operations SET status = ?, error = ?, error_class = ?, finished_at = ?"
                " WHERE status IN (?, ?)",
                (OP_ERROR, error, error_class, time.time(), OP_PENDING, OP_RUNNING),
            )
            return cur.rowcount

    def fail_pending_operations_of_run(self, run_id: str, error: str,
                                       error_class: str) -> list[str]:
        with self._tx() as db:
            ids = [r[0] for r in db.execute(
                "SELECT id FROM operations WHERE run_id = ? AND status = ?",
                (run_id, OP_PENDING)).fetchall()]
            db.execute(
                "UPDATE operations SET status = ?, error = ?, error_class = ?, finished_at = ?"
                " WHERE run_id = ? AND status = ?",
                (OP_ERROR, error, error_class, time.time(), run_id, OP_PENDING),
            )
        return ids

    def expire_operation_results(self, finished_before: float) -> int:
        """Drop results older than the retention window (their polls then answer 404)."""
        with self._tx() as db:
            return db.execute(
                "UPDATE operations SET status = ?, result = NULL WHERE status IN (?, ?)"
                " AND finished_at < ?",
                (OP_EXPIRED, OP_DONE, OP_ERROR, finished_before)).rowcount

    def purge_operations(self, finished_before: float) -> int:
        """Forget ops entirely once the idempotency window is over."""
        with self._tx() as db:
            return db.execute(
                "DELETE FROM operations WHERE finished_at IS NOT NULL AND finished_at < ?",
                (finished_before,)).rowcount

    def _update_op(self, run_id: str, op_id: str, fields: dict[str, Any]) -> None:
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as db:
            db.execute(f"UPDATE operations SET {cols} WHERE run_id = ? AND id = ?",
                       (*fields.values(), run_id, op_id))

    # ── usage counters ──

    def add_usage(
        self, owner_id: str, owner_kind: str, *, tokens_trained: int = 0,
        tokens_sampled: int = 0, compute_seconds: float = 0.0, operations: int = 0,
        sample_requests: int = 0, checkpoint_pk: str | None = None,
    ) -> None:
        """Add to an owner's counters. ``checkpoint_pk``: the checkpoint a sampling request
        served; when the owner is not a run (a standalone sampler, a deployment), the tokens
        are also counted for the checkpoint's run (:meth:`usage_report`)."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO usage (owner_id, owner_kind) VALUES (?, ?)",
                       (owner_id, owner_kind))
            db.execute(
                "UPDATE usage SET tokens_trained = tokens_trained + ?,"
                " tokens_sampled = tokens_sampled + ?, compute_seconds = compute_seconds + ?,"
                " operations = operations + ?, sample_requests = sample_requests + ?"
                " WHERE owner_id = ?",
                (tokens_trained, tokens_sampled, compute_seconds, operations, sample_requests,
                 owner_id),
            )
            found = None
            if checkpoint_pk is not None and owner_kind != "run":
                found = db.execute("SELECT run_id FROM checkpoints WHERE pk = ?", (checkpoint_pk,)).fetchone()
            run_id = owner_id if owner_kind == "run" else (found[0] if found else "")
            db.execute(
                "INSERT INTO usage_minutes (owner_id, owner_kind, run_id, minute, tokens_trained, tokens_sampled,"
                " compute_seconds, operations, sample_requests) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (owner_id, run_id, minute) DO UPDATE SET"
                " tokens_trained = tokens_trained + excluded.tokens_trained,"
                " tokens_sampled = tokens_sampled + excluded.tokens_sampled,"
                " compute_seconds = compute_seconds + excluded.compute_seconds,"
                " operations = operations + excluded.operations,"
                " sample_requests = sample_requests + excluded.sample_requests",
                (owner_id, owner_kind, run_id, int(time.time()) // 60 * 60, tokens_trained, tokens_sampled,
                 compute_seconds, operations, sample_requests),
            )
            if found is None:
                return
            db.execute("INSERT OR IGNORE INTO checkpoint_sampling (run_id, owner_id, owner_kind)"
                       " VALUES (?, ?, ?)", (found[0], owner_id, owner_kind))
            db.execute("UPDATE checkpoint_sampling SET tokens_sampled = tokens_sampled + ?,"
                       " sample_requests = sample_requests + ? WHERE run_id = ? AND owner_id = ?",
                       (tokens_sampled, sample_requests, found[0], owner_id))

    def usage_report(self, owner_id: str | None = None) -> list[dict[str, Any]]:
        """``GET /v1/local/usage``: every owner's counters (or one owner's). A run's row also
        has ``checkpoints_sampled_by``: who else sampled its checkpoints (standalone samplers,
        deployments), with their tokens and requests."""
        by_run: dict[str, list[dict[str, Any]]] = {}
        for run_id, other, kind, tokens, requests in self._conn().execute(
                "SELECT run_id, owner_id, owner_kind, tokens_sampled, sample_requests"
                " FROM checkpoint_sampling ORDER BY run_id, owner_kind, owner_id"):
            by_run.setdefault(run_id, []).append({"owner_id": other, "owner_kind": kind,
                                                  "tokens_sampled": tokens, "sample_requests": requests})
        rows = [u for u in self.list_usage() if owner_id in (None, u.owner_id)]
        known = {u.owner_id for u in self.list_usage()}
        for run_id in by_run.keys() - known:  # a run whose checkpoints were sampled, nothing else
            if owner_id in (None, run_id):
                rows.append(UsageRow(run_id, "run", 0, 0, 0.0, 0, 0))
        out = []
        for u in rows:
            row: dict[str, Any] = {
                "owner_id": u.owner_id, "owner_kind": u.owner_kind,
                "tokens_trained": u.tokens_trained, "tokens_sampled": u.tokens_sampled,
                "compute_seconds": round(u.compute_seconds, 3), "operations": u.operations,
                "sample_requests": u.sample_requests}
            if u.owner_kind == "run":
                row["checkpoints_sampled_by"] = by_run.get(u.owner_id, [])
            out.append(row)
        return out

    def usage_periods(self, since: float, until: float, period_s: int) -> list[dict[str, Any]]:
        """The counters of the minutes that overlap ``[since, until)`` (epoch seconds: usage is
        kept to the minute) summed per owner, run and period of ``period_s`` seconds
        (UTC-aligned), oldest first."""
        first, end = int(since) // 60 * 60, int(until)
        rows = self._conn().execute(
            "SELECT (minute / ?) * ? AS start, owner_id, owner_kind, run_id, SUM(tokens_trained),"
            " SUM(tokens_sampled), SUM(compute_seconds), SUM(operations), SUM(sample_requests)"
            " FROM usage_minutes WHERE minute >= ? AND minute < ?"
            " GROUP BY start, owner_id, owner_kind, run_id ORDER BY start, owner_kind DESC, owner_id, run_id",
            (period_s, period_s, first, end)).fetchall()
        keys = ("start", "owner_id", "owner_kind", "run_id", "tokens_trained", "tokens_sampled",
                "compute_seconds", "operations", "sample_requests")
        out = [dict(zip(keys, row)) for row in rows]
        for row in out:
            row["compute_seconds"] = round(row["compute_seconds"], 3)
            row["run_id"] = row["run_id"] or None
        return out

    def get_usage(self, owner_id: str) -> UsageRow | None:
        return self._one(UsageRow, "SELECT * FROM usage WHERE owner_id = ?", (owner_id,))

    def list_usage(self) -> list[UsageRow]:
        return self._all(UsageRow, "SELECT * FROM usage ORDER BY owner_kind, owner_id")

    # ── logs ──

    def append_log(self, deployment_id: str, message: str, *, level: str = "INFO",
                   request_id: str | None = None, ts_ns: int | None = None) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO logs (deployment_id, ts_ns, level, message, request_id)"
                " VALUES (?,?,?,?,?)",
                (deployment_id, ts_ns or time.time_ns(), level, message, request_id),
            )

    def query_logs(
        self, deployment_id: str, *, start_ns: int, end_ns: int, levels: Iterable[str],
        descending: bool, limit: int,
    ) -> list[LogRow]:
        levels = list(levels)
        order = "DESC" if descending else "ASC"
        return self._all(
            LogRow,
            f"SELECT * FROM logs WHERE deployment_id = ? AND ts_ns >= ? AND ts_ns <= ?"
            f" AND level IN ({','.join('?' * len(levels))})"
            f" ORDER BY ts_ns {order}, id {order} LIMIT ?",
            (deployment_id, start_ns, end_ns, *levels, limit),
        )

    # ── user config ──

    def get_user_config(self) -> dict[str, list[str] | None]:
        row = self._conn().execute("SELECT * FROM user_config WHERE id = 1").fetchone()
        if row is None:
            return {"trainer_accelerator_priority": None, "sampler_accelerator_priority": None}
        return {
            key: json.loads(row[key]) if row[key] is not None else None
            for key in ("trainer_accelerator_priority", "sampler_accelerator_priority")
        }

    def set_user_config(self, values: dict[str, list[str] | None]) -> None:
        current = self.get_user_config()
        current.update(values)
        with self._tx() as db:
            db.execute(
                "INSERT INTO user_config (id, trainer_accelerator_priority,"
                " sampler_accelerator_priority) VALUES (1, ?, ?) ON CONFLICT (id) DO UPDATE"
                " SET trainer_accelerator_priority = excluded.trainer_accelerator_priority,"
                " sampler_accelerator_priority = excluded.sampler_accelerator_priority",
                tuple(json.dumps(current[k]) if current[k] is not None else None
                      for k in ("trainer_accelerator_priority", "sampler_accelerator_priority")),
            )

    # ── helpers ──

    _UPDATABLE = {
        "runs": {f.name for f in dataclasses.fields(RunRow)} - {"id"},
        "samplers": {f.name for f in dataclasses.fields(SamplerRow)} - {"id"},
        "checkpoints": {f.name for f in dataclasses.fields(CheckpointRow)} - {"pk"},
        "deployments": {"status", "status_reason", "updated_at"},
    }

    def _update(self, table: str, key: str, key_value: str, fields: dict[str, Any]) -> None:
        if not fields:
            return
        unknown = set(fields) - self._UPDATABLE[table]
        if unknown:  # column names are interpolated below, so refuse anything unexpected
            raise ValueError(f"cannot update {table}.{sorted(unknown)}")
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as db:
            db.execute(f"UPDATE {table} SET {cols} WHERE {key} = ?", (*fields.values(), key_value))

