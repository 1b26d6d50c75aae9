"""The backend's model catalog (``loops models``): what it trains, for which use case, up to how
many tokens.

One source on every backend: ``GET /v1/loops/capabilities``, asked once per use case (``sft``,
``rl``; Baseten's lists may differ) and merged by model. The local server answers it with its
built-in models, the ones pulled into its cache and the local folders runs used, and says
where each comes from (``source``) and whether its files are here (``ready``); Baseten's
answer has no such fields, so they stay None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from baseten_loops_cli.services import Connected as Backend

USE_CASES = ("sft", "rl")


class CatalogModel(BaseModel):
    model: str
    max_seq_len: int | None = None
    use_cases: list[str]
    enabled: bool = True
    # Why not (Baseten's enablement_details.reason: needs_approval, loops_not_enabled, ...).
    not_enabled_reason: str | None = None
    serverless: bool | None = None
    supports_vision_language: bool = False
    source: str | None = None  # local backend: built-in | local folder
    ready: bool | None = None  # local backend: its files are on this machine (or it needs none)
    description: str | None = None


def catalog(backend: "Backend", *, model: str | None = None, use_case: str | None = None) -> list[CatalogModel]:
    """Every model the backend offers (or ``model`` alone), for ``use_case`` or both, in the
    backend's order."""
    found: dict[str, CatalogModel] = {}
    for case in (use_case,) if use_case else USE_CASES:
        for entry in backend.client.capabilities(model=model, use_case=case):
            extra: dict[str, Any] = entry.model_extra or {}
            row = found.get(entry.model_name)
            if row is None:
                details = entry.enablement_details
                row = found[entry.model_name] = CatalogModel(
                    model=entry.model_name,
                    max_seq_len=entry.max_seq_len or entry.max_context_length,
                    use_cases=[],
                    enabled=entry.enabled and entry.max_enabled_seq_len != 0,
                    not_enabled_reason=details.reason if details else None,
                    serverless=entry.serverless,
                    supports_vision_language=entry.supports_vision_language,
                    source=extra.get("source"),
                    ready=extra.get("ready"),
                    description=extra.get("description"),
                )
            row.use_cases.append(case)
    return list(found.values())
