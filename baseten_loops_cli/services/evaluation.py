"""What `loops eval` scores and which samplers serve it.

:func:`candidates` turns checkpoint names (``RUN:NAME``, ids, ``bt://`` URIs, ``RUN:*``) and
``--base`` into :class:`Candidate` rows (which training/evaluation/scoring.py scores). A
:class:`SamplerPool` opens a sampler for a row only on a cache miss:

- a checkpoint of an active run: the run's paired sampler, pinned to it (``X-Checkpoint-Path``);
- a checkpoint of an inactive run, or the base model: a live standalone sampler serving it when
  one exists, else one started here and stopped by :meth:`SamplerPool.close`, so an evaluation
  leaves no capacity behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from baseten_loops_cli.errors import LoopsError, UsageError
from baseten_loops_cli.services.resolve import (
    NotFound,
    checkpoints_of_run,
    created_key,
    display_name,
    resolve_checkpoint,
    sampler_is_terminal,
    uri_of,
)

if TYPE_CHECKING:
    from baseten_loops_cli.services import Connected


class SamplerLike(Protocol):
    async def asample(self, prompt_tokens: Sequence[int], **kwargs: Any) -> Any: ...
    async def aclose(self) -> None: ...


@dataclass
class Candidate:
    """One row of the table: a sampler checkpoint or a base model.

    ``identity`` is what makes a cached result reusable (the backend, the checkpoint's id, URI
    and creation time); ``open`` returns a client of a sampler serving the weights (with any
    pin set) and is called only on a cache miss. ``close`` (optional) runs after scoring."""

    label: str
    base_model: str
    identity: str
    open: Callable[[], SamplerLike]
    uri: str | None = None
    is_base: bool = False


def run_checkpoints(client: Any, text: str) -> list:
    """``RUN:*``: the run's sampler checkpoints, oldest first."""
    run_id = text[: -len(":*")]
    cps = [c for c in checkpoints_of_run(client, run_id) if c.target == "sampler"]
    if not cps:
        raise NotFound(
            f"run {run_id} has no sampler checkpoints",
            hint=f"Trainer checkpoints cannot be scored; list them with `loops checkpoints list --run-id {run_id}`.",
        )
    return sorted(cps, key=lambda c: (created_key(c), c.checkpoint_id))


def sampler_checkpoint(client: Any, text: str) -> Any:
    """``text`` resolved to a sampler checkpoint; a trainer checkpoint is a usage error."""
    cp = resolve_checkpoint(client, text, prefer="sampler")
    if cp.target != "sampler":
        raise UsageError(
            f"{text} is a trainer checkpoint (training state); eval scores sampler weights",
            hint=f"Pick a sampler checkpoint: loops checkpoints list --run-id {cp.run_id} --target sampler",
        )
    return cp


class SamplerPool:
    """Finds or starts the samplers that serve the candidates (on a cache miss only) and stops
    the ones it started. ``on_started(sampler_id, what)`` is told of each sampler it starts."""

    def __init__(self, client: Any, api_key: str, on_started: Callable[[str, str], None] | None = None) -> None:
        self.client = client
        self.api_key = api_key
        self.on_started = on_started
        self.started: list[str] = []

    def _started(self, sampler_id: str, what: str) -> None:
        self.started.append(sampler_id)
        if self.on_started is not None:
            self.on_started(sampler_id, what)

    def for_checkpoint(self, uri: str) -> Any:
        from baseten_loops_cli.services.sampling import resolve_source
        from baseten_loops_cli.workers.sampler import SamplerClient

        source = resolve_source(self.client, uri)
        if source.started_sampler:
            self._started(source.sampler.id, uri)
        return SamplerClient(source.sampler.base_url, api_key=self.api_key, run_id=source.run_header,
                             sampler_id=None if source.run_header else source.sampler.id, checkpoint_path=source.pin)  # fmt: skip

    def for_base(self, base_model: str) -> Any:
        from baseten_loops_cli.services.sampling import create_sampler
        from baseten_loops_cli.workers.sampler import SamplerClient

        live = [s for s in self.client.samplers.list() if not sampler_is_terminal(s) and s.base_model == base_model
                and not s.run_id and not s.model_path]  # fmt: skip
        sampler = live[0] if live else None
        if sampler is None:
            sampler, what = create_sampler(self.client, base_model=base_model)
            self._started(sampler.id, f"the base model {what}")
        return SamplerClient(sampler.base_url, api_key=self.api_key, sampler_id=sampler.id)

    def close(self) -> list[str]:
        """Stop the samplers this pool started; returns the ids it could not stop."""
        failed = []
        for sampler_id in self.started:
            try:
                self.client.samplers.deactivate(sampler_id)
            except LoopsError:
                failed.append(sampler_id)
        return failed


def candidates(backend: "Connected", refs: list[str], pool: SamplerPool, *, base: bool,
               config_base_model: Callable[[], str] | None = None) -> list[Candidate]:
    """The table's rows: the base model(s) first when ``base``, then each named checkpoint once.
    ``config_base_model`` gives the base model when ``--base`` comes without a checkpoint."""
    client = backend.client
    resolved: list = []
    for text in refs:
        found = run_checkpoints(client, text) if text.endswith(":*") else [sampler_checkpoint(client, text)]
        resolved += [cp for cp in found if cp.id not in {c.id for c in resolved}]
    rows: list[Candidate] = []
    if base:
        models = list(dict.fromkeys(cp.base_model for cp in resolved if cp.base_model))
        if not models:
            if config_base_model is None:
                raise UsageError("--base alone needs --config (its base_model)", hint="Or name a checkpoint of that model too.")
            models = [config_base_model()]
        for model in models:
            rows.append(Candidate(
                f"base ({model})" if len(models) > 1 else "base", model, f"{backend.base_url}|base|{model}",
                partial(pool.for_base, model), is_base=True,
            ))  # fmt: skip
    for cp in resolved:
        uri = uri_of(cp) or cp.uri
        if not cp.base_model:
            raise LoopsError(f"checkpoint {display_name(cp)} does not say its base model", hint="It cannot be scored.")
        created = cp.created_at.isoformat() if cp.created_at else ""
        rows.append(Candidate(
            display_name(cp), cp.base_model, f"{backend.base_url}|{cp.id}|{uri}|{created}",
            partial(pool.for_checkpoint, uri), uri=uri,
        ))  # fmt: skip
    return rows
