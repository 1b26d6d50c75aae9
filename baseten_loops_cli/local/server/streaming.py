"""Token-by-token server-sent events from the sampler (``SamplerService.stream``), shared by
the deployments' OpenAI routes and a sampler's ``/sample``.

The route builds each chunk (its own JSON shape); this module drives the stream: the first
token is awaited *before* the response starts (so bad input is still an HTTP error, not a
broken stream), each token event becomes at most one chunk as soon as the sampler hands it
over, text is released only once final (:class:`Detokenizer`), and the final result closes
every choice (its remaining text and ``finish_reason``), then the usage chunk, then
``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

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


async def sse_response(samplers: SamplerService, base_model: str, job: SampleRequest,
                       tokenizer: Any, chunk: ChunkBuilder, *, include_usage: bool,
                       on_done: Callable[[SampleResult], dict]) -> StreamingResponse:
    """Stream ``job``; ``on_done(output)`` records the usage and returns the usage dict."""
    events = samplers.stream(base_model, job)
    first = await events.__anext__()

    def frame(obj: dict | None) -> str:
        if obj is None:
            return ""
        if include_usage:  # OpenAI: every chunk but the last carries "usage": null
            obj.setdefault("usage", None)
        return f"data: {json.dumps(obj)}\n\n"

    async def sse():
        texts = [Detokenizer(tokenizer, job.stop) for _ in range(job.n)]
        for index in range(job.n):
            if started := frame(chunk(index, "start", None)):
                yield started
        item = first
        while not isinstance(item, SampleResult):
            # A sample's last token: its text comes from the final result (a stop string
            # cuts it there).
            delta = "" if item.finish_reason is not None else texts[item.sample].push(item.token)
            if sent := frame(chunk(item.sample, "token", (delta, item))):
                yield sent
            item = await events.__anext__()
        usage = on_done(item)
        for index, seq in enumerate(item.sequences):
            yield frame(chunk(index, "finish", (texts[index].finish(seq.text), seq.finish_reason)))
        if include_usage:
            yield frame(chunk(None, "usage", usage))
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
