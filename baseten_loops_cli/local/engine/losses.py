"""The built-in losses of ``forward_backward``, computed from target-token logprobs.

Notation, per datum of N positions: ``lp`` = the trained policy's logprob of
``target_tokens[i]`` at position i (no internal shift: the caller already shifted, so the
label at i is the next token), ``old_lp`` = the behaviour policy's logprob (``logprobs``
input), ``A`` = ``advantages``, ``r = exp(lp - old_lp)``, and ``m`` = the per-position
multiplier ``mask * weights`` (each optional, default 1) on positions whose target is not
``-100``. Every loss is a **sum over positions and datums** (as in Tinker) and reports it
as ``metrics["loss:sum"]``:

- ``cross_entropy``: ``sum(-w * lp)``; ``target_tokens`` may be (N,) or (N, K), with
  ``weights`` of the same shape (default 1). Config: ``skip_token_normalization`` (see
  below).
- ``importance_sampling``: ``-sum(m * r * A)``
- ``ppo``: ``-sum(m * min(r * A, clip(r, lo, hi) * A))``, config ``clip_low_threshold``
  (lo, default 0.8) and ``clip_high_threshold`` (hi, default 1.2)
- ``cispo``: ``-sum(m * sg(clip(r, lo, hi)) * lp * A)`` (sg = stop-gradient), same config
- ``dro``: ``-sum(m * (lp * A - beta/2 * (lp - old_lp)^2))``, config ``beta`` (0.05)
- ``dpo``: rows come in (chosen, rejected) pairs with ``ref_logprobs``; per pair
  ``z = beta * ((sum w*lp_c - sum w*ref_c) - (sum w*lp_r - sum w*ref_r))`` and loss
  ``-(1 - eps) * logsigmoid(z) - eps * logsigmoid(-z)``, config ``beta`` (0.1) and
  ``label_smoothing`` (eps, 0.0). Metrics, means over pairs: ``dpo_loss``,
  ``dpo_reward_margin`` (z), ``dpo_preference_accuracy`` (z > 0; a log-ratio gap within
  ``DPO_TIE_NATS`` counts half), ``dpo_chosen_reward`` / ``dpo_rejected_reward``
  (``beta * sum w * (lp - ref)``)

Token normalization: by default the trainer divides the ``cross_entropy`` gradient by the
number of trained positions (nonzero weight) accumulated since the last ``optim_step``, so
split ``forward_backward`` calls equal one big call. ``skip_token_normalization: true``
keeps the plain sum (the SDK's custom-loss path relies on it: there the weights are
``-dC/dlogprobs``). The RL losses and DPO are never normalized (Tinker semantics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from baseten_loops_cli.local.engine.errors import EngineInputError

IGNORE_INDEX = -100
DPO_TIE_NATS = 1e-3
_CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@dataclass
class DatumLossInput:
    """One datum as a loss sees it."""

    target_logprobs: torch.Tensor  # (N,) or (N, K) float32, 0 where the target is ignored
    valid: torch.Tensor  # bool, same shape: target != -100
    inputs: dict[str, torch.Tensor]  # the datum's loss_fn_inputs as tensors


@dataclass
class LossResult:
    total: torch.Tensor  # scalar sum; backward() on it gives the (unnormalized) gradient
    elementwise: list[torch.Tensor]  # per datum, each position's contribution (N,)
    trained_tokens: int  # positions that carry loss (the normalization count)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LossDef:
    required: frozenset[str]
    optional: frozenset[str]
    config: dict[str, Any]  # key -> default
    token_normalized: Callable[[dict[str, Any]], bool] = lambda config: False
    rows_per_group: int = 1
    allows_2d_targets: bool = False

    @property
    def accepted(self) -> frozenset[str]:
        return self.required | self.optional


_RL = frozenset({"target_tokens", "logprobs", "advantages"})
_RL_OPTIONAL = frozenset({"mask", "weights"})

LOSSES: dict[str, LossDef] = {
    "cross_entropy": LossDef(frozenset({"target_tokens"}), frozenset({"weights"}),
                             {"skip_token_normalization": False},
                             token_normalized=lambda c: not c["skip_token_normalization"],
                             allows_2d_targets=True),
    "importance_sampling": LossDef(_RL, _RL_OPTIONAL, {}),
    "ppo": LossDef(_RL, _RL_OPTIONAL, dict(_CLIP_DEFAULTS)),
    "cispo": LossDef(_RL, _RL_OPTIONAL, dict(_CLIP_DEFAULTS)),
    "dro": LossDef(_RL, _RL_OPTIONAL, {"beta": 0.05}),
    "dpo": LossDef(frozenset({"target_tokens", "ref_logprobs"}), frozenset({"weights"}),
                   {"beta": 0.1, "label_smoothing": 0.0}, rows_per_group=2),
}


def loss_def(loss_fn: str) -> LossDef:
    definition = LOSSES.get(loss_fn)
    if definition is None:
        raise EngineInputError(f"Unknown loss_fn {loss_fn!r}. The local engine supports: "
                               f"{', '.join(LOSSES)}.", "UnknownLoss")
    return definition


def resolve_config(loss_fn: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` merged over the loss's defaults; unknown keys and bad values are errors."""
    definition = loss_def(loss_fn)
    config = dict(config or {})
    unknown = sorted(set(config) - set(definition.config))
    if unknown:
        accepted = ", ".join(definition.config) or "none"
        raise EngineInputError(f"Unknown loss_fn_config key(s) {', '.join(unknown)} for "
                               f"{loss_fn} (accepted: {accepted}).", "UnknownLossConfigKey")
    merged = {**definition.config, **config}
    for key, value in merged.items():
        default = definition.config[key]
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        else:
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value))
        if not ok:
            raise EngineInputError(f"loss_fn_config.{key} must be a {type(default).__name__}, "
                                   f"got {value!r}.", "InvalidLossConfig")
    if "clip_low_threshold" in merged and not (
            0 <= merged["clip_low_threshold"] <= merged["clip_high_threshold"]):
        raise EngineInputError("loss_fn_config needs 0 <= clip_low_threshold <= "
                               "clip_high_threshold.", "InvalidLossConfig")
    return merged


