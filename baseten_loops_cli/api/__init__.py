"""The client side's HTTP layer: ``http`` (the one transport: retry policy and decision, send,
typed errors), ``models`` (pydantic), ``client`` (``LoopsClient``, the control plane),
``download`` (checkpoint transfers), ``uri`` (``bt://`` checkpoint URIs), ``errors``.

Attributes are resolved lazily so ``import baseten_loops_cli.api`` stays cheap; importing
``LoopsClient`` pulls in httpx and pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.api.http import HttpClient
    from baseten_loops_cli.api.uri import CheckpointUri

_LAZY = {
    "LoopsClient": "baseten_loops_cli.api.client",
    "HttpClient": "baseten_loops_cli.api.http",
    "CheckpointUri": "baseten_loops_cli.api.uri",
}

__all__ = ["LoopsClient", "HttpClient", "CheckpointUri"]  # the keys of _LAZY


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
