"""Score sampler checkpoints (and base models) on a data set: `loops eval` and a config's `eval:`.

Two kinds of data, told apart by the config (an RL config brings the reward):

- **SFT rows** (chat ``messages`` or ``prompt``/``completion``, rendered exactly as for
  training): mean NLL per trained token, perplexity and next-token accuracy on those tokens.
  Each row is one forward pass with no training: it is sent to a sampler serving the weights
  as a prompt (``max_tokens`` 1) asking for its prompt logprobs plus the top-1 alternative,
  so the logprob of every token and whether it was the model's argmax come back. A sampler is
  what serves a sampler checkpoint on Baseten and locally alike; a trainer would first have to
  be provisioned and loaded with the weights.
- **RL prompt rows** and a reward: ``samples`` completions per prompt, scored by the reward:
  mean reward, pass rate (reward >= ``pass_threshold``), unbiased pass@k and mean completion
  length. A reward that raises is reported with its row; the other rows are still scored.
- **Multiple-choice rows** (``choices`` + ``label``): accuracy and length-normalised accuracy
  from the prompt logprobs of each choice (``training/evaluation/multiple_choice.py``).

A :class:`Candidate` opens its sampler only when its result is not cached: results are kept
per (candidate, data hash, settings) under the cache dir, so re-running a table is instant.
Nothing here knows about the CLI; ``cli/eval.py`` resolves checkpoints into candidates and
renders the :class:`EvalReport`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Protocol, Sequence

from baseten_loops_cli.errors import ConfigError, LoopsError
# The rows: services/evaluation.py makes them from checkpoint names (training sits above services).
from baseten_loops_cli.services.evaluation import Candidate, SamplerLike
from baseten_loops_cli.training.config import RewardConfig, SamplingConfig

# Bump when the numbers a cached result holds would change for the same inputs.
CACHE_VERSION = 1
# Requests in flight per candidate.
CONCURRENCY = 8
# What a row without a length limit is checked against (the sampler checks the model's own).
NO_LIMIT = 1 << 30

Better = Literal["higher", "lower"]


@dataclass(frozen=True)
class Metric:
    key: str
    header: str
    better: Better | None  # None: shown, never "best"
    description: str


SFT_METRICS = (
    Metric("nll", "NLL", "lower", "mean negative log-likelihood per scored token (nats)"),
    Metric("perplexity", "PPL", "lower", "exp(nll)"),
    Metric("accuracy", "ACCURACY", "higher", "fraction of scored tokens that were the model's top-1 prediction"),
    Metric("tokens", "TOKENS", None, "scored (assistant) tokens"),
)
RL_METRICS = (
    Metric("reward", "REWARD", "higher", "mean reward over every completion"),
    Metric("pass_rate", "PASS RATE", "higher", "fraction of completions with reward >= pass_threshold"),
    Metric("pass_at_k", "PASS@K", "higher", "unbiased pass@k, averaged over prompts"),
    Metric("completion_tokens", "LENGTH", None, "mean completion length (tokens)"),
)


# ── what is evaluated, on what ─────────────────────────────────────────────────────────────




@dataclass(frozen=True)
class SFTTask:
    data: Path
    train_on: str = "last_assistant"
    max_seq_len: int = NO_LIMIT
    limit: int | None = None

    kind = "sft"
    metrics = SFT_METRICS

    def settings(self) -> dict:
        return {"train_on": self.train_on, "limit": self.limit}

    def identity(self) -> str:
        return ""

    def load_rows(self, tokenizer: Any) -> list[Any]:
        from baseten_loops_cli.training.data import datums as data_mod

        try:
            rows = data_mod.load_sft_examples(self.data, tokenizer, train_on=self.train_on, max_seq_len=self.max_seq_len)
        except ConfigError as exc:
            # rows without a reply: the old loader's words, or the data layer's (a prompt-only format)
            # (not rows of no known format: the data layer's hint says how to map their columns)
            if "no known row format" not in exc.message and any(
                    text in exc.message for text in ("expected a 'messages'", "no assistant message", "do not have a reply to train on")):
                exc.hint = (
                    "SFT rows need an answer to score (an assistant message, or prompt + completion); "
                    "to score prompts by a reward, pass --config with an RL config (kind: rl, reward: ...)."
                )
            raise
        return rows[: self.limit] if self.limit else rows

    async def score(self, client: SamplerLike, rows: list, tokenizer: Any, advance: Callable[[], None]
                    ) -> tuple[dict[str, float], list[RowError]]:
        return await _score_sft(client, rows, advance), []


@dataclass(frozen=True)
class RLTask:
    data: Path
    reward: RewardConfig
    reward_dir: Path  # a file reward's path is relative to it (the config's folder)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    samples: int = 4
    k: int | None = None
    pass_threshold: float = 1.0
    seed: int = 0
    max_seq_len: int = NO_LIMIT
    limit: int | None = None

    kind = "rl"
    metrics = RL_METRICS

    @property
    def pass_k(self) -> int:
        return self.k or self.samples

    def identity(self) -> str:
        return _reward_identity(self)

    @functools.cached_property
    def reward_fn(self) -> Any:
        """The built reward (once per task: a file reward is imported once)."""
        from baseten_loops_cli.training.rewards.builtins import build_reward

        return build_reward(self.reward, self.reward_dir)

    def load_rows(self, tokenizer: Any) -> list[Any]:
        from baseten_loops_cli.training.data import datums as data_mod

        rows = data_mod.load_prompts(self.data, tokenizer, max_seq_len=self.max_seq_len, max_tokens=self.sampling.max_tokens)
        return rows[: self.limit] if self.limit else rows

    async def score(self, client: SamplerLike, rows: list, tokenizer: Any, advance: Callable[[], None]
                    ) -> tuple[dict[str, float], list[RowError]]:
        return await _score_rl(client, rows, self, tokenizer, self.reward_fn, advance)

    def settings(self) -> dict:
        return {
            "reward": self.reward.model_dump(), "samples": self.samples, "k": self.pass_k,
            "pass_threshold": self.pass_threshold, "seed": self.seed, "limit": self.limit,
            "sampling": self.sampling.model_dump(),
        }  # fmt: skip


class EvalTask(Protocol):
    """What `evaluate` scores: a task kind (SFTTask, RLTask, multiple_choice.MCTask) carries
    its metrics, reads its rows and scores one candidate's sampler on them."""

    data: Path
    limit: int | None
    kind: ClassVar[str]  # "sft" | "rl" | "mc": in the report and the cache key
    metrics: ClassVar[tuple[Metric, ...]]

    def settings(self) -> dict: ...

    def identity(self) -> str:
        """What else makes a result differ (a reward file's content); "" if nothing."""
        ...

    def load_rows(self, tokenizer: Any) -> list[Any]: ...

    async def score(self, client: SamplerLike, rows: list, tokenizer: Any, advance: Callable[[], None]
                    ) -> tuple[dict[str, float], list[RowError]]: ...


