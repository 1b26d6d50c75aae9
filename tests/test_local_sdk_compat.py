"""The official SDK (baseten-loops 0.32.0) drives the local server end to end.

The SDK needs Python >= 3.12 and heavy dependencies, so it lives in its own venv, made by
``scripts/install_sdk_venv.sh`` in the test cache, or named by ``LOOPS_SDK_PYTHON``
(tests/external.py). Without one this test skips, which fails CI.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import LocalServer
from tests.external import sdk_run_env

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.local
@pytest.mark.required_in_ci
def test_official_sdk_quickstart_against_local_server(local_server: LocalServer):
    python, env = sdk_run_env(local_server.url, local_server.token)
    proc = subprocess.run([python, str(REPO / "scripts" / "sdk_compat.py"), "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    failed = [s["name"] for s in summary.get("steps", []) if s["outcome"] == "FAILED"]
    assert proc.returncode == 0 and summary.get("ok"), (
        f"SDK flow failed at {failed}:\n{proc.stderr[-6000:]}")
    assert summary["policy_version"] == 3
    assert ("default", "sampler") in [tuple(c) for c in summary["checkpoints"]]
    assert summary["downloaded"]["bytes"] > 0
