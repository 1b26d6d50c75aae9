"""Bearer-token auth for the local server.

Every request must carry the server's token as ``Authorization: Api-Key <token>`` (what
the SDK sends) or ``Authorization: Bearer <token>`` (what curl examples use). Exempt:

- ``GET /health``: the liveness probe the daemon polls while starting; it reveals
  nothing but "a loops server is here".
- ``/files/...``: presigned checkpoint links carry their own signature and must work
  without an auth header (the SDK deliberately sends none when fetching them).

The server binds to 127.0.0.1 only; the token keeps other local users (and web pages
probing localhost) out.
"""

from __future__ import annotations

import hmac
from starlette.types import ASGIApp, Receive, Scope, Send

from baseten_loops_cli.local.server.errors import ApiError, openai_error

_SCHEMES = ("api-key", "bearer")


def token_from_header(value: str | None) -> str | None:
    """The token in an ``Authorization`` header value, or None if it has none."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() not in _SCHEMES or not token.strip():
        return None
    return token.strip()


def is_exempt(method: str, path: str) -> bool:
    return (path == "/health" and method in ("GET", "HEAD")) or path.startswith("/files/")


class TokenAuthMiddleware:
    """Pure ASGI middleware (no response buffering, so streaming routes stay streaming)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_exempt(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        token = token_from_header(header)
        if token is None:
            error = ApiError(
                401,
                "Missing API key. Send 'Authorization: Api-Key <token>' (or 'Bearer <token>'); "
                "the local server's token is printed by `loops server env`.",
                "AuthenticationRequired",
                headers={"WWW-Authenticate": "Api-Key, Bearer"},
            )
        elif not hmac.compare_digest(token.encode(), self._token):
            error = ApiError(
                401,
                "API key rejected by the local loops server. Use the token from "
                "`loops server env` (it changes only if the state dir is deleted).",
                "InvalidApiKey",
                headers={"WWW-Authenticate": "Api-Key, Bearer"},
            )
        else:
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith("/deployments/"):  # OpenAI clients read this object
            error.extra["error"] = openai_error(error)
        await error.response()(scope, receive, send)

