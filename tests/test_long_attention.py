"""The attention of training rows under a bf16 policy on CPU (local/engine/attention.py,
issue 40): a float32 forward (bf16 on a CPU with AMX) whose output the bf16 o_proj reads
unchanged, a bf16 backward for long rows and a float32 one for short rows, and a checkpointed
layer's recompute that reuses the forward's attention instead of running the kernel again.
Checked against plain SDPA and against the unchecked trainer, with either forward."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from baseten_loops_cli.local.engine import (  # noqa: E402
    allocator,
    attention,
    derived_saves,
    model_zoo,
    precision,
    registry,
)
from baseten_loops_cli.local.engine import trainer as trainer_module  # noqa: E402
from baseten_loops_cli.local.engine.trainer import LoraTrainer  # noqa: E402
from tests.test_engine import TEXT, sft_datum  # noqa: E402

BF16 = precision.Precision("bfloat16", "cpu", "test")


def _qkv(dtype: torch.dtype, length: int = 96, heads: int = 6, kv_heads: int = 2, batch: int = 1):
    g = torch.Generator().manual_seed(0)
    shapes = [(batch, heads, length, 32), (batch, kv_heads, length, 32), (batch, kv_heads, length, 32)]
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in shapes]


@pytest.mark.parametrize("bf16_forward", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_attention_is_sdpas_forward_and_a_close_backward(dtype, balanced, bf16_forward,
                                                                   monkeypatch) -> None:
    """A long row's op output is SDPA's (causal, grouped kv heads) in the forward's dtype
    rounded to bf16, bit for bit; its gradients are within bf16's rounding of float32
    autograd's, with the kernel's backward called once or as the two balanced calls of long
    rows."""
    monkeypatch.setattr(attention, "BALANCED_BACKWARD_MIN_TOKENS", 64 if balanced else 10**9)
    monkeypatch.setattr(attention, "BF16_BACKWARD_MIN_TOKENS", 64)
    ours_in, ref_in = _qkv(dtype), _qkv(dtype)
    scale = 32 ** -0.5
    out, logsumexp = attention.cpu_attention(*ours_in, None, scale, True, bf16_forward)
    forward = torch.bfloat16 if bf16_forward else torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().to(forward) for t in ref_in), is_causal=True, scale=scale, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and logsumexp.dtype == torch.float32
    assert torch.equal(out, expected.to(torch.bfloat16))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.float() for t in ref_in), is_causal=True, scale=scale, enable_gqa=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad.to(torch.bfloat16))
    ref.backward(grad)
    for ours, theirs in zip(ours_in, ref_in):
        assert ours.grad.dtype == dtype
        error = (ours.grad.float() - theirs.grad.float()).norm() / theirs.grad.float().norm()
        assert 0 < error < 0.02, error  # bf16 arithmetic, not float32's, and not far from it


@pytest.mark.parametrize("bf16_forward", [False, True])
def test_short_packed_rows_attention_has_a_float32_backward(bf16_forward) -> None:
    """A short row (under BF16_BACKWARD_MIN_TOKENS) under a packing mask: the op's forward is
    SDPA's in its dtype, bit for bit; the backward runs in float32, so with a float32 forward
    the gradients are torch's SDPA autograd's to float32 rounding, and with a bf16 one within
    the bf16 forward's rounding."""
    query, key, value = _qkv(torch.float32, length=40)
    ref_in = [t.detach().clone().requires_grad_(True) for t in (query, key, value)]
    segment = torch.tensor([0] * 15 + [1] * 20 + [2] * 5)
    mask = ((segment[:, None] == segment[None, :]) & torch.ones(40, 40, dtype=torch.bool).tril())[None, None]
    scale = 32 ** -0.5
    out, _ = attention.cpu_attention(query, key, value, mask, scale, False, bf16_forward)
    forward = torch.bfloat16 if bf16_forward else torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().to(forward) for t in ref_in), attn_mask=mask, scale=scale, enable_gqa=True)
    assert out.dtype == forward and torch.equal(out, expected)
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=mask, scale=scale,
                                                           enable_gqa=True)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    bound = 0.02 if bf16_forward else 1e-6
    for ours, theirs in zip((query, key, value), ref_in):
        error = (ours.grad - theirs.grad).norm() / theirs.grad.norm()
        assert error < bound, error
        assert float(theirs.grad.abs().max()) > 1e-3


