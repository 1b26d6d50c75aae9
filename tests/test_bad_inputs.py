"""The bad-input corpus (tests/data/bad/cases.yaml), run by one parametrized test.

Each case is one bad config file, data file, command line, URI, HTTP payload or checkpoint
archive. A CLI case must end with the expected exit code and a one-line message (no
traceback, no API key); an HTTP case must get the expected status and a JSON error body
``{detail, error_class}`` whose detail says what was wrong (and, on a deployment's OpenAI
routes, OpenAI's error object naming the field at fault).
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

from tests.support import cli_env

BAD_DIR = Path(__file__).parent / "data" / "bad"
FILES_DIR = BAD_DIR / "files"
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
        assert "skip" not in case, f"{case['id']}: every case runs; there is no skip"
        if case["kind"] == "http":
            assert isinstance(case.get("status"), int), case["id"]
        elif case.get("op"):
            assert case["kind"] == "archive" and case.get("status") == 200, case["id"]
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
            elif name == "inference_deployment_id":  # `loops deploy` of the corpus checkpoint
                r = c.post("/v1/loops/checkpoints/deploy",
                           json={"checkpoint_ids": [self.value("checkpoint_id")], "model_name": "corpus-model"})
                r.raise_for_status()
                self._values[name] = r.json()["deployment_id"]
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
        for name in ("session_id", "run_id", "deployment_id", "checkpoint_id", "inference_deployment_id"):
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


def _damaged_checkpoint(ctx: _Ctx, server, damage: dict, tmp: Path) -> dict[str, str]:
    """A fresh trainer checkpoint (save_state of a new run), then ``damage`` applied to its
    files on the server's disk: what a bad disk, a partial copy or a hostile archive does."""
    import pickle

    from baseten_loops_cli.workers.trainer import TrainerClient

    with server.client() as c:
        r = c.post("/v1/loops/trainers", json={"session_id": ctx.value("session_id"),
                                               "base_model": "loops-local/tiny", "lora_rank": 4})
        r.raise_for_status()
        run_id = r.json()["run"]["id"]
        with TrainerClient(f"{server.url}/trainers/{run_id}", api_key=server.token, run_id=run_id,
                           base_model="loops-local/tiny") as tc:
            tc.save_state("damaged").result(timeout=120)
        cps = c.get("/v1/loops/checkpoints", params={"run_id": run_id}).json()["checkpoints"]
        cp = next(x for x in cps if x["checkpoint_id"] == "damaged")
        folder = Path(c.get(f"/v1/loops/checkpoints/{cp['id']}/source").json()["source"]["path"])
    target = folder / damage["file"]
    action = damage["action"]
    if action == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: int(damage.get("keep", len(data) // 2))])
    elif action == "delete":
        target.unlink()
    elif action == "text":
        target.write_text(damage["text"])
    elif action == "json_set":
        obj = json.loads(target.read_text())
        obj.update(damage["set"])
        target.write_text(json.dumps(obj))
    elif action == "pickle_bomb":
        marker = tmp / "PWNED"

        class _Bomb:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        target.write_bytes(pickle.dumps(_Bomb()))
    elif action == "symlink":
        target.unlink()
        target.symlink_to(damage["to"])
    else:
        raise KeyError(f"unknown damage {action!r}")
    return {"ckpt_uri": cp["path"], "ckpt_run": run_id, "ckpt_id": cp["id"]}


def _setup(name: str, tmp: Path, ctx: _Ctx, server, case: dict | None = None) -> dict[str, str]:
    """Returns extra placeholders."""
    if name == "run":
        return {"run_id": ctx.value("run_id")}
    if name == "deployment_url":  # the OpenAI base URL of a `loops deploy` of the corpus checkpoint
        return {"deployment_url": f"{server.url}/deployments/{ctx.value('inference_deployment_id')}/v1"}
    if name == "damaged_checkpoint":
        return _damaged_checkpoint(ctx, server, (case or {})["damage"], tmp)
    raise KeyError(f"unknown setup {name!r}")


def run_cli(args: list[str], env: dict[str, str], cwd: Path, stdin: str | None = None,
            timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=env, cwd=cwd,
                          input=stdin if stdin is not None else "", capture_output=True, text=True,
                          timeout=timeout, check=False)


def _run_cli_case(case: dict, tmp: Path, ctx: _Ctx, server) -> None:
    mapping = {"files": str(FILES_DIR), "tmp": str(tmp)}
    for step in ([case["setup"]] if isinstance(case.get("setup"), str) else case.get("setup") or []):
        mapping.update(_setup(step, tmp, ctx, server, case))
    if "data" in case:
        (tmp / "data.jsonl").write_text(_fill(case["data"], mapping, None), encoding="utf-8")
        mapping["data"] = str(tmp / "data.jsonl")
    elif "data_b64" in case:
        import base64

        (tmp / "data.jsonl").write_bytes(base64.b64decode(case["data_b64"]))
        mapping["data"] = str(tmp / "data.jsonl")
    for name, text in (case.get("files") or {}).items():  # extra files beside the config
        (tmp / name).write_text(text, encoding="utf-8")
    if "config" in case:
        (tmp / "config.yaml").write_text(_fill(case["config"], mapping, None), encoding="utf-8")
        mapping["config"] = str(tmp / "config.yaml")
    elif "config_file" in case:
        mapping["config"] = str(FILES_DIR / case["config_file"])
    args = [_fill(str(a), mapping, ctx) for a in case["args"]]
    proc = run_cli(args, cli_env(server, **(case.get("env") or {})), tmp, case.get("stdin"))
    where = f"loops {' '.join(args)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == case["exit"], where
    assert _fill(case["message"], mapping, None).lower() in proc.stderr.lower(), where
    assert "Traceback" not in proc.stderr + proc.stdout, where
    # The README's promise for every error: one `Error:` line and a `Hint:` line with the fix.
    assert "Error:" in proc.stderr and "\nHint: " in proc.stderr, "an Error: line without a Hint: line\n" + where
    # Bad input is a known failure: it must never reach main()'s catch-all for bugs.
    assert "Error: unexpected" not in proc.stderr, "an unhandled exception, not a message\n" + where
    assert server.token not in proc.stderr + proc.stdout, "the API key leaked\n" + where
    assert not (tmp / "PWNED").exists(), "code in a checkpoint file was executed"


def _run_op_case(case: dict, tmp: Path, ctx: _Ctx, server) -> None:
    """An archive case fed to a trainer op (e.g. load_state_with_optimizer): the op must end
    with a clear error (status error, message, error_class), never run what is in the files."""
    from baseten_loops_cli.api.errors import RemoteOpError
    from baseten_loops_cli.workers.trainer import TrainerClient

    mapping = {"files": str(FILES_DIR), "tmp": str(tmp)}
    mapping.update(_setup("damaged_checkpoint", tmp, ctx, server, case))
    op = case["op"]
    with server.client() as c:
        r = c.post("/v1/loops/trainers", json={"session_id": ctx.value("session_id"),
                                               "base_model": "loops-local/tiny", "lora_rank": 4})
        r.raise_for_status()
        run_id = r.json()["run"]["id"]
    with TrainerClient(f"{server.url}/trainers/{run_id}", api_key=server.token, run_id=run_id,
                       base_model="loops-local/tiny") as tc:
        fut = tc.load_state(mapping["ckpt_uri"], with_optimizer=(op == "load_state_with_optimizer"))
        with pytest.raises(RemoteOpError) as info:
            fut.result(timeout=120)
    text = str(info.value)
    assert case["message"].lower() in text.lower(), text
    if "error_class" in case:
        assert info.value.error_class == case["error_class"], (info.value.error_class, text)
    assert "Traceback" not in text
    assert not (tmp / "PWNED").exists(), "code in a checkpoint file was executed"


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
    elif "body_raw_nested" in case:
        depth = case["body_raw_nested"]
        kwargs["content"] = ('{"prompt": ' + "[" * depth + "]" * depth + "}").encode()
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
    if path.startswith("/deployments/"):  # OpenAI clients read OpenAI's error object
        error = body.get("error")
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, where
        assert error["message"] and error["type"] == "invalid_request_error", where
        if "param" in case:
            assert error["param"] == case["param"], where
    assert "Traceback" not in r.text and server.token not in r.text, where


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bad_input(case, corpus_ctx, local_server, tmp_path):
    if case["kind"] == "http":
        _run_http_case(case, corpus_ctx, local_server)
    elif case.get("op"):
        _run_op_case(case, tmp_path, corpus_ctx, local_server)
    else:
        _run_cli_case(case, tmp_path, corpus_ctx, local_server)
