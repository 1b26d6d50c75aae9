"""The attention a bf16 base runs on CPU (transformers' AttentionInterface names
:data:`FLOAT32_ATTENTION` and :data:`BF16_ATTENTION`), and what a recomputed decoder layer keeps
of it.

- The forward runs in the dtype this CPU's flash kernel is fastest in (:func:`cpu_forward_dtype`,
  chosen when the base loads; q, k, v cast to it, autocast off): bf16 on a CPU with AMX, whose
  tiles multiply bf16 (a SmolLM2 layer, 9 heads of 64, float32 -> bf16: 34.5 -> 11.7 ms at 2k,
  400 -> 132 ms at 8k on the 2-core Xeon), float32 elsewhere (the 2-core AVX512-BF16 EPYC:
  44 -> 41 ms at 2k but 551 -> 649 ms at 8k). Every path of a base (training, scoring, the
  sampler's prefill and decode) runs the same forward, so sampler and trainer logprobs agree
  as closely in either (precision.BF16_LOGPROB_TOLERANCE).
- A training row's attention is the :func:`cpu_attention` op, whose backward runs in the dtype
  faster at the row's length: bf16 from :data:`BF16_BACKWARD_MIN_TOKENS` (one SmolLM2 layer on
  the EPYC: 39 -> 29 ms at 1k, 142 -> 96 ms at 2k, 475 -> 343 ms at 4k, 1.80 -> 1.47 s at 8k),
  float32 below (8 rows of 64: 2.5 -> 5.3 ms in bf16 on the EPYC, 1.9 -> 7.5 ms on the Xeon).
  A long row's op keeps q, k, v and its output in bf16 (half the bytes) and returns the output
  in bf16: the bf16 o_proj that reads it rounds it so, so every loss and logprob is unchanged.
  The gradients' relative error against float32 autograd is 0.5-0.8% in bf16, what every bf16
  matmul of the backward already has.
- Grouped key/value heads: the backward keeps k and v at their own head count; the kernels get
  them repeated to the query's heads (:func:`_heads_of`, faster); torch's SDPA, where the op
  is not used (no gradient), takes them grouped (``enable_gqa``; transformers repeats them):
  identical outputs.
- Under activation checkpointing the layer's recompute takes the attention output the
  forward saved (:func:`keep_attention_outputs`, torch's selective checkpointing) instead of
  running the kernel again: attention is most of a long row's FLOPs (an 8k SmolLM2 row: the
  float32 forward kernel 0.55 s of a layer's ~0.75 s on the EPYC), and its output is one bf16
  hidden_size vector a token.
"""

from __future__ import annotations

from typing import Any

import torch

from baseten_loops_cli.local.engine import allocator, derived_saves

FLOAT32_ATTENTION = "loops_sdpa_float32"
BF16_ATTENTION = "loops_sdpa_bf16"
# Query length from which a training row's attention runs its backward in bf16 (above).
BF16_BACKWARD_MIN_TOKENS = 1024

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# Query length from which the bf16 backward runs as two balanced kernel calls
# (:func:`_balanced_backward`).
BALANCED_BACKWARD_MIN_TOKENS = 6144


def _heads_of(query: torch.Tensor, key_or_value: torch.Tensor) -> torch.Tensor:
    """Grouped key/value heads repeated to the query's head count. The kernel takes grouped
    heads as they are, but then runs slower: one SmolLM2 layer at 8k (9 query heads, 3 key/value
    heads), forward 0.58 -> 0.54 s and bf16 backward 1.28 -> 1.09 s with them repeated (4k:
    backward 0.37 -> 0.30 s; 1k: 29 -> 28 ms)."""
    repeats = query.shape[1] // key_or_value.shape[1]
    return key_or_value if repeats == 1 else key_or_value.repeat_interleave(repeats, 1)


