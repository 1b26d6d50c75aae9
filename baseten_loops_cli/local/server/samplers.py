"""Samplers: paired (serving a run's latest published adapter) and standalone (a base
model, or one sampler-weights checkpoint), plus the batched path to the engine.

Weight sync follows the dedicated-sampler protocol (loops-protocol.md §1.4, §3.3):

- ``save_weights_for_sampler(bump_version=True)`` *publishes*: the run's paired sampler
  serves that checkpoint from then on, at ``policy_version`` = the trainer step it was
  saved at (0 = nothing trained yet: serve the base model).
- ``X-Min-Policy-Version: N`` on ``/sample``: serve only once the live adapter is at
  version >= N. Publishing is synchronous here, so the sampler is behind only until the
  save op finishes; the request holds briefly for that, then answers 408 (the SDK retries).
- ``X-Checkpoint-Path: bt://...``: serve that checkpoint; with a floor, serve it only until
  the live adapter reaches the floor.

Concurrent ``/sample`` requests are batched: requests arriving within a few milliseconds
of each other go to the engine as one call (one padded batch on the model's compute
thread instead of N serial generations).

Streaming (:meth:`SamplerService.stream`): the engine calls the job's ``on_token`` on the
compute thread after every decoded token; the callback hands the token to the request's
event loop through a queue, so the HTTP response sends it while the batch keeps decoding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.store import SamplerRow as SamplerRow  # rows it answers with
from baseten_loops_cli.local.engine.sample_types import SampleRequest, SampleResult
from baseten_loops_cli.local.server.checkpoints import (
    CheckpointFiles,
    parse_bt_path,
    require_bt_path,
)
from baseten_loops_cli.local.server.compute import SAMPLE, ComputePool, ModelWorker
from baseten_loops_cli.local.server.config import ServerConfig
from baseten_loops_cli.local.server.model_catalog import ModelCatalog
from baseten_loops_cli.local.server.errors import ApiError, bad_request, conflict, not_found
from baseten_loops_cli.local.server.schemas import DEFAULT_SCALE_DOWN_DELAY_S, CreateSamplerRequest

log = logging.getLogger("loops.server.samplers")


@dataclass(frozen=True)
class Adapter:
    """A sampler-weights checkpoint as the engine loads it. ``key`` changes whenever the
    files do (a re-save of the same name), so engine-side caches never serve stale weights."""

    checkpoint_pk: str
    name: str
    path: Path
    version: int
    key: str
    # A paired sampler's live adapter: its versions share engine slots (SampleRequest.adapter_family).
    family: str | None = None


_STREAM_END = object()


# A batch that keeps growing leaves at the latest this many windows after its first request.
MAX_WAIT_WINDOWS = 5


class SampleBatcher:
    """Collects concurrent requests for one base model into engine batches.

    A batch leaves once no request has joined it for ``window_s`` (at most
    :data:`MAX_WAIT_WINDOWS` windows after its first request), or at ``max_batch`` requests.
    The window restarts with each arrival because a burst reaches a busy server spread out:
    the 8 requests of an async RL batch, sent together while the server trained, arrived over
    up to 47 ms, so a window counted from the first request split one batch in two engine calls
    in a step out of four, and the second waited for the first.

    Only one batch per model is with the engine at a time: requests arriving meanwhile wait
    and go together in the next batch, so under load batches grow instead of queueing one by
    one behind each other on the model's thread.
    """

    def __init__(self, worker: ModelWorker, window_s: float, max_batch: int) -> None:
        self.worker = worker
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: list[tuple[SampleRequest, asyncio.Future]] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._opened_at = 0.0
        self._in_flight: asyncio.Task | None = None
        self.batches = 0
        self.largest_batch = 0

    async def submit(self, job: SampleRequest) -> SampleResult:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((job, future))
        if len(self._pending) >= self.max_batch:
            self._flush()
            return await future
        now = loop.time()
        if len(self._pending) == 1:
            self._opened_at = now
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        leaves = min(now + self.window_s, self._opened_at + MAX_WAIT_WINDOWS * self.window_s)
        self._flush_handle = loop.call_at(leaves, self._flush)
        return await future

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._in_flight is not None or not self._pending:
            return  # sent when the batch in flight comes back
        batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        jobs = [job for job, _ in batch]
        worker = self.worker
        done = worker.submit(f"sample x{len(jobs)}",
                             lambda: worker.engine.sample(worker.sampler(), jobs), lane=SAMPLE)
        self._in_flight = asyncio.get_running_loop().create_task(self._deliver(done, batch))

    async def _deliver(self, done, batch: list[tuple[SampleRequest, asyncio.Future]]) -> None:
        try:
            outputs = await asyncio.wrap_future(done)
        except Exception as exc:
            outputs = [exc] * len(batch)
        finally:
            self._in_flight = None
            self._flush()  # whatever arrived meanwhile goes now
        for (_, future), output in zip(batch, outputs):
            if future.done():  # the client went away
                continue
            if isinstance(output, BaseException):
                future.set_exception(output)
            else:
                future.set_result(output)


class SamplerService:
    def __init__(self, config: ServerConfig, store: st.Store, pool: ComputePool,
                 files: CheckpointFiles, models: ModelCatalog) -> None:
        self.config = config
        self.store = store
        self.pool = pool
        self.engine = pool.engine
        self.files = files
        self.models = models
        self.log = store.append_log  # a line in a deployment's logs
        self._batchers: dict[str, SampleBatcher] = {}
        # Set (and replaced) whenever a sampler's live adapter changes, waking requests
        # that hold for X-Min-Policy-Version.
        self._published: dict[str, asyncio.Event] = {}

    def batcher(self, base_model: str) -> SampleBatcher:
        batcher = self._batchers.get(base_model)
        if batcher is None:
            cfg = self.config
            batcher = self._batchers[base_model] = SampleBatcher(
                self.pool.worker(base_model), cfg.sample_batch_window_s, cfg.max_sample_batch)
        return batcher

    async def generate(self, base_model: str, job: SampleRequest) -> SampleResult:
        """Sample through the batcher; the engine's input errors become 400s."""
        try:
            return await self.batcher(base_model).submit(job)
        except Exception as exc:
            if self.engine.is_input_error(exc):
                raise bad_request(str(exc), getattr(exc, "error_class", "InvalidInput")) from None
            raise

    async def stream(self, base_model: str, job: SampleRequest) -> AsyncIterator[Any]:
        """Sample ``job`` token by token: yields the engine's ``TokenEvent`` for every token
        as it is decoded, then the complete ``SampleResult`` (errors raise as in
        :meth:`generate`). A client that goes away stops waiting; the batch it was in
        still finishes (other requests share it)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        pause_hook = self.pool.after_token  # test fault hook (pauses decoding)

        def on_token(event: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)
            if pause_hook is not None:
                pause_hook()

        job.on_token = on_token
        done = asyncio.ensure_future(self.generate(base_model, job))
        # Queued after every token: the engine hands them over before its result.
        done.add_done_callback(lambda _: events.put_nowait(_STREAM_END))
        try:
            while (event := await events.get()) is not _STREAM_END:
                yield event
            yield done.result()
        finally:
            done.cancel()

    def stats(self) -> dict[str, Any]:
        return {name: {"batches": b.batches, "largest_batch": b.largest_batch}
                for name, b in self._batchers.items()}

    # ── create / lookup ──

    async def create(self, req: CreateSamplerRequest, team_id: str | None) -> st.SamplerRow:
        store = self.store
        if store.get_session(req.session_id) is None:
            raise bad_request(f"Unknown session_id {req.session_id!r}. Create one with "
                              "POST /v1/loops/sessions.", "SessionNotFound")
        chosen = [k for k in ("base_model", "run_id", "model_path") if getattr(req, k)]
        if len(chosen) != 1:
            raise bad_request("Pass exactly one of base_model (standalone), run_id (paired with "
                              f"a run) or model_path (a sampler checkpoint); got "
                              f"{', '.join(chosen) or 'none'}.", "InvalidRequest")
        if req.run_id:
            return await self.ensure_paired(req.run_id, req, team_id)
        if req.model_path:
            ref = require_bt_path(req.model_path, what="model_path")
            if ref.target != st.TARGET_SAMPLER:
                raise bad_request(f"model_path {req.model_path} is trainer state; samplers serve "
                                  "sampler weights: "
                                  f"bt://loops:{ref.run_id}/sampler_weights/<name>.",
                                  "WrongCheckpointTarget")
            cp = store.find_checkpoint(ref.run_id, ref.target, ref.name)
            if cp is None:
                raise bad_request(f"No checkpoint {req.model_path}.", "CheckpointNotFound")
            spec = await self.models.spec(cp.base_model)
            self._check_length(req.max_seq_length, spec)
            sampler = store.create_sampler(
                session_id=req.session_id, team_id=team_id, run_id=None, base_model=cp.base_model,
                model_path=req.model_path, checkpoint_pk=cp.pk, max_seq_length=req.max_seq_length,
                num_replicas=req.num_replicas, scale_down_delay_seconds=DEFAULT_SCALE_DOWN_DELAY_S,
                policy_version=cp.policy_version)
        else:
            spec = await self.models.spec(req.base_model or "")
            self._check_length(req.max_seq_length, spec)
            sampler = store.create_sampler(
                session_id=req.session_id, team_id=team_id, run_id=None, base_model=spec.name,
                model_path=None, checkpoint_pk=None, max_seq_length=req.max_seq_length,
                num_replicas=req.num_replicas, scale_down_delay_seconds=DEFAULT_SCALE_DOWN_DELAY_S)
        self.log(sampler.deployment_id, f"Sampler {sampler.id} serving "
                                        f"{sampler.model_path or sampler.base_model}.")
        return sampler

    @staticmethod
    def _check_length(max_seq_length: int | None, spec) -> None:
        if max_seq_length is not None and max_seq_length > spec.max_seq_len:
            raise bad_request(f"max_seq_length {max_seq_length} exceeds {spec.name}'s maximum of "
                              f"{spec.max_seq_len}.", "SequenceTooLong")

    async def ensure_paired(self, run_id: str, req: CreateSamplerRequest | None,
                            team_id: str | None) -> st.SamplerRow:
        """The run's paired sampler, created on first request (idempotent per run)."""
        store = self.store
        run = store.get_run(run_id)
        if run is None:
            raise bad_request(f"Unknown run_id {run_id!r}.", "RunNotFound")
        if run.status != st.RUN_ACTIVE:
            raise conflict(f"Run {run_id} is deactivated; it cannot get a sampler. Serve one of "
                           "its checkpoints with a model_path sampler instead.", "RunInactive")
        if req is not None and req.availability_model not in (None, run.availability_model):
            raise bad_request(f"A paired sampler inherits its run's availability_model "
                              f"({run.availability_model}); got {req.availability_model!r}.",
                              "InvalidRequest")
        existing = store.paired_sampler(run_id)
        if existing is not None:
            return existing
        sampler = store.create_sampler(
            session_id=req.session_id if req else run.session_id, team_id=team_id or run.team_id,
            run_id=run.id, base_model=run.base_model, model_path=None,
            checkpoint_pk=run.published_checkpoint_pk,
            max_seq_length=(req.max_seq_length if req else None) or run.max_seq_len,
            num_replicas=req.num_replicas if req else None,
            scale_down_delay_seconds=run.scale_down_delay_seconds,
            policy_version=run.published_version)
        self.log(sampler.deployment_id, f"Paired sampler {sampler.id} for run {run.id}.")
        self.log(run.deployment_id, f"Paired sampler {sampler.id} created.")
        return sampler

    def list_for_team(self, team_id: str | None) -> list[st.SamplerRow]:
        """Samplers (newest first): the team's, or every one when ``team_id`` is None."""
        return self.store.list_samplers(team_id)

    def get(self, sampler_id: str) -> st.SamplerRow:
        sampler = self.store.get_sampler(sampler_id)
        if sampler is None:
            raise not_found("sampler", sampler_id, "List samplers with GET /v1/loops/samplers.")
        return sampler

    @staticmethod
    def check_serving(sampler: st.SamplerRow) -> None:
        """409 for a deactivated sampler (a scaled-to-zero one serves: the request wakes it)."""
        if sampler.status == st.SAMPLER_INACTIVE:
            raise ApiError(409, f"Sampler {sampler.id} was deactivated; create a new one.",
                           "SamplerInactive")

    def record_sample(self, sampler: st.SamplerRow, tokens_sampled: int, *,
                      checkpoint_pk: str | None = None) -> None:
        """A ``/sample`` request finished: count it (for the run, if the sampler is a run's
        paired sampler; also for the run whose checkpoint ``checkpoint_pk`` served it) and
        keep the sampler awake."""
        owner, kind = (sampler.run_id, "run") if sampler.run_id else (sampler.id, "sampler")
        self.store.add_usage(owner, kind, tokens_sampled=tokens_sampled, sample_requests=1,
                             checkpoint_pk=checkpoint_pk)
        self.store.update_sampler(sampler.id, last_active_at=time.time())

    def deactivate(self, sampler: st.SamplerRow) -> None:
        if sampler.status == st.SAMPLER_INACTIVE:
            return
        self.store.update_sampler(sampler.id, status=st.SAMPLER_INACTIVE,
                                  deactivated_at=time.time())
        self.released(sampler)

    def released(self, sampler: st.SamplerRow) -> None:
        """``sampler`` was just deactivated (alone, or with its run): free its adapter and
        wake requests waiting on it (they then answer 409)."""
        self._release_adapter(sampler)
        self.log(sampler.deployment_id, "Sampler deactivated.")
        self._notify(sampler.id)

    # ── weight sync ──

    def publish(self, run_id: str, cp: st.CheckpointRow) -> None:
        """``save_weights_for_sampler(bump_version=True)`` finished: the paired sampler now
        serves ``cp`` at version ``cp.policy_version``."""
        store = self.store
        store.update_run(run_id, published_checkpoint_pk=cp.pk,
                         published_version=cp.policy_version)
        sampler = store.paired_sampler(run_id)
        if sampler is not None:
            store.update_sampler(sampler.id, live_checkpoint_pk=cp.pk,
                                 policy_version=cp.policy_version)
            self.log(sampler.deployment_id, f"Hot-swapped to {cp.bt_path} (policy version "
                                            f"{cp.policy_version}).")
            self._notify(sampler.id)

    def _notify(self, sampler_id: str) -> None:
        event = self._published.pop(sampler_id, None)
        if event is not None:
            event.set()

    async def wait_for_publish(self, sampler_id: str, timeout_s: float) -> None:
        event = self._published.setdefault(sampler_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def adapter(self, cp: st.CheckpointRow) -> Adapter:
        return Adapter(cp.pk, cp.name, self.files.absolute(cp.storage_dir),
                       cp.policy_version, f"{cp.pk}@{cp.created_at:.6f}")

    async def choose_adapter(
        self, sampler: st.SamplerRow, pin: str | None, floor: int | None
    ) -> tuple[Adapter | None, int]:
        """Which weights serve this request, and the policy version to report.

        Raises 408 while a floor is above the live adapter and no pin can stand in.
        """
        hold_until = time.monotonic() + self.config.min_version_hold_s
        while True:
            sampler = self.store.get_sampler(sampler.id) or sampler
            if sampler.status == st.SAMPLER_INACTIVE:
                raise conflict(f"Sampler {sampler.id} was deactivated.", "SamplerInactive")
            live_version = sampler.policy_version
            if floor is None or live_version >= floor:
                if pin is not None and floor is None:
                    return self._pinned(sampler, pin)
                return self.live_adapter(sampler), live_version
            if pin is not None:
                return self._pinned(sampler, pin)
            remaining = hold_until - time.monotonic()
            if remaining <= 0:
                raise ApiError(
                    408, f"Sampler {sampler.id} serves policy version {live_version}, below the "
                         f"requested minimum {floor}. It catches up when the run's "
                         "save_weights_for_sampler finishes; retry.",
                    "PolicyVersionBehind", extra={"policy_version": live_version})
            await self.wait_for_publish(sampler.id, remaining)

    def live_adapter(self, sampler: st.SamplerRow) -> Adapter | None:
        if sampler.live_checkpoint_pk is None:
            return None
        if sampler.run_id is not None and sampler.policy_version == 0:
            return None  # version 0: nothing trained yet, the base model serves
        cp = self.store.get_checkpoint(sampler.live_checkpoint_pk)
        if cp is None:
            return None
        # Each save_weights_for_sampler of the run republishes it: a new version replaces the
        # last in the engine rather than taking a slot of its own.
        return replace(self.adapter(cp), family=f"live:{sampler.id}")

    def _pinned(self, sampler: st.SamplerRow, pin: str) -> tuple[Adapter | None, int]:
        ref = parse_bt_path(pin)
        if ref is None or ref.target != st.TARGET_SAMPLER:
            raise bad_request(f"X-Checkpoint-Path {pin!r} must be a sampler checkpoint: "
                              "bt://loops:<run>/sampler_weights/<name>.", "InvalidCheckpointPath")
        cp = self.store.find_checkpoint(ref.run_id, ref.target, ref.name)
        if cp is None:
            raise bad_request(f"No checkpoint {pin}.", "CheckpointNotFound")
        if cp.base_model != sampler.base_model:
            raise bad_request(f"{pin} was trained on {cp.base_model}; this sampler serves "
                              f"{sampler.base_model}.", "BaseModelMismatch")
        return self.adapter(cp), cp.policy_version

    # ── scale to zero ──

    def sweep(self, now: float) -> None:
        """Scale down the samplers idle for their scale_down_delay_seconds, but never one
        woken or used in the last ``sampler_min_awake_s`` (a short delay would beat the
        SDK's 10 s status poll after its one /wake, and ensure_ready would wait forever)."""
        store = self.store
        floor = self.config.sampler_min_awake_s
        for sampler in store.list_samplers():
            if (sampler.status == st.SAMPLER_ACTIVE
                    and now - sampler.last_active_at >= max(sampler.scale_down_delay_seconds, floor)):
                store.update_sampler(sampler.id, status=st.SAMPLER_SCALED_TO_ZERO)
                self._release_adapter(sampler)
                self.log(sampler.deployment_id, "Idle: scaled to zero (the next request "
                                                "or POST /wake brings it back).")

    def _release_adapter(self, sampler: st.SamplerRow) -> None:
        """Unload the idle sampler's adapter from the engine (it reloads on the next
        request). Other samplers serving the same checkpoint reload it too: cheap."""
        adapter = self.live_adapter(sampler)
        if adapter is None:
            return
        worker = self.pool.worker(sampler.base_model)
        worker.submit(f"unload {adapter.key}", lambda: worker.unload_sampler_adapter(adapter.key), lane=SAMPLE)

    def wake(self, sampler: st.SamplerRow) -> st.SamplerRow:
        if sampler.status == st.SAMPLER_INACTIVE:
            raise conflict(f"Sampler {sampler.id} was deactivated; create a new one.",
                           "SamplerInactive")
        self.store.update_sampler(sampler.id, status=st.SAMPLER_ACTIVE,
                                      last_active_at=time.time())
        if sampler.status == st.SAMPLER_SCALED_TO_ZERO:
            self.log(sampler.deployment_id, "Woken up.")
        return self.store.get_sampler(sampler.id)  # type: ignore[return-value]
