"""`loops train` end to end against the real local backend: SFT learns, RL learns, Ctrl-C and
SIGKILL followed by `loops train resume` give the same run as an uninterrupted one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import cli_env, kill, wait_for

pytest.importorskip("torch")
pytestmark = pytest.mark.local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def loops(server, *args, timeout=300, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "baseten_loops_cli", *args],
        env=env or cli_env(server), capture_output=True, text=True, timeout=timeout, **kw,
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def final_adapter(server, run_dir: Path) -> dict:
    """The final sampler adapter's tensors, fetched through the control plane's presigned URLs."""
    import httpx
    from safetensors.torch import load as load_safetensors

    state = json.loads((run_dir / "state.json").read_text())
    with server.client() as http:
        ckpts = http.get("/v1/loops/checkpoints", params={"run_id": state["run_id"]}).json()["checkpoints"]
        final = next(c for c in ckpts if c["target"] == "sampler" and c["checkpoint_id"] == "final")
        files = http.get(f"/v1/loops/checkpoints/{final['id']}/files").json()["presigned_urls"]
    url = next(f["url"] for f in files if f["relative_file_name"].endswith("adapter_model.safetensors"))
    return load_safetensors(httpx.get(url, timeout=60).content)


def test_tiny_sft_loss_halves_and_records_everything(local_server, tmp_path):
    run_dir = tmp_path / "sft"
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-sft.yaml"), "--run-dir", str(run_dir),
                   "--set", "max_steps=30", "--set", "eval_every=15", "-o", "jsonl")
    assert result.returncode == 0, result.stderr
    streamed = [json.loads(l) for l in result.stdout.splitlines()]
    records = [r for r in metrics(run_dir) if not r.get("final")]
    assert [r["step"] for r in streamed] == [r["step"] for r in records] == list(range(1, 31))
    assert records[-1]["loss"] < records[0]["loss"] / 2, (records[0]["loss"], records[-1]["loss"])
    assert any("eval_loss" in r for r in records)
    assert records[-1]["policy_version"] == 30
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "completed" and state["step"] == 30
    ckpts = [json.loads(l) for l in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert ckpts[-1]["name"] == "final" and ckpts[-1]["sampler_path"].startswith("bt://loops:")
    assert (run_dir / "config.yaml").exists()
    # The run this command created was deactivated at the end: no idle capacity left.
    with local_server.client() as http:
        run = http.get(f"/v1/loops/runs/{state['run_id']}").json()["run"]
    assert run["status"]["name"] == "INACTIVE"
    # Off a TTY: one plain line per step on stderr.
    assert sum(1 for l in result.stderr.splitlines() if l.startswith("step ")) == 30


def test_tiny_rl_reward_rises(local_server, tmp_path):
    run_dir = tmp_path / "rl"  # through the config's logging.run_dir this time, not --run-dir
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-rl.yaml"), "--set", f"logging.run_dir={run_dir}",
                   "--set", "max_steps=7", "--set", "eval_every=7")
    assert result.returncode == 0, result.stderr
    records = [r for r in metrics(run_dir) if not r.get("final")]
    rewards = [r["reward"] for r in records]
    assert len(rewards) == 7
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.3, rewards
    assert [r["sampled_with_version"] for r in records] == list(range(7))  # synchronous: on-policy
    assert 0 <= records[-1]["eval_pass_rate"] <= 1 and records[-1]["eval_reward_mean"] > first
    samples = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 7 * 8 * 8 and {"prompt", "completion", "reward", "policy_version"} <= set(samples[0])
    assert {s["policy_version"] for s in samples if s["step"] == 7} == {6}


def test_async_rl_overlaps_within_the_staleness_bound(local_server, tmp_path):
    run_dir = tmp_path / "async"
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-rl.yaml"), "--run-dir", str(run_dir),
                   "--set", "max_steps=3", "--set", "groups_per_batch=4", "--set", "group_size=4",
                   "--set", "data.eval_prompts=null",
                   "--set", "max_steps_off_policy=1")
    assert result.returncode == 0, result.stderr
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 <= r["staleness"] <= 1 for r in records)
    assert any(r["staleness"] == 1 for r in records)  # the next batch was sampled while training
    for sample in (json.loads(l) for l in (run_dir / "samples.jsonl").read_text().splitlines()):
        assert sample["step"] - 1 - sample["policy_version"] <= 1  # never staler than the bound


def test_same_config_runs_on_a_baseten_profile(local_server, tmp_path):
    """Only `profile` changes: a `kind = "baseten"` profile (here pointed at the local server)."""
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "config.toml").write_text(f'[profiles.remote]\nkind = "baseten"\nbase_url = "{local_server.url}"\n')
    env = cli_env(local_server)
    env.pop("LOOPS_BASE_URL")
    env["LOOPS_CONFIG_DIR"] = str(config_dir)
    args = ["train", "run", str(EXAMPLES / "tiny-sft.yaml"), "--set", "profile=remote", "--set", "max_steps=2",
            "--set", "data.eval=null"]
    declined = loops(local_server, *args, "--run-dir", str(tmp_path / "declined"), env=env)
    assert declined.returncode == 3 and "--yes" in declined.stderr  # remote capacity: asks first
    assert not (tmp_path / "declined" / "state.json").exists()
    result = loops(local_server, *args, "--run-dir", str(tmp_path / "run"), "--yes", env=env)
    assert result.returncode == 0, result.stderr
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["profile"] == "remote" and state["status"] == "completed" and state["step"] == 2


def _run_args(run_dir: Path) -> list[str]:
    return ["train", "run", str(EXAMPLES / "tiny-sft.yaml"), "--run-dir", str(run_dir),
            "--set", f"max_steps={RESUME_STEPS}", "--set", "eval_every=0", "--set", "checkpointing.save_every=3",
            "--set", "data.eval=null"]


RESUME_STEPS = 10


@pytest.fixture(scope="module")
def reference_run(local_server, tmp_path_factory) -> Path:
    """The uninterrupted run the interrupted ones must match (same config, same seed)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = loops(local_server, *_run_args(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


def assert_same_run(server, got: Path, reference: Path) -> None:
    assert [r["step"] for r in metrics(got)] == list(range(1, RESUME_STEPS + 1))  # none repeated or skipped
    assert [r["loss"] for r in metrics(got)] == pytest.approx([r["loss"] for r in metrics(reference)], rel=1e-4, abs=1e-5)
    a, b = final_adapter(server, reference), final_adapter(server, got)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() < 1e-5, name


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    def reached() -> bool:
        if (run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in metrics(run_dir)):
            return True
        assert proc.poll() is None, proc.communicate()
        return False

    wait_for(reached, timeout=timeout, interval=0.05, what=f"step {step}")


def test_sigkill_then_resume_matches_an_uninterrupted_run(local_server, tmp_path, reference_run):
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", *_run_args(killed)],
                            env=cli_env(local_server), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_step(killed, 5, proc)  # past the step-3 checkpoint: steps 4-5 must be redone, once
    kill(proc)
    resumed = loops(local_server, "train", "resume", str(killed))
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming at step" in resumed.stderr
    assert_same_run(local_server, killed, reference_run)


def test_ctrl_c_saves_state_prints_resume_and_exits_130(local_server, tmp_path, reference_run):
    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", *_run_args(run_dir), "-o", "json"],
                            env=cli_env(local_server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"loops train resume {run_dir}" in err
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "interrupted"
    last = json.loads((run_dir / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert last["step"] == state["step"] >= 2
    # -o json: the summary of a completed run, saying it was interrupted (scripts need it).
    summary = json.loads(out)
    assert summary["status"] == "interrupted" and summary["run_dir"] == str(run_dir), out
    assert summary["run_id"] == state["run_id"] and summary["steps"] == state["step"], out
    assert summary["final_checkpoint"] == last["sampler_path"], out
    resumed = loops(local_server, "train", "resume", str(run_dir), "-o", "json")
    assert resumed.returncode == 0, resumed.stderr
    done = json.loads(resumed.stdout)
    assert done["status"] == "completed" and done["steps"] == RESUME_STEPS and set(done) == set(summary)
    assert_same_run(local_server, run_dir, reference_run)
    again = loops(local_server, "train", "resume", str(run_dir), "-o", "json")  # nothing left to do
    assert again.returncode == 0 and "already completed" in again.stderr
    assert json.loads(again.stdout) == done


def test_kill_before_the_first_checkpoint_starts_over_exactly_once(local_server, tmp_path):
    run_dir = tmp_path / "early"
    args = [*_run_args(run_dir), "--set", "max_steps=5", "--set", "checkpointing.save_every=0"]
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", *args],
                            env=cli_env(local_server), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run_dir, 2, proc)
    kill(proc)
    first_run = json.loads((run_dir / "state.json").read_text())["run_id"]
    resumed = loops(local_server, "train", "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert "starting from step 1" in resumed.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5]
    with local_server.client() as http:  # the orphaned run was not left billing
        assert http.get(f"/v1/loops/runs/{first_run}").json()["run"]["status"]["name"] == "INACTIVE"


def test_dry_run_and_validate_plan(local_server, tmp_path):
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-sft.yaml"), "--dry-run", "-o", "json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert plan["examples"] == 80 and plan["steps"] == 100 and plan["train_tokens"] > 0
    bad = loops(local_server, "train", "validate", str(EXAMPLES / "tiny-sft.yaml"), "--set", "base_model=nope/model")
    assert bad.returncode == 1 and "Error:" in bad.stderr and "Traceback" not in bad.stderr


def test_broken_reward_stops_with_its_name_after_saving_state(local_server, tmp_path):
    (tmp_path / "r.py").write_text("def boom(c, row):\n    raise ValueError('bad row')\n")
    config = (EXAMPLES / "tiny-rl.yaml").read_text().replace("rewards.py:digit_fraction", f"{tmp_path}/r.py:boom")
    config = config.replace("data/", f"{EXAMPLES}/data/")
    (tmp_path / "rl.yaml").write_text(config)
    run_dir = tmp_path / "run"
    result = loops(local_server, "train", "run", str(tmp_path / "rl.yaml"), "--run-dir", str(run_dir),
                   "--set", "max_steps=3")
    assert result.returncode == 1
    assert "reward" in result.stderr and "boom" in result.stderr and "ValueError: bad row" in result.stderr
    assert "loops train resume" in result.stderr and "Traceback" not in result.stderr
    assert json.loads((run_dir / "state.json").read_text())["status"] == "failed"


def test_kl_penalty_against_the_base_model_is_measured(local_server, tmp_path):
    run_dir = tmp_path / "kl"
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-rl.yaml"), "--run-dir", str(run_dir),
                   "--set", "max_steps=2", "--set", "data.eval_prompts=null", "--set", "kl_penalty_coef=0.1")
    assert result.returncode == 0, result.stderr
    kls = [r["kl_policy_base"] for r in metrics(run_dir) if "kl_policy_base" in r]
    assert len(kls) == 2
    assert abs(kls[0]) < 1e-3  # step 1 samples the untrained adapter: policy == base
    assert any(abs(k) > 1e-3 for k in kls[1:])