def _grouped(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient over repeated key/value heads summed back to ``heads`` grouped ones."""
    if grad.shape[1] == heads:
        return grad
    return grad.unflatten(1, (heads, grad.shape[1] // heads)).sum(2, dtype=torch.float32)


@torch.library.custom_op("loops::cpu_attention", mutates_args=())
def cpu_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: torch.Tensor | None, scale: float, causal: bool,
                  bf16_forward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention of a training row (causal, or under ``mask``: transformers' boolean
    one, True where a query attends), its forward in bf16 or float32 (``bf16_forward``,
    :func:`cpu_forward_dtype`); the output and the softmax's logsumexp (float32). The output of
    a long row (:data:`BF16_BACKWARD_MIN_TOKENS`) is bf16, which the bf16 o_proj rounds it to
    anyway; a short row's is the forward's dtype. An op of its own, so its backward can run in
    the dtype that is faster at the row's length, and a checkpointed layer's recompute can take
    both outputs from its forward (:func:`keep_attention_outputs`)."""
    dtype = torch.bfloat16 if bf16_forward else torch.float32
    query = query.to(dtype)
    out, logsumexp = _FLASH(query, _heads_of(query, key.to(dtype)), _heads_of(query, value.to(dtype)),
                            0.0, causal, attn_mask=_additive(mask, dtype), scale=scale)
    if query.shape[2] >= BF16_BACKWARD_MIN_TOKENS:
        return allocator.mapped_copies(out.to(torch.bfloat16), logsumexp.float())
    return out, logsumexp.float()


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask as the kernels take it, in their dtype: a boolean one as 0 where a query attends
    and -inf elsewhere (what torch's SDPA makes of one), a float one cast."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


def _backward_dtype(length: int) -> torch.dtype:
    return torch.bfloat16 if length >= BF16_BACKWARD_MIN_TOKENS else torch.float32


def _keep_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    query, key, value, mask, scale, causal, _bf16_forward = inputs
    ctx.scale, ctx.causal = scale, causal
    ctx.dtypes = (query.dtype, key.dtype, value.dtype)
    backward = _backward_dtype(query.shape[2])
    ctx.save_for_backward(*(t.to(backward) for t in (query, key, value)), mask, *output)


def _cpu_attention_backward(ctx: Any, grad: torch.Tensor, _grad_logsumexp: Any) -> Any:
    query, key, value, mask, out, logsumexp = ctx.saved_tensors
    kv_heads = key.shape[1]
    dtype = _backward_dtype(query.shape[2])
    tensors = (grad.to(dtype), query, _heads_of(query, key), _heads_of(query, value),
               out.to(dtype), logsumexp)
    if ctx.causal and mask is None and query.shape[2] >= BALANCED_BACKWARD_MIN_TOKENS:
        grads = _balanced_backward(*tensors, ctx.scale)
    else:
        grads = _FLASH_BACKWARD(*tensors, 0.0, ctx.causal, attn_mask=_additive(mask, dtype),
                                scale=ctx.scale)
    grads = (grads[0], _grouped(grads[1], kv_heads), _grouped(grads[2], kv_heads))
    return (*(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None, None, None, None)


def _balanced_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal backward as two kernel calls that keep every thread busy.

    The kernel's backward gives each thread whole (batch, head) pairs: SmolLM2's 9 heads on
    2 threads run as 5 then 4, one thread idle a ninth of the time. Given the forward's output
    and logsumexp, the backward is a sum over key blocks, so with queries and keys cut in
    halves, (Q1, K1) and (Q2, K2) are two causal squares (one call, stacked as a batch of 2)
    and (Q2, K1) a full rectangle (a second call, its queries cut in two and stacked): twice
    the (batch, head) pairs, the same work each. An 8k SmolLM2 layer: 1.09 -> 1.02 s; at 4k
    and below the copies cost what the balance gains. A length not a multiple of 4 is padded
    at the end with zero rows: no real query attends them (causal), and a zero output
    gradient gives them no gradient to pass on."""
    length = query.shape[2]
    pad = -length % 4
    if pad:
        grad, query, key, value, out = (torch.nn.functional.pad(t, (0, 0, 0, pad))
                                        for t in (grad, query, key, value, out))
        logsumexp = torch.nn.functional.pad(logsumexp, (0, pad))
    half = query.shape[2] // 2
    quarter = half // 2
    batch = query.shape[0]  # the stacked calls' first `batch` rows are the first half's

    def squares(t: torch.Tensor) -> torch.Tensor:  # (Q1|K1, Q2|K2) as a batch of 2
        return torch.cat([t[:, :, :half], t[:, :, half:]])

    def rectangle_rows(t: torch.Tensor) -> torch.Tensor:  # Q2's two quarters as a batch of 2
        return torch.cat([t[:, :, half:half + quarter], t[:, :, half + quarter:]])

    def rectangle_keys(t: torch.Tensor) -> torch.Tensor:  # K1, for each of them
        return torch.cat([t[:, :, :half]] * 2)

    dq_sq, dk_sq, dv_sq = _FLASH_BACKWARD(*(squares(t) for t in (grad, query, key, value, out, logsumexp)),
                                          0.0, True, scale=scale)
    dq_re, dk_re, dv_re = _FLASH_BACKWARD(
        rectangle_rows(grad), rectangle_rows(query), rectangle_keys(key), rectangle_keys(value),
        rectangle_rows(out), rectangle_rows(logsumexp), 0.0, False, scale=scale)
    dq = torch.cat([dq_sq[:batch].float(),
                    dq_sq[batch:] + torch.cat([dq_re[:batch], dq_re[batch:]], 2).float()], 2)

    def keys_grad(square: torch.Tensor, rectangle: torch.Tensor) -> torch.Tensor:
        first = square[:batch].float() + rectangle[:batch].float() + rectangle[batch:].float()
        return torch.cat([first, square[batch:].float()], 2)

    return (dq[:, :, :length], keys_grad(dk_sq, dk_re)[:, :, :length],
            keys_grad(dv_sq, dv_re)[:, :, :length])


cpu_attention.register_autograd(_cpu_attention_backward, setup_context=_keep_for_backward)


def _transposed(output: torch.Tensor) -> torch.Tensor:
    return output.transpose(1, 2).contiguous()


def cpu_forward_dtype(flags: list[str] | None = None) -> torch.dtype:
    """The dtype a bf16 base's attention forward runs in on this CPU: bf16 where the CPU has
    AMX (``amx_bf16``), float32 elsewhere. Measured per layer of SmolLM2 (9 heads of 64),
    the kernel's causal forward float32 -> bf16: on a 2-core Xeon with AMX 34.5 -> 11.7 ms at
    2k and 400 -> 132 ms at 8k (AMX multiplies bf16 tiles; its float32 runs on AVX-512); on
    the 2-core AVX512-BF16 EPYC 44 -> 41 ms at 2k and 551 -> 649 ms at 8k."""
    from baseten_loops_cli.local.engine import precision

    chosen = precision.cpu_bf16_flags() if flags is None else flags
    return torch.bfloat16 if "amx_bf16" in chosen else torch.float32


def use_cpu_attention(module: Any, forward_dtype: torch.dtype | None = None) -> None:
    """Run ``module``'s SDPA attention with its forward in ``forward_dtype`` (default
    :func:`cpu_forward_dtype`) while autocast is on (see the module docstring); unchanged
    without autocast. For models using ``sdpa`` (others are left)."""
    if getattr(module.config, "_attn_implementation", None) not in ("sdpa", FLOAT32_ATTENTION,
                                                                     BF16_ATTENTION):
        return
    _register()
    dtype = cpu_forward_dtype() if forward_dtype is None else forward_dtype
    module.set_attn_implementation(BF16_ATTENTION if dtype == torch.bfloat16 else FLOAT32_ATTENTION)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def sdpa_in(dtype: torch.dtype) -> Any:
        bf16_forward = dtype == torch.bfloat16

        def cpu_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
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
                    return sdpa_attention_forward(module, query.to(dtype), key.to(dtype),
                                                  value.to(dtype), attention_mask, **options)
            with torch.autocast(device, enabled=False):
                if not dropout and device == "cpu" and torch.is_grad_enabled() and (
                        causal or attention_mask is not None):
                    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
                    mask = None if causal else attention_mask
                    output, _ = cpu_attention(query, key, value, mask, scale, causal, bf16_forward)
                else:
                    output = torch.nn.functional.scaled_dot_product_attention(
                        query.to(dtype), key.to(dtype), value.to(dtype),
                        attn_mask=_additive(attention_mask, dtype), dropout_p=dropout,
                        scale=scaling, is_causal=bool(causal),
                        enable_gqa=query.shape[1] != key.shape[1])
            # o_proj's LoRA A keeps this copy for its backward; the kernel keeps ``output``.
            return derived_saves.derive(output.transpose(1, 2).contiguous(), _transposed, output), None

        return cpu_sdpa

    for name, dtype in ((FLOAT32_ATTENTION, torch.float32), (BF16_ATTENTION, torch.bfloat16)):
        AttentionInterface.register(name, sdpa_in(dtype))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def keep_attention_outputs() -> Any:
    """A ``context_fn`` for ``torch.utils.checkpoint``: the recompute of a checkpointed layer
    reuses the flash kernels' outputs its forward saved (see the module docstring)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    saved = {aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.loops.cpu_attention.default}
    flash_cuda = getattr(aten, "_scaled_dot_product_flash_attention", None)
    if flash_cuda is not None:
        saved.add(flash_cuda.default)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return (CheckpointPolicy.MUST_SAVE if op in saved
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return partial(create_selective_checkpoint_contexts, policy)
