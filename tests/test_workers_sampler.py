"""SamplerClient against a real local HTTP server, plus the completions parser."""

from __future__ import annotations

import asyncio

import pytest
from fault_server import FaultServer, Reply

from baseten_loops_cli.api.errors import AuthenticationError, SampleTimeoutError, ServerShutdownError
from baseten_loops_cli.workers import ModelInput, SamplerClient, parse_completions
from baseten_loops_cli.workers.sampler import build_sample_body, parse_token_id


def completion(tokens=("token_id:7", "token_id:8"), lps=(-0.5, -1.0), finish="stop", **extra):
    choice = {"text": "hi", "finish_reason": finish, "logprobs": {"tokens": list(tokens), "token_logprobs": list(lps)}}
    choice.update(extra)
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


@pytest.fixture
def server():
    srv = FaultServer()
    yield srv
    srv.close()


def client(server, **kw) -> SamplerClient:
    kw.setdefault("sleep", lambda s: None)
    return SamplerClient(f"{server.url}/s/sync", api_key="sk-secret-123", **kw)


def test_body_and_headers(server):
    server.route("POST", "/s/sync/sample", lambda r: Reply(200, completion(), headers={"x-trainers-policy-version": "3"}))
    sc = client(server, run_id="run1")
    res = sc.sample([1, 2, 3], n=2, max_tokens=5, temperature=0.7, top_p=0.9, top_k=0, seed=4, stop=[9, 10],
                    min_policy_version=3, checkpoint_path="bt://loops:run1/sampler_weights/a")  # fmt: skip
    req = server.requests_to("POST", "/s/sync/sample")[0]
    assert req.json == {
        "prompt": [1, 2, 3], "n": 2, "temperature": 0.7, "top_p": 0.9, "logprobs": 0,
        "return_tokens_as_token_ids": True, "max_tokens": 5, "seed": 4, "stop_token_ids": [9, 10],
    }  # fmt: skip
    assert req.header("x-run-id") == "run1" and req.header("x-sampler-id") is None
    assert req.header("x-min-policy-version") == "3"
    assert req.header("x-checkpoint-path") == "bt://loops:run1/sampler_weights/a"
    assert req.header("authorization") == "Api-Key sk-secret-123"
    assert len(req.header("idempotency-key")) == 32
    assert res.policy_version == 3
    assert res.sequences[0].tokens == [7, 8] and res.sequences[0].logprobs == [-0.5, -1.0]
    assert res.sequences[0].stop_reason == "stop" and res.sequences[0].text == "hi"


def test_optional_fields_and_sampler_id(server):
    server.route("POST", "/s/sync/sample", lambda r: Reply(200, completion()))
    sc = client(server, sampler_id="smp1")
    sc.sample(ModelInput.from_ints([5]), top_k=20, stop="\n", min_policy_version=0, prompt_logprobs=True)
    req = server.requests_to("POST", "/s/sync/sample")[0]
    assert req.json["top_k"] == 20 and req.json["stop"] == "\n" and req.json["prompt_logprobs"] == 0
    assert "max_tokens" not in req.json and "seed" not in req.json
    assert req.header("x-sampler-id") == "smp1" and req.header("x-run-id") is None
    assert req.header("x-min-policy-version") is None  # never sent as 0
    # a pinned checkpoint names its run: no X-Sampler-Id then
    sc.sample([1], checkpoint_path="bt://loops:r/sampler_weights/x")
    assert server.requests_to("POST", "/s/sync/sample")[1].header("x-sampler-id") is None


def test_408_behind_then_ok_reuses_key(server):
    server.script("POST", "/s/sync/sample", Reply(408), Reply(502), Reply(reset=True), Reply(503))
    server.route("POST", "/s/sync/sample", lambda r: Reply(200, completion()))
    sc = client(server, run_id="r")
    assert sc.sample([1], min_policy_version=2).sequences[0].tokens == [7, 8]
    keys = {r.header("idempotency-key") for r in server.requests_to("POST", "/s/sync/sample")}
    assert len(server.requests_to("POST", "/s/sync/sample")) == 5 and len(keys) == 1


def test_errors(server):
    server.script("POST", "/s/sync/sample", Reply(401, {"detail": "bad key"}), Reply(503), Reply(503),
                  Reply(200, completion(), delay=1.0))  # fmt: skip
    sc = client(server, run_id="r", timeout=0.3, max_unavailable_retries=1)
    with pytest.raises(AuthenticationError) as info:
        sc.sample([1])
    assert "sk-secret-123" not in str(info.value)
    with pytest.raises(ServerShutdownError):
        sc.sample([1])
    with pytest.raises(SampleTimeoutError):
        sc.sample([1])


def test_async_sample(server):
    server.script("POST", "/s/sync/sample", Reply(408))
    server.route("POST", "/s/sync/sample", lambda r: Reply(200, completion(), headers={"x-trainers-policy-version": "1"}))
    sc = client(server, run_id="r")

    async def go():
        try:
            return await asyncio.gather(*(sc.asample([1, 2], max_tokens=2) for _ in range(5)))
        finally:
            await sc.aclose()

    results = asyncio.run(go())
    assert len(results) == 5 and all(r.policy_version == 1 for r in results)
    assert len(server.requests_to("POST", "/s/sync/sample")) == 6


