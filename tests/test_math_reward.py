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
])
def test_the_final_answer_is_compared_mathematically(reward, reply, answer, expected):
    name, fn = reward
    assert score(name, fn, reply, {"answer": answer}, "row:1") == expected


def test_a_row_without_an_answer_names_the_reward(reward):
    name, fn = reward
    with pytest.raises(RewardError, match="needs an 'answer' field"):
        score(name, fn, "42", {"prompt": "x"}, "row:1")
