"""The official SDK (baseten-loops 0.32.0) drives the local server end to end.

The SDK needs Python >= 3.12 and heavy dependencies, so it lives in its own venv:
``LOOPS_SDK_PYTHON`` (its interpreter) or ``/work/sdkvenv`` (made by
``scripts/install_sdk_venv.sh``). Without one this test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import LocalServer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SDK_PYTHON = Path("/work/sdkvenv/bin/python")


def sdk_python() -> str | None:
    candidate = os.environ.get("LOOPS_SDK_PYTHON") or (
        str(DEFAULT_SDK_PYTHON) if DEFAULT_SDK_PYTHON.exists() else None)
    if candidate is None:
        return None
    probe = subprocess.run([candidate, "-c", "import baseten.loops"], capture_output=True,
                           timeout=120)
    return candidate if probe.returncode == 0 else None


@pytest.mark.local
def test_official_sdk_quickstart_against_local_server(local_server: LocalServer):
    python = sdk_python()
    if python is None:
        pytest.skip("no SDK venv (set LOOPS_SDK_PYTHON or run scripts/install_sdk_venv.sh)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_"))}
    env.update(LOOPS_BASE_URL=local_server.url, BASETEN_API_KEY=local_server.token,
               WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONPATH="")
    proc = subprocess.run([python, str(REPO / "scripts" / "sdk_compat.py"), "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    failed = [s["name"] for s in summary.get("steps", []) if s["outcome"] == "FAILED"]
    assert proc.returncode == 0 and summary.get("ok"), (
        f"SDK flow failed at {failed}:\n{proc.stderr[-6000:]}")
    assert summary["policy_version"] == 3
    assert ("default", "sampler") in [tuple(c) for c in summary["checkpoints"]]
    assert summary["downloaded"]["bytes"] > 0
