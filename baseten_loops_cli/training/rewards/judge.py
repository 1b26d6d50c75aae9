"""Judge rewards: a grader model scores replies against a rubric.

The grader is any OpenAI-compatible chat endpoint (``url``: vLLM, OpenAI, a ``loops deploy``
URL serving a Loops checkpoint), or (``model`` without ``url``) a Loops sampler checkpoint or a
base model served by a sampler of the run's backend: the rubric's messages are rendered with that
model's chat template and sampled through the SDK's sampling route (:class:`~baseten_loops_cli.
training.rewards.teacher.ServedModel`, the distillation teacher's machinery), so it runs on every backend.
Either way the answer goes through the same parser. The rubric is a jinja2 template over ``prompt``, ``reply``
(``replies`` in group mode) and ``row`` (the prompt row's fields: ``{{ row.answer }}``); an
unknown name is a config error, a row without a field the rubric uses is that rollout's failure.

The score is parsed from the grader's answer: a number in ``scale`` (``Score: 7``, ``7/10``,
the last number), normalised to 0..1, or one of ``labels`` (``{good: 1, bad: 0}``) mapped to its
score. ``mode: group`` sends a whole group in one request and takes a score per reply (RULER's
JSON ``{"scores": [{"id": 1, "score": 0.8}, ...]}``, ``1: 7`` lines, or a ranking ``2 > 1 > 3``).
An answer without a score is asked again once (with a reminder of the format), then is a
:class:`~baseten_loops_cli.training.rewards.builtins.RewardError`: a failed rollout with the reason.
Identical requests are answered from a cache; the grader's tokens are counted in ``usage`` (a
URL's from the OpenAI ``usage`` field of its answers, a served model's as rendered and sampled),
which the loops record per step (``judge_*`` metrics) and the run's summary totals.
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
    from baseten_loops_cli.training.rewards.builtins import RewardError

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
        self._pending: dict[str, threading.Event] = {}  # requests in flight, by cache key
        self._lock = threading.Lock()
        self._http: Any = None
        self._served: Any = None  # a checkpoint or base model judge: teacher.ServedModel, bound by serve_on
        self._sampler: Any = None
        self._pin: str | None = None
        self._tokenizer: Any = None

    @property
    def served(self) -> bool:
        """Graded by a model served by a sampler of the run's backend (no url)."""
        return not self.spec.url

    def serve_on(self, session: Any) -> None:
        """A checkpoint or base model judge: open its sampler on the run's backend (``session``:
        a TrainingSession). Nothing for a URL judge."""
        if not self.served or self._served is not None:
            return
        from baseten_loops_cli.tokenization import get_tokenizer
        from baseten_loops_cli.training.rewards.teacher import ServedModel

        served = ServedModel(session, self.spec.model)
        self._tokenizer = get_tokenizer(served.base_model)
        self._served = served

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

    def check(self, client: Any = None) -> None:
        """Before provisioning: the grader answers and takes the key (a URL), or the backend
        (``client``) has the checkpoint or serves the base model (a served judge)."""
        from baseten_loops_cli.errors import LoopsError

        if self.served:
            self._check_served(client)
            return
        try:
            self._client().send("GET", "/models")
        except ConfigError:
            raise
        except LoopsError as exc:
            raise self._failure(exc) from None

    def _check_served(self, client: Any) -> None:
        from baseten_loops_cli.training.rewards.teacher import is_checkpoint_ref

        model = self.spec.model
        if is_checkpoint_ref(model):
            from baseten_loops_cli.services.resolve import NotFound, resolve_checkpoint

            try:
                checkpoint = resolve_checkpoint(client, model, prefer="sampler")
            except NotFound as exc:
                raise ConfigError(f"{self.where}: the judge checkpoint {model!r} does not exist ({exc.message})",
                                  hint="Name a sampler checkpoint: RUN:NAME or a bt:// URI (loops checkpoints list "
                                       "--target sampler).") from None
            if checkpoint.target != "sampler":
                raise ConfigError(f"{self.where}: the judge checkpoint {model!r} is a trainer checkpoint",
                                  hint="A judge samples: name a sampler checkpoint (loops checkpoints list --target sampler).")
            self._check_tokenizer(checkpoint.base_model or "")
            return
        import os.path

        names = [m.model_name for m in client.capabilities()]
        if model not in names and os.path.isabs(model):
            names += [m.model_name for m in client.capabilities(model=model)]
        if model not in names:
            import difflib

            close = difflib.get_close_matches(model, names, n=1)
            raise ConfigError(
                f"{self.where}: the judge base model {model!r} is not served by this backend"
                + (f"; did you mean {close[0]!r}?" if close else ""),
                hint=f"Name a base model this backend serves ({', '.join(names) or 'none'}), a checkpoint "
                     "(RUN:NAME), or an OpenAI-compatible url.",
            )
        self._check_tokenizer(model)

    def _check_tokenizer(self, base_model: str) -> None:
        """The rubric is rendered with the judge model's chat template: its tokenizer must be here."""
        from baseten_loops_cli.tokenization import get_tokenizer

        try:
            get_tokenizer(base_model)
        except Exception as exc:  # the tokenization layer's own errors: say which judge needs it
            detail = getattr(exc, "message", None) or str(exc)
            raise ConfigError(f"{self.where}: the judge model {base_model!r} has no tokenizer here ({detail})",
                              hint=getattr(exc, "hint", None) or "The judge's chat template renders the rubric: "
                                   "make its tokenizer available (loops server pull-model) or use url:.") from None

    def _ask_served(self, messages: list[dict]) -> tuple[str, int, int]:
        """Render with the judge model's chat template, sample (greedy at temperature 0) on the
        run's backend, decode: (text, prompt tokens, completion tokens)."""
        from baseten_loops_cli.errors import LoopsError
        from baseten_loops_cli.tokenization import render_generation_prompt

        if self._served is None:
            raise _reward_error(f"{self.where}: the judge {self.spec.model} is served by the run's backend: it grades "
                                "in `loops train run` and `loops reward test`, not here (serve it with `loops deploy` "
                                "and give its url)")
        tokenizer = self._tokenizer
        tokens = render_generation_prompt(tokenizer, messages)
        with self._lock:
            if self._sampler is None:
                self._sampler, self._pin = self._served.client()
        try:
            result = self._sampler.sample(tokens, n=1, max_tokens=self.spec.max_tokens, temperature=self.spec.temperature,
                                          seed=0, stop=list(tokenizer.stop_token_ids), checkpoint_path=self._pin)  # fmt: skip
        except LoopsError as exc:
            raise _reward_error(f"{self.where}: the judge {self.spec.model} could not sample: {exc.message}") from None
        completion = list(result.sequences[0].tokens) if result.sequences else []
        return tokenizer.decode(completion, skip_special_tokens=True), len(tokens), len(completion)

    def _ask(self, messages: list[dict]) -> str:
        """The judge's answer to ``messages``: from the cache, else asked once. Identical requests
        in flight at once (two equal replies of a group) wait for the first one's answer."""
        body = {"model": self.spec.model or "judge", "messages": messages, "max_tokens": self.spec.max_tokens,
                "temperature": self.spec.temperature}  # fmt: skip
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        while True:
            with self._lock:
                if key in self._cache:
                    self.usage["cached"] += 1
                    return self._cache[key]
                pending = self._pending.get(key)
                if pending is None:
                    pending = self._pending[key] = threading.Event()
                    break
            pending.wait()  # then the cache has it, or that request failed and this one asks itself
        try:
            text, prompt_tokens, completion_tokens = self._ask_served(messages) if self.served else self._ask_url(body)
            with self._lock:
                self._cache[key] = text
                self.usage["requests"] += 1
                self.usage["prompt_tokens"] += prompt_tokens
                self.usage["completion_tokens"] += completion_tokens
            return text
        finally:
            with self._lock:
                self._pending.pop(key, None)
            pending.set()

    def _ask_url(self, body: dict) -> tuple[str, int, int]:
        """One request to the URL judge: (text, its usage's prompt tokens, completion tokens)."""
        from baseten_loops_cli.errors import LoopsError

        try:
            payload = self._client().send("POST", "/chat/completions", json=body, repeatable=True).json()
        except LoopsError as exc:
            raise _reward_error(self._failure(exc).message) from None
        try:
            text = payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise _reward_error(f"{self.where}: the judge's answer has no choices[0].message.content") from None
        usage = payload.get("usage") or {}
        return text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)

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
        (rl and distill do, once per group); one called per reply gets a RewardError saying so."""

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
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        if self._served is not None:
            self._served.close()
            self._served = None


def judge_of(fn: Any) -> Judge | None:
    """The Judge behind a reward function built by ``rewards.build_reward`` (None for others):
    how a loop reaches its token counts."""
    owner = getattr(fn, "__self__", None) or getattr(fn, "judge", None)
    return owner if isinstance(owner, Judge) else None


JUDGE_METRICS = ("judge_requests", "judge_prompt_tokens", "judge_completion_tokens")


class JudgeMeter:
    """The judges among a run's reward functions: bound to the run's backend (a checkpoint or
    base model judge samples there), and their tokens per step. A step record gets what the
    judges used since the previous one (``judge_requests``, ``judge_prompt_tokens``,
    ``judge_completion_tokens``; cached answers cost nothing), so metrics.jsonl sums to the run's
    total across resumes (each step is recorded once), which the run's summary shows."""

    def __init__(self, fns: Any, session: Any) -> None:
        self.judges: list[Judge] = []
        for fn in fns or []:
            judge = judge_of(fn)
            if judge is not None and judge not in self.judges:
                judge.serve_on(session)
                self.judges.append(judge)
        self._seen = dict.fromkeys(JUDGE_METRICS, 0)

    def step_metrics(self) -> dict:
        """What the judges used since the last call ({} without judges)."""
        if not self.judges:
            return {}
        now = {"judge_requests": sum(j.usage["requests"] for j in self.judges),
               "judge_prompt_tokens": sum(j.usage["prompt_tokens"] for j in self.judges),
               "judge_completion_tokens": sum(j.usage["completion_tokens"] for j in self.judges)}  # fmt: skip
        out = {name: now[name] - self._seen[name] for name in JUDGE_METRICS}
        self._seen = now
        return out

    def close(self) -> None:
        for judge in self.judges:
            judge.close()