@dataclass
class RowError:
    source: str  # file:line
    message: str  # one line


@dataclass
class CandidateResult:
    label: str
    base_model: str
    uri: str | None
    is_base: bool
    rows: int
    metrics: dict[str, float]
    cached: bool = False
    errors: list[RowError] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "checkpoint": self.label, "uri": self.uri, "base_model": self.base_model, "base": self.is_base,
            "rows": self.rows, "metrics": self.metrics, "cached": self.cached,
            "errors": [asdict(e) for e in self.errors],
        }  # fmt: skip


@dataclass
class EvalReport:
    kind: str  # the task's: "sft" | "rl" | "mc"
    data: str
    data_sha256: str
    settings: dict
    results: list[CandidateResult]
    metrics: tuple[Metric, ...]  # the task's

    @property
    def errors(self) -> list[RowError]:
        return [e for r in self.results for e in r.errors]

    def best_labels(self) -> dict[str, list[str]]:
        """metric key -> the labels of the rows holding the best value (several on a tie)."""
        best: dict[str, list[str]] = {}
        for metric in self.metrics:
            if metric.better is None:
                continue
            found = [(r.metrics.get(metric.key), r.label) for r in self.results]
            scored = [(v, label) for v, label in found if isinstance(v, (int, float)) and not math.isnan(v)]
            if scored:
                top = (min if metric.better == "lower" else max)(v for v, _ in scored)
                best[metric.key] = [label for v, label in scored if v == top]
        return best

    def best(self) -> dict[str, str]:
        """metric key -> the label of the best row (on a tie, the first listed)."""
        return {key: labels[0] for key, labels in self.best_labels().items()}

    def as_dict(self) -> dict:
        marks = self.best_labels()
        results = []
        for r in self.results:
            row = r.as_dict()
            row["best"] = [k for k, labels in marks.items() if r.label in labels]
            results.append(row)
        return {
            "kind": self.kind, "data": self.data, "data_sha256": self.data_sha256,
            "settings": self.settings, "results": results, "best": self.best(),
        }  # fmt: skip

    def table(self) -> tuple[list[dict], list[tuple[str, Any]]]:
        """(rows, columns) of the human table: the rows are :meth:`as_dict`'s ``results`` (what
        jsonl prints, one per line), the columns format them, the best per column marked with
        ``*``."""
        several = len(self.results) > 1

        def metric(key: str) -> Callable[[dict], str]:
            return lambda row: _format_value(key, row["metrics"].get(key)) + (" *" if several and key in row["best"] else "")

        columns: list[tuple[str, Any]] = [("CHECKPOINT", "checkpoint"), ("ROWS", "rows")]
        columns += [(m.header.replace("@K", f"@{self.settings.get('k', 'K')}"), metric(m.key)) for m in self.metrics]
        return self.as_dict()["results"], columns


