"""A run's trainer endpoint, ``/trainers/<run_id>`` (loops-protocol.md §3.1).

    GET  /health?base_model=...     200 once the trainer is up (held briefly while deploying)
    GET  /policy_version            {"policy_version": <optim steps taken>}
    POST /<op>                      202 {"operation_id", "schema_version": 1} + Location
    GET  /operations/{id}           long-poll: 200 done/error, 408 still pending, 404 unknown

The eight ops are in ``runs.TRAINER_OPS``. A submit is validated before it is accepted
(bad input -> 400 at once), then queued behind the run's earlier ops.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from baseten_loops_cli.local.server.context import ServerContext, get_ctx
from baseten_loops_cli.local.server.errors import ApiError, not_found
from baseten_loops_cli.local.server.runs import TRAINER_OPS, RunRow
from baseten_loops_cli.local.server.schemas import parse_body

OPERATION_SCHEMA_VERSION = 1


def _run(ctx: ServerContext, request: Request) -> RunRow:
    run_id = request.path_params["run_id"]
    run = ctx.runs.find(run_id)
    if run is None:
        # Runs are never deleted, so no retry can find it: say so the way the gateway
        # does, or the SDK retries this 404 for an hour (errors.py).
        error = not_found("run", run_id, "Its trainer URL is the run's base_url from "
                                         "GET /v1/loops/runs/<run_id>.")
        error.gateway_code = "run_not_found"
        raise error
    return run


async def health(request: Request) -> Response:
    ctx = get_ctx(request)
    run = _run(ctx, request)
    wanted = request.query_params.get("base_model")
    if wanted and wanted != run.base_model:
        raise ApiError(404, f"This trainer serves {run.base_model}, not {wanted}.",
                       "BaseModelMismatch", gateway_code="base_model_mismatch")
    # The SDK's heartbeat pings /health to keep a dedicated trainer warm.
    deployment_status = await ctx.runs.heartbeat(run, ctx.config.health_hold_s)
    return JSONResponse({"status": "ok", "run_id": run.id, "base_model": run.base_model,
                         "deployment_status": deployment_status,
                         "policy_version": run.policy_version})


async def policy_version(request: Request) -> Response:
    ctx = get_ctx(request)
    run = _run(ctx, request)
    return JSONResponse({"policy_version": run.policy_version})


async def submit(request: Request) -> Response:
    ctx = get_ctx(request)
    run = _run(ctx, request)
    op = request.path_params["op"]
    if op not in TRAINER_OPS:
        raise ApiError(404, f"No trainer op {op!r}. Ops: {', '.join(TRAINER_OPS)}.",
                       "RouteNotFound", gateway_code="unknown_operation")
    body = await parse_body(request, optional=True)
    key = request.headers.get("idempotency-key") or None
    row = await ctx.runs.submit(run, op, body, key)
    location = f"/trainers/{run.id}/operations/{row.id}"
    return JSONResponse({"operation_id": row.id, "schema_version": OPERATION_SCHEMA_VERSION},
                        status_code=202, headers={"Location": location})


async def poll(request: Request) -> Response:
    ctx = get_ctx(request)
    run = _run(ctx, request)
    op_id = request.path_params["operation_id"]
    answer = await ctx.ops.poll(run.id, op_id, ctx.config.op_poll_hold_s)
    row = answer.row
    if answer.done:
        # The result's JSON text as stored when the op finished: spliced in, not decoded and
        # encoded again (a forward's logprobs can be megabytes, on the event loop).
        body = f'{{"status":"done","result":{row.result_json or "null"},"operation_id":{json.dumps(row.id)}}}'
        return Response(body.encode("utf-8"), media_type="application/json")
    if answer.failed:
        return JSONResponse({"status": "error", "error": row.error,
                             "error_class": row.error_class, "operation_id": row.id})
    return JSONResponse(
        {"detail": f"Operation {op_id} ({row.op}) is still {row.status}; poll again.",
         "error_class": "OperationPending", "status": row.status, "operation_id": row.id},
        status_code=408)


def routes() -> list[BaseRoute]:
    return [
        Route("/trainers/{run_id}/health", health, methods=["GET"]),
        Route("/trainers/{run_id}/policy_version", policy_version, methods=["GET"]),
        Route("/trainers/{run_id}/operations/{operation_id}", poll, methods=["GET"]),
        Route("/trainers/{run_id}/{op}", submit, methods=["POST"]),
    ]
