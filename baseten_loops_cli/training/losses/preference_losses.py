"""The preference losses (DPO, IPO, SimPO, ORPO and KTO) in closed form, for the custom-loss path.

Pure Python (no torch, no numpy: the CLI core has neither). Each loss depends on a token's
logprob only through its sequence's summed logprob ``S = sum_t w_t * lp_t`` (``w_t`` the datum's
weight: 1 on the reply, 0 elsewhere) or its mean ``S / n`` with ``n = sum_t w_t``, so
``dL/dlp_t = w_t * dL/dS`` and the client needs no autograd. This module returns, per sequence,
``dL/dS``; :func:`token_weights` turns it into the ``cross_entropy`` weights ``-dL/dlp_t``.

On the wire it is the official SDK's ``TrainingClient.forward_backward_custom``, step for step:

1. ``/forward`` with ``cross_entropy`` and ``loss_fn_config={"skip_token_normalization": True}``
   on datums carrying only ``target_tokens`` and ``weights`` (the SDK keeps a datum's own weights
   in this pass; they only change the reported loss), and the server must echo
   ``metrics.skip_token_normalization == 1.0`` (:func:`check_unnormalized`);
2. the loss on the returned logprobs (``null`` = masked, read as 0 as the SDK's ``nan_to_num``);
3. ``/forward_backward`` with ``cross_entropy``, the same config and ``weights = -dL/dlogprob``.

The server's unnormalized ``cross_entropy`` is ``sum(-w * lp)``, so step 3 back-propagates
exactly ``sum_i dL/dS_i * S_i``: the gradient of ``L``. :func:`forward_datum`,
:func:`backward_datum` and :func:`submit_custom_loss` build those requests. The reference
logprobs (DPO, IPO, KTO) never travel in these datums: the SDK's custom-loss datums forbid any
other input, so the client sums them itself (:func:`score_sequence`).

The objective is the **sum** over pairs (KTO: over examples), as the protocol's own ``dpo`` loss
is (Tinker semantics: every loss sums over datums), so ``loss: dpo`` on the server and
``loss: ipo`` here scale the same way with the batch size; ``LossResult.loss`` (the metric) is
the **mean**, as TRL reports it. Formulas, per pair (chosen ``w``, rejected ``l``), with
``r = S - S_ref`` and ``A = S / n``:

- ``dpo`` (Rafailov et al. 2023; cDPO smoothing as TRL's ``sigmoid`` loss and the protocol's
  ``dpo``): ``z = beta * (r_w - r_l)``, ``L = -(1 - eps) logsig(z) - eps logsig(-z)``.
- ``ipo`` (Azar et al. 2023): ``L = (r_w / n_w - r_l / n_l - 1 / (2 beta))^2``. The paper writes
  the summed log-ratios; TRL's ``DPOTrainer`` (``loss_type="ipo"``) averages them per token,
  confirmed with the authors, so that beta means the same whatever the reply lengths. We follow
  TRL.
- ``simpo`` (Meng et al. 2024), reference-free: ``L = -logsig(beta * (A_w - A_l) - gamma)``,
  the paper's loss and TRL's ``CPOTrainer(loss_type="simpo")`` with ``cpo_alpha=0`` (TRL's
  default ``cpo_alpha=1`` adds a behaviour-cloning NLL term that SimPO does not have).
  Defaults are the paper's (beta 2.0, gamma 1.0: gamma/beta = 0.5), not TRL's (0.1, 0.5).
- ``orpo`` (Hong et al. 2024), reference-free: ``L = -A_w + lambda * -logsig(lo(A_w) - lo(A_l))``
  with ``lo(A) = A - log(1 - exp(A))`` the log-odds of ``p = exp(A)``. The NLL term is the
  chosen reply's mean token NLL, per pair: the paper's ``L_SFT``. TRL's ``ORPOTrainer`` takes
  its NLL over the prompt too (and averages over every chosen token of the batch); here the
  prompt is never trained, as in every kind of this CLI. TRL calls lambda ``beta``. A mean
  logprob above ``-ORPO_MIN_GAP`` (a reply the model is certain of, where the log-odds are
  infinite) is read as ``-ORPO_MIN_GAP``.
- ``kto`` (Ethayarajh et al. 2024), unpaired: per example ``r = S - S_ref``; desirable
  ``L = lambda_D * (1 - sig(beta * (r - z0)))``, undesirable
  ``L = lambda_U * (1 - sig(beta * (z0 - r)))``. ``z0`` is TRL's KL estimate: the batch mean of
  ``S - S_ref`` over mismatched sequences (each example's prompt with another example's
  completion, :func:`kto_mismatched_index`), clamped at 0, and no gradient flows through it
  (as in the paper and TRL). TRL's ``KTOTrainer`` averages the loss over the batch's examples;
  so does ``LossResult.loss``.

Metrics, means over the batch (as ``training/kinds/dpo.py`` logs DPO): ``loss``, ``chosen_reward`` /
``rejected_reward``, ``reward_margin`` (always ``chosen_reward - rejected_reward``) and
``preference_accuracy`` (chosen ahead of rejected; a gap within ``TIE_NATS`` counts half, so an
untrained DPO/IPO policy scores exactly 0.5). The rewards are TRL's: ``beta * r`` for dpo and ipo
(summed, whichever the loss uses), ``beta * A`` for simpo, the mean logprob ``A`` for orpo (TRL
scales it by its beta, our lambda; unscaled it stays meaningful at ``lambda: 0``). ORPO adds
``nll_loss`` and ``log_odds_ratio`` (the mean of ``lo(A_w) - lo(A_l)``). KTO logs ``loss``,
``kl_estimate`` (z0), ``desirable_reward`` / ``undesirable_reward`` (``beta * r``, means over
each label present) and ``reward_margin`` (their difference, when both labels are present).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from baseten_loops_cli.errors import LoopsError

PAIRED_LOSSES = ("dpo", "ipo", "simpo", "orpo")
UNPAIRED_LOSSES = ("kto",)
LOSSES = PAIRED_LOSSES + UNPAIRED_LOSSES
# Losses that compare the policy with a reference policy (the others skip the reference pass).
NEEDS_REFERENCE = frozenset({"dpo", "ipo", "kto"})
# Losses that run on the protocol's own loss rather than the custom-loss path.
PROTOCOL_LOSS = {"dpo": "dpo"}

# A pair whose gap is within this many nats is a tie and counts half (training/kinds/dpo.py's
# TIE_NATS and local/engine/losses.py's DPO_TIE_NATS: the same rule, checked by a test).
TIE_NATS = 1e-3
# ORPO's log-odds are infinite at mean logprob 0; a mean above -ORPO_MIN_GAP is read as this.
ORPO_MIN_GAP = 1e-6

CUSTOM_LOSS_FN = "cross_entropy"
CUSTOM_LOSS_CONFIG = {"skip_token_normalization": True}

__all__ = [
    "CUSTOM_LOSS_CONFIG", "CUSTOM_LOSS_FN", "LOSSES", "NEEDS_REFERENCE", "PAIRED_LOSSES", "PARAMETERS",
    "PROTOCOL_LOSS", "TIE_NATS", "UNPAIRED_LOSSES", "LossResult", "Param", "ParamProblem",
    "PreferenceParamError", "SequenceScore", "backward_datum", "check_unnormalized", "forward_datum",
    "kto_loss", "kto_mismatched_index", "kto_weight_advice", "paired_loss", "param_problems",
    "params_for", "resolve_params", "score_sequence", "scores_from_forward", "submit_custom_loss",
    "token_weights",
]  # fmt: skip


# ------------------------------------------------------------------ parameters
@dataclass(frozen=True)
class Param:
    """One loss parameter: the losses that take it (with each one's default) and its bounds."""

    name: str
    defaults: Mapping[str, float]  # loss -> default; the keys are the losses that take it
    low: float | None = None
    low_inclusive: bool = True
    high: float | None = None
    high_inclusive: bool = True
    doc: str = ""

    @property
    def losses(self) -> tuple[str, ...]:
        return tuple(self.defaults)

    def bounds_text(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>=' if self.low_inclusive else '>'} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<=' if self.high_inclusive else '<'} {self.high:g}")
        return " and ".join(parts) or "any number"

    def in_bounds(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (value == self.low and not self.low_inclusive)):
            return False
        if self.high is not None and (value > self.high or (value == self.high and not self.high_inclusive)):
            return False
        return True


PARAMETERS: dict[str, Param] = {
    p.name: p
    for p in (
        Param("beta", {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "kto": 0.1}, low=0.0, low_inclusive=False,
              doc="dpo, kto: how far the policy may move from the reference; ipo: the target log-ratio "
                  "gap is 1/(2*beta); simpo: the reward scale (the paper uses 2.0-2.5)."),
        Param("label_smoothing", {"dpo": 0.0}, low=0.0, high=0.5, high_inclusive=False,
              doc="Assumed fraction of flipped labels (conservative DPO)."),
        Param("gamma", {"simpo": 1.0}, low=0.0,
              doc="SimPO's target reward margin (the paper: gamma/beta about 0.5)."),
        Param("lambda", {"orpo": 0.1}, low=0.0,
              doc="ORPO's weight on the odds-ratio term (TRL calls it beta); 0 is plain SFT."),
        Param("desirable_weight", {"kto": 1.0}, low=0.0, low_inclusive=False,
              doc="KTO's lambda_D: the weight of desirable (label true) examples."),
        Param("undesirable_weight", {"kto": 1.0}, low=0.0, low_inclusive=False,
              doc="KTO's lambda_U: the weight of undesirable (label false) examples."),
    )
}  # fmt: skip


def params_for(loss: str) -> dict[str, float]:
    """The parameters ``loss`` takes, with its defaults."""
    _check_loss(loss)
    return {name: p.defaults[loss] for name, p in PARAMETERS.items() if loss in p.defaults}


@dataclass(frozen=True)
class ParamProblem:
    """One bad parameter: ``key`` is the config key (for file:line), ``message`` names it."""

    key: str
    message: str
    fix: str | None = None


class PreferenceParamError(ValueError):
    """:func:`resolve_params` found problems (``.problems``); the message is the first one's."""

    def __init__(self, problems: list[ParamProblem]):
        super().__init__(problems[0].message)
        self.problems = problems


def _check_loss(loss: str) -> None:
    if loss not in LOSSES:
        raise PreferenceParamError([_unknown_loss(loss)])


def _unknown_loss(loss: Any) -> ParamProblem:
    return ParamProblem("loss", f"loss: unknown loss {loss!r} (one of {', '.join(PAIRED_LOSSES)}; "
                                f"unpaired rows: kind kto)", f"Set loss to one of {', '.join(PAIRED_LOSSES)}.")


def param_problems(loss: str, given: Mapping[str, Any], *, known: Iterable[str] = ()) -> list[ParamProblem]:
    """Everything wrong with ``given`` (a config's loss parameters) for ``loss``: an unknown loss,
    a parameter that belongs to another loss, an unknown key, a value that is not a number or is
    out of bounds. Keys in ``known`` (the config's other keys) are not this function's business."""
    if loss not in LOSSES:
        return [_unknown_loss(loss)]
    skip = set(known)
    problems = []
    for key, value in given.items():
        if key in skip:
            continue
        param = PARAMETERS.get(key)
        if param is None:
            takes = ", ".join(params_for(loss)) or "none"
            problems.append(ParamProblem(key, f"{key}: not a parameter of loss {loss} (it takes {takes})", "Remove it."))
            continue
        if loss not in param.defaults:
            owners = ("losses " + ", ".join(param.losses[:-1]) + f" and {param.losses[-1]}"
                      if len(param.losses) > 1 else f"loss {param.losses[0]}")
            hint = f"Remove it: {loss} takes {', '.join(params_for(loss))}."
            if key == "beta" and loss == "orpo":
                hint = "ORPO's weight on the odds-ratio term is `lambda` (TRL calls it beta)."
            problems.append(ParamProblem(key, f"{key} belongs to {owners}, not to {loss}", hint))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(ParamProblem(key, f"{key}: must be a number, got {value!r}", f"Set {key} to {param.bounds_text()}."))
            continue
        if not param.in_bounds(float(value)):
            problems.append(ParamProblem(key, f"{key}: must be {param.bounds_text()}, got {value!r}",
                                         f"Set {key} to {param.bounds_text()} (default {param.defaults[loss]:g})."))
    return problems


def resolve_params(loss: str, given: Mapping[str, Any] | None = None) -> dict[str, float]:
    """``given`` over ``loss``'s defaults, as floats; :class:`PreferenceParamError` if anything
    is wrong (see :func:`param_problems`)."""
    given = dict(given or {})
    problems = param_problems(loss, given)
    if problems:
        raise PreferenceParamError(problems)
    return {**params_for(loss), **{k: float(v) for k, v in given.items()}}


def kto_weight_advice(n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's (and the KTO paper's) advice: ``lambda_D * n_D / (lambda_U * n_U)`` should lie in
    [1, 4/3]. A warning to print, or None when the weights are within it."""
    if not n_desirable or not n_undesirable:
        return None
    ratio = desirable_weight * n_desirable / (undesirable_weight * n_undesirable)
    if 1.0 <= ratio <= 4 / 3:
        return None
    low = n_undesirable * undesirable_weight / n_desirable
    return (f"KTO: desirable_weight * {n_desirable} desirable / (undesirable_weight * {n_undesirable} undesirable) "
            f"is {ratio:.2f}; the KTO paper advises 1 to 1.33 (e.g. desirable_weight {low:.2f} to {low * 4 / 3:.2f}).")


# ------------------------------------------------------------------ scores and results
@dataclass(frozen=True)
class SequenceScore:
    """One sequence's scores over its trained positions (weight ``w_t != 0``)."""

    logprob: float  # S = sum_t w_t * lp_t: the policy's summed logprob
    tokens: float  # n = sum_t w_t: the denominator of the mean logprob
    ref_logprob: float | None = None  # sum_t w_t * ref_t, where the loss has a reference

    @property
    def mean_logprob(self) -> float:
        return self.logprob / self.tokens

    @property
    def log_ratio(self) -> float:
        if self.ref_logprob is None:
            raise ValueError("this loss needs the reference's logprobs and the sequence has none")
        return self.logprob - self.ref_logprob


@dataclass
class LossResult:
    """A batch's loss: ``loss`` the mean (the metric), ``loss_sum`` the objective whose gradient
    ``grads`` holds (``dL/dS`` per sequence, in input order), and the metrics."""

    loss: float
    loss_sum: float
    grads: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


def score_sequence(token_logprobs: Sequence[float | None], weights: Sequence[float],
                   ref_logprobs: Sequence[float] | None = None) -> SequenceScore:
    """A datum's :class:`SequenceScore` from per-position logprobs (``None`` = masked, skipped
    where the weight is 0), its ``weights`` and, where the loss has one, the reference's
    per-position logprobs (the ``ref_logprobs`` layout of ``training.data.datums.dpo_datum``)."""
    if len(token_logprobs) != len(weights) or (ref_logprobs is not None and len(ref_logprobs) != len(weights)):
        raise ValueError(f"{len(token_logprobs)} logprobs for {len(weights)} weights"
                         + (f" and {len(ref_logprobs)} reference logprobs" if ref_logprobs is not None else ""))
    total = count = ref = 0.0
    for i, w in enumerate(weights):
        if not w:
            continue
        lp = token_logprobs[i]
        if lp is None or (isinstance(lp, float) and math.isnan(lp)):
            raise ValueError(f"position {i} has weight {w} but no logprob")
        total += w * lp
        count += w
        if ref_logprobs is not None:
            ref += w * ref_logprobs[i]
    if count <= 0:
        raise ValueError("a sequence with nothing to train on (every weight is 0)")
    return SequenceScore(total, count, ref if ref_logprobs is not None else None)


def _logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _log1mexp(a: float) -> float:
    """log(1 - exp(a)) for a < 0, branching at -ln 2 against cancellation (as TRL does)."""
    return math.log1p(-math.exp(a)) if a < -math.log(2) else math.log(-math.expm1(a))


def _win(gap: float) -> float:
    return 1.0 if gap > TIE_NATS else 0.5 if abs(gap) <= TIE_NATS else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# ------------------------------------------------------------------ paired losses
def paired_loss(loss: str, sequences: Sequence[SequenceScore], params: Mapping[str, Any] | None = None) -> LossResult:
    """The ``loss`` of interleaved pairs (chosen at even indices, rejected at odd: the layout of
    ``training.kinds.dpo.pair_datums`` and of the protocol's ``dpo`` loss). ``grads[i]`` is
    ``dL/dS`` of ``sequences[i]``, ``L`` the sum over pairs."""
    if loss not in PAIRED_LOSSES:
        raise ValueError(f"{loss!r} is not a paired loss (one of {', '.join(PAIRED_LOSSES)})")
    p = resolve_params(loss, params)
    if len(sequences) % 2 or not sequences:
        raise ValueError(f"paired losses take (chosen, rejected) pairs: got {len(sequences)} sequences")
    grads = [0.0] * len(sequences)
    losses, chosen_rewards, rejected_rewards, wins = [], [], [], []
    extra: dict[str, list[float]] = {}
    beta = p.get("beta", 0.0)
    for k in range(0, len(sequences), 2):
        c, r = sequences[k], sequences[k + 1]
        if loss == "dpo":
            eps = p["label_smoothing"]
            z = beta * (c.log_ratio - r.log_ratio)
            losses.append(-(1 - eps) * _logsigmoid(z) - eps * _logsigmoid(-z))
            dz = -(1 - eps) * _sigmoid(-z) + eps * _sigmoid(z)
            grads[k], grads[k + 1] = beta * dz, -beta * dz
            chosen_rewards.append(beta * c.log_ratio)
            rejected_rewards.append(beta * r.log_ratio)
            wins.append(_win(c.log_ratio - r.log_ratio))
        elif loss == "ipo":
            h = c.log_ratio / c.tokens - r.log_ratio / r.tokens - 1 / (2 * beta)
            losses.append(h * h)
            grads[k], grads[k + 1] = 2 * h / c.tokens, -2 * h / r.tokens
            chosen_rewards.append(beta * c.log_ratio)
            rejected_rewards.append(beta * r.log_ratio)
            wins.append(_win(c.log_ratio - r.log_ratio))
        elif loss == "simpo":
            z = beta * (c.mean_logprob - r.mean_logprob) - p["gamma"]
            losses.append(-_logsigmoid(z))
            dz = -_sigmoid(-z)
            grads[k], grads[k + 1] = beta * dz / c.tokens, -beta * dz / r.tokens
            chosen_rewards.append(beta * c.mean_logprob)
            rejected_rewards.append(beta * r.mean_logprob)
            wins.append(_win(c.mean_logprob - r.mean_logprob))
        else:  # orpo
            lam = p["lambda"]
            a_c = min(c.mean_logprob, -ORPO_MIN_GAP)
            a_r = min(r.mean_logprob, -ORPO_MIN_GAP)
            delta = (a_c - _log1mexp(a_c)) - (a_r - _log1mexp(a_r))
            nll = -c.mean_logprob
            odds_term = -_logsigmoid(delta)
            losses.append(nll + lam * odds_term)
            d_delta = -lam * _sigmoid(-delta)  # dL/d(delta)
            # d lo(a)/da = 1 / (1 - exp(a)) = -1 / expm1(a)
            grads[k] = (-1.0 + d_delta * (-1.0 / math.expm1(a_c))) / c.tokens
            grads[k + 1] = (-d_delta * (-1.0 / math.expm1(a_r))) / r.tokens
            chosen_rewards.append(c.mean_logprob)
            rejected_rewards.append(r.mean_logprob)
            wins.append(_win(c.mean_logprob - r.mean_logprob))
            extra.setdefault("nll_loss", []).append(nll)
            extra.setdefault("log_odds_ratio", []).append(delta)
    chosen, rejected = _mean(chosen_rewards), _mean(rejected_rewards)
    metrics = {"loss": _mean(losses), "reward_margin": chosen - rejected, "preference_accuracy": _mean(wins),
               "chosen_reward": chosen, "rejected_reward": rejected}
    metrics.update({key: _mean(values) for key, values in extra.items()})
    return LossResult(metrics["loss"], sum(losses), grads, metrics)


# ------------------------------------------------------------------ KTO
def kto_mismatched_index(i: int, n: int) -> int:
    """The example whose completion goes with example ``i``'s prompt in the KL estimate: the one
    before it (the first takes the last's), TRL's ``KL_completion_ids`` rule. Fixed per row, so
    the reference scores them once before training, as DPO's sequences."""
    if n < 2:
        raise ValueError("KTO's KL estimate needs at least 2 examples")
    return (i - 1) % n


def kto_loss(sequences: Sequence[SequenceScore], labels: Sequence[bool], kl_sequences: Sequence[SequenceScore],
             params: Mapping[str, Any] | None = None) -> LossResult:
    """KTO over a batch of unpaired examples (``labels[i]``: True = desirable) whose KL estimate
    comes from ``kl_sequences`` (mismatched prompt/completion pairs; no gradient). ``grads[i]``
    is ``dL/dS`` of ``sequences[i]``, ``L`` the sum over examples."""
    p = resolve_params("kto", params)
    if len(sequences) != len(labels) or not sequences:
        raise ValueError(f"{len(sequences)} sequences for {len(labels)} labels")
    beta, lam_d, lam_u = p["beta"], p["desirable_weight"], p["undesirable_weight"]
    z0 = max(0.0, _mean([s.log_ratio for s in kl_sequences])) if kl_sequences else 0.0
    losses, grads, desirable, undesirable = [], [], [], []
    for seq, label in zip(sequences, labels):
        r = seq.log_ratio
        if label:
            s = _sigmoid(beta * (r - z0))
            losses.append(lam_d * (1 - s))
            grads.append(-lam_d * beta * s * (1 - s))
            desirable.append(beta * r)
        else:
            s = _sigmoid(beta * (z0 - r))
            losses.append(lam_u * (1 - s))
            grads.append(lam_u * beta * s * (1 - s))
            undesirable.append(beta * r)
    metrics = {"loss": _mean(losses), "kl_estimate": z0}
    if desirable:
        metrics["desirable_reward"] = _mean(desirable)
    if undesirable:
        metrics["undesirable_reward"] = _mean(undesirable)
    if desirable and undesirable:
        metrics["reward_margin"] = metrics["desirable_reward"] - metrics["undesirable_reward"]
    return LossResult(metrics["loss"], sum(losses), grads, metrics)


# ------------------------------------------------------------------ the wire (the SDK's custom-loss path)
def token_weights(weights: Sequence[float], grad: float) -> list[float]:
    """The ``cross_entropy`` weights ``-dL/dlp_t = -w_t * dL/dS`` of one datum."""
    return [-(w * grad) if w else 0.0 for w in weights]


def _tensor(data: list, dtype: str) -> dict:
    return {"data": data, "dtype": dtype, "shape": [len(data)]}


def forward_datum(datum: Mapping[str, Any]) -> dict:
    """The datum as the SDK's custom-loss ``/forward`` sends it: ``target_tokens`` and its own
    ``weights`` (zeros if it has none), nothing else (no ``ref_logprobs``)."""
    inputs = datum["loss_fn_inputs"]
    targets = inputs["target_tokens"]
    weights = inputs.get("weights") or _tensor([0.0] * len(targets["data"]), "float32")
    return {**datum, "loss_fn_inputs": {"target_tokens": targets, "weights": weights}}


def backward_datum(datum: Mapping[str, Any], grad: float) -> dict:
    """The datum of the second call: ``weights = -dL/dlogprob`` on its trained positions."""
    inputs = datum["loss_fn_inputs"]
    weights = token_weights(inputs["weights"]["data"], grad)
    return {**datum, "loss_fn_inputs": {"target_tokens": inputs["target_tokens"],
                                        "weights": {**inputs["weights"], "data": weights}}}


def check_unnormalized(metrics: Mapping[str, Any]) -> None:
    """The SDK's check: the trainer must have honoured ``skip_token_normalization``."""
    if metrics.get("skip_token_normalization") != 1.0:
        raise LoopsError("this trainer does not support cross_entropy's skip_token_normalization, which the "
                         "preference losses other than dpo need (the SDK's forward_backward_custom)",
                         hint="Use `loss: dpo`, which runs on the trainer's own dpo loss.")


def _output(result: Any) -> tuple[dict, list]:
    """(metrics, loss_fn_outputs) of a forward result, a typed model or its JSON."""
    if isinstance(result, Mapping):
        return dict(result.get("metrics") or {}), list(result["loss_fn_outputs"])
    return dict(result.metrics or {}), list(result.loss_fn_outputs)


def scores_from_forward(datums: Sequence[Mapping[str, Any]], result: Any, *,
                        ref_key: str = "ref_logprobs") -> list[SequenceScore]:
    """Each datum's :class:`SequenceScore` from a ``/forward`` result (the reference from the
    datum's ``ref_key`` input where it has one: GSPO compares with the sampler's ``logprobs``)."""
    metrics, outputs = _output(result)
    check_unnormalized(metrics)
    if len(outputs) != len(datums):
        raise LoopsError(f"forward returned {len(outputs)} outputs for {len(datums)} datums")
    scores = []
    for datum, out in zip(datums, outputs):
        inputs = datum["loss_fn_inputs"]
        refs = inputs.get(ref_key)
        tensor = out["logprobs"] if isinstance(out, Mapping) else out.logprobs
        logprobs = tensor["data"] if isinstance(tensor, Mapping) else tensor.data
        scores.append(score_sequence(logprobs, inputs["weights"]["data"], refs["data"] if refs else None))
    return scores


def submit_custom_loss(trainer: Any, datums: Sequence[Mapping[str, Any]],
                       compute: Callable[[list[SequenceScore]], LossResult], *,
                       extra: Sequence[Mapping[str, Any]] = (), backward: bool = True,
                       ref_key: str = "ref_logprobs") -> tuple[Any, LossResult]:
    """The SDK's ``forward_backward_custom`` for a closed-form loss: ``/forward`` (waited for),
    ``compute`` on the scores, then (``backward``) ``/forward_backward`` with the weights,
    submitted and not waited for (an ``optim_step`` may pipeline behind it). ``extra`` datums are
    scored in the same ``/forward`` and passed to ``compute`` after ``datums``' scores, with no
    backward (KTO's mismatched KL sequences). ``trainer`` is a ``workers.trainer.TrainerClient``
    (anything with its ``forward``/``forward_backward``). ``ref_key``: the datums' input that
    :func:`scores_from_forward` reads as each sequence's reference. Returns (the future or None, result)."""
    everything = list(datums) + list(extra)
    forward = trainer.forward([forward_datum(d) for d in everything], CUSTOM_LOSS_FN, dict(CUSTOM_LOSS_CONFIG))
    result = compute(scores_from_forward(everything, forward.result(), ref_key=ref_key))
    if not backward:
        return None, result
    data = [backward_datum(d, g) for d, g in zip(datums, result.grads)]
    return trainer.forward_backward(data, CUSTOM_LOSS_FN, dict(CUSTOM_LOSS_CONFIG)), result
