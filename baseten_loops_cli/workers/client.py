"""What the trainer and sampler clients share: one constructor, one transport.

A worker client is an :class:`~baseten_loops_cli.api.http.HttpClient` on the worker's base URL
(sharing the process's httpx client of that origin with the control plane), its retry
policies, and the helpers to read JSON answers. Subclasses add their routes.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Iterable, Mapping

import httpx

from baseten_loops_cli.api.errors import ProtocolError
from baseten_loops_cli.api.http import USER_AGENT, HttpClient, RetryPolicy

# Retries of plain GETs (health, policy version, model list) on transport errors / 5xx / 408.
DEFAULT_GET_RETRIES = 8


class WorkerClient:
    """Base of :class:`TrainerClient` and :class:`SamplerClient`.

    ``timeout``: read timeout of one request (connect: 10 s). ``headers``: sent with every
    request (a trainer's ``X-Run-Id``). ``sleep`` / ``rng`` make retry waits testable;
    ``transport`` (tests) replaces the network.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        run_id: str | None = None,
        timeout: float = 60.0,
        headers: Mapping[str, str] | None = None,
        get_retries: int = DEFAULT_GET_RETRIES,
        user_agent: str = USER_AGENT,
        sleep: Callable[[float], None] = time.sleep,
        rng: Callable[[], float] = random.random,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.run_id = run_id
        self._api_key = api_key
        self._sleep = sleep
        self._rng = rng
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._get_policy = RetryPolicy(max_retries=get_retries)
        self._http = HttpClient(self.base_url, api_key, timeout=self._timeout, policy=self._get_policy,
                                user_agent=user_agent, headers=headers, sleep=sleep, rng=rng, transport=transport)  # fmt: skip

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    async def aclose(self) -> None:
        await self._http.aclose()
        self.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- helpers ---------------------------------------------------------------------------

    def _get_json(self, path: str, *, params: Mapping[str, Any] | None = None,
                  headers: Mapping[str, str] | None = None, accept: Iterable[int] = ()) -> tuple[int, Any]:
        """GET ``path`` (retried by the GET policy); ``(status, JSON body or None)``."""
        resp = self._http.send("GET", path, params=params, headers=headers, accept=accept)
        return resp.status_code, json_body(resp)


def json_body(resp: httpx.Response) -> Any:
    """The JSON body of a worker answer, or None when it has none (or not JSON)."""
    try:
        return resp.json()
    except ValueError:
        return None


def require_dict(body: Any, what: str) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"{what} answered an unexpected body: {str(body)[:200]}")
    return body


__all__ = ["DEFAULT_GET_RETRIES", "WorkerClient", "json_body", "require_dict"]
