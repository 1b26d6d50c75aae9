"""Typed errors of the control-plane and worker clients.

Every class is a :class:`~baseten_loops_cli.errors.LoopsError`, so ``cli.main`` prints it as one
``Error: ...`` line with its hint and exit code. This module imports neither httpx nor pydantic:
the CLI can name these classes in ``except`` clauses without paying for the HTTP stack. The
mapping from an ``httpx.Response`` to a class lives in :mod:`baseten_loops_cli.api.http`.

Messages are a single line and never contain the API key (``api.http`` scrubs it before an
error is built).
"""

from __future__ import annotations

from typing import Any

from baseten_loops_cli.errors import AuthError, ExitCode, LoopsError

# A message longer than this is cut: an HTML error page must not flood the terminal.
_MAX_MESSAGE_CHARS = 400


def one_line(text: str, limit: int = _MAX_MESSAGE_CHARS) -> str:
    """Collapse whitespace (newlines included) and cut ``text`` to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class ApiError(LoopsError):
    """The server answered with an error status (4xx/5xx).

    ``status``: HTTP status; ``error_class``: the server's machine class (``error_class``,
    or vLLM's ``type``); ``reason``: ``details.reason`` (e.g. ``NOT_PRESIGNABLE``);
    ``request_id``: the id the server gave the request, for support; ``detail``: the
    human message from the body (first string among detail/error/message); ``body``: the parsed
    JSON body (or ``None``).
    """

    # Used when the raiser gives no hint of its own.
    default_hint: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        error_class: str | None = None,
        reason: str | None = None,
        request_id: str | None = None,
        detail: str | None = None,
        method: str | None = None,
        url: str | None = None,
        body: Any = None,
        hint: str | None = None,
        exit_code: int | None = None,
    ):
        super().__init__(one_line(message), hint=hint or self.default_hint, exit_code=exit_code)
        self.status = status
        self.error_class = error_class
        self.reason = reason
        self.request_id = request_id
        self.detail = detail
        self.method = method
        self.url = url
        self.body = body


class BadRequestError(ApiError):
    """A 4xx that no other class covers (400, 405, 410, 413, 422, ...): the request is wrong."""

    default_hint = "The backend refused the request as sent: change what the message names and run it again."


class AuthenticationError(ApiError, AuthError):
    """401/403: the key is missing, wrong, or lacks the scope for this route."""

    exit_code = ExitCode.AUTH
    default_hint = "run `loops auth login` (or set BASETEN_API_KEY) with a key that has Loops access"


class NotFoundError(ApiError):
    """404: no such run, sampler, checkpoint or deployment (or not visible to this key)."""


class ConflictError(ApiError):
    """409: the resource is in a state that forbids the operation."""


class RateLimitedError(ApiError):
    """429 after the retries ran out. ``retry_after`` is the server's last requested wait (s)."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServerError(ApiError):
    """5xx after the retries ran out."""


class ConnectionFailedError(LoopsError):
    """The request never got an answer: connection refused/reset, DNS failure, timeout.

    ``url`` is what could not be reached (the key is never part of it).
    """

    exit_code = ExitCode.ERROR

    def __init__(self, message: str, *, url: str | None = None, hint: str | None = None):
        super().__init__(
            one_line(message),
            hint=hint
            or "check the URL (profile / LOOPS_BASE_URL) and your network; "
            "for the local backend run `loops server status`",
        )
        self.url = url


class RequestTimeoutError(ConnectionFailedError):
    """The server accepted the connection but did not answer within the timeout."""


# ── Worker (trainer / sampler) errors ───────────────────────────────────────────────────────


class RemoteOpError(LoopsError):
    """A trainer operation finished with ``{"status": "error"}``.

    ``error_class`` is the server's class name (e.g. ``ValueError``, ``EngineInputError``),
    ``operation`` the op name (``forward_backward``), ``operation_id`` its id.
    """

    def __init__(
        self,
        message: str,
        *,
        error_class: str | None = None,
        operation: str,
        operation_id: str,
        run_id: str | None = None,
    ):
        where = f"{operation} {operation_id}" + (f", run {run_id}" if run_id else "")
        prefix = f"{error_class}: " if error_class else ""
        super().__init__(one_line(f"{prefix}{message} ({where})"))
        self.error_class = error_class
        self.operation = operation
        self.operation_id = operation_id
        self.run_id = run_id
        self.remote_message = message


class ServerShutdownError(LoopsError):
    """The worker answered 503 without ``Retry-After``: it is shutting down."""

    def __init__(self, message: str = "the worker is shutting down (HTTP 503)", *, url: str | None = None):
        super().__init__(
            one_line(message),
            hint="retry once the run's trainer is back (`loops runs get <run>` shows its status)",
        )
        self.url = url


class UnknownOperationError(LoopsError):
    """``GET /operations/{id}`` answered 404 even after one resubmit with the same key."""


class OperationExpiredError(LoopsError):
    """``GET /operations/{id}`` answered 410: the result was evicted."""


class OperationTimeoutError(LoopsError, TimeoutError):
    """``OpFuture.result(timeout=...)`` ran out before the op finished (the op keeps running)."""


class SampleTimeoutError(LoopsError, TimeoutError):
    """``/sample`` did not answer within the read timeout; not retried (it restarts generation)."""


class PolicyVersionUnavailableError(LoopsError, NotImplementedError):
    """The trainer does not expose ``/policy_version`` (501, as serverless trainers)."""


class ProtocolError(LoopsError):
    """The server answered with a shape this client does not understand."""


__all__ = [
    "ApiError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "ConnectionFailedError",
    "NotFoundError",
    "OperationExpiredError",
    "OperationTimeoutError",
    "PolicyVersionUnavailableError",
    "ProtocolError",
    "RateLimitedError",
    "RemoteOpError",
    "RequestTimeoutError",
    "SampleTimeoutError",
    "ServerError",
    "ServerShutdownError",
    "UnknownOperationError",
    "one_line",
]
