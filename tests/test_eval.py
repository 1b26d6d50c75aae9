"""`loops eval` against the real local server: the tiny SFT run's checkpoints score better
than the base model and match a forward pass computed with plain PEFT on the downloaded
adapter; the tiny RL run's final checkpoint passes more often than its base; gates, the cache,
the `eval:` block of a training config, and bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.cli_support import loops, one_line_error, seeded  # noqa: F401  (fixture)

pytest.importorskip("torch")
pytestmark = pytest.mark.local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SFT_EVAL = EXAMPLES / "data" / "tiny_sft_eval.jsonl"
RL_EVAL = EXAMPLES / "data" / "tiny_rl_eval.jsonl"
SFT_STEPS = 12
RL_STEPS = 6


def _train(server, run_dir: Path, config: Path, *sets: str) -> str:
    args = ["train", "run", str(config), "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    result = loops(server, *args)
    assert result.code == 0, result
    return json.loads((run_dir / "state.json").read_text())["run_id"]


@pytest.fixture(scope="session")
def sft_run(local_server, tmp_path_factory) -> tuple[str, Path]:
    """The tiny SFT example, 12 steps, a checkpoint every 4, ending with `eval:` (+ base)."""
    run_dir = tmp_path_factory.mktemp("eval-sft") / "run"
    run_id = _train(local_server, run_dir, EXAMPLES / "tiny-sft.yaml", f"max_steps={SFT_STEPS}",
                    "checkpointing.save_every=4", "eval_every=0", "eval.base=true")
    return run_id, run_dir


@pytest.fixture(scope="session")
def rl_run(local_server, tmp_path_factory) -> tuple[str, Path]:
    """The tiny RL example, 6 steps, ending with `eval:` (+ base, 2 samples per prompt)."""
    run_dir = tmp_path_factory.mktemp("eval-rl") / "run"
    run_id = _train(local_server, run_dir, EXAMPLES / "tiny-rl.yaml", f"max_steps={RL_STEPS}",
                    "data.eval_prompts=null", f"eval.data={RL_EVAL}", "eval.base=true", "eval.samples=2")
    return run_id, run_dir


def _by_label(doc: dict) -> dict[str, dict]:
    return {r["checkpoint"]: r["metrics"] for r in doc["results"]}


def peft_scores(adapter_dir: Path | None) -> dict[str, float]:
    """NLL per token and next-token accuracy on the tiny eval set's assistant tokens, by plain
    transformers + PEFT (no loops code on the scoring path but the row rendering)."""
    import torch

    from baseten_loops_cli.local.engine.model_zoo import build_tiny_model
    from baseten_loops_cli.tokenization import get_tokenizer
    from baseten_loops_cli.training.data.datums import load_sft_examples

    model = build_tiny_model()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    examples = load_sft_examples(SFT_EVAL, get_tokenizer("loops-local/tiny"), train_on="last_assistant", max_seq_len=128)
    nll = weight = correct = 0.0
    with torch.no_grad():
        for example in examples:
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([example.tokens])).logits[0].float(), -1)
            for i in range(1, len(example.tokens)):
                w = example.weights[i]
                if w > 0:
                    nll -= w * float(logprobs[i - 1, example.tokens[i]])
                    correct += w * float(int(logprobs[i - 1].argmax()) == example.tokens[i])
                    weight += w
    return {"nll": nll / weight, "accuracy": correct / weight, "tokens": weight}


def test_sft_checkpoints_beat_the_base_and_match_plain_peft(local_server, sft_run, tmp_path):
    run_id, run_dir = sft_run
    args = ["eval", f"{run_id}:step-000004", f"{run_id}:final", "--base", "--data", str(SFT_EVAL)]
    result = loops(local_server, *args, "-o", "json")
    assert result.code == 0, result
    doc = result.json()
    assert [r["checkpoint"] for r in doc["results"]] == ["base", f"{run_id}:step-000004", f"{run_id}:final"]
    base, first, final = (r["metrics"] for r in doc["results"])
    assert base["nll"] > first["nll"] > final["nll"]  # NLL falls with training
    assert base["accuracy"] < first["accuracy"] <= final["accuracy"] and base["accuracy"] < final["accuracy"]
    assert final["perplexity"] == pytest.approx(math.exp(final["nll"]))
    assert doc["best"]["nll"] == f"{run_id}:final"

    # The same numbers as plain PEFT on the downloaded adapter (and on the bare base model).
    adapter = tmp_path / "adapter"
    download = loops(local_server, "checkpoints", "download", f"{run_id}:final", "--target", "sampler", "-O", str(adapter))
    assert download.code == 0, download
    expected = peft_scores(adapter)
    assert final["nll"] == pytest.approx(expected["nll"], abs=1e-4)
    assert final["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-4)
    assert final["tokens"] == expected["tokens"]
    expected_base = peft_scores(None)
    assert base["nll"] == pytest.approx(expected_base["nll"], abs=1e-4)
    assert base["accuracy"] == pytest.approx(expected_base["accuracy"], abs=1e-4)

    # ... and as the trainer's own forward pass: the run's last eval_loss.
    eval_loss = [r["eval_loss"] for r in (json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r][-1]
    assert final["nll"] == pytest.approx(eval_loss, abs=1e-4)

    # A re-run of the same table comes from the cache, numbers unchanged.
    again = loops(local_server, *args)
    assert again.code == 0, again
    lines = again.stdout.splitlines()
    assert lines[0].split()[:3] == ["CHECKPOINT", "ROWS", "NLL"]
    final_line = next(l for l in lines if l.startswith(f"{run_id}:final"))
    assert f"{final['nll']:.4f} *" in final_line  # the best NLL is marked
    assert "3 of 3 from the cache" in again.stderr
    assert "Started sampler" not in again.stderr  # nothing provisioned for a cached table


def test_run_star_lists_every_sampler_checkpoint_oldest_first(local_server, sft_run):
    run_id, _ = sft_run
    result = loops(local_server, "eval", f"{run_id}:*", "--data", str(SFT_EVAL), "--limit", "4", "-o", "jsonl")
    assert result.code == 0, result
    rows = [json.loads(l) for l in result.lines]
    assert [r["checkpoint"] for r in rows] == [f"{run_id}:{n}" for n in ("step-000004", "step-000008", "final")]
    assert all(r["rows"] == 4 for r in rows)
    quiet = loops(local_server, "eval", f"{run_id}:*", "--data", str(SFT_EVAL), "--limit", "4", "-q")
    assert quiet.lines == [r["checkpoint"] for r in rows]


def test_training_ends_with_the_eval_block(sft_run, rl_run):
    for (run_id, run_dir), main in ((sft_run, "nll"), (rl_run, "pass_rate")):
        doc = json.loads((run_dir / "eval.json").read_text())
        assert [r["checkpoint"] for r in doc["results"]] == ["base", f"{run_id}:final"]
        base, final = (r["metrics"] for r in doc["results"])
        assert (final[main] < base[main]) if main == "nll" else (final[main] > base[main]), doc
        table = (run_dir / "eval.txt").read_text()
        assert table.startswith("CHECKPOINT") and f"{run_id}:final" in table


def test_gates_exit_codes(local_server, sft_run):
    run_id, _ = sft_run
    args = ["eval", f"{run_id}:step-000004", f"{run_id}:final", "--base", "--data", str(SFT_EVAL)]
    assert loops(local_server, *args, "--fail-under", "accuracy=0.5", "--fail-over", "nll=3").code == 0
    missed = loops(local_server, *args, "--fail-under", "accuracy=0.9999")
    one_line_error(missed, 1, "best accuracy", f"{run_id}:final", "under 0.9999")
    assert f"{run_id}:final" in missed.stdout  # the table is still printed
    one_line_error(loops(local_server, *args, "--fail-over", "perplexity=1.01"), 1, "best perplexity")
    one_line_error(loops(local_server, *args, "--fail-under", "nll=1"), 2, "--fail-over nll=1")
    unknown = loops(local_server, *args, "--fail-under", "bleu=1")
    one_line_error(unknown, 2, "unknown metric", "Use one of: accuracy (nll, perplexity with --fail-over)")
    one_line_error(loops(local_server, *args, "--fail-under", "accuracy"), 2, "METRIC=VALUE")
    # The base model alone is gated on itself (it has not learned the task).
    base_only = loops(local_server, "eval", "--base", "--config", str(EXAMPLES / "tiny-sft.yaml"),
                      "--fail-under", "accuracy=0.5", "-o", "json")
    one_line_error(base_only, 1, "best accuracy", "(base)")
    assert base_only.json()["settings"]["train_on"] == "last_assistant"  # --data from the config


def test_rl_final_checkpoint_passes_more_than_its_base(local_server, rl_run):
    run_id, _ = rl_run
    args = ["eval", f"{run_id}:final", "--base", "--config", str(EXAMPLES / "tiny-rl.yaml"), "--samples", "4", "--k", "2",
            "--limit", "8"]
    result = loops(local_server, *args, "-o", "json")
    assert result.code == 0, result
    scores = _by_label(result.json())
    base, final = scores["base"], scores[f"{run_id}:final"]
    assert final["pass_rate"] > base["pass_rate"]
    assert final["reward"] > base["reward"]
    assert 0 <= base["pass_at_k"] <= 1 and final["pass_at_k"] >= final["pass_rate"] - 1e-9
    assert 0 < final["completion_tokens"] <= 8  # sampling.max_tokens
    assert result.json()["settings"]["k"] == 2
    assert loops(local_server, *args, "--fail-under", "pass_rate=0.5").code == 0


def test_a_raising_reward_names_the_row_and_scores_the_rest(local_server, rl_run, tmp_path):
    run_id, _ = rl_run
    (tmp_path / "flaky.py").write_text(
        "def reward(completion, row):\n"
        "    if row['answer'] == '90':\n"
        "        raise ValueError('no reward for 90\\nsecond line')\n"
        "    return float(any(ch.isdigit() for ch in completion))\n"
    )
    config = (EXAMPLES / "tiny-rl.yaml").read_text().replace("reward: rewards.py:digit_fraction", "reward: flaky.py:reward")
    config = config.replace("data/", f"{EXAMPLES / 'data'}/")
    (tmp_path / "rl.yaml").write_text(config)
    args = ["eval", f"{run_id}:final", "--config", str(tmp_path / "rl.yaml"), "--samples", "2", "--limit", "4", "-o", "json"]
    result = loops(local_server, *args)
    one_line_error(result, 1, "tiny_rl_eval.jsonl:2", "ValueError: no reward for 90")
    assert "second line" not in result.stderr
    row = result.json()["results"][0]
    assert row["rows"] == 4 and [e["source"].rsplit("/", 1)[-1] for e in row["errors"]] == ["tiny_rl_eval.jsonl:2"]
    assert row["metrics"]["reward"] > 0.5  # the other 3 rows were scored
    # A result with errors is not cached: fixing the reward gives clean numbers.
    (tmp_path / "flaky.py").write_text("def reward(completion, row):\n    return 1.0\n")
    fixed = loops(local_server, *args)
    assert fixed.code == 0, fixed
    assert fixed.json()["results"][0]["metrics"]["reward"] == 1.0


def test_bad_input(local_server, sft_run, tmp_path):
    run_id, _ = sft_run
    good = SFT_EVAL.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good[0] + "\n" + '{"question": "no messages here"}\n')
    one_line_error(loops(local_server, "eval", f"{run_id}:final", "--data", str(bad)), 1, "bad.jsonl:2", "messages")
    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(RL_EVAL, prompts)
    one_line_error(loops(local_server, "eval", f"{run_id}:final", "--data", str(prompts)), 1, "prompts.jsonl:1", "--config")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    one_line_error(loops(local_server, "eval", f"{run_id}:final", "--data", str(empty)), 1, "empty.jsonl", "empty")
    one_line_error(loops(local_server, "eval", f"{run_id}:final", "--data", str(tmp_path / "missing.jsonl")), 1, "missing.jsonl", "not found")
    one_line_error(loops(local_server, "eval", f"{run_id}:nope", "--data", str(SFT_EVAL)), 1, "no checkpoint named 'nope'")
    one_line_error(loops(local_server, "eval", "zzzzzzz:*", "--data", str(SFT_EVAL)), 1, "no run 'zzzzzzz'")
    trainer_cp = f"bt://loops:{run_id}/weights/final"
    one_line_error(loops(local_server, "eval", trainer_cp, "--data", str(SFT_EVAL)), 2, "trainer checkpoint", "--target sampler")
    one_line_error(loops(local_server, "eval", "--data", str(SFT_EVAL)), 2, "at least one checkpoint")
    one_line_error(loops(local_server, "eval", f"{run_id}:final", "--data", str(SFT_EVAL), "--samples", "2"), 2, "RL config")


# ── no server needed ──────────────────────────────────────────────────────────────────────


def test_pass_at_k_is_the_unbiased_estimator():
    from baseten_loops_cli.training.evaluation.scoring import pass_at_k

    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer than k failures: some k-subset always passes


def test_eval_block_in_a_config(tmp_path):
    from baseten_loops_cli.errors import ConfigError
    from baseten_loops_cli.training.config import load_config

    source = (EXAMPLES / "tiny-sft.yaml").read_text()
    for block, expected in (("eval: true", {"base": False}), ("eval:", {"base": False}),
                            ("eval:\n  base: true\n  limit: 3", {"base": True, "limit": 3})):
        (tmp_path / "c.yaml").write_text(source + block + "\n")
        spec = load_config(tmp_path / "c.yaml").config.eval
        assert spec is not None and spec.model_dump(include=set(expected)) == expected
    assert load_config(EXAMPLES / "tiny-sft.yaml").config.eval is None
    (tmp_path / "c.yaml").write_text(source + "eval:\n  bsae: true\n")
    with pytest.raises(ConfigError, match=r"c.yaml:\d+: unknown key 'eval.bsae'; did you mean 'eval.base'"):
        load_config(tmp_path / "c.yaml")


def test_progress_bar_draws_only_on_a_terminal():
    import io

    from baseten_loops_cli.output.sink import Output, Streams

    for tty, drawn in ((True, True), (False, False)):
        err = io.StringIO()
        out = Output("table", streams=Streams(stdout=io.StringIO(), stderr=err, stdin_tty=False, stdout_tty=tty, stderr_tty=tty))
        with out.count_progress("Scoring rows") as bar:
            bar.start(3)
            for _ in range(3):
                bar.advance()
        assert ("Scoring rows" in err.getvalue()) is drawn


def test_same_command_on_a_baseten_profile(local_server, sft_run, tmp_path):
    """Only samplers are used: a `kind = "baseten"` profile (here pointed at the local server)
    scores the same numbers."""
    run_id, _ = sft_run
    args = ["eval", f"{run_id}:final", "--data", str(SFT_EVAL), "--limit", "3", "-o", "json"]
    local = loops(local_server, *args)
    assert local.code == 0, local
    (tmp_path / "config.toml").write_text(f'[profiles.remote]\nkind = "baseten"\nbase_url = "{local_server.url}"\n')
    remote = loops(local_server, *args, "--profile", "remote", "--no-cache",
                   env={"LOOPS_CONFIG_DIR": str(tmp_path), "LOOPS_BASE_URL": ""})
    assert remote.code == 0, remote
    assert remote.json()["results"][0]["cached"] is False
    assert remote.json()["results"][0]["metrics"] == pytest.approx(local.json()["results"][0]["metrics"], abs=1e-6)


def test_a_multiple_choice_file_is_scored_by_each_choices_logprobs(seeded, tmp_path):
    """Rows with `choices` + `label`: accuracy and length-normalised accuracy from the logprobs
    of each choice after the prompt; checked against the trainer's `/forward` on the same
    weights (the seeded run's, which are its checkpoint s2's)."""
    from baseten_loops_cli.tokenization import get_tokenizer
    from tests.cli_support import QUESTION, SECRET, trainer

    chat = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"  # the tiny model's ChatML
    rows = [{"prompt": chat, "choices": [SECRET, "salmon", "hello there"], "label": 0},
            {"prompt": chat, "choices": ["sword", SECRET], "label": SECRET},
            {"prompt": "The password", "choices": [" is", " was", "word"], "label": 2}]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = loops(seeded.server, "eval", f"{seeded.run_id}:s2", "--base", "--data", str(data), "-o", "json")
    assert result.code == 0, result
    doc = result.json()
    assert doc["kind"] == "mc" and [r["rows"] for r in doc["results"]] == [3, 3]
    got = _by_label(doc)[f"{seeded.run_id}:s2"]

    tokenizer = get_tokenizer(seeded.base_model)
    pairs = [(r, tokenizer.encode(r["prompt"]), tokenizer.encode(r["prompt"] + c)) for r in rows for c in r["choices"]]
    data_ = [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": ids[:-1]}]},
              "loss_fn_inputs": {"target_tokens": {"data": ids[1:], "dtype": "int64", "shape": [len(ids) - 1]}}}
             for _, _, ids in pairs]
    with trainer(seeded.server, seeded.run_id) as tc:
        out = tc.forward(data_, "cross_entropy").result(timeout=120)
    sums = [sum(o["logprobs"]["data"][len(ctx) - 1:]) for (_, ctx, _), o in zip(pairs, out["loss_fn_outputs"])]
    right = right_norm = 0
    for r in rows:
        scores, sums = sums[:len(r["choices"])], sums[len(r["choices"]):]
        label = r["label"] if isinstance(r["label"], int) else r["choices"].index(r["label"])
        right += max(range(len(scores)), key=scores.__getitem__) == label
        right_norm += max(range(len(scores)), key=lambda i: scores[i] / len(r["choices"][i])) == label
    assert got["accuracy"] == pytest.approx(right / 3) and got["accuracy_norm"] == pytest.approx(right_norm / 3)
    assert got["accuracy"] >= 2 / 3  # the tuned adapter knows the password
    assert got["choices"] == pytest.approx(8 / 3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "choices": ["a", "b"], "label": 5}) + "\n")
    one_line_error(loops(seeded.server, "eval", f"{seeded.run_id}:s2", "--data", str(bad)), 1, "bad.jsonl:1",
                   "'label' must be the right choice's index")


def test_data_reads_any_file_type_and_hub_names(local_server, tmp_path):
    """`--data` goes through the data layer: the eval set as Parquet scores exactly what its JSONL
    does; an hf://datasets/ name reaches the hub reader (offline here, so it says so in one line)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [json.loads(line) for line in SFT_EVAL.read_text().splitlines() if line.strip()]
    parquet = tmp_path / "eval.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    args = ["eval", "--base", "--config", str(EXAMPLES / "tiny-sft.yaml"), "--limit", "4", "--no-cache", "-o", "json"]
    from_jsonl = loops(local_server, *args, "--data", str(SFT_EVAL))
    from_parquet = loops(local_server, *args, "--data", str(parquet))
    assert from_jsonl.code == 0 and from_parquet.code == 0, from_parquet.stderr
    scores = from_parquet.json()["results"][0]
    assert scores["rows"] == 4 and scores["metrics"] == from_jsonl.json()["results"][0]["metrics"]
    assert from_parquet.json()["data"] == str(parquet)
    hub = loops(local_server, "eval", "--base", "--config", str(EXAMPLES / "tiny-sft.yaml"),
                "--data", "hf://datasets/no-such-org/no-such-data", env={"HF_HUB_OFFLINE": "1"})
    one_line_error(hub, 1, "hf://datasets/no-such-org/no-such-data")


