"""Judge rewards: a grader model scores replies against a rubric.

The grader is any OpenAI-compatible chat endpoint (``url``: vLLM, OpenAI, a ``loops deploy``
URL serving a Loops checkpoint). The rubric is a jinja2 template over ``prompt``, ``reply``
(``replies`` in group mode) and ``row`` (the prompt row's fields: ``{{ row.answer }}``); an
unknown name is a config error, a row without a field the rubric uses is that rollout's failure.

The score is parsed from the grader's answer: a number in ``scale`` (``Score: 7``, ``7/10``,
the last number), normalised to 0..1, or one of ``labels`` (``{good: 1, bad: 0}``) mapped to its
score. ``mode: group`` sends a whole group in one request and takes a score per reply (RULER's
JSON ``{"scores": [{"id": 1, "score": 0.8}, ...]}``, ``1: 7`` lines, or a ranking ``2 > 1 > 3``).
An answer without a score is asked again once (with a reminder of the format), then is a
:class:`~baseten_loops_cli.training.rewards.RewardError`: a failed rollout with the reason.
Identical requests are answered from a cache; the grader's tokens are counted in ``usage``.
The key is read from the environment variable ``api_key_env`` names, when a request is made:
it is never stored, logged or written (the transport redacts ``Authorization``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from typing import Any

from baseten_loops_cli.errors import ConfigError

TEMPLATE_NAMES = {"single": {"prompt", "reply", "row"}, "group": {"prompt", "replies", "row"}}
_NUMBER = r"-?\d+(?:\.\d+)?"
_SCORE_PATTERNS = (
    re.compile(rf"(?:score|rating|grade)\s*[:=]?\s*\**\s*({_NUMBER})", re.IGNORECASE),
    re.compile(rf"({_NUMBER})\s*/\s*{_NUMBER}"),
)


def _reward_error(message: str) -> Exception:
    from baseten_loops_cli.training.rewards import RewardError

    return RewardError(message)


def check_rubric(rubric: str, mode: str) -> None:
    """Raise ValueError (a config problem at the rubric's line) for a template that does not
    parse or names something other than the fields it gets."""
    import jinja2
    from jinja2 import meta

    try:
        names = meta.find_undeclared_variables(jinja2.Environment().parse(rubric))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"rubric is not a valid template: {exc.message} (line {exc.lineno} of the rubric)") from None
    unknown = sorted(names - TEMPLATE_NAMES[mode])
    if unknown:
        valid = ", ".join("{{ %s }}" % n for n in sorted(TEMPLATE_NAMES[mode]))
        raise ValueError(f"rubric uses unknown field {unknown[0]!r} (valid: {valid}; a row's field is {{{{ row.NAME }}}})")


def parse_score(text: str, scale: tuple[float, float], labels: dict[str, float] | None) -> float | None:
    """The grader's score of one reply, normalised to 0..1 (labels: their mapped score), or None."""
    if labels:
        best, where = None, -1
        for label, value in labels.items():
            for match in re.finditer(rf"(?<!\w){re.escape(label)}(?!\w)", text, re.IGNORECASE):
                if match.start() > where:
                    best, where = value, match.start()
        return best
    lo, hi = scale
    candidates = [m.group(1) for p in _SCORE_PATTERNS for m in p.finditer(text)] or re.findall(_NUMBER, text)[-1:]
    for raw in reversed(candidates):
        value = float(raw)
        if lo <= value <= hi:
            return (value - lo) / (hi - lo) if hi > lo else 1.0
    return None


def parse_group(text: str, n: int, scale: tuple[float, float]) -> list[float] | None:
    """One 0..1 score per reply of a group: RULER's JSON scores, ``ID: score`` lines, or a
    ranking ``best > ... > worst`` (ids 1..n); None when the answer does not cover every reply."""
    lo, hi = scale

    def norm(values: dict[int, float]) -> list[float] | None:
        if sorted(values) != list(range(1, n + 1)) or not all(lo <= v <= hi for v in values.values()):
            return None
        return [(values[i] - lo) / (hi - lo) if hi > lo else 1.0 for i in range(1, n + 1)]

    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        try:
            doc = json.loads(text[start : end + 1])
            entries = doc.get("scores") if isinstance(doc, dict) else None
            if isinstance(entries, list):
                values = {int(e.get("trajectory_id", e.get("id"))): float(e["score"]) for e in entries}
                return norm(values)
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
    ranking = re.search(r"\d+(?:\s*>\s*\d+)+", text)
    if ranking:
        order = [int(x) for x in re.findall(r"\d+", ranking.group())]
        if sorted(order) == list(range(1, n + 1)):
            return [1.0 - order.index(i) / (n - 1) if n > 1 else 1.0 for i in range(1, n + 1)]
    lines = dict(re.findall(rf"(?m)^\W*(?:reply|response|trajectory)?\s*#?(\d+)\s*[:=-]\s*({_NUMBER})", text, re.IGNORECASE))
    if lines:
        return norm({int(k): float(v) for k, v in lines.items()})
    return None


def _prompt_text(row: dict) -> str:
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    messages = row.get("messages") or []
    users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else ""


class Judge:
    """One configured grader (``reward.judge``): render, ask (cached), parse, count tokens."""

    def __init__(self, spec: Any, where: str = "reward.judge"):
        import jinja2

        self.spec = spec
        self.where = where
        self.scale = (float(spec.scale[0]), float(spec.scale[1]))
        self.labels = dict(spec.labels) if spec.labels else None
        self.template = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False).from_string(spec.rubric)
        self.usage = {"requests": 0, "cached": 0, "prompt_tokens": 0, "completion_tokens": 0}
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()
        self._http: Any = None

    # -------------------------------------------------------------- transport
    def _client(self) -> Any:
        from baseten_loops_cli.api.http import HttpClient

        if self._http is None:
            headers = {}
            if self.spec.api_key_env:
                key = os.environ.get(self.spec.api_key_env)
                if not key:
                    raise ConfigError(
                        f"{self.where}: the environment variable {self.spec.api_key_env} (api_key_env) is not set",
                        hint=f"export {self.spec.api_key_env}=... before running.",
                    )
                headers["Authorization"] = f"Bearer {key}"
            self._http = HttpClient(self.spec.url, None, headers=headers, timeout=self.spec.timeout_s, max_retries=2)
        return self._http

    def _failure(self, exc: Exception) -> ConfigError:
        from baseten_loops_cli.api.errors import AuthenticationError, NotFoundError

        if isinstance(exc, AuthenticationError):
            return ConfigError(f"{self.where}: the judge at {self.spec.url} refused the key (401/403)",
                               hint="Name the variable holding the grader's key in reward.judge.api_key_env and export it.")
        if isinstance(exc, NotFoundError):
            return ConfigError(f"{self.where}: {self.spec.url} has no OpenAI /chat/completions route (404)",
                               hint="Give the grader's OpenAI base URL, ending in /v1 (a `loops deploy` URL does).")
        return ConfigError(f"{self.where}: the judge at {self.spec.url} does not answer ({type(exc).__name__})",
                           hint="Check reward.judge.url and that the grader is up (curl URL/models).")

    def check(self) -> None:
        """Before provisioning: the grader answers and takes the key."""
        from baseten_loops_cli.errors import LoopsError

        try:
            self._client().send("GET", "/models")
        except ConfigError:
            raise
        except LoopsError as exc:
            raise self._failure(exc) from None

    def _ask(self, messages: list[dict]) -> str:
        from baseten_loops_cli.errors import LoopsError

        body = {"model": self.spec.model or "judge", "messages": messages, "max_tokens": self.spec.max_tokens,
                "temperature": self.spec.temperature}  # fmt: skip
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        with self._lock:
            if key in self._cache:
                self.usage["cached"] += 1
                return self._cache[key]
        try:
            payload = self._client().send("POST", "/chat/completions", json=body, repeatable=True).json()
        except LoopsError as exc:
            raise _reward_error(self._failure(exc).message) from None
        try:
            text = payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise _reward_error(f"{self.where}: the judge's answer has no choices[0].message.content") from None
        usage = payload.get("usage") or {}
        with self._lock:
            self._cache[key] = text
            self.usage["requests"] += 1
            self.usage["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
            self.usage["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        return text

    def _render(self, **fields: Any) -> str:
        import jinja2

        try:
            return self.template.render(**fields)
        except jinja2.UndefinedError as exc:
            raise _reward_error(f"{self.where}: the rubric uses a field this row does not have ({exc.message})") from None

    def _ask_until_parsed(self, content: str, parse: Any, what: str) -> Any:
        messages = [{"role": "user", "content": content}]
        answer = self._ask(messages)
        value = parse(answer)
        if value is None:  # once more, reminded of the format
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"Your answer had no {what}. Reply with {what} only."}]
            answer = self._ask(messages)
            value = parse(answer)
        if value is None:
            raise _reward_error(f"{self.where}: the judge answered without {what} twice: {answer[:120]!r}")
        return value

    # -------------------------------------------------------------- what rewards call
    def what(self) -> str:
        if self.labels:
            return "one of the labels " + ", ".join(self.labels)
        return f"a score from {self.scale[0]:g} to {self.scale[1]:g}"

    def score(self, reply: str, row: dict) -> float:
        """One reply's reward (0..1 on a numeric scale; the label's score with labels)."""
        content = self._render(prompt=_prompt_text(row), reply=reply, row=row)
        return float(self._ask_until_parsed(content, lambda text: parse_score(text, self.scale, self.labels), self.what()))

    def score_group(self, replies: list[str], row: dict) -> list[float]:
        """``mode: group``: every reply of one prompt in one request (RULER); a 0..1 score each."""
        content = self._render(prompt=_prompt_text(row), replies=replies, row=row)
        what = f"a score from {self.scale[0]:g} to {self.scale[1]:g} for each of the {len(replies)} replies"
        return self._ask_until_parsed(content, lambda text: parse_group(text, len(replies), self.scale), what)

    def group_reward(self) -> Any:
        """``mode: group`` as a reward: loops that score whole groups call its ``score_group``
        (distill does); one called per reply gets a RewardError saying so."""

        def one_at_a_time(reply: str, row: dict) -> float:
            raise _reward_error(f"{self.where}: mode: group scores whole groups; this loop scores replies one "
                                "at a time (use mode: single)")

        one_at_a_time.score_group = self.score_group  # type: ignore[attr-defined]
        one_at_a_time.judge = self  # type: ignore[attr-defined]
        return one_at_a_time

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


def judge_of(fn: Any) -> Judge | None:
    """The Judge behind a reward function built by ``rewards.build_reward`` (None for others):
    how a loop reaches its token counts."""
    owner = getattr(fn, "__self__", None) or getattr(fn, "judge", None)
    return owner if isinstance(owner, Judge) else None
