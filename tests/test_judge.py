"""Judge rewards (training/judge.py) against a real OpenAI-compatible grader over HTTP.

The grader is examples/judge/grader.py (starlette, served by uvicorn on 127.0.0.1 in a thread):
its answers are known (10 x the digit fraction of the reply), so every parsed score is checked.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.judge import Judge, check_rubric, parse_group, parse_score
from baseten_loops_cli.training.rewards import RewardError, build_reward

ROOT = Path(__file__).resolve().parent.parent
RUBRIC = "Question: {{ prompt }}\nExpected: {{ row.answer }}\n<reply>{{ reply }}</reply>\nScore 0-10."
GROUP_RUBRIC = ("Question: {{ prompt }}\n{% for r in replies %}<reply id=\"{{ loop.index }}\">{{ r }}</reply>\n{% endfor %}"
                "Score each reply 0-10 as JSON.")


@pytest.fixture(scope="module")
def grader_url(monkeypatch_module=None):
    import importlib.util

    import uvicorn

    spec = importlib.util.spec_from_file_location("loops_example_grader", ROOT / "examples" / "judge" / "grader.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(module.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


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
    from baseten_loops_cli.training.judge import judge_of

    spec = RewardConfig(fn="judge", judge=JudgeConfig(url=grader_url, model="grader", rubric=RUBRIC))
    name, fn = build_reward(spec, ROOT)
    assert fn("12", {"prompt": "p", "answer": "1"}) == 1.0
    assert judge_of(fn).usage["requests"] == 1
    group = RewardConfig(fn="judge", judge=JudgeConfig(url=grader_url, rubric=GROUP_RUBRIC, mode="group"))
    _, group_fn = build_reward(group, ROOT)
    assert group_fn.score_group(["1", "x"], {"prompt": "p"}) == [1.0, 0.0] and judge_of(group_fn) is not None
    with pytest.raises(RewardError, match="mode: group scores whole groups"):
        group_fn("1", {"prompt": "p"})
