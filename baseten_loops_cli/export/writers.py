"""The torch side of export: load base + adapter, write peft / hf / gguf, verify by reloading.

Imported only once :func:`baseten_loops_cli.export.require_local_extra` has checked the extra.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from baseten_loops_cli.errors import LoopsError
from baseten_loops_cli.export import ExportResult
from baseten_loops_cli.settings.model_files import TOKENIZER_FILES, find_model_dir

TINY = "loops-local/tiny"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Besides TOKENIZER_FILES, what slow/BPE tokenizers keep in separate files.
EXTRA_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
# Token ids for the verification forward pass (below every vocab size we support).
PROBE_IDS = [[1, 17, 42, 99, 128, 7, 200, 3]]


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


class _NullProgress:
    def start(self, **_: Any) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def file_done(self, name: str) -> None: ...


# ── loading ─────────────────────────────────────────────────────────────────────────────────


def base_dir(name: str) -> Path | None:
    """The base's HF folder on this machine (None for the built-in tiny model)."""
    if name == TINY:
        return None
    return _hf_dir(name)


def _hf_dir(name: str) -> Path:
    """The HF folder of a base other than the tiny model (an error if this machine has none)."""
    path = find_model_dir(name)
    if path is None:
        raise LoopsError(f"this machine has no files for the base model {name}",
                         hint=f"Fetch it: `loops server pull-model {name}` (or name a local HF folder).")
    return path


def load_base(name: str) -> Any:
    """The base model in float32, eval mode."""
    if name == TINY:
        from baseten_loops_cli.local.engine.model_zoo import build_tiny_model

        model = build_tiny_model()
    else:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(_hf_dir(name), dtype=torch.float32)
    model.name_or_path = model.config._name_or_path = name
    return model.eval()


def load_adapted(adapter_dir: Path, base_model: str) -> Any:
    from peft import PeftModel

    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise LoopsError(f"{adapter_dir} has no {ADAPTER_CONFIG}: not a sampler checkpoint (LoRA adapter)")
    return PeftModel.from_pretrained(load_base(base_model), str(adapter_dir)).eval()


@torch.no_grad()
def logits_of(model: Any) -> torch.Tensor:
    return model(input_ids=torch.tensor(PROBE_IDS)).logits.float()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ── writing ─────────────────────────────────────────────────────────────────────────────────


def write(adapter_dir: Path, base_model: str, staging: Path, final: Path, *, fmt: str, dtype: str,
          card: dict[str, Any], progress: Any = None, base_path: str | None = None) -> ExportResult:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar on stderr; none per shard or tensor
    hf_logging.set_verbosity_error()
    progress = progress or _NullProgress()
    with warnings.catch_warnings():
        # peft looks the base's name up on the hub to check the vocabulary; offline that is a
        # warning about a lookup that does not matter here.
        warnings.simplefilter("ignore")
        return _write(adapter_dir, base_model, staging, final, fmt=fmt, dtype=dtype, card=card, progress=progress,
                      base_path=base_path)


def _write(adapter_dir: Path, base_model: str, staging: Path, final: Path, *, fmt: str, dtype: str,
           card: dict[str, Any], progress: Any, base_path: str | None = None) -> ExportResult:
    adapted = load_adapted(adapter_dir, base_model)
    reference = logits_of(adapted)
    if fmt == "peft":
        diff, named = _write_peft(adapter_dir, base_model, adapted, staging, final, dtype, reference, progress, base_path)
        path = final
        card = {**card, "base_path": named, "named_base": named if base_path else None}
    elif fmt == "hf":
        diff = _write_hf(base_model, adapted, staging, dtype, reference, progress)
        path = final
    else:
        name = _safe_name(base_model) + ".gguf"
        diff = _write_gguf(base_model, adapted, staging / name, dtype, reference, progress)
        if base_model == TINY:  # also beside the file, for loaders that read only tokenizer.json
            _write_tokenizer(base_model, staging)
        path = final / name
    (staging / "README.md").write_text(model_card(fmt, dtype, base_model, card, diff))
    files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    return ExportResult(format=fmt, path=str(path), dtype=dtype, base_model=base_model, files=files,
                        bytes=size, max_abs_diff=diff, base_path=card.get("base_path"))


