"""The one httpx layer: auth headers, retries with backoff, debug log, typed errors.

Modelled on the Stainless clients (anthropic-sdk-python ``_base_client.py``): a thin wrapper over
one ``httpx.Client`` that retries what is safe to retry and turns every failure into a
:mod:`baseten_loops_cli.api.errors` class.

What is retried (``max_retries`` extra attempts, exponential backoff with full jitter):

* connect errors (refused, DNS, connect timeout): the request was never sent, any method;
* read timeouts and connections dropped mid-response: idempotent methods only, since a POST
  may already have been applied;
* 429, and 503 with ``Retry-After``: the server asked for a pause, any method; the wait
  honours ``Retry-After`` (seconds, ``retry-after-ms`` or an HTTP date), capped;
* 502/503/504: any method unless the caller says the request is unsafe to repeat (e.g.
  ``POST /checkpoints/deploy``, which is billable and not idempotent);
* 408 and 500: idempotent methods (or ``safe_to_repeat=True``) only.

The helpers below (headers, redaction, backoff, ``error_from_response``) are shared with the
worker clients in :mod:`baseten_loops_cli.workers`.
"""

from __future__ import annotations

import email.utils
import json
import math
import random
import time
from datetime import timezone
from typing import Any, Callable, Iterable, Mapping

import httpx

from baseten_loops_cli import __version__
from baseten_loops_cli.api.errors import (
    ApiError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ConnectionFailedError,
    NotFoundError,
    RateLimitedError,
    RequestTimeoutError,
    ServerError,
    one_line,
)

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
DEFAULT_MAX_RETRIES = 3
INITIAL_RETRY_DELAY = 0.5
MAX_RETRY_DELAY = 8.0
# Bounds the wait a Retry-After can impose between two attempts (the SDK's cap too).
MAX_RETRY_AFTER = 60.0

USER_AGENT = f"loops/{__version__}"
ACCEPT_ERROR_HEADER = "X-Baseten-Accept-Error"
ERROR_SOURCE_HEADER = "X-Baseten-Error-Source"
ERROR_CODE_HEADER = "X-Baseten-Error-Code"
# The serverless gateway's own 4xx: retrying the same request never helps.
GATEWAY_ERROR_SOURCE = "06"

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
RETRY_STATUSES = frozenset({502, 503, 504})

# Headers whose values never reach a log line.
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key"})

# Transport failures where the request was certainly not sent.
_NOT_SENT_EXC: tuple[type[Exception], ...] = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Transport failures after the request may have reached the server.
_MAYBE_SENT_EXC: tuple[type[Exception], ...] = (
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)

DebugLog = Callable[[str], None]
Sleep = Callable[[float], None]


# ── shared helpers ──────────────────────────────────────────────────────────────────────────


def auth_headers(api_key: str | None, user_agent: str = USER_AGENT) -> dict[str, str]:
    """Identity + auth headers every Loops request carries."""
    headers = {"User-Agent": user_agent, ACCEPT_ERROR_HEADER: "1"}
    if api_key:
        headers["Authorization"] = f"Api-Key {api_key}"
    return headers


def redact_header(name: str, value: str) -> str:
    """``Api-Key abc`` → ``Api-Key ***``; any other secret header → ``***``."""
    if name.lower() not in _SECRET_HEADERS:
        return value
    scheme, sep, _ = value.partition(" ")
    return f"{scheme} ***" if sep and name.lower().endswith("authorization") else "***"


def redact_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    items = headers.items() if isinstance(headers, Mapping) else headers
    return {k: redact_header(k, v) for k, v in items}


def scrub(text: str, secret: str | None) -> str:
    """Remove ``secret`` from ``text`` (a server could echo the header back in its body)."""
    if secret and len(secret) >= 4 and secret in text:
        return text.replace(secret, "***")
    return text


def backoff_delay(
    attempt: int,
    *,
    initial: float = INITIAL_RETRY_DELAY,
    maximum: float = MAX_RETRY_DELAY,
    rng: Callable[[], float] = random.random,
) -> float:
    """Full-jitter exponential backoff: uniform in ``[0, min(maximum, initial * 2**attempt)]``.

    ``attempt`` counts retries already made (0 for the first retry). Full jitter (AWS
    architecture blog) spreads a burst of clients better than the Stainless 0.75-1 factor.
    """
    ceiling = min(maximum, initial * (2 ** min(attempt, 30)))
    return ceiling * rng()