def _format_value(key: str, value: Any) -> str:
    if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if key == "tokens":
        return str(int(value))
    if key == "perplexity":
        return f"{value:.3f}" if value < 1000 else f"{value:.4g}"
    if key == "completion_tokens":
        return f"{value:.1f}"
    return f"{value:.4f}"


# ── gates (--fail-under / --fail-over) ─────────────────────────────────────────────────────


@dataclass(frozen=True)
class Gate:
    metric: str
    threshold: float
    direction: Literal["under", "over"]  # fail when the best is under / over the threshold


def parse_gate(text: str, task: EvalTask, direction: Literal["under", "over"]) -> Gate:
    from baseten_loops_cli.errors import UsageError

    flag = f"--fail-{direction}"
    other = "over" if direction == "under" else "under"
    want = "higher" if direction == "under" else "lower"
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_").lower()
    known = {m.key: m for m in task.metrics if m.better is not None}
    fitting = [k for k, m in known.items() if m.better == want]
    others = [k for k in known if k not in fitting]
    choices = ", ".join(fitting) + (f" ({', '.join(others)} with --fail-{other})" if others else "")
    if not sep or not key:
        example = fitting[0] if fitting else next(iter(known))
        raise UsageError(f"{flag} {text!r}: expected METRIC=VALUE", hint=f"For example {flag} {example}=0.5.")
    if key in ("pass@k", "pass_at"):
        key = "pass_at_k"
    metric = known.get(key)
    if metric is None:
        raise UsageError(f"{flag}: unknown metric {key!r} for {task.kind.upper()} data", hint=f"Use one of: {choices}.")
    if metric.better != want:
        raise UsageError(
            f"{flag} {key}: {key} is better when {metric.better}, so a floor makes no sense",
            hint=f"Use --fail-{other} {key}={value.strip()}.",
        )
    try:
        threshold = float(value)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: {value.strip()!r} is not a number") from None
    return Gate(key, threshold, direction)


def check_gates(report: EvalReport, gates: Sequence[Gate]) -> list[str]:
    """The gates the best checkpoint misses, one line each. The base model counts only when it
    is the only row: a gate is about what training produced."""
    pool = [r for r in report.results if not r.is_base] or report.results
    failures = []
    for gate in gates:
        metric = next(m for m in report.metrics if m.key == gate.metric)
        found = [(r.metrics.get(gate.metric), r.label) for r in pool]
        values = [(v, label) for v, label in found if isinstance(v, (int, float)) and not math.isnan(v)]
        if not values:
            failures.append(f"no checkpoint has a {gate.metric} to check")
            continue
        value, label = (min if metric.better == "lower" else max)(values, key=lambda x: x[0])
        if (gate.direction == "under" and value < gate.threshold) or (gate.direction == "over" and value > gate.threshold):
            word = "under" if gate.direction == "under" else "over"
            failures.append(f"best {gate.metric} {value:.4g} ({label}) is {word} {gate.threshold:g}")
    return failures


# ── data ──────────────────────────────────────────────────────────────────────────────────


