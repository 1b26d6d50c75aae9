"""Runs: creation, the ordered execution of their ops, and their trainer's lifecycle.

Each active run has a :class:`RunExecutor`, an asyncio task draining the run's queue one
item at a time. Because everything that changes the run's trainer goes through that one
queue — ops, the initial deploy, scale-to-zero, stop — ops run strictly in the order they
were submitted (for one SDK client that is ``seq_id`` order: it gates submits on it), and
a run can never be scaled down under a queued op.

Trainer deployment states (``LoopsDeploymentStatus``)::

    CREATED --deploy--> DEPLOYING --> RUNNING --idle > scale_down_delay_seconds--> SCALED_TO_ZERO
                                         ^                                            |
                                         +-------------- next op (wake) --------------+
    any --deactivate--> STOPPED          load failure --> FAILED

Scaling to zero saves the run's full state (adapter, optimizer, step) to
``runs/<id>/live`` and frees the adapter; the next op restores it. A clean server stop
does the same for every loaded run, so after a restart each run wakes where it left off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.store import RunRow as RunRow  # rows it answers with
from baseten_loops_cli.local.server import trainer_ops
from baseten_loops_cli.local.server.checkpoints import (
    CheckpointFiles,
    CheckpointRef,
    parse_bt_path,
    require_bt_path,
    validate_name,
)
from baseten_loops_cli.local.server.compute import ComputePool, ModelWorker
from baseten_loops_cli.local.server.config import ServerConfig
from baseten_loops_cli.local.server.model_catalog import ModelCatalog
from baseten_loops_cli.local.server.errors import ApiError, bad_request, conflict
from baseten_loops_cli.local.server.operations import OperationRegistry
from baseten_loops_cli.local.server.samplers import SamplerService
from baseten_loops_cli.local.server.schemas import CreateRunRequest
from baseten_loops_cli.local.server.validation import validate_adam, validate_forward

log = logging.getLogger("loops.server.runs")

TRAINER_OPS = (
    "init_trainer_server",
    "forward",
    "forward_backward",
    "optim_step",
    "save_state",
    "save_weights_for_sampler",
    "load_state",
    "load_state_with_optimizer",
)


class OpFailed(Exception):
    """An op that cannot run; becomes the op's ``{"status": "error"}`` answer."""

    def __init__(self, message: str, error_class: str) -> None:
        super().__init__(message)
        self.error_class = error_class


@dataclass
class _Item:
    kind: str  # "deploy" | "op" | "hibernate" | "stop"
    op_id: str = ""
    op: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    done: asyncio.Future | None = None


@dataclass(frozen=True)
class RunDescription:
    """A run as the control plane shows it (``schemas.run_view``): its row and its paired
    sampler's, live or not (None if it never had one)."""

    run: st.RunRow
    sampler: st.SamplerRow | None


def idle_long_enough(run: st.RunRow, now: float | None = None) -> bool:
    """Whether ``run`` has had no op or heartbeat for its ``scale_down_delay_seconds``."""
    return (now or time.time()) - run.last_active_at >= run.scale_down_delay_seconds


def run_inactive_error(run: st.RunRow) -> ApiError:
    return conflict(
        f"Run {run.id} is {run.status} (deactivated); it takes no more ops. Its checkpoints "
        "remain: start a new run from one with load_state / "
        "create_training_client_from_state.", "RunInactive")


