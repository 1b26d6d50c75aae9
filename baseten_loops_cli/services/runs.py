"""Runs: list (with the recent-runs rule), describe, wait for a trainer, watch, page and follow
logs, and deactivate many runs or samplers (one flow for both).

Which runs a plain listing shows (:func:`list_runs`): the ACTIVE ones. ``loops train run``
deactivates its run when it ends, so right after a tour every run is INACTIVE and "show the
active ones" would show nothing; when no run is active, the runs created in the last
:data:`RECENT_WINDOW_S` are shown instead, whatever their status. Either way ``hidden`` says how
many rows were left out, for the command's ``--all`` hint.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from baseten_loops_cli.api.models import DeactivateResponse, Log, LoopsCheckpoint, LoopsDeployment, LoopsRun, LoopsSampler
from baseten_loops_cli.api.polling import Clock, Poll, Sleep
from baseten_loops_cli.errors import LoopsError, RunFailedError
from baseten_loops_cli.services.resolve import (
    TRAINER_FAILED,
    TRAINER_TERMINAL,
    created_key,
    get_run,
    get_sampler,
    sampler_is_terminal,
)

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.services import Connected as Backend

RECENT_WINDOW_S = 24 * 3600
LOG_PAGE_SIZE = 1000
TAIL_POLL_S = 2.0
STATUS_POLL_S = 5.0
SORT_KEYS = ("created", "name", "base-model", "status")


# ── list ──────────────────────────────────────────────────────────────────────────────────


class RunListing(BaseModel):
    runs: list[LoopsRun]
    total: int  # after the status rule, before --limit
    hidden: int  # left out by the status rule
    recent: bool = False  # no run is active: the runs of the last RECENT_WINDOW_S are shown


def select_runs(runs: Sequence[Any], *, include_inactive: bool, now: float | None = None) -> tuple[list[Any], int, bool]:
    """(shown, hidden, recent) by the rule in the module docstring. Works on anything with
    ``is_active`` and ``created_at`` (runs)."""
    runs = list(runs)
    if include_inactive:
        return runs, 0, False
    active = [r for r in runs if r.is_active]
    if active or not runs:
        return active, len(runs) - len(active), False
    cutoff = (now if now is not None else time.time()) - RECENT_WINDOW_S
    recent = [r for r in runs if r.created_at is not None and r.created_at.timestamp() >= cutoff]
    return recent, len(runs) - len(recent), bool(recent)


def sort_runs(runs: list[LoopsRun], sort: str, reverse: bool) -> list[LoopsRun]:
    keys: dict[str, Callable[[LoopsRun], Any]] = {
        "created": created_key,
        "name": lambda r: (r.name or "").lower(),
        "base-model": lambda r: r.base_model.lower(),
        "status": lambda r: r.status_name,
    }
    # Newest first by default (the Go CLI's --direction desc); names and models A→Z.
    ordered = sorted(runs, key=created_key, reverse=True)
    ordered = sorted(ordered, key=keys[sort], reverse=sort == "created")
    return list(reversed(ordered)) if reverse else ordered


def list_runs(
    client: "LoopsClient",
    *,
    include_inactive: bool = False,
    base_model: str | None = None,
    org: bool = False,
    sort: str = "created",
    reverse: bool = False,
    limit: int = 0,
) -> RunListing:
    runs = client.runs.list(base_model=base_model, scope="org" if org else None)
    shown, hidden, recent = select_runs(runs, include_inactive=include_inactive)
    ordered = sort_runs(shown, sort, reverse)
    return RunListing(runs=ordered[:limit] if limit else ordered, total=len(ordered), hidden=hidden, recent=recent)


# ── describe ──────────────────────────────────────────────────────────────────────────────


class RunDescription(LoopsRun):
    """``runs describe -o json``: the LoopsRun with its trainer deployment, policy version,
    latest checkpoints and usage added."""

    model_config = ConfigDict(extra="allow")

    deployment: LoopsDeployment | None = None
    policy_version: int | None = None
    latest_checkpoints: list[LoopsCheckpoint] = Field(default_factory=list)
    checkpoint_count: int = 0
    usage: dict[str, Any] | None = None


def trainer_deployment(client: "LoopsClient", deployment_id: str | None) -> LoopsDeployment | None:
    """The run's trainer deployment, or None (serverless runs have none; older backends may
    not know the route)."""
    from baseten_loops_cli.api.errors import ApiError

    if not deployment_id:
        return None
    try:
        return client.deployments.get(deployment_id)
    except ApiError:
        return None


def run_usage(backend: "Backend", run_id: str) -> dict[str, Any] | None:
    """Tokens and compute the backend reports for a run (the local backend does), or None."""
    if not backend.capabilities.usage_counters:
        return None
    try:
        rows = backend.client.local_usage(run_id=run_id)
    except Exception:  # noqa: BLE001 - a backend without the route reports nothing
        return None
    return next((row for row in rows if row.get("owner_id") == run_id), None)


def policy_version(backend: "Backend", run: LoopsRun) -> int | None:
    """The trainer's policy version (= optimizer steps): from the run when the backend reports
    it, else from a dedicated trainer's ``/policy_version``."""
    if run.policy_version is not None:
        return run.policy_version
    if not run.deployment_id or not run.base_url:
        return None
    from baseten_loops_cli.workers.trainer import TrainerClient

    try:
        with TrainerClient(run.base_url, api_key=backend.api_key, run_id=run.id, base_model=run.base_model) as tc:
            return tc.policy_version()
    except LoopsError:
        return None


