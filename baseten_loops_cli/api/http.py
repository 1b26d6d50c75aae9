"""The one transport: retry policy, the retry decision, the send loop, typed errors.

Every request of the CLI - control plane, trainer and sampler workers, operation polling, run
creation, checkpoint downloads - is decided by :func:`decide` under a :class:`RetryPolicy`, and
sent by :meth:`HttpClient.send` (sync) or :meth:`HttpClient.asend` (async), the only loops that
re-send a request. The shape follows the Stainless clients (anthropic-sdk-python
``_base_client.py``: a policy, a "should retry" decision, Retry-After honoured and capped,
exponential backoff with jitter, typed errors), with two additions the Loops protocol needs: a
deadline (workers wait out cold starts by time, not by count) and "may it have been applied?"
for requests without an Idempotency-Key.

The policy and the decision are :mod:`baseten_loops_cli.api.retry` (pure); this module sends.

Giving up (retries, deadline, unreachable or unavailable limits spent) raises the typed error
of the last outcome, naming the URL, the last status or failure and the attempts made.

One ``httpx.Client`` per origin per process (and one ``httpx.AsyncClient`` per origin per event
loop) is shared by every :class:`HttpClient`; headers (``Authorization``, ``User-Agent``) are
built by :func:`auth_headers` and sent per request, so clients with different keys can share
connections.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypedDict, TypeVar, Unpack

import httpx

if TYPE_CHECKING:
    import asyncio

from baseten_loops_cli import __version__
from baseten_loops_cli.api.errors import (
    ApiError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ConnectionFailedError,
    NotFoundError,
    ProtocolError,
    RateLimitedError,
    RequestTimeoutError,
    ServerError,
    ServerShutdownError,
    one_line,
)
from baseten_loops_cli.api.retry import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_POLICY,
    IDEMPOTENT_METHODS,
    MAX_RETRY_AFTER,
    RETRYABLE_TRANSPORT_ERRORS,
    Decision,
    RetryPolicy,
    RetryState,
    backoff_delay,
    decide,
    request_was_sent,
    retry_after_seconds,
)
from baseten_loops_cli.errors import LoopsError

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)

USER_AGENT = f"loops/{__version__}"
ACCEPT_ERROR_HEADER = "X-Baseten-Accept-Error"
ERROR_SOURCE_HEADER = "X-Baseten-Error-Source"
ERROR_CODE_HEADER = "X-Baseten-Error-Code"
# The serverless gateway's own 4xx: retrying the same request never helps.
GATEWAY_ERROR_SOURCE = "06"

# Headers whose values never reach a log line.
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key"})

DebugLog = Callable[[str], None]
Sleep = Callable[[float], None]
T = TypeVar("T")


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
    """Remove ``secret`` from ``text`` (a server could echo the header back in its body), also
    as Python escapes it (h11's "Illegal header value b'Api-Key sk-...\\n'" shows a key with a
    stray newline that way)."""
    if not secret or len(secret) < 4:
        return text
    forms = {secret, repr(secret)[1:-1], repr(secret.encode("utf-8", "backslashreplace"))[2:-1]}
    for form in sorted(forms, key=len, reverse=True):
        if form in text:
            text = text.replace(form, "***")
    return text




def _running_loop() -> "asyncio.AbstractEventLoop":
    """The running event loop. asyncio is imported by the async paths only: every sync
    command (most of them) would pay ~11 ms to import it, and async callers have it already."""
    import asyncio

    return asyncio.get_running_loop()


class SendOptions(TypedDict, total=False):
    """The keywords of :meth:`HttpClient.send` / :meth:`HttpClient.asend` (all optional).

    ``policy``: the retry policy (default: the client's). ``repeatable``: whether the request
    may be sent again after the server may have received it; defaults to the method being
    idempotent (pass True for a body keyed by an Idempotency-Key). ``accept``: statuses returned
    as they are, not raised. ``retry_if``: an accepted response that is retried all the same."""

    params: Mapping[str, Any] | None
    json: Any
    headers: Mapping[str, str] | None
    timeout: Any  # httpx.USE_CLIENT_DEFAULT: the client's
    policy: RetryPolicy | None
    repeatable: bool | None
    accept: Iterable[int]
    retry_if: Callable[[httpx.Response], bool] | None


class _Attempts:
    """The attempts of one :meth:`HttpClient.send` / ``asend`` (what the sync and async loops
    share): each attempt's request, and the decision on its outcome."""

    def __init__(self, http: "HttpClient", client: httpx.Client | httpx.AsyncClient, method: str, path: str,
                 options: SendOptions, *, stream: bool) -> None:  # fmt: skip
        self._http = http
        self._client = client
        self._method = method.upper()
        self._path = path
        self._options = options
        self._stream = stream
        self._policy = options.get("policy") or http.policy
        repeatable = options.get("repeatable")
        self._repeat = self._method in IDEMPOTENT_METHODS if repeatable is None else repeatable
        self._state = RetryState(started=time.monotonic())
        self._request: httpx.Request | None = None
        self._started = 0.0

    def next_request(self) -> httpx.Request:
        options = self._options
        self._request = self._http._build(self._client, self._method, self._path, params=options.get("params"),
                                          json=options.get("json"), headers=options.get("headers"),
                                          timeout=options.get("timeout", httpx.USE_CLIENT_DEFAULT))  # fmt: skip
        self._http._log_request(self._request, self._state.attempt)
        self._started = time.monotonic()
        return self._request

    def decide(self, outcome: httpx.Response | httpx.TransportError) -> httpx.Response | float:
        """The response to return, or the pause before the next attempt; raises the typed
        error of ``outcome`` when the policy gives up."""
        assert self._request is not None  # next_request() came first
        decision, self._state = self._http._decide(self._policy, outcome, self._state, self._request, self._started,
                                                   self._repeat, self._options.get("accept", ()),
                                                   self._options.get("retry_if"))  # fmt: skip
        if decision.action == "return":
            return outcome  # type: ignore[return-value]  # decide() returns only responses
        if self._stream and isinstance(outcome, httpx.Response):
            outcome.close()
        if decision.action == "raise":
            raise self._http._error(self._request, outcome, decision, self._state) from (
                outcome if isinstance(outcome, BaseException) else None)
        return decision.delay


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)




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
            msgs = [str(d["msg"]) for d in body["detail"] if isinstance(d, dict) and d.get("msg")]
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


