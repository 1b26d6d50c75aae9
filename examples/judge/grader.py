"""A small OpenAI-compatible grader whose answers are known: the judge of examples/tiny-judge.yaml.

It reads the reply between <reply> and </reply> in the rubric it gets and answers
``Score: N``, N = 10 x the fraction of the reply's characters that are digits (what
examples/rewards.py:digit_fraction computes, so the judge's reward can be checked). With
several <reply id="K"> blocks (``mode: group``) it answers RULER's JSON
``{"scores": [{"trajectory_id": K, "score": N}, ...]}``. The model ``prose`` answers without a
score (for tests). With GRADER_KEY set, requests need ``Authorization: Bearer $GRADER_KEY``.

    pip install 'baseten-loops-cli[local]'        # starlette + uvicorn
    python examples/judge/grader.py --port 8765   # then reward.judge.url: http://127.0.0.1:8765/v1
"""

from __future__ import annotations

import argparse
import json
import os
import re

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

REPLY = re.compile(r'<reply(?: id="(\d+)")?>(.*?)</reply>', re.DOTALL)


def digit_score(text: str) -> int:
    text = text.strip()
    return round(10 * sum(c.isdigit() for c in text) / len(text)) if text else 0


def grade(model: str, content: str) -> str:
    if model == "prose":
        return "This reply is thoughtful and I like it a lot."
    replies = REPLY.findall(content)
    if len(replies) > 1 or (replies and replies[0][0]):
        return json.dumps({"scores": [{"trajectory_id": int(k), "score": digit_score(t)} for k, t in replies]})
    return f"Score: {digit_score(replies[0][1]) if replies else 0}"


def _authorized(request: Request) -> bool:
    key = os.environ.get("GRADER_KEY")
    return not key or request.headers.get("authorization") == f"Bearer {key}"


async def models(request: Request) -> JSONResponse:
    if not _authorized(request):
        return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error"}}, status_code=401)
    return JSONResponse({"object": "list", "data": [{"id": "grader", "object": "model"}]})


async def chat(request: Request) -> JSONResponse:
    if not _authorized(request):
        return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error"}}, status_code=401)
    body = await request.json()
    user = [m["content"] for m in body["messages"] if m["role"] == "user"]
    text = grade(body.get("model", ""), user[0] if user else "")
    return JSONResponse({
        "id": "chatcmpl-grader", "object": "chat.completion", "model": body.get("model", "grader"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": len(user[0].split()) if user else 0, "completion_tokens": len(text.split()),
                  "total_tokens": 0},
    })  # fmt: skip


app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])

if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
