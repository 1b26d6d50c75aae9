"""Judge rewards (training/rewards/judge.py) against a real OpenAI-compatible grader over HTTP.

The grader is examples/judge/grader.py (starlette, served by uvicorn on 127.0.0.1 in a thread):
its answers are known (10 x the digit fraction of the reply), so every parsed score is checked.
"""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.rewards.judge import Judge, check_rubric, parse_group, parse_score
from baseten_loops_cli.training.rewards.builtins import RewardError, build_reward
from tests.support import serve_asgi

ROOT = Path(__file__).resolve().parent.parent
RUBRIC = "Question: {{ prompt }}\nExpected: {{ row.answer }}\n<reply>{{ reply }}</reply>\nScore 0-10."
GROUP_RUBRIC = ("Question: {{ prompt }}\n{% for r in replies %}<reply id=\"{{ loop.index }}\">{{ r }}</reply>\n{% endfor %}"
                "Score each reply 0-10 as JSON.")


@pytest.fixture(scope="module")
def grader():
    """The example grader on 127.0.0.1, and the bodies of the chat requests it got (in order)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("loops_example_grader", ROOT / "examples" / "judge" / "grader.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    requests: list[dict] = []

    async def counting(scope, receive, send):  # the grader's app, with every chat request kept
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            chunks = []
            while True:
                message = await receive()
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            requests.append(json.loads(b"".join(chunks)))
            replay = iter([{"type": "http.request", "body": b"".join(chunks), "more_body": False}])

            async def receive():  # noqa: F811 - the body again, for the app
                return next(replay, {"type": "http.disconnect"})
        await module.app(scope, receive, send)

    with serve_asgi(counting) as url:
        yield SimpleNamespace(url=f"{url}/v1", requests=requests)


@pytest.fixture(scope="module")
def grader_url(grader) -> str:
    return grader.url


def _spec(url: str, **changes) -> SimpleNamespace:
    base = dict(url=url, model="grader", api_key_env=None, rubric=RUBRIC, scale=(0.0, 10.0), labels=None,
                mode="single", max_tokens=64, temperature=0.0, timeout_s=10.0)
    base.update(changes)
    return SimpleNamespace(**base)


def test_scores_are_parsed_normalised_and_cached(grader_url):
    judge = Judge(_spec(grader_url))
    row = {"prompt": "Say a number", "answer": "42"}
    assert judge.score("1234", row) == 1.0
    assert judge.score("ab12", row) == 0.5
    assert judge.score("abcd", row) == 0.0
    assert judge.score("1234", row) == 1.0  # the same request again: from the cache
    assert judge.usage["requests"] == 3 and judge.usage["cached"] == 1
    assert judge.usage["prompt_tokens"] > 0 and judge.usage["completion_tokens"] == 6  # "Score: N" x 3


def test_group_mode_scores_a_whole_group_in_one_request(grader_url):
    judge = Judge(_spec(grader_url, rubric=GROUP_RUBRIC, mode="group"))
    assert judge.score_group(["12", "a1", "zz"], {"prompt": "p"}) == [1.0, 0.5, 0.0]
    assert judge.usage["requests"] == 1


def test_prose_without_a_score_is_asked_again_once_then_fails_the_rollout(grader_url):
    judge = Judge(_spec(grader_url, model="prose"))
    with pytest.raises(RewardError, match="answered without a score from 0 to 10 twice: 'This reply is thoughtful"):
        judge.score("12", {"prompt": "p", "answer": "1"})
    assert judge.usage["requests"] == 2


def test_a_row_without_the_rubrics_field_fails_that_rollout(grader_url):
    with pytest.raises(RewardError, match="the rubric uses a field this row does not have"):
        Judge(_spec(grader_url)).score("12", {"prompt": "p"})


def test_an_unknown_rubric_field_is_a_config_problem():
    with pytest.raises(ValueError, match="unknown field 'answer'"):
        check_rubric("{{ prompt }} {{ answer }}", "single")
    check_rubric("{{ prompt }} {{ row.answer }} {{ reply }}", "single")


def test_a_judge_that_does_not_answer_or_refuses_the_key(grader_url, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(ConfigError, match="does not answer"):
        Judge(_spec(dead)).check()
    monkeypatch.setenv("GRADER_KEY", "right")
    monkeypatch.setenv("MY_GRADER_KEY", "wrong")
    with pytest.raises(ConfigError, match="refused the key") as caught:
        Judge(_spec(grader_url, api_key_env="MY_GRADER_KEY")).check()
    assert "wrong" not in str(caught.value) + str(caught.value.hint)
    monkeypatch.setenv("MY_GRADER_KEY", "right")
    Judge(_spec(grader_url, api_key_env="MY_GRADER_KEY")).check()


@pytest.mark.parametrize("text, expected", [
    ("Score: 7", 0.7), ("I'd give it 8/10.", 0.8), ("The reply is fine. 3", 0.3), ("Rating = 11", None),
    ("Great reply!", None),
])
def test_parse_score(text, expected):
    got = parse_score(text, (0.0, 10.0), None)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_parse_labels_and_groups():
    assert parse_score("Verdict: CORRECT", (0, 1), {"correct": 1.0, "incorrect": 0.0}) == 1.0
    assert parse_score("This is incorrect.", (0, 1), {"correct": 1.0, "incorrect": 0.0}) == 0.0
    assert parse_group("Ranking: 2 > 3 > 1", 3, (0, 10)) == [0.0, 1.0, 0.5]
    assert parse_group("1: 10\n2: 5", 2, (0, 10)) == [1.0, 0.5]
    assert parse_group('{"scores": [{"trajectory_id": "1", "score": 4}]}', 2, (0, 10)) is None  # one missing


def test_the_judge_example_reward_rises(local_server, grader_url, tmp_path):
    """examples/tiny-judge.yaml: RL on the tiny model graded by the example grader over HTTP."""
    import json

    from tests.cli_support import loops

    run_dir = tmp_path / "run"
    result = loops(local_server, "train", "run", str(ROOT / "examples" / "tiny-judge.yaml"), "--run-dir", str(run_dir),
                   "--set", f"reward.judge.url={grader_url}", "--set", "max_steps=7", "--set", "eval_every=0",
                   "--set", "data.eval_prompts=null", "--yes")  # fmt: skip
    assert result.code == 0, result
    rewards = [json.loads(line)["reward"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.3, rewards
    saved = (run_dir / "config.yaml").read_text()
    assert "judge" in saved and "Bearer" not in saved


def test_a_built_judge_reward_reaches_its_token_counts(grader_url):
    from baseten_loops_cli.training.config import JudgeConfig, RewardConfig
    from baseten_loops_cli.training.rewards.judge import judge_of

    spec = RewardConfig(fn="judge", judge=JudgeConfig(url=grader_url, model="grader", rubric=RUBRIC))
    name, fn = build_reward(spec, ROOT)
    assert fn("12", {"prompt": "p", "answer": "1"}) == 1.0
    assert judge_of(fn).usage["requests"] == 1
    group = RewardConfig(fn="judge", judge=JudgeConfig(url=grader_url, rubric=GROUP_RUBRIC, mode="group"))
    _, group_fn = build_reward(group, ROOT)
    assert group_fn.score_group(["1", "x"], {"prompt": "p"}) == [1.0, 0.0] and judge_of(group_fn) is not None
    with pytest.raises(RewardError, match="mode: group scores whole groups"):
        group_fn("1", {"prompt": "p"})


def _metrics(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _judge_config(tmp_path: Path, judge: str, **sets: str) -> Path:
    """examples/tiny-judge.yaml with ``judge`` as its reward.judge block (YAML, indented 4) and
    its data paths made absolute."""
    import re

    text = (ROOT / "examples" / "tiny-judge.yaml").read_text().replace("data/", f"{ROOT}/examples/data/")
    text = re.sub(r"(?ms)^  judge:\n.*?(?=^pass_threshold)", "  judge:\n" + judge, text)
    for key, value in sets.items():
        text = re.sub(rf"(?m)^{key}: .*$", f"{key}: {value}", text) if re.search(rf"(?m)^{key}:", text) else text + f"{key}: {value}\n"
    path = tmp_path / "judge.yaml"
    path.write_text(text)
    return path


def test_a_group_judge_in_rl_is_asked_once_per_group_and_its_tokens_are_recorded(local_server, grader, tmp_path):
    """`mode: group` inside kind: rl: one request per group (counted by the grader itself), the
    scores of RULER's JSON per reply, and the grader's own usage figures summed per step
    (judge_* metrics), in the summary and in `-o json`."""
    from tests.cli_support import loops

    judge = (f"    url: {grader.url}\n    model: grader\n    mode: group\n    scale: [0, 10]\n    rubric: |\n"
             "      Score each reply 0-10 as JSON.\n"
             "      {% for r in replies %}<reply id=\"{{ loop.index }}\">{{ r }}</reply>\n      {% endfor %}\n")
    config = _judge_config(tmp_path, judge, max_steps="2", groups_per_batch="4", group_size="4")
    run_dir = tmp_path / "run"
    before = len(grader.requests)
    result = loops(local_server, "train", "run", str(config), "--run-dir", str(run_dir), "--set", "data.eval_prompts=null",
                   "--yes", "-o", "json")  # fmt: skip
    assert result.code == 0, result
    asked = grader.requests[before:]
    assert len(asked) == 2 * 4, [r["messages"][0]["content"][:60] for r in asked]  # 2 steps x 4 groups, 1 each
    assert all(r["messages"][0]["content"].count("<reply id=") == 4 for r in asked)
    records = [r for r in _metrics(run_dir) if not r.get("final")]
    assert [r["judge_requests"] for r in records] == [4, 4]
    # The grader's usage: prompt tokens = words of the rubric it got, completion = words of its JSON answer.
    prompt_words = sum(len(r["messages"][0]["content"].split()) for r in asked)
    assert sum(r["judge_prompt_tokens"] for r in records) == prompt_words
    assert all(r["judge_completion_tokens"] > 0 for r in records)
    summary = result.json()
    assert summary["judge"]["requests"] == 8 and summary["judge"]["prompt_tokens"] == prompt_words
    assert summary["judge"]["served_by"] == grader.url
    # Each reply's reward is the grader's score for it: 10 x the digit fraction, scaled to 0..1.
    import json

    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        text = s["completion"].strip()
        digits = round(10 * sum(c.isdigit() for c in text) / len(text)) if text else 0
        assert s["reward"] == pytest.approx(digits / 10), s
    # What people read at the end of `train run`: the summary's judge line.
    from baseten_loops_cli.training.experiments.rundir import RunDir
    from baseten_loops_cli.training.service import summary_of

    line = summary_of(RunDir(run_dir), summary["run_id"], "rl", "completed").judge_line()
    assert line == (f"Judge: 8 requests, {prompt_words:,} prompt + {summary['judge']['completion_tokens']:,} completion "
                    f"tokens (billed by {grader.url})")


def test_the_plan_counts_a_judges_tokens_and_prices_them(local_server, grader, tmp_path):
    from tests.cli_support import loops

    judge = f"    url: {grader.url}\n    model: grader\n    max_tokens: 16\n    rubric: \"{{{{ prompt }}}} <reply>{{{{ reply }}}}</reply>\"\n"
    config = _judge_config(tmp_path, judge, max_steps="2", groups_per_batch="4", group_size="4")
    priced = ["--set", "pricing.usd_per_million_judge_tokens=1000000"]
    result = loops(local_server, "train", "validate", str(config), "--set", "data.eval_prompts=null", *priced, "-o", "json")
    assert result.code == 0, result
    plan = result.json()["plan"]
    judge_plan = plan["judge"]
    assert judge_plan["requests"] == 2 * 4 * 4  # single mode: one request per reply
    assert judge_plan["completion_tokens"] == 32 * 16
    assert judge_plan["external_tokens"] == judge_plan["prompt_tokens"] + judge_plan["completion_tokens"]
    # $1 per judge token, nothing else priced: the cost is the judge's tokens.
    assert plan["estimated_cost_usd"] == pytest.approx(judge_plan["external_tokens"])
    assert any("the judge (" in n and "grades up to 32 requests" in n for n in plan["notes"])


def _usage(local_server, *args: str) -> dict:
    from tests.cli_support import loops

    result = loops(local_server, "usage", "--all", *args, "-o", "json")
    assert result.code == 0, result
    return result.json()


def test_a_checkpoint_judge_grades_through_the_runs_backend(local_server, tiny_sft_checkpoint, tmp_path):
    """`judge.model: RUN:final`: the rubric is rendered with the checkpoint's chat template and
    sampled (greedy) by a sampler of the run's backend; each reward is what the same checkpoint
    answers `loops sample --chat` at temperature 0, parsed. The judge's sampled tokens are in the
    backend's usage of that checkpoint's run, exactly as the run's judge_completion_tokens say."""
    import json

    from baseten_loops_cli.training.rewards.judge import parse_score
    from tests.cli_support import loops

    judge_run = tiny_sft_checkpoint.split(":")[0]

    def sampled_of_judge_run() -> int:
        runs = _usage(local_server, "--by-run")["runs"]
        return next(r["tokens_sampled"] for r in runs if r["run_id"] == judge_run)

    judge = f"    model: {tiny_sft_checkpoint}\n    scale: [0, 18]\n    max_tokens: 12\n    rubric: \"{{{{ prompt }}}}\"\n"
    config = _judge_config(tmp_path, judge, max_steps="1", groups_per_batch="4", group_size="2", max_failed_fraction="1.0")
    config.write_text(config.read_text().replace("tiny_rl_prompts", "tiny_distill_prompts"))
    run_dir = tmp_path / "run"
    before = sampled_of_judge_run()
    result = loops(local_server, "train", "run", str(config), "--run-dir", str(run_dir), "--yes", "-o", "json",
                   "--set", "data.eval_prompts=null")
    assert result.code == 0, result
    judge_sampled = sampled_of_judge_run() - before  # before `loops sample` below samples it too
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    answers: dict[str, float | None] = {}

    def answer(prompt: str) -> float | None:
        """The checkpoint's own greedy answer to the rubric (here: the prompt), parsed."""
        if prompt not in answers:
            direct = loops(local_server, "sample", tiny_sft_checkpoint, "--chat", "--prompt", prompt, "--temperature", "0",
                           "--max-tokens", "12", "-o", "json")  # fmt: skip
            assert direct.code == 0, direct
            answers[prompt] = parse_score(direct.json()["samples"][0]["text"], (0.0, 18.0), None)
        return answers[prompt]

    for prompt in {s["prompt"] for s in samples}:
        answer(prompt)
    assert any(v is not None for v in answers.values()), answers  # the SFT'd checkpoint answers with a number
    for s in samples:
        want = answers[s["prompt"]]
        if want is None:
            assert s.get("failed") and "answered without a score" in s["error"], s
        else:
            assert not s.get("failed") and s["reward"] == pytest.approx(want), (s, want)
    record = [r for r in _metrics(run_dir) if not r.get("final")][-1]
    # Identical rubrics are asked once (the cache): one request per prompt, two when it was unparseable.
    assert record["judge_requests"] == sum(1 if v is not None else 2 for v in answers.values())
    assert judge_sampled == record["judge_completion_tokens"] > 0
    assert result.json()["judge"]["served_by"] == f"the run's backend ({tiny_sft_checkpoint})"

    # `loops reward test` grades with the same checkpoint judge, outside a run (asked after the
    # usage figures above: `loops sample` samples the checkpoint too).
    tested = loops(local_server, "reward", "test", str(config), "--rows", "2", "-o", "json")
    rows = tested.json()
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert len(rows) == 2, tested
    for row in rows:
        want = answer(row["prompt"])
        if want is not None:
            assert row["reward"] == pytest.approx(want), (row, want)
        else:
            assert row.get("failed") and "grades inside" not in row["error"], row


