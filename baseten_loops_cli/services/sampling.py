"""Sample text from a run's latest weights or from a sampler checkpoint.

The prompt is tokenized here with the base model's tokenizer (``chat`` renders it with the
model's chat template first) and sent to a sampler's ``/sample`` as token ids, exactly as
training code does; the answer is decoded back to text.

Which sampler serves it (:func:`resolve_source`):

- a run: its paired sampler (created on first use, as the SDK does), serving the latest weights;
- a checkpoint of an active run: that run's sampler, pinned to the checkpoint
  (``X-Checkpoint-Path``);
- a checkpoint of a deactivated run: a standalone sampler serving it (reused when one exists,
  created otherwise and left running, like any sampler: it scales to zero when idle).

Use from Python::

    source = resolve_source(client, "abc1234:final")
    answer = sample_text(source, SampleRequest(prompt="What is 2+3?", chat=True), api_key=key)
    print(answer.samples[0].text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from pydantic import BaseModel, ConfigDict

from baseten_loops_cli.api.models import LoopsCheckpoint, LoopsRun, LoopsSampler
from baseten_loops_cli.errors import LoopsError, UsageError
from baseten_loops_cli.services.resolve import (
    NotFound,
    display_name,
    resolve_checkpoint,
    run_not_found,
    sampler_is_terminal,
    uri_of,
)

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.workers.sampler import SampleOptions


class SampleSource(BaseModel):
    """What serves a prompt: a sampler, and the run or checkpoint it samples."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    sampler: LoopsSampler
    base_model: str
    run_id: str | None = None
    checkpoint: LoopsCheckpoint | None = None
    run_header: str | None = None  # X-Run-Id (a run's paired sampler); else the sampler id
    pin: str | None = None  # X-Checkpoint-Path: a checkpoint served by its run's live sampler
    started_sampler: bool = False  # a standalone sampler was created for this checkpoint

    @property
    def label(self) -> str:
        """``RUN:NAME`` of the checkpoint, or ``run RUN``."""
        return display_name(self.checkpoint) if self.checkpoint else f"run {self.run_id}"

    @property
    def uri(self) -> str | None:
        return uri_of(self.checkpoint) if self.checkpoint else None


class SampleRequest(BaseModel):
    prompt: str
    chat: bool = False
    system: str | None = None
    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


class Sample(BaseModel):
    index: int
    text: str
    tokens: list[int]
    logprobs: list[float] | None = None
    stop_reason: str | None = None


class SampleResponse(BaseModel):
    """``loops sample -o json`` (stable keys, in this order)."""

    checkpoint: str | None = None
    checkpoint_id: str | None = None
    uri: str | None = None
    run_id: str | None = None
    base_model: str
    sampler_id: str
    policy_version: int | None = None
    chat: bool
    prompt: str
    prompt_tokens: list[int]
    samples: list[Sample]


def _looks_like_checkpoint(text: str) -> bool:
    return text.startswith(("bt://", "abt://")) or ":" in text


def resolve_source(client: "LoopsClient", ref: str, target: str | None = None) -> SampleSource:
    """The sampler serving ``ref`` (a run id, or a sampler checkpoint by id, URI or RUN:NAME)."""
    from baseten_loops_cli.api.errors import NotFoundError

    if _looks_like_checkpoint(ref) or target:
        return _checkpoint_source(client, ref, resolve_checkpoint(client, ref, target, prefer="sampler"))
    try:
        run = client.runs.get(ref)
    except NotFoundError:
        try:  # a checkpoint id?
            cp = resolve_checkpoint(client, ref)
        except NotFound:
            err = run_not_found(client, ref)
            err.message = f"no run or checkpoint {ref!r}"
            raise err from None
        return _checkpoint_source(client, ref, cp)
    if not run.is_active:
        raise LoopsError(
            f"run {run.id} is {run.status_name}: it has no live weights to sample",
            hint=_newest_checkpoint_hint(client, run.id),
        )
    return SampleSource(sampler=paired_sampler(client, run), base_model=run.base_model, run_id=run.id, run_header=run.id)