def test_queued_202_is_polled(server):
    server.route("POST", "/s/sync/sample", lambda r: Reply(202, {"operation_id": "op1", "schema_version": 1}))
    server.script("GET", "/s/sync/operations/op1", Reply(408))
    server.route("GET", "/s/sync/operations/op1", lambda r: Reply(200, {"status": "done", "result": completion()}))
    assert client(server, run_id="r").sample([1]).sequences[0].tokens == [7, 8]


def test_a_queued_sample_shares_the_trainers_long_poll(server):
    """WorkerClient._await_operation: "pending" is asked again after the poll interval, an
    op's error is RemoteOpError, an evicted result (410) OperationExpiredError."""
    from baseten_loops_cli.api.errors import OperationExpiredError, RemoteOpError

    server.route("POST", "/s/sync/sample", lambda r: Reply(202, {"operation_id": "op1", "schema_version": 1}))
    server.script("GET", "/s/sync/operations/op1", Reply(200, {"status": "pending"}), Reply(408),
                  Reply(200, {"status": "error", "error": "out of memory", "error_class": "EngineError"}))  # fmt: skip
    waits: list[float] = []
    with pytest.raises(RemoteOpError) as err:
        client(server, run_id="r", sleep=waits.append).sample([1])
    assert err.value.operation == "sample" and err.value.error_class == "EngineError" and "out of memory" in str(err.value)
    assert waits == [0.5]  # after "pending" only: a 408 was a held poll, asked again at once
    assert "idempotency-key" not in {k.lower() for k in server.requests_to("GET", "/s/sync/operations/op1")[0].headers}
    server.script("GET", "/s/sync/operations/op1", Reply(410))
    with pytest.raises(OperationExpiredError):
        client(server, run_id="r").sample([1])


def test_waiting_for_a_policy_version_ends_at_its_deadline(server):
    from baseten_loops_cli.api.errors import OperationTimeoutError

    server.route("GET", "/s/sync/trainers_policy_version", lambda r: Reply(200, {"policy_version": 2}))
    now = [0.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    sc = client(server, run_id="r", sleep=sleep, clock=lambda: now[0])
    with pytest.raises(OperationTimeoutError, match="still serves policy version 2 after 2s"):
        sc.wait_for_policy_version(3, timeout=2, interval=0.75)
    assert waits == [0.75, 0.75, 0.5] and len(server.requests_to("GET", "/s/sync/trainers_policy_version")) == 4


def test_models_and_policy_version(server):
    server.route("GET", "/s/sync/v1/models", lambda r: Reply(200, {"data": [{"id": "base", "parent": None}]}))
    server.route("GET", "/s/sync/trainers_policy_version", lambda r: Reply(200, {"policy_version": 4}))
    sc = client(server, run_id="r")
    assert sc.models() == [{"id": "base", "parent": None}]
    assert sc.trainers_policy_version() == 4
    assert sc.wait_for_policy_version(3) == 4


# -- pure parsing ---------------------------------------------------------------------------


def test_parse_token_ids_and_prefix_strip():
    payload = {
        "choices": [
            {"token_ids": [1, 2, 9], "logprobs": {"token_logprobs": [None, -1.0, -2.0]}, "finish_reason": "length",
             "prompt_token_ids": [1, 2]},
            {"logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.1]}, "finish_reason": "abort"},
        ]
    }  # fmt: skip
    res = parse_completions(payload, {}, prompt_token_ids=[1, 2])
    assert res.sequences[0].tokens == [9] and res.sequences[0].logprobs == [-2.0]
    assert res.sequences[0].stop_reason == "length"
    assert res.sequences[1].tokens == [9] and res.sequences[1].stop_reason == "length"
    assert res.prompt_token_ids == [1, 2] and res.policy_version is None
    assert parse_token_id("token_id:42") == 42 and parse_token_id(5) == 5


def test_parse_prompt_logprobs():
    plp = [None, {"5": {"logprob": -0.3, "rank": 1}, "6": {"logprob": -2.0, "rank": 2}}]
    payload = completion(prompt_logprobs=plp)
    res = parse_completions(payload, {"x-trainers-policy-version": "2"}, prompt_token_ids=[4, 5], include_topk_prompt_logprobs=True)
    assert res.prompt_logprobs == [None, -0.3]
    assert res.topk_prompt_logprobs == [None, [(5, -0.3), (6, -2.0)]]
    assert res.policy_version == 2


def test_build_body_matches_sdk_shape():
    body = build_sample_body([1], stop=["a", "b"], top_k=-1)
    assert body == {"prompt": [1], "n": 1, "temperature": 1.0, "top_p": 1.0, "logprobs": 0,
                    "return_tokens_as_token_ids": True, "stop": ["a", "b"]}  # fmt: skip