def error_from_response(resp: httpx.Response, *, api_key: str | None = None, gave_up: str | None = None) -> ApiError:
    """Map an error response to the typed :class:`ApiError` subclass for its status.

    ``gave_up`` ("gave up after 4 attempts in 3.1s") marks the last answer of a retried
    request: the message then names the whole URL, not only the path."""
    body = _json_or_none(resp)
    detail, error_class, reason = error_fields(body, resp.text if body is None else "")
    status = resp.status_code
    method = resp.request.method if resp.request is not None else None
    url = _display_url(resp.request.url) if resp.request is not None else None
    where = f"{method} {url if gave_up else httpx.URL(url).path}" if method and url else "request"
    gateway = resp.headers.get(ERROR_SOURCE_HEADER) == GATEWAY_ERROR_SOURCE
    code = resp.headers.get(ERROR_CODE_HEADER)
    text = f"HTTP {status} for {where}"
    if gave_up:
        text += f"; {gave_up}"
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
        retry_after = retry_after_seconds(resp.headers, cap=math.inf)
        hint = f"the server asked to wait {retry_after:.0f}s before retrying" if retry_after else None
        return RateLimitedError(message, retry_after=retry_after, hint=hint, **kwargs)
    if status >= 500:
        return ServerError(message, **kwargs)
    if status >= 400:
        return BadRequestError(message, **kwargs)
    return ApiError(message, **kwargs)  # pragma: no cover - callers pass error statuses only


