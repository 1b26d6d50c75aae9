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

