"""Token-by-token server-sent events from the sampler (``SamplerService.stream``), shared by
the deployments' OpenAI routes and a sampler's ``/sample``.

The route builds each chunk (its own JSON shape); this module drives the stream: the first
token is awaited *before* the response starts (so bad input is still an HTTP error, not a
broken stream), each token event becomes at most one chunk as soon as the sampler hands it
over, text is released only once final (:class:`Detokenizer`), and the final result closes
every choice (its ``finish_reason``; a sample's last token event already carried the rest of
its text), then the usage chunk, then ``[DONE]``. A batch of prompts (:func:`sse_batch_response`)
streams as one response, its choices numbered as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse

from baseten_loops_cli.local.engine.sample_types import SampleRequest, SampleResult
from baseten_loops_cli.local.server.samplers import SamplerService

# chunk(index, kind, payload) -> one chunk (dict) or None (nothing to send):
#   "start"  payload None                        a choice begins (chat: the role delta)
#   "token"  payload (text delta, TokenEvent)     one decoded token
#   "finish" payload (text rest, finish_reason)   a choice ends
#   "usage"  payload the usage dict (index None)  sent last when include_usage
ChunkBuilder = Callable[[Any, str, Any], "dict | None"]


class Detokenizer:
    """A streamed sample's text, released as soon as it is final: held back while it ends
    in an incomplete UTF-8 character or in what could be the start of a stop string."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).rstrip("\ufffd")
        hold = max((k for s in self.stop for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        return self._release(text[:len(text) - hold])

    def finish(self, text: str) -> str:
        return self._release(text)

    def _release(self, text: str) -> str:
        if not text.startswith(self.sent):  # the decoding of earlier tokens changed: wait
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


async def _events(samplers: SamplerService, base_model: str, jobs: list[SampleRequest]
                  ) -> AsyncIterator[tuple[int, Any]]:
    """``(job index, item)`` for every item of every job's stream (``SamplerService.stream``),
    as they come; the jobs are submitted together, so the batcher decodes them as one batch."""
    if len(jobs) == 1:
        async for item in samplers.stream(base_model, jobs[0]):
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, job: SampleRequest) -> None:
        try:
            async for item in samplers.stream(base_model, job):
                queue.put_nowait((index, item))
        except Exception as exc:  # raised to the reader below
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        finished = 0
        while finished < len(jobs):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            finished += isinstance(item, SampleResult)
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def sse_response(samplers: SamplerService, base_model: str, job: SampleRequest,
                       tokenizer: Any, chunk: ChunkBuilder, *, include_usage: bool,
                       on_done: Callable[[SampleResult], dict]) -> StreamingResponse:
    """Stream ``job``; ``on_done(output)`` records the usage and returns the usage dict."""
    return await sse_batch_response(samplers, base_model, [job], tokenizer, chunk,
                                    include_usage=include_usage,
                                    on_done=lambda outputs: on_done(outputs[0]))


async def sse_batch_response(samplers: SamplerService, base_model: str,
                             jobs: list[SampleRequest], tokenizer: Any, chunk: ChunkBuilder, *,
                             include_usage: bool,
                             on_done: Callable[[list[SampleResult]], dict]
                             ) -> StreamingResponse:
    """Stream ``jobs`` (a batch of prompts) as one response. Their choices are numbered as
    OpenAI numbers a batch's: job k's sample j is choice ``sum(n of jobs before k) + j``.
    ``on_done(outputs)`` (in job order) records the usage and returns the usage dict."""
    offsets = [sum(job.n for job in jobs[:k]) for k in range(len(jobs))]
    total = sum(job.n for job in jobs)
    events = _events(samplers, base_model, jobs)
    first = await events.__anext__()

    def frame(obj: dict | None) -> str:
        if obj is None:
            return ""
        if include_usage:  # OpenAI: every chunk but the last carries "usage": null
            obj.setdefault("usage", None)
        return f"data: {json.dumps(obj)}\n\n"

    async def sse() -> AsyncIterator[str]:
        texts = [Detokenizer(tokenizer, job.stop) for job in jobs for _ in range(job.n)]
        for index in range(total):
            if started := frame(chunk(index, "start", None)):
                yield started
        outputs: list[SampleResult | None] = [None] * len(jobs)
        item: tuple[int, Any] | None = first
        while item is not None:
            k, event = item
            if isinstance(event, SampleResult):
                outputs[k] = event
                for j, seq in enumerate(event.sequences):
                    index = offsets[k] + j
                    yield frame(chunk(index, "finish", (texts[index].finish(seq.text),
                                                        seq.finish_reason)))
            else:
                index = offsets[k] + event.sample
                # A sample's last token brings the rest of its text (a stop string cuts
                # it there), so the token's logprobs travel with its text.
                delta = (texts[index].finish(event.text) if event.text is not None
                         else texts[index].push(event.token))
                if sent := frame(chunk(index, "token", (delta, event))):
                    yield sent
            item = await anext(events, None)
        # Each job's stream ends with its SampleResult (or raised): none is None by now.
        usage = on_done([output for output in outputs if output is not None])
        if include_usage:
            yield frame(chunk(None, "usage", usage))
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