def describe_run(backend: "Backend", run_id: str, *, checkpoints: int = 5) -> RunDescription:
    client = backend.client
    run = get_run(client, run_id)
    cps = sorted(client.checkpoints.list(run_id=run.id), key=created_key, reverse=True)
    fields = run.model_dump()
    fields.pop("policy_version", None)
    return RunDescription(
        **fields,
        deployment=trainer_deployment(client, run.deployment_id),
        policy_version=policy_version(backend, run),
        latest_checkpoints=cps[:checkpoints] if checkpoints else [],
        checkpoint_count=len(cps),
        usage=run_usage(backend, run.id),
    )


# ── create / wait ─────────────────────────────────────────────────────────────────────────


class CreateRun(BaseModel):
    """What ``loops runs create`` asks for; checkpoint and run references are resolved by
    :func:`create_run`."""

    base_model: str
    name: str | None = None
    lora_rank: int | None = None
    max_seq_len: int | None = None
    replicas: int | None = None
    from_checkpoint: str | None = None  # a trainer checkpoint to start from (id, URI, RUN:NAME)
    reuse_from: str | None = None  # an earlier run whose warm trainer and sampler to reuse


def create_run(
    client: "LoopsClient",
    request: CreateRun,
    *,
    on_status: Callable[[str], None] = lambda _s: None,
    on_warning: Callable[[str], None] = lambda _s: None,
) -> LoopsRun:
    """Check the request (the checkpoint holds trainer state of the same base model and LoRA
    rank; a reused run has the same base model) and create the run."""
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.services.resolve import resolve_checkpoint, uri_of

    base_model, lora_rank, path = request.base_model, request.lora_rank, None
    if request.from_checkpoint:
        ref = request.from_checkpoint
        cp = resolve_checkpoint(client, ref, prefer="trainer")
        if cp.target != "trainer":
            raise UsageError(
                f"{ref} holds sampler weights; --from needs trainer state (a weights/ checkpoint)",
                hint="Use a checkpoint saved with save_state; list them with "
                f"`loops checkpoints list --run-id {cp.run_id} --target trainer`.",
            )
        if cp.base_model and cp.base_model != base_model:
            raise UsageError(f"{ref} was trained on {cp.base_model}, not {base_model}", hint=f"Pass --base-model {cp.base_model}.")
        path = uri_of(cp)
        rank = cp.lora_rank
        if rank is not None:
            if lora_rank is None:
                lora_rank = rank  # the run must match the checkpoint's adapter
            elif lora_rank != rank:
                raise UsageError(
                    f"{ref} has LoRA rank {rank}, not {lora_rank}",
                    hint=f"Drop --lora-rank (it defaults to the checkpoint's) or pass --lora-rank {rank}.",
                )
    if request.reuse_from:
        prior = get_run(client, request.reuse_from)
        if prior.base_model != base_model:
            raise UsageError(
                f"--reuse-from {request.reuse_from} runs {prior.base_model}, not {base_model}",
                hint="Warm reuse needs the same base model.",
            )
        if request.replicas and request.replicas > 1:
            on_warning("--replicas > 1 always provisions fresh capacity; --reuse-from is ignored by the backend.")
    on_status(f"Provisioning Loops run and sampler for {base_model}...")
    body = {
        "session_id": client.sessions.create().id,
        "base_model": base_model,
        "name": request.name,
        "lora_rank": lora_rank,
        "max_seq_len": request.max_seq_len,
        "replicas": request.replicas,
        "path": path,
        "reuse_from_run_id": request.reuse_from,
    }
    return client.runs.create({k: v for k, v in body.items() if v is not None})


