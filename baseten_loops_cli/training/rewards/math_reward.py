"""The ``math_answer`` reward: is the reply's final answer the row's ``answer``, mathematically?

As TRL's ``accuracy_reward``: `math-verify` parses the gold answer and the reply (LaTeX such as
``\\boxed{\\frac{1}{2}}`` or plain expressions such as ``0.5``) and checks them for equivalence,
so ``1/2``, ``0.5`` and ``\\frac12`` all match. math-verify is the optional extra ``[math]``,
imported only when this reward is used.
"""

from __future__ import annotations

import logging
from typing import Any

from baseten_loops_cli.errors import ConfigError

NAME = "math_answer"


def _without_timeout_notice(record: logging.LogRecord) -> bool:
    """math-verify warns once that its timeout is off: it is, on purpose (reward_timeout_s
    bounds the call), so the warning would only puzzle a user reading the run's output."""
    return not record.getMessage().startswith("Timeout is disabled")


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError:
        raise ConfigError(
            f"reward {NAME!r} needs the math-verify package",
            hint="Install it with: pip install 'baseten-loops-cli[math]'",
        ) from None
    return math_verify


def _unworked_arithmetic(value: Any) -> bool:
    """Whether an extracted answer is a sum or product of plain numbers left for the grader to
    work out (``$12 + 61$``): that is the question, not its answer. A value such as ``2\\sqrt{3}``
    or ``\\frac{1}{2}`` is an answer."""
    from sympy import Add, Mul

    return isinstance(value, (Add, Mul)) and all(arg.is_Rational for arg in value.args)


def build() -> Any:
    """The reward function (checks now that math-verify is installed)."""
    mv = _math_verify()
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    for module in ("math_verify.parser", "math_verify.grader"):  # see math_answer below
        logging.getLogger(module).addFilter(_without_timeout_notice)

    # The reply's answer: a boxed / $...$ LaTeX answer first, else a plain expression after an
    # answer anchor ("answer:", "the final answer is"; TRL's accuracy_reward takes anchored
    # LaTeX only, rows with plain numbers need the second). Not any plain expression: the first
    # SmolLM2 math run scored "12 + 61 = x" as the answer 73, a reward a policy learns to
    # collect by repeating the question.
    reply_config = [LatexExtractionConfig(boxed_match_priority=0),
                    ExprExtractionConfig(try_extract_without_anchor=False)]

    # No timeouts of math-verify's own: they use signal.alarm, which only the main thread may
    # set, and rewards run on worker threads (the first SmolLM2 math run failed every rollout
    # with "doesn't support threaded environment"). reward_timeout_s bounds the call instead.
    def math_answer(completion: str, row: dict) -> float:
        from baseten_loops_cli.training.rewards.builtins import RewardError

        if "answer" not in row:
            raise RewardError(f"reward {NAME!r} needs an 'answer' field in each prompt row")
        gold = mv.parse(str(row["answer"]), extraction_mode="first_match", parsing_timeout=None)
        if not gold:
            raise RewardError(f"reward {NAME!r}: math-verify cannot parse the row's answer {str(row['answer'])[:80]!r}")
        answer = mv.parse(completion, extraction_config=reply_config, extraction_mode="first_match",
                          parsing_timeout=None)
        if not answer or _unworked_arithmetic(answer[0]):
            return 0.0
        return float(mv.verify(gold, answer, timeout_seconds=None))

    return math_answer
