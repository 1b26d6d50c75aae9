"""`loops sample RUN:final` vs the same request to a `loops deploy` endpoint by curl, on
SmolLM2-135M with a warm sampler.

    python bench/sample_latency.py [--max-tokens 16] [--rounds 5] [--quick] [--json]

A run on SmolLM2-135M-Instruct takes one SFT step and publishes sampler checkpoint ``final``,
which is deployed like `loops deploy` does. After one warm-up of each side, every round times
(wall clock, whole process) `loops sample RUN:final --prompt P --max-tokens N -T 0` and then
`curl` posting the same prompt to the deployment's ``/completions`` (greedy, same N). The
ratio is the median CLI time / median curl time; target <= 1.5 (the command's own cost:
start-up, resolving RUN:final, tokenizing, must stay small next to the generation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from train_throughput import SMOLLM2, bench_server, emit

TARGET = 1.5
PROMPT = "The capital of France is"


def trained_checkpoint(server) -> tuple[str, str]:
    """(run id, the deployment's OpenAI base URL) for checkpoint ``final`` of a fresh run that
    took one SFT step."""
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.workers.trainer import TrainerClient

    tokens = list(range(1, 33))
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
             "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [len(tokens) - 1]},
                                "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32",
                                            "shape": [len(tokens) - 1]}}}
    with LoopsClient(server.url, server.token) as api:
        session = api.sessions.create()
        run = api.http.request_json("POST", "/v1/loops/runs", json={
            "session_id": session.id, "base_model": SMOLLM2, "lora_rank": 8, "seed": 0})["run"]
        with TrainerClient(run["base_url"], api_key=server.token, run_id=run["id"], base_model=SMOLLM2) as tc:
            tc.forward_backward([datum], "cross_entropy").result(timeout=600)
            tc.optim_step({"learning_rate": 1e-4}).result(timeout=600)
            tc.save_weights_for_sampler("final").result(timeout=600)
        cps = api.http.request_json("GET", "/v1/loops/checkpoints", params={"run_id": run["id"]})["checkpoints"]
        pk = next(cp["id"] for cp in cps if cp["checkpoint_id"] == "final")
        dep = api.http.request_json("POST", "/v1/loops/checkpoints/deploy", json={"checkpoint_ids": [pk]})
    return run["id"], f"{server.url}/deployments/{dep['deployment_id']}/v1"


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return elapsed, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--json", action="store_true", help="one JSON object for run_all.py")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds

    with bench_server() as server:
        run_id, base = trained_checkpoint(server)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_"))}, **server.env}
        cli = [sys.executable, "-m", "baseten_loops_cli", "sample", f"{run_id}:final", "--prompt", PROMPT,
               "--max-tokens", str(args.max_tokens), "-T", "0"]
        body = json.dumps({"model": "final", "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0})
        curl = ["curl", "-sS", "--fail", "-H", f"Authorization: Bearer {server.token}",
                "-H", "Content-Type: application/json", "-d", body, f"{base}/completions"]
        timed(cli, env)  # warm-up: loads the model and the adapter in the sampler
        timed(curl)
        cli_s, curl_s = [], []
        for _ in range(rounds):
            cli_s.append(timed(cli, env)[0])
            curl_s.append(timed(curl)[0])
    cli_med, curl_med = statistics.median(cli_s), statistics.median(curl_s)
    emit("loops sample / curl to a deployment (SmolLM2, warm)", cli_med / curl_med, TARGET,
         f"loops sample {cli_med:.2f} s, curl {curl_med:.2f} s (medians of {rounds}, {args.max_tokens} tokens, greedy)",
         args.json, extra={"value": round(cli_med, 2), "unit": "s"}, higher_is_better=False)


if __name__ == "__main__":
    main()
