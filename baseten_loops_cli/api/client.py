"""``LoopsClient``: one method per control-plane route (§2.2), returning pydantic models.

Resource namespaces in the Stainless style::

    client = LoopsClient(base_url, api_key, team=None, debug_log=print)
    session = client.sessions.create()
    run = client.runs.create_trainer(CreateTrainerRequest(session_id=session.id, base_model=...))
    for f in client.checkpoints.iter_files(ckpt.id): ...

List routes return the unwrapped list (``list[LoopsRun]``), get/create routes the object. When
``team`` (a team id) is set, the routes that have ``/v1/teams/{team}/loops/...`` twins (create
session/run/trainer/sampler, list runs/samplers) use them.
"""

from __future__ import annotations

import builtins  # `list` alone names a resource class's own list() method in its annotations
import time
from typing import Any, Callable, Iterator, Mapping, TypedDict, TypeVar, Unpack
from urllib.parse import quote

import httpx

from baseten_loops_cli.api.errors import NotFoundError
from baseten_loops_cli.api.http import DEFAULT_TIMEOUT, USER_AGENT, HttpClient, Sleep
from baseten_loops_cli.api.retry import DEFAULT_MAX_RETRIES
from baseten_loops_cli.api.models import (
    CapabilitiesResponse,
    CheckpointFile,
    CheckpointFilesResponse,
    CheckpointSource,
    CheckpointSourceResponse,
    CheckpointsResponse,
    CreateRunRequest,
    CreateSamplerRequest,
    CreateSessionRequest,
    CreateTrainerRequest,
    DeactivateResponse,
    DebugArchiveFilesResponse,
    DeployCheckpointsRequest,
    DeployCheckpointsResponse,
    DeploymentMetricsResponse,
    DeploymentResponse,
    DeploymentsResponse,
    Log,
    LogsResponse,
    LoopsCheckpoint,
    LoopsDeployment,
    LoopsRun,
    LoopsSampler,
    MetricsRequest,
    ModelDeployment,
    RunResponse,
    RunsResponse,
    SamplerDeploymentStatus,
    SamplerResponse,
    SamplersResponse,
    Session,
    SessionResponse,
    SupportedModel,
    Team,
    TeamsResponse,
    UserConfig,
    UserConfigPatch,
    UserConfigResponse,
    ValidateCheckpointRequest,
)
from baseten_loops_cli.errors import UsageError

# truss caps the checkpoint-files page walk at 1000 pages; so do we.
MAX_FILE_PAGES = 1000


def _seg(value: str) -> str:
    """A path segment, URL-encoded (ids are opaque strings)."""
    return quote(str(value), safe="")


T = TypeVar("T")


class LogWindow(TypedDict, total=False):
    """Which logs a logs query asks for: a time window (≤7 days; default: the last 30 min),
    ``direction`` asc or desc, ``limit`` 1-1000, and the lowest level (any case)."""

    start_epoch_millis: int | None
    end_epoch_millis: int | None
    direction: str | None
    limit: int | None
    min_level: str | None


class MetricsWindow(TypedDict, total=False):
    """A deployment's metrics query: :class:`MetricsRequest`'s fields."""

    start_epoch_millis: int | None
    end_epoch_millis: int | None
    step_seconds: int | None
    time_divisor_seconds: int | None


def _log_query(window: LogWindow) -> dict[str, Any]:
    """The query (trainer logs) or body (model logs) of a logs request, unset keys left out."""
    direction, limit, min_level = window.get("direction"), window.get("limit"), window.get("min_level")
    if direction is not None and direction not in ("asc", "desc"):
        raise UsageError(f"direction must be asc or desc, not {direction!r}")
    if limit is not None and not 1 <= limit <= 1000:
        raise UsageError(f"limit must be between 1 and 1000, not {limit}")
    query = {key: window.get(key) for key in LogWindow.__annotations__}  # in the declared order
    query["min_level"] = min_level.upper() if min_level else None
    return {k: v for k, v in query.items() if v is not None}


class _Resource:
    def __init__(self, client: "LoopsClient"):
        self._client = client
        self._http = client.http

    def _get(self, path: str, **kw: Any) -> Any:
        return self._http.request_json("GET", path, **kw)

    def _post(self, path: str, **kw: Any) -> Any:
        return self._http.request_json("POST", path, **kw)

    def _create_found_again(self, route: str, req: Any, *, parse: Callable[[Any], T], listed: Callable[[], list[T]],
                            mine: Callable[[T], bool], discard: Callable[[T], Any], what: str) -> T:
        """``POST {create_root}/{route}`` with ``req``, a create without an Idempotency-Key
        (:meth:`HttpClient.create`): after an ambiguous failure, what it may have made is the
        ``listed()`` items that are ``mine`` and were made since it began; extras are ``discard``-ed."""
        since = time.time()
        return self._http.create(f"{self._client.create_root}/{route}", json=req.to_body(), parse=parse,
                                 find=lambda: _made_since([x for x in listed() if mine(x)], since),
                                 discard=discard, what=what)  # fmt: skip