def connection_error(
    exc: BaseException, url: httpx.URL | str, *, api_key: str | None = None, gave_up: str | None = None
) -> ConnectionFailedError:
    """Map an httpx transport failure to :class:`ConnectionFailedError` (or its timeout child)."""
    shown = _display_url(url)
    reason = one_line(scrub(str(exc) or type(exc).__name__, api_key), 160)  # scrubbed whole: a cut key is not found
    suffix = f"; {gave_up}" if gave_up else ""
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        return RequestTimeoutError(f"timed out waiting for {shown} ({type(exc).__name__}{suffix})", url=shown)
    return ConnectionFailedError(f"could not reach {shown}: {reason}" + (f" ({gave_up})" if gave_up else ""), url=shown)


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




# ── one httpx client per origin per process ──────────────────────────────────────────────────

_SYNC_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=64)
# Async sampling fans out (hundreds of concurrent /sample calls for RL groups).
_ASYNC_LIMITS = httpx.Limits(max_connections=2048, max_keepalive_connections=256)


def _transport(origin: str, *, asynchronous: bool = False) -> Any:
    """The transport of one origin's client. A plain-http origin never does TLS (redirects are
    not followed), so it skips loading the CA bundle (tens of ms per process)."""
    verify = origin.startswith("https://")
    if asynchronous:
        return httpx.AsyncHTTPTransport(verify=verify, limits=_ASYNC_LIMITS)
    return httpx.HTTPTransport(verify=verify, limits=_SYNC_LIMITS)


def _origin(url: str) -> str:
    u = httpx.URL(url)
    return f"{u.scheme}://{u.netloc.decode('ascii')}"


