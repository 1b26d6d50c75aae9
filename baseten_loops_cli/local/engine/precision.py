"""The engine's dtype and device policy, chosen in one place (``loops server start --dtype
auto|float32|bfloat16 --device auto|cpu|cuda``).

- With ``bfloat16`` the trainer's and the sampler's forward passes run under
  ``torch.autocast(bfloat16)`` (matmuls in bf16, reductions and softmax as autocast keeps
  them), so LoRA master weights, gradients and AdamW state stay float32, and logits are cast
  to float32 before log-softmax and every loss.
- A base loaded under a bf16 policy keeps its frozen matmul weights (every ``nn.Linear``, the
  LM head) in bf16 (:func:`store_matmul_weights_bf16`): autocast casts a frozen weight again
  at every use (it caches casts of trainable leaves only), which on SmolLM2 was 0.98 s of
  ``aten::copy_`` in a 2.2 s step and made bf16 barely faster than float32; stored once, the
  values autocast multiplies are the same (one fp32 -> bf16 rounding), so results are
  identical. Embeddings, norms and biases stay float32 (the residual stream as autocast
  leaves it). Memory: the Linear weights halve. The LM head is the exception: it keeps
  float32 weights and computes in float32 (:func:`float32_linear_class`), so every logprob
  (sampling, echo, ``/forward``, RL) comes from float32 logits; a tied head shares the
  embedding's float32 weight.
- On CPU, such a base computes attention's forward in the dtype its CPU's flash kernel is
  fastest in (attention.use_cpu_attention: q, k, v cast to it, autocast off around SDPA):
  float32 on the AVX512-BF16 EPYC, where the kernel is slower in bf16 (SmolLM2 SFT step: its
  backward 174 ms in bf16 against 45 ms in float32; the step 12% faster with attention in
  float32), bf16 on a CPU with AMX (attention.cpu_forward_dtype: 3x faster at 2k-8k tokens).
  float32 is no less exact: SmolLM2 logprobs on 8 SFT rows against float32, max |error| 0.16
  against 0.24 with bf16 attention, mean 0.037 against 0.034. Plain PEFT compared with such a
  base runs the same attention (scripts/gpu_check.sh).
  Short rows' SDPA takes grouped key/value heads (``enable_gqa``) where transformers would
  repeat them: identical outputs, 92 KB less per trained SmolLM2 token. A training row's
  backward runs in float32, from 1k tokens in bf16 (attention.py: faster there, and half the
  kept bytes).
- The Linear layers inside a bf16 base's LoRA layers share one bf16 copy of each input
  (:func:`share_input_casts`): autocast made one per layer, and autograd kept the LoRA A
  ones (SmolLM2: 213 KB per trained token). Bit-identical results.
- ``auto`` picks ``bfloat16`` only where the hardware computes it natively: a CPU with AMX
  or AVX512-BF16 (``amx_bf16`` / ``avx512_bf16`` in /proc/cpuinfo) or a CUDA device with bf16
  support; ``float32`` elsewhere. ``bfloat16`` asked for explicitly runs anywhere torch runs
  it (emulated on older CPUs: correct, slow). ``--device auto`` is CUDA when torch sees one.
- ``auto`` is the server's default: on the 2-core AVX512-BF16 EPYC (no AMX), side by side in
  one process under load, a SmolLM2 LoRA SFT step took 1.12 s in bf16 against 2.16 s in
  float32, a forward-only pass 0.62 against 1.30 s, sampling 8 prompts x 4 x 8 tokens 1.52
  against 2.41 s and 4 x 64 greedy tokens 3.03 against 5.69 s.
- Fidelity: in float32 the trainer agrees exactly with plain PEFT; in bf16 within the bounds
  tests/test_engine.py states (:data:`BF16_LOGPROB_TOLERANCE`).

The engine reads the policy from :func:`current` (float32 on CPU unless :func:`configure`d:
engine tests and library users get exact float32 by default).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# The bound tests hold bf16 to, per token: |loops - plain PEFT under the same autocast| and
# |sampler - trainer| logprobs (tests/test_engine.py: under 1e-6 there, against 0.04 between bf16
# and float32; scripts/gpu_check.sh --device cpu on an AVX512-BF16 CPU, bf16 weights stored and
# float32 attention: loops vs PEFT 3.6e-7 tiny, 4.6e-6 SmolLM2; sampler vs trainer 8.4e-4 tiny,
# 6.7e-4 SmolLM2; before them 1.4e-2 tiny with two sampled rows, 1e-3 SmolLM2). bf16 keeps 8
# mantissa bits and the paths' matmul shapes differ (packing, KV-cache decode, batch rows).
BF16_LOGPROB_TOLERANCE = 0.02


class PrecisionUnavailable(ValueError):
    """The requested device or dtype is not available on this machine (message: one line)."""


@dataclass(frozen=True)
class Precision:
    dtype: str  # "float32" | "bfloat16": the compute dtype of forward passes
    device: str  # "cpu" | "cuda"
    reason: str  # why (for status): e.g. "auto: avx512_bf16 in /proc/cpuinfo"

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    @property
    def compute_dtype(self) -> Any:
        """The ``torch`` dtype matmuls compute in under :meth:`autocast`."""
        import torch

        return torch.bfloat16 if self.bf16 else torch.float32

    def autocast(self) -> Any:
        """The context forward passes run in: bf16 autocast, or nothing in float32."""
        if not self.bf16:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.device, dtype=torch.bfloat16)

    def to_dict(self) -> dict[str, str]:
        return {"dtype": self.dtype, "device": self.device, "reason": self.reason}


FLOAT32_CPU = Precision("float32", "cpu", "default")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The bf16 instruction sets this CPU reports (``amx_bf16``, ``avx512_bf16``)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = fh.read()
        except OSError:
            return []
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return [flag for flag in CPU_BF16_FLAGS if flag in flags]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_bf16() -> bool:
    import torch

    return bool(torch.cuda.is_bf16_supported())


def resolve(dtype: str = "auto", device: str = "auto") -> Precision:
    """The policy for a requested ``dtype`` and ``device``; PrecisionUnavailable if the
    device (or bf16 on CUDA) is not there, ValueError for an unknown name."""
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r} (accepted: {', '.join(DTYPES)}).")
    if device not in DEVICES:
        raise ValueError(f"Unknown device {device!r} (accepted: {', '.join(DEVICES)}).")
    if device == "cuda" and not _cuda_available():
        raise PrecisionUnavailable("--device cuda was requested, but torch sees no CUDA device "
                                   "on this machine.")
    chosen_device = device if device != "auto" else ("cuda" if _cuda_available() else "cpu")
    if chosen_device == "cuda":
        native = _cuda_bf16()
        if dtype == "bfloat16" and not native:
            raise PrecisionUnavailable("--dtype bfloat16 was requested, but this CUDA device has "
                                       "no bf16 support.")
        why = "CUDA bf16 support" if native else "no CUDA bf16 support"
    else:
        flags = cpu_bf16_flags()
        native = bool(flags)
        why = (f"{', '.join(flags)} in /proc/cpuinfo" if flags
               else "no amx_bf16/avx512_bf16 on this CPU")
    if dtype == "auto":
        return Precision("bfloat16" if native else "float32", chosen_device, f"auto: {why}")
    reason = "requested" if dtype == "float32" or native else f"requested ({why}: emulated)"
    return Precision(dtype, chosen_device, reason)


_lock = threading.Lock()
_current: Precision = FLOAT32_CPU


def configure(dtype: str = "auto", device: str = "auto") -> Precision:
    """Set the process's policy (the server does, once, when the engine loads)."""
    global _current
    chosen = resolve(dtype, device)
    with _lock:
        _current = chosen
    return chosen


