"""Tokenizers and chat templates shared by the client (data preparation) and the local
server (sampling, chat completions). Never torch or transformers (tests/test_layers.py).

- ``loops-local/*``: built in code (:class:`~.byte_tokenizer.ByteTokenizer`).
- anything else: ``tokenizer.json`` and the chat template from the model's files
  (:mod:`.files`), found by ``settings.model_files.find_model_dir``: a local directory, the
  converted-model cache, or the Hugging Face hub cache.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

from baseten_loops_cli.errors import LoopsError
from baseten_loops_cli.settings.model_files import TOKENIZER_FILES
from baseten_loops_cli.tokenization.byte_tokenizer import ByteTokenizer
from baseten_loops_cli.tokenization.chat import (
    render_chat,
    render_generation_prompt,
    render_prompt_completion,
    template_supports_tools,
)

TINY_MODEL = "loops-local/tiny"

__all__ = [
    "TINY_MODEL",
    "Tokenizer",
    "TokenizerUnavailableError",
    "get_tokenizer",
    "local_model_names",
    "render_chat",
    "render_generation_prompt",
    "render_prompt_completion",
    "template_supports_tools",
]


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    # Read-only (properties), so a tokenizer that always has the id (an ``int``) fits.
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def pad_token_id(self) -> int | None: ...
    stop_token_ids: tuple[int, ...]  # ids that end a generation (eos, end-of-turn)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...


class TokenizerUnavailableError(LoopsError):
    """The tokenizer of a model cannot be loaded here."""


# Tokenizers built in code, by model name.
_BUILTIN: dict[str, type[ByteTokenizer]] = {TINY_MODEL: ByteTokenizer}
_cache: dict[str, Tokenizer] = {}
_lock = threading.Lock()


def local_model_names() -> list[str]:
    """Models whose tokenizer is built in code (any model with files on disk also works)."""
    return list(_BUILTIN)


def get_tokenizer(base_model: str) -> Tokenizer:
    """The tokenizer of ``base_model`` (cached per name; thread-safe)."""
    with _lock:
        tokenizer = _cache.get(base_model)
        if tokenizer is None:
            tokenizer = _cache[base_model] = _load(base_model)
        return tokenizer


def _byte_vocabulary_folder(name: str) -> bool:
    import json
    from pathlib import Path

    from baseten_loops_cli.settings.model_files import byte_vocabulary

    config = Path(name).expanduser() / "config.json"
    try:
        return config.is_file() and byte_vocabulary(json.loads(config.read_text()))
    except (OSError, ValueError):
        return False


def _load(base_model: str) -> Tokenizer:
    builtin = _BUILTIN.get(base_model)
    if builtin is not None:
        return builtin()
    from baseten_loops_cli.settings.model_files import find_model_dir
    from baseten_loops_cli.tokenization.files import load_file_tokenizer

    directory = find_model_dir(base_model, weights=False)
    if directory is None and _byte_vocabulary_folder(base_model):
        return ByteTokenizer()  # a folder of the tiny model (a merged export): its tokenizer is built in code
    directory = directory or _from_hub(base_model)
    if directory is None:
        raise TokenizerUnavailableError(
            f"The tokenizer of {base_model} is not on this machine (no tokenizer.json in a "
            "local model directory, the converted-model cache or the Hugging Face cache) and "
            "could not be downloaded from the Hugging Face hub.",
            hint=f"Run 'loops server pull-model {base_model}', or pass a local model directory.",
        )
    try:
        return load_file_tokenizer(base_model, directory)
    except Exception as exc:  # tokenizers raises plain Exceptions on bad files
        raise TokenizerUnavailableError(
            f"Could not load the tokenizer of {base_model} from {directory}: {exc}",
            hint=f"Delete that directory and run 'loops server pull-model {base_model}' again.",
        ) from exc


def _from_hub(base_model: str) -> Path | None:
    """The tokenizer files of a hub id, downloaded into the HF cache (not the weights);
    None when offline (``HF_HUB_OFFLINE=1``) or unknown."""
    if base_model.count("/") != 1 or Path(base_model).expanduser().exists():
        return None
    try:
        from huggingface_hub import snapshot_download  # a dependency of tokenizers

        return Path(snapshot_download(base_model, allow_patterns=list(TOKENIZER_FILES)))
    except Exception:  # offline, unknown repo, gated: the caller says what to do
        return None
