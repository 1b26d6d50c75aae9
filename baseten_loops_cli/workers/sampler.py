"""Client of a sampler worker: ``POST /sample`` (§3.3), sync and async.

The body is the vLLM completions flavour the SDK sends (token-id prompt, ``logprobs: 0``,
``return_tokens_as_token_ids: true``); the answer is an OpenAI completions body parsed into
:class:`~baseten_loops_cli.workers.types.SampleResult`. A serverless-queue style ``202
{operation_id}`` answer is also understood (polled like a trainer op).

Routing headers: ``X-Run-Id`` (paired sampler) or ``X-Sampler-Id`` (standalone, only when no
checkpoint is pinned) - never both; ``X-Checkpoint-Path`` pins weights; ``X-Min-Policy-Version``
is a floor (never sent as 0); the sampler answers 408 while it is behind, which is retried.
``Idempotency-Key`` is one uuid4 per ``sample()`` call, reused by its retries.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Iterable, Iterator, Literal, Mapping, NamedTuple, Sequence, TypedDict, Unpack
from urllib.parse import quote

import httpx

from baseten_loops_cli.api.errors import (
    OperationTimeoutError,
    ProtocolError,
    RequestTimeoutError,
    SampleTimeoutError,
)
from baseten_loops_cli.api.http import connection_error
from baseten_loops_cli.api.retry import RetryPolicy
from baseten_loops_cli.api.polling import Poll
from baseten_loops_cli.workers.client import (
    DEFAULT_POLL_HOLD_TIMEOUT,
    WorkerClient,
    WorkerOptions,
    json_body,
    require_dict,
)
from baseten_loops_cli.workers.types import ExternalRef, ModelInput, SampledSequence, SampleResult

RUN_ID_HEADER = "X-Run-Id"
SAMPLER_ID_HEADER = "X-Sampler-Id"
MIN_POLICY_VERSION_HEADER = "X-Min-Policy-Version"
CHECKPOINT_PATH_HEADER = "X-Checkpoint-Path"
AFFINITY_HEADER = "X-Baseten-Session-ID"
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
POLICY_VERSION_HEADER = "x-trainers-policy-version"

DEFAULT_READY_TIMEOUT = 600.0
# 408 = the sampler is behind X-Min-Policy-Version (or a gateway timeout); 5xx = proxy/cold start.
# A 500 is the engine failing on this request: raised, not retried for ten minutes.
_SAMPLE_RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})


# ── response parsing (the SDK's _parse_completions) ─────────────────────────────────────────


def parse_token_id(tok: str | int) -> int:
    """A vLLM ``return_tokens_as_token_ids`` marker (``"token_id:123"``) or a plain int."""
    if isinstance(tok, int):
        return tok
    prefix, _, suffix = str(tok).partition(":")
    if prefix != "token_id" or not suffix:
        raise ProtocolError(f"expected a 'token_id:<int>' token (return_tokens_as_token_ids), got {tok!r}")
    return int(suffix)


def _stop_reason(finish_reason: Any) -> Literal["stop", "length"]:
    return "stop" if finish_reason == "stop" else "length"


def _int_list(raw: Any) -> list[int] | None:
    if isinstance(raw, list) and all(isinstance(t, int) for t in raw):
        return list(raw)
    return None


def _parse_prompt_logprobs(
    raw: list | None, prompt_ids: Sequence[int], with_topk: bool
) -> tuple[list[float | None] | None, list[list[tuple[int, float]] | None] | None]:
    """vLLM's per-position ``{token_id: {logprob, ...}}`` dicts → (actual logprobs, top-k)."""
    if not raw:
        return None, None
    logprobs: list[float | None] = []
    topk: list[list[tuple[int, float]] | None] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            logprobs.append(None)
            topk.append(None)
            continue
        actual = entry.get(str(prompt_ids[i])) if i < len(prompt_ids) else None
        logprobs.append(actual.get("logprob") if isinstance(actual, dict) else None)
        topk.append([(int(tid), obj["logprob"]) for tid, obj in entry.items() if isinstance(obj, dict)])
    return logprobs, (topk if with_topk else None)


