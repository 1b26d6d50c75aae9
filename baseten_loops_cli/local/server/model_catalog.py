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

    async def listing(self) -> list[dict[str, Any]]:
        """``GET /v1/local/models``: the built-in models, then every other model a run used
        (local Hugging Face folders), each with its max_seq_len and where its files are
        (``files`` None: built in code, or not pulled yet; ``ready`` says which)."""
        models = await self.all()
        names = list(models) + [n for n in self.store.run_base_models() if n not in models]

        def entry(name: str) -> dict[str, Any] | None:
            spec = models.get(name) or self.engine.spec(name)
            if spec is None:  # a folder since moved or deleted: nothing to offer
                return None
            files = self.engine.model_files(name)
            return {"name": name, "max_seq_len": spec.max_seq_len,
                    "source": "built-in" if name in models else "local folder",
                    "ready": files is not None or not self.engine.needs_files(name),
                    "files": str(files) if files is not None else None,
                    "description": spec.description}

        found = await asyncio.to_thread(lambda: [entry(n) for n in names])
        return [e for e in found if e is not None]