def test_the_attention_forward_is_bf16_only_where_the_cpu_has_amx() -> None:
    assert attention.cpu_forward_dtype(["amx_bf16", "avx512_bf16"]) == torch.bfloat16
    assert attention.cpu_forward_dtype(["avx512_bf16"]) == torch.float32
    assert attention.cpu_forward_dtype([]) == torch.float32


@pytest.mark.parametrize(("length", "batch"), [(96, 1), (101, 1), (4, 1), (50, 2)])
def test_balanced_backward_is_the_kernels_backward(length, batch) -> None:
    """The two balanced kernel calls (squares and a rectangle of the causal triangle, the row
    padded to a multiple of 4) give the one call's gradients, in float32 to 1e-5: an exact
    rearrangement, not an approximation."""
    query, key, value = (t.detach() for t in _qkv(torch.float32, length=length, kv_heads=6, batch=batch))
    scale = 32 ** -0.5
    out, logsumexp = attention._FLASH(query, key, value, 0.0, True, scale=scale)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    whole = attention._FLASH_BACKWARD(grad, query, key, value, out, logsumexp, 0.0, True, scale=scale)
    balanced = attention._balanced_backward(grad, query, key, value, out, logsumexp, scale)
    for ours, theirs in zip(balanced, whole):
        assert ours.shape == theirs.shape
        assert float((ours - theirs).abs().max()) < 1e-5 * max(1.0, float(theirs.abs().max()))
        assert float(theirs.abs().max()) > 1e-3


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32-forward", "bf16-forward"])
def bf16_base(request) -> registry.BaseModel:
    module, info = model_zoo.load_model(model_zoo.TINY)
    base = registry.BaseModel(model_zoo.TINY, info, module)
    base.store_matmul_weights_bf16()
    attention.use_cpu_attention(module, request.param)
    return base


def test_checkpointed_long_rows_reuse_the_forwards_attention(bf16_base, monkeypatch) -> None:
    """A long row (here: past a lowered BF16_BACKWARD_MIN_TOKENS) runs cpu_attention with a bf16
    backward; with every layer checkpointed, the backward's recompute takes the attention outputs its forward
    kept (the kernel runs once a layer, not twice), and logprobs, loss and gradients equal the
    unchecked trainer's to 1e-5. The checkpointed step keeps the layers' outputs and the
    attention's outputs in mappings of their own (allocator.long_step; here from any size)."""
    monkeypatch.setattr(attention, "BF16_BACKWARD_MIN_TOKENS", 64)
    assert allocator.configure_allocator()  # what the server does when the engine loads
    monkeypatch.setattr(allocator, "KEPT_MAPPED_MIN_BYTES", 0)
    monkeypatch.setattr(allocator, "_threshold", 0)  # a long step from any row length
    mapped = []
    real_copies = allocator.mapped_copies

    def copies(*tensors):
        kept = real_copies(*tensors)
        mapped.append([k is not t for k, t in zip(kept, tensors)])
        return kept

    monkeypatch.setattr(allocator, "mapped_copies", copies)
    kernel_calls = []
    real = attention._FLASH
    monkeypatch.setattr(attention, "_FLASH",
                        lambda *a, **k: kernel_calls.append(a[0].shape[2]) or real(*a, **k))
    datum = sft_datum((TEXT * 4)[:150], [0.0] * 60 + [1.0] * 89)
    layers = bf16_base.module.config.num_hidden_layers
    outputs, grads = {}, {}
    for mode in ("off", "on"):
        trainer = LoraTrainer(bf16_base, f"long-{mode}", 4, seed=5)
        try:
            monkeypatch.setattr(trainer_module, "_checkpointing", mode)
            kernel_calls.clear()
            with precision.using(BF16):
                outputs[mode] = trainer.forward_backward([datum])
            assert kernel_calls == [149] * layers, (mode, kernel_calls)
            # on: each layer's output, and its attention's output and logsumexp, mapped
            assert mapped == ([[True, True], [True]] * layers if mode == "on" else
                              [[False, False]] * layers), (mode, mapped)
            mapped.clear()
            grads[mode] = [p.grad.clone() for p in trainer._params]
        finally:
            trainer.release()
    on, off = outputs["on"], outputs["off"]
    assert on["metrics"]["recomputed_layers"] == layers
    assert on["metrics"]["loss:sum"] == pytest.approx(off["metrics"]["loss:sum"], abs=1e-5)
    on_lps = on["loss_fn_outputs"][0]["logprobs"]["data"]
    off_lps = off["loss_fn_outputs"][0]["logprobs"]["data"]
    assert on_lps == pytest.approx(off_lps, abs=1e-5)
    assert max(float((a - b).abs().max()) for a, b in zip(grads["on"], grads["off"])) < 1e-5
    assert max(float(g.abs().max()) for g in grads["off"]) > 1e-4  # the gradients are not 0


