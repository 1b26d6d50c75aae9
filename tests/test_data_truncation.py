"""``data.truncation`` (issue 40 point 4): the pure cuts, each policy for each kind through the
kinds' own data loading, and the notes and errors a user sees. The tiny model's byte tokenizer
makes a row's length exact: one token per character plus the chat template's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.tokenization import get_tokenizer
from baseten_loops_cli.training.config import load_config
from baseten_loops_cli.training.data.formats import truncation as trunc
from baseten_loops_cli.training.plan import load_data

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LIMIT = 64
SHORT, LONG = "p" * 8, "x" * 90


# ── the pure cuts ─────────────────────────────────────────────────────────────────────────
def test_cut_keeps_the_first_or_the_last_tokens():
    tokens, weights = list(range(10)), [0.0] * 4 + [1.0] * 6
    assert trunc.cut(tokens, weights, 4, "right") == ([0, 1, 2, 3], [0.0] * 4)
    assert trunc.cut(tokens, weights, 4, "left") == ([6, 7, 8, 9], [1.0] * 4)
    assert trunc.cut(tokens, weights, 10, "left") == (tokens, weights)  # it fits: unchanged
    assert trunc.cut_prompt(list(range(10)), 3) == [7, 8, 9]  # a prompt keeps its end


def _side(prompt: int, reply: int, tag: int) -> tuple[list, list]:
    return [0] * prompt + [tag] * reply, [0.0] * prompt + [1.0] * reply


def test_pairs_cut_the_prompt_from_the_left_then_the_replies_from_the_right():
    """As TRL's DPOTrainer with truncation_mode="keep_end" and max_prompt_length = half."""
    prompt = list(range(100, 150))  # 50 prompt tokens, told apart to see which are kept
    chosen = (prompt + [1] * 10, [0.0] * 50 + [1.0] * 10)
    rejected = (prompt + [2] * 6, [0.0] * 50 + [1.0] * 6)
    # Short replies: only the prompt is cut, to what leaves room for the longer reply.
    (c, cw), (r, rw) = trunc.cut_replies([chosen, rejected], 40)
    assert c == prompt[-30:] + [1] * 10 and r == prompt[-30:] + [2] * 6 and cw == [0.0] * 30 + [1.0] * 10
    # Long replies too: the prompt keeps its last half of the limit, the replies their first tokens.
    long_pair = [(prompt + [1] * 70, [0.0] * 50 + [1.0] * 70), (prompt + [2] * 5, [0.0] * 50 + [1.0] * 5)]
    (c, _), (r, _) = trunc.cut_replies(long_pair, 40)
    assert c == prompt[-20:] + [1] * 20 and r == prompt[-20:] + [2] * 5
    # A short prompt is kept whole; the reply takes the rest.
    (c, _), = trunc.cut_replies([_side(5, 70, 1)], 40)
    assert c == [0] * 5 + [1] * 35
    fits = [_side(5, 10, 1), _side(5, 12, 2)]
    assert trunc.cut_replies(fits, 40) == fits


# ── each policy for each kind, through the kind's load_data ───────────────────────────────
ROWS = {
    "sft": [{"prompt": SHORT, "completion": "ok"}, {"prompt": LONG, "completion": "ok"}, {"prompt": "q", "completion": LONG}],
    "rl": [{"prompt": SHORT, "answer": "1"}, {"prompt": LONG, "answer": "2"}],
    "distill": [{"prompt": SHORT}, {"prompt": LONG}],
    "dpo": [{"prompt": SHORT, "chosen": "yes", "rejected": "no"}, {"prompt": LONG, "chosen": "yes", "rejected": "no"},
            {"prompt": SHORT, "chosen": LONG, "rejected": "no"}],
    "kto": [{"prompt": SHORT, "completion": "yes", "label": True}, {"prompt": LONG, "completion": "no", "label": False},
            {"prompt": SHORT, "completion": LONG, "label": True}, {"prompt": SHORT, "completion": "nah", "label": False}],
}
EXAMPLE = {"sft": "tiny-sft.yaml", "rl": "tiny-rl.yaml", "distill": "tiny-distill.yaml", "dpo": "tiny-dpo.yaml",
           "kto": "tiny-kto.yaml"}
PROMPT_KINDS = ("rl", "distill")