def parse_completions(
    payload: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    include_topk_prompt_logprobs: bool = False,
) -> SampleResult:
    """Map an OpenAI ``/v1/completions`` body (+ response headers) to a :class:`SampleResult`.

    Tokens come from ``choices[].token_ids`` or ``logprobs.tokens`` (``"token_id:N"``); a prompt
    prefix echoed in front of the completion is stripped when it matches exactly.
    """
    sequences: list[SampledSequence] = []
    raw_prompt_logprobs = None
    echoed_prompt: list[int] | None = None
    for choice in payload.get("choices") or []:
        lp = choice.get("logprobs") or {}
        raw_tokens = choice.get("token_ids") or lp.get("tokens") or []
        tokens = [parse_token_id(t) for t in raw_tokens]
        token_logprobs = lp.get("token_logprobs")
        logprobs = list(token_logprobs) if token_logprobs is not None else None
        choice_prompt = _int_list(choice.get("prompt_token_ids"))
        if echoed_prompt is None and choice_prompt is not None:
            echoed_prompt = choice_prompt
        prefix = choice_prompt if choice_prompt is not None else (list(prompt_token_ids) if prompt_token_ids else None)
        if prefix and tokens[: len(prefix)] == prefix:
            tokens = tokens[len(prefix) :]
            logprobs = logprobs[len(prefix) :] if logprobs is not None else None
        raw_ref = choice.get("routed_experts_ref")
        sequences.append(
            SampledSequence(
                tokens=tokens,
                logprobs=logprobs,
                stop_reason=_stop_reason(choice.get("finish_reason")),
                text=choice.get("text"),
                routed_experts=ExternalRef.model_validate(raw_ref) if raw_ref else None,
            )
        )
        if raw_prompt_logprobs is None:
            raw_prompt_logprobs = choice.get("prompt_logprobs")
    policy_version = None
    if headers is not None and headers.get(POLICY_VERSION_HEADER) not in (None, ""):
        try:
            policy_version = int(headers[POLICY_VERSION_HEADER])
        except ValueError:
            policy_version = None
    prompt_ids = echoed_prompt if echoed_prompt is not None else (list(prompt_token_ids) if prompt_token_ids is not None else None)
    prompt_logprobs, topk = _parse_prompt_logprobs(raw_prompt_logprobs, prompt_ids or [], include_topk_prompt_logprobs)
    return SampleResult(
        sequences=sequences,
        policy_version=policy_version,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=topk,
    )


# ── request building ────────────────────────────────────────────────────────────────────────


