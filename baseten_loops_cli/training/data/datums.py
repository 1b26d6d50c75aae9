"""Training data: rows (read by ``training/data/formats`` from any format) -> token sequences -> Datums.

SFT rows are either OpenAI chat (``{"messages": [{"role", "content"}, ...]}``) or
``{"prompt": ..., "completion": ...}``. RL rows are ``{"prompt": ...}`` or ``{"messages": [...]}``
plus whatever the reward needs (usually ``"answer"``). DPO rows are a prompt (``"prompt"`` or
``"messages"``) with a ``"chosen"`` and a ``"rejected"`` reply, or two whole conversations.
Every error names the file and line.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from baseten_loops_cli.errors import ConfigError
# Rows are read by the format layer (files, folders, hub datasets; every row format), once, into
# the internal rows these loaders take: (where, row), where = "file:line" or "file: row N".
from baseten_loops_cli.training.data.formats import read_rows
from baseten_loops_cli.training.data.formats import truncation as trunc
from baseten_loops_cli.training.data.formats.readers import JSONL_HINT, read_jsonl  # noqa: F401 - re-exported

T = TypeVar("T")

# How many refused rows one error lists (the rest are counted).
LISTED_ROWS = 5


@dataclass
class Example:
    """One rendered SFT example: tokens and per-token training weights."""

    tokens: list[int]
    weights: list[float]
    source: str  # "file:line", for error messages

    @property
    def trained_tokens(self) -> int:
        return int(sum(1 for w in self.weights[1:] if w > 0))


@dataclass
class Prompt:
    """One RL prompt: its rendered tokens and its row (for the reward)."""

    tokens: list[int]
    row: dict[str, Any]
    source: str
    text: str = field(default="")


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ConfigError(f"{where}: messages[{i}] must have a string 'content'",
                              hint='Each message is {"role": "user", "content": "..."}.')
        if message.get("role") not in ("system", "user", "assistant", "tool"):
            raise ConfigError(f"{where}: messages[{i}] has role {message.get('role')!r}; expected system, user or assistant",
                              hint="Rename the role to system, user or assistant.")
    return messages


def too_long(message: str, length: int) -> ConfigError:
    """The over-length error of a row, whose hint names ``data.truncation`` (the fix that keeps the row)."""
    return ConfigError(
        message,
        hint=f"Raise max_seq_len to at least {length} (if the model allows), set data.truncation to right or left "
             f"(cut such rows to max_seq_len) or drop (skip them), or shorten the row.",
    )


class RowLoader:
    """One loader's pass over a data source: the spec read (a config's, with its
    ``data.truncation``, or a plain path's), the rows refused (every one collected, so one
    `loops train validate` lists them all) and the rows ``drop`` skipped or a cut shortened
    (reported with the spec's notes)."""

    def __init__(self, data: Any, purpose: str):
        from baseten_loops_cli.training.data.formats.dataset import DataSpec, plain_spec

        self.spec = data if isinstance(data, DataSpec) else plain_spec(data)
        self.purpose = purpose
        self.policy = self.spec.truncation
        self.errors: list[ConfigError] = []
        self.dropped: list[str] = []
        self.cut: list[str] = []

    def rows(self):
        """``(where, row)`` of the spec, converted for the loader's purpose."""
        return read_rows(self.spec, self.purpose)

    @contextmanager
    def row(self):
        """Around one row's checks: its error is collected (raised with the others by :meth:`finish`)."""
        try:
            yield
        except ConfigError as exc:
            self.errors.append(exc)

    def load(self, one: Callable[[str, dict], T | None], noun: str) -> list[T]:
        """Every row through ``one`` (``(where, row) -> item``, None when the row is skipped:
        ``data.truncation: drop``), each refusal collected; then :meth:`finish`."""
        items: list[T] = []
        for where, row in self.rows():
            with self.row():
                item = one(where, row)
                if item is not None:
                    items.append(item)
        return self.finish(items, noun)

    def over(self, where: str, error: ConfigError) -> bool:
        """A row is over max_seq_len: True when it is to be cut (``right``/``left``), False when
        ``drop`` skips it; ``error`` raises ``error``."""
        if self.policy == "drop":
            self.dropped.append(where)
            return False
        if self.policy not in trunc.CUTS:
            raise error
        self.cut.append(where)
        return True

    def nothing_left(self, where: str, max_seq_len: int) -> ConfigError:
        return ConfigError(
            f"{where}: cut to max_seq_len {max_seq_len} (data.truncation: {self.policy}), nothing is left to train on",
            hint="Use data.truncation: left (keeps the end, where the reply is) or drop, or raise max_seq_len.",
        )

    def finish(self, items: list, noun: str) -> list:
        """``items`` after every row: the refused rows raised together (the first few named),
        the dropped and cut ones reported."""
        if self.errors:
            raise refused_rows(self.errors)
        label = self.spec.label
        for rows, done in ((self.dropped, "dropped"), (self.cut, f"cut ({self.policy})")):
            if rows:
                first = ", ".join(rows[:3]) + (" ..." if len(rows) > 3 else "")
                self.spec.reports.append(f"{label}: {len(rows):,} row{'s' if len(rows) != 1 else ''} over max_seq_len "
                                         f"{done} by data.truncation ({first})")
        if not items:
            extra = f" ({len(self.dropped):,} dropped as over max_seq_len)" if self.dropped else " (the file is empty)"
            raise ConfigError(f"{self.spec}: no {noun}{extra}", hint="Put at least one row in it: " + JSONL_HINT
                              if not self.dropped else "Raise max_seq_len, or use data.truncation: right or left.")
        return items


def refused_rows(errors: list[ConfigError]) -> ConfigError:
    """Several rows' errors as one: each on its line (the first :data:`LISTED_ROWS`), the rest
    counted; one row's error as it is."""
    if len(errors) == 1:
        return errors[0]
    lines = [f"{len(errors):,} rows refused:"] + [f"  {e.message}" for e in errors[:LISTED_ROWS]]
    if len(errors) > LISTED_ROWS:
        lines.append(f"  ... and {len(errors) - LISTED_ROWS:,} more")
    return ConfigError("\n".join(lines), hint=errors[0].hint)


def load_sft_examples(path: Path, tokenizer: Any, *, train_on: str, max_seq_len: int) -> list[Example]:
    from baseten_loops_cli.tokenization import render_chat, render_prompt_completion

    loader = RowLoader(path, "sft")

    def to_example(where: str, row: dict) -> Example | None:
        if "messages" in row:
            messages = _check_messages(row["messages"], where)
            if not any(m.get("role") == "assistant" for m in messages):
                raise ConfigError(f"{where}: no assistant message to train on",
                                  hint='End the row with the reply to learn: {"role": "assistant", "content": "..."}.')
            try:
                tokens, weights = render_chat(tokenizer, messages, train_on=train_on)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        elif "prompt" in row and "completion" in row:
            if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
                raise ConfigError(f"{where}: 'prompt' and 'completion' must be strings")
            tokens, weights = render_prompt_completion(tokenizer, row["prompt"], row["completion"])
        else:
            raise ConfigError(
                f"{where}: expected a 'messages' list or 'prompt' and 'completion' keys, found {sorted(row)}",
                hint='Write each row as {"messages": [{"role": "user", "content": ...}, '
                     '{"role": "assistant", "content": ...}]} or {"prompt": ..., "completion": ...}.',
            )
        if len(tokens) > max_seq_len:
            if not loader.over(where, too_long(f"{where}: example is {len(tokens)} tokens, over max_seq_len {max_seq_len}", len(tokens))):
                return None
            tokens, weights = trunc.cut(list(tokens), list(weights), max_seq_len, loader.policy)
            if not any(w > 0 for w in list(weights)[1:]):
                raise loader.nothing_left(where, max_seq_len)
        example = Example(list(tokens), [float(w) for w in weights], where)
        if example.trained_tokens == 0:
            raise ConfigError(f"{where}: nothing to train on (every token has weight 0)")
        return example

    return loader.load(to_example, "examples")


def load_prompts(path: Path, tokenizer: Any, *, max_seq_len: int, max_tokens: int) -> list[Prompt]:
    from baseten_loops_cli.tokenization import render_chat

    loader = RowLoader(path, "prompts")

    def to_prompt(where: str, row: dict) -> Prompt | None:
        if "messages" in row:
            messages = _check_messages(row["messages"], where)
        elif isinstance(row.get("prompt"), str):
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            raise ConfigError(f"{where}: expected a string 'prompt' or a 'messages' list, found {sorted(row)}")
        tokens, _ = render_chat(tokenizer, messages, train_on="all", add_generation_prompt=True)
        if len(tokens) + max_tokens > max_seq_len:
            error = too_long(f"{where}: prompt is {len(tokens)} tokens; with sampling.max_tokens {max_tokens} that "
                             f"exceeds max_seq_len {max_seq_len}", len(tokens) + max_tokens)
            if max_tokens >= max_seq_len:  # no prompt fits: the config's numbers, not the row
                raise ConfigError(f"{where}: sampling.max_tokens {max_tokens} leaves no room for a prompt in max_seq_len {max_seq_len}",
                                  hint="Raise max_seq_len or lower sampling.max_tokens.")
            if not loader.over(where, error):
                return None
            tokens = trunc.cut_prompt(list(tokens), max_seq_len - max_tokens)  # its end: the generation prompt
        return Prompt(list(tokens), row, where, messages[-1]["content"])

    return loader.load(to_prompt, "prompts")


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The example order of one epoch: a pure function of (seed, epoch), so resume replays it."""
    order = list(range(n))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def batches_for_step(n: int, batch_size: int, step: int, *, seed: int, shuffle: bool) -> list[int]:
    """Indices of the examples of ``step`` (0-based). Partial last batches are dropped."""
    per_epoch = max(1, n // batch_size)
    epoch, index = divmod(step, per_epoch)
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    return order[index * batch_size : (index + 1) * batch_size]


def sft_datum(example: Example) -> dict:
    """A cross-entropy Datum with the one-token shift: input[i] predicts target[i] = tokens[i+1]."""
    inputs = example.tokens[:-1]
    targets = example.tokens[1:]
    weights = example.weights[1:]
    n = len(inputs)
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": inputs}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": targets, "dtype": "int64", "shape": [n]},
            "weights": {"data": weights, "dtype": "float32", "shape": [n]},
        },
    }


def rl_datum(
    prompt_tokens: list[int], completion: list[int], logprobs: list[float], advantage: float | list[float]
) -> dict:
    """An RL Datum over prompt + completion: only completion targets carry advantage and loss.

    ``advantage`` is one number for the whole completion, or one per completion token (e.g.
    after a per-token KL penalty).
    """
    full = list(prompt_tokens) + list(completion)
    inputs = full[:-1]
    targets = full[1:]
    n = len(inputs)
    prompt_targets = len(prompt_tokens) - 1
    behaviour = [0.0] * prompt_targets + [float(x) for x in logprobs]
    per_token = [float(advantage)] * len(completion) if isinstance(advantage, (int, float)) else [float(a) for a in advantage]
    advantages = [0.0] * prompt_targets + per_token
    mask = [0.0] * prompt_targets + [1.0] * len(completion)
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": inputs}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": targets, "dtype": "int64", "shape": [n]},
            "logprobs": {"data": behaviour, "dtype": "float32", "shape": [n]},
            "advantages": {"data": advantages, "dtype": "float32", "shape": [n]},
            "mask": {"data": mask, "dtype": "float32", "shape": [n]},
        },
    }


def weighted_nll(datums: list[dict], outputs: list[dict]) -> tuple[float, int]:
    """Mean negative log-likelihood over trained tokens, from forward(_backward) outputs."""
    total = 0.0
    count = 0.0
    for datum, out in zip(datums, outputs):
        weights = datum["loss_fn_inputs"]["weights"]["data"]
        logprobs = out["logprobs"]["data"]
        for w, lp in zip(weights, logprobs):
            if w and lp is not None:
                total -= w * lp
                count += w
    return (total / count if count else float("nan")), int(count)


# ------------------------------------------------------------------ preference pairs (DPO)
@dataclass
class PreferencePair:
    """One DPO row: the same conversation ending in the chosen and in the rejected reply (each
    an :class:`Example` whose weights mark the final assistant reply)."""

    chosen: Example
    rejected: Example
    source: str


def _reply_messages(value: Any, key: str, where: str) -> list[dict]:
    """``chosen``/``rejected`` as messages: a string (one assistant reply), a message, or a list."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value:
        return _check_messages(value, f"{where}: '{key}'")
    raise ConfigError(f"{where}: '{key}' must be a string reply or a non-empty list of messages")


def _preference_side(row: dict, key: str, prompt: list[dict], where: str) -> list[dict]:
    if key not in row:
        raise ConfigError(
            f"{where}: missing key '{key}'",
            hint='Each row needs "chosen" and "rejected" (plus "prompt" or "messages", unless both are whole conversations).',
        )
    conversation = prompt + _reply_messages(row[key], key, where)
    if conversation[-1].get("role") != "assistant":
        raise ConfigError(f"{where}: '{key}' must end with an assistant message (the reply being compared)")
    return conversation


def load_preference_pairs(path: Path, tokenizer: Any, *, max_seq_len: int) -> list[PreferencePair]:
    """Rows ``{"prompt" | "messages", "chosen", "rejected"}`` or ``{"chosen": [messages],
    "rejected": [messages]}``; both sides must share everything before the final reply."""
    from baseten_loops_cli.tokenization import render_chat
    from baseten_loops_cli.training.data.kto_rows import check_paired_row

    loader = RowLoader(path, "preference")

    def to_pair(where: str, row: dict) -> PreferencePair | None:
        check_paired_row(row, where)  # an unpaired (KTO) row: named as such, not "missing 'chosen'"
        if isinstance(row.get("prompt"), str):
            prompt = [{"role": "user", "content": row["prompt"]}]
        elif "prompt" in row:
            prompt = _check_messages(row["prompt"], f"{where}: 'prompt'")
        elif "messages" in row:
            prompt = _check_messages(row["messages"], where)
        else:
            prompt = []
        chosen = _preference_side(row, "chosen", prompt, where)
        rejected = _preference_side(row, "rejected", prompt, where)
        if chosen[:-1] != rejected[:-1]:
            raise ConfigError(
                f"{where}: 'chosen' and 'rejected' differ before their final reply",
                hint="A pair compares two replies to one conversation: put the shared turns in 'prompt' or 'messages'.",
            )
        sides = []
        for key, conversation in (("chosen", chosen), ("rejected", rejected)):
            try:
                tokens, weights = render_chat(tokenizer, conversation, train_on="last_assistant")
            except ValueError as exc:
                raise ConfigError(f"{where}: '{key}': {exc}") from None
            sides.append((list(tokens), [float(w) for w in weights]))
        longest = max(sides, key=lambda side: len(side[0]))
        if len(longest[0]) > max_seq_len:
            key = "chosen" if longest is sides[0] else "rejected"
            if not loader.over(where, too_long(f"{where}: '{key}' is {len(longest[0])} tokens with its prompt, over max_seq_len {max_seq_len}",
                                         len(longest[0]))):
                return None
            sides = trunc.cut_replies(sides, max_seq_len)  # the prompt from the left, then the replies from the right
            if not all(any(w > 0 for w in weights[1:]) for _, weights in sides):
                raise loader.nothing_left(where, max_seq_len)
        chosen_ex, rejected_ex = (Example(tokens, weights, where) for tokens, weights in sides)
        if chosen_ex.tokens == rejected_ex.tokens:
            raise ConfigError(f"{where}: 'chosen' and 'rejected' are identical" + (" once cut to max_seq_len" if where in loader.cut else ""),
                              hint="A pair must prefer one reply over a different one.")
        return PreferencePair(chosen_ex, rejected_ex, where)

    return loader.load(to_pair, "preference pairs")


def reference_logprobs_field(token_logprobs: list[float | None]) -> list[float]:
    """The sampler's prompt logprobs of a sequence (``[i]`` = logprob of token i, ``[0]`` None)
    as the trainer's per-position ``ref_logprobs`` (``[i]`` = logprob of token i+1): shifted
    left by one, the last position padded with 0.0 and None as 0.0, exactly as the SDK's
    ``helpers.datum.attach_reference_logprobs`` does (those positions carry weight 0)."""
    return [0.0 if v is None else float(v) for v in token_logprobs[1:]] + [0.0]


def dpo_datum(example: Example, ref_logprobs: list[float]) -> dict:
    """A DPO row as the SDK builds it: the whole sequence as model input (so the sampler-scored
    ``ref_logprobs`` line up with it), target[i] = token i+1, and weight 1 on the reply's
    targets. The last position predicts nothing: weight 0, token 0 as a placeholder target."""
    tokens = example.tokens
    n = len(tokens)
    if len(ref_logprobs) != n:
        raise ValueError(f"{example.source}: {len(ref_logprobs)} reference logprobs for {n} tokens")
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": list(tokens[1:]) + [0], "dtype": "int64", "shape": [n]},
            "weights": {"data": list(example.weights[1:]) + [0.0], "dtype": "float32", "shape": [n]},
            "ref_logprobs": {"data": list(ref_logprobs), "dtype": "float32", "shape": [n]},
        },
    }
