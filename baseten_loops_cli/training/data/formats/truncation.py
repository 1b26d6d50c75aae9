"""``data.truncation``: what a row longer than ``max_seq_len`` becomes. Pure functions over
token id lists (and their per-token weights); the loaders in ``training/data/datums.py`` and
``kto_rows.py`` call them on every rendered row, so every kind honours one policy.

- ``error`` (default): the row is refused, with its file and line.
- ``drop``: the row is skipped and counted (a data note of the plan).
- ``right``: keep the first ``max_seq_len`` tokens; ``left``: keep the last.

A row with a prompt and replies (DPO/IPO/SimPO/ORPO pairs, KTO rows) is cut as TRL's
DPOTrainer cut pairs before 0.20 (``truncation_mode="keep_end"`` with ``max_prompt_length``):
the shared prompt first, from the left (its end leads into the replies), then the replies from
the right (their starts are what is compared), under either ``right`` or ``left``. A prompt to
sample from (RL, distill) keeps its end under either, since the generation prompt that ends it
is what the model continues.
"""

from __future__ import annotations

POLICIES = ("error", "drop", "right", "left")
CUTS = ("right", "left")  # the policies that keep a shortened row


def cut(tokens: list, weights: list, limit: int, policy: str) -> tuple[list, list]:
    """One sequence cut to ``limit`` tokens: its first (``right``) or last (``left``) ones."""
    if len(tokens) <= limit:
        return tokens, weights
    if policy == "left":
        return tokens[len(tokens) - limit:], weights[len(weights) - limit:]
    return tokens[:limit], weights[:limit]


def cut_prompt(tokens: list, limit: int) -> list:
    """A prompt to sample from, cut to its last ``limit`` tokens (``limit`` >= 1)."""
    return tokens[len(tokens) - limit:] if len(tokens) > limit else tokens


def reply_start(weights: list) -> int:
    """Where a rendered row's trained reply begins (its first weighted token): the prompt is
    everything before it."""
    return next((i for i, w in enumerate(weights) if w > 0), len(weights))


def cut_replies(sides: list[tuple[list, list]], limit: int) -> list[tuple[list, list]]:
    """Each side of a row (the same prompt, then its reply: a pair's chosen and rejected, or a
    KTO row's one completion) cut to ``limit`` tokens: the prompt keeps its last tokens, at
    most what leaves room for the longest reply and at least half of ``limit`` (TRL's
    ``max_prompt_length``) when the replies are long too; then the replies keep their first
    tokens. Every side keeps the same prompt."""
    split = min(reply_start(weights) for _, weights in sides)
    longest = max(len(tokens) - split for tokens, _ in sides)
    if split + longest <= limit:
        return sides
    keep = min(split, max(limit - longest, limit // 2))
    room = limit - keep
    out = []
    for tokens, weights in sides:
        out.append((tokens[split - keep: split] + tokens[split: split + room],
                    weights[split - keep: split] + weights[split: split + room]))
    return out

