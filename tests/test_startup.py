"""`loops --help`, `--version`, a command's `--help` and completion requests stay light: they
must not import httpx, pydantic, yaml, keyring or torch (each costs 50-150 ms, or seconds for
torch, and completion runs on every TAB); no synchronous command imports asyncio (~15 ms).
`bench/startup.py` measures the time itself."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("httpx", "pydantic", "yaml", "keyring", "torch", "asyncio")

# Runs the real entry point and, at exit (after main()'s sys.exit), writes the top-level names
# of the heavy modules that got imported. LOOPS_TEST_PREIMPORT imports one first (the control).
WRAPPER = f"""
import atexit, json, os, sys
HEAVY = {HEAVY!r}
def _report():
    # A None entry is an import blocked on purpose (httpx._main), not a loaded module.
    loaded = sorted({{name.split(".")[0] for name, mod in list(sys.modules.items()) if mod is not None}} & set(HEAVY))
    with open(os.environ["LOOPS_TEST_MODULES_OUT"], "w") as fh:
        json.dump(loaded, fh)
atexit.register(_report)
if os.environ.get("LOOPS_TEST_PREIMPORT"):
    __import__(os.environ["LOOPS_TEST_PREIMPORT"])
sys.path.insert(0, {str(ROOT)!r})
sys.argv = ["loops", *sys.argv[1:]]
from baseten_loops_cli.cli.main import main
main()
"""


@pytest.fixture
def run(tmp_path):
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("LOOPS_", "BASETEN_", "_LOOPS_", "_TYPER_", "COMP_"))}
    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        base[f"LOOPS_{name}_DIR"] = str(tmp_path / name.lower())
    base["LOOPS_NO_AUTOSTART"] = "1"
    calls = itertools.count()

    def _run(*args: str, **extra_env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        out = tmp_path / f"modules-{next(calls)}.json"  # a file per call: calls may overlap
        env = {**base, "LOOPS_TEST_MODULES_OUT": str(out), **extra_env}
        result = subprocess.run([sys.executable, "-c", WRAPPER, *args], env=env,
                                capture_output=True, text=True, timeout=120)
        assert out.exists(), f"the wrapper did not report (rc {result.returncode}): {result.stderr}"
        return result, json.loads(out.read_text())

    return _run


def test_the_check_sees_a_heavy_import(run):
    _, loaded = run("--version", LOOPS_TEST_PREIMPORT="yaml")
    assert loaded == ["yaml"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--help"], "Usage: loops"),
        (["--version"], "loops "),
        (["completion", "--help"], "Usage: loops completion"),
        (["-o", "json", "--profile", "x", "--help"], "Usage: loops"),
    ],
)
def test_help_and_version_import_nothing_heavy(run, args, expected):
    result, loaded = run(*args)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
    assert loaded == [], f"`loops {' '.join(args)}` imported {loaded}"


def test_runs_list_help_imports_nothing_heavy(run):
    result, loaded = run("runs", "list", "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: loops runs list" in result.stdout
    assert loaded == [], f"`loops runs list --help` imported {loaded}"


@pytest.mark.parametrize("args", [
    ["runs", "list", "-o", "json"],
    ["train", "run", str(ROOT / "examples" / "tiny-sft.yaml"), "--dry-run", "-o", "json"],
], ids=["runs-list", "sft-plan"])
def test_synchronous_commands_do_not_import_asyncio(run, args):
    """Only async code paths (RL, eval, sampling many prompts) import asyncio, where they run.
    Nothing listens on the port: the command fails after its imports, which is what is checked."""
    result, loaded = run(*args, LOOPS_BASE_URL="http://127.0.0.1:9", BASETEN_API_KEY="test-key")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "httpx" in loaded, loaded  # the command got as far as its API client
    assert "asyncio" not in loaded, f"`loops {' '.join(args)}` imported asyncio"


def test_every_command_help_imports_nothing_heavy(run):
    """Each group's and command's --help: catches a heavy import at the top of any cli module.
    (The processes run a few at a time: one after another they took 10 s of CI.)"""
    from concurrent.futures import ThreadPoolExecutor

    import typer.main

    from baseten_loops_cli.cli.main import app

    commands: list[list[str]] = []

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            commands.append([*path, name])
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    assert len(commands) > 20, commands
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda args: run(*args, "--help"), commands))
    offenders = {" ".join(args): loaded or result.stderr.strip()[-200:]
                 for args, (result, loaded) in zip(commands, results) if result.returncode != 0 or loaded}
    assert not offenders, f"--help of these commands imported heavy modules or failed: {offenders}"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"_LOOPS_COMPLETE": "complete_bash", "COMP_WORDS": "loops ru", "COMP_CWORD": "1"}, "runs"),
        ({"_LOOPS_COMPLETE": "complete_bash", "COMP_WORDS": "loops config ", "COMP_CWORD": "2"}, "list"),
        ({"_LOOPS_COMPLETE": "complete_bash", "COMP_WORDS": "loops completion show ", "COMP_CWORD": "3"}, "zsh"),
        ({"_LOOPS_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "loops ru"}, "runs"),
        ({"_LOOPS_COMPLETE": "complete_fish", "_TYPER_COMPLETE_ARGS": "loops ru",
          "_TYPER_COMPLETE_FISH_ACTION": "get-args"}, "runs"),
        # A command with typed options (defaults are not coerced while completing) and a dynamic
        # argument; no server is running here, so there is nothing to offer and nothing to fetch.
        ({"_LOOPS_COMPLETE": "complete_bash", "COMP_WORDS": "loops runs describe ", "COMP_CWORD": "3"}, None),
    ],
    ids=["bash-command", "bash-subcommand", "bash-choice", "zsh", "fish", "bash-run-id-no-server"],
)
def test_completion_requests_import_nothing_heavy(run, env, expected):
    result, loaded = run(**env)
    assert result.returncode == 0, result.stderr
    if expected is not None:
        assert expected in result.stdout, result.stdout
    else:  # nothing to offer; were `runs describe` gone, the runs subcommands would be offered
        assert result.stdout.strip() == "", result.stdout
    assert loaded == [], f"a completion request ({env}) imported {loaded}"