def wait_for_trainer(
    client: "LoopsClient",
    run: LoopsRun,
    *,
    timeout: float | None = None,
    interval: float = 2.0,
    on_status: Callable[[str], None] = lambda _s: None,
    sleep: Sleep = time.sleep,
    clock: Clock = time.monotonic,
) -> LoopsRun:
    """Poll until the run's trainer is RUNNING; :class:`RunFailedError` if it fails first.
    ``on_status`` hears each new trainer status."""
    last = status = None
    for _ in Poll(interval=interval, timeout=timeout, sleep=sleep, clock=clock):
        run = get_run(client, run.id)
        if not run.is_active:
            raise RunFailedError(f"run {run.id} was deactivated while waiting for its trainer")
        dep = trainer_deployment(client, run.deployment_id)
        status = dep.status_name if dep else None
        if status and status != last:
            on_status(status)
            last = status
        if dep is None and not run.deployment_id:
            return run  # serverless: nothing to provision
        if status in ("RUNNING", "SCALED_TO_ZERO"):
            return run
        if status in TRAINER_TERMINAL:
            reason = dep.status_reason if dep else None
            exc = RunFailedError if status in TRAINER_FAILED else LoopsError
            raise exc(
                f"run {run.id}'s trainer is {status}" + (f": {reason}" if reason else ""),
                hint=f"See its logs: loops runs logs {run.id}",
            )
    raise LoopsError(
        f"run {run.id}'s trainer is still {status or 'starting'} after {timeout:.0f}s",
        hint=f"It keeps coming up in the background; check with `loops runs watch {run.id}`.",
    )


# ── watch ─────────────────────────────────────────────────────────────────────────────────


