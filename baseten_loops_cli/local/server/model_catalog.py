"""The engine's base models by name (``ModelCatalog``), for routes and services."""

from __future__ import annotations

import asyncio

from baseten_loops_cli.local.server.compute import Engine, ModelSpec
from baseten_loops_cli.local.server.errors import ApiError, bad_request, choices


class ModelCatalog:
    """The engine's models by name, for routes and services (the first look imports torch,
    off the event loop)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

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
