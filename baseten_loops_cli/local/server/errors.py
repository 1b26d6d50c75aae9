"""Every error the local server returns is JSON ``{"detail": ..., "error_class": ...}``.

``detail`` is one sentence saying what was wrong *and what to do about it*; ``error_class``
is a stable machine-readable name. Clients (ours and the official SDK) take the human
message from ``detail``.

One protocol subtlety shapes this module: the official SDK retries 400 and 404 for up to
an hour, because on the hosted platform they mean "still deploying". A 400 that will
never succeed (bad input) must therefore also carry ``"type": "BadRequestError"`` at the
top level, the marker the SDK treats as a permanent rejection (see its
``http_errors.is_permanent_rejection``). Without it a typo in a loss name would hang a
training script for an hour instead of failing at once.

The SDK also retries a worker route's 404 for that hour, and there no body marker helps.
A worker request naming a run or sampler this server has never had (a URL from another
server, a typo) can never succeed, so that 404 is answered as the hosted gateway answers
a request it will never route: ``X-Baseten-Error-Source: 06`` plus an
``X-Baseten-Error-Code``, sent when the request opted in with ``X-Baseten-Accept-Error: 1``
(the SDK always does). The SDK reads that as "fail at once" (its
``http_errors.is_gateway_rejection``), in its op submits, ``/sample`` retries and trainer
readiness wait alike.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("loops.server")

# The marker the SDK reads as "retrying this exact request cannot succeed".
PERMANENT_REJECTION_TYPE = "BadRequestError"
# The hosted gateway's error-source headers (loops-protocol.md 2.6), sent on request.
ACCEPT_ERROR_HEADER = "x-baseten-accept-error"
ERROR_SOURCE_HEADER = "X-Baseten-Error-Source"
ERROR_CODE_HEADER = "X-Baseten-Error-Code"
GATEWAY_ERROR_SOURCE = "06"


class ApiError(Exception):
    """Raise anywhere in a handler; the app turns it into the JSON error response."""

    def __init__(
        self,
        status: int,
        detail: str,
        error_class: str,
        *,
        reason: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        gateway_code: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.error_class = error_class
        self.reason = reason
        self.headers = headers or {}
        self.extra = extra or {}
        # Set on a worker route's 4xx that no retry can change (see the module docstring).
        self.gateway_code = gateway_code

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"detail": self.detail, "error_class": self.error_class}
        if self.status == 400:
            body["type"] = PERMANENT_REJECTION_TYPE
        if self.reason is not None:
            body["details"] = {"reason": self.reason}
        body.update(self.extra)
        return body

    def response(self, request: Request | None = None) -> JSONResponse:
        headers = dict(self.headers)
        if (self.gateway_code is not None and request is not None
                and request.headers.get(ACCEPT_ERROR_HEADER) == "1"):
            headers[ERROR_SOURCE_HEADER] = GATEWAY_ERROR_SOURCE
            headers[ERROR_CODE_HEADER] = self.gateway_code
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# ── constructors for the common cases (keep messages consistent) ──


def bad_request(detail: str, error_class: str = "InvalidRequest", **kw: Any) -> ApiError:
    return ApiError(400, detail, error_class, **kw)


def not_found(kind: str, ident: str, hint: str = "") -> ApiError:
    detail = f"No {kind} with id {ident!r}."
    if hint:
        detail += f" {hint}"
    return ApiError(404, detail, f"{kind.title().replace(' ', '')}NotFound")


def conflict(detail: str, error_class: str) -> ApiError:
    return ApiError(409, detail, error_class)


# OpenAI's ``error.code`` for the error classes whose OpenAI name differs from ours.
_OPENAI_CODES = {"SequenceTooLong": "context_length_exceeded", "ModelNotFound": "model_not_found",
                 "InvalidApiKey": "invalid_api_key", "AuthenticationRequired": "missing_api_key"}


def openai_error(error: ApiError, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (``{"message", "type", "param", "code"}``) for ``error``: what
    OpenAI clients read (the ``openai`` package shows ``message`` and keeps the object as
    ``exc.body``). Routes serving OpenAI clients add it as ``"error"`` beside ``detail``."""
    kind = "server_error" if error.status >= 500 else "invalid_request_error"
    code = _OPENAI_CODES.get(error.error_class) or re.sub(
        r"(?<=[a-z0-9])(?=[A-Z])", "_", error.error_class).lower()
    return {"message": error.detail, "type": kind, "param": param, "code": code}


def choices(values: Iterable[str]) -> str:
    values = sorted(values)
    return ", ".join(values) if values else "<none>"


# ── app-level handlers ──


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response(request)


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 (no such route / method) in our JSON shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        detail = (f"No route {request.method} {request.url.path}. Check the URL against "
                  "the Loops API (DEVELOPERS.md, 'Local backend URLs').")
        error_class = "RouteNotFound"
    elif exc.status_code == 405:
        detail = f"{request.method} is not allowed on {request.url.path}."
        error_class = "MethodNotAllowed"
    else:
        detail = str(exc.detail)
        error_class = "HTTPError"
    return JSONResponse({"detail": detail, "error_class": error_class},
                        status_code=exc.status_code, headers=exc.headers)


async def unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A bug in the server: log the traceback, answer 500 JSON, keep serving."""
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(
        {"detail": f"Internal error in the local loops server ({type(exc).__name__}: {exc}). "
                   "See server.log in the state dir (`loops server logs`).",
         "error_class": "InternalServerError"},
        status_code=500,
    )