def test_short_rows_run_the_float32_backward(bf16_base, monkeypatch) -> None:
    """Below BF16_BACKWARD_MIN_TOKENS a training row's attention backward runs in float32 (the
    kernel's bf16 backward is slower there: 8 rows of 64 SmolLM2 tokens, 1.9 -> 7.5 ms a layer
    on the AMX Xeon), whatever the forward's dtype; a long row's in bf16."""
    dtypes = []
    real = attention._FLASH_BACKWARD
    monkeypatch.setattr(attention, "_FLASH_BACKWARD",
                        lambda *a, **k: dtypes.append(a[1].dtype) or real(*a, **k))
    trainer = LoraTrainer(bf16_base, "short", 4, seed=5)
    layers = bf16_base.module.config.num_hidden_layers
    try:
        with precision.using(BF16):
            out = trainer.forward_backward([sft_datum(TEXT[:40]), sft_datum(TEXT[5:30])])
            assert dtypes == [torch.float32] * layers  # the two rows packed in one
            dtypes.clear()
            monkeypatch.setattr(attention, "BF16_BACKWARD_MIN_TOKENS", 32)
            trainer.forward_backward([sft_datum(TEXT[:40])])
            assert dtypes == [torch.bfloat16] * layers
    finally:
        trainer.release()
    assert out["metrics"]["loss:sum"] > 0


def _packing_counted(monkeypatch, packed: list) -> None:
    real = derived_saves._pack

    def pack(x):
        kept = real(x)
        if isinstance(kept, torch.Tensor):
            return kept
        packed.append(x.untyped_storage().nbytes())
        return kept

    monkeypatch.setattr(derived_saves, "_pack", pack)


@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_derived_saves_rebuild_bit_identical_gradients(bf16_base, monkeypatch, checkpointing) -> None:
    """The backward keeps the MLP's act(g) and act(g) * u and o_proj's copy of the attention
    output as recipes over tensors it keeps anyway (derived_saves), three a layer, and the
    gradients, logprobs and loss equal the step that keeps the tensors themselves, bit for bit.
    Inside checkpointed layers nothing is packed (their graphs keep nothing)."""
    monkeypatch.setattr(attention, "BF16_BACKWARD_MIN_TOKENS", 64)  # the long-row attention
    monkeypatch.setattr(trainer_module, "_checkpointing", checkpointing)
    datum = sft_datum((TEXT * 4)[:150], [0.0] * 60 + [1.0] * 89)
    layers = bf16_base.module.config.num_hidden_layers
    packed: list[int] = []
    _packing_counted(monkeypatch, packed)
    results = {}
    for derived in (True, False):
        if not derived:
            monkeypatch.setattr(derived_saves, "packing", contextlib.nullcontext)
        trainer = LoraTrainer(bf16_base, f"derived-{derived}-{checkpointing}", 4, seed=5)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # LoRA B nonzero, so LoRA A's gradients read their inputs
            for p in trainer._params:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        try:
            with precision.using(BF16):
                output = trainer.forward_backward([datum])
            results[derived] = (output, [p.grad.clone() for p in trainer._params])
        finally:
            trainer.release()
    hidden, inner = bf16_base.module.config.hidden_size, bf16_base.module.config.intermediate_size
    if checkpointing == "off":  # a, h (bf16, 149 x intermediate) and the copy (149 x hidden)
        assert sorted(packed) == sorted([149 * inner * 2] * 2 * layers + [149 * hidden * 2] * layers)
    else:
        assert packed == []
    (ours, our_grads), (theirs, their_grads) = results[True], results[False]
    assert ours["metrics"]["loss:sum"] == theirs["metrics"]["loss:sum"]
    assert (ours["loss_fn_outputs"][0]["logprobs"]["data"]
            == theirs["loss_fn_outputs"][0]["logprobs"]["data"])
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads))
    assert max(float(g.abs().max()) for g in their_grads) > 1e-4  # the gradients are not 0
