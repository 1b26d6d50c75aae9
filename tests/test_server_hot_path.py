"""The trainer protocol's hot path on the real local server: a long-poll answers the moment
its op finishes (not when the hold runs out), and a result answered from memory is the one
a retried poll later reads from the database."""

from __future__ import annotations

import time

import pytest
from test_local_server import DATA, new_run

pytest.importorskip("torch")
pytestmark = pytest.mark.local


def test_long_poll_wakes_when_the_op_finishes_and_retried_polls_agree(server_factory):
    server = server_factory(op_poll_hold_s=60.0)
    with server.client(timeout=120) as client:
        trainer = new_run(client)
        run_id = trainer.run["id"]
        client.post("/v1/local/faults", json={"job": f"forward_backward {run_id}", "delay_s": 1.0})
        op_id = trainer.submit("forward_backward", {"data": DATA, "loss_fn": "cross_entropy"}).json()["operation_id"]
        started = time.monotonic()
        first = trainer.poll(op_id)
        waited = time.monotonic() - started
        assert first.status_code == 200 and first.json()["status"] == "done", first.text
        # Held while the op ran (>= its 1 s delay, minus submit time), answered long before the 60 s hold.
        assert 0.5 <= waited < 30, waited
        again = trainer.poll(op_id)  # e.g. the first answer was lost: read back from the database
        assert again.status_code == 200 and again.json() == first.json()
        outputs = first.json()["result"]["loss_fn_outputs"]
        assert len(outputs) == len(DATA)


# ── Nagle's algorithm is off on the server's connections ──
# A response written in two pieces (headers, then body) waits for the client's delayed ACK when
# Nagle is on: 40 ms per request on Linux, which made every trainer op and poll cost 44 ms on
# 127.0.0.1. (httpcore turns it off on the client's side.) Checked on the socket, not by timing.


