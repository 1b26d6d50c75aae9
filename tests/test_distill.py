"""On-policy distillation (``kind: distill``) against the real local server.

The advantages of one batch are checked against an independent computation, the
``importance_sampling`` loss the trainer reports against one computed here from the trainer's
own logprobs, and the whole recipe end to end: an SFT'd tiny checkpoint teaches the tiny base,
and the student's agreement with the teacher on held-out prompts rises above a stated bound.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from baseten_loops_cli.training.data import Prompt
from baseten_loops_cli.training.kinds.distill import Rollout, datums_of
from baseten_loops_cli.training.teacher import TeacherScores
from tests.cli_support import TINY, loops, one_line_error

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


class _Cfg:
    kl_coef = 0.5
    reward_weight = 2.0


def _batch() -> list[list[Rollout]]:
    prompt = Prompt([1, 10, 11, 12], {"prompt": "p"}, "p:1", "p")
    student = [[-1.25, -0.5, -2.0], [-0.1, -3.0]]
    teacher = [[-0.75, -1.5, -0.25], [-0.2, -0.4]]
    rewards = [1.0, 0.0]
    return [[Rollout(prompt, toks, s, "x", "stop", TeacherScores(t, None), reward=r)
             for toks, s, t, r in zip([[20, 21, 22], [23, 24]], student, teacher, rewards)]]


def test_advantages_are_the_negative_reverse_kl_plus_the_reward_term():
    groups = _batch()
    datums, kl_terms = datums_of(groups, _Cfg)
    # Independent: A_t = 0.5 * (t - s) + 2.0 * (r - mean r), on completion targets only.
    expected = [
        [0.0] * 3 + [0.5 * (-0.75 + 1.25) + 1.0, 0.5 * (-1.5 + 0.5) + 1.0, 0.5 * (-0.25 + 2.0) + 1.0],
        [0.0] * 3 + [0.5 * (-0.2 + 0.1) - 1.0, 0.5 * (-0.4 + 3.0) - 1.0],
    ]
    for datum, want in zip(datums, expected):
        got = datum["loss_fn_inputs"]["advantages"]["data"]
        assert len(got) == len(want) and all(abs(a - b) < 1e-5 for a, b in zip(got, want)), (got, want)
        mask = datum["loss_fn_inputs"]["mask"]["data"]
        assert mask == [0.0] * 3 + [1.0] * (len(want) - 3)
    assert [round(k, 6) for k in kl_terms] == [-0.5, 1.0, -1.75, 0.1, -2.6]


def _final_sampler_of(server, run_dir: Path) -> str:
    state = json.loads((run_dir / "state.json").read_text())
    return f"{state['run_id']}:final"


@pytest.fixture(scope="module")
def teacher_ref(local_server, tmp_path_factory) -> str:
    """The tiny SFT example, shortened: the teacher every test here distills from."""
    run_dir = tmp_path_factory.mktemp("teacher") / "run"
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-sft.yaml"), "--run-dir", str(run_dir),
                   "--set", "epochs=12", "--set", "eval_every=0", "--set", "checkpointing.save_every=0",
                   "--yes", "-o", "json")  # fmt: skip
    assert result.code == 0, result
    return _final_sampler_of(local_server, run_dir)


def test_the_importance_sampling_loss_of_a_batch_matches_an_independent_computation(local_server, teacher_ref):
    from baseten_loops_cli.workers.trainer import TrainerClient

    with local_server.client() as c:
        session = c.post("/v1/loops/sessions", json={}).json()["session"]["id"]
        run = c.post("/v1/loops/runs", json={"session_id": session, "base_model": TINY, "lora_rank": 8, "seed": 3}).json()["run"]
    trainer = TrainerClient(f"{local_server.url}/trainers/{run['id']}", api_key=local_server.token, run_id=run["id"], base_model=TINY)
    try:
        datums, _ = datums_of(_batch(), _Cfg)
        out = trainer.forward(datums, "importance_sampling").result(timeout=120)
    finally:
        trainer.close()
    # Independent: loss = -sum_t exp(logp_new - logp_old) * A_t * mask_t, from the trainer's logprobs.
    expected = 0.0
    for datum, result in zip(datums, out["loss_fn_outputs"]):
        new = result["logprobs"]["data"]
        ins = datum["loss_fn_inputs"]
        for lp, old, adv, m in zip(new, ins["logprobs"]["data"], ins["advantages"]["data"], ins["mask"]["data"]):
            expected -= math.exp(lp - old) * adv * m
    assert abs(out["metrics"]["loss:sum"] - expected) < 1e-5 * max(1.0, abs(expected)), (out["metrics"], expected)


AGREEMENT_BOUND = 0.3  # held-out agreement after 20 steps (0.5 measured here); the tiny base starts at 0


def test_an_sft_teacher_raises_the_students_held_out_agreement(local_server, teacher_ref, tmp_path):
    config = tmp_path / "distill.yaml"
    shutil.copy(EXAMPLES / "tiny-distill.yaml", config)
    (tmp_path / "data").mkdir()
    for name in ("tiny_distill_prompts.jsonl", "tiny_distill_eval.jsonl"):
        shutil.copy(EXAMPLES / "data" / name, tmp_path / "data" / name)
    run_dir = tmp_path / "run"
    result = loops(local_server, "train", "run", str(config), "--run-dir", str(run_dir), "--set", f"teacher.model={teacher_ref}",
                   "--set", "reward=exact_match", "--yes", "-o", "json")  # fmt: skip
    assert result.code == 0, result
    before = float(re.search(r"Before training: teacher agreement ([\d.]+)%", result.stderr).group(1)) / 100
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "eval_teacher_agreement" in r][-1]
    assert before < 0.1, result.stderr
    assert final["eval_teacher_agreement"] >= AGREEMENT_BOUND, (before, final)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all("reverse_kl" in s and "reward" in s for s in samples)


def test_a_teacher_of_another_tokenizer_is_refused_before_provisioning(local_server, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    other = tmp_path / "other-model"
    other.mkdir()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "What": 1, "is": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(other / "tokenizer.json"))
    config = tmp_path / "distill.yaml"
    shutil.copy(EXAMPLES / "tiny-distill.yaml", config)
    shutil.copytree(EXAMPLES / "data", tmp_path / "data", ignore=shutil.ignore_patterns("*smol*", "*dpo*"))
    result = loops(local_server, "train", "validate", str(config), "--offline", "--set", f"teacher.model={other}")
    one_line_error(result, 1, "another tokenizer than the student loops-local/tiny", "teacher")
