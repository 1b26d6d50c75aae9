"""Reward functions for RL: builtins, or ``path/to/file.py:function`` from the config's folder.

A reward is ``fn(completion: str, row: dict) -> float``. Code is loaded only from the file the
config names (resolved relative to the config file), never from an import path.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any, Callable

from baseten_loops_cli.errors import ConfigError, LoopsError

RewardFn = Callable[[str, dict], float]

BUILTINS = ("exact_match", "numeric_match", "regex", "contains", "starts_with", "math_answer", "judge")


class RewardError(LoopsError):
    """A reward function raised or returned a non-number."""


def _answer(row: dict, name: str) -> str:
    if "answer" not in row:
        raise RewardError(f"reward {name!r} needs an 'answer' field in each prompt row")
    return str(row["answer"])


def _norm(text: str, case_sensitive: bool) -> str:
    text = text.strip()
    return text if case_sensitive else text.lower()


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _prefix_credit(completion: str, answer: str) -> float:
    """Fraction of ``answer`` matched as a prefix of ``completion`` (partial credit)."""
    if not answer:
        return 1.0
    n = 0
    for a, b in zip(completion, answer):
        if a != b:
            break
        n += 1
    return n / len(answer)


def build_reward(spec: Any, base_dir: Path) -> tuple[str, RewardFn]:
    """Return (display name, function) for a RewardConfig."""
    name = spec.fn
    cs = spec.case_sensitive
    if name == "exact_match":
        return name, lambda c, row: float(_norm(c, cs) == _norm(_answer(row, name), cs))
    if name == "contains":
        if spec.partial_credit:
            def contains_partial(c: str, row: dict) -> float:
                answer, text = _norm(_answer(row, name), cs), _norm(c, cs)
                if answer in text:
                    return 1.0
                return max((_prefix_credit(text[i:], answer) for i in range(len(text))), default=0.0) * 0.5

            return name, contains_partial
        return name, lambda c, row: float(_norm(_answer(row, name), cs) in _norm(c, cs))
    if name == "starts_with":
        if spec.partial_credit:
            return name, lambda c, row: _prefix_credit(_norm(c, cs), _norm(_answer(row, name), cs))
        return name, lambda c, row: float(_norm(c, cs).startswith(_norm(_answer(row, name), cs)))
    if name == "numeric_match":
        def numeric(c: str, row: dict) -> float:
            match = _NUMBER.search(c)
            if not match:
                return 0.0
            try:
                return float(math.isclose(float(match.group()), float(_answer(row, name)), rel_tol=1e-9, abs_tol=1e-9))
            except ValueError:
                return 0.0

        return name, numeric
    if name == "regex":
        if not spec.pattern:
            raise ConfigError("reward.fn 'regex' needs reward.pattern")
        try:
            pattern = re.compile(spec.pattern, 0 if cs else re.IGNORECASE)
        except re.error as exc:
            raise ConfigError(f"reward.pattern is not a valid regex: {exc}") from None
        return name, lambda c, row: float(bool(pattern.search(c)))
    if name == "math_answer":  # math-verify, the optional [math] extra (training/math_reward.py)
        from baseten_loops_cli.training import math_reward

        return name, math_reward.build()
    if name == "judge":  # a grader model (training/judge.py)
        if spec.judge is None:
            raise ConfigError("reward.fn 'judge' needs reward.judge (url, rubric)", hint="See README, Judge rewards.")
        from baseten_loops_cli.training.judge import Judge

        judge = Judge(spec.judge)
        return name, (judge.score if spec.judge.mode == "single" else judge.group_reward())
    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        return name, _load_file_reward(name, base_dir)
    import difflib

    close = difflib.get_close_matches(name, BUILTINS, n=1)
    raise ConfigError(
        f"unknown reward {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""),
        hint=f"Use one of {', '.join(BUILTINS)} or path/to/file.py:function.",
    )


def _load_file_reward(spec: str, base_dir: Path) -> RewardFn:
    file_part, func_name = spec.rsplit(":", 1)
    path = Path(file_part)
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise ConfigError(f"reward file {path} not found", hint="Paths are relative to the config file.")
    module_spec = importlib.util.spec_from_file_location(f"loops_reward_{abs(hash(str(path)))}", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"cannot load reward file {path}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: report it, don't crash
        raise ConfigError(f"reward file {path} failed to import: {type(exc).__name__}: {exc}",
                          hint=f"Fix the error, then check with `python {path}`.") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(f"reward file {path} has no function {func_name!r}",
                          hint="Name a function the file defines: reward: path/to/file.py:function.")
    return fn


def score(name: str, fn: RewardFn, completion: str, row: dict, source: str) -> float:
    """Call the reward, turning a raise or a non-number into a RewardError naming it and the row."""
    try:
        value = fn(completion, row)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} (prompt {source})") from None
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise RewardError(f"reward {name!r} returned {value!r}, not a finite number (prompt {source})")
    return float(value)


def completion_text(tokenizer: Any, tokens: list[int], stop: list[str]) -> str:
    """What the reward sees: the decoded completion, cut at the stop strings."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for stop_text in stop:
        if stop_text in text:
            text = text[: text.index(stop_text)]
    return text
