"""The plan's numbers against what the run then does: token counts of the real batches, and a
local time estimate calibrated by a measured run that lands within ±35% of the actual."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _loops(server, cache: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "WANDB_"))}
    env.update(server.env, LOOPS_CACHE_DIR=str(cache), NO_COLOR="1")  # a calibration of our own
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=env,
                          capture_output=True, text=True, timeout=900)
    return proc, time.monotonic() - started


def _plan(server, cache: Path, config: str, *sets: str) -> dict:
    proc, _ = _loops(server, cache, "train", "run", str(EXAMPLES / config), "--dry-run", "-o", "json", *sets)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["plan"]


@pytest.mark.parametrize("config, calibrate, measure", [
    ("tiny-sft.yaml", ["--set", "max_steps=15", "--set", "eval_every=0"], ["--set", "max_steps=30", "--set", "eval_every=0"]),
    ("tiny-rl.yaml", ["--set", "max_steps=3"], ["--set", "max_steps=6"]),
])
def test_local_estimate_is_calibrated_and_within_35_percent(local_server, tmp_path, config, calibrate, measure):
    # The server loads the model on its first run: warm it outside this test's calibration, or
    # the calibrating run's start-up includes the load and the estimate depends on test order.
    warm, _ = _loops(local_server, tmp_path / "warm-cache", "train", "run", str(EXAMPLES / config),
                     "--run-dir", str(tmp_path / "warm"), "--set", "max_steps=1")
    assert warm.returncode == 0, warm.stderr
    cache = tmp_path / "cache"
    first = _plan(local_server, cache, config, *calibrate)
    assert any("not calibrated" in note for note in first["notes"])
    proc, _ = _loops(local_server, cache, "train", "run", str(EXAMPLES / config), "--run-dir", str(tmp_path / "a"), *calibrate)
    assert proc.returncode == 0, proc.stderr
    plan = _plan(local_server, cache, config, *measure)
    assert not any("not calibrated" in note for note in plan["notes"])
    proc, actual = _loops(local_server, cache, "train", "run", str(EXAMPLES / config), "--run-dir", str(tmp_path / "b"), *measure)
    assert proc.returncode == 0, proc.stderr
    estimate = plan["estimated_seconds"]
    assert abs(estimate - actual) <= 0.35 * actual, (estimate, actual)


def test_planned_sft_tokens_are_the_trained_tokens(local_server, tmp_path):
    cache = tmp_path / "cache"
    sets = ["--set", "max_steps=4", "--set", "eval_every=0", "--set", "data.eval=null"]
    plan = _plan(local_server, cache, "tiny-sft.yaml", *sets)
    proc, _ = _loops(local_server, cache, "train", "run", str(EXAMPLES / "tiny-sft.yaml"), "--run-dir", str(tmp_path / "r"), *sets)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert plan["train_tokens"] == sum(r["tokens"] for r in records if not r.get("final"))


def test_planned_rl_tokens_bound_the_sampled_tokens(local_server, tmp_path):
    cache = tmp_path / "cache"
    plan = _plan(local_server, cache, "tiny-rl.yaml", "--set", "max_steps=2")
    proc, _ = _loops(local_server, cache, "train", "run", str(EXAMPLES / "tiny-rl.yaml"), "--run-dir", str(tmp_path / "r"),
                     "--set", "max_steps=2")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    sampled = sum(r["sampled_tokens"] for r in records if not r.get("final"))
    assert 0 < sampled <= plan["sample_tokens"] == 2 * 8 * 8 * 8


def test_logging_run_dir_is_relative_to_the_working_directory(local_server, tmp_path):
    """As the README says: `runs/...` lands under the directory the command runs in, not next to
    the config file (data paths stay relative to the config)."""
    configs = tmp_path / "configs"
    configs.mkdir()
    text = (EXAMPLES / "tiny-sft.yaml").read_text().replace("data/", f"{EXAMPLES}/data/")
    (configs / "c.yaml").write_text(text + "logging:\n  run_dir: runs/mine\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "WANDB_"))}
    env.update(local_server.env, LOOPS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(EXAMPLES.parent))
    proc = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "train", "run", str(configs / "c.yaml"),
                           "--dry-run", "-o", "json"], env=env, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["run_dir"] == "runs/mine"  # not configs/runs/mine


def test_a_kind_without_a_measured_run_is_calibrated_from_the_models_other_runs(local_server, tmp_path):
    """After tiny SFT runs only, the first tiny DPO (and RL) plan uses the model's measured step
    cost per token, scaled by its own tokens, and says so; a DPO measurement then takes over."""
    cache = tmp_path / "cache"
    cache.mkdir()
    calibration = cache / "train-calibration.json"
    calibration.write_text(json.dumps({"sft:loops-local/tiny": {"s_per_token": 1e-3, "startup_s": 2.0, "measured_at": 1.0}}))
    for config in ("tiny-dpo.yaml", "tiny-rl.yaml"):
        plan = _plan(local_server, cache, config)
        assert not any("not calibrated" in note for note in plan["notes"]), plan["notes"]
        assert any("calibrated from this model's last sft run" in note and "scaled by tokens" in note
                   for note in plan["notes"]), plan["notes"]
        assert plan["estimated_seconds"] >= 2.0 + (plan["train_tokens"] + plan["sample_tokens"]) * 1e-3 - 0.01
    calibration.write_text(json.dumps({"sft:loops-local/tiny": {"s_per_token": 1e-3, "startup_s": 2.0, "measured_at": 1.0},
                                       "dpo:loops-local/tiny": {"s_per_token": 2e-3, "startup_s": 1.0, "measured_at": 0.5}}))
    own = _plan(local_server, cache, "tiny-dpo.yaml")
    assert any("calibrated by the last dpo run of loops-local/tiny" in note for note in own["notes"]), own["notes"]
    assert not any("scaled by tokens" in note for note in own["notes"])


def test_validate_lists_the_backends_and_the_datas_problems_together(local_server, tmp_path):
    """Issue 42: a max_seq_len the backend refuses does not hide the data's problems (a column
    data.columns names that the CSV lacks); without max_seq_len the same config is valid on
    loops-local/tiny (the default is min(2048, its limit of 1024))."""
    (tmp_path / "qa.csv").write_text("question,answer\nWhat is 2+2?,4\n", encoding="utf-8")
    config = tmp_path / "c.yaml"
    config.write_text("kind: sft\nname: qa\nbase_model: loops-local/tiny\nmax_seq_len: 4096\nbatch_size: 1\n"
                      "data:\n  train: qa.csv\n  columns: {prompt: q, completion: answer}\n", encoding="utf-8")
    proc, _ = _loops(local_server, tmp_path / "cache", "train", "validate", str(config))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "Error: 2 problems:", proc.stderr
    assert "max_seq_len 4096 is over what loops-local/tiny allows here (1024)" in lines[1]
    assert "no column 'q' (data.columns.prompt)" in lines[2] and "Traceback" not in proc.stderr
    config.write_text(config.read_text().replace("max_seq_len: 4096\n", "").replace("prompt: q", "prompt: question"))
    proc, _ = _loops(local_server, tmp_path / "cache", "train", "validate", str(config), "-o", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plan"]["examples"] == 1


SMOLLM2_SHAPE = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}


def test_plan_estimates_the_longest_rows_peak_memory_and_warns_past_the_ram(tmp_path):
    """Issue 40: the plan estimates the server's peak for the longest row (the model's config.json,
    memory_estimate) and warns when it passes this machine's RAM; per-layer recompute past the
    activation budget keeps an 8k-token SmolLM2 row near the 1k one's peak."""
    from types import SimpleNamespace

    from baseten_loops_cli.memory_estimate import checkpoint_layer_count, parameter_count, training_peak_bytes
    from baseten_loops_cli.training.plan import longest_row, memory_notes

    assert 130e6 < parameter_count(SMOLLM2_SHAPE) < 140e6  # SmolLM2-135M
    assert checkpoint_layer_count(SMOLLM2_SHAPE, "bfloat16", 1000) == 0  # short rows: no recompute
    assert 0 < checkpoint_layer_count(SMOLLM2_SHAPE, "bfloat16", 2000) < 30
    assert checkpoint_layer_count(SMOLLM2_SHAPE, "bfloat16", 8000) == 30
    gib = 2**30
    one_k, eight_k = (training_peak_bytes(SMOLLM2_SHAPE, n, "bfloat16") for n in (1000, 8000))
    assert eight_k < 3 * gib and eight_k - one_k < 1 * gib  # the bench's targets
    assert training_peak_bytes(SMOLLM2_SHAPE, 8000, "bfloat16", mode="off") > 5 * gib  # without recompute (6.1)

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    (model / "model.safetensors").write_bytes(b"")  # a model folder (its weights are not read)
    config = SimpleNamespace(base_model=str(model), max_seq_len=8192, sampling=SimpleNamespace(max_tokens=256))
    data = SimpleNamespace(train=[SimpleNamespace(tokens=[1] * 100), SimpleNamespace(tokens=[1] * 7000)])
    assert longest_row(config, data) == 7256  # the longest prompt and its sampled reply
    (note,) = memory_notes(config, data, ram=64 * gib)
    assert note.startswith("memory: ~") and "7,256 tokens" in note and "64.0 GiB" in note
    (warning,) = memory_notes(config, data, ram=1 * gib)
    assert warning.startswith("warning: ~") and "more than this machine's 1.0 GiB of RAM" in warning
    assert "max_seq_len" in warning
    # Rows whose tokens are not counted are planned at max_seq_len (longer ones are refused).
    assert longest_row(config, SimpleNamespace(train=[SimpleNamespace()])) == 8192
    assert memory_notes(SimpleNamespace(base_model="loops-local/tiny", max_seq_len=1024), data) == []
