"""A thin wrapper giving a ``transformers`` tokenizer the loops :class:`Tokenizer` shape.

``transformers`` is only imported by :func:`load_hf_tokenizer`, never at module import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

# Turn-ending tokens of common chat templates; whichever the vocabulary has are stop tokens.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class HFTokenizer:
    """Wraps a ``transformers.PreTrainedTokenizerBase``; ``.hf`` is the wrapped object."""

    def __init__(self, name: str, hf: Any) -> None:
        self.name = name
        self.hf = hf
        self.vocab_size: int = len(hf)
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        self.pad_token_id: int | None = (
            hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
        )
        stops = {self.eos_token_id} if self.eos_token_id is not None else set()
        vocab = hf.get_vocab()
        stops.update(vocab[tok] for tok in _TURN_END_TOKENS if tok in vocab)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # Ids the vocabulary does not know decode to U+FFFD instead of raising.
        safe = [i if 0 <= i < self.vocab_size else None for i in map(int, ids)]
        if None not in safe:
            return self.hf.decode(safe, skip_special_tokens=skip_special_tokens)
        out: list[str] = []
        run: list[int] = []
        for token in safe:
            if token is None:
                out.append(self.hf.decode(run, skip_special_tokens=skip_special_tokens))
                out.append("\ufffd")
                run = []
            else:
                run.append(token)
        out.append(self.hf.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(out)

    def apply_chat_template_text(self, messages: Sequence[dict], add_generation_prompt: bool
                                 ) -> str:
        return self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in ``text``."""
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(span) for span in enc["offset_mapping"]]

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def load_hf_tokenizer(name: str, source: str | Path) -> HFTokenizer:
    """Load with ``AutoTokenizer`` from a directory or a hub id (``source``)."""
    from transformers import AutoTokenizer

    return HFTokenizer(name, AutoTokenizer.from_pretrained(str(source)))
