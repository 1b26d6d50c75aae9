"""Tokenizers and chat templates shared by the client (data preparation) and the local
server (sampling, chat completions). No torch here, and ``transformers`` only on demand.

- ``loops-local/tiny``: :class:`~.byte_tokenizer.ByteTokenizer`, built in code.
- anything else: ``transformers.AutoTokenizer``, loaded from where the local engine finds
  the model (``local.engine.model_zoo.resolve_model_dir``: a local directory, the HF cache,
  or the converted-GGUF cache), else from the Hugging Face hub id itself.
"""

from __future__ import annotations

import threading
from typing import Iterable, Protocol, runtime_checkable

from baseten_loops_cli.errors import LoopsError
from baseten_loops_cli.tokenization.byte_tokenizer import ByteTokenizer
from baseten_loops_cli.tokenization.chat import render_chat, render_prompt_completion

TINY_MODEL = "loops-local/tiny"

__all__ = [
    "TINY_MODEL",
    "Tokenizer",
    "TokenizerUnavailableError",
    "get_tokenizer",
    "local_model_names",
    "render_chat",
    "render_prompt_completion",
]


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None
    stop_token_ids: tuple[int, ...]  # ids that end a generation (eos, end-of-turn)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...


class TokenizerUnavailableError(LoopsError):
    """The tokenizer of a model cannot be loaded here."""


_cache: dict[str, Tokenizer] = {}
_lock = threading.Lock()


def local_model_names() -> list[str]:
    """Models the local backend knows by name (any local HF model directory also works)."""
    try:
        from baseten_loops_cli.local.engine.model_zoo import BUILTIN_MODELS
    except ImportError:  # the engine package is absent from this install
        return [TINY_MODEL]
    return list(BUILTIN_MODELS)


def get_tokenizer(base_model: str) -> Tokenizer:
    """The tokenizer of ``base_model`` (cached per name; thread-safe)."""
    with _lock:
        tokenizer = _cache.get(base_model)
        if tokenizer is None:
            tokenizer = _cache[base_model] = _load(base_model)
        return tokenizer


def _load(base_model: str) -> Tokenizer:
    if base_model == TINY_MODEL:
        return ByteTokenizer()
    try:
        import transformers  # noqa: F401  (only to give a clear error when it is missing)
    except ImportError:
        raise TokenizerUnavailableError(
            f"The tokenizer of {base_model} needs the 'transformers' package.",
            hint="pip install 'baseten-loops-cli[local]' (or pip install transformers).",
        ) from None
    from baseten_loops_cli.local.engine.model_zoo import resolve_model_dir
    from baseten_loops_cli.tokenization.hf import load_hf_tokenizer

    source = resolve_model_dir(base_model) or base_model
    try:
        return load_hf_tokenizer(base_model, source)
    except Exception as exc:  # transformers raises OSError/ValueError/HTTP errors
        raise TokenizerUnavailableError(
            f"Could not load the tokenizer of {base_model}: {exc}",
            hint=f"Check the model name, or run 'loops server pull-model {base_model}'.",
        ) from exc
