"""The bad-input corpus (tests/data/bad/cases.yaml), run by one parametrized test.

Each case is one bad config file, data file, command line, URI, HTTP payload or checkpoint
archive. A CLI case must end with the expected exit code and a one-line message (no
traceback, no API key); an HTTP case must get the expected status and a JSON error body
``{detail, error_class}`` whose detail says what was wrong.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

BAD_DIR = Path(__file__).parent / "data" / "bad"
FILES_DIR = BAD_DIR / "files"
ROOT = Path(__file__).resolve().parent.parent
CASES: list[dict[str, Any]] = yaml.safe_load((BAD_DIR / "cases.yaml").read_text(encoding="utf-8"))
KINDS = {"config", "data", "cli", "uri", "http", "archive"}
CLI_TIMEOUT_S = 180


def test_corpus_is_well_formed():
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(CASES) >= 40
    for case in CASES:
        assert case["kind"] in KINDS, case["id"]
        assert case.get("message"), f"{case['id']}: every case names its expected message"
        if case["kind"] == "http":
            assert isinstance(case.get("status"), int), case["id"]
        else:
            assert isinstance(case.get("exit"), int) and case.get("args"), case["id"]
    # Every kind the issue names is represented.
    assert {c["kind"] for c in CASES} == KINDS


# ── shared server state for the corpus ──────────────────────────────────────────────────────


class _Ctx:
    """Ids the cases' placeholders refer to, created once on the session server."""

    def __init__(self, server) -> None:
        self.server = server
        self._values: dict[str, str] = {}

    def _client(self):
        return self.server.client()

    def value(self, name: str) -> str:
        if name in self._values:
            return self._values[name]
        with self._client() as c:
            if name == "session_id":
                r = c.post("/v1/loops/sessions", json={})
                r.raise_for_status()
                self._values[name] = r.json()["session"]["id"]
            elif name in ("run_id", "deployment_id"):
                r = c.post("/v1/loops/runs", json={"session_id": self.value("session_id"),
                                                    "base_model": "loops-local/tiny", "lora_rank": 4})
                r.raise_for_status()
                run = r.json()["run"]
                self._values["run_id"] = run["id"]
                self._values["deployment_id"] = run.get("deployment_id") or ""
            elif name == "checkpoint_id":
                self._values[name] = self._make_checkpoint(c)
            else:
                raise KeyError(name)
        return self._values[name]

    def _make_checkpoint(self, c) -> str:
        """A real sampler checkpoint of the corpus run (one tiny step, then save)."""
        from baseten_loops_cli.workers.trainer import TrainerClient

        run_id = self.value("run_id")
        tc = TrainerClient(f"{self.server.url}/trainers/{run_id}", api_key=self.server.token,
                           run_id=run_id, base_model="loops-local/tiny")
        try:
            tc.save_weights_for_sampler("corpus").result(timeout=120)
        finally:
            close = getattr(tc, "close", None)
            if close:
                close()
        r = c.get("/v1/loops/checkpoints", params={"run_id": run_id})
        r.raise_for_status()
        return r.json()["checkpoints"][0]["id"]


@pytest.fixture(scope="module")
def corpus_ctx(local_server):
    return _Ctx(local_server)


def _fill(text: str, mapping: dict[str, str], ctx: _Ctx | None) -> str:
    out = text
    for key, val in mapping.items():
        out = out.replace("{" + key + "}", val)
    if ctx is not None:
        for name in ("session_id", "run_id", "deployment_id", "checkpoint_id"):
            token = "{" + name + "}"
            if token in out:
                out = out.replace(token, ctx.value(name))
    return out


def _fill_obj(obj: Any, mapping: dict[str, str], ctx: _Ctx | None) -> Any:
    if isinstance(obj, str):
        return _fill(obj, mapping, ctx)
    if isinstance(obj, list):
        return [_fill_obj(x, mapping, ctx) for x in obj]
    if isinstance(obj, dict):
        return {k: _fill_obj(v, mapping, ctx) for k, v in obj.items()}
    return obj


