"""How much memory a LoRA training step on one row holds: the local trainer's activation budget
(local/engine/trainer.py) and the plan's peak estimate (training/plan.py, ``train validate``),
from a model's transformers config alone (no torch: the plan imports this).

A backward pass keeps every decoder layer's activations until it runs. Measured per token, per
layer and per unit of ``hidden_size + intermediate_size`` (torch.autograd.graph
.saved_tensors_hooks over one forward_backward, frozen weights left out): SmolLM2 866 KB a token
in bf16 (13.7; 1069 before precision.share_input_casts and grouped kv heads in float32
attention), 1420 in float32 (22.4); the tiny model 16 in bf16. Since the MLP's activation and
product and the attention output's copy are rebuilt in the backward (local/engine/
derived_saves.py), 0.69x that: 9.7 in bf16, 15.6 in float32 (the saved tensors of a 2,000-token
SmolLM2 row, 23.5 -> 16.1 KB a token a layer in bf16, 40.0 -> 27.7 in float32). Past
:data:`ACTIVATION_BUDGET_BYTES`, the trainer recomputes the first k decoder layers in the
backward (:func:`checkpoint_layer_count`), which then keep only their float32 input and their
attention's output (:func:`recomputed_layer_bytes_per_token`).
"""

from __future__ import annotations

from typing import Any

ACTIVATION_BYTES_PER_WIDTH = {"bfloat16": 9.7, "float32": 15.6}
# Activation checkpointing (issue 40; trainer.checkpointed_layers). Without it an 8k-token
# SmolLM2 row held ~7 GB of activations and the server peaked at 10.95 GiB. Past this budget
# the first k decoder layers keep only their input and attention output and run the rest of
# their forward again in the backward, the fewest k that keeps the estimate under the budget.
# The peak is then about the runtime and weights plus the budget. 1 GiB: an 8k SmolLM2 row
# recomputes every layer either way (its kept inputs alone are 0.8 GiB), and 1k rows recompute
# none; a 2k row recomputes 6 layers (15 before derived_saves; 24 with 512 MiB: in-process,
# bf16, 2k SFT 192 -> 200 tokens/s; 223 with none, at 3.1 GiB).
ACTIVATION_BUDGET_BYTES = 1024 * 2**20
# The server's activation_checkpointing option: "auto" (past the budget), "on" (every decoder
# layer of every backward), "off" (never).
CHECKPOINTING_MODES = ("auto", "on", "off")
# Besides weights and activations, a local server process holds the interpreter, torch and its
# allocator's slack: measured with SmolLM2 loaded in bf16, ~0.9 GiB over its weight bytes.
RUNTIME_BYTES = 900 * 2**20
# The trainer's LM head runs over 160 rows at a time (trainer.HEAD_CHUNK_ROWS): their float32
# logits, a bf16 copy of their softmax and of the head's weight for the gradient's product.
HEAD_CHUNK_ROWS = 160


def _int(config: Any, name: str) -> int:
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return int(value or 0)


def activation_bytes_per_token(config: Any, dtype: str) -> int:
    """The activation bytes a backward pass keeps per token of a model with ``config`` (a
    transformers config or its config.json as a dict) computing in ``dtype``."""
    width = _int(config, "hidden_size") + _int(config, "intermediate_size")
    per_width = ACTIVATION_BYTES_PER_WIDTH.get(dtype, ACTIVATION_BYTES_PER_WIDTH["float32"])
    return max(1, int(_int(config, "num_hidden_layers") * width * per_width))


def recomputed_layer_bytes_per_token(config: Any) -> int:
    """What a recomputed decoder layer keeps per token: its float32 input, its attention's
    bf16 output and the softmax's float32 logsumexp a head (attention.keep_attention_outputs)."""
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads") or 1
    head_dim = _int(config, "head_dim") or hidden // heads
    return hidden * 4 + heads * head_dim * 2 + heads * 4


def checkpoint_layer_count(config: Any, dtype: str, tokens: int, mode: str = "auto") -> int:
    """How many decoder layers a backward over ``tokens`` tokens recomputes: with ``mode``
    "auto", 0 while the estimate fits :data:`ACTIVATION_BUDGET_BYTES`, else the fewest that
    make it fit (all of them if none do); "on": all; "off": none."""
    layers = _int(config, "num_hidden_layers")
    if mode != "auto" or layers == 0:
        return layers if mode == "on" else 0
    per_layer = tokens * activation_bytes_per_token(config, dtype) // layers
    kept_input = tokens * recomputed_layer_bytes_per_token(config)
    if layers * per_layer <= ACTIVATION_BUDGET_BYTES:
        return 0
    # k recomputed layers hold k inputs plus, while one runs again, that layer's activations.
    for k in range(1, layers + 1):
        if (layers - k) * per_layer + k * kept_input + per_layer <= ACTIVATION_BUDGET_BYTES:
            return k
    return layers


def parameter_count(config: Any) -> int:
    """A Llama-like model's parameters from its config (embedding and LM head counted once
    each unless tied; norms left out)."""
    hidden, layers = _int(config, "hidden_size"), _int(config, "num_hidden_layers")
    heads = _int(config, "num_attention_heads") or 1
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim") or hidden // heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * _int(config, "intermediate_size")
    vocab = _int(config, "vocab_size")
    tied = (config.get("tie_word_embeddings", True) if isinstance(config, dict)
            else getattr(config, "tie_word_embeddings", True))
    return layers * (attention + mlp) + vocab * hidden * (1 if tied else 2)


def training_peak_bytes(config: Any, tokens: int, dtype: str = "float32",
                        mode: str = "auto") -> int:
    """A local server's peak while it trains one ``tokens``-token row (LoRA, the base in
    ``dtype``): the base weights (float32; bf16 matmul weights take ~0.71x), the activations
    kept with :func:`checkpoint_layer_count`'s recompute, the LM head's chunk and the runtime.
    An estimate (SmolLM2 bf16, measured against it in docs/long-sequences.md)."""
    layers = max(1, _int(config, "num_hidden_layers"))
    hidden, vocab = _int(config, "hidden_size"), _int(config, "vocab_size")
    weights = parameter_count(config) * 4
    if dtype == "bfloat16":
        weights = int(weights * 0.71)
    per_layer = tokens * activation_bytes_per_token(config, dtype) // layers
    recomputed = checkpoint_layer_count(config, dtype, tokens, mode)
    activations = ((layers - recomputed) * per_layer
                   + recomputed * tokens * recomputed_layer_bytes_per_token(config)
                   + (per_layer if recomputed else 0))
    head = HEAD_CHUNK_ROWS * vocab * (4 + 2) + vocab * hidden * 2 + tokens * hidden * 4 * 2
    return RUNTIME_BYTES + weights + activations + head
