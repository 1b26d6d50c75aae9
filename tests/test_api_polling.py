"""The one polling helper (api/polling.py) and the waits built on it: attempts at once, then every
interval, the last one at the deadline, never a wait past it; services wait through it with an
injected sleep (never time.sleep of their own)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from fault_server import FaultServer, Reply

from baseten_loops_cli.api.polling import Poll
from baseten_loops_cli.errors import LoopsError

ROOT = Path(__file__).resolve().parent.parent


class FakeTime:
    """A clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def test_attempts_come_every_interval_and_the_last_at_the_deadline():
    t = FakeTime()
    poll = Poll(interval=2.0, timeout=5.0, sleep=t.sleep, clock=t.clock)
    at = [t.now - 100.0 for _ in poll]
    assert at == [0.0, 2.0, 4.0, 5.0]  # the wait before the last is cut to the deadline
    assert t.waits == [2.0, 2.0, 1.0] and poll.attempts == 4 and poll.expired and poll.remaining() == 0.0


def test_again_skips_one_wait_and_no_deadline_runs_until_the_caller_stops():
    t = FakeTime()
    poll = Poll(interval=1.0, sleep=t.sleep, clock=t.clock)
    for attempt in poll:
        if attempt == 2:
            poll.again()  # e.g. a held long-poll answered 408: ask again at once
        if attempt == 4:
            break
    assert t.waits == [1.0, 1.0] and poll.remaining() == float("inf") and poll.elapsed() == 2.0


def test_a_poll_of_no_time_still_asks_once():
    t = FakeTime()
    assert list(Poll(interval=1.0, timeout=0, sleep=t.sleep, clock=t.clock)) == [1] and t.waits == []


def test_a_deployment_that_never_becomes_active_fails_at_its_deadline():
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.services.deployments import DeploymentInfo, wait_active

    srv = FaultServer()
    srv.route("GET", "/v1/models/m1/deployments/d1", lambda r: Reply(200, {"id": "d1", "status": "DEPLOYING"}))
    t = FakeTime()
    statuses: list[str] = []
    info = DeploymentInfo(model_id="m1", deployment_id="d1", url="http://x/v1", curl="curl")
    try:
        with LoopsClient(srv.url, "k") as client, pytest.raises(LoopsError) as err:
            wait_active(SimpleNamespace(client=client), info, on_status=statuses.append, interval=2.0, timeout=7.0,
                        sleep=t.sleep, clock=t.clock)  # fmt: skip
    finally:
        srv.close()
    assert str(err.value) == "deployment d1 is still DEPLOYING after 7s"
    assert "loops deploy describe m1/d1" in (err.value.hint or "")
    assert statuses == ["Deployment d1: DEPLOYING"] and t.waits == [2.0, 2.0, 2.0, 1.0]
    assert len(srv.requests_to("GET", "/v1/models/m1/deployments/d1")) == 5


def test_services_wait_only_through_an_injected_sleep():
    calls = {path.name: re.findall(r"\btime\.sleep\(", path.read_text())
             for path in (ROOT / "baseten_loops_cli" / "services").glob("*.py")}  # fmt: skip
    assert not {name: found for name, found in calls.items() if found}
