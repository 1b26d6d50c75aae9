"""``POST /v1/local/models/pull``: fetch and convert a base model into the server's cache
(what ``loops server pull-model`` asks for).

The answer streams one JSON object per line from the moment the request arrives, so the
client shows progress from the first byte: ``{"event": "start"}``, then the steps
(``download``, ``log`` lines of the downloader, ``convert``), a ``heartbeat`` every second
while a step works, and finally ``done`` (with the model's directory) or ``error``
(``detail``, ``error_class``). Errors after the 200 travel in the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from baseten_loops_cli.local.server.context import get_ctx
from baseten_loops_cli.local.server.schemas import _Request, parse_body

HEARTBEAT_S = 1.0
_pulls: set[asyncio.Task] = set()


class PullModelRequest(_Request):
    model: str = Field(min_length=1)


async def pull_model(request: Request) -> Response:
    ctx = get_ctx(request)
    body = await parse_body(request, PullModelRequest)
    spec = await ctx.models.spec(body.model)  # 400 listing the models for an unknown name
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    started = time.monotonic()

    def report(event: dict[str, Any]) -> None:  # called on the pull's thread
        loop.call_soon_threadsafe(events.put_nowait, event)

    async def work() -> None:
        try:
            path = await asyncio.to_thread(ctx.engine.pull, spec.name, report)
            events.put_nowait({"event": "done", "model": spec.name,
                               "path": str(path) if path else None})
        except Exception as exc:
            error_class = getattr(exc, "error_class", type(exc).__name__)
            events.put_nowait({"event": "error", "detail": str(exc),
                               "error_class": error_class})
        finally:
            events.put_nowait(None)

    async def lines() -> AsyncIterator[str]:
        # Kept referenced: a client that goes away does not stop the pull.
        task = asyncio.create_task(work(), name=f"pull-{spec.name}")
        _pulls.add(task)
        task.add_done_callback(_pulls.discard)
        yield json.dumps({"event": "start", "model": spec.name, "elapsed_s": 0.0}) + "\n"
        while True:
            try:
                event = await asyncio.wait_for(events.get(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                event = {"event": "heartbeat"}
            if event is None:
                return
            event["elapsed_s"] = round(time.monotonic() - started, 1)
            yield json.dumps(event) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def routes() -> list[BaseRoute]:
    return [Route("/v1/local/models/pull", pull_model, methods=["POST"])]
