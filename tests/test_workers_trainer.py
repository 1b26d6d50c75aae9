"""TrainerClient against a real local HTTP server (tests/fault_server.py)."""

from __future__ import annotations

import threading

import pytest
from fault_server import FakeTrainer, FaultServer, Reply

from baseten_loops_cli.api.errors import (
    BadRequestError,
    OperationTimeoutError,
    PolicyVersionUnavailableError,
    RemoteOpError,
    ServerShutdownError,
    UnknownOperationError,
)
from baseten_loops_cli.workers import AdamParams, Datum, ModelInput, TensorData, TrainerClient


@pytest.fixture
def server():
    srv = FaultServer()
    yield srv
    srv.close()


@pytest.fixture
def trainer(server):
    return FakeTrainer(server, pending_polls=1)


def make_client(server, **kw) -> TrainerClient:
    kw.setdefault("sleep", lambda s: None)
    return TrainerClient(f"{server.url}/trainer", api_key="sk-secret-123", run_id="run1", base_model="m/x", **kw)


def datum() -> Datum:
    return Datum(
        model_input=ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": TensorData(data=[2, 3, 4], dtype="int64", shape=[3])},
    )


def test_submit_body_headers_and_long_poll(server, trainer):
    tc = make_client(server)
    fut = tc.forward_backward([datum()], loss_fn="cross_entropy")
    assert fut.result() == {"op": "forward_backward", "seq_id": 1}
    post = server.requests_to("POST", "/trainer/forward_backward")[0]
    body = post.json
    assert body["model"] == "m/x" and body["run_id"] == "run1" and body["seq_id"] == 1
    assert body["loss_fn"] == "cross_entropy" and body["loss_fn_config"] is None and body["top_k_logprobs"] == 0
    assert body["data"] == [datum().model_dump(mode="json")]
    assert post.header("authorization") == "Api-Key sk-secret-123"
    assert post.header("x-run-id") == "run1"
    assert post.header("x-baseten-accept-error") == "1"
    assert len(post.header("idempotency-key")) == 32  # uuid4 hex
    polls = server.requests_to("GET", "/trainer/operations/*")
    assert len(polls) == 2  # one 408 (still pending), then 200 done
    assert all(p.header("x-run-id") == "run1" for p in polls)
    assert fut.done() and fut.result() is fut.result()  # cached, no re-poll
    assert len(server.requests_to("GET", "/trainer/operations/*")) == 2


def test_pipelining_and_seq_order(server, trainer):
    tc = make_client(server)
    fb = tc.forward_backward([datum()])
    opt = tc.optim_step(AdamParams(learning_rate=1e-3))
    # both submitted before either result is awaited
    assert [op for op, _, _ in trainer.applied] == ["forward_backward", "optim_step"]
    assert opt.result()["seq_id"] == 2 and fb.result()["seq_id"] == 1
    body = server.requests_to("POST", "/trainer/optim_step")[0].json
    assert body["adam_params"] == {
        "learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0,
    }


def test_concurrent_submits_arrive_in_seq_order(server, trainer):
    tc = make_client(server)
    futs, lock = [], threading.Lock()

    def work():
        for _ in range(10):
            f = tc.forward([datum()])
            with lock:
                futs.append(f)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [seq for _, seq, _ in trainer.applied]
    assert seqs == list(range(1, 41))  # server saw them in seq order, no gaps
    assert sorted(f.seq_id for f in futs) == list(range(1, 41))


def test_submit_retries_reuse_idempotency_key(server, trainer):
    server.script("POST", "/trainer/optim_step", Reply(reset=True), Reply(502), Reply(503, headers={"Retry-After": "0"}))
    tc = make_client(server)
    fut = tc.optim_step()
    assert fut.result()["op"] == "optim_step"
    posts = server.requests_to("POST", "/trainer/optim_step")
    assert len(posts) == 4
    assert len({p.header("idempotency-key") for p in posts}) == 1
    assert len(trainer.applied) == 1 and trainer.policy_version == 1


def test_duplicate_submit_is_applied_once(server, trainer):
    # The first POST reaches the server but its response is lost (the server applies it,
    # then the connection is reset); the retry with the same key must be deduped.
    calls = {"n": 0}

    def flaky(req):
        reply = trainer._submit(req)
        calls["n"] += 1
        return Reply(reset=True) if calls["n"] == 1 else reply

    server.route("POST", "/trainer/save_state", flaky)
    server._routes.insert(0, server._routes.pop())  # before the FakeTrainer's catch-all
    tc = make_client(server)
    tc.save_state("step-1").result()
    assert [op for op, _, _ in trainer.applied] == ["save_state"]
    assert len(trainer.distinct_keys) == 1


def test_poll_404_resubmits_once_with_same_key(server, trainer):
    trainer.pending_polls = 0
    tc = make_client(server)
    fut = tc.save_weights_for_sampler("s1")
    key = fut.idempotency_key
    trainer.forget()  # server restart: it no longer knows the operation
    assert fut.result()["op"] == "save_weights_for_sampler"
    posts = server.requests_to("POST", "/trainer/save_weights_for_sampler")
    assert [p.header("idempotency-key") for p in posts] == [key, key]
    assert posts[0].json == posts[1].json  # same seq_id and body
    assert posts[0].json["bump_version"] is False and posts[0].json["ttl_seconds"] is None


