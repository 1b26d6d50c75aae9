"""The attention a bf16 base runs on CPU (transformers' AttentionInterface name
:data:`FLOAT32_ATTENTION`), and what a recomputed decoder layer keeps of it.

- The forward is SDPA in float32 (q, k, v cast up, autocast off): torch's CPU flash kernel's
  forward is hardly faster in bf16 (one SmolLM2 layer: 41 against 44 ms at 2k) and slower at
  length (649 against 551 ms at 8k), and float32 keeps logprobs as exact as the rest of the
  bf16 policy allows (precision.py).
- Grouped key/value heads go to the kernel as they are (``enable_gqa``; transformers repeats
  them): identical outputs, and the backward keeps k and v at their own head count.
- A datum of :data:`BF16_BACKWARD_MIN_TOKENS` or more that trains runs
  :func:`causal_attention`, whose backward is bf16: the kernel's backward is faster in bf16
  from ~512 tokens (one SmolLM2 layer, 9 heads of 64: 39 -> 29 ms at 1k, 142 -> 96 ms at 2k,
  475 -> 343 ms at 4k, 1.80 -> 1.47 s at 8k; slower below: 2.5 -> 5.3 ms for 8 rows of 64),
  and the tensors the backward keeps (q, k, v, the output) are half the bytes. The gradients' relative error
  against the float32 backward is 0.5-0.8%, what every bf16 matmul of the backward already
  has. The forward stays float32, and its output is returned in bf16: the bf16 o_proj that
  reads it rounds it so, so every loss and logprob is unchanged.
- Under activation checkpointing the layer's recompute takes the attention output the
  forward saved (:func:`keep_attention_outputs`, torch's selective checkpointing) instead of
  running the kernel again: attention is most of a long row's FLOPs (an 8k SmolLM2 row: the
  forward kernel 0.55 s of a layer's ~0.75 s), and its output is one bf16 hidden_size vector
  a token.
"""

from __future__ import annotations

from typing import Any

import torch

FLOAT32_ATTENTION = "loops_sdpa_float32"
# Query length from which a grad-requiring attention runs its backward in bf16 (above).
BF16_BACKWARD_MIN_TOKENS = 1024

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@torch.library.custom_op("loops::causal_attention", mutates_args=())
def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal, unmasked CPU flash attention in float32; the output in bf16 (the bf16 o_proj
    rounds it so anyway) and the softmax's logsumexp. An op of its own, so a checkpointed
    layer's recompute can take both from its forward (:func:`keep_attention_outputs`)."""
    out, logsumexp = _FLASH(query.float(), key.float(), value.float(), 0.0, True, scale=scale)
    return out.to(torch.bfloat16), logsumexp


def _keep_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    query, key, value, scale = inputs
    ctx.scale = scale
    ctx.dtypes = (query.dtype, key.dtype, value.dtype)
    ctx.save_for_backward(*(t.to(torch.bfloat16) for t in (query, key, value)), *output)


def _causal_attention_backward(ctx: Any, grad: torch.Tensor, _grad_logsumexp: Any) -> Any:
    query, key, value, out, logsumexp = ctx.saved_tensors
    grads = _FLASH_BACKWARD(grad.to(torch.bfloat16), query, key, value, out, logsumexp,
                            0.0, True, scale=ctx.scale)
    return (*(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None)


causal_attention.register_autograd(_causal_attention_backward, setup_context=_keep_for_backward)


def use_float32_attention(module: Any) -> None:
    """Run ``module``'s SDPA attention in float32 while autocast is on (see the module
    docstring); unchanged without autocast. For models using ``sdpa`` (others are left)."""
    if getattr(module.config, "_attn_implementation", None) != "sdpa":
        return
    _register()
    module.set_attn_implementation(FLOAT32_ATTENTION)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def float32_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                     dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> Any:
        device = query.device.type
        options = dict(dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        if not torch.is_autocast_enabled(device):
            return sdpa_attention_forward(module, query, key, value, attention_mask, **options)
        q_length = query.shape[2]
        causal = q_length > 1 and attention_mask is None and (
            is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if (kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
                or (causal and key.shape[2] != q_length)):  # cases transformers adapts
            with torch.autocast(device, enabled=False):
                return sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              attention_mask, **options)
        with torch.autocast(device, enabled=False):
            if (causal and not dropout and device == "cpu" and torch.is_grad_enabled()
                    and q_length >= BF16_BACKWARD_MIN_TOKENS):
                scale = scaling if scaling is not None else query.shape[-1] ** -0.5
                output, _ = causal_attention(query, key, value, scale)
            else:
                output = torch.nn.functional.scaled_dot_product_attention(
                    query.float(), key.float(), value.float(), attn_mask=attention_mask,
                    dropout_p=dropout, scale=scaling, is_causal=bool(causal),
                    enable_gqa=query.shape[1] != key.shape[1])
        return output.transpose(1, 2).contiguous(), None

    AttentionInterface.register(FLOAT32_ATTENTION, float32_sdpa)
    AttentionMaskInterface.register(FLOAT32_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def keep_attention_outputs() -> Any:
    """A ``context_fn`` for ``torch.utils.checkpoint``: the recompute of a checkpointed layer
    reuses the flash kernels' outputs its forward saved (see the module docstring)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    saved = {aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.loops.causal_attention.default}
    flash_cuda = getattr(aten, "_scaled_dot_product_flash_attention", None)
    if flash_cuda is not None:
        saved.add(flash_cuda.default)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return (CheckpointPolicy.MUST_SAVE if op in saved
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return partial(create_selective_checkpoint_contexts, policy)