def test_the_server_turns_nagle_off_on_every_accepted_connection():
    import asyncio
    import socket

    from baseten_loops_cli.local.daemon import listen

    async def accepted_nodelay() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):  # how uvicorn's protocol receives it
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = listen(0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0



# ── the janitor's sweeps read indexes, not finished rows ──
# Every janitor tick (0.5 s, on the event loop) expires results older than an hour. With an
# index on status alone, SQLite read every finished row of the last hour to test finished_at,
# which lies behind the result blob: ~30 ms per 10,000 ops, so a long run's server stalled
# more with every op. Checked on the query plans of the statements a sweep executes.


def test_the_janitor_sweeps_search_by_finish_time_in_an_index(tmp_path):
    import sqlite3

    from baseten_loops_cli.local.server.operations import OperationRegistry
    from baseten_loops_cli.local.store import Store

    store = Store(tmp_path / "ops.db")
    ops = OperationRegistry(store, result_ttl_s=3600, idempotency_window_s=86400)
    for i in range(50):
        ops.create("run1", "forward_backward", f"key-{i}", i)
        ops.finish("run1", f"key-{i}", result={"loss_fn_outputs": [{"logprobs": [-1.5] * 2000}]})
    statements: list[str] = []
    store._conn().set_trace_callback(statements.append)
    ops.expire(time.time())
    store._conn().set_trace_callback(None)
    sweeps = [s for s in statements if s.lstrip().upper().startswith(("UPDATE", "DELETE"))]
    assert len(sweeps) == 2, statements  # expire the results, purge the records
    with sqlite3.connect(tmp_path / "ops.db") as db:
        for sql in sweeps:
            plan = " ".join(row[-1] for row in db.execute("EXPLAIN QUERY PLAN " + sql))
            assert "INDEX" in plan and "finished_at<" in plan, (sql, plan)
    store.close()


# ── an op's bookkeeping is one transaction; its result is encoded once ──


def test_writes_inside_a_store_transaction_commit_together(tmp_path):
    """The writes an op's end makes (usage, run, op row, log) join one transaction: one commit
    between two ops of a run, and all or nothing."""
    from baseten_loops_cli.local.store import Store

    store = Store(tmp_path / "tx.db")
    session = store.create_session(None, None)
    run = store.create_run(session_id=session.id, team_id=None, name="tx", base_model="m", lora_rank=4,
                           max_seq_len=64, seed=1, scale_down_delay_seconds=60, availability_model="x",
                           replicas=1, init_path=None)

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with store.transaction():
            store.add_usage(run.id, "run", compute_seconds=1.0, operations=1)
            store.update_run(run.id, policy_version=7)
            raise Boom
    assert store.get_run(run.id).policy_version == 0
    assert store.get_usage(run.id) is None or store.get_usage(run.id).operations == 0
    with store.transaction():
        store.add_usage(run.id, "run", compute_seconds=1.0, operations=1)
        store.update_run(run.id, policy_version=7)
        with pytest.raises(ValueError):  # a nested write that fails undoes only its own work
            with store.transaction():
                store.update_run(run.id, lora_rank=8)
                raise ValueError("nested")
    assert store.get_run(run.id).policy_version == 7 and store.get_usage(run.id).operations == 1
    assert store.get_run(run.id).lora_rank == 4
    store.close()


def test_an_op_result_is_compact_json_and_a_diverged_loss_still_answers():
    import json
    import math

    from baseten_loops_cli.local.server.operations import encode_result

    assert encode_result({"loss": 0.5, "name": "é"}) == '{"loss":0.5,"name":"é"}'
    text = encode_result({"metrics": {"loss": float("nan")}})  # was a 500 on every poll
    assert math.isnan(json.loads(text)["metrics"]["loss"])


# ── Thread budgets: a server that has sampled trains with the threads of a fresh one ──
# torch.set_num_threads is per thread, but it also stores a process-wide value that a thread's
# first torch call adopts. Lanes that halved their budget while both were busy used to leave
# that value at half, so every thread started afterwards (another model's lanes, which took it
# as their whole budget for good) ran on half the cores (issue 33). Checked on the settings.

def _threads_now() -> tuple[int, int, int]:
    import re

    import torch

    info = torch.__config__.parallel_info()  # this thread's settings
    read = lambda key: int(re.search(re.escape(key) + r" : (\d+)", info).group(1))  # noqa: E731
    return torch.get_num_threads(), read("omp_get_max_threads()"), read("mkl_get_max_threads()")


def test_thread_budget_is_restored_after_overlapping_lanes(monkeypatch):
    import threading

    from baseten_loops_cli.local.server import compute

    monkeypatch.setattr(compute, "_process_threads", 2)  # a budget that halves, on any machine
    worker = compute.ModelWorker(compute.Engine(), "thread-test")
    try:
        release = threading.Event()
        sampling = worker.submit("sample", lambda: (release.wait(30), _threads_now())[1], compute.SAMPLE)
        time.sleep(0.2)  # the sample lane is busy: a training job gets half
        assert worker.submit("train", _threads_now, compute.TRAIN).result(30)[0] == 1
        release.set()
        assert sampling.result(30) == (2, 2, 2)  # it started alone
        assert worker.submit("train", _threads_now, compute.TRAIN).result(30) == (2, 2, 2)
        # A thread that first touches torch now, and a second model's worker, get it all.
        seen: list = []
        fresh = threading.Thread(target=lambda: seen.append(_threads_now()))
        fresh.start()
        fresh.join(30)
        assert seen == [(2, 2, 2)]
        other = compute.ModelWorker(compute.Engine(), "thread-test-2")
        try:
            assert other.submit("train", _threads_now, compute.TRAIN).result(30) == (2, 2, 2)
        finally:
            other.stop(10)
    finally:
        release.set()
        worker.stop(10)


# GNU OpenMP keeps a worker pool for every thread that ran a multi-threaded region until that
# thread exits, and throttles every pool's spin-wait once pools outnumber the CPUs: a server
# whose sample lane had run alone with two threads trained 1.2x slower afterwards (issue 33,
# bench/after_rl.py). So at most one lane thread holds a pool; checked on the OS threads.

def _os_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _settled_os_threads() -> int:
    """The thread count once it has not changed for 0.2 s (threads of earlier tests, and their
    OpenMP workers, finish exiting after the join)."""
    last, since = _os_threads(), time.monotonic()
    while time.monotonic() - since < 0.2:
        time.sleep(0.02)
        now = _os_threads()
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_only_one_lane_thread_keeps_an_openmp_pool(monkeypatch):
    import threading

    import torch

    from baseten_loops_cli.local.server import compute
    from support import wait_for

    def parallel(wait: threading.Event | None = None):
        if wait is not None:
            wait.wait(30)
        torch.ones(1 << 21).exp_()  # big enough for ATen to run it on the OpenMP team
        return threading.current_thread()

    monkeypatch.setattr(compute, "_process_threads", 2)
    worker = compute.ModelWorker(compute.Engine(), "pool-test")
    try:
        # Alone, each lane runs with both threads; the next lane to do so retires the other.
        without_pools = _settled_os_threads()
        sampler = worker.submit("sample", parallel, compute.SAMPLE).result(30)
        assert _os_threads() == without_pools + 1  # the sample lane's OpenMP worker
        trainer = worker.submit("train", parallel, compute.TRAIN).result(30)
        sampler.join(10)
        assert not sampler.is_alive() and worker._lanes[compute.SAMPLE].thread.is_alive()
        # The retired thread took its OpenMP worker with it: one pool's worker is left.
        wait_for(lambda: _os_threads() == without_pools + 1, timeout=10, interval=0.05,
                 what="the retired lane's OpenMP pool to exit")
        again = worker.submit("train", parallel, compute.TRAIN).result(30)
        assert again is trainer  # a lane working alone keeps its thread

        # A job starting beside a busy lane that has every thread (oversubscribed: two on one
        # core here) starts a second pool, so OpenMP throttles the busy one's spin-waits; a
        # pooled lane that finishes while another lane is busy retires its own thread.
        release_train, release_sample = threading.Event(), threading.Event()
        training = worker.submit("train", lambda: parallel(release_train), compute.TRAIN)
        time.sleep(0.2)
        sampling = worker.submit("sample", lambda: parallel(release_sample), compute.SAMPLE)
        wait_for(lambda: _os_threads() == without_pools + 2, timeout=10, interval=0.05,
                 what="a second OpenMP pool while the lanes overlap")
        release_train.set()
        assert training.result(30) is trainer
        trainer.join(10)
        assert not trainer.is_alive()
        release_sample.set()
        sampling.result(30)
        assert worker.submit("train", parallel, compute.TRAIN).result(30).is_alive()
    finally:
        worker.stop(10)


def test_a_running_job_halves_its_threads_when_the_other_lane_starts_and_takes_them_back(monkeypatch):
    """The share is decided again at the engine's checkpoints (engine/thread_budget.py), not
    only when a job starts: async RL's training job starts alone a few milliseconds before the
    sample job it overlaps, and kept both cores beside it."""
    import threading

    from baseten_loops_cli.local.engine import thread_budget
    from baseten_loops_cli.local.server import compute
    from support import wait_for

    monkeypatch.setattr(compute, "_process_threads", 2)
    worker = compute.ModelWorker(compute.Engine(), "redecide-test")
    sample_lane = worker._lanes[compute.SAMPLE]
    try:
        sampling, finish_sample = threading.Event(), threading.Event()
        seen: list[int] = []

        def sample() -> int:
            sampling.set()
            finish_sample.wait(30)
            return _threads_now()[0]

        def train() -> list[int]:
            seen.append(_threads_now()[0])  # started alone
            sample_job = worker.submit("sample", sample, compute.SAMPLE)
            sampling.wait(30)
            thread_budget.checkpoint()
            seen.append(_threads_now()[0])  # beside the sampler
            finish_sample.set()
            seen.append(sample_job.result(30))
            wait_for(lambda: not sample_lane.busy, timeout=10, interval=0.01, what="the sample lane to go idle")
            thread_budget.checkpoint()
            seen.append(_threads_now()[0])  # alone again
            return seen

        assert worker.submit("train", train, compute.TRAIN).result(30) == [2, 1, 1, 2]
        # Outside a lane's job a checkpoint decides nothing.
        thread_budget.checkpoint()
    finally:
        finish_sample.set()
        worker.stop(10)