def test_a_base_model_judge_samples_on_a_sampler_of_the_run(local_server, tmp_path):
    """`judge.model: loops-local/tiny`: a standalone sampler in the run's session serves it (its
    tokens are that sampler's row of `loops usage`) and is stopped with the run."""
    from tests.cli_support import loops

    judge = "    model: loops-local/tiny\n    max_tokens: 6\n    rubric: \"Rate 0-10: {{ reply }}\"\n"
    config = _judge_config(tmp_path, judge, max_steps="1", groups_per_batch="2", group_size="2", max_failed_fraction="1.0")
    run_dir = tmp_path / "run"
    seen = {r.get("sampler_id") for r in _usage(local_server)["rows"]}
    result = loops(local_server, "train", "run", str(config), "--run-dir", str(run_dir), "--yes", "-o", "json",
                   "--set", "data.eval_prompts=null")  # fmt: skip
    assert result.code == 0, result
    new = [r for r in _usage(local_server)["rows"] if r.get("sampler_id") and r["sampler_id"] not in seen]
    assert len(new) == 1 and new[0]["base_model"] == "loops-local/tiny" and new[0]["sampler_status"] == "INACTIVE", new
    record = [r for r in _metrics(run_dir) if not r.get("final")][-1]
    assert record["judge_requests"] >= 1 and record["judge_prompt_tokens"] > 0
    assert new[0]["tokens_sampled"] == record["judge_completion_tokens"]
