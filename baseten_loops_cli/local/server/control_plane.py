"""The control plane: every ``/v1/loops/*`` route of loops-protocol.md §2.2, their
``/v1/teams/{team_id}/loops/*`` twins, ``/v1/teams``, and the model-deployment status
route the SDK polls for dedicated samplers.

Handlers are thin: parse, call a service of the context (``runs``, ``samplers``,
``checkpoints``, ``deployments``, ``account``, ``models``), render its rows with a view of
``schemas``. They never touch the store (an import-linter contract, ``.importlinter``).
Lists are unpaginated envelopes (``{"runs": [...]}``), newest first.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from baseten_loops_cli.local.server.context import ServerContext, get_ctx
from baseten_loops_cli.local.server.deployment_registry import ModelDeployment, TrainerDeployment
from baseten_loops_cli.local.server.errors import ApiError, bad_request, not_found
from baseten_loops_cli.local.server.runs import RunDescription, RunRow
from baseten_loops_cli.local.server.schemas import (
    LOCAL_TEAM,
    CreateRunRequest,
    CreateSamplerRequest,
    CreateSessionRequest,
    DeployCheckpointsRequest,
    MetricsRequest,
    ValidateCheckpointRequest,
    base_url_of,
    checkpoint_deployment_view,
    checkpoint_view,
    deactivated_view,
    deployment_view,
    parse_body,
    query_int,
    run_view,
    sampler_deployment_view,
    sampler_view,
)

Handler = Callable[[Request], Awaitable[Response]]

MAX_LOG_WINDOW_MS = 7 * 24 * 3600 * 1000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _team(request: Request) -> str | None:
    """The team of a ``/v1/teams/{team_id}/loops/...`` route (None on the plain routes)."""
    team_id = request.path_params.get("team_id")
    if team_id is not None and team_id != LOCAL_TEAM["id"]:
        raise ApiError(404, f"No team {team_id!r}. The local backend has one team, "
                            f"{LOCAL_TEAM['id']!r} (GET /v1/teams).", "TeamNotFound")
    return team_id


def _run(ctx: ServerContext, run_id: str) -> RunRow:
    run = ctx.runs.find(run_id)
    if run is None:
        raise not_found("run", run_id, "List runs with GET /v1/loops/runs.")
    return run


def _run_json(request: Request, described: RunDescription) -> dict[str, Any]:
    return run_view(base_url_of(request), described.run, described.sampler)


# ── sessions ──

async def create_session(request: Request) -> Response:
    ctx = get_ctx(request)
    team = _team(request)
    body = await parse_body(request, CreateSessionRequest, optional=True)
    session = ctx.account.create_session(team, body.training_project_id)
    return JSONResponse({"session": {"id": session.id}})


async def get_session(request: Request) -> Response:
    ctx = get_ctx(request)
    session = ctx.account.find_session(request.path_params["session_id"])
    if session is None:
        raise not_found("session", request.path_params["session_id"])
    return JSONResponse({"session": {"id": session.id}})


# ── runs ──

async def _create_run(request: Request, *, with_sampler: bool) -> Response:
    ctx = get_ctx(request)
    team = _team(request)
    req = await parse_body(request, CreateRunRequest)
    run = await ctx.runs.create(req, team)
    if with_sampler:
        await ctx.samplers.ensure_paired(
            run.id, CreateSamplerRequest(session_id=req.session_id,
                                         num_replicas=req.sampler_num_replicas), team)
    return JSONResponse({"run": _run_json(request, ctx.runs.describe(run))})


async def create_run(request: Request) -> Response:
    """POST /runs: a run plus its paired sampler (truss, Go CLI, SDK <= 0.10)."""
    return await _create_run(request, with_sampler=True)


async def create_trainer(request: Request) -> Response:
    """POST /trainers: trainer only; the SDK creates the paired sampler lazily."""
    return await _create_run(request, with_sampler=False)


async def list_runs(request: Request) -> Response:
    ctx = get_ctx(request)
    team = _team(request)
    scope = request.query_params.get("scope")
    if scope not in (None, "", "org", "user", "mine"):
        raise bad_request(f"scope must be 'org' or omitted, got {scope!r}.", "InvalidQuery")
    runs = ctx.runs.search(run_id=request.query_params.get("run_id") or None,
                           base_model=request.query_params.get("base_model") or None,
                           team_id=team)
    return JSONResponse({"runs": [_run_json(request, r) for r in runs]})


async def get_run(request: Request) -> Response:
    ctx = get_ctx(request)
    run = _run(ctx, request.path_params["run_id"])
    return JSONResponse({"run": _run_json(request, ctx.runs.describe(run))})


async def deactivate_run(request: Request) -> Response:
    ctx = get_ctx(request)
    run = _run(ctx, request.path_params["run_id"])
    await ctx.runs.deactivate(run)
    return JSONResponse(deactivated_view(run.id, run.base_model))


# ── samplers ──

async def create_sampler(request: Request) -> Response:
    ctx = get_ctx(request)
    team = _team(request)
    req = await parse_body(request, CreateSamplerRequest)
    sampler = await ctx.samplers.create(req, team)
    return JSONResponse({"sampler": sampler_view(base_url_of(request), sampler)})


async def list_samplers(request: Request) -> Response:
    ctx = get_ctx(request)
    team = _team(request)
    base = base_url_of(request)
    return JSONResponse({"samplers": [sampler_view(base, s)
                                      for s in ctx.samplers.list_for_team(team)]})


async def get_sampler(request: Request) -> Response:
    ctx = get_ctx(request)
    sampler = ctx.samplers.get(request.path_params["sampler_id"])
    return JSONResponse({"sampler": sampler_view(base_url_of(request), sampler)})


async def deactivate_sampler(request: Request) -> Response:
    ctx = get_ctx(request)
    sampler = ctx.samplers.get(request.path_params["sampler_id"])
    ctx.samplers.deactivate(sampler)
    return JSONResponse(deactivated_view(sampler.id, sampler.base_model))


# ── checkpoints ──

async def list_checkpoints(request: Request) -> Response:
    ctx = get_ctx(request)
    filters = {k: v for k in ("run_id", "base_model", "checkpoint_path")
               if (v := request.query_params.get(k))}
    if len(filters) != 1:
        raise bad_request("Pass exactly one filter: run_id, base_model or checkpoint_path "
                          f"(got {', '.join(filters) or 'none'}).", "InvalidQuery")
    rows = ctx.checkpoints.search(**filters)
    return JSONResponse({"checkpoints": [checkpoint_view(cp) for cp in rows]})


async def checkpoint_files(request: Request) -> Response:
    ctx = get_ctx(request)
    cp = ctx.checkpoints.get(request.path_params["checkpoint_id"])
    page_size = query_int(request, "page_size", 1000, minimum=1)
    offset = query_int(request, "page_token", 0, minimum=0)
    page = ctx.checkpoints.file_page(cp, base_url_of(request), offset, page_size)
    return JSONResponse({"presigned_urls": page.entries, "next_page_token": page.next_page_token,
                         "total_count": page.total_count})


async def checkpoint_source(request: Request) -> Response:
    ctx = get_ctx(request)
    cp = ctx.checkpoints.get(request.path_params["checkpoint_id"])
    # "s3" is the protocol's name for "fetch the files through presigned URLs", which
    # is exactly how local files are served; the SDK only knows "s3" and "volume".
    return JSONResponse({"source": {"kind": "s3", "store": "local",
                                    "path": str(ctx.checkpoints.folder(cp))}})


async def validate_checkpoint(request: Request) -> Response:
    ctx = get_ctx(request)
    req = await parse_body(request, ValidateCheckpointRequest)
    ctx.checkpoints.check_servable(req.checkpoint_path, req.run_id)
    return JSONResponse({})


async def deploy_checkpoints(request: Request) -> Response:
    ctx = get_ctx(request)
    req = await parse_body(request, DeployCheckpointsRequest)
    dep = ctx.deployments.deploy(req.checkpoint_ids, req.model_name, base_url_of(request))
    return JSONResponse({"model_id": dep.model_id, "deployment_id": dep.id})


# ── trainer deployments ──

def _deployment_json(request: Request, trainer: TrainerDeployment) -> dict:
    return deployment_view(base_url_of(request), trainer.deployment, trainer.run, trainer.sampler)


async def list_deployments(request: Request) -> Response:
    ctx = get_ctx(request)
    return JSONResponse({"deployments": [_deployment_json(request, d)
                                         for d in ctx.deployments.trainers()]})


async def get_deployment(request: Request) -> Response:
    ctx = get_ctx(request)
    trainer = ctx.deployments.trainer(request.path_params["deployment_id"])
    return JSONResponse({"deployment": _deployment_json(request, trainer)})


async def deactivate_deployment(request: Request) -> Response:
    ctx = get_ctx(request)
    trainer = ctx.deployments.trainer(request.path_params["deployment_id"])
    await ctx.deployments.deactivate_trainer(trainer)
    dep = trainer.deployment
    return JSONResponse(deactivated_view(dep.id, dep.base_model))


def _logs_response(ctx: ServerContext, deployment_id: str, params: dict[str, Any]) -> Response:
    now_ms = int(time.time() * 1000)

    def as_int(name: str, default: int) -> int:
        raw = params.get(name)
        if raw in (None, ""):
            return default
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise bad_request(f"{name} must be an integer, got {raw!r}.", "InvalidQuery") from None

    end_ms = as_int("end_epoch_millis", now_ms)
    start_ms = as_int("start_epoch_millis", end_ms - 30 * 60 * 1000)
    if start_ms > end_ms:
        raise bad_request("start_epoch_millis is after end_epoch_millis.", "InvalidQuery")
    if end_ms - start_ms > MAX_LOG_WINDOW_MS:
        raise bad_request("The log window is at most 7 days; narrow start/end.", "InvalidQuery")
    limit = as_int("limit", 500)
    if not 1 <= limit <= 1000:
        raise bad_request(f"limit must be in 1..1000, got {limit}.", "InvalidQuery")
    direction = str(params.get("direction") or "desc").lower()
    if direction not in ("asc", "desc"):
        raise bad_request(f"direction must be 'asc' or 'desc', got {direction!r}.",
                          "InvalidQuery")
    min_level = str(params.get("min_level") or "DEBUG").upper()
    if min_level not in LOG_LEVELS:
        raise bad_request(f"min_level must be one of {', '.join(LOG_LEVELS)}.", "InvalidQuery")
    levels = LOG_LEVELS[LOG_LEVELS.index(min_level):]
    rows = ctx.deployments.logs(deployment_id, start_ns=start_ms * 1_000_000,
                                end_ns=end_ms * 1_000_000 + 999_999, levels=levels,
                                descending=direction == "desc", limit=limit)
    return JSONResponse({"logs": [
        {"timestamp": str(r.ts_ns), "message": r.message, "replica": "local-0",
         "request_id": r.request_id, "level": r.level}
        for r in rows]})


async def deployment_logs(request: Request) -> Response:
    ctx = get_ctx(request)
    trainer = ctx.deployments.trainer(request.path_params["deployment_id"])
    return _logs_response(ctx, trainer.deployment.id, dict(request.query_params))


async def deployment_metrics(request: Request) -> Response:
    ctx = get_ctx(request)
    trainer = ctx.deployments.trainer(request.path_params["deployment_id"])
    req = await parse_body(request, MetricsRequest, optional=True)
    now_ms = int(time.time() * 1000)
    end_ms = req.end_epoch_millis or now_ms
    start_ms = req.start_epoch_millis or end_ms - 3600 * 1000
    step_s = req.step_seconds or 60
    if end_ms <= start_ms:
        raise bad_request("end_epoch_millis must be after start_epoch_millis.", "InvalidRequest")
    if (end_ms - start_ms) / 1000 / step_s > 10_000:
        raise bad_request("Too many points; raise step_seconds.", "InvalidRequest")
    return JSONResponse({"deployment_id": trainer.deployment.id,
                         "metrics": ctx.deployments.request_metrics(trainer, start_ms, end_ms,
                                                                    step_s)})


async def debug_archive_files(request: Request) -> Response:
    ctx = get_ctx(request)
    ctx.deployments.trainer(request.path_params["deployment_id"])
    # Locally the "debug archive" is the server log, which `loops server logs` shows.
    return JSONResponse({"presigned_urls": [], "next_page_token": None})


# ── capabilities, user config, teams ──

async def capabilities(request: Request) -> Response:
    ctx = get_ctx(request)
    use_case = request.query_params.get("use_case", "rl")
    if use_case not in ("rl", "sft"):
        raise bad_request(f"use_case must be 'rl' or 'sft', got {use_case!r}.", "InvalidQuery")
    wanted = request.query_params.get("model")
    max_seq = query_int(request, "max_seq_len", 0, minimum=0) or None
    out = await ctx.models.supported(wanted=wanted, max_seq_len=max_seq)
    return JSONResponse({"supported_models": out})


async def user_config(request: Request) -> Response:
    ctx = get_ctx(request)
    if request.method == "PATCH":
        config = ctx.account.update_user_config(await parse_body(request, optional=True))
    else:
        config = ctx.account.user_config()
    return JSONResponse({"user_config": config})


async def list_teams(request: Request) -> Response:
    return JSONResponse({"teams": [LOCAL_TEAM]})


# ── /v1/models/{model_id}/deployments/{deployment_id} (dedicated samplers, deploys) ──

def _model_deployment(ctx: ServerContext, request: Request) -> ModelDeployment:
    return ctx.deployments.model_deployment(request.path_params["model_id"],
                                            request.path_params["deployment_id"])


async def model_deployment(request: Request) -> Response:
    ctx = get_ctx(request)
    found = _model_deployment(ctx, request)
    if found.sampler is not None:
        return JSONResponse(sampler_deployment_view(found.sampler))
    assert found.inference is not None
    return JSONResponse(checkpoint_deployment_view(base_url_of(request), found.inference,
                                                   found.checkpoints))


async def model_deployment_logs(request: Request) -> Response:
    ctx = get_ctx(request)
    found = _model_deployment(ctx, request)
    params: dict[str, Any] = dict(request.query_params)
    if request.method == "POST":
        params.update(await parse_body(request, optional=True))
    return _logs_response(ctx, found.deployment_id, params)


async def model_deployment_deactivate(request: Request) -> Response:
    ctx = get_ctx(request)
    ctx.deployments.deactivate_model_deployment(_model_deployment(ctx, request))
    return JSONResponse({"success": True})


def _with_team_twin(path: str, endpoint: Handler, methods: list[str]) -> list[Route]:
    return [Route(f"/v1/loops{path}", endpoint, methods=methods),
            Route(f"/v1/teams/{{team_id}}/loops{path}", endpoint, methods=methods)]


def routes() -> list[BaseRoute]:
    return [
        *_with_team_twin("/sessions", create_session, ["POST"]),
        Route("/v1/loops/sessions/{session_id}", get_session, methods=["GET"]),
        *_with_team_twin("/runs", create_run, ["POST"]),
        *_with_team_twin("/runs", list_runs, ["GET"]),
        Route("/v1/loops/runs/{run_id}", get_run, methods=["GET"]),
        Route("/v1/loops/runs/{run_id}/deactivate", deactivate_run, methods=["POST"]),
        *_with_team_twin("/trainers", create_trainer, ["POST"]),
        *_with_team_twin("/debug/trainers", create_trainer, ["POST"]),
        *_with_team_twin("/samplers", create_sampler, ["POST"]),
        *_with_team_twin("/samplers", list_samplers, ["GET"]),
        *_with_team_twin("/debug/samplers", create_sampler, ["POST"]),
        Route("/v1/loops/samplers/{sampler_id}", get_sampler, methods=["GET"]),
        Route("/v1/loops/samplers/{sampler_id}/deactivate", deactivate_sampler, methods=["POST"]),
        Route("/v1/loops/checkpoints", list_checkpoints, methods=["GET"]),
        Route("/v1/loops/checkpoints/validate", validate_checkpoint, methods=["POST"]),
        Route("/v1/loops/checkpoints/deploy", deploy_checkpoints, methods=["POST"]),
        Route("/v1/loops/checkpoints/{checkpoint_id}/files", checkpoint_files, methods=["GET"]),
        Route("/v1/loops/checkpoints/{checkpoint_id}/source", checkpoint_source, methods=["GET"]),
        Route("/v1/loops/deployments", list_deployments, methods=["GET"]),
        Route("/v1/loops/deployments/{deployment_id}", get_deployment, methods=["GET"]),
        Route("/v1/loops/deployments/{deployment_id}/deactivate", deactivate_deployment,
              methods=["POST"]),
        Route("/v1/loops/deployments/{deployment_id}/logs", deployment_logs, methods=["GET"]),
        Route("/v1/loops/deployments/{deployment_id}/metrics", deployment_metrics,
              methods=["POST"]),
        Route("/v1/loops/deployments/{deployment_id}/debug_archive/files", debug_archive_files,
              methods=["GET"]),
        Route("/v1/loops/capabilities", capabilities, methods=["GET"]),
        Route("/v1/loops/user_config", user_config, methods=["GET", "PATCH"]),
        Route("/v1/teams", list_teams, methods=["GET"]),
        Route("/v1/models/{model_id}/deployments/{deployment_id}", model_deployment,
              methods=["GET"]),
        Route("/v1/models/{model_id}/deployments/{deployment_id}/logs", model_deployment_logs,
              methods=["GET", "POST"]),
        Route("/v1/models/{model_id}/deployments/{deployment_id}/deactivate",
              model_deployment_deactivate, methods=["POST"]),
    ]