def build_sample_body(
    prompt_tokens: Sequence[int] | ModelInput,
    *,
    n: int = 1,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int | None = None,
    stop: str | Sequence[str] | Sequence[int] | None = None,
    prompt_logprobs: bool = False,
    topk_prompt_logprobs: int = 0,
    structured_outputs: dict | None = None,
) -> dict:
    """The §3.3 ``/sample`` body, key for key what the SDK sends."""
    if isinstance(prompt_tokens, ModelInput):
        prompt = prompt_tokens.to_ints()
    else:
        prompt = [int(t) for t in prompt_tokens]
    if topk_prompt_logprobs < 0:
        raise ValueError("topk_prompt_logprobs must be non-negative")
    body: dict[str, Any] = {
        "prompt": prompt,
        "n": int(n),
        "temperature": temperature,
        "top_p": top_p,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    if prompt_logprobs:
        body["prompt_logprobs"] = int(topk_prompt_logprobs)
    if max_tokens is not None:
        body["max_tokens"] = int(max_tokens)
    if seed is not None:
        body["seed"] = int(seed)
    if top_k is not None and top_k > 0:
        body["top_k"] = int(top_k)
    if stop is not None:
        if isinstance(stop, (list, tuple)) and stop and all(isinstance(s, int) for s in stop):
            body["stop_token_ids"] = list(stop)
        else:
            body["stop"] = list(stop) if isinstance(stop, tuple) else stop
    if structured_outputs is not None:
        body["structured_outputs"] = structured_outputs
    return body


class SamplingOptions(TypedDict, total=False):
    """What a ``/sample`` asks for: :func:`build_sample_body`'s keywords (its defaults stand
    for those left out)."""

    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: str | Sequence[str] | Sequence[int] | None
    prompt_logprobs: bool
    topk_prompt_logprobs: int


class SampleOptions(SamplingOptions, total=False):
    """The keywords of :meth:`SamplerClient.sample` (as the SDK's): the sampling, and the routing
    headers (:meth:`SamplerClient.request_headers`; None: the client's default)."""

    min_policy_version: int | None
    checkpoint_path: str | None
    affinity_key: str | None


class SampleChunk(NamedTuple):
    """One streamed ``/sample`` chunk: a decoded token of sample ``index`` (its text delta,
    possibly empty while held back), or that sample's end (``finish_reason`` set)."""

    index: int  # type: ignore[assignment]  # shadows tuple.index(): the sample's number is what callers read
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def _stream_event(line: str) -> dict | None:
    """The JSON of one server-sent ``data:`` line (None for other lines and ``[DONE]``)."""
    import json

    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    try:
        payload = json.loads(data)
    except ValueError as exc:
        raise ProtocolError(f"/sample streamed a non-JSON event: {data[:200]}") from exc
    if not isinstance(payload, dict):
        raise ProtocolError(f"/sample streamed an unexpected event: {data[:200]}")
    return payload


# How long a training run (its loop, judges, teachers) waits for one /sample answer (the
# client's default is 300 s). A dedicated sampler answers synchronously, and a training
# batch's requests are generated together: 4 groups of 4 replies of 256 SmolLM2 tokens took
# over 300 s on a busy 2-core machine, which failed the run (issue 44's example). A read
# timeout is never retried, since a retry restarts the generation; this bound is only there
# for a sampler that stopped answering.
TRAINING_SAMPLE_TIMEOUT_S = 1800.0


class SamplerClient(WorkerClient):
    """Client of one sampler (``sampler.base_url``), sync (:meth:`sample`) and async
    (:meth:`asample`). ``min_policy_version`` / ``checkpoint_path`` given here are defaults for
    every call; a call's own arguments override them.

    A ``/sample`` is retried (same Idempotency-Key) until ``ready_timeout`` on connection
    failures, 408/429/502/504 and 503 (at most ``max_unavailable_retries`` in a row without
    Retry-After); a read timeout is not retried, since a retry restarts the generation."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        run_id: str | None = None,
        sampler_id: str | None = None,
        checkpoint_path: str | None = None,
        min_policy_version: int | None = None,
        timeout: float = 300.0,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        poll_hold_timeout: float = DEFAULT_POLL_HOLD_TIMEOUT,
        max_unavailable_retries: int = 6,
        **worker: Unpack[WorkerOptions],
    ):
        super().__init__(base_url, api_key=api_key, run_id=run_id, timeout=timeout, **worker)
        self.sampler_id = sampler_id
        self.checkpoint_path = checkpoint_path
        self.min_policy_version = min_policy_version
        self.ready_timeout = ready_timeout
        self.poll_hold_timeout = poll_hold_timeout
        self._sample_policy = RetryPolicy(retry_statuses=_SAMPLE_RETRY_STATUSES, max_retries=None, deadline=ready_timeout,
                                          unavailable_limit=max_unavailable_retries, retry_timeouts=False)  # fmt: skip

    # -- headers ---------------------------------------------------------------------------

    def request_headers(
        self,
        *,
        min_policy_version: int | None = None,
        checkpoint_path: str | None = None,
        affinity_key: str | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, str]:
        """Per-request routing headers (the auth headers are on the HTTP client)."""
        ckpt = checkpoint_path if checkpoint_path is not None else self.checkpoint_path
        floor = min_policy_version if min_policy_version is not None else self.min_policy_version
        headers: dict[str, str] = {}
        if ckpt:
            headers[CHECKPOINT_PATH_HEADER] = ckpt
        if self.run_id:
            headers[RUN_ID_HEADER] = self.run_id
        elif self.sampler_id and not ckpt:
            headers[SAMPLER_ID_HEADER] = self.sampler_id  # a checkpoint path already names its run
        if floor:  # never sent as 0: 0 means "base weights", no floor at all
            headers[MIN_POLICY_VERSION_HEADER] = str(int(floor))
        if affinity_key:
            headers[AFFINITY_HEADER] = affinity_key
        if idempotency_key:
            headers[IDEMPOTENCY_KEY_HEADER] = idempotency_key
        return headers

    # -- sample ----------------------------------------------------------------------------

    def _prepare(
        self,
        prompt_tokens: Sequence[int] | ModelInput,
        *,
        min_policy_version: int | None = None,
        checkpoint_path: str | None = None,
        affinity_key: str | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> tuple[dict, dict[str, str]]:
        """The body and headers of one ``/sample`` call (sync, async and streamed alike); the
        Idempotency-Key is fresh per call and reused by that call's retries."""
        body = build_sample_body(prompt_tokens, **sampling)
        headers = self.request_headers(
            min_policy_version=min_policy_version,
            checkpoint_path=checkpoint_path,
            affinity_key=affinity_key,
            idempotency_key=uuid.uuid4().hex,
        )
        return body, headers

    def sample(self, prompt_tokens: Sequence[int] | ModelInput, **options: Unpack[SampleOptions]) -> SampleResult:
        """One ``/sample`` call: ``options`` are :class:`SampleOptions` (the SDK's keywords)."""
        body, headers = self._prepare(prompt_tokens, **options)
        poll = self._poll(timeout=self.ready_timeout)  # a queued sample's polls share its budget
        with self._timeout_is_sample_timeout():
            resp = self._http.send("POST", "sample", json=body, headers=headers, policy=self._sample_policy, repeatable=True)
        return self._answer(resp, body, headers, poll)

    async def asample(self, prompt_tokens: Sequence[int] | ModelInput, **options: Unpack[SampleOptions]) -> SampleResult:
        """Async :meth:`sample` on the shared ``httpx.AsyncClient``; fan out with ``asyncio.gather``."""
        body, headers = self._prepare(prompt_tokens, **options)
        poll = self._poll(timeout=self.ready_timeout)
        with self._timeout_is_sample_timeout():
            resp = await self._http.asend("POST", "sample", json=body, headers=headers, policy=self._sample_policy,
                                          repeatable=True)  # fmt: skip
        if resp.status_code == 202:
            import asyncio  # here, not at module level: sync callers never need it (~15 ms)

            # Rare (serverless queue); poll on a worker thread with the sync client.
            return await asyncio.to_thread(self._answer, resp, body, headers, poll)
        return self._answer(resp, body, headers, poll)

    def sample_stream(self, prompt_tokens: Sequence[int] | ModelInput, **options: Unpack[SampleOptions]) -> Iterator[SampleChunk]:
        """:meth:`sample` with ``stream: true``: chunks as the sampler decodes them (a
        local-backend / vLLM extension; the hosted SDK does not stream). Retried as
        :meth:`sample` until the stream starts; never after (a retry restarts generation)."""
        body, headers = self._prepare(prompt_tokens, **options)
        body["stream"] = True
        with self._timeout_is_sample_timeout():
            resp = self._http.send("POST", "sample", json=body, headers=headers, policy=self._sample_policy,
                                   repeatable=True, stream=True)  # fmt: skip
        try:
            for line in resp.iter_lines():
                event = _stream_event(line)
                for choice in (event or {}).get("choices") or []:
                    logprobs = choice.get("logprobs") or {}
                    yield SampleChunk(int(choice.get("index") or 0), choice.get("text") or "",
                                      [int(t) for t in choice.get("token_ids") or []],
                                      list(logprobs.get("token_logprobs") or []), choice.get("finish_reason"))
        except httpx.ReadTimeout as exc:
            raise self._sample_timeout() from exc
        except httpx.TransportError as exc:
            raise connection_error(exc, resp.request.url, api_key=self._http.api_key) from exc
        finally:
            resp.close()

    # -- other routes ----------------------------------------------------------------------

    def models(self) -> list[dict]:
        """``GET /v1/models`` → ``[{id, parent}]`` (base: ``parent`` null; adapters: set)."""
        body = self._get_body("v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        return list(data or [])

    def trainers_policy_version(self) -> int:
        """``GET /trainers_policy_version``: the adapter version the sampler serves now."""
        body = self._get_body("trainers_policy_version")
        try:
            return int(body["policy_version"])
        except (TypeError, KeyError, ValueError) as exc:
            raise ProtocolError(f"unexpected /trainers_policy_version body: {str(body)[:200]}") from exc

    def wait_for_policy_version(self, version: int, *, timeout: float = 600.0, interval: float = 0.5) -> int:
        """Poll :meth:`trainers_policy_version` until it reaches ``version``; returns it."""
        current = None
        for _ in self._poll(timeout=timeout, interval=interval):
            current = self.trainers_policy_version()
            if current >= version:
                return current
        raise OperationTimeoutError(
            f"the sampler still serves policy version {current} after {timeout:g}s (waiting for {version})"
        )

    # -- internals -------------------------------------------------------------------------

    def _get_body(self, path: str) -> Any:
        _, body = self._get_json(path, headers=self.request_headers())
        if body is None:
            raise ProtocolError(f"GET {path}: non-JSON answer")
        return body

    def _sample_timeout(self) -> SampleTimeoutError:
        return SampleTimeoutError(
            f"the sampler at {self.base_url} did not answer /sample within {self._timeout.read}s",
            hint="lower max_tokens or n, or raise the timeout; the request is not retried because it restarts generation",
        )

    @contextlib.contextmanager
    def _timeout_is_sample_timeout(self) -> Iterator[None]:
        """A ``/sample`` POST's read timeout, said as the sampler's (it is not retried)."""
        try:
            yield
        except RequestTimeoutError as exc:
            raise self._sample_timeout() from exc

    def _answer(self, resp: httpx.Response, body: dict, headers: Mapping[str, str], poll: Poll) -> SampleResult:
        """The result of an accepted ``/sample``: its body, or a queued (202) one's polled result."""
        if resp.status_code == 202:
            payload, answer_headers = self._poll_queued(resp, headers, poll), None
        else:
            payload, answer_headers = json_body(resp), resp.headers
        # body["prompt_logprobs"] is topk_prompt_logprobs, sent only when prompt logprobs are asked for
        return parse_completions(require_dict(payload, "/sample"), answer_headers, prompt_token_ids=body["prompt"],
                                 include_topk_prompt_logprobs=body.get("prompt_logprobs", 0) > 0)  # fmt: skip

    def _poll_queued(self, accepted: httpx.Response, headers: Mapping[str, str], poll: Poll) -> dict:
        """The result of a queued (202) sample: ``/operations/{id}`` long-polled as a trainer op."""
        try:
            op_id = str(accepted.json()["operation_id"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError("/sample answered 202 without an operation_id") from exc
        poll_headers = {k: v for k, v in headers.items() if k != IDEMPOTENCY_KEY_HEADER}
        policy = self._sample_policy.replace(retry_statuses=_SAMPLE_RETRY_STATUSES - {408}, retry_timeouts=True)
        try:
            return self._await_operation(op_id, operation="sample", poll=poll, policy=policy, headers=poll_headers)
        except OperationTimeoutError:
            try:  # best effort, once: do not leave a queued generation running for nobody
                self._http.send("POST", f"operations/{quote(op_id, safe='')}/cancel", headers=poll_headers,
                                policy=policy.replace(max_retries=0))  # fmt: skip
            except Exception:  # noqa: BLE001 - the timeout is what the caller needs to see
                pass
            raise


def sample_many(client: SamplerClient, prompts: Iterable[Sequence[int]], **kwargs: Any) -> list[SampleResult]:
    """Sample several prompts concurrently (asyncio) from sync code."""
    import asyncio  # here, not at module level: most commands that import this never sample

    async def _run() -> list[SampleResult]:
        try:
            return list(await asyncio.gather(*(client.asample(p, **kwargs) for p in prompts)))
        finally:
            await client._http.aclose()  # its AsyncClient belongs to this loop, which ends here

    return asyncio.run(_run())


__all__ = ["SampleOptions", "SamplerClient", "SamplingOptions", "build_sample_body", "parse_completions", "parse_token_id", "sample_many"]