class Sessions(_Resource):
    def create(self, training_project_id: str | None = None) -> Session:
        """``POST /v1/loops/sessions`` (team twin when ``team`` is set)."""
        body = CreateSessionRequest(training_project_id=training_project_id).to_body()
        # SDK 0.32 sends no body at all; an empty one is equivalent, but keep the wire identical.
        # An extra empty session is harmless, so a lost response is simply retried.
        data = self._post(f"{self._client.create_root}/sessions", json=body or None, safe_to_repeat=True)
        return SessionResponse.model_validate(data).session

    def get(self, session_id: str) -> Session:
        return SessionResponse.model_validate(self._get(f"/v1/loops/sessions/{_seg(session_id)}")).session


# How far the server's clock may be behind ours when telling "made by this create" from "was
# already there" (a session can hold other objects: a run's paired sampler, earlier runs).
CLOCK_SKEW_S = 30.0


def _made_since(items: list[Any], since: float) -> list[Any]:
    """The items created at or after ``since`` (unix time, less the clock skew), oldest first;
    an item without ``created_at`` is kept (nothing tells it apart)."""
    fresh = [x for x in items if x.created_at is None or x.created_at.timestamp() >= since - CLOCK_SKEW_S]
    return sorted(fresh, key=lambda x: (x.created_at is None, x.created_at.timestamp() if x.created_at else 0, x.id))


class Runs(_Resource):
    def create(self, request: CreateRunRequest | Mapping[str, Any]) -> LoopsRun:
        """``POST /v1/loops/runs``: a run with its paired sampler. Not idempotent: after an
        ambiguous failure the run is looked up in its session (see :meth:`HttpClient.create`)."""
        req = request if isinstance(request, CreateRunRequest) else CreateRunRequest.model_validate(request)
        return self._create("runs", req)

    def create_trainer(self, request: CreateTrainerRequest | Mapping[str, Any]) -> LoopsRun:
        """``POST /v1/loops/trainers``: trainer only (the SDK ≥0.2x path); sampler made lazily."""
        req = request if isinstance(request, CreateTrainerRequest) else CreateTrainerRequest.model_validate(request)
        return self._create("trainers", req)

    def _create(self, route: str, req: CreateTrainerRequest) -> LoopsRun:
        def mine(r: LoopsRun) -> bool:  # a live run of this session and name (listed by its model)
            return r.session_id == req.session_id and r.is_active and (req.name is None or r.name in (None, req.name))

        return self._create_found_again(route, req, parse=lambda data: RunResponse.model_validate(data).run,
                                        listed=lambda: self.list(base_model=req.base_model), mine=mine,
                                        discard=lambda run: self.deactivate(run.id), what="run")  # fmt: skip

    def list(self, *, base_model: str | None = None, scope: str | None = None, run_id: str | None = None) -> list[LoopsRun]:
        """``GET /v1/loops/runs`` (unpaginated, order not guaranteed). ``scope="org"`` = whole org."""
        params = {"base_model": base_model, "scope": scope, "run_id": run_id}
        return RunsResponse.model_validate(self._get(f"{self._client.create_root}/runs", params=params)).runs

    def get(self, run_id: str) -> LoopsRun:
        return RunResponse.model_validate(self._get(f"/v1/loops/runs/{_seg(run_id)}")).run

    def deactivate(self, run_id: str) -> DeactivateResponse:
        """Tear down the run and its paired sampler; checkpoints are kept."""
        return DeactivateResponse.model_validate(self._post(f"/v1/loops/runs/{_seg(run_id)}/deactivate", json={}, safe_to_repeat=True))


