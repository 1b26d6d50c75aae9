"""The RL algorithms of ``kind: rl`` (GRPO, Dr. GRPO, DAPO, GSPO, RLOO) as composable pieces.

Pure Python (no torch: the CLI core has none). Each algorithm is a choice of four pieces, and an
``algorithm:`` preset (:data:`PRESETS`) only fills them in; any key the config sets wins:

- **advantage** (:class:`AdvantageConfig`, :func:`group_advantages`): the baseline a reward is
  compared with (``group_mean``, or ``leave_one_out``: the mean of the *other* replies, RLOO),
  whether the difference is divided by the group's reward std (``normalize: std``, GRPO) or not
  (``none``, Dr. GRPO), and how a reply's tokens share it (``length_normalization``, below).
- **loss** (``loss.name``, ``loss.clip_low`` / ``loss.clip_high``): ``ppo`` with decoupled clip
  bounds (DAPO's clip-higher) runs on the protocol's own ``ppo`` loss, whose ``loss_fn_config``
  takes both thresholds (:func:`protocol_loss`); ``gspo`` (:func:`gspo_loss`) is a closed-form
  custom loss on ``/forward`` logprobs + weighted ``cross_entropy``, the preference family's path
  (``preference_losses.submit_custom_loss``), so it runs on Baseten through protocol routes only.
- **overlong** (:class:`OverlongConfig`, :func:`overlong_penalty`): DAPO's soft overlong punishment.
- **dynamic sampling** (:class:`DynamicSamplingConfig`, :func:`needs_resampling`,
  :func:`replacement_prompts`): DAPO's: groups whose rewards are all equal are replaced by newly
  sampled ones until the batch is full, at most ``max_rounds`` rounds.

Scale. Every protocol loss *sums* over tokens and datums (Tinker semantics). The length
normalizations weight a reply's tokens so that the batch's loss stays a sum over replies of a
per-reply loss of order ``|A|`` (the papers take the mean over the group; ours is that times the
number of replies, as the protocol's losses sum over datums):

- ``none``: every token carries ``A`` (the historical default: the Tinker cookbook's sum);
- ``sequence``: ``A / |o_i|``: each reply's token mean (GRPO);
- ``token``: ``A * N / T``, ``T`` the reply tokens of the whole batch and ``N`` its replies:
  every token of the batch counts the same (DAPO's token-level aggregation);
- ``constant``: ``A / C``, ``C`` = ``advantage.length_constant`` (default ``sampling.max_tokens``):
  Dr. GRPO's constant, which does not favour short correct or long wrong replies.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence, get_args

from pydantic import Field

from baseten_loops_cli.training.config import Section
from baseten_loops_cli.training.losses.preference_losses import LossResult, SequenceScore

# std normalization's epsilon, TRL's GRPOTrainer's (``(r - mean) / (std + 1e-4)``).
STD_EPS = 1e-4
# A group whose rewards differ by less than this has no signal (the rule _datums used before).
SAME_REWARD = 1e-12

__all__ = [
    "ALGORITHMS", "PRESETS", "AdvantageConfig", "DynamicSamplingConfig", "OverlongConfig", "STD_EPS",
    "AdvantageRule", "clip_bounds", "clip_fractions", "describe", "expand_preset", "fill_groups", "group_advantages",
    "gspo_loss", "length_scales", "needs_resampling", "overlong_penalty", "protocol_loss", "replacement_prompts",
    "gspo_custom_loss", "gspo_datum",
]  # fmt: skip


# ------------------------------------------------------------------ config pieces
class AdvantageConfig(Section):
    baseline: Literal["group_mean", "leave_one_out"] = Field(
        "group_mean", description="group_mean: reward - the group's mean; leave_one_out: reward - the mean of the others (RLOO).")
    normalize: Literal["none", "std"] = Field(
        "none", description="std: divide by the group's reward std (GRPO); none: do not (Dr. GRPO).")
    length_normalization: Literal["none", "sequence", "token", "constant"] = Field(
        "none", description="none: every reply token carries the advantage (sum); sequence: / reply length (GRPO); "
                            "token: every token of the batch weighs the same (DAPO); constant: / length_constant (Dr. GRPO).")
    length_constant: int | None = Field(None, ge=1, description="The constant of length_normalization: constant (default: sampling.max_tokens).")


class OverlongConfig(Section):
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer`` reply tokens, then a
    linear ramp to ``-penalty`` at ``max_tokens``, ``-penalty`` beyond."""

    max_tokens: int | None = Field(None, ge=1, description="L_max (default: sampling.max_tokens).")
    buffer: int | None = Field(None, ge=1, description="L_cache: the ramp's length (default: a quarter of max_tokens).")
    penalty: float = Field(1.0, ge=0, description="The penalty at max_tokens (DAPO: 1).")

    def resolved(self, sampling_max_tokens: int) -> tuple[int, int]:
        """(L_max, L_cache) with the defaults filled in."""
        limit = self.max_tokens or sampling_max_tokens
        return limit, min(limit, self.buffer or max(1, limit // 4))


class DynamicSamplingConfig(Section):
    max_rounds: int = Field(3, ge=1, description="At most this many rounds of resampling a step.")


# name: (what it sets, why). Explicit config keys override each piece (expand_preset).
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {  # DeepSeekMath (arXiv 2402.03300)
        "advantage": {"baseline": "group_mean", "normalize": "std", "length_normalization": "sequence"},
        "loss": {"name": "ppo", "clip_low": 0.2, "clip_high": 0.2},
    },
    "dr_grpo": {  # Understanding R1-Zero-Like Training (arXiv 2503.20783)
        "advantage": {"baseline": "group_mean", "normalize": "none", "length_normalization": "constant"},
        "loss": {"name": "ppo", "clip_low": 0.2, "clip_high": 0.2},
    },
    "dapo": {  # arXiv 2503.14476
        "advantage": {"baseline": "group_mean", "normalize": "std", "length_normalization": "token"},
        "loss": {"name": "ppo", "clip_low": 0.2, "clip_high": 0.28},
        "overlong": {"penalty": 1.0},
        "dynamic_sampling": {"max_rounds": 3},
    },
    "gspo": {  # arXiv 2507.18071: the sequence ratio averages over the reply already
        "advantage": {"baseline": "group_mean", "normalize": "std", "length_normalization": "none"},
        "loss": {"name": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
    },
    "rloo": {  # Ahmadian et al. 2024 (arXiv 2402.14740), REINFORCE with a leave-one-out baseline
        "advantage": {"baseline": "leave_one_out", "normalize": "none", "length_normalization": "sequence"},
        "loss": {"name": "importance_sampling"},
    },
}
# The presets' names, as the config's `algorithm:` type (a Literal, so the schema lists them).
AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo"]
ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
assert set(ALGORITHMS) == set(PRESETS), "AlgorithmName names every preset"
PIECES = ("advantage", "loss", "overlong", "dynamic_sampling")


def expand_preset(data: Mapping[str, Any]) -> dict[str, Any]:
    """The raw config ``data`` with its ``algorithm:`` preset filled in under the keys it sets
    itself (a key of ``advantage:``, ``loss:``, ``overlong:`` or ``dynamic_sampling:``). A
    preset's loss parameters are kept only while ``loss.name`` is the preset's; ``overlong: null``
    or ``dynamic_sampling: null`` (or false) turns a preset's piece off. An unknown name is left
    for the schema to report (with the known ones)."""
    out = dict(data)
    name = out.get("algorithm")
    preset = PRESETS.get(name) if isinstance(name, str) else None
    if preset is None:
        return out
    for piece, values in preset.items():
        if piece in out and out[piece] in (None, False):
            out[piece] = None
            continue
        given = out.get(piece)
        if given is True:
            given = {}
        if not isinstance(given, Mapping) and given is not None:
            continue  # the schema reports it
        given = dict(given or {})
        if piece == "loss" and given.get("name", values["name"]) != values["name"]:
            out[piece] = given
            continue
        out[piece] = {**values, **given}
    return out


def describe(config: Any) -> str:
    """One line: what the config's RL pieces resolved to (``loops train validate`` prints it)."""
    adv = config.advantage
    parts = [f"advantage {adv.baseline}, normalize {adv.normalize}, length_normalization {adv.length_normalization}"
             + (f" ({adv.length_constant or config.sampling.max_tokens})" if adv.length_normalization == "constant" else "")]
    loss = config.loss
    bounds = clip_bounds(loss)
    parts.append(f"loss {loss.name}" + (f" (ratio clipped to [{bounds[0]:g}, {bounds[1]:g}])" if bounds else ""))
    if config.overlong is not None:
        limit, buffer = config.overlong.resolved(config.sampling.max_tokens)
        parts.append(f"overlong penalty {config.overlong.penalty:g} over the last {buffer} of {limit} tokens")
    if config.dynamic_sampling is not None:
        parts.append(f"dynamic sampling (up to {config.dynamic_sampling.max_rounds} rounds)")
    head = f"algorithm {config.algorithm}: " if config.algorithm else "RL: "
    return head + "; ".join(parts)


# ------------------------------------------------------------------ advantages
def overlong_penalty(length: int, limit: int, buffer: int, penalty: float) -> float:
    """DAPO's R_length (eq. 13) times ``penalty``: 0 up to ``limit - buffer`` tokens,
    ``((limit - buffer) - length) / buffer`` up to ``limit``, -1 beyond."""
    free = limit - buffer
    if length <= free:
        return 0.0
    if length <= limit:
        return penalty * (free - length) / buffer
    return -penalty


def group_advantages(rewards: Sequence[float], advantage: AdvantageConfig) -> list[float]:
    """Each reply's advantage in a group: reward minus the baseline, over the std if asked."""
    n = len(rewards)
    mean = statistics.fmean(rewards)
    if advantage.baseline == "leave_one_out":
        # r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean)
        total = math.fsum(rewards)
        out = [r - (total - r) / (n - 1) for r in rewards]
    else:
        out = [r - mean for r in rewards]
    if advantage.normalize == "std":
        std = statistics.stdev(rewards) if n > 1 else 0.0  # Bessel's, as TRL (torch.std)
        out = [a / (std + STD_EPS) for a in out]
    return out


def length_scales(lengths: Sequence[int], advantage: AdvantageConfig, max_tokens: int) -> list[float]:
    """The factor each reply's token advantages are multiplied by (module docstring, "Scale");
    ``lengths`` are the trained replies of the whole batch."""
    how = advantage.length_normalization
    if how == "none":
        return [1.0] * len(lengths)
    if how == "sequence":
        return [1.0 / n if n else 0.0 for n in lengths]
    if how == "token":
        total = sum(lengths)
        return [len(lengths) / total if total else 0.0] * len(lengths)
    constant = advantage.length_constant or max_tokens
    return [1.0 / constant] * len(lengths)


@dataclass(frozen=True)
class AdvantageRule:
    """How a batch's rewards become token advantages: the config's ``advantage:`` and
    ``overlong:`` with ``sampling.max_tokens`` (their defaults' reference). The default rule is
    the historical one: reward - group mean on every reply token."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    overlong: OverlongConfig | None = None
    max_tokens: int = 0

    @classmethod
    def of(cls, config: Any) -> "AdvantageRule":
        return cls(config.advantage, config.overlong, config.sampling.max_tokens)

    def shaped(self, reward: float, length: int) -> float:
        if self.overlong is None:
            return reward
        limit, buffer = self.overlong.resolved(self.max_tokens)
        return reward + overlong_penalty(length, limit, buffer, self.overlong.penalty)

    def apply(self, rewards: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]]) -> list[list[tuple[float, float]]]:
        """Per group, per reply: (advantage, the factor its tokens' advantages are scaled by)."""
        advantages = [group_advantages([self.shaped(r, n) for r, n in zip(rs, ns)], self.advantage)
                      for rs, ns in zip(rewards, lengths)]
        scales = iter(length_scales([n for ns in lengths for n in ns], self.advantage, self.max_tokens))
        return [[(a, next(scales)) for a in group] for group in advantages]


def fill_groups(groups: list, versions: list[int], draw: Any, max_rounds: int, rewards_of: Any) -> dict[str, int]:
    """DAPO's dynamic sampling, in place: each group without signal is replaced by a newly drawn
    group with signal, ``draw(count, round) -> (groups, versions)`` drawing as many as are
    missing each round, for at most ``max_rounds`` rounds (a group still without signal then
    stays and is not trained). Returns the metrics: groups drawn, rounds, groups left unfilled."""
    missing = needs_resampling([rewards_of(g) for g in groups])
    drawn = rounds = 0
    while missing and rounds < max_rounds:
        rounds += 1
        new_groups, new_versions = draw(len(missing), rounds)
        drawn += len(new_groups)
        good = [(g, v) for g, v in zip(new_groups, new_versions) if has_signal(rewards_of(g))]
        for slot, (group, version) in zip(list(missing), good):
            groups[slot], versions[slot] = group, version
            missing.remove(slot)
    return {"groups_resampled": drawn, "resample_rounds": rounds, "groups_unfilled": len(missing)}


# ------------------------------------------------------------------ dynamic sampling
def has_signal(rewards: Sequence[float]) -> bool:
    return len(rewards) >= 2 and max(rewards) - min(rewards) >= SAME_REWARD


def needs_resampling(groups_rewards: Sequence[Sequence[float]]) -> list[int]:
    """The indices of the groups without signal (fewer than 2 scored replies, or all equal)."""
    return [i for i, rewards in enumerate(groups_rewards) if not has_signal(rewards)]


def replacement_prompts(n_prompts: int, count: int, *, seed: int, step: int, round_: int) -> list[int]:
    """Which prompts a resampling round draws: ``count`` indices, a function of (seed, step,
    round) alone, so a resumed run draws the same ones."""
    rng = random.Random(f"loops-dynamic-sampling:{seed}:{step}:{round_}")
    if count <= n_prompts:
        return rng.sample(range(n_prompts), count)
    return [rng.randrange(n_prompts) for _ in range(count)]


# ------------------------------------------------------------------ losses
# A loss's clip epsilons (low, high) when the config sets neither: the protocol's ppo/cispo
# defaults (thresholds 0.8, 1.2), and GSPO's paper's (its ratios are per sequence, near 1).
DEFAULT_CLIP = {"ppo": (0.2, 0.2), "cispo": (0.2, 0.2), "gspo": (3e-4, 4e-4)}


def clip_bounds(loss: Any) -> tuple[float, float] | None:
    """:func:`ratio_bounds` of a loss that clips; None for a loss without clipping."""
    return ratio_bounds(loss) if loss.name in DEFAULT_CLIP else None


def ratio_bounds(loss: Any) -> tuple[float, float]:
    """(low, high) bounds of the ratio of a clipping loss (a ``DEFAULT_CLIP`` name):
    ``[1 - clip_low, 1 + clip_high]`` (the epsilons, as DAPO writes them), else ppo/cispo's own
    ``config`` thresholds, else the defaults."""
    low_eps, high_eps = DEFAULT_CLIP[loss.name]
    low = 1.0 - loss.clip_low if loss.clip_low is not None else loss.config.get("clip_low_threshold", 1.0 - low_eps)
    high = 1.0 + loss.clip_high if loss.clip_high is not None else loss.config.get("clip_high_threshold", 1.0 + high_eps)
    return low, high


def protocol_loss(loss: Any) -> tuple[str, dict | None]:
    """(loss_fn, loss_fn_config) of a loss the protocol runs itself (every one but gspo)."""
    if loss.name in ("ppo", "cispo") and (loss.clip_low is not None or loss.clip_high is not None):
        low, high = ratio_bounds(loss)
        return loss.name, {"clip_low_threshold": low, "clip_high_threshold": high}
    return loss.name, (loss.config or None)


def gspo_loss(sequences: Sequence[SequenceScore], advantages: Sequence[float], low: float, high: float) -> LossResult:
    """GSPO (Zheng et al. 2025, eq. 5-7), summed over replies: ``s_i = exp((S_i - S_old_i) / n_i)``
    (the geometric mean of the token ratios against the sampler), ``L_i = -min(s_i A_i,
    clip(s_i, low, high) A_i)``. ``grads[i] = dL/dS_i``: ``-A_i s_i / n_i`` where the unclipped
    term is the minimum, else 0 (the clipped term is constant). Metrics: the mean loss, the ratio's
    mean and std (its spread) and the share of replies clipped below / above."""
    if len(sequences) != len(advantages) or not sequences:
        raise ValueError(f"{len(sequences)} sequences for {len(advantages)} advantages")
    losses, grads, ratios = [], [], []
    clipped_low = clipped_high = 0
    for seq, a in zip(sequences, advantages):
        s = math.exp(seq.log_ratio / seq.tokens)
        ratios.append(s)
        c = min(max(s, low), high)
        clipped_low += s < low
        clipped_high += s > high
        losses.append(-min(s * a, c * a))
        # The unclipped term wins the min where s*A <= c*A (ties: the unclipped one, as torch.min).
        grads.append(-a * s / seq.tokens if s * a <= c * a else 0.0)
    n = len(sequences)
    metrics = {"loss": sum(losses) / n, "sequence_ratio_mean": sum(ratios) / n,
               "sequence_ratio_std": statistics.pstdev(ratios) if n > 1 else 0.0,
               "clip_low_fraction": clipped_low / n, "clip_high_fraction": clipped_high / n}
    return LossResult(metrics["loss"], sum(losses), grads, metrics)


def clip_fractions(datums: Sequence[Mapping[str, Any]], outputs: Sequence[Any], low: float, high: float) -> dict[str, float]:
    """PPO's token clip fractions from a ``forward_backward``'s logprobs: the share of trained
    tokens whose ratio to the sampler was below ``low`` / above ``high``."""
    below = above = count = 0
    for datum, output in zip(datums, outputs):
        trainer = ((output or {}).get("logprobs") or {}).get("data") or []
        inputs = datum["loss_fn_inputs"]
        for lp, old, m in zip(trainer, inputs["logprobs"]["data"], inputs["mask"]["data"]):
            if m and lp is not None:
                r = math.exp(lp - old)
                below += r < low
                above += r > high
                count += 1
    if not count:
        return {}
    return {"clip_low_fraction": below / count, "clip_high_fraction": above / count}


def gspo_datum(datum: Mapping[str, Any]) -> dict:
    """An RL datum (``training.data.datums.rl_datum``) for the custom-loss path: its mask as the
    ``weights`` (the reply's positions), the rest kept for the client-side loss."""
    inputs = datum["loss_fn_inputs"]
    return {**datum, "loss_fn_inputs": {**inputs, "weights": dict(inputs["mask"])}}


def gspo_custom_loss(datums: Sequence[Mapping[str, Any]], low: float, high: float) -> tuple[list[dict], Any]:
    """GSPO on the custom-loss path (``preference_losses.submit_custom_loss``, which the step loop
    runs for a ``CustomLoss``): the datums to score and train (their mask as the weights) and the
    closed-form loss over them, against the sampler's logprobs (the datums' ``logprobs``: the loop
    passes ``ref_key="logprobs"``). Each reply's advantage is its datum's (one number over the
    reply: GSPO's is per sequence; a KL penalty is refused by the config). The step record's
    ``loss`` is the objective's sum, as a protocol loss's ``loss:sum``."""
    data = [gspo_datum(d) for d in datums]
    advantages = [_sequence_advantage(d) for d in data]

    def compute(scores: list[SequenceScore]) -> LossResult:
        result = gspo_loss(scores, advantages, low, high)
        return LossResult(result.loss, result.loss_sum, result.grads, {**result.metrics, "loss": result.loss_sum})

    return data, compute


def _sequence_advantage(datum: Mapping[str, Any]) -> float:
    inputs = datum["loss_fn_inputs"]
    return next((a for a, m in zip(inputs["advantages"]["data"], inputs["mask"]["data"]) if m), 0.0)


