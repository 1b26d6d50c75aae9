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

One module per table (``runs.py``, ``samplers.py``, ...: its row type, its schema and its
methods, a mixin on :class:`~.base.StoreBase`, the one connection); :class:`Store` is all of
them on one database, and what spans tables (a restart's reconciliation) is written here.
Everything is importable from ``baseten_loops_cli.local.store`` as before the split.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from baseten_loops_cli.local.store.base import (
    DEPLOY_CREATED,
    DEPLOY_DEPLOYING,
    DEPLOY_FAILED,
    DEPLOY_RUNNING,
    DEPLOY_SCALED_TO_ZERO,
    DEPLOY_STOPPED,
    FINISHED_OP_STATUSES,
    OP_DONE,
    OP_ERROR,
    OP_EXPIRED,
    OP_PENDING,
    OP_RUNNING,
    RUN_ACTIVE,
    RUN_INACTIVE,
    SAMPLER_ACTIVE,
    SAMPLER_INACTIVE,
    SAMPLER_SCALED_TO_ZERO,
    SCHEMA_VERSION,
    TARGET_SAMPLER,
    TARGET_TRAINER,
    TERMINAL_DEPLOY_STATUSES,
    iso,
    new_checkpoint_pk,
    new_short_id,
)
from baseten_loops_cli.local.store.sessions import SessionsTable, SCHEMA as _SESSIONS_SCHEMA, SessionRow
from baseten_loops_cli.local.store.runs import RunsTable, SCHEMA as _RUNS_SCHEMA, RunRow
from baseten_loops_cli.local.store.deployments import DeploymentsTable, SCHEMA as _DEPLOYMENTS_SCHEMA, DeploymentRow
from baseten_loops_cli.local.store.samplers import SamplersTable, SCHEMA as _SAMPLERS_SCHEMA, SamplerRow
from baseten_loops_cli.local.store.checkpoints import CheckpointsTable, SCHEMA as _CHECKPOINTS_SCHEMA, CheckpointRow
from baseten_loops_cli.local.store.operations import OperationsTable, SCHEMA as _OPERATIONS_SCHEMA, OperationRow
from baseten_loops_cli.local.store.usage import UsageTable, SCHEMA as _USAGE_SCHEMA, UsageRow
from baseten_loops_cli.local.store.logs import LogsTable, SCHEMA as _LOGS_SCHEMA, LogRow
from baseten_loops_cli.local.store.user_config import UserConfigTable, SCHEMA as _USER_CONFIG_SCHEMA

_SCHEMA = "".join((_SESSIONS_SCHEMA, _RUNS_SCHEMA, _DEPLOYMENTS_SCHEMA, _SAMPLERS_SCHEMA, _CHECKPOINTS_SCHEMA, _OPERATIONS_SCHEMA, _USAGE_SCHEMA, _LOGS_SCHEMA, _USER_CONFIG_SCHEMA))


class Store(SessionsTable, RunsTable, DeploymentsTable, SamplersTable, CheckpointsTable, OperationsTable, UsageTable, LogsTable, UserConfigTable):
    """The local backend's database: every table's methods on one connection per thread.
    Safe to use from any thread."""

    _UPDATABLE = {
        "runs": {f.name for f in dataclasses.fields(RunRow)} - {"id"},
        "samplers": {f.name for f in dataclasses.fields(SamplerRow)} - {"id"},
        "checkpoints": {f.name for f in dataclasses.fields(CheckpointRow)} - {"pk"},
        "deployments": {"status", "status_reason", "updated_at"},
    }

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA)

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


# What `from baseten_loops_cli.local.store import ...` offered before the split, and the Store.
__all__ = [
    "CheckpointRow",
    "DEPLOY_CREATED",
    "DEPLOY_DEPLOYING",
    "DEPLOY_FAILED",
    "DEPLOY_RUNNING",
    "DEPLOY_SCALED_TO_ZERO",
    "DEPLOY_STOPPED",
    "DeploymentRow",
    "FINISHED_OP_STATUSES",
    "LogRow",
    "OP_DONE",
    "OP_ERROR",
    "OP_EXPIRED",
    "OP_PENDING",
    "OP_RUNNING",
    "OperationRow",
    "RUN_ACTIVE",
    "RUN_INACTIVE",
    "RunRow",
    "SAMPLER_ACTIVE",
    "SAMPLER_INACTIVE",
    "SAMPLER_SCALED_TO_ZERO",
    "SCHEMA_VERSION",
    "SamplerRow",
    "SessionRow",
    "Store",
    "TARGET_SAMPLER",
    "TARGET_TRAINER",
    "TERMINAL_DEPLOY_STATUSES",
    "UsageRow",
    "iso",
    "new_checkpoint_pk",
    "new_short_id",
]
