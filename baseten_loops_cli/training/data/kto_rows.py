"""KTO rows: one completion per row with a thumbs up or down, and the checks that keep paired and
unpaired data apart.

A row is ``{"prompt": str | [messages], "completion": str | message | [messages], "label":
true | false}`` (TRL's unpaired preference format); ``"messages"`` may stand in for
``"prompt"``, and without either the completion is a whole conversation ending in the reply.
The data layer (``formats.read_rows(spec, "unpaired")``) reads every source and format into
these rows (a CSV label "true"/"0" already a bool); the row checks here are pure functions of a
row and its ``file:line`` (``where``), and :func:`load_kto_examples` renders them. Every error
names the file and line, as ``training/data/datums.py``'s do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.data.datums import Example, _check_messages, _reply_messages
from baseten_loops_cli.training.data.formats.truncation import cut_replies, reply_start
from baseten_loops_cli.training.losses.preference_losses import kto_mismatched_index

KTO_ROW_HINT = 'Write each row as {"prompt": ..., "completion": ..., "label": true} (false for an undesirable completion).'
SPLIT_PAIR_HINT = ('KTO takes one completion per row: split each pair into {"prompt": ..., "completion": <chosen>, '
                   '"label": true} and {"prompt": ..., "completion": <rejected>, "label": false}, or use kind: dpo.')


@dataclass
class KTORow:
    """A validated KTO row: the conversation before the reply, the reply, and its label."""

    prompt: list[dict]
    completion: list[dict]
    label: bool
    source: str  # "file:line"


@dataclass
class KTOExample:
    """A rendered KTO row: its tokens (weights mark the reply) and its label."""

    example: Example
    label: bool
    row: KTORow


def _prompt_messages(row: dict, where: str) -> list[dict]:
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    if "prompt" in row:
        return _check_messages(row["prompt"], f"{where}: 'prompt'")
    if "messages" in row:
        return _check_messages(row["messages"], where)
    return []


def kto_row(row: dict, where: str) -> KTORow:
    """A row under ``kind: kto`` checked: a paired row is an error naming the fix, as are a
    missing completion or label and a label that is not a JSON boolean."""
    if "chosen" in row or "rejected" in row:
        raise ConfigError(f"{where}: a paired row ('chosen'/'rejected') under kind: kto", hint=SPLIT_PAIR_HINT)
    if "completion" not in row:
        raise ConfigError(f"{where}: missing key 'completion'", hint=KTO_ROW_HINT)
    if "label" not in row:
        raise ConfigError(f"{where}: missing key 'label' (true for a desirable completion, false for an undesirable one)",
                          hint=KTO_ROW_HINT)
    if not isinstance(row["label"], bool):
        raise ConfigError(f"{where}: 'label' must be true or false, got {row['label']!r}",
                          hint="Write the JSON booleans true or false, unquoted.")
    prompt = _prompt_messages(row, where)
    completion = _reply_messages(row["completion"], "completion", where)
    if completion[-1].get("role") != "assistant":
        raise ConfigError(f"{where}: 'completion' must end with an assistant message (the reply being labelled)")
    if not prompt and not any(m.get("role") == "user" for m in completion[:-1]):
        raise ConfigError(f"{where}: no prompt: give 'prompt' (or 'messages'), or a whole conversation as 'completion'",
                          hint=KTO_ROW_HINT)
    conversation = prompt + completion  # the reply last; everything before it is the prompt
    return KTORow(conversation[:-1], conversation[-1:], row["label"], where)


def check_paired_row(row: dict, where: str) -> None:
    """The reverse check, for paired kinds (``kind: dpo``): an unpaired KTO row is an error
    naming the fix (else the loader would only say "missing key 'chosen'")."""
    if "chosen" in row or "rejected" in row:
        return
    if "label" in row or "completion" in row:
        raise ConfigError(
            f"{where}: an unpaired row ('completion'/'label') under kind: dpo",
            hint="Use kind: kto for rows with one completion and a label, or give each row a 'chosen' and a 'rejected' reply.",
        )


def check_kto_labels(labels: Iterable[bool], path: Any) -> tuple[int, int]:
    """(desirable, undesirable) counts; only one label in the file is an error (KTO needs both)."""
    labels = list(labels)
    desirable = sum(1 for label in labels if label)
    undesirable = len(labels) - desirable
    if labels and (not desirable or not undesirable):
        only = "true" if desirable else "false"
        missing = "false (undesirable)" if desirable else "true (desirable)"
        raise ConfigError(f"{path}: every row has label {only}; KTO needs rows labelled {missing} too",
                          hint="Add rows with the other label, or use kind: sft to train on good completions only.")
    return desirable, undesirable


def _render(tokenizer: Any, conversation: list[dict], where: str) -> tuple[list[int], list[float]]:
    from baseten_loops_cli.tokenization import render_chat

    try:
        tokens, weights = render_chat(tokenizer, conversation, train_on="last_assistant")
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return list(tokens), [float(w) for w in weights]


def render_kto_row(where: str, row: dict, tokenizer: Any, *, max_seq_len: int, loader: Any = None) -> KTOExample | None:
    """One internal row checked and rendered (the reply trained, as DPO's sides); a row over
    max_seq_len goes by the ``loader``'s ``data.truncation`` (None: dropped)."""
    from baseten_loops_cli.training.data.datums import too_long

    checked = kto_row(row, where)
    tokens, weights = _render(tokenizer, checked.prompt + checked.completion, where)
    if len(tokens) > max_seq_len:
        error = too_long(f"{where}: the completion is {len(tokens)} tokens with its prompt, over max_seq_len {max_seq_len}",
                         len(tokens))
        if loader is None:
            raise error
        if not loader.over(where, error):
            return None
        # the prompt from the left, then the completion from the right (as a DPO pair's sides)
        [(tokens, weights)] = cut_replies([(tokens, weights)], max_seq_len)
        if not any(w > 0 for w in weights[1:]):
            raise loader.nothing_left(where, max_seq_len)
    example = Example(tokens, weights, where)
    if example.trained_tokens == 0:
        raise ConfigError(f"{where}: nothing to train on (the completion renders to no tokens)")
    return KTOExample(example, checked.label, checked)


def load_kto_examples(spec: Any, tokenizer: Any, *, max_seq_len: int, check_labels: bool = True) -> list[KTOExample]:
    """Every row of a data spec (or a plain path) in any format, checked and rendered; both
    labels must occur (``check_labels``: off for `loops data check`, which renders row by row)."""
    from baseten_loops_cli.training.data.datums import RowLoader

    loader = RowLoader(spec, "unpaired")
    examples = loader.load(lambda where, row: render_kto_row(where, row, tokenizer, max_seq_len=max_seq_len, loader=loader),
                           "rows")
    if check_labels:
        check_kto_labels((e.label for e in examples), spec)
    return examples


def kl_examples(examples: list[KTOExample], tokenizer: Any, *, max_seq_len: int) -> list[Example]:
    """The mismatched sequences of KTO's KL estimate, one per example (its prompt with
    :func:`~baseten_loops_cli.training.losses.preference_losses.kto_mismatched_index`'s completion),
    cut at ``max_seq_len`` (an estimate needs no complete reply; the prompt fits, as it fits
    with its own completion, unless ``data.truncation`` cut it: then it is cut as its row was)."""
    out = []
    n = len(examples)
    for i, item in enumerate(examples):
        other = examples[kto_mismatched_index(i, n)].row
        tokens, weights = _render(tokenizer, item.row.prompt + other.completion, item.row.source)
        if reply_start(weights) >= max_seq_len:  # a prompt data.truncation cut: cut as its row was
            [(tokens, weights)] = cut_replies([(tokens, weights)], max_seq_len)
        out.append(Example(tokens[:max_seq_len], weights[:max_seq_len], f"{item.row.source} (KL)"))
    return out