def compute(loss_fn: str, data: list[DatumLossInput], config: dict[str, Any]) -> LossResult:
    """The loss of a batch; ``config`` must come from :func:`resolve_config`."""
    if loss_fn == "dpo":
        return _dpo(data, config)
    per_token = _PER_TOKEN[loss_fn]
    elementwise: list[torch.Tensor] = []
    trained = 0
    for datum in data:
        multiplier = _multiplier(datum)
        contribution = per_token(datum, config) * multiplier
        trained += int((multiplier != 0).reshape(multiplier.shape[0], -1).any(-1).sum())
        # (N, K) cross-entropy targets reduce to one value per position.
        elementwise.append(contribution.reshape(contribution.shape[0], -1).sum(-1))
    total = torch.stack([e.sum() for e in elementwise]).sum()
    return LossResult(total, elementwise, trained, {"loss:sum": float(total.detach())})


def _multiplier(datum: DatumLossInput) -> torch.Tensor:
    """``mask * weights`` on valid positions, 0 elsewhere."""
    multiplier = datum.valid.to(torch.float32)
    for name in ("mask", "weights"):
        if name in datum.inputs:
            multiplier = multiplier * datum.inputs[name]
    return multiplier


def _cross_entropy(datum: DatumLossInput, config: dict[str, Any]) -> torch.Tensor:
    return -datum.target_logprobs


def _ratio(datum: DatumLossInput) -> torch.Tensor:
    # Ignored positions have lp = 0 and an arbitrary old_lp; zero the exponent there so a
    # huge ratio cannot produce inf * 0 = NaN.
    log_ratio = (datum.target_logprobs - datum.inputs["logprobs"]) * datum.valid
    return torch.exp(log_ratio)


def _importance_sampling(datum: DatumLossInput, config: dict[str, Any]) -> torch.Tensor:
    return -_ratio(datum) * datum.inputs["advantages"]


def _ppo(datum: DatumLossInput, config: dict[str, Any]) -> torch.Tensor:
    ratio = _ratio(datum)
    advantages = datum.inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _cispo(datum: DatumLossInput, config: dict[str, Any]) -> torch.Tensor:
    clipped = _ratio(datum).clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -clipped.detach() * datum.target_logprobs * datum.inputs["advantages"]


def _dro(datum: DatumLossInput, config: dict[str, Any]) -> torch.Tensor:
    lp = datum.target_logprobs
    quadratic = ((lp - datum.inputs["logprobs"]) * datum.valid) ** 2
    return -(lp * datum.inputs["advantages"] - 0.5 * config["beta"] * quadratic)


_PER_TOKEN: dict[str, Callable[[DatumLossInput, dict[str, Any]], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
}


def _dpo(data: list[DatumLossInput], config: dict[str, Any]) -> LossResult:
    beta, smoothing = config["beta"], config["label_smoothing"]
    sequence_margins = []  # per row: sum w * (lp - ref_lp)
    trained = 0
    for datum in data:
        multiplier = _multiplier(datum)
        trained += int((multiplier != 0).sum())
        sequence_margins.append(
            (multiplier * (datum.target_logprobs - datum.inputs["ref_logprobs"])).sum())
    margins = torch.stack(sequence_margins)
    z = beta * (margins[0::2] - margins[1::2])  # chosen rows are even, rejected odd
    pair_losses = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
    total = pair_losses.sum()
    # A pair's loss is not a sum over positions; report it on the chosen row's last
    # position so that each datum's elementwise_loss still sums to its share.
    elementwise = [torch.zeros_like(d.target_logprobs) for d in data]
    for pair, loss in enumerate(pair_losses.detach()):
        elementwise[2 * pair][-1] = loss
    z = z.detach()
    gap = margins.detach()[0::2] - margins.detach()[1::2]  # the log-ratio difference, in nats
    # A pair the policy ranks within DPO_TIE_NATS of the reference is a tie and counts half,
    # so an untrained policy scores 0.5 whatever the float noise (training/kinds/dpo.py agrees).
    wins = (gap > DPO_TIE_NATS).float() + 0.5 * (gap.abs() <= DPO_TIE_NATS).float()
    metrics = {"loss:sum": float(total.detach()),
               "dpo_loss": float(pair_losses.detach().mean()),
               "dpo_reward_margin": float(z.mean()),
               "dpo_preference_accuracy": float(wins.mean()),
               "dpo_chosen_reward": float(beta * margins.detach()[0::2].mean()),
               "dpo_rejected_reward": float(beta * margins.detach()[1::2].mean())}
    return LossResult(total, elementwise, trained, metrics)