def current() -> Precision:
    return _current


@contextlib.contextmanager
def using(precision: Precision) -> Iterator[Precision]:
    """Tests: run a block under ``precision`` (restored afterwards)."""
    global _current
    with _lock:
        before, _current = _current, precision
    try:
        yield precision
    finally:
        with _lock:
            _current = before


def store_matmul_weights_bf16(module: Any) -> int:
    """Keep a frozen base's matmul weights in bf16 (see the module docstring); returns the bytes
    of weights held afterwards minus before (negative: saved). Call before any adapter exists,
    and only where every forward pass runs under :meth:`Precision.autocast` in bf16 (the
    registry does it when the policy is bf16 at load time; ``BaseModel.activate`` refuses the
    model under a float32 policy afterwards)."""
    import torch

    before = _weight_bytes(module)
    head = module.get_output_embeddings()
    for layer in module.modules():
        if not isinstance(layer, torch.nn.Linear) or layer.weight.dtype != torch.float32:
            continue
        if layer is head:  # float32 weights, run in float32 (float32_head)
            continue
        layer.weight.data = layer.weight.data.to(torch.bfloat16)
        # PEFT moves a new adapter to its base layer's dtype (rounding a fresh LoRA A to bf16)
        # unless the layer names a compute dtype: LoRA weights stay float32 masters.
        # torch types Module.__setattr__ for tensors and modules only; PEFT reads a plain attribute.
        layer.compute_dtype = torch.float32  # type: ignore[assignment]
    # transformers maps safetensors files (mmap): the weights left in float32 (embeddings,
    # norms) still point into the file, which keeps all of it mapped and counted in the
    # server's RSS beside the bf16 copies (SmolLM2: the whole 513 MiB file). Copies of their
    # own release the map.
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.dtype != torch.bfloat16 and tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()
    return _weight_bytes(module) - before


