"""Checks a trainer op's body at submit time, before it is queued.

Bad input is refused with a 400 naming the datum, the field and the fix, *when the op is
submitted* — not minutes later when it reaches the model, and never as a silent NaN in
the weights. (A user report that shaped this: a request with an unsupported
``loss_fn_config`` key was retried 50 times against 500s; here it is one clear 400.)

The loss table mirrors the protocol (loops-protocol.md §3.2): which ``loss_fn_inputs``
each loss needs, which it accepts, and which ``loss_fn_config`` keys it takes. Anything
deeper (numerics, the model itself) is the engine's job; its ``EngineInputError`` comes
back as the op's error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from baseten_loops_cli.local.server.compute import ModelSpec
from baseten_loops_cli.local.server.errors import ApiError, bad_request, choices

_TOKEN_INPUTS = {"target_tokens"}
_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
_INT_DTYPES = {"int64", "int32", "int16", "int8", "uint8"}
_KNOWN_DTYPES = _FLOAT_DTYPES | _INT_DTYPES | {"bool"}
IGNORE_INDEX = -100
MAX_TOP_K_LOGPROBS = 20

_RL_INPUTS = frozenset({"target_tokens", "logprobs", "advantages"})


@dataclass(frozen=True)
class LossSpec:
    required: frozenset[str]
    optional: frozenset[str]
    config: dict[str, Any]  # key -> default
    rows_per_group: int = 1

    @property
    def accepted(self) -> frozenset[str]:
        return self.required | self.optional


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(frozenset({"target_tokens"}), frozenset({"weights"}),
                              {"skip_token_normalization": False}),
    "importance_sampling": LossSpec(_RL_INPUTS, frozenset({"mask", "weights"}), {}),
    "ppo": LossSpec(_RL_INPUTS, frozenset({"mask", "weights"}),
                    {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(_RL_INPUTS, frozenset({"mask", "weights"}),
                      {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "dro": LossSpec(_RL_INPUTS, frozenset({"mask", "weights"}), {"beta": 0.05}),
    "dpo": LossSpec(frozenset({"target_tokens", "ref_logprobs"}), frozenset({"weights"}),
                    {"beta": 0.1, "label_smoothing": 0.0}, rows_per_group=2),
    "dppo": LossSpec(_RL_INPUTS, frozenset({"mask", "weights"}),
                     {"dppo_mask_high": 0.2, "dppo_mask_low": 0.2, "adv_tau": 1.0,
                      "kl_tau": 1e-3}),
}

ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                 "weight_decay": 0.0, "grad_clip_norm": 1.0}


@dataclass(frozen=True)
class ForwardRequest:
    data: list[dict]
    loss_fn: str
    loss_fn_config: dict[str, Any] | None
    top_k_logprobs: int
    token_count: int


def _err(detail: str, error_class: str) -> ApiError:
    return bad_request(detail, error_class)


def datum_tokens(datum: dict, index: int, spec: ModelSpec) -> list[int]:
    """The token ids of ``datum.model_input`` (text chunks only), validated."""
    model_input = datum.get("model_input") if isinstance(datum, dict) else None
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise _err(f"data[{index}].model_input.chunks must be a list of chunks "
                   "({'type': 'encoded_text', 'tokens': [...]}).", "InvalidDatum")
    tokens: list[int] = []
    for c, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind in ("image", "image_asset_pointer"):
            raise _err(f"data[{index}].model_input.chunks[{c}] is an image, but {spec.name} "
                       "is a text-only model. Send encoded_text chunks.", "UnsupportedInput")
        if kind != "encoded_text" or not isinstance(chunk.get("tokens"), list):
            raise _err(f"data[{index}].model_input.chunks[{c}] must be "
                       "{'type': 'encoded_text', 'tokens': [int, ...]}.", "InvalidDatum")
        tokens.extend(chunk["tokens"])
    check_token_ids(tokens, spec, f"data[{index}].model_input")
    return tokens


def check_token_ids(tokens: list[Any], spec: ModelSpec, where: str) -> None:
    vocab = spec.vocab_size
    for i, tok in enumerate(tokens):
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise _err(f"{where} token {i} is {tok!r}; token ids must be integers.",
                       "InvalidTokenId")
        if tok < 0 or (vocab is not None and tok >= vocab):
            raise _err(f"{where} token {i} is {tok}, outside {spec.name}'s vocabulary "
                       f"[0, {vocab}). Tokenize with the model's own tokenizer.",
                       "InvalidTokenId")


def _tensor(datum: dict, name: str, index: int) -> dict:
    tensor = datum["loss_fn_inputs"][name]
    where = f"data[{index}].loss_fn_inputs.{name}"
    if not isinstance(tensor, dict) or not {"data", "dtype", "shape"} <= set(tensor):
        raise _err(f"{where} must be TensorData {{data, dtype, shape}}.", "InvalidTensor")
    data, dtype, shape = tensor["data"], tensor["dtype"], tensor["shape"]
    if dtype not in _KNOWN_DTYPES:
        raise _err(f"{where}.dtype {dtype!r} is not supported; use one of "
                   f"{choices(_KNOWN_DTYPES)}.", "InvalidTensor")
    if (not isinstance(shape, list) or not shape or len(shape) > 2
            or not all(isinstance(d, int) and d >= 0 for d in shape)):
        raise _err(f"{where}.shape must be [N] or [N, K] with non-negative ints, got {shape!r}.",
                   "ShapeMismatch")
    if not isinstance(data, list) or len(data) != math.prod(shape):
        count = len(data) if isinstance(data, list) else type(data).__name__
        raise _err(f"{where} has {count} values but shape {shape} needs {math.prod(shape)}. "
                   "Send the data flattened in row-major order.", "ShapeMismatch")
    return tensor


def _check_values(tensor: dict, name: str, index: int, spec: ModelSpec) -> None:
    where = f"data[{index}].loss_fn_inputs.{name}"
    data, dtype = tensor["data"], tensor["dtype"]
    if name in _TOKEN_INPUTS:
        if dtype not in _INT_DTYPES:
            raise _err(f"{where} holds token ids, so its dtype must be an integer type "
                       f"(int64), not {dtype!r}.", "DtypeMismatch")
        bad = next((i for i, v in enumerate(data)
                    if not isinstance(v, int) or isinstance(v, bool)
                    or (v != IGNORE_INDEX and (v < 0 or (spec.vocab_size is not None
                                                         and v >= spec.vocab_size)))), None)
        if bad is not None:
            raise _err(f"{where}[{bad}] is {data[bad]!r}: target ids must be in "
                       f"[0, {spec.vocab_size}) or {IGNORE_INDEX} (ignore).", "InvalidTokenId")
        return
    if dtype not in _FLOAT_DTYPES and dtype != "bool" and name != "mask":
        raise _err(f"{where} must be a float tensor (float32), not {dtype!r}.", "DtypeMismatch")
    for i, v in enumerate(data):
        if dtype == "bool":
            ok = isinstance(v, (bool, int))
        else:
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool)
                  and math.isfinite(v))
        if not ok:
            raise _err(f"{where}[{i}] is {v!r}: {name} must be finite numbers (null means NaN "
                       "on the wire). Check the values you computed, e.g. advantages of a "
                       "group whose rewards are all equal divided by a zero std.",
                       "NonFiniteInput")


def validate_forward(body: dict, spec: ModelSpec, max_seq_len: int) -> ForwardRequest:
    loss_fn = body.get("loss_fn", "cross_entropy")
    if loss_fn not in LOSSES:
        raise _err(f"Unknown loss_fn {loss_fn!r}. Available: {choices(LOSSES)}.", "UnknownLoss")
    loss = LOSSES[loss_fn]
    config = body.get("loss_fn_config")
    if config is not None:
        if not isinstance(config, dict):
            raise _err("loss_fn_config must be an object or null.", "InvalidLossConfig")
        unknown = sorted(set(config) - set(loss.config))
        if unknown:
            allowed = choices(loss.config) if loss.config else "none (pass null)"
            raise _err(f"Unknown loss_fn_config key(s) {', '.join(map(repr, unknown))} for "
                       f"{loss_fn}. Accepted keys: {allowed}.", "UnknownLossConfigKey")
        for key, value in config.items():
            default = loss.config[key]
            ok = isinstance(value, bool) if isinstance(default, bool) else (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
            if not ok:
                raise _err(f"loss_fn_config.{key} must be a {type(default).__name__}, got "
                           f"{value!r}.", "InvalidLossConfig")
    top_k = body.get("top_k_logprobs", 0) or 0
    if not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K_LOGPROBS:
        raise _err(f"top_k_logprobs must be an integer in 0..{MAX_TOP_K_LOGPROBS}, got {top_k!r}.",
                   "InvalidRequest")
    data = body.get("data")
    if not isinstance(data, list) or not data:
        raise _err("data must be a non-empty list of Datum objects.", "InvalidDatum")
    if len(data) % loss.rows_per_group:
        raise _err(f"{loss_fn} pairs rows (chosen, rejected), so the datum count must be a "
                   f"multiple of {loss.rows_per_group}; got {len(data)}.", "InvalidDatum")
    total_tokens = 0
    target_rank: int | None = None
    for index, datum in enumerate(data):
        tokens = datum_tokens(datum, index, spec)
        n = len(tokens)
        if n == 0:
            raise _err(f"data[{index}] has no tokens.", "InvalidDatum")
        if n > max_seq_len:
            raise _err(f"data[{index}] is {n} tokens, longer than this run's max_seq_len "
                       f"{max_seq_len}. Truncate or split it, or create the run with a larger "
                       f"max_seq_len (up to {spec.max_seq_len} for {spec.name}).",
                       "SequenceTooLong")
        inputs = datum.get("loss_fn_inputs")
        if not isinstance(inputs, dict):
            raise _err(f"data[{index}].loss_fn_inputs must be an object of TensorData.",
                       "InvalidDatum")
        missing = sorted(loss.required - set(inputs))
        if missing:
            raise _err(f"data[{index}].loss_fn_inputs is missing {', '.join(missing)}, which "
                       f"{loss_fn} needs (it takes {choices(loss.accepted)}).", "MissingLossInput")
        unknown = sorted(set(inputs) - loss.accepted)
        if unknown:
            raise _err(f"data[{index}].loss_fn_inputs has {', '.join(map(repr, unknown))}, which "
                       f"{loss_fn} does not use (it takes {choices(loss.accepted)}).",
                       "UnknownLossInput")
        target = _tensor(datum, "target_tokens", index)
        rank = len(target["shape"])
        if target_rank is None:
            target_rank = rank
        elif rank != target_rank:
            raise _err(f"data[{index}].loss_fn_inputs.target_tokens has rank {rank} but earlier "
                       f"datums have rank {target_rank}; every datum in a request must use the "
                       "same target shape.", "ShapeMismatch")
        for name in inputs:
            tensor = _tensor(datum, name, index)
            if tensor["shape"][0] != n:
                raise _err(f"data[{index}].loss_fn_inputs.{name} has shape {tensor['shape']} but "
                           f"the model input is {n} tokens; per-position inputs need N={n} "
                           "(targets are already shifted: the label at i is token i+1).",
                           "ShapeMismatch")
            if name == "weights" and tensor["shape"] != target["shape"]:
                raise _err(f"data[{index}].loss_fn_inputs.weights has shape {tensor['shape']}, "
                           f"but target_tokens has {target['shape']}; they must match.",
                           "ShapeMismatch")
            _check_values(tensor, name, index, spec)
        total_tokens += n
    return ForwardRequest(data, loss_fn, config, top_k, total_tokens)


def validate_adam(body: dict) -> dict[str, float]:
    params = body.get("adam_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise _err("adam_params must be an object.", "InvalidAdamParams")
    unknown = sorted(set(params) - set(ADAM_DEFAULTS))
    if unknown:
        raise _err(f"Unknown adam_params key(s) {', '.join(map(repr, unknown))}. Accepted: "
                   f"{choices(ADAM_DEFAULTS)}.", "InvalidAdamParams")
    merged = {**ADAM_DEFAULTS, **params}
    for key, value in merged.items():
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value)):
            raise _err(f"adam_params.{key} must be a finite number, got {value!r}.",
                       "InvalidAdamParams")
    checks = [
        (merged["learning_rate"] >= 0, "learning_rate must be >= 0"),
        (0 <= merged["beta1"] < 1, "beta1 must be in [0, 1)"),
        (0 <= merged["beta2"] < 1, "beta2 must be in [0, 1)"),
        (merged["eps"] > 0, "eps must be > 0"),
        (merged["weight_decay"] >= 0, "weight_decay must be >= 0"),
        (merged["grad_clip_norm"] >= 0, "grad_clip_norm must be >= 0 (0 disables clipping)"),
    ]
    for ok, message in checks:
        if not ok:
            raise _err(f"adam_params: {message}.", "InvalidAdamParams")
    return {k: float(v) for k, v in merged.items()}
