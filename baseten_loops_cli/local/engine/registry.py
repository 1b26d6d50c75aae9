"""Loaded base models, shared by every trainer and sampler that uses them.

One :class:`BaseModel` per name per process. LoRA adapters (trainers' and samplers') all
live on that one module through PEFT's multi-adapter support, so N runs on a base cost one
copy of the base weights plus N small adapters. Only one adapter is active at a time:
callers hold ``base.lock`` from :meth:`BaseModel.activate` until their compute is done.

Each loaded base also has a :attr:`BaseModel.twin` for sampling: the same weight tensors (not a
copy) in module objects of its own, with adapters of its own, so a sampler can generate on one
thread while a trainer steps on another (PEFT's active adapter is per module, so two users of
one module could not run at once).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys

from baseten_loops_cli.local.engine import attention, derived_saves, precision, thread_budget
from baseten_loops_cli.local.engine.model_zoo import (
    ModelInfo,
    available_models,
    load_model,
)

__all__ = ["BaseModel", "ModelInfo", "available_models", "decoder_layers", "load_base"]


class BaseModel:
    """A frozen float32 causal LM plus the LoRA adapters attached to it."""

    def __init__(self, name: str, info: ModelInfo, module: Any) -> None:
        self.name = name
        self.info = info
        self.module = module  # the transformers model; LoRA layers are injected into it
        precision.float32_head(module)  # logprobs from float32 logits under any policy
        self.lock = threading.RLock()
        self._peft: Any = None  # peft.PeftModel, created with the first adapter
        self._adapter_names: dict[str, str] = {}  # caller's name -> PEFT-safe name
        # The PEFT name last passed to set_adapter (None: unknown). set_adapter walks every
        # module (~40 ms a call on SmolLM2), so activate() skips it when nothing changed;
        # adding or deleting an adapter resets this (PEFT re-marks the layers then).
        self._active: str | None = None
        self._twin: BaseModel | None = None
        # True once the frozen matmul weights are bf16 (precision.store_matmul_weights_bf16):
        # every forward pass must then run under a bf16 policy.
        self.bf16_weights = False
        # False for the sampling twin: nothing there runs a backward pass.
        self.trains = True

    @property
    def twin(self) -> "BaseModel":
        """The sampling twin (see the module docstring); made by :func:`load_base` before any
        adapter exists, because the twin copies the module's structure as it is."""
        if self._twin is None:
            raise RuntimeError(f"{self.name} was not loaded with a twin (registry.load_base makes it)")
        return self._twin

    def make_twin(self) -> "BaseModel":
        """Module objects of their own around the same parameter and buffer tensors: costs
        the module tree (milliseconds), not the weights."""
        if self._peft is not None:
            raise RuntimeError("a twin must be made before any adapter is attached")
        shared = {id(t): t for t in (*self.module.parameters(), *self.module.buffers())}
        self._twin = BaseModel(self.name, self.info, copy.deepcopy(self.module, memo=shared))
        self._twin.bf16_weights = self.bf16_weights
        self._twin.trains = False
        return self._twin

    def store_matmul_weights_bf16(self) -> None:
        """Keep the frozen matmul weights in bf16 (precision.store_matmul_weights_bf16), for
        this base and its twin (the same tensors). Before any adapter exists."""
        if self._peft is not None:
            raise RuntimeError("the weights' dtype must be set before any adapter is attached")
        precision.store_matmul_weights_bf16(self.module)
        self.bf16_weights = True
        if self._twin is not None:  # the twin's modules hold the old weight objects
            self._twin = None
            self.make_twin()

    @property
    def max_seq_len(self) -> int:
        return self.info.max_seq_len

    @property
    def vocab_size(self) -> int:
        return int(self.module.config.vocab_size)

    # ── adapters ──

    @staticmethod
    def _safe_name(name: str) -> str:
        # PEFT adapter names become nn.ModuleDict keys: no dots. The hash keeps names that
        # sanitise alike ("a.b" / "a_b") distinct.
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        return f"{re.sub(r'[^A-Za-z0-9_]', '_', name)[:40]}_{digest}"

    def has_adapter(self, name: str) -> bool:
        return name in self._adapter_names

    def add_adapter(self, name: str, config: Any) -> None:
        """Attach a fresh adapter (initialised from the current torch RNG)."""
        from peft import get_peft_model

        if name in self._adapter_names:
            raise ValueError(f"adapter {name!r} already exists on {self.name}")
        safe = self._safe_name(name)
        with self.lock, warnings.catch_warnings():
            # PEFT calls a transformers API deprecated in 5.x; nothing for us to act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            self._active = None
            if self._peft is None:
                self._peft = get_peft_model(self.module, config, adapter_name=safe)
            else:
                self._peft.add_adapter(safe, config)
            if self.bf16_weights and self.trains:  # a backward pass keeps the copies
                precision.share_input_casts(self.module)
            if self.trains:
                derived_saves.install(self.module)
            self._adapter_names[name] = safe

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Attach an adapter saved in PEFT format at ``path``."""
        config = self._saved_config(path)
        self.add_adapter(name, config)
        self.set_adapter_state(name, _saved_weights(path))

    def reload_adapter(self, name: str, path: str | Path) -> bool:
        """Replace adapter ``name``'s weights with the PEFT adapter at ``path`` if both have
        the same LoRA layers (rank, alpha, targets, ...); False, unchanged, if not. Adding an
        adapter makes PEFT walk and wrap every layer (SmolLM2's 210 LoRA layers; 16 ms a load
        even on the tiny model, a sixth of an RL step's sampling there), copying weights in
        does not. Raises like :meth:`load_adapter` for a missing or malformed folder."""
        if _layer_fields(self._saved_config(path)) != _layer_fields(self.adapter_config(name)):
            return False
        self.set_adapter_state(name, _saved_weights(path))
        return True

    def _saved_config(self, path: str | Path) -> Any:
        """The LoraConfig of the PEFT folder ``path`` (for inference), if trained on this base."""
        from peft import LoraConfig

        config = LoraConfig.from_pretrained(str(path))
        if config.base_model_name_or_path not in (None, self.name):
            raise ValueError(f"it was trained on {config.base_model_name_or_path}, not {self.name}")
        config.inference_mode = True
        return config

    def delete_adapter(self, name: str) -> None:
        safe = self._adapter_names.pop(name, None)
        if safe is None:
            return
        with self.lock, warnings.catch_warnings():
            # PEFT warns when the active adapter goes; activate() sets one before each use.
            warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
            self._active = None
            self._peft.delete_adapter(safe)

    def adapter_parameters(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        """The adapter's parameters, sorted by name (a stable order for optimizer state)."""
        marker = f".{self._adapter_names[name]}."
        return sorted((n, p) for n, p in self.module.named_parameters() if marker in n)

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's weights keyed as in PEFT's ``adapter_model.safetensors``."""
        from peft import get_peft_model_state_dict

        # save_embedding_layers=False: LoRA never touches the embeddings, and "auto" would
        # look the base model up on the Hugging Face hub.
        state = get_peft_model_state_dict(self._peft, adapter_name=self._adapter_names[name],
                                          save_embedding_layers=False)
        return {k: v.detach().clone().contiguous() for k, v in state.items()}

    def set_adapter_state(self, name: str, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        with self.lock:
            # peft annotates the return as `namedtuple` (the factory); it is the
            # (missing_keys, unexpected_keys) of torch's Module.load_state_dict.
            result: _IncompatibleKeys = set_peft_model_state_dict(
                self._peft, state, adapter_name=self._adapter_names[name])
        marker = f".{self._adapter_names[name]}."
        missing = [k for k in result.missing_keys if marker in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"adapter weights do not match the adapter's layers (missing "
                             f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})")

    def adapter_config(self, name: str) -> Any:
        return self._peft.peft_config[self._adapter_names[name]]

    @contextlib.contextmanager
    def activate(self, name: str | None) -> Iterator[Any]:
        """Hold the lock with adapter ``name`` (None: no adapter, the plain base) active;
        yields the module to call."""
        if self.bf16_weights and not precision.current().bf16:
            raise RuntimeError(f"{self.name} was loaded with bf16 matmul weights; the dtype "
                               "policy must not change to float32 after a model loads")
        with self.lock:
            if self._peft is None:
                if name is not None:
                    raise KeyError(name)
                yield self.module
                return
            lora = self._peft.base_model
            if name is None:
                lora.disable_adapter_layers()
                try:
                    yield self.module
                finally:
                    lora.enable_adapter_layers()
                return
            safe = self._adapter_names[name]
            if self._active != safe:
                lora.set_adapter(safe)
                self._active = safe
            yield self.module


def _saved_weights(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "adapter_model.safetensors"))


def _layer_fields(config: Any) -> dict[str, Any]:
    """What decides an adapter's layers and how they apply (not its name or provenance)."""
    fields = config.to_dict()
    for name in ("base_model_name_or_path", "revision", "inference_mode", "peft_version",
                 "auto_mapping"):
        fields.pop(name, None)
    if isinstance(fields.get("target_modules"), (set, list, tuple)):
        fields["target_modules"] = sorted(fields["target_modules"])
    return fields


_bases: dict[str, BaseModel] = {}
_load_locks: dict[str, threading.Lock] = {}
_registry_lock = threading.Lock()


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers in order (``model.model.layers`` for the Llama-like
    families, else the ModuleList holding ``num_hidden_layers`` modules); [] if none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    count = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and count and len(module) == count:
            return list(module)
    return []


def load_base(name: str) -> BaseModel:
    """The base model ``name``, loaded once per process (concurrent callers wait for the
    first load). Raises UnknownModelError (listing the names) or ModelUnavailableError."""
    with _registry_lock:
        base = _bases.get(name)
        if base is not None:
            return base
        lock = _load_locks.setdefault(name, threading.Lock())
    with lock:
        with _registry_lock:
            if name in _bases:
                return _bases[name]
        module, info = load_model(name)
        policy = precision.current()
        if policy.device != "cpu":  # the twin shares the weights there
            module = module.to(policy.device)
        base = BaseModel(name, info, module)
        if policy.bf16:  # frozen matmul weights in bf16 once; CPU attention in the CPU's dtype
            base.store_matmul_weights_bf16()
            if policy.device == "cpu":
                attention.use_cpu_attention(module)
        # Where a job may change its thread count mid-way (the twin copies the hooks).
        thread_budget.install(decoder_layers(module))
        base.make_twin()
        with _registry_lock:
            _bases[name] = base
        return base
