"""The engine's base models by name (``ModelCatalog``), for routes and services."""

from __future__ import annotations

import asyncio
from typing import Any

from baseten_loops_cli.local.server.compute import Engine, ModelSpec
from baseten_loops_cli.local.store import Store
from baseten_loops_cli.local.server.errors import ApiError, bad_request, choices


class ModelCatalog:
    """The engine's models by name, for routes and services (the first look imports torch,
    off the event loop)."""

    def __init__(self, engine: Engine, store: Store) -> None:
        self.engine = engine
        self.store = store

    async def all(self) -> dict[str, ModelSpec]:
        try:
            return await asyncio.to_thread(self.engine.models)
        except ImportError as exc:
            raise ApiError(503, f"The local compute engine cannot be loaded ({exc}). Install "
                                "the local extra: pip install 'baseten-loops-cli[local]'.",
                           "EngineUnavailable") from None

    async def find(self, name: str) -> ModelSpec | None:
        """A named model or a local Hugging Face model folder; None if neither."""
        models = await self.all()
        return models.get(name) or await asyncio.to_thread(self.engine.spec, name)

    async def spec(self, name: str) -> ModelSpec:
        """A model by name (or local model directory); 400 listing the available ones."""
        models = await self.all()
        spec = models.get(name) or await asyncio.to_thread(self.engine.spec, name)
        if spec is None:
            raise bad_request(
                f"Unknown base model {name!r}. Models available on the local backend: "
                f"{choices(models)}. (`loops server pull-model NAME` adds one.)",
                "UnknownBaseModel",
            )
        return spec

    async def supported(self, *, wanted: str | None = None, max_seq_len: int | None = None) -> list[dict[str, Any]]:
        """``GET /v1/loops/capabilities``' ``supported_models``: every model of :meth:`listing`
        (built in, pulled, local folders runs used; or ``wanted`` alone, a local folder too)
        as Baseten's SupportedModel, plus where it comes from (``source``, ``ready``). Both use
        cases (sft, rl) are served by every local model."""
        if wanted:
            models = await self.all()
            found = [e for e in [await asyncio.to_thread(self._entry, wanted, models)] if e is not None]
        else:
            found = await self.listing()
        specs = await self.all()
        out = []
        for entry in found:
            name, limit = entry["name"], entry["max_seq_len"]
            spec = specs.get(name)
            row: dict[str, Any] = {
                "model_name": name, "max_seq_len": limit, "max_enabled_seq_len": limit, "max_context_length": limit,
                "supports_vision_language": bool(spec and spec.supports_vision_language), "enabled": True,
                "serverless": False, "enablement_details": None, "description": entry["description"],
                "source": entry["source"], "ready": entry["ready"],
            }
            if max_seq_len is not None and max_seq_len > limit:
                row.update(enabled=False, enablement_details={
                    "reason": "sequence_length_unsupported",
                    "reason_detail": f"{name} supports up to {limit} tokens.",
                    "remediation": f"Use max_seq_len <= {limit}."})
            out.append(row)
        return out

    async def listing(self) -> list[dict[str, Any]]:
        """``GET /v1/local/models``: the built-in models, then every other model a run used
        (local Hugging Face folders), each with its max_seq_len and where its files are
        (``files`` None: built in code, or not pulled yet; ``ready`` says which)."""
        models = await self.all()
        names = list(models) + [n for n in self.store.run_base_models() if n not in models]
        found = await asyncio.to_thread(lambda: [self._entry(n, models) for n in names])
        return [e for e in found if e is not None]

    def _entry(self, name: str, models: dict[str, ModelSpec]) -> dict[str, Any] | None:
        """One model's row of :meth:`listing`; None for a folder since moved or deleted. On a
        worker thread (reads the folder's config.json)."""
        spec = models.get(name) or self.engine.spec(name)
        if spec is None:
            return None
        files = self.engine.model_files(name)
        return {"name": name, "max_seq_len": spec.max_seq_len,
                "source": "built-in" if name in models else "local folder",
                "ready": files is not None or not self.engine.needs_files(name),
                "files": str(files) if files is not None else None,
                "description": spec.description}