def _newest_checkpoint_hint(client: "LoopsClient", run_id: str) -> str:
    """Offer the run's newest sampler checkpoint by RUN:NAME (``RUN:final`` after `loops train`)."""
    from baseten_loops_cli.services.resolve import created_key

    try:
        saved = [c for c in client.checkpoints.list(run_id=run_id) if c.target == "sampler"]
    except LoopsError:
        saved = []
    if not saved:
        return f"It saved no sampler checkpoint to sample: loops checkpoints list --run-id {run_id}"
    names = {c.checkpoint_id for c in saved}
    name = "final" if "final" in names else max(saved, key=created_key).checkpoint_id
    return f"Sample its {'final' if name == 'final' else 'newest'} checkpoint: loops sample {run_id}:{name}"


def paired_sampler(client: "LoopsClient", run: LoopsRun) -> LoopsSampler:
    """The run's live paired sampler, created if it has none (idempotent per run)."""
    if run.sampler is not None and not sampler_is_terminal(run.sampler):
        return run.sampler
    session_id = run.session_id or client.sessions.create().id
    return client.samplers.create({"session_id": session_id, "run_id": run.id})


def _checkpoint_source(client: "LoopsClient", ref: str, cp: LoopsCheckpoint) -> SampleSource:
    from baseten_loops_cli.api.errors import ApiError

    if cp.target != "sampler":
        raise UsageError(
            f"{ref} is a trainer checkpoint (training state); samplers serve sampler weights",
            hint=f"Sample a sampler checkpoint: loops checkpoints list --run-id {cp.run_id} --target sampler",
        )
    uri = uri_of(cp) or ""
    try:
        run: LoopsRun | None = client.runs.get(cp.run_id)
    except ApiError:
        run = None
    if run is not None and run.is_active:
        sampler = paired_sampler(client, run)
        return SampleSource(sampler=sampler, base_model=cp.base_model or sampler.base_model, run_header=run.id, pin=uri, checkpoint=cp, run_id=cp.run_id)
    for s in client.samplers.list():
        if s.model_path == uri and not sampler_is_terminal(s):
            return SampleSource(sampler=s, base_model=cp.base_model or s.base_model, checkpoint=cp, run_id=cp.run_id)
    session_id = client.sessions.create().id
    sampler = client.samplers.create({"session_id": session_id, "model_path": uri})
    return SampleSource(sampler=sampler, base_model=cp.base_model or sampler.base_model, started_sampler=True, checkpoint=cp, run_id=cp.run_id)


def create_sampler(
    client: "LoopsClient",
    *,
    base_model: str | None = None,
    run_id: str | None = None,
    checkpoint: str | None = None,
    max_seq_len: int | None = None,
    replicas: int | None = None,
) -> tuple[LoopsSampler, str]:
    """A sampler for a base model, a run (its paired sampler) or a sampler checkpoint (give one),
    and a few words saying what it serves."""
    from baseten_loops_cli.services.resolve import get_run

    body: dict = {"max_seq_length": max_seq_len, "num_replicas": replicas}
    if run_id:
        run = get_run(client, run_id)
        body.update(run_id=run.id, session_id=run.session_id)
        what = f"run {run.id}"
    elif checkpoint:
        cp = resolve_checkpoint(client, checkpoint, prefer="sampler")
        if cp.target != "sampler":
            raise UsageError(
                f"{checkpoint} is trainer state; samplers serve sampler weights",
                hint=f"Pick a sampler checkpoint: loops checkpoints list --run-id {cp.run_id} --target sampler",
            )
        body["model_path"] = uri_of(cp)
        what = str(body["model_path"])
    else:
        body["base_model"] = base_model
        what = str(base_model)
    if not body.get("session_id"):
        body["session_id"] = client.sessions.create().id
    return client.samplers.create({k: v for k, v in body.items() if v is not None}), what