def _safe_name(name: str) -> str:
    """A file name for a base: a hub id's ``/`` as ``--``; a local folder by its own name (not
    its whole path)."""
    folder = Path(name).expanduser()
    if (folder / "config.json").is_file():
        return folder.resolve().name
    return name.replace("/", "--")


def _save_state_dict(tensors: dict[str, torch.Tensor], path: Path, progress: Any) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    progress.advance(path.stat().st_size)
    progress.file_done(path.name)


def _write_peft(adapter_dir: Path, base_model: str, adapted: Any, staging: Path, final: Path, dtype: str,
                reference: torch.Tensor, progress: Any, base_path: str | None = None) -> tuple[float, str | None]:
    """Write the adapter; returns the verification diff and the base's local folder (the one
    ``base_path`` names, or where this machine has the base: what loads it offline)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    progress.start(total_bytes=sum(t.numel() * t.element_size() for t in tensors.values()), completed_bytes=0, files=1)
    if base_model == TINY:
        # No hub has the tiny model (it is built in code): ship it as a real HF folder and
        # point the adapter at it, so AutoPeftModelForCausalLM.from_pretrained(DIR) just works.
        base = load_base(TINY)
        base.save_pretrained(staging / "base", safe_serialization=True)
        # Its byte tokenizer beside both (built in code too): AutoTokenizer loads the export
        # folder and its base/ alike.
        _write_tokenizer(TINY, staging / "base")
        _write_tokenizer(TINY, staging)
        config["base_model_name_or_path"] = str(final / "base")
    else:
        local = Path(base_model).expanduser()
        # A hub id stays a hub id (peft finds it online or in the HF cache); a local folder
        # is named by its absolute path.
        config["base_model_name_or_path"] = str(local.absolute()) if (local / "config.json").is_file() else base_model
    folder = str(final / "base") if base_model == TINY else str(base_dir(base_model))
    if base_path is not None:  # --base-path: name this folder, so peft loads without the hub
        folder = str(Path(base_path).expanduser().absolute())
        if not (Path(folder) / "config.json").is_file():
            raise LoopsError(f"--base-path {base_path}: no config.json there (not a Hugging Face model folder)",
                             hint=f"Name the base's folder; this machine has {base_model} at {base_dir(base_model) or 'DIR/base'}.")
        config["base_model_name_or_path"] = folder
    config["inference_mode"] = True
    _save_state_dict({k: v.to(torch_dtype(dtype)) for k, v in tensors.items()}, staging / ADAPTER_WEIGHTS, progress)
    (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # Verify: plain peft on the written folder (the tiny base from the staged copy).
    base = load_base(base_model) if base_model != TINY else _load_hf(staging / "base")
    reloaded = PeftModel.from_pretrained(base, str(staging)).eval()
    return max_abs_diff(logits_of(reloaded), reference), folder


def _load_hf(path: Path, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()


def merged_model(adapted: Any, dtype: str) -> Any:
    merged = adapted.merge_and_unload()
    return merged.to(torch_dtype(dtype))


def _write_hf(base_model: str, adapted: Any, staging: Path, dtype: str, reference: torch.Tensor, progress: Any) -> float:
    merged = merged_model(adapted, dtype)
    total = sum(p.numel() * p.element_size() for p in merged.state_dict().values())
    progress.start(total_bytes=total, completed_bytes=0, files=1)
    merged.config._name_or_path = base_model
    merged.save_pretrained(staging, safe_serialization=True)
    progress.advance(total)
    progress.file_done("model.safetensors")
    _write_tokenizer(base_model, staging)
    return max_abs_diff(logits_of(_load_hf(staging)), reference)


def _write_tokenizer(base_model: str, staging: Path) -> None:
    """The base's tokenizer files; the tiny model's byte tokenizer (built in code) written as a
    ``tokenizers`` tokenizer.json, so ``AutoTokenizer.from_pretrained(DIR)`` loads every export."""
    directory = base_dir(base_model)
    if directory is None:
        from baseten_loops_cli.local.engine.model_zoo import TINY_CONFIG
        from baseten_loops_cli.tokenization.byte_tokenizer import tokenizer_files

        for name, text in tokenizer_files(TINY_CONFIG["max_position_embeddings"]).items():
            (staging / name).write_text(text)
        return
    for name in (*TOKENIZER_FILES, *EXTRA_TOKENIZER_FILES):
        if (directory / name).is_file():
            shutil.copyfile(directory / name, staging / name)


# ── GGUF ────────────────────────────────────────────────────────────────────────────────────


def llama_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """q/k rows reordered from HF's rotate-half RoPE layout to llama.cpp's interleaved one
    (what llama.cpp's convert_hf_to_gguf does; readers such as transformers undo it)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# transformers model_type -> llama.cpp architecture, and whether q/k rows are permuted: llama's
# rotate-half RoPE becomes llama.cpp's interleaved one; Qwen's runs as NEOX RoPE in llama.cpp,
# which is HF's layout already (convert_hf_to_gguf permutes llama only).
GGUF_ARCHITECTURES = {"llama": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False)}


