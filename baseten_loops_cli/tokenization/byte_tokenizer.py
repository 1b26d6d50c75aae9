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
