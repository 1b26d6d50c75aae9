"""Calls that only the local server answers (``/v1/local/*``)."""

from __future__ import annotations

import json
from typing import Any, Iterator

from baseten_loops_cli.errors import LoopsError


def pull_model_events(base_url: str, api_key: str, model: str) -> Iterator[dict[str, Any]]:
    """``POST /v1/local/models/pull``: the server's progress events as they arrive (see
    ``local/server/model_routes.py``); an ``error`` event raises LoopsError."""
    import httpx

    from baseten_loops_cli.api.http import HttpClient, connection_error, error_from_response

    # No retries (a pull is one long conversion); the read timeout only spans heartbeats.
    with HttpClient(base_url, api_key, timeout=httpx.Timeout(30.0, read=60.0)) as http:
        try:
            resp = http.open("POST", "/v1/local/models/pull", json={"model": model})
        except httpx.TransportError as exc:
            raise connection_error(exc, http.url("/v1/local/models/pull"), api_key=api_key) from exc
        try:
            if resp.status_code >= 400:
                resp.read()
                raise error_from_response(resp, api_key=api_key)
            for line in resp.iter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("event") == "error":
                    raise LoopsError(f"Pulling {model} failed: {event.get('detail')}",
                                     hint="See `loops server logs` for the server's side.")
                yield event
        except httpx.TransportError as exc:
            raise connection_error(exc, http.url("/v1/local/models/pull"), api_key=api_key) from exc
        finally:
            resp.close()


def local_models(base_url: str, api_key: str) -> list[dict[str, Any]]:
    """``GET /v1/local/models``: ``[{name, max_seq_len, source, ready, files, description}]``
    (built-in models, then the local folders runs used; see ``ModelCatalog.listing``)."""
    from baseten_loops_cli.api.http import HttpClient

    with HttpClient(base_url, api_key) as http:
        data = http.request_json("GET", "/v1/local/models")
    return list((data or {}).get("models") or []) if isinstance(data, dict) else []