class RunSnapshot(BaseModel):
    """One state of a run (``runs watch -o jsonl`` prints one per change)."""

    time: str
    run_id: str
    run_status: str | None
    trainer_status: str | None = None
    trainer_status_reason: str | None = None
    sampler_status: str | None = None
    step: int | None = None
    policy_version: int | None = None
    sampler_policy_version: int | None = None

    @property
    def ended(self) -> bool:
        return self.run_status != "ACTIVE" or self.trainer_status in TRAINER_TERMINAL

    @property
    def failed(self) -> bool:
        return self.trainer_status in TRAINER_FAILED

    def line(self) -> str:
        parts = [f"run {self.run_status}"]
        if self.trainer_status:
            parts.append(f"trainer {self.trainer_status}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.sampler_status:
            parts.append(f"sampler {self.sampler_status}")
        if self.sampler_policy_version is not None:
            parts.append(f"v{self.sampler_policy_version}")
        return " · ".join(parts)


def snapshot(backend: "Backend", run_id: str) -> RunSnapshot:
    run = get_run(backend.client, run_id)
    dep = trainer_deployment(backend.client, run.deployment_id)
    version = policy_version(backend, run)
    sampler = run.sampler
    return RunSnapshot(
        time=datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
        run_id=run.id,
        run_status=run.status_name,
        trainer_status=dep.status_name if dep else None,
        trainer_status_reason=dep.status_reason if dep else None,
        sampler_status=sampler.status_name if sampler else None,
        step=version,
        policy_version=version,
        sampler_policy_version=sampler.policy_version if sampler else None,
    )


def watch_run(backend: "Backend", run_id: str, *, interval: float = 3.0,
              sleep: Sleep = time.sleep) -> Iterator[RunSnapshot]:
    """Each new state of the run, until it is deactivated or its trainer stops (the last
    snapshot yielded is the final one)."""
    last_key = None
    for _ in Poll(interval=interval, sleep=sleep):
        snap = snapshot(backend, run_id)
        key = snap.model_dump(exclude={"time"})
        if key != last_key:  # an ended state always differs from the live one before it
            last_key = key
            yield snap
        if snap.ended:
            return


# ── logs ──────────────────────────────────────────────────────────────────────────────────


def log_key(entry: Log) -> tuple:
    return (entry.timestamp, entry.replica, entry.message)


def log_ns(entry: Log) -> int:
    try:
        return int(entry.timestamp or 0)
    except (TypeError, ValueError):
        return 0


class LogSource:
    """Pages of one log stream: a run's trainer deployment, or its paired sampler's."""

    def __init__(self, client: "LoopsClient", run: LoopsRun, sampler: bool):
        self.client, self.run, self.sampler = client, run, sampler
        if sampler:
            s = run.sampler
            if s is None:
                raise LoopsError(
                    f"Loops run '{run.id}' has no paired sampler to fetch logs from",
                    hint="The sampler is created on the first sampling call.",
                )
            if not (s.model_id and s.deployment_id):
                raise LoopsError(f"Loops run '{run.id}' has a serverless sampler; it has no logs to fetch")
            self.label = f"sampler {s.id}"
        else:
            if not run.deployment_id:
                raise LoopsError(
                    f"Loops run '{run.id}' has no trainer logs to fetch",
                    hint="Serverless runs have no trainer deployment; try --sampler.",
                )
            self.label = f"trainer deployment {run.deployment_id}"

    def page(self, **params: Any) -> list[Log]:
        s = self.run.sampler
        if self.sampler and s is not None:
            return self.client.models.logs(str(s.model_id), str(s.deployment_id), **params)
        return self.client.deployments.logs(str(self.run.deployment_id), **params)

    def ended(self) -> tuple[bool, str | None]:
        """(no more lines will come, the status that says so)."""
        current = get_run(self.client, self.run.id)
        if self.sampler:
            status = current.sampler.status_name if current.sampler else None
            return sampler_is_terminal(current.sampler), status
        dep = trainer_deployment(self.client, current.deployment_id)
        status = dep.status_name if dep else None
        return status in TRAINER_TERMINAL or not current.is_active, status


def fetch_logs(page: Callable[..., list[Log]], start_ms: int, end_ms: int, limit: int, min_level: str | None) -> list[Log]:
    """Up to ``limit`` (0 = all) log lines in [start, end], newest pages first, returned oldest
    first. Pages of at most 1000 walk backwards in time; duplicates at page edges are dropped."""
    seen: set = set()
    collected: list[Log] = []
    end = end_ms
    while True:
        want = LOG_PAGE_SIZE if not limit else min(LOG_PAGE_SIZE, limit - len(collected))
        if want <= 0:
            break
        got = page(start_epoch_millis=start_ms, end_epoch_millis=end, direction="desc", limit=want, min_level=min_level)
        fresh = [e for e in got if log_key(e) not in seen]
        seen.update(log_key(e) for e in fresh)
        collected.extend(fresh)
        if len(got) < want or not fresh:
            break
        oldest_ms = min(log_ns(e) for e in got) // 1_000_000
        end = oldest_ms if oldest_ms < end else end - 1
        if end < start_ms:
            break
    if limit:
        collected = sorted(collected, key=log_ns, reverse=True)[:limit]
    return sorted(collected, key=log_ns)


class LogFollower:
    """New lines of ``source`` from ``since_ms`` on, every few seconds, until the trainer (or
    sampler) stops; then ``end_status`` says what it is.

    ``printed``: the lines already shown (``fetch_logs``' answer); following resumes at the
    newest one's millisecond, and the lines of that millisecond are not yielded again (the
    query's start is inclusive, so they come back)."""

    def __init__(self, source: LogSource, since_ms: int, min_level: str | None, printed: Sequence[Log] = (), *,
                 sleep: Sleep = time.sleep, clock: Clock = time.monotonic):
        self.source, self.cursor, self.min_level = source, since_ms, min_level
        self._sleep, self._clock = sleep, clock
        self.end_status: str | None = None
        self._seen: set = set()
        if printed:
            self.cursor = max(since_ms, max(log_ns(e) for e in printed) // 1_000_000)
            self._seen = {log_key(e) for e in printed if log_ns(e) // 1_000_000 >= self.cursor}

    def __iter__(self) -> Iterator[Log]:
        seen: set = set(self._seen)
        last_status_check: float | None = None
        poll = Poll(interval=TAIL_POLL_S, sleep=self._sleep, clock=self._clock)
        for _ in poll:
            now_ms = int(time.time() * 1000)
            got = self.source.page(start_epoch_millis=self.cursor, end_epoch_millis=now_ms, direction="asc",
                                   limit=LOG_PAGE_SIZE, min_level=self.min_level)
            fresh = [e for e in sorted(got, key=log_ns) if log_key(e) not in seen]
            for entry in fresh:
                seen.add(log_key(entry))
                yield entry
            if fresh:
                newest_ms = log_ns(fresh[-1]) // 1_000_000
                if newest_ms > self.cursor:
                    # keep only the keys of the boundary millisecond (the next query starts there)
                    seen = {k for k in seen if int(k[0] or 0) // 1_000_000 >= newest_ms}
                    self.cursor = newest_ms
            if len(got) >= LOG_PAGE_SIZE:
                poll.again()  # more is waiting: fetch again right away
                continue
            if last_status_check is None or poll.elapsed() - last_status_check >= STATUS_POLL_S:
                last_status_check = poll.elapsed()
                ended, self.end_status = self.source.ended()
                if ended:
                    return


# ── deactivate many ───────────────────────────────────────────────────────────────────────

T = TypeVar("T", LoopsRun, LoopsSampler)


def deactivate_many(
    ids: Sequence[str],
    *,
    get: Callable[[str], T],
    stopped: Callable[[T], bool],
    deactivate: Callable[[str], DeactivateResponse],
    confirm: Callable[[list[T]], None],
    on_skipped: Callable[[T], None] = lambda _x: None,
    on_done: Callable[[T], None] = lambda _x: None,
) -> list[DeactivateResponse]:
    """The one deactivate-many flow: look every id up first (a typo stops everything), skip
    the ones already stopped, ``confirm`` the rest (it raises to cancel), deactivate each."""
    items = [get(i) for i in dict.fromkeys(i.strip() for i in ids if i.strip())]
    todo = []
    for item in items:
        if stopped(item):
            on_skipped(item)
        else:
            todo.append(item)
    if not todo:
        return []
    confirm(todo)
    results = []
    for item in todo:
        results.append(deactivate(item.id))
        on_done(item)
    return results


def deactivate_runs(client: "LoopsClient", run_ids: Sequence[str], **callbacks: Any) -> list[DeactivateResponse]:
    """Stop runs' trainers and paired samplers (saved checkpoints stay)."""
    return deactivate_many(
        run_ids, get=lambda i: get_run(client, i), stopped=lambda r: not r.is_active, deactivate=client.runs.deactivate, **callbacks
    )


def deactivate_samplers(client: "LoopsClient", sampler_ids: Sequence[str], **callbacks: Any) -> list[DeactivateResponse]:
    """Stop samplers (checkpoints and runs are not touched)."""
    return deactivate_many(
        sampler_ids, get=lambda i: get_sampler(client, i), stopped=sampler_is_terminal, deactivate=client.samplers.deactivate, **callbacks
    )
