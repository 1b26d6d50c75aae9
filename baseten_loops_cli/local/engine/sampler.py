"""Batched token generation on a base model or one of its LoRA adapters.

Requests for the same adapter (or the plain base) are generated together: their prompts are
left-padded into one batch and prefilled once each (one row per request), then the KV cache
(``DynamicCache``), mask, positions and last logits are repeated into one row per sample
(``n`` per request), decoded one token per step in this module's own loop rather than
``model.generate`` so that it controls the logprobs:

- the logprob reported for each sampled token is from the **unmodified** distribution
  (temperature 1, no top-k/top-p), a float32 log-softmax of the same logits the trainer
  computes, so sampler and trainer logprobs of the same tokens under the same weights agree
  (up to float noise, ~1e-5): RL importance ratios depend on it;
- temperature, top-k and top-p only shape the distribution the token is *drawn* from
  (temperature 0 = greedy).

Seeded requests draw from their own ``torch.Generator`` per sample, so the same request
gives the same tokens (other requests in the batch do not change its random stream).

``top_logprobs=k`` also reports, for every generated token, the ``k`` most likely tokens
and their logprobs from that same unmodified distribution (OpenAI's ``top_logprobs``).
``on_token`` (streaming) is called on the generating thread after every decoded token with
a :class:`TokenEvent`, before the next decode step, so a server can send each token while
the rest of the batch is still being generated; a sample's last event carries its final text.
``max_tokens=0`` only prefills: the prompt's logprobs (``prompt_logprobs``) and no tokens.

A generation stops at a stop token (the tokenizer's eos / end-of-turn ids plus the
request's ``stop_token_ids``; the token is kept in ``tokens``), at a stop string (checked on
the decoded text; ``text`` is cut before it), or after ``max_tokens`` (``"length"``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from baseten_loops_cli.local.engine import precision
from baseten_loops_cli.local.engine.errors import EngineInputError
from baseten_loops_cli.local.engine.registry import BaseModel
from baseten_loops_cli.local.engine.sample_types import (
    PromptTokenLogprob,
    SampledSequence,
    SampleRequest,
    SampleResult,
    TokenEvent,
)

MAX_LOADED_ADAPTERS = 8
# An adapter family's versions (SampleRequest.adapter_family: an RL run's live adapter, a new
# version every step) hold at most this many slots: a new version takes over the layers of
# the family's least recently used one (BaseModel.reload_adapter: 0.10 s for SmolLM2 at rank
# 16) instead of PEFT adding one (0.32 s with one adapter on the base, 0.69 s with four: it
# walks every layer of every adapter), and an RL run keeps 2 sets of LoRA weights in the
# sampler, not 8 (SmolLM2 rank 16: 39 MB, not 156). Two, not one: the next step's sampling can
# start while the previous version still has requests queued (max_steps_off_policy).
FAMILY_SLOTS = 2
MAX_PROMPT_LOGPROBS_TOP_K = 20
MAX_TOP_LOGPROBS = 20
# The prefill runs the prompts through the model this many positions at a time, each chunk
# attending to the KV cache of those before it (issue 40: an 8k-token prompt in one pass held
# every layer's (8k x intermediate) MLP tensors, and with prompt logprobs (8k x vocabulary)
# float32 logits and their log-softmax, 3 GB for SmolLM2). Same logits up to float
# summation order; 512-row matmuls stay as fast per token as longer ones.
PREFILL_CHUNK_TOKENS = 512


@dataclass
class _Row:
    """One sequence being generated (request ``request`` sample ``sample``)."""

    request: int
    sample: int
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None


@dataclass
class _Batch:
    """The decode batch: one row per sequence still generating (``live``: their indices in
    the request's rows, in batch order), its KV cache, last logits, mask and next positions.

    A row that has stopped leaves the batch (:meth:`keep_unfinished`) instead of running
    through the model until the longest reply ends: RL groups of replies of up to 256 tokens
    stop at very different lengths."""

    cache: Any
    logits: torch.Tensor
    attention_mask: torch.Tensor
    next_positions: torch.Tensor
    live: list[int]
    device: str
    next_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def keep_unfinished(self, rows: list[_Row]) -> bool:
        """Drop the stopped rows from every tensor of the batch (and the next tokens'); grow
        the mask by the position about to be decoded. False when no row is left."""
        keep = [k for k, i in enumerate(self.live) if rows[i].finish_reason is None]
        if len(keep) < len(self.live):
            self.live = [self.live[k] for k in keep]
            if not keep:
                return False
            index = torch.tensor(keep, dtype=torch.long)
            self.cache.batch_select_indices(index.to(self.device))
            self.logits = self.logits[index]
            self.attention_mask = self.attention_mask[index]
            self.next_positions = self.next_positions[index]
            if self.next_tokens.numel():
                self.next_tokens = self.next_tokens[index]
        if self.next_tokens.numel():  # a token was drawn: its position joins the mask
            self.attention_mask = torch.cat(
                [self.attention_mask, torch.ones((len(self.live), 1), dtype=torch.long)], dim=-1)
        return bool(self.live)


class SamplerEngine:
    """Samples from ``base`` and from adapters loaded onto it (an LRU of
    :data:`MAX_LOADED_ADAPTERS`)."""

    def __init__(self, base: BaseModel) -> None:
        self.base = base
        self._adapters: OrderedDict[str, str] = OrderedDict()  # key -> name on the base
        self._families: dict[str, str] = {}  # key -> its family, for the keys that have one
        self._slots = 0  # adapters loaded so far: names them on the base
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from baseten_loops_cli.tokenization import get_tokenizer

            self._tokenizer = get_tokenizer(self.base.name)
        return self._tokenizer

    # ── adapters ──

    def load_adapter(self, key: str, path: str | Path, family: str | None = None) -> None:
        """Make the PEFT adapter at ``path`` available as ``key`` (no-op if it is loaded); a
        ``family`` holds at most :data:`FAMILY_SLOTS` slots."""
        if key in self._adapters:
            self._adapters.move_to_end(key)
            return
        kin = [k for k in self._adapters if family is not None and self._families.get(k) == family]
        refilled = ((len(kin) >= FAMILY_SLOTS and self._refill(kin[0], key, path))
                    or (len(self._adapters) >= MAX_LOADED_ADAPTERS
                        and self._refill(next(iter(self._adapters)), key, path)))
        if not refilled:
            self._add(key, path)
        if family is not None:
            self._families[key] = family

    def _add(self, key: str, path: str | Path) -> None:
        """Load ``path`` into a new slot on the base (PEFT wraps every layer again), making
        room in the LRU first."""
        while len(self._adapters) >= MAX_LOADED_ADAPTERS:
            self.unload_adapter(next(iter(self._adapters)))
        self._slots += 1
        name = f"sampler:{id(self):x}:{self._slots}"  # unique on the base, whatever the key
        try:
            self.base.load_adapter(name, path)
        except (OSError, ValueError, RuntimeError) as exc:  # missing, malformed, wrong shapes
            self.base.delete_adapter(name)
            raise EngineInputError(f"Cannot load the adapter at {path}: {exc}",
                                   "InvalidCheckpoint") from exc
        self._adapters[key] = name

    def _refill(self, oldest: str, key: str, path: str | Path) -> bool:
        """Give adapter ``oldest``'s layers the weights at ``path`` under ``key`` if their
        shapes match (an RL run's successive versions): no PEFT layer surgery. False if they
        do not (nothing changed)."""
        name = self._adapters[oldest]
        try:
            if not self.base.reload_adapter(name, path):
                return False
        except (OSError, ValueError, RuntimeError) as exc:  # its old weights may be half gone
            self.unload_adapter(oldest)
            raise EngineInputError(f"Cannot load the adapter at {path}: {exc}",
                                   "InvalidCheckpoint") from exc
        del self._adapters[oldest]
        self._families.pop(oldest, None)
        self._adapters[key] = name
        return True

    def unload_adapter(self, key: str) -> None:
        self._families.pop(key, None)
        name = self._adapters.pop(key, None)
        if name is not None:
            self.base.delete_adapter(name)

    @property
    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    # ── sampling ──

    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Results in request order; requests on the same adapter share one batch."""
        for index, request in enumerate(requests):
            self._validate(request, index)
        results: list[SampleResult | None] = [None] * len(requests)
        groups: dict[str | None, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(request.adapter, []).append(index)
        for key, indices in groups.items():
            adapter_name = self._adapter_for(key, requests[indices[0]])
            batch = [requests[i] for i in indices]
            for i, result in zip(indices, self._generate(adapter_name, batch)):
                results[i] = result
        return results  # type: ignore[return-value]

    def _adapter_for(self, key: str | None, request: SampleRequest) -> str | None:
        if key is None:
            return None
        if key not in self._adapters:
            if request.adapter_path is None:
                raise EngineInputError(f"Adapter {key!r} is not loaded.", "AdapterNotLoaded")
            self.load_adapter(key, request.adapter_path, request.adapter_family)
        self._adapters.move_to_end(key)
        return self._adapters[key]

    def _validate(self, request: SampleRequest, index: int) -> None:
        where = f"requests[{index}]"
        vocab = self.base.vocab_size
        if not request.prompt:
            raise EngineInputError(f"{where}.prompt is empty.", "InvalidSampleRequest")
        bad = next((t for t in request.prompt + list(request.stop_token_ids)
                    if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineInputError(f"{where} has token id {bad!r}, outside [0, {vocab}).",
                                   "InvalidTokenId")
        if request.n < 1 or request.max_tokens < 0:
            raise EngineInputError(f"{where} needs n >= 1 and max_tokens >= 0.",
                                   "InvalidSampleRequest")
        total = len(request.prompt) + request.max_tokens
        if total > self.base.max_seq_len:
            raise EngineInputError(
                f"{where}: the prompt ({len(request.prompt)} tokens) plus max_tokens "
                f"({request.max_tokens}) is {total}, over the model's limit of "
                f"{self.base.max_seq_len}.", "SequenceTooLong")
        if request.temperature < 0 or not 0 < request.top_p <= 1:
            raise EngineInputError(f"{where} needs temperature >= 0 and 0 < top_p <= 1.",
                                   "InvalidSampleRequest")
        k = request.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_PROMPT_LOGPROBS_TOP_K:
            raise EngineInputError(f"{where}.prompt_logprobs must be in "
                                   f"0..{MAX_PROMPT_LOGPROBS_TOP_K}.", "InvalidSampleRequest")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise EngineInputError(f"{where}.top_logprobs must be in 0..{MAX_TOP_LOGPROBS}.",
                                   "InvalidSampleRequest")

    @torch.no_grad()
    def _generate(self, adapter_name: str | None, requests: list[SampleRequest]
                  ) -> list[SampleResult]:
        rows = [_Row(r, j, _generator(req.seed, j))
                for r, req in enumerate(requests) for j in range(req.n)]
        stops = [set(self.tokenizer.stop_token_ids) | set(req.stop_token_ids)
                 for req in requests]
        policy = precision.current()
        with self.base.activate(adapter_name) as model:
            def forward(**inputs: Any) -> torch.Tensor:
                # On the policy's device and dtype; the logits come back as float32 on the
                # CPU (sampling, logprobs and the generators live there).
                with policy.autocast():
                    out = model(**{k: v.to(policy.device) if isinstance(v, torch.Tensor) else v
                                   for k, v in inputs.items()}, use_cache=True)
                return out.logits.float().cpu()

            batch, prompt_logprobs = self._prefill(forward, rows, requests, policy.device)
            self._decode(forward, batch, rows, requests, stops)

        results = [SampleResult([], prompt_logprobs[r]) for r in range(len(requests))]
        for row in rows:
            if row.finish_reason is None:
                row.finish_reason = "length"
            text = row.text if row.text is not None else self.tokenizer.decode(
                _text_tokens(row, stops[row.request]), skip_special_tokens=True)
            req = requests[row.request]
            results[row.request].sequences.append(SampledSequence(
                row.tokens, row.logprobs, row.finish_reason, text,
                row.top_logprobs if req.top_logprobs else None))
        return results

    def _prefill(self, forward: Callable[..., torch.Tensor], rows: list[_Row],
                 requests: list[SampleRequest], device: str
                 ) -> tuple[_Batch, list[list[PromptTokenLogprob | None] | None]]:
        """Every prompt through the model (one row per request, left-padded, by chunks of
        :data:`PREFILL_CHUNK_TOKENS`), then the batch repeated to one row per sample (an RL
        group of n samples prefills its prompt once, not n times); and the prompt logprobs."""
        from transformers import DynamicCache

        prompts = [req.prompt for req in requests]
        samples = torch.tensor([req.n for req in requests])
        width = max(len(p) for p in prompts)
        input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, prompt in enumerate(prompts):  # left padding: every prompt ends at `width`
            input_ids[i, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[i, width - len(prompt):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        # The prefill's logits at every position only where prompt logprobs are asked for;
        # else at the last one (32 rows x 40 prompt tokens of SmolLM2 logits: 250 MB in
        # float32, and the LM head a fifth of the prefill's FLOPs).
        keep = 0 if any(req.prompt_logprobs is not None for req in requests) else 1
        prompt_logprobs: list[list[PromptTokenLogprob | None] | None] = [None] * len(requests)
        for start in range(0, width, PREFILL_CHUNK_TOKENS):
            end = min(width, start + PREFILL_CHUNK_TOKENS)
            chunk_logits = forward(input_ids=input_ids[:, start:end],
                                   attention_mask=attention_mask[:, :end],
                                   position_ids=position_ids[:, start:end], cache=cache,
                                   logits_to_keep=keep)
            if not keep:
                self._prompt_logprobs(chunk_logits, rows, requests, width, start,
                                      prompt_logprobs)
        cache.batch_select_indices(
            torch.arange(len(requests)).repeat_interleave(samples).to(device))
        batch = _Batch(cache, chunk_logits[:, -1].repeat_interleave(samples, dim=0),
                       attention_mask.repeat_interleave(samples, dim=0),
                       position_ids[:, -1].repeat_interleave(samples) + 1,
                       list(range(len(rows))), device)
        return batch, prompt_logprobs

    def _decode(self, forward: Callable[..., torch.Tensor], batch: _Batch, rows: list[_Row],
                requests: list[SampleRequest], stops: list[set[int]]) -> None:
        """One token per step for every row still generating, until each has stopped."""
        for row in rows:
            if requests[row.request].max_tokens == 0:
                row.finish_reason = "length"
        batch.keep_unfinished(rows)
        while batch.live:
            logprobs = torch.log_softmax(batch.logits, dim=-1)
            # Draw every row's token, then read their logprobs in one gather (a Python-level
            # op per row costs more than the tiny model's matmuls).
            picked = [_draw(batch.logits[k], requests[rows[i].request], rows[i].generator)
                      for k, i in enumerate(batch.live)]
            chosen = torch.tensor(picked, dtype=torch.long)
            chosen_logprobs = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
            for k, i in enumerate(batch.live):
                req = requests[rows[i].request]
                top: list[tuple[int, float]] = []
                if req.top_logprobs:
                    values, ids = logprobs[k].topk(req.top_logprobs)
                    top = list(zip(ids.tolist(), values.tolist()))
                self._emit(rows[i], req, stops[rows[i].request], picked[k], chosen_logprobs[k],
                           top)
            batch.next_tokens = chosen
            if batch.keep_unfinished(rows):
                batch.logits = forward(
                    input_ids=batch.next_tokens.unsqueeze(-1),
                    attention_mask=batch.attention_mask,
                    position_ids=batch.next_positions.unsqueeze(-1), cache=batch.cache)[:, -1]
                batch.next_positions = batch.next_positions + 1

    def _emit(self, row: _Row, req: SampleRequest, stop_ids: set[int], token: int,
              logprob: float, top: list[tuple[int, float]]) -> None:
        """Add one generated token to ``row``: its logprob, top-k, stop check and stream event."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        if req.top_logprobs:
            row.top_logprobs.append(top)
        self._check_stop(row, req, stop_ids)
        if row.finish_reason is None and len(row.tokens) >= req.max_tokens:
            row.finish_reason = "length"
        if row.finish_reason is not None and row.text is None:
            row.text = self.tokenizer.decode(_text_tokens(row, stop_ids),
                                             skip_special_tokens=True)
        if req.on_token is not None:
            req.on_token(TokenEvent(
                row.sample, token, logprob, top, row.finish_reason,
                row.finish_reason == "stop" and token in stop_ids, row.text))

    def _check_stop(self, row: _Row, request: SampleRequest, stop_ids: set[int]) -> None:
        if row.tokens[-1] in stop_ids:
            row.finish_reason = "stop"
            return
        if request.stop:
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            hits = [text.find(s) for s in request.stop if s and s in text]
            if hits:
                row.finish_reason = "stop"
                row.text = text[: min(hits)]

    def _prompt_logprobs(self, logits: torch.Tensor, rows: list[_Row],
                         requests: list[SampleRequest], width: int, offset: int,
                         found: list[list[PromptTokenLogprob | None] | None]) -> None:
        """Add to ``found`` (per request, from its prefill row ``logits[request]``; None
        if not asked for) the prompt logprobs that the prefill chunk's ``logits``, at padded
        columns ``offset`` onwards, predict; chunks come in order."""
        end = offset + logits.shape[1]
        for row in rows:
            req = requests[row.request]
            if req.prompt_logprobs is None or row.sample != 0:
                continue
            start = width - len(req.prompt)
            entries = found[row.request]
            if entries is None:
                entries = found[row.request] = [None]  # the first token has no logprob
            # logits at column c predict the token at column c + 1
            low, high = max(start, offset), min(width - 1, end)
            if low >= high:
                continue
            logprobs = torch.log_softmax(logits[row.request, low - offset: high - offset].float(),
                                         dim=-1)
            targets = torch.tensor(req.prompt[low - start + 1: high - start + 1],
                                   dtype=torch.long)
            picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            ranks = (logprobs > picked.unsqueeze(-1)).sum(-1) + 1
            top_values, top_ids = logprobs.topk(req.prompt_logprobs, dim=-1)
            for p in range(high - low):
                top = list(zip(top_ids[p].tolist(), top_values[p].tolist()))
                entries.append(PromptTokenLogprob(float(picked[p]), int(ranks[p]), top))


def _generator(seed: int | None, sample: int) -> torch.Generator:
    if seed is None:
        seed = random.SystemRandom().randrange(2**62)
    # A distinct, deterministic stream per sample of a seeded request.
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + sample) % 2**63)


def _draw(logits: torch.Tensor, request: SampleRequest, generator: torch.Generator) -> int:
    """A token from ``logits`` (one row, float32) shaped by temperature, top-k and top-p."""
    if request.temperature == 0:
        return int(logits.argmax())
    scaled = logits / request.temperature
    if request.top_k > 0 and request.top_k < scaled.numel():
        kth = scaled.topk(request.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if request.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= request.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _text_tokens(row: _Row, stop_ids: set[int]) -> list[int]:
    """The tokens whose text is returned: without a final stop token."""
    if row.finish_reason == "stop" and row.tokens and row.tokens[-1] in stop_ids:
        return row.tokens[:-1]
    return row.tokens
