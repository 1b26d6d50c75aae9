"""Checks a request at submit time, before it is queued.

Bad input is refused with a 400 naming the datum, the field and the fix *when the op is
submitted*, not minutes later when it reaches the model, and never as a silent NaN in
the weights. (A user report that shaped this: a request with an unsupported
``loss_fn_config`` key was retried 50 times against 500s; here it is one clear 400.)

Datums and losses are checked by the engine's own parser (``Engine.parse_forward``), so
the server and the engine can never disagree about what is valid, and what it parsed is what
the trainer runs (a datum is parsed once); this module adds what
only the server knows (the run's ``max_seq_len``) and checks the parts of requests the
engine takes on trust (Adam hyperparameters, sampling prompts).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, cast

from baseten_loops_cli.local.server.compute import Engine, ModelSpec
from baseten_loops_cli.local.server.errors import bad_request, choices

MAX_TOP_K_LOGPROBS = 20
ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                 "weight_decay": 0.0, "grad_clip_norm": 1.0}
# When a model's vocabulary size is unknown before it loads, the engine checks ids later.
_UNKNOWN_VOCAB = 2**31


@dataclass(frozen=True)
class ForwardRequest:
    data: list[dict]
    loss_fn: str
    loss_fn_config: dict[str, Any] | None
    top_k_logprobs: int
    token_count: int
    # The engine's parsed datums, for the trainer to run as they are; None when the model's
    # vocabulary was unknown here (the trainer then parses again, checking the ids).
    parsed: list[Any] | None


async def validate_forward(engine: Engine, body: dict, spec: ModelSpec,
                           max_seq_len: int) -> ForwardRequest:
    """A forward/forward_backward body, checked; 400 with the engine's words otherwise."""
    loss_fn = body.get("loss_fn") or "cross_entropy"
    config = body.get("loss_fn_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("loss_fn_config must be an object or null.", "InvalidLossConfig")
    top_k = body.get("top_k_logprobs") or 0
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not (
            0 <= top_k <= MAX_TOP_K_LOGPROBS):
        raise bad_request(f"top_k_logprobs must be an integer in 0..{MAX_TOP_K_LOGPROBS}, got "
                          f"{top_k!r}.", "InvalidRequest")
    data = body.get("data")
    try:
        # Parsing builds tensors: off the event loop, so a large batch cannot stall it.
        parsed = await asyncio.to_thread(
            engine.parse_forward, data, loss_fn, config, spec.vocab_size or _UNKNOWN_VOCAB,
            max_seq_len)
    except Exception as exc:
        if not engine.is_input_error(exc):
            raise
        message = str(exc)
        error_class = getattr(exc, "error_class", "InvalidInput")
        if error_class == "SequenceTooLong" and max_seq_len < spec.max_seq_len:
            message += (f" (This run's max_seq_len is {max_seq_len}; {spec.name} supports up to "
                        f"{spec.max_seq_len}: create the run with a larger max_seq_len, or "
                        "truncate.)")
        raise bad_request(message, error_class) from None
    tokens = sum(len(p.tokens) for p in parsed)
    # parse_forward refused anything but a non-empty list of datum objects (dicts).
    return ForwardRequest(cast(list[dict], data), loss_fn, config, top_k, tokens, parsed if spec.vocab_size else None)


def check_token_ids(tokens: list[Any], spec: ModelSpec, where: str) -> None:
    vocab = spec.vocab_size
    for i, tok in enumerate(tokens):
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise bad_request(f"{where} token {i} is {tok!r}; token ids must be integers.",
                              "InvalidTokenId")
        if tok < 0 or (vocab is not None and tok >= vocab):
            raise bad_request(f"{where} token {i} is {tok}, outside {spec.name}'s vocabulary "
                              f"[0, {vocab}). Tokenize with the model's own tokenizer.",
                              "InvalidTokenId")


def validate_adam(body: dict) -> dict[str, float]:
    params = body.get("adam_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad_request("adam_params must be an object.", "InvalidAdamParams")
    unknown = sorted(set(params) - set(ADAM_DEFAULTS))
    if unknown:
        raise bad_request(f"Unknown adam_params key(s) {', '.join(map(repr, unknown))}. "
                          f"Accepted: {choices(ADAM_DEFAULTS)}.", "InvalidAdamParams")
    merged = {**ADAM_DEFAULTS, **params}
    for key, value in merged.items():
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value)):
            raise bad_request(f"adam_params.{key} must be a finite number, got {value!r}.",
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
            raise bad_request(f"adam_params: {message}.", "InvalidAdamParams")
    return {k: float(v) for k, v in merged.items()}