def _load(tmp_path: Path, kind: str, policy: str | None):
    data = tmp_path / f"{kind}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[kind]), encoding="utf-8")
    key = "prompts" if kind in PROMPT_KINDS else "train"
    sets = [f"max_seq_len={LIMIT}", f"data.{key}={data}", f"data.{'eval_prompts' if kind in PROMPT_KINDS else 'eval'}=null"]
    if kind == "distill":
        sets.append("teacher.model=loops-local/tiny")  # a base model teacher: no backend needed
    if policy is not None:
        sets.append(f"data.truncation={policy}")
    return load_data(load_config(EXAMPLES / EXAMPLE[kind], sets))


def _sequences(kind: str, data) -> list[list[int]]:
    if kind == "dpo":
        return [s.tokens for p in data.train for s in (p.chosen, p.rejected)]
    if kind == "kto":
        return [e.example.tokens for e in data.train]
    return [row.tokens for row in data.train]


def _over(kind: str) -> int:
    return len(ROWS[kind]) - (2 if kind == "kto" else 1)  # the rows with a LONG field


@pytest.mark.parametrize("kind", list(ROWS))
def test_error_is_the_default_and_names_the_row_and_data_truncation(kind, tmp_path):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, kind, None)
    message = info.value.message
    assert f"{kind}.jsonl:2" in message and f"max_seq_len {LIMIT}" in message
    if _over(kind) > 1:  # every refused row is listed, not only the first
        assert message.startswith(f"{_over(kind)} rows refused:") and f"{kind}.jsonl:3" in message
    assert "data.truncation" in info.value.hint
    with pytest.raises(ConfigError):
        _load(tmp_path, kind, "error")


@pytest.mark.parametrize("kind", list(ROWS))
def test_drop_skips_and_counts_the_rows_over(kind, tmp_path):
    data = _load(tmp_path, kind, "drop")
    assert len(data.train) == len(ROWS[kind]) - _over(kind)
    sources = [getattr(row, "source", None) or row.example.source for row in data.train]
    assert all(LONG not in json.dumps(ROWS[kind][int(s.rsplit(":", 1)[1]) - 1]) for s in sources)
    assert any(f"{_over(kind)} row{'s' if _over(kind) > 1 else ''} over max_seq_len dropped by data.truncation" in n
               for n in data.notes), data.notes


@pytest.mark.parametrize("policy", trunc.CUTS)
@pytest.mark.parametrize("kind", list(ROWS))
def test_cuts_keep_every_row_within_max_seq_len(kind, policy, tmp_path):
    tok = get_tokenizer("loops-local/tiny")
    if kind == "sft" and policy == "right":  # row 3's reply starts after the limit: nothing left to train on
        with pytest.raises(ConfigError) as info:
            _load(tmp_path, kind, policy)
        assert "sft.jsonl:2: cut to max_seq_len 64 (data.truncation: right), nothing is left to train on" in info.value.message
        assert "data.truncation: left" in info.value.hint
        return
    data = _load(tmp_path, kind, policy)
    assert len(data.train) == len(ROWS[kind])
    assert any(f"over max_seq_len cut ({policy}) by data.truncation" in n for n in data.notes), data.notes
    sequences = _sequences(kind, data)
    if kind in PROMPT_KINDS:  # room for sampling.max_tokens; the prompt keeps its end (the generation prompt)
        budget = LIMIT - data_max_tokens(kind)
        assert max(len(s) for s in sequences) <= budget
        assert tok.decode(sequences[1]).endswith("x" * 8 + "<|im_end|>\n<|im_start|>assistant\n")
        return
    assert max(len(s) for s in sequences) <= LIMIT
    if kind == "kto":  # the KL sequences (a prompt with another row's completion) are cut as the rows
        assert all(len(item.kl.tokens) <= LIMIT and item.kl.trained_tokens > 0 for item in data.train)
    if kind == "sft":  # left keeps the ends: the replies
        assert all(w > 0 for w in data.train[1].weights[-2:]) and tok.decode(data.train[1].tokens).startswith("x")
    else:  # pairs and KTO rows: the prompt cut from the left, the reply kept from its start
        long_prompt = data.train[1].chosen if kind == "dpo" else data.train[1].example
        text = tok.decode(long_prompt.tokens)
        assert text.startswith("x") and "<|im_start|>assistant\n" + ("yes" if kind == "dpo" else "no") in text
        long_reply = data.train[2].chosen if kind == "dpo" else data.train[2].example
        assert tok.decode(long_reply.tokens).startswith("<|im_start|>user\n" + SHORT)  # short prompt whole


def data_max_tokens(kind: str) -> int:
    return load_config(EXAMPLES / EXAMPLE[kind]).config.sampling.max_tokens
