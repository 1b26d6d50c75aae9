"""The ``math_answer`` reward (math-verify, the [math] extra): equivalent answers match."""

from __future__ import annotations

from pathlib import Path

import pytest

from baseten_loops_cli.training.rewards.builtins import RewardError, build_reward, score

pytest.importorskip("math_verify")  # in the dev extra: CI runs these


class _Spec:
    fn = "math_answer"
    case_sensitive = False
    partial_credit = False
    pattern = None


@pytest.fixture(scope="module")
def reward():
    return build_reward(_Spec, Path("."))


@pytest.mark.parametrize("reply, answer, expected", [
    ("The sum is $\\boxed{82}$.", "82", 1.0),
    ("ANSWER: 82", "82", 1.0),
    ("so x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("$\\frac{2}{4}$", "$\\frac{1}{2}$", 1.0),
    ("ANSWER: 81", "82", 0.0),
    ("I don't know", "82", 0.0),
    # The question repeated is not its answer, though math-verify would work it out to 73.
    ("12 + 61 = x", "73", 0.0),
    ("$12 + 61$", "73", 0.0),
    ("The final answer is 73.", "73", 1.0),
    ("$2\\sqrt{3}$", "$2\\sqrt{3}$", 1.0),
])
def test_the_final_answer_is_compared_mathematically(reward, reply, answer, expected):
    name, fn = reward
    assert score(name, fn, reply, {"answer": answer}, "row:1") == expected


def test_a_row_without_an_answer_names_the_reward(reward):
    name, fn = reward
    with pytest.raises(RewardError, match="needs an 'answer' field"):
        score(name, fn, "42", {"prompt": "x"}, "row:1")


def test_scores_on_a_worker_thread_as_rollouts_run_it(reward):
    """Rewards run on the rollout workers' threads (training/isolation.py), where
    math-verify's own signal.alarm timeout raised "doesn't support threaded environment" and
    failed every rollout of the first SmolLM2 math run; reward_timeout_s bounds it instead."""
    import asyncio

    from baseten_loops_cli.training.rewards.isolation import Isolated

    name, fn = reward

    async def both() -> list[float]:
        isolated = Isolated(timeout_s=30, workers=2)
        return [await isolated.call("reward", score, name, fn, reply, {"answer": "82"}, "row:1")
                for reply in ("so \\boxed{82}", "ANSWER: 81")]

    assert asyncio.run(both()) == [1.0, 0.0]
