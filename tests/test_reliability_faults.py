"""Training through the fault proxy: resets, lost responses, 502/503 (with and without
Retry-After), 408s, slow responses and replays at a 20% rate must change nothing.

Two levels:

* the trainer client (``workers.TrainerClient``) driving a run through the proxy: exactly N
  optimizer steps and a bit-identical adapter vs. the same ops without faults;
* ``loops train run CONFIG`` with ``LOOPS_BASE_URL`` pointing at the proxy: the same step count
  and final adapter as a fault-free run of the same config (how much longer it takes is
  measured by bench/train_through_faults.py, not asserted: wall time is the machine's load).

Rates, steps and seeds can be tuned with LOOPS_FAULT_RATE, LOOPS_FAULT_STEPS, LOOPS_FAULT_SEED.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.faultproxy import FaultProxy
from tests.support import cli_env

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "loops-local/tiny"
FAULT_RATE = float(os.environ.get("LOOPS_FAULT_RATE", "0.2"))
STEPS = int(os.environ.get("LOOPS_FAULT_STEPS", "6"))
FAULT_SEED = int(os.environ.get("LOOPS_FAULT_SEED", "1234"))


# ── helpers ─────────────────────────────────────────────────────────────────────────────────


def _datum(tokens: list[int]) -> dict:
    n = len(tokens) - 1
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
                               "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]}}}


BATCHES = [[_datum([1 + (i + j) % 40, 3 + i, 7 + j, 11 + (i * j) % 30, 13, 2 + i]) for j in range(2)]
           for i in range(16)]


def _new_run(client: httpx.Client, seed: int) -> dict:
    session = client.post("/v1/loops/sessions", json={}).json()["session"]["id"]
    r = client.post("/v1/loops/trainers", json={"session_id": session, "base_model": MODEL,
                                               "lora_rank": 4, "seed": seed})
    assert r.status_code == 200, r.text
    return r.json()["run"]


def _drive(base_url: str, token: str, run: dict, steps: int) -> tuple[int, float]:
    """``steps`` pipelined forward_backward + optim_step, then publish the adapter. Returns
    (policy_version, seconds)."""
    from baseten_loops_cli.workers.trainer import TrainerClient

    t0 = time.monotonic()
    with TrainerClient(f"{base_url}/trainers/{run['id']}", api_key=token, run_id=run["id"],
                       base_model=MODEL, result_timeout=300, submit_timeout=300) as tc:
        for step in range(steps):
            fb = tc.forward_backward(BATCHES[step % len(BATCHES)])
            opt = tc.optim_step({"learning_rate": 0.05})
            fb.result(timeout=300)
            opt.result(timeout=300)
        tc.save_weights_for_sampler("final").result(timeout=300)
        version = tc.policy_version()
    return version, time.monotonic() - t0


def adapter_tensors(server, run_id: str, name: str = "final") -> dict:
    """The published adapter of ``run_id`` (bt://.../sampler_weights/<name>), fetched through
    its presigned URLs (no auth header) and loaded as tensors."""
    from safetensors.torch import load as load_safetensors

    with server.client() as c:
        cps = c.get("/v1/loops/checkpoints", params={"run_id": run_id}).json()["checkpoints"]
        cp = next(x for x in cps if x.get("target") == "sampler" and x.get("checkpoint_id") == name)
        files = c.get(f"/v1/loops/checkpoints/{cp['id']}/files").json()["presigned_urls"]
    tensors = {}
    with httpx.Client(timeout=60) as plain:
        for f in files:
            if f["relative_file_name"].endswith(".safetensors"):
                tensors.update(load_safetensors(plain.get(f["url"]).content))
    assert tensors, f"no safetensors in {[f['relative_file_name'] for f in files]}"
    return tensors


def assert_same_adapter(a: dict, b: dict, atol: float = 0.0) -> None:
    """Bit-identical adapters, or within ``atol`` where the caller says why bits may differ."""
    import torch

    assert sorted(a) == sorted(b)
    diffs = {k: float((a[k].float() - b[k].float()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    diffs = {k: d for k, d in diffs.items() if d > atol}
    assert not diffs, f"adapters differ (max abs diff per tensor): {dict(list(diffs.items())[:5])}"


def _port(url: str) -> int:
    return httpx.URL(url).port


# ── trainer client through the proxy ───────────────────────────────────────────────────────


def test_trainer_client_survives_faults_exactly_once(local_server):
    """N steps through 20% faults == N steps without: policy_version N, identical adapter."""
    with local_server.client() as c:
        clean_run = _new_run(c, seed=7)
        faulty_run = _new_run(c, seed=7)
    clean_version, clean_s = _drive(local_server.url, local_server.token, clean_run, STEPS)
    with FaultProxy("127.0.0.1", _port(local_server.url), rate=FAULT_RATE, seed=FAULT_SEED,
                    delay_s=0.2, retry_after_s=1) as proxy:
        faulty_version, faulty_s = _drive(proxy.url, local_server.token, faulty_run, STEPS)
        snap = proxy.snapshot()
    print(f"\nfaults injected: {snap}; clean {clean_s:.1f}s, faulty {faulty_s:.1f}s")
    assert snap["injected"] > 0
    assert clean_version == STEPS
    assert faulty_version == STEPS, f"policy_version {faulty_version} after {STEPS} steps; faults: {snap}"
    assert_same_adapter(adapter_tensors(local_server, clean_run["id"]),
                        adapter_tensors(local_server, faulty_run["id"]))


@pytest.mark.parametrize("kind", ["reset_after", "replay"])
def test_every_request_duplicated_or_lost_still_applies_once(local_server, kind):
    """The worst case for idempotency: every 2nd request's response is lost (or every request
    delivered twice). Still exactly one optimizer step per optim_step."""
    with local_server.client() as c:
        run = _new_run(c, seed=11)
    rate = 0.5 if kind == "reset_after" else 1.0
    with FaultProxy("127.0.0.1", _port(local_server.url), rate=rate, seed=3, mix=[kind],
                    only=r"^/trainers/") as proxy:
        version, _ = _drive(proxy.url, local_server.token, run, 3)
        snap = proxy.snapshot()
    assert snap["by_kind"].get(kind, 0) >= 3, snap
    assert version == 3, f"{kind}: policy_version {version} after 3 steps ({snap})"


def test_plain_503_without_retry_after_on_trainer_is_survived(local_server):
    """A 503 without Retry-After from a proxy in front of the trainer is transient; the
    issue asks the run to survive 503s with and without Retry-After."""
    with local_server.client() as c:
        run = _new_run(c, seed=5)
    with FaultProxy("127.0.0.1", _port(local_server.url), rate=0.25, seed=9, mix=["503"],
                    only=r"^/trainers/") as proxy:
        version, _ = _drive(proxy.url, local_server.token, run, 3)
    assert version == 3


def test_control_plane_client_retries_408_and_dropped_connections(local_server):
    """``api.http.HttpClient`` through 408s and resets on GETs (idempotent: always retried)."""
    from baseten_loops_cli.api.http import HttpClient

    with FaultProxy("127.0.0.1", _port(local_server.url), rate=0.3, seed=21,
                    mix=["408", "reset", "502", "503_retry_after"], retry_after_s=0) as proxy:
        with HttpClient(proxy.url, local_server.token, sleep=lambda s: time.sleep(min(s, 0.05)),
                        max_retries=8) as http:
            for _ in range(40):
                assert "runs" in http.request_json("GET", "/v1/loops/runs")
        snap = proxy.snapshot()
    assert snap["by_kind"].get("408", 0) > 0, snap


# ── `loops train run` through the proxy ─────────────────────────────────────────────────────

SFT_STEPS = int(os.environ.get("LOOPS_FAULT_SFT_STEPS", "8"))


def sft_config(tmp: Path, *, steps: int = SFT_STEPS, save_every: int = 2, seed: int = 3) -> Path:
    path = tmp / "sft.yaml"
    path.write_text(
        f"""kind: sft