class Samplers(_Resource):
    def create(self, request: CreateSamplerRequest | Mapping[str, Any]) -> LoopsSampler:
        """``POST /v1/loops/samplers``: exactly one of base_model / run_id / model_path."""
        req = request if isinstance(request, CreateSamplerRequest) else CreateSamplerRequest.model_validate(request)
        chosen = [k for k in ("base_model", "run_id", "model_path") if getattr(req, k)]
        if len(chosen) != 1:
            raise UsageError(
                "a sampler needs exactly one of base_model, run_id or model_path"
                + (f" (got {', '.join(chosen)})" if chosen else "")
            )

        def mine(s: LoopsSampler) -> bool:
            # The listing carries each sampler's session and source (fields a backend may send).
            return (s.session_id == req.session_id and not SamplerDeploymentStatus.is_terminal(s.status_name)
                    and all(getattr(s, k) == getattr(req, k) for k in chosen if k != "base_model")
                    and (req.base_model is None or s.base_model == req.base_model))  # fmt: skip

        return self._create_found_again("samplers", req, parse=lambda data: SamplerResponse.model_validate(data).sampler,
                                        listed=self.list, mine=mine,
                                        discard=lambda sampler: self.deactivate(sampler.id), what="sampler")  # fmt: skip

    def list(self, *, scope: str | None = None) -> list[LoopsSampler]:
        data = self._get(f"{self._client.create_root}/samplers", params={"scope": scope})
        return SamplersResponse.model_validate(data).samplers

    def get(self, sampler_id: str) -> LoopsSampler:
        return SamplerResponse.model_validate(self._get(f"/v1/loops/samplers/{_seg(sampler_id)}")).sampler

    def deactivate(self, sampler_id: str) -> DeactivateResponse:
        return DeactivateResponse.model_validate(self._post(f"/v1/loops/samplers/{_seg(sampler_id)}/deactivate", json={}, safe_to_repeat=True))


class Checkpoints(_Resource):
    def list(
        self, *, run_id: str | None = None, base_model: str | None = None, checkpoint_path: str | None = None
    ) -> list[LoopsCheckpoint]:
        """``GET /v1/loops/checkpoints`` with exactly one filter; newest first (server order).

        For ``checkpoint_path`` a 404 means "no such checkpoint" and returns ``[]`` (SDK).
        """
        given = {k: v for k, v in {"run_id": run_id, "base_model": base_model, "checkpoint_path": checkpoint_path}.items() if v}
        if len(given) != 1:
            raise UsageError(
                "list checkpoints with exactly one of run_id, base_model or checkpoint_path"
                + (f" (got {', '.join(given)})" if given else ""),
                hint="e.g. `loops checkpoints list --run <run_id>`",
            )
        try:
            data = self._get("/v1/loops/checkpoints", params=given)
        except NotFoundError:
            if checkpoint_path:
                return []
            raise
        return CheckpointsResponse.model_validate(data).checkpoints

    def files_page(self, checkpoint_id: str, *, page_token: int = 0, page_size: int = 1000) -> CheckpointFilesResponse:
        """One page of presigned URLs (``page_token`` is an integer offset)."""
        params = {"page_token": page_token, "page_size": page_size}
        data = self._get(f"/v1/loops/checkpoints/{_seg(checkpoint_id)}/files", params=params)
        return CheckpointFilesResponse.model_validate(data)

    def iter_files(self, checkpoint_id: str, *, page_size: int = 1000, max_pages: int = MAX_FILE_PAGES) -> Iterator[CheckpointFile]:
        """Every file of a checkpoint: walks pages until ``next_page_token`` is null or a page is
        empty, at most ``max_pages`` pages. Raises ``ApiError`` with reason ``NOT_PRESIGNABLE``
        for volume-backed checkpoints (see :meth:`get_source`)."""
        token: int | None = 0
        for _ in range(max_pages):
            page = self.files_page(checkpoint_id, page_token=token or 0, page_size=page_size)
            yield from page.presigned_urls
            if page.next_page_token is None or not page.presigned_urls or page.next_page_token == token:
                return
            token = page.next_page_token

    def list_files(self, checkpoint_id: str, **kw: Any) -> builtins.list[CheckpointFile]:
        return list(self.iter_files(checkpoint_id, **kw))

    def get_source(self, checkpoint_id: str) -> CheckpointSource:
        data = self._get(f"/v1/loops/checkpoints/{_seg(checkpoint_id)}/source")
        return CheckpointSourceResponse.model_validate(data).source

    def validate(self, checkpoint_path: str, run_id: str | None = None) -> None:
        """2xx = the caller may use this sampler checkpoint (for this run's LoRA config)."""
        body = ValidateCheckpointRequest(checkpoint_path=checkpoint_path, run_id=run_id).to_body()
        self._post("/v1/loops/checkpoints/validate", json=body, safe_to_repeat=True)

    def deploy(
        self,
        checkpoint_ids: builtins.list[str],
        *,
        model_name: str,
        instance_type_id: str,
        hf_secret_name: str | None = None,
    ) -> DeployCheckpointsResponse:
        """Create an inference deployment. Billable and NOT idempotent: never re-sent after it
        may have reached the server (only connect errors and explicit 429/503 Retry-After). No
        route lists checkpoint deployments, so an ambiguous failure is raised with a hint to
        check before deploying again."""
        body = DeployCheckpointsRequest(
            checkpoint_ids=list(checkpoint_ids),
            model_name=model_name,
            instance_type_id=instance_type_id,
            hf_secret_name=hf_secret_name,
        ).to_body()
        return self._http.create(
            "/v1/loops/checkpoints/deploy",
            json=body,
            parse=DeployCheckpointsResponse.model_validate,
            find=None,
            what="deployment",
        )


