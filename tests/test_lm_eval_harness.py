"""lm-evaluation-harness (the `lm_eval` package, the dev extra) scores a `loops deploy`
endpoint with its `local-completions` model exactly as `loops eval` scores the same
checkpoint on the same rows (issue 43: 0.20 against 0.70 before). lm-eval scores a choice
with `echo: true, logprobs: 1, max_tokens: 1` and drops the last logprob as the generated
token; one row's greedy next token is the stop token, which the response must list."""

from __future__ import annotations

import pytest

from tests.cli_support import loops, seeded  # noqa: F401  (fixture)
from tests.support import ROOT

TASK_DIR = ROOT / "tests" / "data" / "lm_eval"


@pytest.mark.required_in_ci
def test_lm_eval_multiple_choice_on_a_deployment_equals_loops_eval(seeded, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra (pip install -e '.[dev]')")
    from lm_eval.tasks import TaskManager

    from baseten_loops_cli.tokenization.byte_tokenizer import tokenizer_files

    tokenizer_dir = tmp_path / "tokenizer"  # the tiny model's tokenizer as AutoTokenizer loads it
    tokenizer_dir.mkdir()
    for name, text in tokenizer_files(2048).items():
        (tokenizer_dir / name).write_text(text)
    made = loops(seeded.server, "deploy", f"{seeded.run_id}:s2", "-o", "json")
    assert made.code == 0, made
    monkeypatch.chdir(ROOT)  # the task's data_files path
    monkeypatch.setenv("OPENAI_API_KEY", seeded.server.token)  # local-completions' key
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{made.json()['url']}/completions", "model": "s2", "tokenizer_backend": "huggingface",
                    "tokenizer": str(tokenizer_dir), "num_concurrent": 1, "max_retries": 1},
        tasks=["loops_mc"], task_manager=TaskManager(include_path=str(TASK_DIR)), log_samples=True)
    harness = results["results"]["loops_mc"]
    ours = loops(seeded.server, "eval", f"{seeded.run_id}:s2", "--data", str(TASK_DIR / "loops_mc.jsonl"), "-o", "json")
    assert ours.code == 0, ours
    metrics = ours.json()
    metrics = metrics.get("metrics", metrics)
    flat = {k: v for k, v in _flatten(metrics)}
    assert harness["acc,none"] == flat["accuracy"], (harness, metrics)
    assert harness["acc_norm,none"] == flat["accuracy_norm"], (harness, metrics)
    stop_row = results["samples"]["loops_mc"][0]  # "swordfish" is followed by the stop token
    whole, cut = (resp[0][0] for resp in stop_row["resps"])  # "\nswordfish", "\nswordfis"
    assert whole < cut, "tied: the stop token was left out of the logprobs, so lm-eval dropped the 'h'"
    assert stop_row["acc"] == 1.0


def _flatten(value, prefix=""):
    """(key, number) pairs of a nested JSON value (the metrics' place in `loops eval -o json`)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, key)
    elif isinstance(value, list):
        for item in value:
            yield from _flatten(item, prefix)
    elif isinstance(value, (int, float)) and prefix:
        yield prefix, value