name: reliability-sft
base_model: {MODEL}
lora_rank: 4
max_seq_len: 64
seed: {seed}
batch_size: 4
max_steps: {steps}
optimizer:
  learning_rate: 3.0e-3
checkpointing:
  save_every: {save_every}
data:
  train: {ROOT / 'examples' / 'data' / 'tiny_sft_train.jsonl'}
""",
        encoding="utf-8",
    )
    return path


def loops(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, check=False)


def run_dir_result(run_dir: Path) -> tuple[int, str, str]:
    """(steps completed per state.json, run id, final sampler checkpoint name) of a run dir."""
    state = json.loads((run_dir / "state.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "checkpoints.jsonl").read_text().splitlines() if x.strip()]
    final = lines[-1]
    uri = final.get("sampler_path") or final["path"]
    run_id = uri.split("bt://loops:", 1)[1].split("/", 1)[0]
    return int(state["step"]), run_id, uri.rsplit("/", 1)[1]


def test_sft_run_through_20pct_faults_matches_fault_free_run(local_server, tmp_path):
    """`loops train run` (fixed seed, same data) through the fault proxy: exactly N optimizer
    steps and the same adapter as a fault-free run."""
    config = sft_config(tmp_path)
    clean = loops(["train", "run", str(config), "--run-dir", str(tmp_path / "clean")], cli_env(local_server), tmp_path)
    assert clean.returncode == 0, clean.stderr
    with FaultProxy("127.0.0.1", _port(local_server.url), rate=FAULT_RATE, seed=FAULT_SEED,
                    delay_s=0.2, retry_after_s=1) as proxy:
        faulty = loops(["train", "run", str(config), "--run-dir", str(tmp_path / "faulty")],
                       cli_env(local_server, LOOPS_BASE_URL=proxy.url), tmp_path)
        snap = proxy.snapshot()
    assert faulty.returncode == 0, f"faults: {snap}\n{faulty.stderr}"
    assert snap["injected"] >= 3, snap
    clean_steps, clean_run, clean_name = run_dir_result(tmp_path / "clean")
    faulty_steps, faulty_run, faulty_name = run_dir_result(tmp_path / "faulty")
    assert clean_steps == faulty_steps == SFT_STEPS
    with local_server.client() as c:
        for run_id in (clean_run, faulty_run):
            trainer = c.get(f"/trainers/{run_id}/policy_version")
            if trainer.status_code == 200:  # still reachable (runs are deactivated at the end)
                assert trainer.json()["policy_version"] == SFT_STEPS
    metrics = [json.loads(x) for x in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, SFT_STEPS + 1))
    assert metrics[-1].get("policy_version", SFT_STEPS) == SFT_STEPS
    assert_same_adapter(adapter_tensors(local_server, clean_run, clean_name),
                        adapter_tensors(local_server, faulty_run, faulty_name))


@pytest.mark.parametrize("kind", ["reset", "reset_after", "408"])
def test_train_run_survives_a_lost_control_plane_post_without_orphans(local_server, tmp_path, kind):
    """The first POST that creates the session and the first that creates the run each fail
    once in transit (dropped before the server saw it, response lost after it acted, or a
    proxy 408). `loops train run` must still succeed, and leave exactly one run behind (a
    blind re-POST after a lost response would leave an orphan run holding capacity)."""
    name = f"lost-post-{kind.replace('_', '-')}"
    config = sft_config(tmp_path, steps=2, save_every=0)
    config.write_text(config.read_text().replace("name: reliability-sft", f"name: {name}"))
    seen: dict[str, int] = {}

    def first_create_only(k, method, path):
        if method != "POST" or not path.rstrip("/").endswith(("/loops/sessions", "/loops/runs", "/loops/trainers")):
            return False
        key = path.rstrip("/").rsplit("/", 1)[1]
        seen[key] = seen.get(key, 0) + 1
        return seen[key] == 1

    with FaultProxy("127.0.0.1", _port(local_server.url), rate=1.0, mix=[kind], allow=first_create_only) as proxy:
        p = loops(["train", "run", str(config), "--run-dir", str(tmp_path / "rd")], cli_env(local_server, LOOPS_BASE_URL=proxy.url), tmp_path)
        snap = proxy.snapshot()
    assert p.returncode == 0, f"{snap}\n{p.stderr}"
    assert snap["injected"] >= 2, snap
    with local_server.client() as c:
        runs = [r for r in c.get("/v1/loops/runs", params={"all": "true"}).json()["runs"] if r.get("name") == name]
    assert len(runs) == 1, f"{len(runs)} runs named {name}: {[r['id'] for r in runs]} (orphans from a re-POST)"