def retry_after_seconds(headers: Mapping[str, str], cap: float = MAX_RETRY_AFTER) -> float | None:
    """The wait a response asks for (``retry-after-ms``, ``Retry-After`` seconds or HTTP date),
    clamped to ``[0, cap]``; ``None`` when it names no usable delay."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            value = float(raw_ms) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return min(max(value, 0.0), cap)
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if parsed.tzinfo is None:  # "-0000" dates parse naive; they are UTC
            parsed = parsed.replace(tzinfo=timezone.utc)
        value = parsed.timestamp() - time.time()
    if not math.isfinite(value):
        return None
    return min(max(value, 0.0), cap)


def _safe_retry_after(headers: Mapping[str, str], cap: float) -> float | None:
    return retry_after_seconds(headers, cap)


def _json_or_none(resp: httpx.Response) -> Any:
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        return None


def error_fields(body: Any, text: str = "") -> tuple[str | None, str | None, str | None]:
    """``(detail, error_class, reason)`` from an error body.

    ``detail`` is the first non-empty string among ``detail``/``error``/``message`` (§2.6), or
    the ``message`` of a nested vLLM ``{"error": {...}}``; ``error_class`` is ``error_class`` or
    vLLM's ``type``; ``reason`` is ``details.reason``.
    """
    detail = error_class = reason = None
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            value = body.get(key)
            if isinstance(value, str) and value.strip():
                detail = value
                break
        nested = body.get("error") if isinstance(body.get("error"), dict) else None
        if detail is None and nested is not None:
            msg = nested.get("message")
            detail = msg if isinstance(msg, str) and msg.strip() else None
        if detail is None and isinstance(body.get("detail"), list):
            # FastAPI/pydantic validation errors: a list of {loc, msg}.
            msgs = [d.get("msg") for d in body["detail"] if isinstance(d, dict) and d.get("msg")]
            detail = "; ".join(msgs) or None
        cls = body.get("error_class") or body.get("type") or (nested or {}).get("type")
        error_class = cls if isinstance(cls, str) else None
        details = body.get("details")
        if isinstance(details, dict) and isinstance(details.get("reason"), str):
            reason = details["reason"]
    elif body is None and text.strip() and not text.lstrip().startswith("<"):
        detail = text.strip()
    return detail, error_class, reason


def _request_id(resp: httpx.Response, body: Any) -> str | None:
    for name in ("x-request-id", "x-baseten-request-id", "request-id"):
        if resp.headers.get(name):
            return resp.headers[name]
    if isinstance(body, dict) and isinstance(body.get("request_id"), str):
        return body["request_id"]
    return None


_SECRET_QUERY_KEYS = frozenset({"sig", "signature", "token", "key", "api_key", "apikey", "access_token",
                                 "x-amz-signature", "x-amz-credential", "x-amz-security-token"})  # fmt: skip


def redact_url(url: httpx.URL | str) -> str:
    """The URL with secret-looking query values (``sig``, ``token``, ``api_key``, S3 signature
    fields) replaced by ``***``: what the debug log prints."""
    u = httpx.URL(str(url))
    if not u.query:
        return str(u)
    params = [(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in u.params.multi_items()]
    return str(u.copy_with(params=params))


def _display_url(url: httpx.URL | str) -> str:
    """The URL without its query (presigned signatures) and without userinfo."""
    u = httpx.URL(str(url))
    return str(u.copy_with(query=None, fragment=None, username=None, password=None))


def error_from_response(resp: httpx.Response, *, api_key: str | None = None) -> ApiError:
    """Map an error response to the typed :class:`ApiError` subclass for its status."""
    body = _json_or_none(resp)
    detail, error_class, reason = error_fields(body, resp.text if body is None else "")
    status = resp.status_code
    method = resp.request.method if resp.request is not None else None
    url = _display_url(resp.request.url) if resp.request is not None else None
    where = f"{method} {httpx.URL(url).path}" if method and url else "request"
    gateway = resp.headers.get(ERROR_SOURCE_HEADER) == GATEWAY_ERROR_SOURCE
    code = resp.headers.get(ERROR_CODE_HEADER)
    text = f"HTTP {status} for {where}"
    if gateway and code:
        text += f" (Loops gateway: {code})"
    if detail:
        text = f"{detail} ({text})"
    elif reason:
        text = f"{reason} ({text})"
    message = scrub(text, api_key)
    kwargs: dict[str, Any] = dict(
        status=status,
        error_class=error_class,
        reason=reason,
        request_id=_request_id(resp, body),
        detail=scrub(detail, api_key) if detail else None,
        method=method,
        url=url,
        body=body,
    )
    if status in (401, 403):
        return AuthenticationError(message, **kwargs)
    if status == 404:
        return NotFoundError(message, **kwargs)
    if status == 409:
        return ConflictError(message, **kwargs)
    if status == 429:
        retry_after = _safe_retry_after(resp.headers, cap=math.inf)
        hint = f"the server asked to wait {retry_after:.0f}s before retrying" if retry_after else None
        return RateLimitedError(message, retry_after=retry_after, hint=hint, **kwargs)
    if status >= 500:
        return ServerError(message, **kwargs)
    if status >= 400:
        return BadRequestError(message, **kwargs)
    return ApiError(message, **kwargs)  # pragma: no cover - callers pass error statuses only


def connection_error(exc: Exception, url: httpx.URL | str, *, api_key: str | None = None) -> ConnectionFailedError:
    """Map an httpx transport failure to :class:`ConnectionFailedError` (or its timeout child)."""
    shown = _display_url(url)
    reason = scrub(one_line(str(exc) or type(exc).__name__, 160), api_key)
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        return RequestTimeoutError(f"timed out waiting for {shown} ({type(exc).__name__})", url=shown)
    return ConnectionFailedError(f"could not reach {shown}: {reason}", url=shown)


def is_permanent_rejection(resp: httpx.Response) -> bool:
    """A 4xx no retry can fix: the serverless gateway's own rejection, or vLLM's
    ``BadRequestError`` (both shapes), or a structured engine error (``error_class``)."""
    if not 400 <= resp.status_code < 500:
        return False
    if resp.headers.get(ERROR_SOURCE_HEADER) == GATEWAY_ERROR_SOURCE:
        return True
    body = _json_or_none(resp)
    if not isinstance(body, dict):
        return False
    nested = body.get("error")
    payload = nested if isinstance(nested, dict) else body
    return payload.get("type") == "BadRequestError" or bool(body.get("error_class"))


def get_with_retries(
    client: httpx.Client,
    url: str,
    *,
    params: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    max_retries: int = 8,
    sleep: Sleep = time.sleep,
    rng: Callable[[], float] = random.random,
    api_key: str | None = None,
) -> httpx.Response:
    """A GET on a bare ``httpx.Client`` (the worker clients), retried like :class:`HttpClient`
    retries a GET: transport errors, 408, 429, 500, 502, 503, 504 (honouring Retry-After).

    Returns the last response, error statuses included (the caller maps them: a 501 can mean
    "unsupported"); raises :class:`ConnectionFailedError` when the server never answered.
    """
    attempt = 0
    while True:
        try:
            resp = client.get(url, params=params, headers=headers)
        except httpx.TransportError as exc:
            if attempt >= max_retries:
                raise connection_error(exc, url, api_key=api_key) from exc
            sleep(backoff_delay(attempt, rng=rng))
            attempt += 1
            continue
        if resp.status_code in (408, 429, 500, 502, 503, 504) and attempt < max_retries:
            delay = retry_after_seconds(resp.headers)
            sleep(backoff_delay(attempt, rng=rng) if delay is None else delay)
            attempt += 1
            continue
        return resp


# ── the client ──────────────────────────────────────────────────────────────────────────────


class HttpClient:
    """One ``httpx.Client`` with Loops auth headers, retries and typed errors.

    ``debug_log`` receives one line per attempt (method, URL, status, elapsed, headers with
    ``Authorization`` redacted to ``Api-Key ***``). ``sleep`` and ``rng`` are injectable so tests
    run the retry paths without waiting.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        user_agent: str = USER_AGENT,
        debug_log: DebugLog | None = None,
        sleep: Sleep = time.sleep,
        rng: Callable[[], float] = random.random,
        max_retry_after: float = MAX_RETRY_AFTER,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.max_retries = max(0, int(max_retries))
        self.debug_log = debug_log
        self._sleep = sleep
        self._rng = rng
        self._max_retry_after = max_retry_after
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=auth_headers(api_key, user_agent),
            timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
            transport=transport,
            follow_redirects=False,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None | object = httpx.USE_CLIENT_DEFAULT,
        safe_to_repeat: bool | None = None,
        max_retries: int | None = None,
    ) -> httpx.Response:
        """Send one request (with retries) and return the 2xx/3xx response, or raise.

        ``safe_to_repeat``: whether the request may be re-sent after it possibly reached the
        server (read timeout, dropped connection, 502/504). Defaults to the method being
        idempotent, except that 502/503/504 are retried for every method unless this is
        ``False`` explicitly (the server did not apply a request it answered 502/503/504 to
        in this API).
        """
        method = method.upper()
        idempotent = method in IDEMPOTENT_METHODS
        repeat_after_send = idempotent if safe_to_repeat is None else safe_to_repeat
        retries = self.max_retries if max_retries is None else max(0, max_retries)
        clean_params = {k: v for k, v in (params or {}).items() if v is not None} or None
        attempt = 0
        while True:
            request = self._client.build_request(
                method, path, params=clean_params, json=json, headers=headers, timeout=timeout
            )
            started = time.monotonic()
            self._log_request(request, attempt)
            try:
                resp = self._client.send(request)
            except httpx.TransportError as exc:
                elapsed = time.monotonic() - started
                self._log(f"<- {type(exc).__name__} {request.method} {_display_url(request.url)} ({elapsed * 1000:.0f} ms)")
                retryable = isinstance(exc, _NOT_SENT_EXC) or (isinstance(exc, _MAYBE_SENT_EXC) and repeat_after_send)
                if retryable and attempt < retries:
                    self._wait(attempt, None, reason=type(exc).__name__)
                    attempt += 1
                    continue
                raise connection_error(exc, request.url, api_key=self._api_key) from exc

            elapsed = time.monotonic() - started
            self._log_response(resp, elapsed)
            if resp.status_code < 400:
                return resp
            delay = self._retry_delay(resp, idempotent=idempotent, safe_to_repeat=safe_to_repeat)
            if delay is not False and attempt < retries:
                resp.close()
                self._wait(attempt, delay, reason=f"HTTP {resp.status_code}")
                attempt += 1
                continue
            raise error_from_response(resp, api_key=self._api_key)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def patch(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("PATCH", path, **kwargs)

    def request_json(self, method: str, path: str, **kwargs: Any) -> Any:
        """:meth:`request`, returning the decoded JSON body (``{}`` for an empty body)."""
        resp = self.request(method, path, **kwargs)
        if not resp.content:
            return {}
        try:
            return resp.json()
        except ValueError as exc:
            from baseten_loops_cli.api.errors import ProtocolError

            raise ProtocolError(
                f"{method} {httpx.URL(path).path}: the server answered {resp.status_code} with a non-JSON body"
            ) from exc

    # -- retry policy ----------------------------------------------------------------------

    def _retry_delay(self, resp: httpx.Response, *, idempotent: bool, safe_to_repeat: bool | None) -> float | None | bool:
        """``False`` = do not retry; ``None`` = retry after the backoff; a float = after that."""
        status = resp.status_code
        retry_after = _safe_retry_after(resp.headers, self._max_retry_after)
        if status == 429:
            return retry_after
        if status == 503 and retry_after is not None:
            return retry_after
        if status in RETRY_STATUSES:
            if safe_to_repeat is False:
                return False
            return retry_after
        if status in (408, 500) and (idempotent if safe_to_repeat is None else safe_to_repeat):
            # 408: a proxy gave up waiting; 500: maybe transient. Only re-sent when repeating
            # the request is harmless (a POST may already have been applied).
            return retry_after
        return False

    def _wait(self, attempt: int, delay: float | None, *, reason: str) -> None:
        wait = backoff_delay(attempt, rng=self._rng) if delay is None else delay
        self._log(f"   retry {attempt + 1}/{self.max_retries} after {reason}: sleeping {wait:.2f}s")
        self._sleep(wait)

    # -- debug log -------------------------------------------------------------------------

    def _log(self, line: str) -> None:
        if self.debug_log is not None:
            self.debug_log(scrub(line, self._api_key))

    def _log_request(self, request: httpx.Request, attempt: int) -> None:
        if self.debug_log is None:
            return
        suffix = f" (attempt {attempt + 1})" if attempt else ""
        self._log(f"-> {request.method} {redact_url(request.url)}{suffix} headers={json.dumps(redact_headers(request.headers.multi_items()))}")

    def _log_response(self, resp: httpx.Response, elapsed: float) -> None:
        if self.debug_log is None:
            return
        self._log(
            f"<- {resp.status_code} {resp.request.method} {redact_url(resp.request.url)} ({elapsed * 1000:.0f} ms) "
            f"headers={json.dumps(redact_headers(resp.headers.multi_items()))}"
        )


__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "HttpClient",
    "USER_AGENT",
    "auth_headers",
    "backoff_delay",
    "connection_error",
    "error_fields",
    "error_from_response",
    "get_with_retries",
    "is_permanent_rejection",
    "redact_header",
    "redact_headers",
    "redact_url",
    "retry_after_seconds",
    "scrub",
]