def test_a_question_answer_csv_is_scored_with_columns(local_server, tmp_path):
    """Issue 42: `--columns` maps a question,answer CSV as a config's data.columns does, and
    `--config` reads its eval data with the config's data.columns; both score what the same
    rows as prompt/completion JSONL score."""
    import csv

    rows = [json.loads(line) for line in SFT_EVAL.read_text().splitlines() if line.strip()][:4]
    pairs = [(r["messages"][-2]["content"], r["messages"][-1]["content"]) for r in rows]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps({"prompt": q, "completion": a}) + "\n" for q, a in pairs))
    with (tmp_path / "qa.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows([("question", "answer"), *pairs])
    config = tmp_path / "qa.yaml"
    config.write_text("kind: sft\nname: qa\nbase_model: loops-local/tiny\ndata:\n  train: qa.csv\n  eval: qa.csv\n"
                      "  columns: {prompt: question, completion: answer}\n")
    args = ["eval", "--base", "--config", str(EXAMPLES / "tiny-sft.yaml"), "--no-cache", "-o", "json"]
    reference = loops(local_server, *args, "--data", str(tmp_path / "pc.jsonl"))
    mapped = loops(local_server, *args, "--data", str(tmp_path / "qa.csv"), "--columns", "prompt=question,completion=answer")
    from_config = loops(local_server, "eval", "--base", "--config", str(config), "--no-cache", "-o", "json")
    assert reference.code == mapped.code == from_config.code == 0, (mapped.stderr, from_config.stderr)
    expected = reference.json()["results"][0]
    assert expected["rows"] == 4
    for result in (mapped, from_config):
        assert result.json()["results"][0]["metrics"] == expected["metrics"]
    bare = loops(local_server, *args, "--data", str(tmp_path / "qa.csv"))
    one_line_error(bare, 1, "no known row format in keys ['answer', 'question']", "--columns prompt=question,completion=answer")
