"""The tokenizer of ``loops-local/tiny``: raw UTF-8 bytes plus five special tokens.

Built in code (no files, no downloads), so the local backend works offline and every
process agrees on the ids. Ids 0..255 are the bytes themselves; the specials follow:

====  ================
256   ``<|pad|>``
257   ``<|bos|>``
258   ``<|eos|>``
259   ``<|im_start|>``
260   ``<|im_end|>``
====  ================

Special tokens written literally in text (``"<|im_end|>"``) are encoded as their ids, the
way HF tokenizers treat added special tokens, so chat-formatted text round-trips.
"""

from __future__ import annotations

import re
from typing import Iterable

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, IM_START, IM_END)
NUM_BYTES = 256
SPECIAL_IDS: dict[str, int] = {tok: NUM_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)

_SPECIAL_PATTERN = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


class ByteTokenizer:
    """Byte-level tokenizer with ChatML special tokens (see the module docstring)."""

    name = "loops-local/tiny"
    vocab_size = VOCAB_SIZE
    pad_token_id = SPECIAL_IDS[PAD]
    bos_token_id = SPECIAL_IDS[BOS]
    eos_token_id = SPECIAL_IDS[EOS]
    im_start_id = SPECIAL_IDS[IM_START]
    im_end_id = SPECIAL_IDS[IM_END]
    # A chat turn ends with <|im_end|>; raw completions end with <|eos|>.
    stop_token_ids: tuple[int, ...] = (eos_token_id, im_end_id)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _SPECIAL_PATTERN.split(text):
            if not piece:
                continue
            special = SPECIAL_IDS.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Decode ids to text. Never raises: an invalid UTF-8 sequence (e.g. a multi-byte
        character cut mid-way) and any id outside the vocabulary become U+FFFD."""
        parts: list[str] = []
        pending = bytearray()

        def flush() -> None:
            if pending:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()

        for token in ids:
            token = int(token)
            if 0 <= token < NUM_BYTES:
                pending.append(token)
                continue
            flush()
            if NUM_BYTES <= token < VOCAB_SIZE:
                if not skip_special_tokens:
                    parts.append(SPECIAL_TOKENS[token - NUM_BYTES])
            else:
                parts.append("\ufffd")
        flush()
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        """The id of a special token's text, or None."""
        return SPECIAL_IDS.get(token)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


# ── the same tokenizer as files (exports), for stock loaders such as AutoTokenizer ──────────

# ChatML, as tokenization.chat renders it for this tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what the ``ByteLevel`` pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(NUM_BYTES + extra)
            extra += 1
    return [chars[b] for b in range(NUM_BYTES)]


def tokenizer_json() -> str:
    """This tokenizer as a ``tokenizers`` ``tokenizer.json``: a byte-level BPE whose vocabulary is
    the 256 bytes at their own ids and no merges, plus the five specials at 256..260, so it
    encodes and decodes exactly as :class:`ByteTokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in enumerate(_byte_chars())}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return raw.to_str(pretty=True)


def tokenizer_files(max_length: int) -> dict[str, str]:
    """File name -> text of the files that make a folder load with ``AutoTokenizer``."""
    import json

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    return {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
