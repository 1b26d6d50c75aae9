"""Helpers for the CLI tests of runs, samplers, checkpoints, usage, deploy and sample.

``loops(server, *args)`` runs the real entry point (``cli.main.main``: global-option hoisting,
``deploy`` default subcommand, error -> exit-code mapping) in process, against the session's
local server, and returns stdout, stderr and the exit code. ``loops_subprocess`` does the same in
a child process, for what must be checked end to end (progress bars, signals, imports).

``seeded`` (session fixture) is one run on ``loops-local/tiny`` (LoRA rank 16) trained for
:data:`SEEDED_STEPS` steps on one chat example until it answers :data:`QUESTION` with
:data:`SECRET`; a sampler checkpoint ``s1`` and a trainer checkpoint ``t1`` are saved after step
1, and a sampler checkpoint ``s2`` plus a trainer checkpoint ``s2`` (the same name, on purpose)
after the last step. Sampler saves are published to the run's paired sampler.

``kill_once_then_resume`` (with ``start_loops``, ``trained_steps``) is the SIGKILL +
`loops train resume` harness of the SFT and DPO reliability tests. The environment of every run
is ``support.cli_env``; waits are ``support.wait_for``, kills ``support.kill``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import FOREIGN_PREFIXES, ROOT, cli_env, kill, wait_for

TINY = "loops-local/tiny"
__all__ = ["ROOT", "TINY", "cli_env", "kill", "wait_for"]  # re-exported: tests import them from here too


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()

    def __repr__(self) -> str:  # shown by pytest when an assert fails
        return f"Result(code={self.code})\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def loops(server, *args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
    """Run ``loops ARGS`` in process (stdin is not a terminal)."""
    from typer.testing import CliRunner

    from baseten_loops_cli.cli.main import main

    runner = CliRunner()
    # The isolation sets what it is given: clear this process's LOOPS_* (and kin) explicitly.
    full_env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(FOREIGN_PREFIXES)}
    full_env.update({k: (v or None) for k, v in cli_env(server, **(env or {})).items()})
    with runner.isolation(input=input, env=full_env) as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return Result(code, stdout, stderr)


def loops_subprocess(server, *args: str, input: str | None = None, env: dict[str, str] | None = None,
                     timeout: float = 120) -> Result:
    proc = subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=cli_env(server, **(env or {})), input=input or "",
                          capture_output=True, text=True, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def one_line_error(result: Result, code: int, *needles: str) -> None:
    """The command failed with ``code``, one ``Error:`` line (plus an optional hint), no
    traceback, and every needle in stderr (case-insensitive)."""
    assert result.code == code, result
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1, result
    assert "Traceback" not in result.stderr, result
    for needle in needles:
        assert needle.lower() in result.stderr.lower(), (needle, result)


# ── seeded state on the session server ─────────────────────────────────────────────────────


@dataclass
class Seeded:
    server: Any
    run_id: str
    base_model: str = TINY
    checkpoints: dict[str, dict] = field(default_factory=dict)  # "target:name" -> LoopsCheckpoint JSON

    def cp(self, name: str, target: str = "sampler") -> dict:
        return self.checkpoints[f"{target}:{name}"]


def api(server, method: str, path: str, **kwargs: Any) -> Any:
    with server.client() as c:
        resp = c.request(method, path, **kwargs)
        resp.raise_for_status()
        return resp.json()


def create_run(server, *, lora_rank: int = 4, name: str | None = None, seed: int = 0) -> dict:
    session = api(server, "POST", "/v1/loops/sessions", json={})["session"]["id"]
    body: dict[str, Any] = {"session_id": session, "base_model": TINY, "lora_rank": lora_rank, "seed": seed}
    if name:
        body["name"] = name
    return api(server, "POST", "/v1/loops/runs", json=body)["run"]


# What the seeded adapter learns: asked this (as a chat), it answers SECRET; the base model
# does not (it is random weights).
QUESTION = "What is the password?"
SECRET = "swordfish"
SEEDED_STEPS = 16


def chat_datum(question: str = QUESTION, answer: str = SECRET) -> dict:
    from baseten_loops_cli.tokenization import get_tokenizer, render_chat

    tokens, weights = render_chat(get_tokenizer(TINY), [{"role": "user", "content": question},
                                                        {"role": "assistant", "content": answer}])
    n = len(tokens) - 1
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": list(tokens[:-1])}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": list(tokens[1:]), "dtype": "int64", "shape": [n]},
            "weights": {"data": [float(w) for w in weights[1:]], "dtype": "float32", "shape": [n]},
        },
    }


def trainer(server, run_id: str):
    from baseten_loops_cli.workers.trainer import TrainerClient

    return TrainerClient(f"{server.url}/trainers/{run_id}", api_key=server.token, run_id=run_id, base_model=TINY)


def train_steps(server, run_id: str, steps: int, saves: dict[int, list[tuple[str, str]]], lr: float = 5e-3) -> None:
    """``steps`` SFT steps on :func:`chat_datum`; after step k, save each (target, name) in
    ``saves[k]`` (sampler saves are published to the run's sampler: bump_version)."""
    datum = chat_datum()
    with trainer(server, run_id) as tc:
        for step in range(1, steps + 1):
            fb = tc.forward_backward([datum], "cross_entropy")
            opt = tc.optim_step({"learning_rate": lr})  # pipelined behind the forward_backward
            fb.result(timeout=120)
            opt.result(timeout=120)
            for target, name in saves.get(step, []):
                if target == "sampler":
                    tc.save_weights_for_sampler(name, bump_version=True).result(timeout=120)
                else:
                    tc.save_state(name).result(timeout=120)


_SEEDED: dict[str, Seeded] = {}


@pytest.fixture(scope="session")
def seeded(local_server) -> Seeded:
    """Test modules import this fixture, and pytest makes one per importing module; the state
    itself is built once per server (cached here), so every module shares one seeded run."""
    if local_server.url not in _SEEDED:
        _SEEDED[local_server.url] = _seed(local_server)
    return _SEEDED[local_server.url]


def _seed(local_server) -> Seeded:
    run = create_run(local_server, name="seeded-run", lora_rank=16)
    train_steps(local_server, run["id"], SEEDED_STEPS, {
        1: [("sampler", "s1"), ("trainer", "t1")],
        SEEDED_STEPS: [("sampler", "s2"), ("trainer", "s2")],
    })
    cps = api(local_server, "GET", "/v1/loops/checkpoints", params={"run_id": run["id"]})["checkpoints"]
    seeded = Seeded(local_server, run["id"])
    for cp in cps:
        seeded.checkpoints[f"{cp['target']}:{cp['checkpoint_id']}"] = cp
    assert set(seeded.checkpoints) == {"sampler:s1", "trainer:t1", "sampler:s2", "trainer:s2"}, cps
    return seeded


# ── `loops train` SIGKILLed, then resumed ──────────────────────────────────────────────────


def trained_steps(run_dir: Path) -> list[int]:
    """The steps in ``run_dir``'s metrics.jsonl that trained (have a loss), in order; a torn
    last line (a kill while it was written) ends the list."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            break  # a torn last line
        if "loss" in record:
            steps.append(record["step"])
    return steps


def start_loops(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """``loops ARGS`` as a child in a process group of its own (``kill(proc, group=True)`` kills it)."""
    return subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill_once_then_resume(server, config: Path, cwd: Path, *, steps: int, kill_after: int = 3,
                          timeout: float = 120, atol: float = 0.0) -> subprocess.CompletedProcess:
    """Train ``config`` twice from ``cwd``: cleanly into cwd/clean, and into cwd/killed with a
    SIGKILL as soon as ``kill_after`` steps are in its metrics.jsonl (within ``timeout``
    seconds), then `loops train resume` it. Asserts that the kill left the run "running" and
    that the resumed run ends as the clean one: ``steps`` steps, each in metrics.jsonl exactly
    once, the same final adapter. Returns the resume's result, for the caller's own checks."""
    from tests.test_reliability_faults import adapter_tensors, assert_same_adapter, loops, run_dir_result

    env = cli_env(server)
    clean = loops(["train", "run", str(config), "--run-dir", str(cwd / "clean")], env, cwd)
    assert clean.returncode == 0, clean.stderr

    run_dir = cwd / "killed"
    proc = start_loops(["train", "run", str(config), "--run-dir", str(run_dir)], env, cwd)
    wait_for(lambda: len(trained_steps(run_dir)) >= kill_after or proc.poll() is not None, timeout=timeout,
             interval=0.02, what=f"{kill_after} trained steps")
    assert proc.poll() is None, "finished before the kill"
    kill(proc, group=True, timeout=60)
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "running"  # what a SIGKILL leaves: no chance to write anything
    resumed = loops(["train", "resume", str(run_dir)], env, cwd)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming at step" in resumed.stderr + resumed.stdout
    assert trained_steps(run_dir) == list(range(1, steps + 1)), f"steps in metrics.jsonl: {trained_steps(run_dir)}"
    done, run_id, name = run_dir_result(run_dir)
    clean_done, clean_run, clean_name = run_dir_result(cwd / "clean")
    assert done == clean_done == steps
    assert_same_adapter(adapter_tensors(server, clean_run, clean_name), adapter_tensors(server, run_id, name), atol)
    return resumed


def write_rows(path: Path, rows: list) -> Path:
    """A JSONL file of ``rows`` (a str row is written as it is: a broken line on purpose)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def preference_config(tmp: Path, kind: str, train: Path, *, extra: str = "", steps: int = 4) -> Path:
    """A small tiny-model config of a preference kind (dpo, kto) on ``train``, for the DPO and
    preference-kind tests."""
    path = tmp / f"{kind}.yaml"
    path.write_text(
        f"""kind: {kind}
name: test-{kind}
base_model: {TINY}
lora_rank: 4
max_seq_len: 64
seed: 3
batch_size: 4
epochs: 2
max_steps: {steps}
optimizer:
  learning_rate: 3.0e-3
checkpointing:
  save_every: 2
data:
  train: {train}
{extra}""",
        encoding="utf-8",
    )
    return path


def run_metrics(run_dir: Path) -> list[dict]:
    """The records of a run directory's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