class Deployments(_Resource):
    def list(self, *, scope: str | None = None) -> list[LoopsDeployment]:
        """All trainer deployments, every status (callers filter terminal ones)."""
        return DeploymentsResponse.model_validate(self._get("/v1/loops/deployments", params={"scope": scope})).deployments

    def get(self, deployment_id: str) -> LoopsDeployment:
        return DeploymentResponse.model_validate(self._get(f"/v1/loops/deployments/{_seg(deployment_id)}")).deployment

    def deactivate(self, deployment_id: str) -> DeactivateResponse:
        data = self._post(f"/v1/loops/deployments/{_seg(deployment_id)}/deactivate", json={}, safe_to_repeat=True)
        return DeactivateResponse.model_validate(data)

    def logs(self, deployment_id: str, **window: Unpack[LogWindow]) -> builtins.list[Log]:
        """Trainer logs in a :class:`LogWindow`."""
        data = self._get(f"/v1/loops/deployments/{_seg(deployment_id)}/logs", params=_log_query(window))
        return LogsResponse.model_validate(data).logs

    def metrics(self, deployment_id: str, **window: Unpack[MetricsWindow]) -> DeploymentMetricsResponse:
        body = MetricsRequest(**window).to_body()
        # A read-only query sent as POST: safe to repeat.
        data = self._post(f"/v1/loops/deployments/{_seg(deployment_id)}/metrics", json=body, safe_to_repeat=True)
        return DeploymentMetricsResponse.model_validate(data)

    def debug_archive_files(
        self, deployment_id: str, *, page_token: str | None = None, page_size: int | None = None
    ) -> DebugArchiveFilesResponse:
        params = {"page_token": page_token, "page_size": page_size}
        data = self._get(f"/v1/loops/deployments/{_seg(deployment_id)}/debug_archive/files", params=params)
        return DebugArchiveFilesResponse.model_validate(data)


class UserConfigs(_Resource):
    def get(self) -> UserConfig:
        return UserConfigResponse.model_validate(self._get("/v1/loops/user_config")).user_config

    def patch(self, patch: UserConfigPatch | Mapping[str, Any]) -> UserConfig:
        """Only the fields present are sent: a list sets, ``None`` clears; ``[]`` is rejected."""
        req = patch if isinstance(patch, UserConfigPatch) else UserConfigPatch.model_validate(dict(patch))
        body = req.to_body()
        for key, value in body.items():
            if value == []:
                raise UsageError(f"{key} cannot be an empty list (pass null to clear it)")
        data = self._http.request_json("PATCH", "/v1/loops/user_config", json=body, safe_to_repeat=True)
        return UserConfigResponse.model_validate(data).user_config


class Teams(_Resource):
    def list(self) -> list[Team]:
        return TeamsResponse.model_validate(self._get("/v1/teams")).teams

    def resolve(self, name_or_id: str) -> Team:
        """The team whose id or (case-insensitive) name matches."""
        teams = self.list()
        for team in teams:
            if team.id == name_or_id:
                return team
        matches = [t for t in teams if t.name.lower() == name_or_id.lower()]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(sorted(t.name or t.id for t in teams)) or "none"
        if matches:
            raise UsageError(f"team name {name_or_id!r} is ambiguous; use its id", hint=f"teams: {known}")
        raise UsageError(f"no team {name_or_id!r}", hint=f"teams: {known}")