# ── setups some CLI cases need (named in cases.yaml) ────────────────────────────────────────


def _setup(name: str, tmp: Path, ctx: _Ctx, server) -> dict[str, str]:
    """Returns extra placeholders."""
    if name == "run_dir":
        # A run directory whose state is broken in a particular way is built by the case's
        # files; nothing to do on the server.
        return {}
    if name == "run":
        return {"run_id": ctx.value("run_id")}
    raise KeyError(f"unknown setup {name!r}")


def _cli_env(server, extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "_LOOPS_"))}
    env.update(server.env)
    env.update({"LOOPS_NO_AUTOSTART": "1", "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200",
                "PYTHONPATH": str(ROOT)})
    env.update(extra or {})
    return env


def run_cli(args: list[str], env: dict[str, str], cwd: Path, stdin: str | None = None,
            timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=env, cwd=cwd,
                          input=stdin if stdin is not None else "", capture_output=True, text=True,
                          timeout=timeout, check=False)


def _run_cli_case(case: dict, tmp: Path, ctx: _Ctx, server) -> None:
    mapping = {"files": str(FILES_DIR), "tmp": str(tmp)}
    for step in ([case["setup"]] if isinstance(case.get("setup"), str) else case.get("setup") or []):
        mapping.update(_setup(step, tmp, ctx, server))
    if "data" in case:
        (tmp / "data.jsonl").write_text(_fill(case["data"], mapping, None), encoding="utf-8")
        mapping["data"] = str(tmp / "data.jsonl")
    if "config" in case:
        (tmp / "config.yaml").write_text(_fill(case["config"], mapping, None), encoding="utf-8")
        mapping["config"] = str(tmp / "config.yaml")
    elif "config_file" in case:
        mapping["config"] = str(FILES_DIR / case["config_file"])
    args = [_fill(str(a), mapping, ctx) for a in case["args"]]
    proc = run_cli(args, _cli_env(server, case.get("env")), tmp, case.get("stdin"))
    where = f"loops {' '.join(args)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == case["exit"], where
    assert case["message"].lower() in proc.stderr.lower(), where
    assert "Traceback" not in proc.stderr + proc.stdout, where
    assert server.token not in proc.stderr + proc.stdout, "the API key leaked\n" + where


def _run_http_case(case: dict, ctx: _Ctx, server) -> None:
    import httpx

    path = _fill(case["path"], {}, ctx)
    headers = dict(case.get("headers") or {})
    if case.get("auth", True):
        headers.setdefault("Authorization", f"Api-Key {server.token}")
    kwargs: dict[str, Any] = {"headers": headers}
    if "body" in case:
        kwargs["content"] = json.dumps(_fill_obj(case["body"], {}, ctx)).encode()
        headers.setdefault("Content-Type", "application/json")
    elif "body_raw" in case:
        kwargs["content"] = case["body_raw"].encode()
        headers.setdefault("Content-Type", "application/json")
    # Send the path exactly as written: no client-side normalization of %2e%2e or //.
    url = httpx.URL(server.url).copy_with(raw_path=path.encode())
    with httpx.Client(timeout=60) as c:
        r = c.request(case["method"], url, **kwargs)
    where = f"{case['method']} {path} -> {r.status_code} {r.text[:500]}"
    assert r.status_code == case["status"], where
    body = r.json()
    assert isinstance(body.get("detail"), str) and isinstance(body.get("error_class"), str), where
    assert case["message"].lower() in body["detail"].lower(), where
    if "error_class" in case:
        assert body["error_class"] == case["error_class"], where
    if r.status_code == 400:
        assert body.get("type") == "BadRequestError", "a permanent 400 must say so: " + where
    assert "Traceback" not in r.text and server.token not in r.text, where


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bad_input(case, corpus_ctx, local_server, tmp_path):
    if case.get("skip"):
        pytest.skip(case["skip"])
    if case["kind"] == "http":
        _run_http_case(case, corpus_ctx, local_server)
    else:
        _run_cli_case(case, tmp_path, corpus_ctx, local_server)