def gguf_architecture(config: Any) -> tuple[Any, bool]:
    """(gguf.MODEL_ARCH, permute q/k) of a base's config; refused for architectures we do not map."""
    import gguf

    found = GGUF_ARCHITECTURES.get(config.model_type)
    if found is None:
        raise LoopsError(f"GGUF export supports {', '.join(GGUF_ARCHITECTURES)} bases; "
                         f"{config._name_or_path} is {config.model_type}",
                         hint="Export with --format hf and convert with llama.cpp's convert_hf_to_gguf.py.")
    return gguf.MODEL_ARCH[found[0]], found[1]


def gguf_tensors(merged: Any) -> dict[str, torch.Tensor]:
    """The merged state dict under llama.cpp's tensor names (q/k permuted for llama; Qwen2's
    q/k/v biases and Qwen3's q/k norms by the same name map)."""
    import gguf

    config = merged.config
    arch, permute = gguf_architecture(config)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for key, value in merged.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise LoopsError(f"no GGUF name for tensor {key}")
        if permute and key.endswith("q_proj.weight"):
            value = llama_permute(value, config.num_attention_heads)
        elif permute and key.endswith("k_proj.weight"):
            value = llama_permute(value, config.num_key_value_heads)
        out[name] = value
    return out


def _write_gguf(base_model: str, adapted: Any, path: Path, dtype: str, reference: torch.Tensor, progress: Any) -> float:
    import gguf

    merged = merged_model(adapted, "float32")
    config = merged.config
    tensors = gguf_tensors(merged)
    arch, _ = gguf_architecture(config)
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(base_model)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    # head_dim may differ from hidden_size / heads (Qwen3: 128 at every size; Mistral-style
    # llama bases); llama.cpp reads it from key_length / value_length.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or (config.rope_parameters or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_type)
    _add_tokenizer(writer, base_model, config)
    total = 0
    for name, value in tensors.items():
        data = value.detach().float().contiguous()
        if value.ndim == 1 or dtype == "float32":  # norms stay F32, as llama.cpp writes them
            writer.add_tensor(name, data.numpy())
        elif dtype == "float16":
            writer.add_tensor(name, data.half().numpy())
        else:
            raw = data.bfloat16().view(torch.int16).numpy()
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        total += data.numel() * (4 if value.ndim == 1 or dtype == "float32" else 2)
    progress.start(total_bytes=total, completed_bytes=0, files=1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    progress.advance(total)
    progress.file_done(path.name)
    return _verify_gguf(path, merged, tensors, reference)


def _add_tokenizer(writer: Any, base_model: str, config: Any) -> None:
    """Tokenizer metadata for a BPE tokenizer.json base (GPT-2 style, as SmolLM2 has), the tiny
    model's byte tokenizer included (its tokenizer.json form: the bytes, no merges)."""
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(config, key, None)
        if isinstance(value, int):
            add(value)
    directory = base_dir(base_model)
    template: str | None
    if directory is None:  # the tiny byte tokenizer, in its tokenizer.json form
        from baseten_loops_cli.tokenization.byte_tokenizer import CHAT_TEMPLATE, tokenizer_json

        spec, template, add_bos = json.loads(tokenizer_json()), CHAT_TEMPLATE, False
    elif (directory / "tokenizer.json").is_file():
        spec, template = json.loads((directory / "tokenizer.json").read_text()), _chat_template(directory)
        add_bos = bool(_tokenizer_config(directory).get("add_bos_token", False))
    else:
        return
    import gguf

    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return
    vocab: dict[str, int] = model["vocab"]
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for text, token in added.items():
        vocab.setdefault(text, token["id"])
    size = max(config.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        special = added.get(text, {}).get("special")
        types[i] = gguf.TokenType.CONTROL if special else (gguf.TokenType.USER_DEFINED if text in added else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre(spec))
    # Said outright: llama.cpp's default for a BPE vocabulary is to prepend BOS, which neither
    # SmolLM2's nor Qwen's tokenizer does.
    writer.add_add_bos_token(add_bos)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if not merges:  # a byte vocabulary (tiny): readers that rebuild merges from scores find none
        writer.add_token_scores([0.0] * size)
    if template:
        writer.add_chat_template(template)


# Qwen2's pre-tokenizer split (Qwen2.5 and Qwen3 share it): words, single digits, punctuation runs.
_QWEN2_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"


def tokenizer_pre(spec: dict[str, Any]) -> str:
    """llama.cpp's name for a tokenizer.json's pre-tokenizer (what convert_hf_to_gguf finds by
    hashing a test string; here by the pre-tokenizer itself): ``qwen2`` for Qwen's split regex,
    ``smollm`` for single digits + GPT-2's byte-level regex (SmolLM2's tokenizer.json), ``gpt2``
    for that regex alone (SmolLM2 as transformers rebuilds it from a GGUF file, which the local
    engine converts once), else ``default`` (the tiny model's bytes: no regex)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "Split" and (step.get("pattern") or {}).get("Regex", "").startswith(_QWEN2_SPLIT):
            return "qwen2"
    byte_regex = any(step.get("type") == "ByteLevel" and step.get("use_regex", True) for step in steps)
    if byte_regex and any(step.get("type") == "Digits" and step.get("individual_digits") for step in steps):
        return "smollm"
    return "gpt2" if byte_regex else "default"


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _chat_template(directory: Path) -> str | None:
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    value = _tokenizer_config(directory).get("chat_template")
    return value if isinstance(value, str) else None


def _verify_gguf(path: Path, merged: Any, tensors: dict[str, torch.Tensor], reference: torch.Tensor) -> float:
    """Read the file back with gguf's reader (every tensor against what was written), then load
    it with transformers' GGUF loader, an independent reader, and compare the logits."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    found = {t.name: t for t in reader.tensors}
    if set(found) != set(tensors):
        raise LoopsError(f"{path.name} read back with tensors {sorted(set(found) ^ set(tensors))} differing from what was written")
    worst = 0.0
    for name, value in tensors.items():
        data = np.asarray(found[name].data)
        if found[name].tensor_type == gguf.GGMLQuantizationType.BF16:
            data = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
        worst = max(worst, float(np.abs(data.astype(np.float32).reshape(tuple(value.shape)) - value.float().numpy()).max()))
    import contextlib
    import io

    try:
        # transformers draws its own tqdm bar over the GGUF tensors on stderr; ours is enough.
        with contextlib.redirect_stderr(io.StringIO()):
            loaded = _load_hf(path.parent, gguf_file=path.name)
    except Exception as exc:  # the reader above already checked every tensor
        raise LoopsError(f"transformers could not load the written {path.name}: {exc}") from None
    return max(worst, max_abs_diff(logits_of(loaded), reference))


# ── model card ──────────────────────────────────────────────────────────────────────────────


def model_card(fmt: str, dtype: str, base_model: str, card: dict[str, Any], diff: float) -> str:
    how = {
        "peft": ("A LoRA adapter (PEFT). Load it with:\n\n```python\nfrom peft import AutoPeftModelForCausalLM\n"
                 "model = AutoPeftModelForCausalLM.from_pretrained(\"THIS_FOLDER\")\n```\n\n"
                 + ("The base model (`loops-local/tiny`, built in code) is in `base/`; `adapter_config.json` names it by "
                    "its absolute path. After moving the folder, load it with "
                    "`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(\"THIS_FOLDER/base\"), \"THIS_FOLDER\")`. "
                    "Its byte tokenizer is in both folders (`AutoTokenizer.from_pretrained(\"THIS_FOLDER\")`)."
                    if base_model == TINY else
                    f"`adapter_config.json` names the base's local folder `{card['named_base']}` (exported with "
                    "`--base-path`), so `AutoPeftModelForCausalLM.from_pretrained(\"THIS_FOLDER\")` loads it without the "
                    "hub while that folder is there."
                    if card.get("named_base") else
                    f"`adapter_config.json` names the base as `{base_model}`. Offline (no hub; "
                    f"`AutoPeftModelForCausalLM` would retry the hub first) load it from the base's local folder"
                    + (f", `{card['base_path']}` on the machine that exported it" if card.get("base_path") else "")
                    + ": `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(\"BASE_FOLDER\"), \"THIS_FOLDER\")`, "
                    "or export with `--base-path BASE_FOLDER` to write that folder into `adapter_config.json`.")),
        "hf": "Base and adapter merged into one transformers model: `AutoModelForCausalLM.from_pretrained(\"THIS_FOLDER\")`, "
              "or serve it with vLLM (`vllm serve THIS_FOLDER`)."
              + (" The tiny model's byte tokenizer is included as `tokenizer.json` (`AutoTokenizer.from_pretrained(\"THIS_FOLDER\")`)." if base_model == TINY else ""),
        "gguf": "Base and adapter merged into one GGUF file (the base's architecture: llama, qwen2 or qwen3) for llama.cpp-compatible runtimes."
                + (" The tiny model's byte tokenizer is in the file's metadata (a byte vocabulary without merges) and "
                   "beside it as `tokenizer.json` (`AutoTokenizer.from_pretrained(\"THIS_FOLDER\")`)." if base_model == TINY else ""),
    }[fmt]
    rows = [("Base model", base_model), ("Format", fmt), ("Dtype", dtype),
            ("Checkpoint", card.get("checkpoint")), ("URI", card.get("uri")), ("Run", card.get("run_id")),
            ("Run name", card.get("run_name")), ("LoRA rank", card.get("lora_rank")), ("Saved", card.get("created_at")),
            ("Verified", f"reloaded; forward-pass max abs diff vs base + adapter: {diff:.3g}")]
    lines = [f"# {card.get('checkpoint') or 'LoRA adapter'} ({fmt})", "", "Exported with `loops checkpoints export`.", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows if v not in (None, "")]
    lines += ["", "Training data, steps and metrics: see the run (`loops runs describe "
              f"{card.get('run_id') or 'RUN'}`); the checkpoint itself does not record them.", "", how, ""]
    if card.get("command"):
        lines += ["Made with:", "", f"```\n{card['command']}\n```", ""]
    return "\n".join(lines)
