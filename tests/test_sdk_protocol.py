"""The official SDK (baseten-loops 0.32.0) against a real local server, beyond its quickstart
(tests/test_local_sdk_compat.py): the edges where our answers decide whether the SDK fails
at once, retries, or hangs.

Each test runs a snippet with the SDK's own interpreter (tests/external.py; without one the
tests skip, which fails CI) and reads back the JSON the snippet prints last.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from conftest import LocalServer
from tests.external import sdk_run_env

pytestmark = [pytest.mark.local, pytest.mark.required_in_ci]

PRELUDE = """
import json, logging, os, time
logging.basicConfig(level=logging.ERROR)
from baseten.loops import *
K, B = os.environ["BASETEN_API_KEY"], os.environ["LOOPS_BASE_URL"]
MODEL = "loops-local/tiny"

def timed(fn):
    # (seconds, exception type, message) of a call expected to raise.
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return [round(time.monotonic() - started, 1), type(exc).__name__, str(exc)]
    return [round(time.monotonic() - started, 1), None, ""]
"""


def run_sdk(server: LocalServer, code: str, timeout: float = 300) -> dict:
    python, env = sdk_run_env(server.url, server.token)
    script = PRELUDE + textwrap.dedent(code)
    proc = subprocess.run([python, "-c", script], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"SDK snippet failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_unknown_run_or_sampler_fails_at_once_instead_of_retrying_for_the_ready_timeout(
        local_server: LocalServer):
    """The SDK retries a worker 404 as "still deploying" for its whole ready_timeout (an hour
    from ServiceClient). A run or sampler this server never had cannot appear later, so the
    404 carries the gateway's error-source headers and the SDK gives up at once: in an op
    submit, in /sample, and in the trainer readiness wait."""
    out = run_sdk(local_server, """
        from baseten.loops.sampling_client import BasetenDeployment, SamplingClient
        from baseten.loops.trainer_deployment import DedicatedTrainerDeployment
        from baseten.loops.training_client import TrainingClient

        trainer = timed(lambda: TrainingClient(
            f"{B}/trainers/nosuchrun", api_key=K, base_model=MODEL, lora_rank=4,
            ready_timeout=120))
        sampler = SamplingClient(
            base_model=MODEL, api_key=K, ready_timeout=120,
            deployment=BasetenDeployment(base_url=f"{B}/samplers/nosuch/sync", model_id="m",
                                         deployment_id="d", api_base_url=B))
        sample = timed(lambda: sampler.sample(ModelInput.from_ints([1]),
                                              sampling_params=SamplingParams(max_tokens=1)))
        models = timed(sampler.discover_base_model_name)
        service = ServiceClient()
        ready = timed(lambda: service._wait_for_trainer_ready(
            DedicatedTrainerDeployment(f"{B}/trainers/nosuchrun", "nodep"), 120, MODEL,
            run_id="nosuchrun"))
        # A real run answers as before: its trainer and sampler still work.
        training = service.create_lora_training_client(MODEL, rank=4, ready_timeout=60)
        mismatch = timed(lambda: service._wait_for_trainer_ready(
            DedicatedTrainerDeployment(training._base_url, "nodep"), 120, "other/model"))
        client = training.save_weights_and_get_sampling_client("live")
        tokens = client.sample(ModelInput.from_ints([1, 2]),
                               sampling_params=SamplingParams(max_tokens=2)).sequences[0].tokens
        training.close()
        print(json.dumps({"trainer": trainer, "sample": sample, "models": models,
                          "ready": ready, "mismatch": mismatch, "tokens": tokens}))
    """)
    for key, code in (("trainer", "run_not_found"), ("sample", "sampler_not_found"),
                      ("models", "sampler_not_found"), ("ready", "run_not_found"),
                      ("mismatch", "base_model_mismatch")):
        seconds, error, message = out[key]
        assert error is not None and seconds < 20, (key, out[key])
        assert "404" in message and code in message, (key, out[key])
    assert out["trainer"][1] == out["sample"][1] == "HTTPStatusError"
    assert out["ready"][1] == out["mismatch"][1] == "RuntimeError"
    assert len(out["tokens"]) == 2


def test_sampling_params_prompt_logprobs_and_checkpoint_pages_parse_in_the_sdk(
        local_server: LocalServer):
    """Sampling options the quickstart leaves out (stop strings and ids, seeds, n, top-k
    prompt logprobs) and the checkpoint-files paging, read through the SDK's own parsers."""
    out = run_sdk(local_server, """
        service = ServiceClient()
        training = service.create_lora_training_client(MODEL, rank=4, ready_timeout=60)
        client = training.save_weights_and_get_sampling_client("p")
        prompt = ModelInput.from_ints([1, 5, 9])
        def sample(**kw):
            return client.sample(prompt, sampling_params=SamplingParams(**kw))
        greedy = sample(max_tokens=4, temperature=0.0).sequences[0]
        stop_id = sample(max_tokens=4, temperature=0.0, stop=[greedy.tokens[1]]).sequences[0]
        seeded = [[s.tokens for s in client.sample(prompt, num_samples=3,
                   sampling_params=SamplingParams(max_tokens=5, seed=7)).sequences]
                  for _ in range(2)]
        topk = client.sample(prompt, sampling_params=SamplingParams(max_tokens=1),
                             include_prompt_logprobs=True, topk_prompt_logprobs=3)
        training.save_state("s").result()
        pages = [training.get_checkpoint_archive_url(name="s", page_size=1, page_token=t)
                 for t in range(2)]
        training.close()
        print(json.dumps({
            "greedy": [greedy.tokens, greedy.stop_reason, len(greedy.logprobs)],
            "stop_id": [stop_id.tokens, stop_id.stop_reason],
            "seeded": seeded,
            "plp": topk.prompt_logprobs, "topk": topk.topk_prompt_logprobs,
            "logprobs": client.compute_logprobs(prompt),
            "pages": [[p.total_count, p.next_page_token, len(p.presigned_urls)] for p in pages]}))
    """)
    tokens, reason, n_logprobs = out["greedy"]
    assert len(tokens) == 4 and reason == "length" and n_logprobs == 4
    # The stop token ends the sequence at its first occurrence, and is kept (as vLLM does).
    assert out["stop_id"] == [tokens[:tokens.index(tokens[1]) + 1], "stop"]
    assert out["seeded"][0] == out["seeded"][1] and len(out["seeded"][0]) == 3
    assert out["plp"][0] is None and out["topk"][0] is None
    assert out["plp"] == out["logprobs"]
    for position, (actual, top) in enumerate(zip(out["plp"][1:], out["topk"][1:]), start=1):
        assert [1, 5, 9][position] in [t for t, _ in top] and 3 <= len(top) <= 4
        assert any(abs(lp - actual) < 1e-6 for _, lp in top)
    total = out["pages"][0][0]
    assert total >= 2 and out["pages"][0][1:] == [1, 1] and out["pages"][1][2] == 1
    assert out["pages"][1][1] == (2 if total > 2 else None)
