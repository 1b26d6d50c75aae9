"""One run's LoRA trainer: its own adapter on the shared base model and its own AdamW.

Contract (DEVELOPERS.md, "Local engine"): ``forward`` / ``forward_backward`` take Datum JSON
and return ForwardBackwardOutput JSON; ``optim_step`` returns OptimStepResponse JSON;
``step`` counts optimizer steps (= the policy version).

LoRA: rank ``lora_rank``, ``lora_alpha = 32`` for every rank (so the update scale is
32/rank, as PEFT defines it), dropout 0, on the attention (q, k, v, o) and MLP (gate, up,
down) projections. A is initialised from ``seed`` (B is zero, so a fresh adapter leaves the
base model unchanged).

Checkpoints are folders:

- ``save_state``: ``adapter_model.safetensors`` + ``adapter_config.json`` (plain PEFT, so it
  is also loadable as an adapter), ``optimizer.pt`` (AdamW state) and
  ``trainer_state.json`` (step, rank, base model).
- ``save_sampler_weights``: only the PEFT pair, loadable with
  ``peft.PeftModel.from_pretrained(base, dir)``; ``base_model_name_or_path`` is the loops
  model name (``loops-local/tiny`` for the tiny model).

Both are written to a temporary sibling folder and renamed into place.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from baseten_loops_cli import memory_estimate
from baseten_loops_cli.local.engine import allocator, attention, derived_saves, losses, precision
from baseten_loops_cli.local.engine.datums import ParsedDatum, parse_data
from baseten_loops_cli.local.engine.errors import EngineInputError
from baseten_loops_cli.local.engine.registry import BaseModel, decoder_layers
from baseten_loops_cli.memory_estimate import activation_bytes_per_token

LORA_ALPHA = 32
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"]
STATE_FORMAT_VERSION = 1
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
MAX_TOP_K_LOGPROBS = 20
ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                 "weight_decay": 0.0, "grad_clip_norm": 1.0}  # the SDK's AdamParams

# How the gradients accumulated since the last optim_step are to be scaled.
_TOKEN_MEAN = "token_mean"
_SUM = "sum"


def lora_config(rank: int, base_name: str) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=list(LORA_TARGET_MODULES), bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=base_name)


class LoraTrainer:
    def __init__(self, base: BaseModel, adapter_name: str, lora_rank: int,
                 seed: int | None = None) -> None:
        if not isinstance(lora_rank, int) or lora_rank < 1:
            raise EngineInputError(f"lora_rank must be a positive integer, got {lora_rank!r}.",
                                   "InvalidLoraRank")
        self.base = base
        self.adapter_name = adapter_name
        self.lora_rank = lora_rank
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
        self.step = 0
        self.tokens_trained = 0
        self._released = False
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            base.add_adapter(adapter_name, lora_config(lora_rank, base.name))
        self._params = [p for _, p in base.adapter_parameters(adapter_name)]
        self._optimizer = self._new_optimizer()
        # What the gradients accumulated since the last optim_step need (_TOKEN_MEAN, _SUM;
        # None: nothing accumulated) and over how many tokens; _reset_accumulation sets them.
        self._pending_mode: str | None
        self._pending_tokens: int
        self._reset_accumulation()

    # ── compute ──

    def forward(self, data: list[dict], loss_fn: str = "cross_entropy",
                loss_fn_config: dict | None = None, top_k_logprobs: int = 0,
                parsed: list[ParsedDatum] | None = None) -> dict:
        """Loss and per-token outputs without touching the gradients. ``parsed``: ``data``
        as :func:`~baseten_loops_cli.local.engine.datums.parse_data` already parsed it for
        this model (the server parses at submit time), so it is not parsed again."""
        return self._run(data, loss_fn, loss_fn_config, top_k_logprobs, parsed, backward=False)

    def forward_backward(self, data: list[dict], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict | None = None, top_k_logprobs: int = 0,
                         parsed: list[ParsedDatum] | None = None) -> dict:
        """Like :meth:`forward`, and adds the loss's gradient to the accumulated gradients."""
        return self._run(data, loss_fn, loss_fn_config, top_k_logprobs, parsed, backward=True)

    def _run(self, data: list[dict], loss_fn: str, loss_fn_config: dict | None,
             top_k_logprobs: int, parsed: list[ParsedDatum] | None, backward: bool) -> dict:
        self._check_live()
        definition = losses.loss_def(loss_fn)
        config = losses.resolve_config(loss_fn, loss_fn_config)
        if not isinstance(top_k_logprobs, int) or not 0 <= top_k_logprobs <= MAX_TOP_K_LOGPROBS:
            raise EngineInputError(f"top_k_logprobs must be an integer in 0..{MAX_TOP_K_LOGPROBS}.",
                                   "InvalidRequest")
        if parsed is None:
            parsed = parse_data(data, loss_fn, definition, self.base.vocab_size,
                                self.base.max_seq_len)
        normalization = _TOKEN_MEAN if definition.token_normalized(config) else _SUM
        if backward and self._pending_mode not in (None, normalization):
            raise EngineInputError(
                "This forward_backward mixes token-normalized and unnormalized gradients in "
                "one optimizer step (cross_entropy with and without skip_token_normalization, "
                "or with an RL loss). Call optim_step first.", "MixedLossNormalization")

        policy = precision.current()
        # A backward pass keeps every layer's activations until it runs: for a large batch
        # it runs per chunk of at most BACKWARD_CHUNK_BYTES of activations (the gradients add
        # up in .grad), so the autograd graph of one chunk is alive at a time. Every loss but DPO
        # is a sum over datums; DPO's pairs are not split, so it stays one pass.
        if backward and loss_fn != "dpo":
            chunks = backward_chunks([len(p.tokens) for p in parsed],
                                     backward_chunk_tokens(self.base.module.config, policy.dtype))
        else:
            chunks = [list(range(len(parsed)))]
        loss_inputs: list[Any] = [None] * len(parsed)
        top_k: list[Any] = [None] * len(parsed)
        results: list[losses.LossResult] = []
        most_recomputed = 0
        with self.base.activate(self.adapter_name) as model, torch.set_grad_enabled(backward):
            head = _lm_head(model)
            for chunk in chunks:
                part = [parsed[i] for i in chunk]
                # A chunk past memory_estimate.ACTIVATION_BUDGET_BYTES (one long datum:
                # chunks never split one) recomputes some decoder layers' activations in the
                # backward instead of keeping them (checkpointed_layers).
                tokens = sum(len(p.tokens) for p in part)
                recompute = checkpoint_layer_count(
                    self.base.module.config, policy.dtype, tokens) if backward else 0
                most_recomputed = max(most_recomputed, recompute)
                # A step that recomputes layers draws its blocks from malloc's heap
                # (allocator.long_step: a fifth of an 8k step was page faults).
                hidden_bytes = tokens * int(self.base.module.config.hidden_size) * 4
                with allocator.long_step(hidden_bytes) if recompute else contextlib.nullcontext():
                    with (policy.autocast(), checkpointed_layers(model, recompute),
                          derived_saves.packing() if backward else contextlib.nullcontext()):
                        # the forward pass only: logprobs and losses in float32
                        outputs = _datum_outputs(model, [p.tokens for p in part],
                                                 policy.device, hidden=head is not None)
                    chunk_inputs, chunk_top = _target_logprobs(
                        outputs, part, top_k_logprobs, policy.device, head, policy.compute_dtype)
                    del outputs
                    chunk_result = losses.compute(loss_fn, chunk_inputs, config)
                    if backward:
                        chunk_result.total.backward()
                        chunk_result.total = chunk_result.total.detach()
                        for datum in chunk_inputs:  # the graph is spent: keep values only
                            datum.target_logprobs = datum.target_logprobs.detach()
                        chunk_result.elementwise = [e.detach() for e in chunk_result.elementwise]
                results.append(chunk_result)
                for j, i in enumerate(chunk):
                    loss_inputs[i] = chunk_inputs[j]
                    if chunk_top:
                        top_k[i] = chunk_top[j]
            result = _merge_results(results, chunks, len(parsed))
        if not top_k_logprobs:
            top_k = []
        if backward:
            self._pending_mode = normalization
            self._pending_tokens += result.trained_tokens
            self.tokens_trained += sum(len(p.tokens) for p in parsed)
        output = _output(loss_fn, result, loss_inputs, top_k, config)
        # Which dtype computed this step (1.0: bf16 autocast, 0.0: float32), in every step's
        # metrics, so a run's records say what produced them.
        output["metrics"]["compute_bf16"] = 1.0 if policy.bf16 else 0.0
        if most_recomputed:  # decoder layers run again in the backward (checkpointed_layers)
            output["metrics"]["recomputed_layers"] = float(most_recomputed)
        return output

    # ── optimizer ──

    def optim_step(self, adam_params: dict | None = None) -> dict:
        """One AdamW step on the accumulated gradients (then cleared). ``adam_params``:
        learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm (0 = no clipping)."""
        self._check_live()
        params = _adam_params(adam_params)
        for group in self._optimizer.param_groups:
            group.update(lr=params["learning_rate"], betas=(params["beta1"], params["beta2"]),
                         eps=params["eps"], weight_decay=params["weight_decay"])
        grads = [p.grad for p in self._params if p.grad is not None]
        if self._pending_mode == _TOKEN_MEAN and self._pending_tokens > 0:
            for grad in grads:
                grad.div_(self._pending_tokens)
        grad_norm = 0.0
        if grads and params["grad_clip_norm"] > 0:  # the norm before clipping, computed once
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, params["grad_clip_norm"]))
        elif grads:
            grad_norm = float(torch.nn.utils.get_total_norm(grads))
        with self.base.lock:
            self._optimizer.step()
        self.step += 1
        self._reset_accumulation()
        return {"metrics": {"grad_norm": grad_norm,
                            "learning_rate": float(params["learning_rate"]),
                            "step": float(self.step)}}

    def _new_optimizer(self) -> torch.optim.Optimizer:
        # Hyperparameters are set from adam_params at every step.
        return torch.optim.AdamW(self._params)

    def _reset_accumulation(self) -> None:
        for p in self._params:
            p.grad = None
        self._pending_mode = None
        self._pending_tokens = 0

    # ── checkpoints ──

    def save_sampler_weights(self, directory: str | os.PathLike) -> None:
        self._check_live()
        with _atomic_dir(directory) as tmp:
            self._write_adapter(tmp)

    def save_state(self, directory: str | os.PathLike) -> None:
        self._check_live()
        with _atomic_dir(directory) as tmp:
            self._write_adapter(tmp)
            torch.save(self._optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            (tmp / TRAINER_STATE).write_text(json.dumps({
                "format_version": STATE_FORMAT_VERSION, "base_model": self.base.name,
                "lora_rank": self.lora_rank, "lora_alpha": LORA_ALPHA, "step": self.step,
            }, indent=2))

    def _write_adapter(self, directory: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.base.adapter_state(self.adapter_name), str(directory / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        config = copy.deepcopy(self.base.adapter_config(self.adapter_name))
        config.inference_mode = True  # as PEFT's own save_pretrained writes it
        config.save_pretrained(str(directory))

    def load_state(self, directory: str | os.PathLike, with_optimizer: bool = False) -> int:
        """Load adapter weights from a ``save_state`` folder (or a plain PEFT adapter folder).
        Weights only: the optimizer is reset and ``step`` becomes 0. ``with_optimizer``:
        also the AdamW state and the step. Pending gradients are dropped. Returns ``step``."""
        from safetensors.torch import load_file

        self._check_live()
        directory = Path(directory)
        config = _read_json(directory / ADAPTER_CONFIG)
        state = _read_json(directory / TRAINER_STATE) if (directory / TRAINER_STATE).exists() \
            else None
        if config is None or not (directory / ADAPTER_WEIGHTS).is_file():
            raise EngineInputError(f"{directory} is not a LoRA checkpoint (no {ADAPTER_CONFIG} "
                                   f"and {ADAPTER_WEIGHTS}).", "InvalidCheckpoint")
        if int(config.get("r", -1)) != self.lora_rank:
            raise EngineInputError(f"The checkpoint has LoRA rank {config.get('r')}, but this "
                                   f"trainer has rank {self.lora_rank}.", "LoraRankMismatch")
        saved_base = config.get("base_model_name_or_path")
        if saved_base and saved_base != self.base.name:
            raise EngineInputError(f"The checkpoint was trained on {saved_base}, not "
                                   f"{self.base.name}.", "BaseModelMismatch")
        if (directory / TRAINER_STATE).exists() and state is None:
            raise EngineInputError(f"{directory}/{TRAINER_STATE} is corrupt (not a JSON object); "
                                   "the checkpoint cannot be loaded.", "InvalidCheckpoint")
        if with_optimizer and (state is None or not (directory / OPTIMIZER_FILE).is_file()):
            raise EngineInputError(f"{directory} has no optimizer state (it holds sampler "
                                   "weights only); load it without the optimizer.",
                                   "InvalidCheckpoint")
        try:
            self.base.set_adapter_state(self.adapter_name,
                                        load_file(str(directory / ADAPTER_WEIGHTS)))
        except (ValueError, RuntimeError) as exc:  # wrong keys or shapes
            raise EngineInputError(f"{directory}: {exc}", "InvalidCheckpoint") from exc
        self._optimizer = self._new_optimizer()
        self._reset_accumulation()
        if with_optimizer:
            assert state is not None  # refused above: with_optimizer needs the trainer state
            self._optimizer.load_state_dict(
                torch.load(directory / OPTIMIZER_FILE, weights_only=True))
            self.step = int(state["step"])
        else:
            self.step = 0
        return self.step

    def release(self) -> None:
        """Free the adapter and optimizer; the trainer is unusable afterwards."""
        if not self._released:
            self._released = True
            self._params = []
            self._optimizer = None  # type: ignore[assignment]
            self.base.delete_adapter(self.adapter_name)

    def _check_live(self) -> None:
        if self._released:
            raise RuntimeError(f"trainer {self.adapter_name!r} was released")


# ── helpers ──

# The most activation bytes one backward pass holds (see LoraTrainer._run). SmolLM2's RL
# example (32 sequences) held ~2 GB at once in one pass; bench/memory.py (under load): RL
# example peak 2178 MiB with 512-token chunks, 1390 with 256 (steps no slower: 256-row matmuls
# stay large). The budget is in bytes, not tokens, because a token's activations scale with
# the model: 256 SmolLM2 tokens hold as much as ~10,000 of the tiny model's, whose batches
# chunked by tokens ran 30% slower (bench/train_throughput.py: 0.92 -> 1.28 of plain PEFT).
# 188 MiB since derived_saves (0.69x the bytes a token): the same ~320 SmolLM2 tokens a pass
# as 272 MiB before it (the run_all of ea5c98d, whose passes took 1.45x the tokens, read the RL
# example's peak 3.04x its weights, against 2.86, and SFT vs TRL 1.19 against 1.56).
#
# Tried and not kept (2026-12-08, SmolLM2 bf16 on the AMX Xeon, the RL example's 32 datums,
# 1,520 tokens): one pass recomputing every layer instead of five passes (kept bytes ~186 MiB,
# under this budget) trained 16-20% faster in process (5.55 -> 4.65 s; two passes of 760
# tokens, 5.7 s: the (760 x 1536) x (1536 x 576) product runs at ~970 GFLOP/s, at 1,520 rows
# ~1,500), but the server's peak under the example rose from 1,406 to 1,550-1,585 MiB (3.02x
# the weights, over bench/memory.py's 3.0): the pass's live bytes peaked 283 MiB over the
# step's start and its RSS 485, the rest free heap among its blocks (not the kept inputs:
# mapped apart, 472); with every block over 1 MiB mapped apart the RSS followed (+320 MiB) but
# the step took 8.3 s of page faults.
BACKWARD_CHUNK_BYTES = 188 * 2**20


def backward_chunk_tokens(config: Any, dtype: str) -> int:
    """How many tokens one backward pass takes under :data:`BACKWARD_CHUNK_BYTES`."""
    return max(1, BACKWARD_CHUNK_BYTES // activation_bytes_per_token(config, dtype))


# Activation checkpointing (issue 40): past memory_estimate.ACTIVATION_BUDGET_BYTES a backward
# recomputes decoder layers instead of keeping their activations. "auto": past the budget;
# "on": every decoder layer of every backward; "off": never (the server's
# activation_checkpointing option, LOOPS_ACTIVATION_CHECKPOINTING).
CHECKPOINTING_MODES = memory_estimate.CHECKPOINTING_MODES
_checkpointing = "auto"


def configure_checkpointing(mode: str) -> None:
    """Set the process's activation-checkpointing mode (the server does, when the engine
    loads); ValueError for a mode not in :data:`CHECKPOINTING_MODES`."""
    global _checkpointing
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"Unknown activation checkpointing mode {mode!r} (accepted: "
                         f"{', '.join(CHECKPOINTING_MODES)}).")
    _checkpointing = mode


def checkpoint_layer_count(config: Any, dtype: str, tokens: int) -> int:
    """How many decoder layers a backward over ``tokens`` tokens recomputes under the
    configured mode (memory_estimate.checkpoint_layer_count)."""
    return memory_estimate.checkpoint_layer_count(config, dtype, tokens, _checkpointing)


@contextlib.contextmanager
def checkpointed_layers(model: Any, count: int) -> Iterator[None]:
    """Run the first ``count`` decoder layers under non-reentrant activation checkpointing
    while the block runs: each keeps its inputs and its attention's output
    (attention.keep_attention_outputs) and runs again, with the same autocast, in the
    backward. The layers' ``forward`` is wrapped on these module objects only (the sampling
    twin has its own); the caller holds the base's lock."""
    layers = decoder_layers(model)[:count] if count > 0 else []
    if not layers:
        yield
        return
    from torch.utils.checkpoint import checkpoint

    keep = attention.keep_attention_outputs()

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            # No dropout in the engine's models: the RNG state need not be replayed.
            with derived_saves.suspended():
                output = checkpoint(forward, *args, use_reentrant=False,
                                    preserve_rng_state=False, context_fn=keep, **kwargs)
            # The output is the next layer's input, kept until this backward: out of the heap
            # (allocator.mapped_copies), which then gives back what it holds free.
            if isinstance(output, torch.Tensor):
                output = _KeptOutput.apply(output)
            elif isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                output = (_KeptOutput.apply(output[0]), *output[1:])
            allocator.release_if_grown()
            return output
        return run

    saved = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = wrap(layer.forward)
    try:
        yield
    finally:
        for layer, before in zip(layers, saved):
            if before is None:
                del layer.forward
            else:
                layer.forward = before


class _KeptOutput(torch.autograd.Function):
    """A checkpointed layer's output, which the next layer keeps until its backward, moved out
    of malloc's heap (allocator.mapped_copies); the gradient passes through, and each layer's
    backward starts by letting the heap give back what it holds free
    (allocator.release_if_grown)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor) -> torch.Tensor:
        return allocator.mapped_copies(hidden)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        allocator.release_if_grown()
        return grad


def backward_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Datum indices in order, cut into consecutive chunks of at most ``budget`` tokens (a
    datum longer than the budget is a chunk of its own)."""
    chunks: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if chunks[-1] and used + n > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks


def _merge_results(results: list[losses.LossResult], chunks: list[list[int]], count: int
                   ) -> losses.LossResult:
    """One LossResult from per-chunk ones of a per-datum-sum loss (metrics are sums)."""
    if len(results) == 1:
        return results[0]
    elementwise: list[Any] = [None] * count
    for result, chunk in zip(results, chunks):
        for j, i in enumerate(chunk):
            elementwise[i] = result.elementwise[j]
    metrics: dict[str, float] = {}
    for result in results:
        for key, value in result.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    total = torch.stack([r.total for r in results]).sum()
    return losses.LossResult(total, elementwise, sum(r.trained_tokens for r in results),
                             metrics)

def _adam_params(given: dict | None) -> dict[str, float]:
    unknown = sorted(set(given or {}) - set(ADAM_DEFAULTS))
    if unknown:
        raise EngineInputError(f"Unknown adam_params {', '.join(unknown)} (accepted: "
                               f"{', '.join(ADAM_DEFAULTS)}).", "InvalidAdamParams")
    params = {**ADAM_DEFAULTS, **(given or {})}
    for key, value in params.items():
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value < 0):
            raise EngineInputError(f"adam_params.{key} must be a finite number >= 0, got "
                                   f"{value!r}.", "InvalidAdamParams")
    return {key: float(value) for key, value in params.items()}


# Model families whose causal mask transformers builds from ``position_ids``
# (masking_utils.find_packed_sequence_indices): in a row holding several sequences, each with
# its positions restarting at 0, every token attends within its own sequence only.
_PACKABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _packable(model: Any) -> bool:
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in _PACKABLE_MODEL_TYPES
            and getattr(config, "_attn_implementation", None) in (
                "sdpa", "eager", attention.FLOAT32_ATTENTION, attention.BF16_ATTENTION))


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: datum indices grouped into rows of at most ``width`` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if row is None:
            rows.append([i])
            free.append(width - lengths[i])
        else:
            rows[row].append(i)
            free[row] -= lengths[i]
    return rows


def packing(lengths: list[int]) -> tuple[int, list[list[int]]]:
    """The row width and rows (:func:`pack_rows`) that hold ``lengths`` in the fewest padded
    slots, trying widths from the longest datum to twice it (ties: the narrower, since each
    row's attention grows with its width squared). Rows exactly as wide as the longest datum
    left 17% of a typical SFT batch as padding (8 datums of 16-64 tokens: 6 rows of 64 for 320
    tokens, where 4 rows of 80 hold them with none), and every matmul of the step pays for it."""
    longest = max(lengths)
    best: tuple[int, int, list[list[int]]] | None = None
    for width in range(longest, 2 * longest + 1, max(1, longest // 64)):  # <= 65 tries
        rows = pack_rows(lengths, width)
        if best is None or len(rows) * width < best[0]:
            best = (len(rows) * width, width, rows)
        if best[0] == sum(lengths):
            break
    assert best is not None
    return best[1], best[2]


def _lm_head(model: Any) -> Any:
    """The LM head, where the model's logits are exactly ``lm_head(last hidden state)`` (the
    packable families: no logit scaling or soft-capping after it); None elsewhere, where the
    trainer takes the model's full logits."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _PACKABLE_MODEL_TYPES:
        return None
    if not isinstance(getattr(model, "model", None), torch.nn.Module):
        return None
    head = model.get_output_embeddings()
    return head if isinstance(head, torch.nn.Linear) and head.bias is None else None


def _datum_outputs(model: Any, sequences: list[list[int]], device: str = "cpu",
                   hidden: bool = False) -> list[torch.Tensor]:
    """Each sequence's (N, V) float32 logits, or with ``hidden`` its (N, H) last hidden
    states (the LM head is then applied by :func:`_target_logprobs`, only at the positions
    whose outputs are read), from one forward pass.

    A batch of unequal lengths is packed: several sequences share a row (positions restart at
    0 for each, so none sees another; the width is :func:`packing`'s), which runs fewer padded
    positions than padding every sequence to the longest. Where packing saves no row, or the model's attention
    cannot take it, rows are right-padded with an attention mask; equal lengths need neither.
    """
    def run(**inputs: Any) -> torch.Tensor:
        inputs = {k: v.to(device) if v is not None else None for k, v in inputs.items()}
        if hidden:
            return model.model(**inputs, use_cache=False).last_hidden_state
        return model(**inputs, use_cache=False).logits.float()

    lengths = [len(s) for s in sequences]
    if len(sequences) > 1 and max(lengths) > UNMASKED_ROW_TOKENS:
        # Each long sequence in a row of its own: without a mask (one sequence, no padding)
        # attention is SDPA with is_causal, whose flash kernel never builds the (width x
        # width) mask that packing or padding needs (an 8k-token row: 64 MB a row; 128k: 16 GB).
        return [out for seq in sequences for out in _datum_outputs(model, [seq], device, hidden)]
    width, rows = packing(lengths) if _packable(model) else (max(lengths), [])
    if rows and len(rows) * width < len(sequences) * max(lengths):
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        position_ids = torch.zeros_like(input_ids)
        where: list[tuple[int, int]] = [(0, 0)] * len(sequences)
        for r, members in enumerate(rows):
            offset = 0
            for i in members:
                n = lengths[i]
                input_ids[r, offset: offset + n] = torch.tensor(sequences[i])
                position_ids[r, offset: offset + n] = torch.arange(n)
                where[i] = (r, offset)
                offset += n
            # The unused tail is one more "sequence" of its own, attended by nothing real.
            position_ids[r, offset:] = torch.arange(width - offset)
        out = run(input_ids=input_ids, position_ids=position_ids)
        return [out[r, offset: offset + n] for (r, offset), n in zip(where, lengths)]
    width = max(lengths)
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq)
    mask = None
    if min(lengths) < width:
        mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    out = run(input_ids=input_ids, attention_mask=mask)
    return [out[row, :n] for row, n in enumerate(lengths)]


# A batch whose longest sequence passes this runs one sequence per forward pass (see
# _datum_outputs); at this length a row's matmuls are as large as packing would make them.
UNMASKED_ROW_TOKENS = 1024


TopK = tuple[torch.Tensor, torch.Tensor]  # (logprobs, token ids), each (N, k)

# Rows of (rows, V) float32 logits alive at once in :class:`HeadLogprobs` (SmolLM2: 160 x
# 49,152 floats, 31 MB, and their bf16 copy for the gradient's product), and the rows of them
# each softmax pass walks at a time. The float32 product runs ~25% faster on 160 rows than on
# 64 (this CPU, 2 cores); the elementwise passes over 32 rows (6 MB) stay in cache, where the
# passes over a whole 160-row block went to memory once per pass.
HEAD_CHUNK_ROWS = 160
HEAD_SLICE_ROWS = 32


class HeadLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ W.T)`` at ``index`` ((P,) or (P, K) target ids), by chunks of
    :data:`HEAD_CHUNK_ROWS` rows, never holding the (P, V) logits for the backward.

    The gradient of a target's logprob with respect to its hidden state is ``W[t] - p @ W``
    (``p`` the row's softmax), times the upstream gradient, a scalar per (row, target). So the
    forward keeps a (P, H) product per row, computed while the chunk's softmax is at hand, and
    the backward scales it: the same FLOPs as autograd's (P, V) x (V, H) product, without
    keeping (P, V) tensors. Autograd kept the logits, their float32 copy and the softmax of
    every trained position until the backward: about 10 bytes x 49,152 per token on SmolLM2,
    as much as all 30 layers' activations (issue 33: "a fused or chunked LM head").

    The logits are float32 whatever the autocast, as the model's own head computes them
    (precision.float32_linear_class): logprobs are not bf16-coarse (issue 43). The gradient's
    product runs in the forward pass's compute dtype: under bf16 autocast a bf16 (rows, V) x
    (V, H) product is ~2x faster than float32's on CPU (issue 41: the float32 head had cost
    the SFT bench 15% of its speed), and the rest of the backward is bf16 anyway. With one
    target per row it is kept in difference form, ``(p - e_t) @ W``, so bf16 rounds it
    relatively: ``p @ W`` alone in bf16 did not train, since near a memorized token
    ``p @ W ~ W[t]`` and its rounding, relative to ``|W[t]|``, swamped the difference. Several
    targets per row (``(P, K)``) keep ``p @ W`` in float32.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, index: torch.Tensor,
                compute_dtype: torch.dtype, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grad = ctx.needs_input_grad[0]
        device = hidden.device.type
        single = index.dim() == 1
        grad_dtype = compute_dtype if single else torch.float32
        weight32 = weight.float()
        weight_for_grad = weight.to(grad_dtype) if grad else weight32
        picked, s_rows, top_values, top_ids = [], [], [], []
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.shape[0], HEAD_CHUNK_ROWS):
                # torch's float32 product (MKL), not precision.float32_linear's oneDNN one:
                # with it the server's peak RSS at 8k went from 2.82-2.85 to 3.04-3.18 GiB
                # (over issue 40's 3 GiB); in process under the server's allocator policy an
                # 8k step peaked at 2.66 against 2.42 GiB (which allocation, not yet known),
                # and a 2k step gained 5% in one in-process reading, nothing beyond the noise
                # in a later A/B (four steps each, 2026-12-07).
                logits = torch.nn.functional.linear(
                    hidden[start: start + HEAD_CHUNK_ROWS].float(), weight32)
                probs = torch.empty_like(logits, dtype=grad_dtype) if grad else None
                for offset in range(0, logits.shape[0], HEAD_SLICE_ROWS):
                    block = logits[offset: offset + HEAD_SLICE_ROWS]
                    at = index[start + offset: start + offset + block.shape[0]]
                    target = at if not single else at.unsqueeze(-1)
                    chosen = block.gather(-1, target)
                    if top_k:
                        values, ids = block.topk(top_k, dim=-1)
                    # log-sum-exp by hand, the exponentials computed once and kept for p
                    peak = block.amax(-1, keepdim=True)
                    block.sub_(peak).exp_()
                    total = block.sum(-1, keepdim=True)
                    normalizer = peak + total.log()
                    picked.append((chosen - normalizer).squeeze(-1) if single
                                  else chosen - normalizer)
                    if top_k:
                        top_values.append(values - normalizer)
                        top_ids.append(ids)
                    if probs is not None:
                        block.div_(total)
                        if single and grad_dtype != torch.float32:
                            block.scatter_add_(-1, target, torch.full_like(
                                target, -1, dtype=block.dtype))
                        probs[offset: offset + block.shape[0]].copy_(block)
                del logits
                if probs is not None:
                    s_rows.append(probs @ weight_for_grad)
                    del probs
        if grad:
            ctx.hidden_dtype = hidden.dtype
            ctx.difference = single and grad_dtype != torch.float32
            ctx.save_for_backward(weight, index, torch.cat(s_rows))
        empty = hidden.new_zeros((hidden.shape[0], 0), dtype=torch.float32)
        return (torch.cat(picked),
                torch.cat(top_values) if top_k else empty,
                torch.cat(top_ids) if top_k else empty.long())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        weight, index, s_rows = ctx.saved_tensors
        if ctx.difference:  # s_rows: (p - e_t) @ W, minus the gradient of log p_t
            grad_hidden = -grad.unsqueeze(-1) * s_rows.float()
        else:  # s_rows: p @ W, in float32
            rows = weight[index].float()
            if index.dim() == 1:
                grad_hidden = grad.unsqueeze(-1) * (rows - s_rows)
            else:
                grad_hidden = ((grad.unsqueeze(-1) * rows).sum(1)
                               - grad.sum(1, keepdim=True) * s_rows)
        return grad_hidden.to(ctx.hidden_dtype), None, None, None, None


def _pick(logits: torch.Tensor, index: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, TopK | None]:
    """Logprobs of ``index`` ((N,) or (N, K)) under (N, V) float32 ``logits``, and the top-k."""
    normalizer = torch.logsumexp(logits, dim=-1)  # (N,)
    if index.dim() == 1:
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - normalizer
    else:
        picked = logits.gather(-1, index) - normalizer.unsqueeze(-1)
    if not top_k:
        return picked, None
    values, ids = logits.detach().topk(top_k, dim=-1)
    return picked, (values - normalizer.detach().unsqueeze(-1), ids)


def _target_logprobs(outputs: list[torch.Tensor], parsed: list[ParsedDatum], top_k: int,
                     device: str = "cpu", head: Any = None,
                     compute_dtype: torch.dtype = torch.float32,
                     ) -> tuple[list[losses.DatumLossInput], list[TopK]]:
    """Each datum's logprobs of its targets (and optionally the top-k alternatives), with
    the datum's loss inputs on ``device`` (where the outputs are).

    ``outputs``: each datum's logits, or, with ``head``, its last hidden states. Then the head
    (and log-softmax) runs only where an output is read: not at all at positions whose target
    is ignored (-100: their logprob goes out as null, their loss is 0) unless top-k is asked
    for, and without autograd at positions whose loss multiplier (``mask * weights``) is 0
    (their logprobs are returned, but no gradient flows through them). So the (N, V) backward
    of the LM head runs at trained positions only (issue 33: "don't compute what is not
    trained").
    """
    inputs: list[losses.DatumLossInput] = []
    top: list[TopK] = []
    # With a head: which positions of each datum are read with and without a gradient; the
    # head then runs once per kind over every datum's positions (one (P, V) matmul instead of
    # one per datum: 8 small ones took ~0.17 s of a 1.2 s SmolLM2 SFT step).
    groups: dict[bool, list[tuple[int, torch.Tensor, torch.Tensor]]] = {True: [], False: []}  # grad -> (datum, positions, targets)
    for d, (out, datum) in enumerate(zip(outputs, parsed)):
        loss_inputs = datum.inputs if device == "cpu" else {
            key: value.to(device) for key, value in datum.inputs.items()}
        targets = loss_inputs["target_tokens"]
        valid = targets != losses.IGNORE_INDEX
        index = targets.clamp(min=0)
        if head is None:
            picked, pair = _pick(out, index, top_k)
            if pair is not None:
                top.append(pair)
            inputs.append(losses.DatumLossInput(picked * valid, valid, loss_inputs))
            continue
        n = targets.shape[0]
        read = valid.reshape(n, -1).any(-1)
        if top_k:
            read = torch.ones_like(read)
        multiplier = valid.to(torch.float32)
        for name in ("mask", "weights"):
            if name in loss_inputs:
                multiplier = multiplier * loss_inputs[name]
        trained = read & (multiplier.reshape(n, -1) != 0).any(-1)
        for rows, grad in ((trained, True), (read & ~trained, False)):
            at = rows.nonzero().squeeze(-1)
            if at.numel():
                groups[grad].append((d, at, index[at]))
        inputs.append(losses.DatumLossInput(valid, valid, loss_inputs))  # logprobs filled below
        if top_k:
            top.append((torch.zeros((n, top_k), dtype=torch.float32, device=out.device),
                        torch.zeros((n, top_k), dtype=torch.long, device=out.device)))
    if head is None:
        return inputs, top
    picked_by_datum = [torch.zeros(d.valid.shape, dtype=torch.float32, device=out.device)
                       for d, out in zip(inputs, outputs)]
    for grad, group in groups.items():
        if not group:
            continue
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            part, values, ids = HeadLogprobs.apply(
                torch.cat([outputs[d][at] for d, at, _ in group]), head.weight,
                torch.cat([index for _, _, index in group]), compute_dtype, top_k)
        offset = 0
        for d, at, _ in group:
            count = at.shape[0]
            # out of place, with autograd as the caller has it: keeps the trained part's graph
            picked_by_datum[d] = picked_by_datum[d].index_put((at,), part[offset: offset + count])
            if top_k:
                top[d][0][at] = values[offset: offset + count].detach()
                top[d][1][at] = ids[offset: offset + count]
            offset += count
    for d, loss_input in enumerate(inputs):
        loss_input.target_logprobs = picked_by_datum[d] * loss_input.valid
    return inputs, top


def _tensor_data(tensor: torch.Tensor, dtype: str, nan_where: torch.Tensor | None = None
                 ) -> dict:
    values = tensor.detach().reshape(-1).tolist()
    if nan_where is not None:  # JSON has no NaN: masked positions go out as null
        values = [None if masked else v for v, masked in
                  zip(values, nan_where.reshape(-1).tolist())]
    return {"data": values, "dtype": dtype, "shape": list(tensor.shape)}


def _output(loss_fn: str, result: losses.LossResult, inputs: list[losses.DatumLossInput],
            top_k: list[TopK], config: dict) -> dict:
    outputs = []
    for i, datum in enumerate(inputs):
        item = {"logprobs": _tensor_data(datum.target_logprobs, "float32", ~datum.valid),
                "elementwise_loss": _tensor_data(result.elementwise[i], "float32")}
        if top_k:
            item["top_k_logprobs"] = _tensor_data(top_k[i][0], "float32")
            item["top_k_tokens"] = _tensor_data(top_k[i][1], "int64")
        outputs.append(item)
    loss_sum = result.metrics["loss:sum"]
    mean = loss_sum / max(result.trained_tokens, 1)
    metrics = {**result.metrics, "loss": mean, "tokens": float(result.trained_tokens)}
    if loss_fn == "cross_entropy":
        metrics["skip_token_normalization"] = float(config["skip_token_normalization"])
    # ``loss`` is telemetry (the per-trained-token mean); the gradient is defined by the
    # loss's sum and the token normalization described in losses.py.
    return {"loss": mean, "loss_fn_output_type": loss_fn, "loss_fn_outputs": outputs,
            "metrics": metrics}


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


@contextlib.contextmanager
def _atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Write into the yielded temporary folder; on success it replaces ``dest`` by renames
    (an existing ``dest`` is swapped out first, then deleted)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if dest.exists():
        old = dest.with_name(f"{tmp.name}.old")
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
