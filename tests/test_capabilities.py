"""Backends answer `capabilities` (settings/connection.py); commands and services ask them, never
the kind's name, so a third kind of backend is one row of the table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from baseten_loops_cli.settings.connection import CAPABILITIES, Capabilities, capabilities_of

ROOT = Path(__file__).resolve().parent.parent


def test_every_kind_answers_every_question_and_an_unknown_kind_is_a_remote_service():
    fields = {f.name for f in dataclasses.fields(Capabilities)}
    assert set(CAPABILITIES) == {"local", "baseten"}
    for name in fields:  # each question is documented where it is asked
        assert f"``{name}``" in (Capabilities.__doc__ or ""), name
    local, remote = capabilities_of("local"), capabilities_of("baseten")
    assert local.local_server and not local.billable and local.default_instance_type == "local-cpu"
    assert remote.billable and remote.gpu_allocations and not remote.local_server and remote.default_instance_type is None
    assert capabilities_of("some-future-kind") == remote


def test_commands_and_services_ask_capabilities_not_the_backend_kind():
    pattern = re.compile(r"""kind\s*[!=]=\s*["']local["']""")
    found = [f"{path.relative_to(ROOT)}:{n}"
             for folder in ("cli", "services", "training")  # training's rooms included
             for path in sorted((ROOT / "baseten_loops_cli" / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]  # fmt: skip
    assert not found, found
