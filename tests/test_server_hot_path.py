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