def file_sha256(path: Path) -> str:
    if not isinstance(path, Path) or path.is_dir():  # a folder, mixture or hold-out (training/data/formats)
        from baseten_loops_cli.training.data.formats.dataset import fingerprint

        return fingerprint(path)
    from baseten_loops_cli.training.data.formats.readers import open_data_file

    digest = hashlib.sha256()
    with open_data_file(path, "JSONL") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _reward_identity(task: RLTask) -> str:
    """The reward's settings plus, for a file reward, the file's content (an edited reward is
    a different reward)."""
    spec = task.reward.fn
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        path = Path(spec.rsplit(":", 1)[0])
        path = path if path.is_absolute() else task.reward_dir / path
        try:
            return hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return "missing"
    return ""


# ── scoring ───────────────────────────────────────────────────────────────────────────────


def _with_source(exc: LoopsError, source: str) -> LoopsError:
    if not exc.message.startswith(source):
        exc.message = f"{source}: {exc.message}"
    return exc


async def _score_sft(client: SamplerLike, examples: list, advance: Callable[[], None]) -> dict[str, float]:
    from baseten_loops_cli.api.errors import ProtocolError

    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(example) -> tuple[float, float, float]:
        async with semaphore:
            try:
                result = await client.asample(
                    example.tokens, n=1, max_tokens=1, temperature=1.0, prompt_logprobs=True, topk_prompt_logprobs=1
                )
            except LoopsError as exc:
                raise _with_source(exc, example.source) from None
        advance()
        logprobs, top = result.prompt_logprobs or [], result.topk_prompt_logprobs or []
        nll = weight = correct = 0.0
        for i in range(1, len(example.tokens)):
            w = example.weights[i]
            if w <= 0:
                continue
            lp = logprobs[i] if i < len(logprobs) else None
            alternatives = top[i] if i < len(top) else None
            if lp is None or not alternatives:
                raise ProtocolError(f"{example.source}: the sampler returned no prompt logprob for token {i}")
            nll -= w * lp
            weight += w
            argmax = max(alternatives, key=lambda pair: pair[1])[0]
            correct += w * (argmax == example.tokens[i])
        return nll, weight, correct

    parts = await asyncio.gather(*(one(e) for e in examples))
    nll = sum(p[0] for p in parts)
    weight = sum(p[1] for p in parts)
    correct = sum(p[2] for p in parts)
    mean = nll / weight if weight else float("nan")
    return {
        "nll": mean,
        "perplexity": math.exp(mean) if weight and mean < 700 else float("inf") if weight else float("nan"),
        "accuracy": correct / weight if weight else float("nan"),
        "tokens": weight,
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


async def _score_rl(
    client: SamplerLike, prompts: list, task: RLTask, tokenizer: Any, reward: tuple[str, Any], advance: Callable[[], None]
) -> tuple[dict[str, float], list[RowError]]:
    from baseten_loops_cli.training.rewards.builtins import RewardError, completion_text, score

    name, fn = reward
    sampling = task.sampling
    semaphore = asyncio.Semaphore(CONCURRENCY)
    stops = list(getattr(tokenizer, "stop_token_ids", ()) or ())

    async def one(index: int, prompt) -> tuple[list[float], list[int], list[RowError]]:
        async with semaphore:
            try:
                result = await client.asample(
                    prompt.tokens, n=task.samples, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                    top_p=sampling.top_p, top_k=sampling.top_k, seed=task.seed * 1_000_003 + index, stop=stops or None,
                )  # fmt: skip
            except LoopsError as exc:
                raise _with_source(exc, prompt.source) from None
        advance()
        rewards, lengths, errors = [], [], []
        for seq in result.sequences:
            text = completion_text(tokenizer, list(seq.tokens), sampling.stop)
            try:
                rewards.append(score(name, fn, text, prompt.row, prompt.source))
            except RewardError as exc:
                first = (exc.message.strip().splitlines() or ["(no message)"])[0]
                errors.append(RowError(prompt.source, first if prompt.source in first else f"{first} (prompt {prompt.source})"))
                break  # one line per row is enough; the row is left out
            lengths.append(len(seq.tokens))
        return rewards, lengths, errors

    parts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    errors = [e for _, _, errs in parts for e in errs]
    scored = [(r, n) for r, n, errs in parts if not errs]
    rewards = [x for r, _ in scored for x in r]
    lengths = [x for _, n in scored for x in n]
    k = task.pass_k
    per_prompt = [pass_at_k(len(r), sum(x >= task.pass_threshold for x in r), k) for r, _ in scored if len(r) >= k]
    nan = float("nan")
    return {
        "reward": statistics.fmean(rewards) if rewards else nan,
        "pass_rate": sum(x >= task.pass_threshold for x in rewards) / len(rewards) if rewards else nan,
        "pass_at_k": statistics.fmean(per_prompt) if per_prompt else nan,
        "completion_tokens": statistics.fmean(lengths) if lengths else nan,
    }, errors


# ── the driver ────────────────────────────────────────────────────────────────────────────


class Progress(Protocol):
    def start(self, total: int) -> None: ...
    def advance(self, n: int = 1) -> None: ...


class _NoProgress:
    def start(self, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


def _cache_key(candidate: Candidate, task: EvalTask, data_sha: str, reward_sha: str) -> str:
    blob = json.dumps(
        {"v": CACHE_VERSION, "kind": task.kind, "candidate": candidate.identity, "base_model": candidate.base_model,
         "data": data_sha, "settings": task.settings(), "reward_file": reward_sha},
        sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _read_cache(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cached if isinstance(cached, dict) and isinstance(cached.get("metrics"), dict) else None


def _write_cache(path: Path | None, rows: int, metrics: dict) -> None:
    if path is None:
        return
    from baseten_loops_cli.training.experiments.rundir import atomic_write

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"rows": rows, "metrics": metrics}, allow_nan=True))
    except OSError:
        pass  # a cache that cannot be written only costs time


def evaluate(
    candidates: Sequence[Candidate],
    task: EvalTask,
    *,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    tokenizer_for: Callable[[str], Any] | None = None,
) -> EvalReport:
    """Score every candidate on ``task`` (cached ones are read back, not scored again).

    Rows are loaded and checked once per base model before any sampler is opened, so a bad row
    fails fast. Sampler and data errors raise; reward errors are collected per row in the
    result (the caller decides the exit code)."""
    from baseten_loops_cli.tokenization import get_tokenizer

    tokenizer_for = tokenizer_for or get_tokenizer
    progress = progress or _NoProgress()
    data_sha = file_sha256(task.data)
    reward_sha = task.identity()

    tokenizers: dict[str, Any] = {}
    rows_by_model: dict[str, list] = {}
    for candidate in candidates:
        model = candidate.base_model
        if model not in rows_by_model:
            tokenizers[model] = tokenizer_for(model)
            rows_by_model[model] = task.load_rows(tokenizers[model])

    plan: list[tuple[Candidate, Path | None, dict | None]] = []
    for candidate in candidates:
        path = cache_dir / f"{_cache_key(candidate, task, data_sha, reward_sha)}.json" if cache_dir else None
        plan.append((candidate, path, _read_cache(path)))
    progress.start(sum(len(rows_by_model[c.base_model]) for c, _, hit in plan if hit is None))

    results = []
    for candidate, path, hit in plan:
        rows = rows_by_model[candidate.base_model]
        if hit is not None:
            results.append(CandidateResult(label=candidate.label, base_model=candidate.base_model, uri=candidate.uri,
                                           is_base=candidate.is_base, rows=int(hit.get("rows", len(rows))), metrics=hit["metrics"], cached=True))
            continue
        errors: list[RowError] = []

        async def run(candidate: Candidate = candidate, rows: list = rows, errors: list[RowError] = errors) -> dict[str, float]:
            client = candidate.open()
            try:
                metrics, found = await task.score(client, rows, tokenizers[candidate.base_model], progress.advance)
                errors.extend(found)
                return metrics
            finally:
                await client.aclose()

        metrics = asyncio.run(run())
        if not errors:
            _write_cache(path, len(rows), metrics)
        results.append(CandidateResult(label=candidate.label, base_model=candidate.base_model, uri=candidate.uri,
                                       is_base=candidate.is_base, rows=len(rows), metrics=metrics, errors=errors))
    return EvalReport(task.kind, str(task.data), data_sha, {"kind": task.kind, **task.settings()}, results,
                      task.metrics)