def test_poll_404_twice_raises(server, trainer):
    server.script("GET", "/trainer/operations/*", Reply(404), Reply(404))
    tc = make_client(server)
    with pytest.raises(UnknownOperationError):
        tc.forward([datum()]).result()


def test_poll_transient_502_and_reset_then_done(server, trainer):
    server.script("GET", "/trainer/operations/*", Reply(502), Reply(reset=True), Reply(408))
    sleeps = []
    tc = make_client(server, sleep=sleeps.append, poll_backoff=0.01)
    assert tc.forward([datum()]).result()["op"] == "forward"
    # 408 re-polls at once; the 502 and the reset back off (jittered, capped at poll_backoff).
    assert len(sleeps) == 2 and all(0 <= s <= 0.01 for s in sleeps), sleeps


def test_poll_503_blip_survived_persistent_is_shutdown(server, trainer):
    trainer.pending_polls = 0
    server.script("GET", "/trainer/operations/*", Reply(503), Reply(503))
    tc = make_client(server, max_unavailable_retries=2)
    assert tc.forward([datum()]).result()["op"] == "forward"
    server.route("GET", "/trainer/operations/*", lambda r: Reply(503))
    server._routes.insert(0, server._routes.pop())
    with pytest.raises(ServerShutdownError):
        tc.forward([datum()]).result()
    assert len(server.requests_to("GET", "/trainer/operations/*")) == 3 + 3


def test_submit_503_without_retry_after(server, trainer):
    server.script("POST", "/trainer/forward", Reply(503), Reply(503))
    tc = make_client(server, max_unavailable_retries=2)
    fut = tc.forward([datum()])  # a short blip is survived, same key
    assert len({r.header("idempotency-key") for r in server.requests_to("POST", "/trainer/forward")}) == 1
    assert len(trainer.applied) == 1 and fut.result()["op"] == "forward"
    server.script("POST", "/trainer/forward", *[Reply(503)] * 3)
    with pytest.raises(ServerShutdownError):
        tc.forward([datum()])


def test_remote_error(server, trainer):
    trainer.errors["forward_backward"] = ("bad tokens", "EngineInputError")
    fut = make_client(server).forward_backward([datum()])
    with pytest.raises(RemoteOpError) as info:
        fut.result()
    err = info.value
    assert err.error_class == "EngineInputError" and err.operation == "forward_backward"
    assert err.operation_id == fut.operation_id and "bad tokens" in str(err)
    with pytest.raises(RemoteOpError):  # cached
        fut.result()


def test_engine_400_after_warm_is_not_retried(server, trainer):
    tc = make_client(server)
    tc.forward([datum()]).result()
    server.script("POST", "/trainer/forward_backward", Reply(400, {"detail": "sequence too long", "error_class": "EngineInputError"}))
    with pytest.raises(BadRequestError) as info:
        tc.forward_backward([datum()])
    assert "sequence too long" in str(info.value) and info.value.error_class == "EngineInputError"


def test_cold_start_404_is_retried(server, trainer):
    server.script("POST", "/trainer/init_trainer_server", Reply(404, body=b"not found"), Reply(400, {"error": "model is loading"}))
    tc = make_client(server)
    assert tc.init_trainer_server(16).result()["op"] == "init_trainer_server"
    body = server.requests_to("POST", "/trainer/init_trainer_server")[-1].json
    assert body["lora_rank"] == 16 and body["base_model"] == "m/x"


def test_result_timeout(server, trainer):
    trainer.pending_polls = 10**6
    server.route("GET", "/trainer/operations/slow", lambda r: Reply(408, delay=0.05))
    tc = make_client(server, poll_hold_timeout=0.2)
    fut = tc.forward([datum()])
    with pytest.raises(OperationTimeoutError):
        fut.result(timeout=0.3)
    assert not fut.done()  # a timeout is not cached: the op may still finish


def test_load_state_paths(server, trainer):
    tc = make_client(server)
    tc.load_state("bt://loops:r/weights/a").result()
    tc.load_state("bt://loops:r/weights/a", with_optimizer=True).result()
    assert [op for op, _, _ in trainer.applied] == ["load_state", "load_state_with_optimizer"]
    assert server.requests_to("POST", "/trainer/load_state")[0].json["path"] == "bt://loops:r/weights/a"


def test_health_and_policy_version(server, trainer):
    tc = make_client(server)
    assert tc.health() == {"status": "ok"}
    assert server.requests_to("GET", "/trainer/health")[0].query == {"base_model": ["m/x"]}
    tc.optim_step().result()
    assert tc.policy_version() == 1
    server.script("GET", "/trainer/policy_version", Reply(501))
    with pytest.raises(PolicyVersionUnavailableError):
        tc.policy_version()


def test_parsed_result(server, trainer):
    trainer.results["forward_backward"] = {"loss": 1.5, "metrics": {"loss:sum": 3.0}, "extra": 1}
    out = make_client(server).forward_backward([datum()]).parsed()
    assert out.loss == 1.5 and out.metrics == {"loss:sum": 3.0}


def test_await_future(server, trainer):
    import asyncio

    tc = make_client(server)

    async def go():
        return await tc.forward([datum()])

    assert asyncio.run(go())["op"] == "forward"


def test_plain_gets_are_retried(server, trainer):
    server.script("GET", "/trainer/policy_version", Reply(503), Reply(reset=True), Reply(502))
    server.script("GET", "/trainer/health", Reply(408))
    tc = make_client(server)
    assert tc.policy_version() == 0
    assert tc.health() == {"status": "ok"}
