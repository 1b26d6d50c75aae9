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


def _exact_match(spec: Any) -> RewardFn:
    cs = spec.case_sensitive
    return lambda c, row: float(_norm(c, cs) == _norm(_answer(row, spec.fn), cs))


def _contains(spec: Any) -> RewardFn:
    cs, name = spec.case_sensitive, spec.fn
    if spec.partial_credit:
        def contains_partial(c: str, row: dict) -> float:
            answer, text = _norm(_answer(row, name), cs), _norm(c, cs)
            if answer in text:
                return 1.0
            return max((_prefix_credit(text[i:], answer) for i in range(len(text))), default=0.0) * 0.5

        return contains_partial
    return lambda c, row: float(_norm(_answer(row, name), cs) in _norm(c, cs))


def _starts_with(spec: Any) -> RewardFn:
    cs, name = spec.case_sensitive, spec.fn
    if spec.partial_credit:
        return lambda c, row: _prefix_credit(_norm(c, cs), _norm(_answer(row, name), cs))
    return lambda c, row: float(_norm(c, cs).startswith(_norm(_answer(row, name), cs)))


def _numeric_match(spec: Any) -> RewardFn:
    def numeric(c: str, row: dict) -> float:
        match = _NUMBER.search(c)
        if not match:
            return 0.0
        try:
            return float(math.isclose(float(match.group()), float(_answer(row, spec.fn)), rel_tol=1e-9, abs_tol=1e-9))
        except ValueError:
            return 0.0

    return numeric


def _pattern(spec: Any) -> re.Pattern:
    if not spec.pattern:
        raise ConfigError(f"reward.fn {spec.fn!r} needs reward.pattern")
    try:
        return re.compile(spec.pattern, 0 if spec.case_sensitive else re.IGNORECASE)
    except re.error as exc:
        raise ConfigError(f"reward.pattern is not a valid regex: {exc}") from None


def _regex(spec: Any) -> RewardFn:
    pattern = _pattern(spec)
    return lambda c, row: float(bool(pattern.search(c)))


def _format(spec: Any) -> RewardFn:
    """1 when the whole (stripped) reply matches ``pattern``, else 0."""
    pattern = _pattern(spec)
    return lambda c, row: float(bool(pattern.fullmatch(c.strip())))


def _length(spec: Any) -> RewardFn:
    """A penalty: 0 up to ``max_chars``, then -(excess / max_chars), at most -1."""
    if spec.max_chars is None:
        raise ConfigError("reward.fn 'length' needs reward.max_chars", hint="e.g. {fn: length, max_chars: 200, weight: 0.5}")
    limit = spec.max_chars
    return lambda c, row: -min(1.0, max(0, len(c.strip()) - limit) / limit)


def _repetition(spec: Any) -> RewardFn:
    """A penalty: minus the share of the reply's word n-grams that repeat an earlier one."""
    n = spec.ngram

    def repetition(c: str, row: dict) -> float:
        words = c.split()
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        return -(1.0 - len(set(grams)) / len(grams)) if grams else 0.0

    return repetition


# The builtins: name -> builder(RewardConfig) -> RewardFn. A new builtin is one entry here.
def _math_answer(spec: Any) -> RewardFn:
    """math-verify, the optional [math] extra (training/rewards/math_reward.py)."""
    from baseten_loops_cli.training.rewards import math_reward

    return math_reward.build()


def _judge(spec: Any) -> RewardFn:
    """A grader model (training/rewards/judge.py); ``mode: group`` scores a whole group in one request."""
    if spec.judge is None:
        raise ConfigError("reward.fn 'judge' needs reward.judge (url or model, and rubric)", hint="See README, Judge rewards.")
    from baseten_loops_cli.training.rewards.judge import Judge

    judge = Judge(spec.judge)
    return judge.score if spec.judge.mode == "single" else judge.group_reward()


BUILDERS: dict[str, Callable[[Any], RewardFn]] = {
    "exact_match": _exact_match,
    "numeric_match": _numeric_match,
    "regex": _regex,
    "contains": _contains,
    "starts_with": _starts_with,
    "format": _format,
    "length": _length,
    "repetition": _repetition,
    "math_answer": _math_answer,
    "judge": _judge,
}
BUILTINS = tuple(BUILDERS)


def build_reward(spec: Any, base_dir: Path) -> tuple[str, RewardFn]:
    """Return (display name, function) for a RewardConfig."""
    name = spec.fn
    if name in BUILDERS:
        return name, BUILDERS[name](spec)
    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        return name, _load_file_reward(name, base_dir)
    import difflib

    close = difflib.get_close_matches(name, BUILTINS, n=1)
    raise ConfigError(
        f"unknown reward {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""),
        hint=f"Use one of {', '.join(BUILTINS)} or path/to/file.py:function.",
    )


def reward_label(spec: Any) -> str:
    """A reward's metric name in a list of rewards: its ``name``, else the builtin or function name."""
    return spec.name or spec.fn.rsplit(":", 1)[-1]


def build_rewards(specs: Any, base_dir: Path) -> list[tuple[str, RewardFn, float]]:
    """(metric name, function, weight) of each reward of a list (or of the one reward)."""
    specs = specs if isinstance(specs, list) else [specs]
    out, seen = [], set()
    for spec in specs:
        label = reward_label(spec)
        if label in seen:
            raise ConfigError(f"two rewards are named {label!r}", hint="Give one a name: {fn: ..., name: NAME}.")
        seen.add(label)
        out.append((label, build_reward(spec, base_dir)[1], spec.weight))
    return out


def _load_file_reward(spec: str, base_dir: Path) -> RewardFn:
    return load_from_file(spec, base_dir, "reward", callable_hint="function")


def load_from_file(spec: str, base_dir: Path, what: str, *, callable_hint: str = "function") -> Any:
    """The object ``NAME`` of ``path/to/file.py:NAME`` (relative to ``base_dir``), loaded from that
    file only: never through the import system, so a same-named module on PYTHONPATH or in the
    working directory is never run instead. ``what`` names it in errors (reward, env)."""
    file_part, attr = spec.rsplit(":", 1)
    path = Path(file_part)
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise ConfigError(f"{what} file {path} not found", hint="Paths are relative to the config file.")
    module_spec = importlib.util.spec_from_file_location(f"loops_{what}_{abs(hash(str(path)))}", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"cannot load {what} file {path}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: report it, don't crash
        raise ConfigError(f"{what} file {path} failed to import: {type(exc).__name__}: {exc}",
                          hint=f"Fix the error, then check with `python {path}`.") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ConfigError(f"{what} file {path} has no {callable_hint} {attr!r}",
                          hint=f"Name a {callable_hint} the file defines: {what}: path/to/file.py:NAME.")
    return obj


def reward_value(value: Any) -> float | None:
    """A reward as a float, or None when it is not a finite number (bool counts as 0/1)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        return None
    return float(value)


def score(name: str, fn: RewardFn, completion: str, row: dict, source: str) -> float:
    """Call the reward, turning a raise or a non-number into a RewardError naming it and the row."""
    try:
        value = fn(completion, row)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} (prompt {source})") from None
    number = reward_value(value)
    if number is None:
        raise RewardError(f"reward {name!r} returned {value!r}, not a finite number (prompt {source})")
    return number


def completion_text(tokenizer: Any, tokens: list[int], stop: list[str]) -> str:
    """What the reward sees: the decoded completion, cut at the stop strings."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for stop_text in stop:
        if stop_text in text:
            text = text[: text.index(stop_text)]
    return text
