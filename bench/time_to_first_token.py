"""Streaming: time to first token vs total time of a 64-token streamed chat answer from a
`loops deploy` endpoint, through the official `openai` client.

    python bench/time_to_first_token.py [--max-tokens 64] [--rounds 7] [--quick] [--json]

A run on ``loops-local/tiny`` publishes a sampler checkpoint (untrained: the base model's
answer), which is deployed like `loops deploy` does; each round streams one chat completion
(``stream=True``, ``stream_options.include_usage``) and records when the first content chunk
arrived and when the stream ended. A round counts only if the answer is the full
``--max-tokens`` tokens long (per the usage chunk; a seed that hits an end-of-turn token early
is skipped). The ratio is the median of first-token time / total time; target <= 0.25
(a token-by-token stream delivers its first token long before the end; a stream that sends
everything at the end is ~1.0).
"""

from __future__ import annotations

import argparse
import statistics
import time

from train_throughput import TINY, bench_server, emit

TARGET = 0.25


def deploy_checkpoint(server) -> str:
    """A deployment's OpenAI base URL, serving checkpoint ``ttft`` of a fresh run."""
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.workers.trainer import TrainerClient

    with LoopsClient(server.url, server.token) as api:
        session = api.sessions.create()
        run = api.http.request_json("POST", "/v1/loops/runs", json={
            "session_id": session.id, "base_model": TINY, "lora_rank": 4, "seed": 0})["run"]
        with TrainerClient(run["base_url"], api_key=server.token, run_id=run["id"], base_model=TINY) as tc:
            tc.save_weights_for_sampler("ttft").result(timeout=300)
        cps = api.http.request_json("GET", "/v1/loops/checkpoints", params={"run_id": run["id"]})["checkpoints"]
        pk = next(cp["id"] for cp in cps if cp["checkpoint_id"] == "ttft")
        dep = api.http.request_json("POST", "/v1/loops/checkpoints/deploy", json={"checkpoint_ids": [pk]})
    return f"{server.url}/deployments/{dep['deployment_id']}/v1"


def stream_once(client, max_tokens: int, seed: int) -> tuple[float, float, int]:
    """(seconds to the first content chunk, seconds to the end, completion tokens)."""
    started = time.perf_counter()
    first = None
    tokens = 0
    stream = client.chat.completions.create(
        model="ttft", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=max_tokens,
        temperature=1.0, seed=seed, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - started
    return (first if first is not None else total), total, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="rounds that count (full-length answers)")
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--json", action="store_true", help="one JSON object for run_all.py")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds

    import openai

    with bench_server() as server:
        client = openai.OpenAI(base_url=deploy_checkpoint(server), api_key=server.token, max_retries=0, timeout=600)
        stream_once(client, args.max_tokens, seed=0)  # warm-up: loads the model and adapter
        ratios, firsts, totals = [], [], []
        seed = 1
        while len(ratios) < rounds and seed < rounds * 10:
            first, total, tokens = stream_once(client, args.max_tokens, seed)
            seed += 1
            if tokens != args.max_tokens:
                continue
            ratios.append(first / total)
            firsts.append(first)
            totals.append(total)
    if not ratios:
        raise SystemExit(f"no round produced {args.max_tokens} tokens")
    ratio = statistics.median(ratios)
    emit("time to first token / total (64-token stream)", ratio, TARGET,
         f"first token {statistics.median(firsts) * 1000:.0f} ms, total {statistics.median(totals) * 1000:.0f} ms "
         f"(medians of {len(ratios)} rounds, {args.max_tokens} tokens each)",
         args.json, extra={"value": round(statistics.median(firsts) * 1000, 1), "unit": "ms"},
         higher_is_better=False)


if __name__ == "__main__":
    main()
