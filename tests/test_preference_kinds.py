"""The preference family as configs and runs (issue 29): `kind: dpo` with `loss: dpo | ipo |
simpo | orpo` and `kind: kto`. Config errors with file:line before anything is provisioned; the
tiny examples lifting the held-out preference (accuracy for the paired losses, the
desirable-vs-undesirable margin for KTO) above stated bounds on the real local server; the
reference-free losses never scoring a reference; SIGKILL + resume on the custom-loss path; the
SmolLM2 example accepting every loss. The losses' values and gradients against the papers'
formulas are tests/test_preference_losses.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.config import load_config
from tests.cli_support import kill_once_then_resume, loops_subprocess, one_line_error, run_metrics as metrics, write_rows
from tests.cli_support import preference_config as config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY = "loops-local/tiny"
DPO_TRAIN = EXAMPLES / "data" / "tiny_dpo_train.jsonl"
KTO_TRAIN = EXAMPLES / "data" / "tiny_kto_train.jsonl"


# ── configs (no server) ─────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("loss, params", [
    ("dpo", {"beta": 0.1, "label_smoothing": 0.0}),
    ("ipo", {"beta": 0.1}),
    ("simpo", {"beta": 2.0, "gamma": 1.0}),
    ("orpo", {"lambda": 0.1}),
])  # fmt: skip
def test_each_loss_takes_its_own_defaults_in_both_examples(loss, params):
    for name in ("tiny-dpo.yaml", "smol-dpo.yaml"):
        loaded = load_config(EXAMPLES / name, [f"loss={loss}"])
        assert (loaded.config.loss, loaded.config.loss_params) == (loss, params), name


def test_loss_parameters_are_read_with_their_bounds(tmp_path):
    path = config(tmp_path, "dpo", DPO_TRAIN, extra="loss: orpo\nlambda: 0.25\n")
    assert load_config(path).config.loss_params == {"lambda": 0.25}
    path = config(tmp_path, "dpo", DPO_TRAIN, extra="loss: simpo\nbeta: 2.5\ngamma: 0\n")
    assert load_config(path).config.loss_params == {"beta": 2.5, "gamma": 0.0}
    path = config(tmp_path, "kto", KTO_TRAIN, extra="beta: 0.2\nundesirable_weight: 1.5\n")
    assert load_config(path).config.loss_params == {"beta": 0.2, "desirable_weight": 1.0, "undesirable_weight": 1.5}


BAD_CONFIGS = [
    ("dpo", "loss: sigmoid\n", "dpo.yaml:16: loss: unknown loss 'sigmoid' (one of dpo, ipo, simpo, orpo)",
     "Set loss to one of dpo, ipo, simpo, orpo"),
    ("dpo", "loss: kto\n", "dpo.yaml:16: loss: kto trains on unpaired rows", "kind: kto"),
    ("dpo", "loss: orpo\nbeta: 0.1\n", "dpo.yaml:17: beta: belongs to losses dpo, ipo, simpo and kto, not to orpo",
     "`lambda`"),
    ("dpo", "loss: simpo\nlabel_smoothing: 0.1\n", "dpo.yaml:17: label_smoothing: belongs to loss dpo, not to simpo",
     "simpo takes beta, gamma"),
    ("dpo", "gamma: 0.5\n", "dpo.yaml:16: gamma: belongs to loss simpo, not to dpo", "dpo takes beta, label_smoothing"),
    ("dpo", "loss: ipo\nbeta: 0\n", "dpo.yaml:17: beta: must be > 0, got 0", "Set beta to > 0 (default 0.1)"),
    ("dpo", "loss: simpo\ngamma: -1\n", "dpo.yaml:17: gamma: must be >= 0, got -1", "default 1"),
    ("dpo", "label_smoothing: 0.5\n", "dpo.yaml:16: label_smoothing: must be >= 0 and < 0.5, got 0.5", "default 0"),
    ("dpo", "loss: orpo\nreference: bt://loops:abc1234/sampler_weights/final\n",
     "dpo.yaml:17: reference: loss orpo is reference-free", "Remove `reference`"),
    ("kto", "desirable_weight: 0\n", "kto.yaml:16: desirable_weight: must be > 0, got 0", "desirable_weight"),
    ("kto", "gamma: 1.0\n", "kto.yaml:16: gamma: belongs to loss simpo, not to kto", "kto takes beta"),
    ("kto", "loss: ipo\n", "kto.yaml:16: loss: kind: kto trains with the kto loss, not 'ipo'", "Use kind: dpo"),
]  # fmt: skip


@pytest.mark.parametrize("kind, extra, message, hint", BAD_CONFIGS,
                         ids=["unknown-loss", "kto-as-loss", "beta-under-orpo", "smoothing-under-simpo",
                              "gamma-under-dpo", "ipo-beta-0", "simpo-gamma-negative", "smoothing-0.5",
                              "reference-free-reference", "kto-weight-0", "kto-gamma", "kto-paired-loss"])
def test_bad_loss_configs_name_file_line_key_and_fix(tmp_path, kind, extra, message, hint):
    path = config(tmp_path, kind, DPO_TRAIN if kind == "dpo" else KTO_TRAIN, extra=extra)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in err.value.message, err.value.message
    assert hint in (err.value.hint or ""), err.value.hint


def test_smollm2_example_plans_every_loss(smollm2_cache, monkeypatch):
    """The SmolLM2 DPO example validates with each loss (the plan, on the real rows and
    tokenizer): only the losses with a reference score one, only the custom-loss path adds a
    forward per step. Not trained here (minutes on CPU)."""
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.plan import load_data

    monkeypatch.setenv("LOOPS_CACHE_DIR", str(smollm2_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(smollm2_cache / "empty-hub"))
    data = load_data(load_config(EXAMPLES / "smol-dpo.yaml"))
    plans = {}
    for loss in ("dpo", "ipo", "simpo", "orpo"):
        loaded = load_config(EXAMPLES / "smol-dpo.yaml", [f"loss={loss}"])
        plans[loss] = kinds.of(loaded.config).estimate(loaded.config, data)
    assert len({(p.steps, p.train_tokens) for p in plans.values()}) == 1  # the same batches
    sequences = sum(len(p.chosen.tokens) + len(p.rejected.tokens) for p in data.train + data.eval)
    train_tokens = plans["dpo"].train_tokens
    assert plans["dpo"].scored_tokens == sequences
    assert plans["ipo"].scored_tokens == sequences + train_tokens
    assert plans["simpo"].scored_tokens == plans["orpo"].scored_tokens == train_tokens
    assert any("reference-free" in n for n in plans["orpo"].notes)


# ── the tiny examples on the real local server ──────────────────────────────────────────────


# (loss, held-out preference accuracy the run must end at or above, at step 0 for the losses
# with a reference: the policy is its own reference). Measured on 2 shared cores, 2026-12-04:
# every loss ends at 100%; simpo and orpo start at 94% (no reference: the untrained model's own
# mean logprobs already favour the short "ANSWER: <sum>"), so their bound is on the eval loss too.
TINY_RUNS = [("ipo", 0.9), ("simpo", 0.95), ("orpo", 0.95)]


@pytest.mark.local
@pytest.mark.parametrize("loss, bound", TINY_RUNS, ids=[r[0] for r in TINY_RUNS])
def test_tiny_dpo_example_with_each_loss_lifts_heldout_accuracy(local_server, tmp_path, loss, bound):
    run_dir = tmp_path / loss
    result = loops_subprocess(local_server, "train", "run", str(EXAMPLES / "tiny-dpo.yaml"), "--set", f"loss={loss}",
                              "--run-dir", str(run_dir), "-o", "jsonl", timeout=600)
    assert result.code == 0, result
    records = metrics(run_dir)
    baseline, steps = records[0], [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert {"loss", "reward_margin", "preference_accuracy", "chosen_reward", "rejected_reward"} <= set(steps[0])
    final = steps[-1]
    assert final["eval_preference_accuracy"] >= bound and final["eval_reward_margin"] > baseline["eval_reward_margin"]
    assert final["eval_loss"] < 0.5 * baseline["eval_loss"], (baseline, final)
    has_reference = (run_dir / "reference_logprobs.jsonl").exists()
    if loss == "ipo":  # a reference: the policy starts as its own
        assert has_reference and baseline["eval_preference_accuracy"] == 0.5
        assert baseline["eval_loss"] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-3)  # (0 - 1/(2 beta))^2
    else:  # reference-free: nothing scored, no reference checkpoint published
        assert not has_reference and "Scoring" not in result.stderr
        checkpoints = [json.loads(x) for x in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
        assert all("dpo-reference" not in (c.get("sampler_path") or "") for c in checkpoints)
    if loss == "orpo":
        assert {"nll_loss", "log_odds_ratio", "eval_nll_loss"} <= set(final)
    assert "Eval: preference accuracy" in result.stderr


@pytest.mark.local
def test_tiny_kto_example_lifts_the_heldout_margin(local_server, tmp_path):
    run_dir = tmp_path / "kto"
    result = loops_subprocess(local_server, "train", "run", str(EXAMPLES / "tiny-kto.yaml"), "--run-dir", str(run_dir),
                              "-o", "jsonl", timeout=600)
    assert result.code == 0, result
    records = metrics(run_dir)
    baseline, steps = records[0], [r for r in records if "loss" in r]
    # Before training the policy is its own reference: every reward 0, the KTO loss 1/2 per example.
    assert baseline["step"] == 0 and abs(baseline["eval_reward_margin"]) < 1e-3 and abs(baseline["eval_kl_estimate"]) < 1e-3
    assert baseline["eval_loss"] == pytest.approx(0.5, abs=1e-3)
    assert [r["step"] for r in steps] == list(range(1, 17))
    assert {"loss", "kl_estimate", "desirable_reward", "undesirable_reward", "examples", "desirable"} <= set(steps[0])
    final = steps[-1]
    # The bound: measured 5.99 (2026-12-04, 2 shared cores); 2.0 leaves room for float noise.
    assert final["eval_reward_margin"] > 2.0, final
    assert final["eval_desirable_reward"] > final["eval_undesirable_reward"]
    assert final["eval_loss"] < 0.5 * baseline["eval_loss"]
    assert "desirable-vs-undesirable reward margin 0.000 -> " in result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("step 16/16"))
    assert " margin " in line and " kl " in line and "eval_margin" in line
    # Every example and its KL sequence scored once by the reference, kept for resume.
    refs = [json.loads(x) for x in (run_dir / "reference_logprobs.jsonl").read_text().splitlines()]
    assert len(refs) == len({r["key"] for r in refs}) <= 2 * (64 + 16)


@pytest.mark.local
def test_init_kto_template_validates(local_server, tmp_path):
    init = loops_subprocess(local_server, "train", "init", "--kind", "kto", "-O", str(tmp_path / "my-kto.yaml"))
    assert init.code == 0, init
    (tmp_path / "data").mkdir()
    rows = [{"prompt": f"q{i}", "completion": f"a{i}", "label": i % 3 != 0} for i in range(9)]
    write_rows(tmp_path / "data" / "feedback.jsonl", rows)
    check = loops_subprocess(local_server, "train", "validate", str(tmp_path / "my-kto.yaml"))
    assert check.code == 0, check
    assert "(KTO)" in check.stderr and "9 examples, 1 steps" in check.stderr
    assert "6 desirable and 3 undesirable" in check.stderr and "the KTO paper advises" in check.stderr  # 6/3 = 2 > 4/3


def _run_ids(server) -> set[str]:
    with server.client() as c:
        return {r["id"] for r in c.get("/v1/loops/runs").json()["runs"]}


GOOD_KTO = [{"prompt": "What is 2+1?", "completion": "ANSWER: 3", "label": True},
            {"prompt": "What is 2+2?", "completion": "4", "label": False}]


@pytest.mark.local
@pytest.mark.parametrize("kind, rows, where, message, hint", [
    ("kto", GOOD_KTO + [{"prompt": "What is 1+1?", "chosen": "ANSWER: 2", "rejected": "2"}], ":3: ",
     "missing key 'completion': this is a paired row ('chosen'/'rejected') under kind: kto", "train with kind: dpo"),
    ("kto", [dict(r, label=True) for r in GOOD_KTO], "", "every row has label true; KTO needs rows labelled false", ""),
    ("kto", GOOD_KTO + [{"prompt": "a", "completion": "b", "label": "yes"}], ":3: ", "'label' must be true or false", ""),
    ("dpo", [{"prompt": "What is 2+1?", "chosen": "ANSWER: 3", "rejected": "3"}] + GOOD_KTO[:1], ":2: ",
     "missing key 'chosen': this is an unpaired row ('completion'/'label') under kind: dpo", "with kind: kto"),
], ids=["paired-under-kto", "one-label", "label-not-bool", "unpaired-under-dpo"])  # fmt: skip
def test_bad_preference_data_fails_before_anything_is_provisioned(local_server, tmp_path, kind, rows, where, message, hint):
    train = write_rows(tmp_path / "rows.jsonl", rows)
    before = _run_ids(local_server)
    result = loops_subprocess(local_server, "train", "run", str(config(tmp_path, kind, train)), "--run-dir", str(tmp_path / "r"))
    one_line_error(result, 1, f"{train}{where}", message, hint)
    assert _run_ids(local_server) == before and not (tmp_path / "r").exists()


# ── SIGKILL, then resume (the custom-loss path) ─────────────────────────────────────────────


@pytest.mark.local
def test_orpo_killed_mid_run_then_resumed_gives_the_same_adapter(server_factory, tmp_path):
    server = server_factory()
    train = write_rows(tmp_path / "pairs.jsonl", [json.loads(x) for x in DPO_TRAIN.read_text().splitlines()[:16]])
    resumed = kill_once_then_resume(server, config(tmp_path, "dpo", train, extra="loss: orpo\n", steps=6), tmp_path,
                                    steps=6, timeout=300)
    assert "Resuming at step" in resumed.stderr and "Scoring" not in resumed.stderr


@pytest.mark.local
def test_kto_killed_mid_run_then_resumed_gives_the_same_adapter(server_factory, tmp_path):
    # One request per sampler batch, as tests/test_dpo.py: the reference scored bit for bit alike.
    server = server_factory(max_sample_batch=1)
    train = write_rows(tmp_path / "rows.jsonl", [json.loads(x) for x in KTO_TRAIN.read_text().splitlines()[:16]])
    resumed = kill_once_then_resume(server, config(tmp_path, "kto", train, steps=6), tmp_path, steps=6, timeout=300)
    assert "Resuming at step" in resumed.stderr and "Scoring" not in resumed.stderr  # the reference scores reused
    assert not math.isnan(metrics(tmp_path / "killed")[-1]["loss"])
