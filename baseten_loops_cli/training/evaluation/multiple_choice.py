"""Multiple-choice (loglikelihood) tasks for `loops eval`: each row's choices scored by the
model's logprobs of their tokens after the row's context, as evaluation harnesses
(lm-evaluation-harness's ``acc`` / ``acc_norm``) score them.

A row is ``{"prompt": TEXT, "choices": [TEXT, ...], "label": INDEX}`` (``label`` may also be
the right choice's text), or ``{"messages": [...], "choices": ..., "label": ...}``: the
conversation rendered with the generation prompt, the choice as the assistant's reply. A
choice is scored in context: the tokens of ``prompt + choice`` after those of ``prompt``
(so a choice starting with a space tokenizes as it would in running text).

Each (row, choice) is one request on the path SFT rows take (``training/evaluation/scoring.py``): a
sampler serving the weights returns the prompt logprobs of ``context + choice`` (``max_tokens``
1, nothing generated that matters), so it runs on Baseten as it does locally.

- ``accuracy``: the right choice has the highest summed logprob.
- ``accuracy_norm``: the same with each sum divided by its choice's length in characters
  (``acc_norm``: long choices are not penalised for having more tokens).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from baseten_loops_cli.errors import ConfigError, LoopsError
from baseten_loops_cli.training.evaluation.scoring import CONCURRENCY, Metric, SamplerLike

MC_METRICS = (
    Metric("accuracy", "ACCURACY", "higher", "fraction of rows whose right choice has the highest summed logprob"),
    Metric("accuracy_norm", "ACC NORM", "higher", "the same, each choice's logprob divided by its length in characters"),
    Metric("choices", "CHOICES", None, "mean number of choices per row"),
)
ROW_HINT = 'Write each row as {"prompt": "...", "choices": ["...", "..."], "label": 0} (label: the right choice\'s index).'


@dataclass(frozen=True)
class MCTask:
    """Multiple-choice rows scored by loglikelihood (see the module docstring)."""

    data: Path
    limit: int | None = None

    kind = "mc"
    metrics = MC_METRICS

    def settings(self) -> dict:
        return {"limit": self.limit}

    def identity(self) -> str:
        return ""

    def load_rows(self, tokenizer: Any) -> list[Any]:
        return load_mc_rows(self.data, tokenizer, limit=self.limit)

    async def score(self, client: Any, rows: list, tokenizer: Any, advance: Callable[[], None]
                    ) -> tuple[dict[str, float], list[Any]]:
        return await score_mc(client, rows, advance), []


@dataclass(frozen=True)
class MCRow:
    source: str  # file:line
    context: list[int]
    choices: list[list[int]]  # each choice's tokens (after the context)
    lengths: list[int]  # each choice's length in characters
    label: int


def is_multiple_choice(path: Path) -> bool:
    """Whether ``path``'s first row is a multiple-choice row (has ``choices`` and ``label``)."""
    from baseten_loops_cli.training.data.formats.readers import read_path

    try:
        for _, row in read_path(path):  # any file type the data layer reads (JSONL, JSON, Parquet, ...)
            return "choices" in row and "label" in row
    except (ConfigError, OSError):
        return False  # the SFT loader says what is wrong with the file
    return False


def _context(row: dict, tokenizer: Any, where: str) -> tuple[list[int], str | None]:
    """The context's tokens, and its text when it is plain text (a choice is appended to it)."""
    if isinstance(row.get("prompt"), str):
        return list(tokenizer.encode(row["prompt"])), row["prompt"]
    if isinstance(row.get("messages"), list):
        from baseten_loops_cli.tokenization import render_chat

        try:
            tokens, _ = render_chat(tokenizer, row["messages"], add_generation_prompt=True)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return list(tokens), None
    raise ConfigError(f"{where}: a multiple-choice row needs a 'prompt' string or a 'messages' list", hint=ROW_HINT)


def load_mc_rows(path: Path, tokenizer: Any, *, limit: int | None = None) -> list[MCRow]:
    from baseten_loops_cli.training.data.formats.readers import JSONL_HINT, read_path

    rows: list[MCRow] = []
    for where, row in read_path(path):  # where: file:line, or file: row N
        choices, label = row.get("choices"), row.get("label")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise ConfigError(f"{where}: 'choices' must be a list of at least 2 non-empty strings", hint=ROW_HINT)
        if isinstance(label, str) and label in choices:
            label = choices.index(label)
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
            raise ConfigError(f"{where}: 'label' must be the right choice's index (0..{len(choices) - 1}) or its text, got {label!r}", hint=ROW_HINT)
        context, text = _context(row, tokenizer, where)
        scored = []
        for choice in choices:
            whole = list(tokenizer.encode(text + choice)) if text is not None else []
            if whole[: len(context)] == context and len(whole) > len(context):
                scored.append(whole[len(context):])
            else:  # the context's last token merged with the choice: tokenize the choice alone
                scored.append(list(tokenizer.encode(choice)))
        if not context:
            raise ConfigError(f"{where}: the prompt is empty; a choice is scored after a context", hint=ROW_HINT)
        rows.append(MCRow(where, context, scored, [len(c) for c in choices], label))
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise ConfigError(f"{path}: no rows (the file is empty)", hint="Put at least one row in it: " + JSONL_HINT)
    return rows


async def score_mc(client: SamplerLike, rows: list[MCRow], advance: Callable[[], None]) -> dict[str, float]:
    """``accuracy`` and ``accuracy_norm`` over ``rows`` (one request per choice)."""
    from baseten_loops_cli.api.errors import ProtocolError
    from baseten_loops_cli.training.evaluation.scoring import _with_source

    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def choice_logprob(row: MCRow, choice: list[int]) -> float:
        tokens = row.context + choice
        async with semaphore:
            try:
                result = await client.asample(tokens, n=1, max_tokens=1, temperature=1.0, prompt_logprobs=True)
            except LoopsError as exc:
                raise _with_source(exc, row.source) from None
        logprobs = list(result.prompt_logprobs or [])[len(row.context): len(tokens)]
        if len(logprobs) != len(choice) or any(lp is None for lp in logprobs):
            raise ProtocolError(f"{row.source}: the sampler returned no prompt logprobs for a choice")
        return float(sum(logprobs))

    async def one(row: MCRow) -> tuple[bool, bool]:
        sums = await asyncio.gather(*(choice_logprob(row, c) for c in row.choices))
        advance()
        best = max(range(len(sums)), key=lambda i: sums[i])
        best_norm = max(range(len(sums)), key=lambda i: sums[i] / row.lengths[i])
        return best == row.label, best_norm == row.label

    parts = await asyncio.gather(*(one(r) for r in rows))
    return {
        "accuracy": sum(p[0] for p in parts) / len(parts),
        "accuracy_norm": sum(p[1] for p in parts) / len(parts),
        "choices": sum(len(r.choices) for r in rows) / len(rows),
    }
