"""Sampling throughput: concurrent requests through the local server vs a sequential
transformers ``generate`` loop in-process.

    python bench/sampler_throughput.py [--model loops-local/tiny|HuggingFaceTB/SmolLM2-135M-Instruct]
                                       [--requests 8] [--n 4] [--max-tokens 64] [--rounds R] [--quick] [--json]

- **http**: a standalone sampler on the base model; ``--requests`` ``SamplerClient.asample``
  calls (``n`` samples, ``max_tokens`` each, temperature 1, no top-k/top-p) all in flight at
  once, so the server batches them;
- **local**: the same model built/loaded fresh in this process, one request at a time:
  ``model.generate(prompt, do_sample=True, num_return_sequences=n, max_new_tokens=max_tokens,
  top_k=0, top_p=1.0)``, under ``torch.autocast(bfloat16)`` where the bench servers compute
  in bf16 (``LOOPS_BENCH_DTYPE``, default auto: train_throughput.local_autocast).

The server's sampler has no "ignore eos" switch, so both sides stop on the same stop tokens
(the tokenizer's eos / end-of-turn ids) and throughput counts the tokens actually generated
(up to and including a stop token) per second. The detail line says how many tokens each
side made per sequence on average (64 = none stopped early).

Rounds alternate (http first on even rounds) and the ratio is the median of per-round
http/local tokens/s; target >= 1.0 (batching concurrent requests should beat the loop).
Both sides run torch with one thread unless ``--threads`` says otherwise (see
train_throughput.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from _common import ROOT
from train_throughput import (
    SMOLLM2,
    TINY,
    bench_env,
    bench_server,
    emit,
    load_local_model,
    local_autocast,
    proc_cpu_seconds,
)

TARGET = 1.0
PROMPT_LEN = 32
# (rounds, quick rounds) per model
# SmolLM2 on 2 busy cores makes ~15 (sequential) to ~40 (batched) tokens/s: a round of both
# sides is ~3 minutes there.
ROUNDS = {TINY: (8, 3), SMOLLM2: (2, 1)}


def make_prompts(model: str, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    hi = 256 if model == TINY else 10_000  # bytes / ordinary sub-word ids
    return [[rng.randrange(hi) for _ in range(PROMPT_LEN)] for _ in range(count)]


def stop_token_ids(model: str) -> list[int]:
    from baseten_loops_cli.tokenization import get_tokenizer

    return sorted(set(get_tokenizer(model).stop_token_ids))


class LocalSampler:
    def __init__(self, model_name: str, stops: list[int], n: int, max_tokens: int) -> None:
        self.model = load_local_model(model_name)
        self.stops = stops
        self.n = n
        self.max_tokens = max_tokens
        self.pad = self.model.config.pad_token_id
        if self.pad is None:
            self.pad = stops[0]

    def run(self, prompts: list[list[int]]) -> int:
        """Generate for each prompt in turn; returns the tokens generated."""
        import torch

        total = 0
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad(), local_autocast():
                out = self.model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                    num_return_sequences=self.n, max_new_tokens=self.max_tokens, temperature=1.0,
                    top_k=0, top_p=1.0, eos_token_id=self.stops, pad_token_id=self.pad)
            for row in out[:, len(prompt):].tolist():
                total += next((i + 1 for i, t in enumerate(row) if t in self.stops), len(row))
        return total


class HttpSampler:
    def __init__(self, server, model_name: str, n: int, max_tokens: int) -> None:
        from baseten_loops_cli.api.client import LoopsClient
        from baseten_loops_cli.workers.sampler import SamplerClient

        self.api = LoopsClient(server.url, server.token)
        session = self.api.sessions.create()
        sampler = self.api.samplers.create({"session_id": session.id, "base_model": model_name})
        self.client = SamplerClient(sampler.base_url, api_key=server.token, sampler_id=sampler.id,
                                    ready_timeout=900, timeout=900)
        self.n = n
        self.max_tokens = max_tokens
        self.seed = 0

    async def _run(self, prompts: list[list[int]]) -> int:
        results = await asyncio.gather(*(
            self.client.asample(p, n=self.n, max_tokens=self.max_tokens, temperature=1.0,
                                top_p=1.0, top_k=-1, seed=self._next_seed()) for p in prompts))
        await self.client.aclose()  # the async client is bound to this run's event loop
        return sum(len(seq.tokens) for r in results for seq in r.sequences)

    def _next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def run(self, prompts: list[list[int]]) -> int:
        return asyncio.run(self._run(prompts))

    def batching(self) -> dict:
        return self.api.http.request_json("GET", "/v1/local/status")["sampling"]

    def close(self) -> None:
        self.client.close()
        self.api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=TINY, choices=[TINY, SMOLLM2])
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests")
    parser.add_argument("--n", type=int, default=4, help="samples per request")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on both sides (default 1; 0 = torch's default, "
                             "one per core)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", action="store_true", help="one JSON object for run_all.py")
    args = parser.parse_args()
    rounds = args.rounds or ROUNDS[args.model][1 if args.quick else 0]
    bench_env(args.threads)

    prompts = make_prompts(args.model, args.requests)
    with bench_server() as server:
        started = time.monotonic()
        http = HttpSampler(server, args.model, args.n, args.max_tokens)
        try:
            stops = stop_token_ids(args.model)
            local = LocalSampler(args.model, stops, args.n, args.max_tokens)
            # Warm-up (the server loads the model; first-call allocations): short generations.
            for side in (http, local):
                side.max_tokens, saved = 4, side.max_tokens
                side.run(prompts[:2])
                side.max_tokens = saved
            setup_s = time.monotonic() - started
            rates: dict[str, list[float]] = {"http": [], "local": []}
            made = {"http": 0, "local": 0}
            cpu = {"http": 0.0, "local": 0.0}
            for r in range(rounds):
                for side in (("http", "local") if r % 2 == 0 else ("local", "http")):
                    c0 = proc_cpu_seconds() + proc_cpu_seconds(server.pid)
                    t0 = time.perf_counter()
                    tokens = (http if side == "http" else local).run(prompts)
                    rates[side].append(tokens / (time.perf_counter() - t0))
                    cpu[side] += proc_cpu_seconds() + proc_cpu_seconds(server.pid) - c0
                    made[side] += tokens
                print(f"round {r + 1}/{rounds}: http {rates['http'][-1]:.0f} tok/s, "
                      f"local {rates['local'][-1]:.0f} tok/s", file=sys.stderr, flush=True)
            stats = http.batching().get(args.model, {})
        finally:
            http.close()
    ratios = [h / l for h, l in zip(rates["http"], rates["local"])]
    ratio = statistics.median(ratios)
    sequences = rounds * args.requests * args.n
    detail = (f"http {statistics.median(rates['http']):.0f} vs local "
              f"{statistics.median(rates['local']):.0f} generated tokens/s ({args.requests} "
              f"concurrent requests x {args.n} samples x <= {args.max_tokens} tokens; mean "
              f"tokens/sequence http {made['http'] / sequences:.1f}, local "
              f"{made['local'] / sequences:.1f}; server batches {stats.get('batches')} "
              f"(largest {stats.get('largest_batch')} requests); CPU-seconds/token local/http "
              f"{(cpu['local'] / made['local']) / (cpu['http'] / made['http']):.3f}; median of "
              f"{rounds} alternating rounds, per-round ratios "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; setup {setup_s:.0f}s)")
    emit(f"sampler_throughput[{args.model.split('/')[-1]}]", ratio, TARGET, detail, args.json,
         {"value": round(statistics.median(rates["http"]), 1), "unit": "tok/s"})


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
