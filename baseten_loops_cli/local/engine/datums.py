"""Datum JSON (exactly as on the wire) -> validated tensors for one loss.

The server checks requests when they are submitted too; this is the engine's own line of
defence, so a direct caller (tests, the SDK's local mode) gets the same clear errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from baseten_loops_cli.local.engine.errors import EngineInputError
from baseten_loops_cli.local.engine.losses import IGNORE_INDEX, LossDef

_INT_DTYPES = {"int64": torch.int64, "int32": torch.int32}
_FLOAT_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                 "float16": torch.float16, "bfloat16": torch.bfloat16}
_TOKEN_INPUTS = {"target_tokens"}


@dataclass
class ParsedDatum:
    tokens: list[int]
    inputs: dict[str, torch.Tensor]  # target_tokens int64; everything else float32


def parse_data(data: Any, loss_fn: str, definition: LossDef, vocab_size: int,
               max_seq_len: int) -> list[ParsedDatum]:
    if not isinstance(data, list) or not data:
        raise EngineInputError("data must be a non-empty list of Datum objects.", "InvalidDatum")
    if len(data) % definition.rows_per_group:
        raise EngineInputError(
            f"{loss_fn} takes rows in groups of {definition.rows_per_group} (chosen, rejected); "
            f"got {len(data)} datums.", "InvalidDatum")
    parsed = [_parse_datum(d, i, loss_fn, definition, vocab_size, max_seq_len)
              for i, d in enumerate(data)]
    ranks = {p.inputs["target_tokens"].dim() for p in parsed}
    if len(ranks) > 1:
        raise EngineInputError("Every datum in a request must use the same target_tokens "
                               "rank ((N,) or (N, K)).", "ShapeMismatch")
    return parsed


def model_input_tokens(datum: Any, index: int, vocab_size: int) -> list[int]:
    model_input = datum.get("model_input") if isinstance(datum, dict) else None
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise EngineInputError(f"data[{index}].model_input.chunks must be a list of "
                               "encoded_text chunks.", "InvalidDatum")
    tokens: list[int] = []
    for c, chunk in enumerate(chunks):
        if (not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text"
                or not isinstance(chunk.get("tokens"), list)):
            raise EngineInputError(
                f"data[{index}].model_input.chunks[{c}] must be {{'type': 'encoded_text', "
                "'tokens': [...]}}; the local engine serves text-only models.", "InvalidDatum")
        tokens.extend(chunk["tokens"])
    for i, tok in enumerate(tokens):
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
            raise EngineInputError(f"data[{index}].model_input token {i} is {tok!r}, not an id "
                                   f"in [0, {vocab_size}).", "InvalidTokenId")
    return tokens


def _parse_datum(datum: Any, index: int, loss_fn: str, definition: LossDef, vocab_size: int,
                 max_seq_len: int) -> ParsedDatum:
    tokens = model_input_tokens(datum, index, vocab_size)
    n = len(tokens)
    if n == 0:
        raise EngineInputError(f"data[{index}] has no tokens.", "InvalidDatum")
    if n > max_seq_len:
        raise EngineInputError(f"data[{index}] is {n} tokens long, over the model's limit of "
                               f"{max_seq_len}.", "SequenceTooLong")
    raw_inputs = datum.get("loss_fn_inputs")
    if not isinstance(raw_inputs, dict):
        raise EngineInputError(f"data[{index}].loss_fn_inputs must be an object of TensorData.",
                               "InvalidDatum")
    missing = sorted(definition.required - set(raw_inputs))
    if missing:
        raise EngineInputError(f"data[{index}].loss_fn_inputs lacks {', '.join(missing)}, which "
                               f"{loss_fn} needs.", "MissingLossInput")
    unknown = sorted(set(raw_inputs) - definition.accepted)
    if unknown:
        raise EngineInputError(f"data[{index}].loss_fn_inputs has {', '.join(unknown)}, which "
                               f"{loss_fn} does not take (it takes "
                               f"{', '.join(sorted(definition.accepted))}).", "UnknownLossInput")
    inputs = {name: _tensor(raw_inputs[name], f"data[{index}].loss_fn_inputs.{name}", name,
                            vocab_size) for name in raw_inputs}
    target_shape = inputs["target_tokens"].shape
    if target_shape[0] != n or (len(target_shape) == 2 and not definition.allows_2d_targets):
        allowed = "(N,) or (N, K)" if definition.allows_2d_targets else "(N,)"
        raise EngineInputError(f"data[{index}].loss_fn_inputs.target_tokens has shape "
                               f"{list(target_shape)}; {loss_fn} needs {allowed} with N={n}, "
                               "the model input length.", "ShapeMismatch")
    for name, tensor in inputs.items():
        expected = target_shape if name == "weights" else (n,)
        if name != "target_tokens" and tensor.shape != expected:
            raise EngineInputError(f"data[{index}].loss_fn_inputs.{name} has shape "
                                   f"{list(tensor.shape)}, expected {list(expected)}.",
                                   "ShapeMismatch")
    return ParsedDatum(tokens, inputs)


def _tensor(raw: Any, where: str, name: str, vocab_size: int) -> torch.Tensor:
    if not isinstance(raw, dict) or not {"data", "dtype", "shape"} <= set(raw):
        raise EngineInputError(f"{where} must be TensorData {{data, dtype, shape}}.",
                               "InvalidDatum")
    data, dtype, shape = raw["data"], raw["dtype"], raw["shape"]
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 2
            or not all(isinstance(d, int) and d >= 0 for d in shape)):
        raise EngineInputError(f"{where}.shape must be [N] or [N, K], got {shape!r}.",
                               "ShapeMismatch")
    if not isinstance(data, list) or len(data) != math.prod(shape):
        raise EngineInputError(f"{where} has {len(data) if isinstance(data, list) else 'no'} "
                               f"values but shape {shape}.", "ShapeMismatch")
    if name in _TOKEN_INPUTS:
        if dtype not in _INT_DTYPES:
            raise EngineInputError(f"{where} holds token ids: its dtype must be int64, not "
                                   f"{dtype!r}.", "DtypeMismatch")
        bad = next((i for i, v in enumerate(data) if not isinstance(v, int)
                    or isinstance(v, bool) or (v != IGNORE_INDEX and not 0 <= v < vocab_size)),
                   None)
        if bad is not None:
            raise EngineInputError(f"{where}[{bad}] is {data[bad]!r}: targets must be ids in "
                                   f"[0, {vocab_size}) or {IGNORE_INDEX}.", "InvalidTokenId")
        return torch.tensor(data, dtype=torch.int64).reshape(shape)
    if dtype not in _FLOAT_DTYPES:
        raise EngineInputError(f"{where} must be a float tensor (float32), not {dtype!r}.",
                               "DtypeMismatch")
    # JSON null is NaN on the wire; any non-finite value would poison the weights.
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in data):
        raise EngineInputError(f"{where} contains NaN, infinite or non-numeric values (null is "
                               "NaN on the wire).", "NaNInput")
    return torch.tensor(data, dtype=torch.float32).reshape(shape)