class Models(_Resource):
    def deployment(self, model_id: str, deployment_id: str) -> ModelDeployment:
        """``GET /v1/models/{model_id}/deployments/{deployment_id}`` (dedicated sampler readiness)."""
        data = self._get(f"/v1/models/{_seg(model_id)}/deployments/{_seg(deployment_id)}")
        return ModelDeployment.model_validate(data)

    # -- added for `loops runs logs --sampler` and `loops deploy` (cli/runs.py, cli/deploy.py) --

    def logs(self, model_id: str, deployment_id: str, **window: Unpack[LogWindow]) -> list[Log]:
        """``POST /v1/models/{model_id}/deployments/{deployment_id}/logs`` (a sampler's or a
        checkpoint deployment's logs; the :class:`LogWindow` in the body, as truss sends it)."""
        data = self._post(f"/v1/models/{_seg(model_id)}/deployments/{_seg(deployment_id)}/logs", json=_log_query(window),
                          safe_to_repeat=True)  # fmt: skip
        return LogsResponse.model_validate(data).logs

    def deactivate(self, model_id: str, deployment_id: str) -> dict[str, Any]:
        """``POST /v1/models/{model_id}/deployments/{deployment_id}/deactivate``."""
        data = self._post(f"/v1/models/{_seg(model_id)}/deployments/{_seg(deployment_id)}/deactivate", json={}, safe_to_repeat=True)
        return data if isinstance(data, dict) else {}


class LoopsClient:
    """Control-plane client. ``team`` is a team id (resolve a name with ``teams.resolve``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        team: str | None = None,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        user_agent: str = USER_AGENT,
        debug_log: Callable[[str], None] | None = None,
        sleep: Sleep | None = None,
        http: HttpClient | None = None,
    ):
        kwargs: dict[str, Any] = {}
        if sleep is not None:
            kwargs["sleep"] = sleep
        self.http = http or HttpClient(
            base_url, api_key, timeout=timeout, max_retries=max_retries, user_agent=user_agent, debug_log=debug_log, **kwargs
        )
        self.base_url = self.http.base_url
        self.team = team
        self.sessions = Sessions(self)
        self.runs = Runs(self)
        self.samplers = Samplers(self)
        self.checkpoints = Checkpoints(self)
        self.deployments = Deployments(self)
        self.user_config = UserConfigs(self)
        self.teams = Teams(self)
        self.models = Models(self)

    @property
    def create_root(self) -> str:
        """``/v1/loops`` or ``/v1/teams/{team}/loops`` for routes with team twins."""
        return f"/v1/teams/{_seg(self.team)}/loops" if self.team else "/v1/loops"

    def capabilities(
        self, *, model: str | None = None, use_case: str | None = None, max_seq_len: int | None = None
    ) -> list[SupportedModel]:
        """``GET /v1/loops/capabilities``: models this workspace may train (``use_case`` rl|sft)."""
        if use_case is not None and use_case not in ("rl", "sft"):
            raise UsageError(f"use_case must be rl or sft, not {use_case!r}")
        params = {"model": model, "use_case": use_case, "max_seq_len": max_seq_len}
        data = self.http.request_json("GET", "/v1/loops/capabilities", params=params)
        return CapabilitiesResponse.model_validate(data).supported_models

    def model_deployment(self, model_id: str, deployment_id: str) -> ModelDeployment:
        return self.models.deployment(model_id, deployment_id)

    def get_user_config(self) -> UserConfig:
        """``GET /v1/loops/user_config`` (cheap, authenticated, side-effect free: ``auth login``
        uses it to check a key)."""
        return self.user_config.get()

    def local_usage(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """``GET /v1/local/usage`` (the local backend only): per-run tokens and compute
        ``[{owner_id, owner_kind, tokens_trained, tokens_sampled, compute_seconds, ...}]``.
        Raises ``NotFoundError`` on a backend without the route (Baseten)."""
        data = self.http.request_json("GET", "/v1/local/usage", params={"run_id": run_id}, max_retries=0)
        return list((data or {}).get("usage") or []) if isinstance(data, dict) else []

    def local_usage_periods(self, since: int, until: int, period_s: int) -> list[dict[str, Any]]:
        """``GET /v1/local/usage?since=&until=&period_s=`` (the local backend only): the counters
        of each ``period_s``-second period (UTC-aligned) of ``[since, until)`` in epoch seconds,
        per owner and the run they count for ``[{start, owner_id, owner_kind, run_id,
        tokens_trained, tokens_sampled, compute_seconds, operations, sample_requests}]``."""
        params = {"since": since, "until": until, "period_s": period_s}
        data = self.http.request_json("GET", "/v1/local/usage", params=params, max_retries=0)
        return list((data or {}).get("periods") or []) if isinstance(data, dict) else []

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "LoopsClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LoopsClient", "MAX_FILE_PAGES"]