class _SharedClients:
    """The process's httpx clients: one per origin (async: per origin and event loop), counted
    by users; the last :meth:`HttpClient.close` of an origin closes its client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sync: dict[str, list[Any]] = {}
        self._async: dict[tuple[str, asyncio.AbstractEventLoop], list[Any]] = {}

    def acquire(self, origin: str) -> httpx.Client:
        with self._lock:
            entry = self._sync.get(origin)
            if entry is None or entry[0].is_closed:
                client = httpx.Client(timeout=DEFAULT_TIMEOUT, transport=_transport(origin), follow_redirects=False)
                entry = self._sync[origin] = [client, 0]
            entry[1] += 1
            return entry[0]

    def release(self, origin: str, client: httpx.Client) -> None:
        with self._lock:
            entry = self._sync.get(origin)
            if entry is None or entry[0] is not client:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._sync[origin]
        client.close()

    def acquire_async(self, origin: str) -> httpx.AsyncClient:
        loop = _running_loop()
        with self._lock:
            for key in [k for k in self._async if k[1].is_closed()]:
                del self._async[key]  # its loop is gone: nothing can close it any more
            entry = self._async.get((origin, loop))
            if entry is None or entry[0].is_closed:
                client = httpx.AsyncClient(timeout=DEFAULT_TIMEOUT, transport=_transport(origin, asynchronous=True),
                                           follow_redirects=False)
                entry = self._async[(origin, loop)] = [client, 0]
            entry[1] += 1
            return entry[0]

    async def release_async(self, origin: str, client: httpx.AsyncClient) -> None:
        loop = _running_loop()
        with self._lock:
            entry = self._async.get((origin, loop))
            if entry is None or entry[0] is not client:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._async[(origin, loop)]
        await client.aclose()


_SHARED = _SharedClients()


# ── the client ──────────────────────────────────────────────────────────────────────────────


class HttpClient:
    """Requests to one base URL, sent by the one send loop under a :class:`RetryPolicy`.

    ``policy`` defaults to :data:`DEFAULT_POLICY` with ``max_retries`` and ``max_retry_after``;
    ``headers`` are added to :func:`auth_headers` on every request (a worker's ``X-Run-Id``).
    ``debug_log`` receives one line per attempt (method, URL, status, elapsed, headers with
    ``Authorization`` redacted to ``Api-Key ***``). ``sleep`` and ``rng`` are injectable so tests
    run the retry paths without waiting. ``transport`` (tests) gives this client a private
    httpx client on that transport instead of the shared one.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        policy: RetryPolicy | None = None,
        user_agent: str = USER_AGENT,
        headers: Mapping[str, str] | None = None,
        debug_log: DebugLog | None = None,
        sleep: Sleep = time.sleep,
        rng: Callable[[], float] = random.random,
        max_retry_after: float = MAX_RETRY_AFTER,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.policy = policy or DEFAULT_POLICY.replace(max_retries=max(0, int(max_retries)), max_retry_after=max_retry_after)
        self.headers = {**auth_headers(api_key, user_agent), **(headers or {})}
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.debug_log = debug_log
        self._sleep = sleep
        self._rng = rng
        self._origin = _origin(self.base_url)
        self._private = transport is not None
        if transport is not None:
            self._client = httpx.Client(timeout=DEFAULT_TIMEOUT, transport=transport, follow_redirects=False)
        else:
            self._client = _SHARED.acquire(self._origin)
        self._aclients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._closed = False

    @property
    def max_retries(self) -> int | None:
        return self.policy.max_retries

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._private:
            self._client.close()
        else:
            _SHARED.release(self._origin, self._client)
        self._aclients.clear()  # an AsyncClient is closed on its own loop (aclose)

    async def aclose(self) -> None:
        loop = _running_loop()
        aclient = self._aclients.pop(loop, None)
        if aclient is not None:
            await _SHARED.release_async(self._origin, aclient)

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _async_client(self) -> httpx.AsyncClient:
        loop = _running_loop()
        aclient = self._aclients.get(loop)
        if aclient is None:
            for gone in [k for k in self._aclients if k.is_closed()]:
                del self._aclients[gone]
            aclient = self._aclients[loop] = _SHARED.acquire_async(self._origin)
        return aclient

    # -- the send loop -----------------------------------------------------------------------

    def url(self, path: str) -> str:
        """``path`` under the base URL (``/v1/...`` or ``forward``); absolute URLs as given."""
        if path.startswith(("http://", "https://")):
            return path
        if not path:
            return self.base_url
        return self.base_url + (path if path.startswith("/") else "/" + path)

    def _build(self, client: httpx.Client | httpx.AsyncClient, method: str, path: str, *, params: Any, json: Any,
               headers: Mapping[str, str] | None, timeout: Any) -> httpx.Request:
        clean = ({k: v for k, v in params.items() if v is not None} or None) if isinstance(params, Mapping) else params
        merged = {**self.headers, **(headers or {})}
        if timeout is httpx.USE_CLIENT_DEFAULT:
            timeout = self.timeout
        return client.build_request(method, self.url(path), params=clean, json=json, headers=merged, timeout=timeout)

    def open(self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
             timeout: Any = httpx.USE_CLIENT_DEFAULT, follow_redirects: bool = False) -> httpx.Response:
        """One attempt, streamed (the caller reads and closes the body): for a transfer whose
        retries depend on what arrived (``api.download`` decides with :func:`decide`) or a
        stream of events. Raises the httpx transport error as is."""
        request = self._build(self._client, method, url, params=None, json=json, headers=headers, timeout=timeout)
        self._log_request(request, 0)
        started = time.monotonic()
        try:
            resp = self._client.send(request, stream=True, follow_redirects=follow_redirects)
        except httpx.TransportError as exc:
            self._log_outcome(request, exc, time.monotonic() - started)
            raise
        self._log_outcome(request, resp, time.monotonic() - started)
        return resp

    def send(self, method: str, path: str, *, stream: bool = False, **options: Unpack[SendOptions]) -> httpx.Response:
        """Send one request, retried as :func:`decide` says; return the response it accepts
        (2xx/3xx and the ``accept`` statuses) or raise the typed error of the last outcome.

        ``options`` are :class:`SendOptions`. ``stream``: the accepted response's body is not
        read yet (iterate it, then close it); error bodies are read for the decision as usual."""
        attempts = _Attempts(self, self._client, method, path, options, stream=stream)
        while True:
            request = attempts.next_request()
            try:
                response = self._client.send(request, stream=stream)
                if stream and response.status_code >= 400:
                    response.read()
                    response.close()
                outcome: httpx.Response | httpx.TransportError = response
            except httpx.TransportError as exc:
                outcome = exc
            accepted_or_delay = attempts.decide(outcome)
            if isinstance(accepted_or_delay, httpx.Response):
                return accepted_or_delay
            self._sleep(accepted_or_delay)

    async def asend(self, method: str, path: str, **options: Unpack[SendOptions]) -> httpx.Response:
        """:meth:`send` on the shared ``httpx.AsyncClient`` of this event loop."""
        client = self._async_client()
        attempts = _Attempts(self, client, method, path, options, stream=False)
        while True:
            request = attempts.next_request()
            try:
                outcome: httpx.Response | httpx.TransportError = await client.send(request)
            except httpx.TransportError as exc:
                outcome = exc
            accepted_or_delay = attempts.decide(outcome)
            if isinstance(accepted_or_delay, httpx.Response):
                return accepted_or_delay
            await _sleep(accepted_or_delay)

    def _decide(self, policy: RetryPolicy, outcome: Any, state: RetryState, request: httpx.Request, started: float,
                repeat: bool, accept: Iterable[int], retry_if: Any) -> tuple[Decision, RetryState]:
        now = time.monotonic()
        self._log_outcome(request, outcome, now - started)
        decision, state = decide(policy, outcome, state, now=now, repeatable=repeat, rng=self._rng, accept=accept,
                                 retry_if=retry_if)  # fmt: skip
        if decision.action == "retry":
            total = "" if policy.max_retries is None else f"/{policy.max_retries}"
            self._log(f"   retry {state.attempt}{total} after {decision.reason}: sleeping {decision.delay:.2f}s")
        return decision, state

    def _error(self, request: httpx.Request, outcome: Any, decision: Decision, state: RetryState) -> LoopsError:
        """The typed error for giving up on ``outcome``; it names the URL and the last status."""
        gave_up = None
        if state.attempt:
            gave_up = f"gave up after {state.attempt + 1} attempts in {time.monotonic() - state.started:.1f}s"
        if isinstance(outcome, BaseException):
            err: LoopsError = connection_error(outcome, request.url, api_key=self.api_key, gave_up=gave_up)
        elif decision.shutdown:
            err = ServerShutdownError(
                f"{_display_url(request.url)} answered HTTP 503 {state.unavailable} times in a row without Retry-After "
                f"(the worker is shutting down or gone{'; ' + gave_up if gave_up else ''})",
                url=self.base_url,
            )
        else:
            err = error_from_response(outcome, api_key=self.api_key, gave_up=gave_up)
        if decision.maybe_applied:
            # Read by HttpClient.create: the outcome to decide on after reconciling.
            err.maybe_applied = True  # type: ignore[attr-defined]
            err.outcome = outcome  # type: ignore[attr-defined]
        return err

    # -- the control plane's request API -------------------------------------------------------

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
        """:meth:`send` with this client's policy (``max_retries`` overrides its count).

        ``safe_to_repeat``: whether the request may be re-sent after it possibly reached the
        server (read timeout, dropped connection, 408/500/502/503/504); defaults to the method
        being idempotent. A create without an Idempotency-Key goes through :meth:`create`."""
        policy = self.policy if max_retries is None else self.policy.replace(max_retries=max(0, max_retries))
        return self.send(method, path, params=params, json=json, headers=headers, timeout=timeout, policy=policy,
                         repeatable=safe_to_repeat)  # fmt: skip

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def patch(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("PATCH", path, **kwargs)

    def request_json(self, method: str, path: str, **kwargs: Any) -> Any:
        """:meth:`request`, returning the decoded JSON body (``{}`` for an empty body)."""
        return response_json(self.request(method, path, **kwargs))

    def create(
        self,
        path: str,
        *,
        json: Any,
        parse: Callable[[Any], T],
        find: Callable[[], list[T]] | None,
        discard: Callable[[T], Any] | None = None,
        what: str = "object",
    ) -> T:
        """POST a create that carries no Idempotency-Key (run, trainer, sampler, deployment).

        It is never re-sent blindly. After an ambiguous failure (dropped connection, timeout,
        502 after the request was sent) ``find()`` looks for what it may have made (by session
        or name, oldest first): a match is the result; with none, the POST is sent again, under
        this client's policy (Retry-After, backoff, retries). When an ambiguous failure
        happened, every other match ``find()`` returns at the end is a duplicate and is
        ``discard``-ed (deactivated). Without ``find`` an ambiguous failure is raised with a
        hint to check before trying again."""
        state = RetryState(started=time.monotonic())
        ambiguous = False
        while True:
            try:
                made = parse(self.request_json("POST", path, json=json, safe_to_repeat=False))
                break
            except LoopsError as exc:
                outcome = getattr(exc, "outcome", None)
                if not getattr(exc, "maybe_applied", False) or outcome is None:
                    raise
                if find is None:
                    exc.hint = f"the {what} may have been created anyway: check before trying again"
                    raise
                ambiguous = True
                decision, state = decide(self.policy, outcome, state, now=time.monotonic(), repeatable=True, rng=self._rng)
                if decision.action != "retry":
                    request = outcome.request if isinstance(outcome, httpx.Response) else httpx.Request("POST", self.url(path))
                    raise self._error(request, outcome, decision, state) from exc
                # Wait first: a create that is still running on the server (a timeout) gets the
                # time to land before it is looked for.
                self._log(f"   {what} creation ended with {exc.message}: looking for it in {decision.delay:.2f}s")
                self._sleep(decision.delay)
                found = find()
                if found:
                    made = found[0]
                    break
                self._log(f"   no {what} was made: sending again")
        if ambiguous and discard is not None:
            for other in find() if find is not None else []:
                if getattr(other, "id", other) != getattr(made, "id", made):
                    self._log(f"   deactivating duplicate {what} {getattr(other, 'id', other)}")
                    discard(other)
        return made

    # -- debug log -------------------------------------------------------------------------

    def _log(self, line: str) -> None:
        if self.debug_log is not None:
            self.debug_log(scrub(line, self.api_key))

    def _log_request(self, request: httpx.Request, attempt: int) -> None:
        if self.debug_log is None:
            return
        suffix = f" (attempt {attempt + 1})" if attempt else ""
        self._log(f"-> {request.method} {redact_url(request.url)}{suffix} headers={json.dumps(redact_headers(request.headers.multi_items()))}")

    def _log_outcome(self, request: httpx.Request, outcome: Any, elapsed: float) -> None:
        if self.debug_log is None:
            return
        if isinstance(outcome, BaseException):
            self._log(f"<- {type(outcome).__name__} {request.method} {_display_url(request.url)} ({elapsed * 1000:.0f} ms)")
            return
        self._log(
            f"<- {outcome.status_code} {request.method} {redact_url(request.url)} ({elapsed * 1000:.0f} ms) "
            f"headers={json.dumps(redact_headers(outcome.headers.multi_items()))}"
        )


def response_json(resp: httpx.Response) -> Any:
    """The decoded JSON body of a response (``{}`` for an empty one), or :class:`ProtocolError`."""
    if not resp.content:
        return {}
    try:
        return resp.json()
    except ValueError as exc:
        where = f"{resp.request.method} {resp.request.url.path}" if resp.request is not None else "request"
        raise ProtocolError(f"{where}: the server answered {resp.status_code} with a non-JSON body") from exc


__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_POLICY",
    "DEFAULT_TIMEOUT",
    "Decision",
    "HttpClient",
    "SendOptions",
    "RETRYABLE_TRANSPORT_ERRORS",
    "RetryPolicy",
    "RetryState",
    "USER_AGENT",
    "auth_headers",
    "backoff_delay",
    "connection_error",
    "decide",
    "error_fields",
    "error_from_response",
    "is_permanent_rejection",
    "redact_header",
    "redact_headers",
    "redact_url",
    "request_was_sent",
    "response_json",
    "retry_after_seconds",
    "scrub",
]