_FLOAT32_LINEAR: Any = None


def float32_head(module: Any) -> None:
    """Make ``module``'s LM head (an ``nn.Linear``) compute in float32 under any autocast
    (:func:`float32_linear_class`); the registry does it for every base it loads. Without
    autocast nothing changes."""
    import torch

    head = module.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        head.__class__ = float32_linear_class()


def float32_linear_class() -> Any:
    """``Float32Linear``: an ``nn.Linear`` that computes in float32 under autocast too (its
    input and weight as float32, autocast off). A bf16 base's LM head is one (issue 43):
    under bf16 the logits came back in bf16, 8 mantissa bits, so logprobs moved in steps of
    0.125 at |logit| 16-32 and two tokens' scores could tie; logprobs score (echo,
    ``/forward``) and train (RL ratios between sampler and trainer), and the head is the
    one matmul whose every output is read as a logprob. The head keeps its float32 weight
    (a tied head shares the embedding's, so no copy is made)."""
    global _FLOAT32_LINEAR
    if _FLOAT32_LINEAR is None:
        import torch

        class Float32Linear(torch.nn.Linear):
            def forward(self, x: Any) -> Any:
                with torch.autocast(x.device.type, enabled=False):
                    return float32_linear(x, self.weight, self.bias)

        _FLOAT32_LINEAR = Float32Linear
    return _FLOAT32_LINEAR


def float32_linear(x: Any, weight: Any, bias: Any = None) -> Any:
    """``x @ weight.T + bias`` in float32 (inputs cast up, float32 products and sums), the LM
    head's logits in :class:`Float32Linear` (the sampler's, ``/forward``'s, and the trainer's
    for families without trainer._lm_head; trainer.HeadLogprobs keeps torch's, see there).

    On CPU through oneDNN's linear rather than ``torch.nn.functional.linear``, which calls
    MKL's sgemm: on the AMD EPYC bench machine MKL runs its slower code path, and a SmolLM2
    head chunk (160 x 576 by 49,152 x 576) took 80-100 ms there against 50 ms through oneDNN,
    both float32 throughout (max error against a float64 product: 1.4e-4 and 6.1e-5 on logits
    of |x| ~100, float32's rounding either way); at the sampler's 1-8 rows a decode step's head
    6-9 ms against 12-29 ms (the run_all of 2026-12-07 06:18 UTC, with the trainer's head on
    it too: the RL benches' dr_grpo and dapo read 1.57 and 1.55 against TRL, 1.18 and 1.36 in
    the run before)."""
    import torch

    x, weight = x.float(), weight.float()
    bias = None if bias is None else bias.float()
    tracked = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    # oneDNN's op has no autograd formula: a product the backward goes through stays torch's.
    if tracked or x.device.type != "cpu" or not _onednn_linear_available() or x.dim() < 2:
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, weight.contiguous(), bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


