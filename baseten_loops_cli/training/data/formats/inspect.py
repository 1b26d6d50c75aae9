"""What `loops data check` and `loops data preview` report about a data source (no printing).

Both read the source through the same layer as training (``read_rows``) and render its rows
through the same loaders (``training/data/datums.py``), one row at a time, so every problem of the
file is collected (with its file and line) instead of stopping at the first, and the token
counts and trained spans are exactly what `loops train run` would send.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from baseten_loops_cli.errors import ConfigError, UsageError
from baseten_loops_cli.training.data.formats import rows as rows_mod
from baseten_loops_cli.training.data.formats.dataset import DataSpec, _map_columns, plain_spec, read_rows
from baseten_loops_cli.training.data.formats.truncation import CUTS

UNLIMITED = 1 << 30


@dataclass
class RowProblem:
    where: str
    message: str
    hint: str | None = None


@dataclass
class DataCheck:
    path: str
    format: str
    kind: str
    rows: int
    base_model: str
    max_seq_len: int
    tokens: dict[str, int]  # min, mean, max (of the rendered rows)
    histogram: list[dict[str, Any]]  # [{"up_to": 64, "rows": 3}, ...]
    over_max_seq_len: int  # rows over max_seq_len: what data.truncation decides about
    # What each data.truncation policy would do to those rows: {"error": {"refused": 3},
    # "drop": {"dropped": 3}, "right": {"cut": 2, "refused": 1}, "left": {"cut": 3, "refused": 0}}
    # (a cut is refused when it leaves nothing to train on).
    truncation: dict[str, dict[str, int]]
    roles: dict[str, int]
    empty_rows: list[str]
    duplicate_rows: list[list[str]]  # [[first, again], ...]
    problems: list[RowProblem] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _kind_of(spec: DataSpec, kind: str | None) -> tuple[Any, str]:
    """(kind, format): the one given, or the registered kind that takes the detected format
    (``Kind.row_formats``; else the first one, SFT)."""
    from baseten_loops_cli.training import kinds

    if kind is not None and kind not in kinds.names():
        raise UsageError(f"--kind {kind!r}: expected {kinds.names_text()}", hint=f"Pass --kind {kinds.names()[0]}, or leave it out to go by the rows' format.")
    source = spec.sources[0]
    records = [(where, _map_columns(row, source.columns)) for where, row in source.records()]
    if not records:
        raise ConfigError(f"{spec}: no rows (the file is empty)", hint="Put at least one row in it.")
    purpose = kinds.get(kind).row_purpose if kind is not None else None
    fmt, _ = rows_mod.detect([(w, r) for w, r in records], source.name, source.format, source.columns, purpose)
    if kind is None:
        kind = next((name for name in kinds.names() if fmt in kinds.get(name).row_formats), kinds.names()[0])
    found = kinds.get(kind)
    if found.render_rows is None:
        raise UsageError(f"--kind {kind!r}: this kind does not say how its rows render",
                         hint=f"Check its rows with another kind ({kinds.names_text()}).")
    return found, rows_mod.describe(fmt, records)


def _load_one(kind: Any, where: str, row: dict, tokenizer: Any, max_seq_len: int, train_on: str,
              truncation: str = "error") -> list[Any]:
    """The kind's rendering of one converted row: its sequences (tokens, and weights when
    trained), under a ``data.truncation`` policy."""
    one = DataSpec(where, [], truncation=truncation)
    one._cache[kind.row_purpose] = [(where, row)]
    return kind.render_rows(one, tokenizer, max_seq_len=max_seq_len, train_on=train_on)[0]


def _roles(row: dict) -> list[str]:
    found = []
    for key in ("messages", "prompt", "chosen", "rejected", "completion"):
        value = row.get(key)
        if isinstance(value, list):
            found += [str(m.get("role")) for m in value if isinstance(m, dict)]
        elif isinstance(value, str) and key == "prompt":
            found.append("prompt")
    if isinstance(row.get("completion"), str):
        found.append("completion")
    return found


def _is_empty(row: dict) -> bool:
    texts = []
    for key in ("messages", "prompt", "completion", "chosen", "rejected"):
        value = row.get(key)
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            texts += [m.get("content") or "" for m in value if isinstance(m, dict)]
    return not any(t.strip() for t in texts if isinstance(t, str))


def _tokenizer(base_model: str) -> Any:
    from baseten_loops_cli.tokenization import get_tokenizer

    try:
        return get_tokenizer(base_model)
    except Exception as exc:
        raise ConfigError(f"base_model {base_model!r}: {getattr(exc, 'message', None) or exc}",
                          hint=getattr(exc, "hint", None)) from None


def default_max_seq_len(base_model: str) -> int:
    """What a config on ``base_model`` gets without ``max_seq_len`` (config.default_max_seq_len)."""
    from baseten_loops_cli.training.config import default_max_seq_len as default

    return default(base_model)


def check(path: str, *, kind: str | None = None, base_model: str = "loops-local/tiny", max_seq_len: int | None = None,
          train_on: str = "last_assistant", columns: dict[str, str] | None = None) -> DataCheck:
    spec = plain_spec(path, columns=columns)
    if max_seq_len is None:
        max_seq_len = default_max_seq_len(base_model)
    kind_def, fmt = _kind_of(spec, kind)
    tokenizer = _tokenizer(base_model)
    problems: list[RowProblem] = []
    lengths: list[int] = []
    roles: Counter = Counter()
    empty: list[str] = []
    seen: dict[str, str] = {}
    duplicates: list[list[str]] = []
    over = 0
    policies = {"error": {"refused": 0}, "drop": {"dropped": 0}, **{p: {"cut": 0, "refused": 0} for p in CUTS}}
    try:
        converted = list(read_rows(spec, kind_def.row_purpose))
    except ConfigError as exc:  # a row the format layer refuses: the file cannot be read as this kind
        raise ConfigError(exc.message, hint=exc.hint) from None
    for where, row in converted:
        roles.update(_roles(row))
        if _is_empty(row):
            empty.append(where)
        key = json.dumps(row, sort_keys=True, default=str)
        if key in seen:
            duplicates.append([seen[key], where])
        else:
            seen[key] = where
        try:
            rendered = _load_one(kind_def, where, row, tokenizer, UNLIMITED, train_on)
        except ConfigError as exc:
            problems.append(RowProblem(where, exc.message.removeprefix(f"{where}: "), exc.hint))
            continue
        length = max(len(r.tokens) for r in rendered)
        lengths.append(length)
        if length > max_seq_len:
            over += 1
            policies["error"]["refused"] += 1
            policies["drop"]["dropped"] += 1
            for policy in CUTS:  # what the loader makes of the row under each cut
                try:
                    _load_one(kind_def, where, row, tokenizer, max_seq_len, train_on, policy)
                    policies[policy]["cut"] += 1
                except ConfigError:
                    policies[policy]["refused"] += 1
            problems.append(RowProblem(where, f"{length} tokens, over max_seq_len {max_seq_len}",
                                       f"Raise max_seq_len to at least {length}, set data.truncation (right, left or "
                                       f"drop) to cut or skip such rows, or shorten the row."))
    bounds, b = [], 16
    while b < max(lengths or [0]) or b < max_seq_len:
        bounds.append(b)
        b *= 2
    bounds.append(b)
    histogram = [{"up_to": u, "rows": sum(1 for n in lengths if (bounds[i - 1] if i else 0) < n <= u)} for i, u in enumerate(bounds)]
    while histogram and histogram[-1]["rows"] == 0 and histogram[-1]["up_to"] > max_seq_len:
        histogram.pop()
    tokens = {"min": min(lengths), "mean": round(sum(lengths) / len(lengths)), "max": max(lengths)} if lengths else {}
    return DataCheck(str(path), fmt, kind_def.name, len(converted), base_model, max_seq_len, tokens, histogram, over,
                     policies, dict(roles), empty, duplicates, problems)


@dataclass
class PreviewRow:
    where: str
    side: str | None  # "chosen" / "rejected" for preference pairs
    text: str
    trained: list[list[int]]  # character spans [start, end) of the trained tokens
    tokens: int
    trained_tokens: int


def preview(path: str, *, rows: int = 3, kind: str | None = None, base_model: str = "loops-local/tiny",
            train_on: str = "last_assistant", columns: dict[str, str] | None = None) -> tuple[str, str, list[PreviewRow]]:
    """(kind, format, the first ``rows`` rows rendered with their trained spans)."""
    spec = plain_spec(path, columns=columns)
    kind_def, fmt = _kind_of(spec, kind)
    tokenizer = _tokenizer(base_model)
    out: list[PreviewRow] = []
    for where, row in list(read_rows(spec, kind_def.row_purpose))[:rows]:
        rendered = _load_one(kind_def, where, row, tokenizer, UNLIMITED, train_on)
        for side, item in zip(kind_def.row_sides, rendered):
            weights = getattr(item, "weights", None) or [0.0] * len(item.tokens)
            out.append(_spans(where, side, item.tokens, weights, tokenizer))
    return kind_def.name, fmt, out


def _spans(where: str, side: str | None, tokens: list[int], weights: list[float], tokenizer: Any) -> PreviewRow:
    """The decoded text and the character spans of its trained tokens (token i is trained when
    weights[i] > 0), found by decoding prefixes (exact for any tokenizer that decodes prefixes
    to prefixes)."""
    text = tokenizer.decode(tokens)
    spans: list[list[int]] = []
    i = 0
    while i < len(tokens):
        if weights[i] > 0:
            j = i
            while j < len(tokens) and weights[j] > 0:
                j += 1
            start, end = len(tokenizer.decode(tokens[:i])), len(tokenizer.decode(tokens[:j]))
            spans.append([start, end])
            i = j
        else:
            i += 1
    return PreviewRow(where, side, text, spans, len(tokens), sum(1 for w in weights if w > 0))