def _tokenizer(base_model: str):
    from baseten_loops_cli.tokenization import get_tokenizer

    return get_tokenizer(base_model)


def _prompt_tokens(tokenizer, request: SampleRequest) -> list[int]:
    from baseten_loops_cli.tokenization import render_chat

    if request.chat:
        system = [{"role": "system", "content": request.system}] if request.system else []
        tokens, _ = render_chat(tokenizer, system + [{"role": "user", "content": request.prompt}], add_generation_prompt=True)
        return list(tokens)
    return list(tokenizer.encode(request.prompt))


def _stop_ids(tokenizer) -> list[int]:
    stops = list(getattr(tokenizer, "stop_token_ids", ()) or ())
    if not stops and getattr(tokenizer, "eos_token_id", None) is not None:
        stops = [tokenizer.eos_token_id]
    return stops


def _sample_options(source: SampleSource, request: SampleRequest, stops: list[int]) -> "SampleOptions":
    """What ``request`` asks the sampler for (sampled or streamed), pinned to ``source``'s checkpoint."""
    return {"n": request.n, "max_tokens": request.max_tokens, "temperature": request.temperature,
            "top_p": request.top_p, "seed": request.seed, "stop": stops or None, "checkpoint_path": source.pin}  # fmt: skip


def _sampler_client(source: SampleSource, api_key: str):
    from baseten_loops_cli.workers.sampler import SamplerClient

    return SamplerClient(
        source.sampler.base_url,
        api_key=api_key,
        run_id=source.run_header,
        sampler_id=None if source.run_header else source.sampler.id,
    )


def sample_text(source: SampleSource, request: SampleRequest, *, api_key: str) -> SampleResponse:
    """Tokenize ``request.prompt``, sample from ``source`` and decode the answers."""
    tokenizer = _tokenizer(source.base_model)
    tokens = _prompt_tokens(tokenizer, request)
    stops = _stop_ids(tokenizer)
    with _sampler_client(source, api_key) as sc:
        result = sc.sample(tokens, **_sample_options(source, request, stops))
    samples = [
        Sample(
            index=i,
            text=tokenizer.decode([t for t in seq.tokens if t not in stops], skip_special_tokens=True),
            tokens=list(seq.tokens),
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            stop_reason=seq.stop_reason,
        )
        for i, seq in enumerate(result.sequences)
    ]
    cp = source.checkpoint
    return SampleResponse(
        checkpoint=display_name(cp) if cp else None,
        checkpoint_id=cp.id if cp else None,
        uri=uri_of(cp) if cp else None,
        run_id=source.run_id,
        base_model=source.base_model,
        sampler_id=source.sampler.id,
        policy_version=result.policy_version,
        chat=request.chat,
        prompt=request.prompt,
        prompt_tokens=tokens,
        samples=samples,
    )


def stream_text(source: SampleSource, request: SampleRequest, *, api_key: str) -> Iterator[str]:
    """:func:`sample_text` for one sample, as text pieces in the order the sampler decodes
    them (its ``/sample`` with ``stream: true``): the first arrives while the rest is still
    being generated."""
    if request.n != 1:
        raise UsageError("streaming prints one sample", hint="Drop -n, or drop --stream to get several samples.")
    tokenizer = _tokenizer(source.base_model)
    stops = _stop_ids(tokenizer)
    with _sampler_client(source, api_key) as sc:
        for chunk in sc.sample_stream(_prompt_tokens(tokenizer, request), **_sample_options(source, request, stops)):
            if chunk.text:
                yield chunk.text


__all__ = ["SampleRequest", "SampleResponse", "SampleSource", "Sample", "create_sampler", "paired_sampler", "resolve_source", "sample_text",
           "stream_text"]