class RunExecutor:
    """One run's queue and its trainer's residency. Built by :meth:`RunManager.executor` with
    the services it uses, and nothing else of the manager's."""

    def __init__(self, run: st.RunRow, *, store: st.Store, ops: OperationRegistry,
                 files: CheckpointFiles, worker: ModelWorker, samplers: SamplerService,
                 snapshot_interval_s: float) -> None:
        self.store = store
        self.ops = ops
        self.files = files
        self.worker = worker
        self.engine = worker.engine
        self.samplers = samplers
        self.snapshot_interval_s = snapshot_interval_s
        self.run_id = run.id
        self.base_model = run.base_model
        self.deployment_id = run.deployment_id
        self.loaded = False
        self.running = asyncio.Event()  # set while the trainer is in memory (RUNNING)
        self.last_snapshot = time.monotonic()
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._outstanding = 0  # queued + executing items
        self._task = asyncio.create_task(self._loop(), name=f"run-{run.id}")

    # ── state ──

    def run(self) -> st.RunRow:
        run = self.store.get_run(self.run_id)
        assert run is not None
        return run

    @property
    def idle(self) -> bool:
        return self._outstanding == 0

    def _set_status(self, status: str, reason: str | None = None) -> None:
        self.store.set_deployment_status(self.deployment_id, status, reason)

    def _log(self, message: str, level: str = "INFO", op_id: str | None = None) -> None:
        self.store.append_log(self.deployment_id, message, level=level, request_id=op_id)

    # ── queue ──

    def _put(self, item: _Item) -> None:
        self._outstanding += 1
        self._queue.put_nowait(item)

    def enqueue_deploy(self) -> None:
        self._put(_Item("deploy"))

    def enqueue_op(self, op_id: str, op: str, params: dict[str, Any]) -> None:
        self._put(_Item("op", op_id, op, params))

    def enqueue_hibernate(self) -> None:
        self._put(_Item("hibernate"))

    async def stop(self, *, hibernate: bool) -> None:
        """Free the trainer (saving it first if ``hibernate``) once everything queued before
        has run, and end the executor. Callers fail pending ops first, so those are skipped."""
        done = asyncio.get_running_loop().create_future()
        self._put(_Item("stop", params={"hibernate": hibernate}, done=done))
        await done

    async def _loop(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                if item.kind == "deploy":
                    with contextlib.suppress(OpFailed):  # recorded as FAILED, with the reason
                        await self._ensure_loaded()
                elif item.kind == "op":
                    await self._run_op(item)
                elif item.kind == "hibernate":
                    await self._hibernate_if_idle()
                elif item.kind == "stop":
                    await self._stop(item.params["hibernate"])
                    if item.done is not None and not item.done.done():
                        item.done.set_result(None)
                    return
            except Exception as exc:  # a bug here must not kill the run's queue...
                log.exception("run %s: %s failed", self.run_id, item.kind)
                if item.done is not None and not item.done.done():
                    item.done.set_result(None)
                if item.kind == "op":  # ...nor leave a poller waiting forever
                    row = self.ops.find(self.run_id, item.op_id)
                    if row is not None and row.status not in st.FINISHED_OP_STATUSES:
                        self.ops.finish(
                            self.run_id, item.op_id, error=f"Internal error in the local "
                            f"server ({type(exc).__name__}: {exc}); see `loops server logs`.",
                            error_class="InternalServerError")
            finally:
                self._outstanding -= 1

    # ── residency ──

    async def _ensure_loaded(self) -> None:
        if self.loaded:
            return
        run = self.run()
        dep = self.store.get_deployment(self.deployment_id)
        assert dep is not None
        if run.status != st.RUN_ACTIVE or dep.status in st.TERMINAL_DEPLOY_STATUSES:
            reason = f": {dep.status_reason}" if dep.status_reason else ""
            raise OpFailed(f"Run {run.id}'s trainer deployment is {dep.status}{reason}. "
                           "Start a new run (from a checkpoint if you have one).",
                           "DeploymentNotRunning")
        live_dir = self.files.live_state_dir(run.id)
        waking = dep.status == st.DEPLOY_SCALED_TO_ZERO
        restore: Path | None = None
        with_optimizer = True
        if live_dir.is_dir():
            restore = live_dir
        elif run.init_path:
            restore, with_optimizer = self.files.absolute(run.init_path), False
        self._set_status(st.DEPLOY_DEPLOYING)
        self._log("Waking from scale to zero: restoring the saved state." if waking else
                  f"Deploying trainer: {run.base_model}, LoRA rank {run.lora_rank}"
                  + (f", starting from {run.init_path}" if run.init_path else "") + ".")
        who = trainer_ops.TrainerIdentity(run.id, run.lora_rank, run.seed)
        started = time.monotonic()
        try:
            step = await self.worker.run(
                f"deploy {run.id}",
                lambda: trainer_ops.load_trainer(self.worker, who, restore, with_optimizer))
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._set_status(st.DEPLOY_FAILED, reason)
            self._log(f"Trainer failed to load: {reason}", "ERROR")
            log.exception("run %s: loading the trainer failed", run.id)
            raise OpFailed(f"Run {run.id}'s trainer failed to load ({reason}).",
                           "DeploymentFailed") from exc
        self.loaded = True
        self.last_snapshot = time.monotonic()
        run = self.run()
        if run.status != st.RUN_ACTIVE:
            # Deactivated while it loaded: the deactivation set the deployment's status and
            # queued the stop that releases what was just loaded; do not mark it RUNNING.
            raise OpFailed(run_inactive_error(run).detail, "RunInactive")
        if restore is live_dir and step != run.policy_version:
            self._log(f"Restored state is at step {step} but the run had reached step "
                      f"{run.policy_version}; the steps in between were lost in an unclean "
                      f"shutdown. Continuing from step {step}.", "WARNING")
            self.store.update_run(run.id, policy_version=step)
        self._set_status(st.DEPLOY_RUNNING)
        self.running.set()
        self._log(f"Trainer running at step {step} (ready in {time.monotonic() - started:.1f}s).")

    async def _save_live_state(self) -> None:
        live_dir = self.files.live_state_dir(self.run_id)
        await self.worker.run(f"snapshot {self.run_id}",
                              lambda: trainer_ops.save_live_state(self.worker, self.run_id,
                                                                  live_dir))
        self.last_snapshot = time.monotonic()

    async def _hibernate_if_idle(self) -> None:
        # Re-checked here: ops may have arrived between the janitor's check and now.
        run = self.run()
        if (not self.loaded or self._outstanding > 1 or run.status != st.RUN_ACTIVE
                or run.pending_grad_ops or not idle_long_enough(run)):
            return
        live_dir = self.files.live_state_dir(self.run_id)
        await self.worker.run(f"scale-to-zero {self.run_id}",
                              lambda: trainer_ops.hibernate(self.worker, self.run_id, live_dir))
        self.loaded = False
        self.running.clear()
        self._set_status(st.DEPLOY_SCALED_TO_ZERO)
        self._log(f"Idle for {run.scale_down_delay_seconds}s: scaled to zero (state saved; "
                  "the next op wakes the trainer).")

    async def _stop(self, hibernate: bool) -> None:
        if not self.loaded:
            return
        live_dir = self.files.live_state_dir(self.run_id)
        if hibernate:
            await self.worker.run(f"shutdown {self.run_id}",
                                  lambda: trainer_ops.hibernate(self.worker, self.run_id,
                                                                live_dir))
        else:
            await self.worker.run(f"release {self.run_id}",
                                  lambda: trainer_ops.release_trainer(self.worker, self.run_id))
        self.loaded = False
        self.running.clear()

    # ── ops ──

    async def _run_op(self, item: _Item) -> None:
        ops = self.ops
        row = ops.find(self.run_id, item.op_id)
        if row is None or row.status != st.OP_PENDING:
            return  # failed meanwhile (run deactivated)
        run = self.run()
        started = time.monotonic()
        outcome: trainer_ops.OpOutcome | None = None
        failure: tuple[str, str] | None = None  # (message, error class)
        try:
            if run.status != st.RUN_ACTIVE:
                raise OpFailed(run_inactive_error(run).detail, "RunInactive")
            if item.op == "optim_step" and run.gradients_lost:
                self.store.update_run(run.id, gradients_lost=0, pending_grad_ops=0)
                raise OpFailed(
                    "The gradients accumulated by forward_backward before the server "
                    "restarted were lost, so this optim_step would apply nothing. Redo the "
                    "forward_backward calls for this step, then optim_step again.",
                    "GradientsLost")
            await self._ensure_loaded()
            ops.mark_running(self.run_id, item.op_id)
            run = self.run()
            job = self._job(run, item)
            outcome = await self.worker.run(
                f"{item.op} {self.run_id}",
                lambda: trainer_ops.execute(self.worker, job, self.files))
        except OpFailed as exc:
            failure = (str(exc), exc.error_class)
        except Exception as exc:
            error_class = getattr(exc, "error_class", None)
            if self.engine.is_input_error(exc) and error_class:
                message = str(exc)
            else:
                log.exception("run %s: %s crashed", self.run_id, item.op)
                error_class = error_class or type(exc).__name__
                message = (f"{item.op} failed in the local engine: {type(exc).__name__}: {exc}. "
                           "The run is still usable; see `loops server logs` for the traceback.")
            failure = (message, error_class)
        elapsed = time.monotonic() - started
        # The op's bookkeeping in one commit: the run's next op waits for it.
        with self.store.transaction():
            self.store.add_usage(self.run_id, "run", compute_seconds=elapsed, operations=1)
            self.store.touch_run(self.run_id)
            if failure is not None:
                message, error_class = failure
                ops.finish(self.run_id, item.op_id, error=message, error_class=error_class)
                self._log(f"{item.op} failed: {message}", "ERROR", item.op_id)
                return
            assert outcome is not None
            self._apply(run, item, outcome)
            ops.finish(self.run_id, item.op_id, result=outcome.result)
            self._log(_describe(item, outcome, time.monotonic() - started), op_id=item.op_id)
        if (item.op in ("optim_step", "load_state", "load_state_with_optimizer",
                        "init_trainer_server")
                and time.monotonic() - self.last_snapshot
                >= self.snapshot_interval_s):
            await self._save_live_state()

    def _job(self, run: st.RunRow, item: _Item) -> trainer_ops.TrainerJob:
        """Resolve what the op needs from the database, on the event loop."""
        who = trainer_ops.TrainerIdentity(run.id, run.lora_rank, run.seed)
        params = dict(item.params)
        if item.op in ("save_state", "save_weights_for_sampler"):
            target = st.TARGET_TRAINER if item.op == "save_state" else st.TARGET_SAMPLER
            return trainer_ops.TrainerJob(item.op, who, params,
                                          checkpoint=CheckpointRef(run.id, target, params["name"]))
        if item.op in ("load_state", "load_state_with_optimizer"):
            return trainer_ops.TrainerJob(item.op, who, params,
                                          source_dir=self._load_source(run, params["path"]))
        if item.op == "init_trainer_server":
            params["was_trained"] = run.pending_grad_ops > 0
        return trainer_ops.TrainerJob(item.op, who, params)

    def _load_source(self, run: st.RunRow, path: str) -> Path:
        ref = parse_bt_path(path)
        if ref is None:
            local = Path(path.removeprefix("file://")).expanduser()
            if not local.is_dir():
                raise OpFailed(f"load_state path {path!r} is neither a bt://loops checkpoint nor "
                               "a directory on this machine.", "CheckpointNotFound")
            return local
        if ref.target != st.TARGET_TRAINER:
            raise OpFailed(f"{path} holds sampler weights (adapter only, no optimizer state). "
                           "load_state needs trainer state: "
                           f"bt://loops:{ref.run_id}/weights/<name> (saved with save_state).",
                           "WrongCheckpointTarget")
        cp = self.store.find_checkpoint(ref.run_id, ref.target, ref.name)
        if cp is None:
            raise OpFailed(f"No checkpoint {path}. List them with "
                           f"GET /v1/loops/checkpoints?run_id={ref.run_id}.", "CheckpointNotFound")
        if cp.base_model != run.base_model:
            raise OpFailed(f"{path} was trained on {cp.base_model}, but this run's base model "
                           f"is {run.base_model}.", "BaseModelMismatch")
        if cp.lora_rank != run.lora_rank:
            raise OpFailed(f"{path} has LoRA rank {cp.lora_rank}, but this run uses rank "
                           f"{run.lora_rank}. Create the run with lora_rank={cp.lora_rank}.",
                           "LoraRankMismatch")
        return self.files.absolute(cp.storage_dir)

    def _apply(self, run: st.RunRow, item: _Item, outcome: trainer_ops.OpOutcome) -> None:
        store = self.store
        fields: dict[str, Any] = {"policy_version": outcome.step}
        if outcome.lora_rank != run.lora_rank:
            fields["lora_rank"] = outcome.lora_rank
        if outcome.grads == trainer_ops.GRADS_ADDED:
            fields["pending_grad_ops"] = run.pending_grad_ops + 1
        elif outcome.grads == trainer_ops.GRADS_CLEARED:
            fields["pending_grad_ops"] = 0
            fields["gradients_lost"] = 0
        store.update_run(run.id, **fields)
        if outcome.tokens_trained:
            store.add_usage(run.id, "run", tokens_trained=outcome.tokens_trained)
        saved = outcome.checkpoint
        if saved is not None:
            ttl = item.params.get("ttl_seconds")
            cp = store.upsert_checkpoint(
                run_id=run.id, name=saved.ref.name, target=saved.ref.target,
                base_model=run.base_model, lora_rank=outcome.lora_rank,
                policy_version=saved.policy_version, size_bytes=saved.size_bytes,
                storage_dir=saved.storage_dir, manifest=saved.manifest,
                expires_at=time.time() + ttl if ttl else None)
            if item.op == "save_weights_for_sampler" and item.params.get("bump_version"):
                self.samplers.publish(run.id, cp)


def _describe(item: _Item, outcome: trainer_ops.OpOutcome, elapsed: float) -> str:
    detail = ""
    if item.op in ("forward", "forward_backward"):
        loss = outcome.result.get("loss")
        if loss is None:
            loss = (outcome.result.get("metrics") or {}).get("loss")
        detail = f": {len(item.params['data'])} datums, {item.params['token_count']} tokens"
        if isinstance(loss, (int, float)):
            detail += f", loss {loss:.4f}"
    elif item.op == "optim_step":
        detail = f": step {outcome.step}"
    elif outcome.checkpoint is not None:
        detail = f": {outcome.checkpoint.ref.uri} ({outcome.checkpoint.size_bytes} bytes)"
    elif item.op.startswith("load_state"):
        detail = f": {item.params['path']} (step {outcome.step})"
    return f"{item.op}{detail} ({elapsed:.2f}s)"


class RunManager:
    def __init__(self, config: ServerConfig, store: st.Store, pool: ComputePool,
                 files: CheckpointFiles, ops: OperationRegistry, models: ModelCatalog,
                 samplers: SamplerService) -> None:
        self.config = config
        self.store = store
        self.pool = pool
        self.engine = pool.engine
        self.files = files
        self.ops = ops
        self.models = models
        self.samplers = samplers
        self.log = store.append_log  # a line in a deployment's logs
        self._executors: dict[str, RunExecutor] = {}
        self._submit_locks: dict[str, asyncio.Lock] = {}

    def executor(self, run: st.RunRow) -> RunExecutor:
        executor = self._executors.get(run.id)
        if executor is None:
            executor = self._executors[run.id] = RunExecutor(
                run, store=self.store, ops=self.ops, files=self.files,
                worker=self.pool.worker(run.base_model), samplers=self.samplers,
                snapshot_interval_s=self.config.snapshot_interval_s)
        return executor

    def loaded_runs(self) -> list[str]:
        return sorted(r for r, e in self._executors.items() if e.loaded)

    # ── queries ──

    def find(self, run_id: str) -> st.RunRow | None:
        return self.store.get_run(run_id)

    def describe(self, run: st.RunRow) -> RunDescription:
        return RunDescription(run, self.store.paired_sampler(run.id, live_only=False))

    def search(self, *, run_id: str | None = None, base_model: str | None = None,
               team_id: str | None = None) -> list[RunDescription]:
        """Runs (newest first), filtered by id, base model and team when given."""
        return [self.describe(run) for run in self.store.list_runs(
            run_id=run_id, base_model=base_model, team_id=team_id)]

    def active_count(self) -> int:
        return len(self.store.list_runs(status=st.RUN_ACTIVE))

    async def heartbeat(self, run: st.RunRow, hold_s: float) -> str:
        """``GET <trainer>/health``, which the SDK's heartbeat pings to keep a dedicated
        trainer warm: mark the run active and answer its trainer deployment's status, holding
        up to ``hold_s`` for a deploying trainer to come up. RUNNING, or SCALED_TO_ZERO (the
        next op wakes it), is reachable; otherwise 409 (run deactivated) or 503 (failed to
        load, or still loading: retry)."""
        if run.status != st.RUN_ACTIVE:
            raise run_inactive_error(run)
        self.store.touch_run(run.id)
        dep = self.store.get_deployment(run.deployment_id)
        assert dep is not None
        if dep.status in (st.DEPLOY_CREATED, st.DEPLOY_DEPLOYING):
            await self.wait_until_running(run, hold_s)
            dep = self.store.get_deployment(run.deployment_id)
            assert dep is not None
        if dep.status == st.DEPLOY_FAILED:
            raise ApiError(503, f"Run {run.id}'s trainer failed to load: {dep.status_reason}. "
                                "Start a new run; see `loops server logs`.", "DeploymentFailed")
        if dep.status in (st.DEPLOY_CREATED, st.DEPLOY_DEPLOYING):
            raise ApiError(503, f"Run {run.id}'s trainer is still loading; retry shortly.",
                           "TrainerStarting", headers={"Retry-After": "1"})
        return dep.status

    # ── startup / shutdown ──

    def recover_after_restart(self) -> None:
        """After a restart or crash nothing is in memory: every active run's trainer (and
        every live sampler) comes back scaled to zero, waking on its next op from the state
        saved at shutdown (or its last snapshot); whatever a crash left of a deactivation
        is finished. Every route then reports the same state (store.reconcile_after_restart)."""
        store = self.store
        for run in store.list_runs(status=st.RUN_ACTIVE):
            if run.pending_grad_ops:
                store.update_run(run.id, pending_grad_ops=0, gradients_lost=1)
        for deployment_id, status in store.reconcile_after_restart():
            self.log(deployment_id, {
                st.DEPLOY_SCALED_TO_ZERO: "Server restarted: scaled to zero; the next request "
                                          "wakes it (a trainer from its last saved state).",
                st.DEPLOY_STOPPED: "Server restarted: the run was deactivated; trainer stopped.",
                st.SAMPLER_INACTIVE: "Server restarted: the run was deactivated; sampler "
                                     "deactivated.",
            }[status])

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        """Save every loaded trainer so the runs resume after a restart."""
        executors = list(self._executors.values())
        for executor in executors:
            self.ops.fail_pending(
                executor.run_id, "The local loops server shut down before this operation "
                "ran. Resubmit it after restarting the server.", "ServerShutdown")
        if executors:
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(e.stop(hibernate=True) for e in executors)), timeout_s)
            except asyncio.TimeoutError:
                log.warning("shutdown: saving trainers timed out after %.0fs", timeout_s)
        for executor in executors:
            if not executor.loaded and executor.run().status == st.RUN_ACTIVE:
                self.store.set_deployment_status(executor.deployment_id,
                                                     st.DEPLOY_SCALED_TO_ZERO)
        self._executors.clear()

    # ── create / deactivate ──

    async def create(self, req: CreateRunRequest, team_id: str | None) -> st.RunRow:
        session = self.store.get_session(req.session_id)
        if session is None:
            raise bad_request(f"Unknown session_id {req.session_id!r}. Create one with "
                              "POST /v1/loops/sessions.", "SessionNotFound")
        if req.base_checkpoint is not None:
            raise bad_request("base_checkpoint (hf://...) needs a download from Hugging Face, "
                              "which the local backend does not do. Use a model from "
                              "GET /v1/loops/capabilities.", "Unsupported")
        spec = await self.models.spec(req.base_model)
        max_seq_len = req.max_seq_len or spec.max_seq_len
        if max_seq_len > spec.max_seq_len:
            raise bad_request(f"max_seq_len {max_seq_len} exceeds {spec.name}'s maximum of "
                              f"{spec.max_seq_len}.", "SequenceTooLong")
        init_path = None
        if req.path is not None:
            ref = require_bt_path(req.path, what="path")
            cp = self.store.find_checkpoint(ref.run_id, ref.target, ref.name)
            if cp is None or ref.target != st.TARGET_TRAINER:
                raise bad_request(f"path {req.path!r} is not a saved trainer checkpoint "
                                  "(bt://loops:<run>/weights/<name>).", "CheckpointNotFound")
            if cp.base_model != spec.name:
                raise bad_request(f"path {req.path} was trained on {cp.base_model}, not "
                                  f"{spec.name}.", "BaseModelMismatch")
            if cp.lora_rank != req.lora_rank:
                raise bad_request(f"path {req.path} has LoRA rank {cp.lora_rank}; create the "
                                  f"run with lora_rank={cp.lora_rank}.", "LoraRankMismatch")
            init_path = cp.storage_dir
        run = self.store.create_run(
            session_id=session.id, team_id=team_id, name=req.name or spec.name,
            base_model=spec.name, lora_rank=req.lora_rank, max_seq_len=max_seq_len,
            seed=req.seed, scale_down_delay_seconds=req.scale_down_delay_seconds,
            availability_model=req.availability_model, replicas=req.replicas,
            init_path=init_path)
        self.log(run.deployment_id, f"Created run {run.id} ({spec.name}, LoRA rank "
                                    f"{run.lora_rank}, max_seq_len {max_seq_len}).")
        if req.replicas > 1:
            self.log(run.deployment_id, f"replicas={req.replicas} requested; the local backend "
                                        "runs a single replica.", level="WARNING")
        if req.reuse_from_run_id or req.reuse_from_session_id:
            self.log(run.deployment_id, "Reuse was requested; local trainers start in seconds, "
                                        "so a fresh one was started.")
        self.executor(run).enqueue_deploy()
        return run

    async def deactivate(self, run: st.RunRow) -> None:
        if run.status == st.RUN_INACTIVE:
            return
        paired = self.store.paired_sampler(run.id)
        self.store.deactivate_run(run.id, run.deployment_id)
        self.ops.fail_pending(run.id, f"Run {run.id} was deactivated before this operation "
                              "ran.", "RunInactive")
        if paired is not None:
            self.samplers.released(paired)
        self.log(run.deployment_id, "Run deactivated; trainer stopped. Checkpoints are kept.")
        executor = self._executors.pop(run.id, None)
        self._submit_locks.pop(run.id, None)
        if executor is not None:
            await executor.stop(hibernate=False)
        shutil.rmtree(self.files.live_state_dir(run.id).parent, ignore_errors=True)

    # ── ops ──

    async def submit(self, run: st.RunRow, op: str, body: dict[str, Any],
                     idempotency_key: str | None) -> st.OperationRow:
        """Accept an op: dedupe its key, validate it, queue it behind the run's earlier ops.

        Submits of one run are handled one at a time (validation awaits a thread), so
        ops are queued in the order they arrived and a retried submit racing its
        original cannot create a second op.
        """
        lock = self._submit_locks.setdefault(run.id, asyncio.Lock())
        async with lock:
            if idempotency_key:
                existing = self.ops.find(run.id, idempotency_key)
                if existing is not None:
                    if existing.op != op:
                        raise conflict(f"Idempotency-Key {idempotency_key!r} was already used "
                                       f"for {existing.op} on this run; use a fresh key per "
                                       "operation.", "IdempotencyKeyReused")
                    return existing
            run = self.store.get_run(run.id) or run
            if run.status != st.RUN_ACTIVE:
                raise run_inactive_error(run)
            model = body.get("model")
            if model is not None and model != run.base_model:
                raise bad_request(f"This trainer serves {run.base_model}, but the request names "
                                  f"model {model!r}.", "BaseModelMismatch")
            params = await self._validate(run, op, body)
            seq_id = body.get("seq_id") if isinstance(body.get("seq_id"), int) else None
            row = self.ops.create(run.id, op, idempotency_key, seq_id)
            self.store.touch_run(run.id)
            self.executor(run).enqueue_op(row.id, op, params)
            return row

    async def _validate(self, run: st.RunRow, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if op in ("forward", "forward_backward"):
            spec = await self.models.spec(run.base_model)
            req = await validate_forward(self.engine, body, spec, run.max_seq_len)
            return {"data": req.data, "loss_fn": req.loss_fn, "loss_fn_config": req.loss_fn_config,
                    "top_k_logprobs": req.top_k_logprobs, "token_count": req.token_count,
                    "parsed": req.parsed}
        if op == "optim_step":
            return {"adam_params": validate_adam(body)}
        if op in ("save_state", "save_weights_for_sampler"):
            ttl = body.get("ttl_seconds")
            if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 1):
                raise bad_request(f"ttl_seconds must be a positive integer or null, got {ttl!r}.",
                                  "InvalidRequest")
            return {"name": validate_name(body.get("name", "default")), "ttl_seconds": ttl,
                    "bump_version": bool(body.get("bump_version", False))}
        if op in ("load_state", "load_state_with_optimizer"):
            path = body.get("path")
            if not isinstance(path, str) or not path:
                raise bad_request(f"{op} needs 'path': bt://loops:<run>/weights/<name> or a "
                                  "local directory.", "InvalidRequest")
            return {"path": path}
        if op == "init_trainer_server":
            rank = body.get("lora_rank", run.lora_rank)
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
                raise bad_request(f"lora_rank must be an integer >= 1, got {rank!r}.",
                                  "InvalidRequest")
            base_model = body.get("base_model")
            if base_model is not None and base_model != run.base_model:
                raise bad_request(f"This trainer serves {run.base_model}, not {base_model!r}.",
                                  "BaseModelMismatch")
            return {"lora_rank": rank}
        raise AssertionError(op)

    # ── scale to zero ──

    def sweep(self, now: float) -> None:
        """Janitor tick: queue scale-down for runs idle past their delay."""
        for run_id, executor in list(self._executors.items()):
            if not executor.loaded or not executor.idle:
                continue
            run = self.store.get_run(run_id)
            if run is None or run.status != st.RUN_ACTIVE:
                continue
            if run.pending_grad_ops:
                continue  # releasing now would silently drop accumulated gradients
            if idle_long_enough(run, now):
                executor.enqueue_hibernate()

    async def wait_until_running(self, run: st.RunRow, timeout_s: float) -> bool:
        executor = self.executor(run)
        if executor.running.is_set():
            return True
        try:
            await asyncio.wait_for(executor.running.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
