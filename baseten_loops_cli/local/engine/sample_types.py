"""What a sampling request and its result are, for the engine and the server alike.

Torch-free on purpose: the server's routes build and read these without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple


class TokenEvent(NamedTuple):
    """One decoded token of one sample, as handed to ``SampleRequest.on_token``."""

    sample: int  # which of the request's n samples
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the request's top_logprobs most likely (id, logprob)
    finish_reason: str | None  # set on the sample's last token
    stop_token: bool  # the token is the stop token that ended it (no text of its own)
    # On the sample's last token: its whole text, as the result will have it (cut before a
    # stop string), so a stream sends the last token's text with that token.
    text: str | None = None


@dataclass
class SampleRequest:
    prompt: list[int]
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    # None: no prompt logprobs; k >= 0: each prompt token's logprob plus k alternatives.
    prompt_logprobs: int | None = None
    # The adapter to sample from (None = the base model): a key given to load_adapter, or
    # any key together with the PEFT folder to load it from on first use. The key changes
    # whenever the files do, so engine-side caches never serve stale weights.
    adapter: str | None = None
    adapter_path: str | Path | None = None
    # The versions of one adapter that replace each other (a paired sampler's live adapter,
    # republished at every save_weights_for_sampler of its run): they share
    # sampler.FAMILY_SLOTS engine slots instead of taking one each. None: a slot of its own.
    adapter_family: str | None = None
    # k > 0: each generated token's k most likely alternatives too (SampledSequence.top_logprobs).
    top_logprobs: int = 0
    # Streaming: called on the generating thread after every decoded token, before the next
    # decode step (the batch keeps decoding while a server sends it).
    on_token: Callable[[TokenEvent], None] | None = None


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    text: str
    # Per token, the top_logprobs most likely (id, logprob); None when not asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None


class PromptTokenLogprob(NamedTuple):
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the k most likely (token id, logprob)


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    # One entry per prompt token; None for the first (nothing precedes it).
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None
    # The text of every token id named in prompt_logprobs (vLLM reports it too).
    token_text: dict[int, str] = field(default_factory=dict)