_ONEDNN_LINEAR: bool | None = None


def _onednn_linear_available() -> bool:
    global _ONEDNN_LINEAR
    if _ONEDNN_LINEAR is None:
        import torch

        _ONEDNN_LINEAR = bool(torch.backends.mkldnn.is_available()
                              and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return _ONEDNN_LINEAR


def _weight_bytes(module: Any) -> int:
    seen = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def share_input_casts(module: Any) -> None:
    """Make the Linear layers inside a bf16 base's LoRA layers (the frozen base Linear and
    each LoRA A; call after PEFT wrapped them) share one bf16 copy of an input they read.

    Under autocast every Linear casts its float32 input to bf16 on its own, and autograd keeps
    each LoRA A's copy for the backward: q, k and v read the same norm output, gate and up
    another, so SmolLM2 kept 6 bf16 copies of 3 inputs per layer (213 KB per trained token, of
    1069). Here a pre-hook casts a float32 input once, remembers the copy on the input tensor
    itself (it lives exactly as long as the input; the trainer's and sampler's threads share
    nothing) and hands each layer that copy through a node of its own (:class:`SharedCast`),
    whose backward casts that layer's gradient to float32 as autocast's cast did, so gradients
    still add up in float32. The values multiplied and the gradients are bit-identical."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    shared_cast = _shared_cast()

    def cast_once(layer: Any, args: tuple) -> tuple | None:
        x = args[0] if args else None
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.float32
                or not torch.is_autocast_enabled(x.device.type)):
            return None
        dtype = torch.get_autocast_dtype(x.device.type)
        copy = getattr(x, "_loops_autocast_copy", None)
        if copy is None or copy.dtype != dtype or copy._version != 0:
            with torch.no_grad():
                copy = x.to(dtype)
            # torch's stubs declare no attributes of our own on a Tensor (it takes any at run time).
            x._loops_autocast_copy = copy  # type: ignore[attr-defined]
        return (shared_cast.apply(x, copy), *args[1:])

    for layer in module.modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        # PEFT casts a bf16 input (o_proj's, down_proj's) up to the LoRA weights' float32
        # before LoRA A, and autocast casts that back down: two copies of equal values, the
        # bf16 one kept for the backward (SmolLM2: 4.2 KB a token a layer). LoRA A takes the
        # input itself instead, whose bytes the backward can then rebuild (derived_saves).
        layer.cast_input_dtype_enabled = False  # type: ignore[attr-defined]
        inner = [layer.get_base_layer(), *getattr(layer, "lora_A", {}).values()]
        for linear in inner:
            if (isinstance(linear, torch.nn.Linear)
                    and not getattr(linear, "_loops_shares_input_casts", False)):
                linear.register_forward_pre_hook(cast_once)
                # torch types Module.__setattr__ for tensors and modules only: a plain flag here.
                linear._loops_shares_input_casts = True  # type: ignore[assignment]


_SHARED_CAST: Any = None


def _shared_cast() -> Any:
    """SharedCast (torch imported on first use): ``apply(x, copy)`` is ``copy`` (x cast to
    bf16 once, without a graph) as a tensor of its own whose gradient flows to ``x`` in x's
    dtype."""
    global _SHARED_CAST
    if _SHARED_CAST is None:
        import torch

        class SharedCast(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any, copy: Any) -> Any:
                ctx.dtype = x.dtype
                return copy.detach()  # the same storage: one copy, whoever saves it

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                return grad.to(ctx.dtype), None

        _SHARED_CAST = SharedCast
    return _SHARED_CAST