def usage_of_records(records: list[dict]) -> dict | None:
    """A run's judge totals from its metrics records (None when it has no judge metrics)."""
    if not any(name in r for r in records for name in JUDGE_METRICS):
        return None
    totals = {name.removeprefix("judge_"): sum(int(r.get(name) or 0) for r in records) for name in JUDGE_METRICS}
    totals["tokens"] = totals["prompt_tokens"] + totals["completion_tokens"]
    return totals


def plan_tokens(specs: Any, tokenizer: Any, passes: list[list[Any]], *, group_size: int, reply_tokens: int) -> dict | None:
    """The plan's share of the run's judges (None without one): requests and tokens, upper bounds.
    ``passes`` are the prompt batches that get graded (every step's, each eval's); every prompt
    has ``group_size`` replies of ``reply_tokens`` tokens (sampling.max_tokens) and every answer
    is ``max_tokens`` long. The rubric is rendered with each row and counted with the student's
    tokenizer (a URL judge's own tokenizer is not known here); the chat template's few tokens,
    retries and cache hits are left out."""
    import jinja2

    judges = [s.judge for s in (specs if isinstance(specs, list) else [specs]) if getattr(s, "judge", None) is not None]
    if not judges:
        return None
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
    requests = prompt_tokens = completion_tokens = backend_tokens = 0
    for spec in judges:
        before = prompt_tokens + completion_tokens
        template = env.from_string(spec.rubric)
        group = spec.mode == "group"
        rubric_tokens: dict[int, int] = {}  # per prompt (by identity): the rubric rendered around empty replies
        for batch in passes:
            for prompt in batch:
                key = id(prompt)
                if key not in rubric_tokens:
                    fields = {"prompt": _prompt_text(prompt.row), "row": prompt.row}
                    fields.update({"replies": [""] * group_size} if group else {"reply": ""})
                    try:
                        text = template.render(**fields)
                    except jinja2.UndefinedError:
                        text = spec.rubric
                    rubric_tokens[key] = len(tokenizer.encode(text))
                n = 1 if group else group_size
                requests += n
                prompt_tokens += n * rubric_tokens[key] + group_size * reply_tokens
                completion_tokens += n * spec.max_tokens
        if not spec.url:  # sampled on the run's backend: priced as its sampling
            backend_tokens += prompt_tokens + completion_tokens - before
    total = prompt_tokens + completion_tokens
    return {"requests": requests, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "backend_tokens": backend_tokens, "external_tokens": total - backend_tokens,
            "served_by": ", ".join(j.url or f"the run's backend ({j.model})" for j in judges)}  # fmt: skip
