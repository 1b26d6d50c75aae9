"""Reinforcement learning (``kind: rl``): prompts, a reward, GRPO-style group advantages.

Per step: publish the current weights to the sampler, sample ``group_size`` completions for each
of ``groups_per_batch`` prompts with every request in flight, score them, set
advantage = reward - group mean, drop groups whose rewards are all equal (no signal), build
datums carrying the sampler's logprobs, then ``forward_backward`` with the configured loss and
``optim_step``.

The loop (training/loop/core.py) drives it through :class:`RLSteps`: ``gather`` (the rollouts),
``advantages`` (the datums) and ``loss`` are the three hooks an RL algorithm overrides.

``max_steps_off_policy: 0`` is synchronous (sample with the weights of this very step).
``N >= 1`` overlaps: the next batch is sampled while this one trains. Each group is tagged
with the policy version that sampled it, and a group more than N versions behind the trainer
is resampled, never trained on.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import Field, field_validator, model_validator

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.losses import rl_algorithms as algos
from baseten_loops_cli.training.config import CommonConfig, LoadedConfig, LossConfig, PromptsData, RewardConfig, SamplingConfig
from baseten_loops_cli.training.data.datums import Prompt, rl_datum
from baseten_loops_cli.training.kinds import Estimate, Kind, LoadedData, StepField
from baseten_loops_cli.training.kinds.rl_rollouts import Batch, Rollout, Rollouts
from baseten_loops_cli.training.loop.core import CustomLoss, Loop, ProtocolLoss, StepHooks, StepWork, Waiter, step_rows, total_steps
from baseten_loops_cli.training.templates import COMMON, GROUPS

# Builtin rewards that compare against the row's "answer": a row without one fails at load time.
ANSWER_REWARDS = ("exact_match", "numeric_match", "contains", "starts_with")


class RLConfig(CommonConfig):
    SECTIONS = CommonConfig.SECTIONS + ("loss", "sampling")
    kind: Literal["rl"]
    data: PromptsData
    reward: RewardConfig | list[RewardConfig] | None  # required unless `env:` is given (see _reward_optional_with_env)
    env: str | None = Field(None, description="path/to/file.py:ClassName: a multi-turn environment, one episode per row.")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's constructor.")
    max_turns: int = Field(8, ge=1, description="An episode ends after this many replies (truncated) if the env has not ended it.")
    turn_discount: float = Field(1.0, gt=0, le=1, description="Episode reward = sum of turn rewards * turn_discount**turn.")
    reward_timeout_s: float = Field(60.0, gt=0, description="Per call of a reward or environment; past it the rollout fails.")
    reward_workers: int = Field(8, ge=1, description="Reward/environment calls running at once (threads).")
    warn_logprob_diff: float = Field(0.5, gt=0, description="Warn when logprob_diff (sampler vs trainer) passes this.")
    max_failed_fraction: float = Field(0.1, ge=0, le=1, description="The run stops when more of a batch's rollouts fail.")
    group_size: int = Field(4, ge=2)
    groups_per_batch: int = Field(8, ge=1)
    loss: LossConfig = Field(default_factory=LossConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    kl_penalty_coef: float = Field(0.0, ge=0, description="KL penalty against the base model (0 = off).")
    max_steps_off_policy: int = Field(0, ge=0, description="0 = synchronous; N >= 1 = async with that staleness bound.")
    pass_threshold: float = Field(1.0, description="A rollout passes when its reward is at least this.")
    # The RL algorithm's pieces (training/losses/rl_algorithms.py, docs/rl-algorithms.md); `algorithm:`
    # is a preset that fills them in under the keys the config sets itself (_expand_algorithm).
    algorithm: algos.AlgorithmName | None = Field(None, description="A preset: " + ", ".join(algos.ALGORITHMS) + ".")
    advantage: algos.AdvantageConfig = Field(default_factory=algos.AdvantageConfig)
    overlong: algos.OverlongConfig | None = Field(None, description="DAPO's soft overlong reward shaping (off unless set).")
    dynamic_sampling: algos.DynamicSamplingConfig | None = Field(
        None, description="DAPO's: replace groups without signal by newly sampled ones (off unless set).")

    @field_validator("overlong", "dynamic_sampling", mode="before")
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        return {} if value is True else None if value is False else value

    @model_validator(mode="before")
    @classmethod
    def _expand_algorithm(cls, data: Any) -> Any:
        return algos.expand_preset(data) if isinstance(data, dict) else data

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_shorthand(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"fn": v} if isinstance(v, str) else v for v in value]
        return {"fn": value} if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _reward_optional_with_env(cls, data: Any) -> Any:
        # Required, so a config with neither reports "missing required key 'reward'" at once,
        # beside its other problems; an environment may score the episode alone.
        if isinstance(data, dict) and data.get("env") is not None and "reward" not in data:
            data = {**data, "reward": None}
        return data

    @model_validator(mode="after")
    def _reward_or_env(self) -> "RLConfig":
        if self.reward is None and self.env is None:
            raise ValueError("an rl config needs a reward (reward: NAME) or an environment (env: path/to/file.py:ClassName)")
        if self.env is not None and not (":" in self.env and self.env.split(":", 1)[0].endswith(".py")):
            raise ValueError(f"env must be path/to/file.py:ClassName, got {self.env!r}")
        if self.env is not None and self.kl_penalty_coef:
            raise ValueError("kl_penalty_coef is not supported with env: yet (episodes are scored as one sequence); set it to 0")
        if self.loss.name == "gspo" and self.kl_penalty_coef:
            raise ValueError("kl_penalty_coef is not supported with loss gspo (its advantage is one per reply); set it to 0")
        return self


def load_data(loaded, tokenizer: Any) -> LoadedData:
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.data.datums import load_prompts
    from baseten_loops_cli.training.data.formats import data_notes
    from baseten_loops_cli.training.rewards.builtins import build_rewards

    config = loaded.config
    train_spec, eval_spec = kinds.data_specs(loaded)  # any format and source, read by the data layer
    kwargs = {"max_seq_len": config.max_seq_len, "max_tokens": config.sampling.max_tokens}
    load = load_env_rows if config.env else load_prompts
    train = load(train_spec, tokenizer, **kwargs)
    evals = load(eval_spec, tokenizer, **kwargs) if eval_spec else None
    reward = build_rewards(config.reward, loaded.base_dir) if config.reward is not None else None
    if config.env:
        from baseten_loops_cli.training.rewards.envs import load_env

        load_env(config.env, loaded.base_dir)  # a missing file or class fails now, before provisioning
    specs = config.reward if isinstance(config.reward, list) else [config.reward] if config.reward else []
    needs_answer = next((spec.fn for spec in specs if spec.fn in ANSWER_REWARDS), None)
    if needs_answer:
        # Catch a missing answer now, not after capacity is provisioned.
        for prompt in train + (evals or []):
            if "answer" not in prompt.row:
                raise ConfigError(
                    f"{prompt.source}: reward {needs_answer!r} needs an 'answer' field in each prompt row",
                    hint='Add "answer" to every row ({"prompt": ..., "answer": ...}) or use a reward file.',
                )
    return LoadedData(tokenizer, train, evals, reward, data_notes(train_spec, eval_spec))


def render_rows(spec, tokenizer: Any, *, max_seq_len: int, train_on: str | None = None) -> list[list[Any]]:
    """Each row as the sampler gets it (`loops data check|preview`): one Prompt (its tokens)."""
    from baseten_loops_cli.training.data.datums import load_prompts

    return [[p] for p in load_prompts(spec, tokenizer, max_seq_len=max_seq_len, max_tokens=0)]


def load_env_rows(data, tokenizer: Any, **_: Any) -> list[Prompt]:
    """Environment rows: any JSON object each, from any source the data layer reads (the
    environment reads the row); the prompt comes from the environment's ``reset``."""
    from baseten_loops_cli.training.data.datums import JSONL_HINT
    from baseten_loops_cli.training.data.formats import read_rows
    from baseten_loops_cli.training.data.formats.rows import ENV_ROWS

    rows = [Prompt([], row, where, str(row.get("prompt", ""))) for where, row in read_rows(data, ENV_ROWS)]
    if not rows:
        raise ConfigError(f"{data}: no rows (the file is empty)", hint="Put at least one row in it: " + JSONL_HINT)
    return rows


def estimate(config, data: LoadedData) -> Estimate:
    """Each step's real prompts and ``sampling.max_tokens`` per completion: upper bounds
    (completions may stop early; groups without signal are not trained)."""
    steps = steps_of(config, len(data.train))
    completions = config.groups_per_batch * config.group_size
    prompt_tokens = sum(len(p.tokens) for step in range(steps) for p in prompts_for_step(data.train, step, config))
    turns = config.max_turns if config.env else 1
    sample_tokens = steps * completions * config.sampling.max_tokens * turns
    notes = ["RL token counts are upper bounds (every completion at sampling.max_tokens)"]
    if config.env:
        notes.append(f"environment episodes: up to max_turns={turns} replies each; opening prompts not counted")
    if config.algorithm or config.model_fields_set & {"advantage", "overlong", "dynamic_sampling"} or config.loss.name == "gspo":
        notes.append(algos.describe(config))  # what `algorithm:` expanded to (`train validate` prints it)
    judge = None
    if config.reward is not None:
        from baseten_loops_cli.training.rewards.judge import plan_tokens

        passes = [prompts_for_step(data.train, step, config) for step in range(steps)]
        if data.eval:  # each eval (every eval_every steps, and the last) grades one reply per prompt
            passes += [[p] for _ in range(1 + (steps // config.eval_every if config.eval_every else 0)) for p in data.eval]
        judge = plan_tokens(config.reward, data.tokenizer, passes, group_size=config.group_size,
                            reply_tokens=config.sampling.max_tokens * turns)
    return Estimate(steps, prompt_tokens * config.group_size + sample_tokens - steps * completions, sample_tokens,
                    notes=notes, judge=judge)


def eval_task(loaded, data, *, limit=None, seed=None, samples=None, k=None) -> Any:
    """Prompt rows: ``samples`` completions each (default: group_size), scored by the reward."""
    from baseten_loops_cli.training.evaluation.scoring import RLTask

    config = loaded.config
    if config.env or isinstance(config.reward, list):
        from baseten_loops_cli.errors import UsageError

        what = "environments" if config.env else "a list of rewards"
        raise UsageError(f"{loaded.path}: `loops eval` does not score {what} yet",
                         hint="Set data.eval_prompts to evaluate during training (eval_reward_mean).")
    return RLTask(
        data, config.reward, loaded.base_dir, config.sampling, samples or config.group_size, k,
        config.pass_threshold, config.seed if seed is None else seed, config.max_seq_len, limit,
    )  # fmt: skip


def prompts_for_step(prompts: list[Prompt], step: int, config) -> list[Prompt]:
    return [prompts[i] for i in step_rows(len(prompts), config.groups_per_batch, step, config, shuffle=config.data.shuffle)]


def steps_of(config, n_prompts: int) -> int:
    return total_steps(n_prompts, config.groups_per_batch, config.epochs, config.max_steps)


def _datums(groups: list[list[Rollout]], kl_coef: float = 0.0,
            rule: algos.AdvantageRule | None = None) -> tuple[list[dict], int, float | None]:
    """Datums of the groups with signal, the number of such groups, and the mean sampled-vs-base
    KL estimate when a KL penalty is on. ``rule`` turns rewards into token advantages (the
    config's ``advantage:`` and ``overlong:``; the default: reward - group mean).

    With a penalty, each completion token's advantage becomes
    ``(advantage - kl_coef * (logp_policy - logp_base)) * scale``: the per-token k1 estimate of
    KL(policy || base), as in the Tinker cookbook's ``kl_penalty_coef``.
    """
    from baseten_loops_cli.training.rewards.envs import episode_datum

    rule = rule or algos.AdvantageRule()
    datums, kl_terms, trained = [], [], []
    for group in groups:
        group = [r for r in group if not r.failed]  # a failed rollout has no reward: not trained
        rewards = [r.reward for r in group]
        if len(rewards) < 2 or (max(rewards) - min(rewards) < algos.SAME_REWARD and not kl_coef):
            continue  # every rollout scored the same: no learning signal
        trained.append(group)
    advantages = rule.apply([[r.reward for r in g] for g in trained], [[len(r.tokens) for r in g] for g in trained])
    for group, group_advantages in zip(trained, advantages):
        for r, (advantage, scale) in zip(group, group_advantages):
            if r.episode is not None:
                datum = episode_datum(r.episode, advantage * scale)
                if datum is not None:
                    datums.append(datum)
                continue
            if not r.tokens or len(r.logprobs) != len(r.tokens):
                continue
            per_token: float | list[float] = advantage * scale
            if kl_coef and r.base_logprobs is not None and len(r.base_logprobs) == len(r.tokens):
                diffs = [lp - blp for lp, blp in zip(r.logprobs, r.base_logprobs)]
                kl_terms.extend(diffs)
                per_token = [(advantage - kl_coef * d) * scale for d in diffs]
            datums.append(rl_datum(r.prompt.tokens, r.tokens, r.logprobs, per_token))
    return datums, len(trained), (statistics.fmean(kl_terms) if kl_terms else None)


def fill_batch(batch: Batch, rollouts: "Rollouts", prompts: list[Prompt], version: int, config) -> dict:
    """DAPO's dynamic sampling (``dynamic_sampling:``): the batch's groups without signal
    replaced, in place, by groups of newly drawn prompts (the same ones on a resume:
    ``rl_algorithms.replacement_prompts``); returns its metrics."""
    def draw(count: int, round_: int) -> tuple[list[list[Rollout]], list[int]]:
        chosen = algos.replacement_prompts(len(prompts), count, seed=config.seed, step=batch.step, round_=round_)
        more = rollouts.sample([prompts[i] for i in chosen], step=batch.step, version=version, n=config.group_size,
                               sampling=config.sampling, seed=config.seed + 104_729 * round_)
        batch.sample_time_s += more.sample_time_s
        return more.groups, more.versions

    return algos.fill_groups(batch.groups, batch.versions, draw, config.dynamic_sampling.max_rounds,
                             lambda group: [r.reward for r in group if not r.failed])


def health(batch: Batch, config, fb_result: dict | None, datums: list[dict]) -> dict:
    """RL health of one step (README "Rewards"):

    - ``reward_std``: std of the rewards of the batch's rollouts (failed ones left out);
    - ``zero_variance_groups``: share of groups whose rewards were all equal (skipped: no signal);
    - ``completion_tokens``: mean reply tokens per rollout (all turns of an episode);
    - ``max_tokens_share``: share of replies that stopped at sampling.max_tokens;
    - ``entropy``: mean negative sampler logprob of the sampled tokens, a Monte Carlo estimate of
      the per-token entropy of the sampling distribution (no top logprobs needed);
    - ``logprob_diff``: mean |sampler logprob - trainer logprob| over the trained tokens, from
      ``forward_backward``'s per-token logprobs (staleness plus numerical drift);
    - ``failed_rollouts``: share of rollouts whose reward or environment failed.
    """
    rollouts = [r for g in batch.groups for r in g]
    ok = [r for r in rollouts if not r.failed]
    rewards = [r.reward for r in ok]
    replies = [t for r in ok for t in (r.episode.turns if r.episode is not None else [r])]
    tokens = [lp for r in ok for lp in r.logprobs]
    zero = sum(1 for g in batch.groups
               if len({round(r.reward, 12) for r in g if not r.failed}) <= 1)  # fmt: skip
    out: dict[str, Any] = {
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "zero_variance_groups": zero / len(batch.groups) if batch.groups else 0.0,
        "completion_tokens": statistics.fmean(len(r.tokens) for r in ok) if ok else 0.0,
        "max_tokens_share": (sum(1 for t in replies if t.stop_reason == "length") / len(replies)) if replies else 0.0,
        "entropy": -statistics.fmean(tokens) if tokens else None,
        "failed_rollouts": (len(rollouts) - len(ok)) / len(rollouts) if rollouts else 0.0,
    }
    if config.overlong is not None:  # DAPO's shaping, in the advantages only: `reward` stays the task's
        out["overlong_penalty"] = statistics.fmean(algos.AdvantageRule.of(config).shaped(0.0, len(r.tokens)) for r in ok) if ok else 0.0
    for label in {k for r in ok for k in (r.components or {})}:
        values = [r.components[label] for r in ok if r.components and label in r.components]
        out[f"reward/{label}"] = statistics.fmean(values)
        out[f"reward_std/{label}"] = statistics.pstdev(values) if len(values) > 1 else 0.0
    outputs = (fb_result or {}).get("loss_fn_outputs") or []
    diffs = []
    for datum, output in zip(datums, outputs):
        trainer = ((output or {}).get("logprobs") or {}).get("data") or []
        inputs = datum["loss_fn_inputs"]
        for lp, sampler, m in zip(trainer, inputs["logprobs"]["data"], inputs["mask"]["data"]):
            if m and lp is not None:
                diffs.append(abs(sampler - lp))
    if diffs:
        out["logprob_diff"] = statistics.fmean(diffs)
    return out


class HealthWarnings:
    """The warnings the live view shows: once when a condition starts, again only after it
    cleared (a run with no signal for 50 steps warns once, not 50 times)."""

    def __init__(self, drift_bound: float) -> None:
        self.drift_bound = drift_bound
        self.active: set[str] = set()

    def check(self, record: dict) -> list[str]:
        step = record["step"]
        conditions = {
            "collapse": (record.get("zero_variance_groups") == 1.0,
                         f"warning: step {step}: reward variance collapsed (every group scored alike; nothing to "
                         "learn from): raise sampling.temperature or group_size, or give the reward partial credit"),
            "drift": ((record.get("logprob_diff") or 0.0) > self.drift_bound,
                      f"warning: step {step}: sampler and trainer logprobs differ by {record.get('logprob_diff', 0):.3f} "
                      f"on average (bound warn_logprob_diff {self.drift_bound:g}): stale samples or numerical drift; "
                      "lower max_steps_off_policy or the learning rate"),
        }
        out = []
        for key, (on, text) in conditions.items():
            if on and key not in self.active:
                out.append(text)
            (self.active.add if on else self.active.discard)(key)
        return out


def check_failures(batch: Batch, config) -> None:
    """Stop the run (RewardError: state saved, resumable) when more than max_failed_fraction of
    the batch's rollouts failed; below that, failed rollouts are only left out of training."""
    from baseten_loops_cli.training.rewards.builtins import RewardError

    rollouts = [r for g in batch.groups for r in g]
    failed = [r for r in rollouts if r.failed]
    if failed and len(failed) / len(rollouts) > config.max_failed_fraction:
        raise RewardError(
            f"{len(failed)} of {len(rollouts)} rollouts of step {batch.step + 1} failed (more than "
            f"max_failed_fraction {config.max_failed_fraction:g}); the first: {failed[0].error}",
            hint="Fix the reward or environment (tracebacks are in samples.jsonl; try `loops reward test CONFIG`).",
        )


def evaluate(rollouts: Rollouts, prompts: list[Prompt], config, version: int) -> dict:
    batch = rollouts.sample(prompts, step=0, version=version, n=1, sampling=config.sampling, seed=config.seed + 7)
    rewards = [r.reward for g in batch.groups for r in g if not r.failed]
    return {
        "eval_reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "eval_pass_rate": sum(r >= config.pass_threshold for r in rewards) / len(rewards) if rewards else float("nan"),
    }


class AheadSampler:
    """RL's off-policy window (``max_steps_off_policy: N``): the batches of the next N steps are
    sampled on their own threads while this one trains. The batch for step s + k is sampled
    with the weights published after step s, so it trains k <= N versions stale; a batch found
    staler is resampled, never trained on."""

    def __init__(self, sample: Callable[[int, int], Batch]) -> None:
        self.sample = sample
        self.ahead: dict[int, tuple[threading.Thread, dict]] = {}

    def start(self, for_step: int, version: int) -> None:
        if for_step in self.ahead:
            return
        box: dict = {}

        def work() -> None:
            try:
                box["batch"] = self.sample(for_step, version)
            except BaseException as exc:  # surfaced on take
                box["error"] = exc

        thread = threading.Thread(target=work, name=f"loops-rl-prefetch-{for_step}", daemon=True)
        thread.start()
        self.ahead[for_step] = (thread, box)

    def take(self, step: int) -> Batch | None:
        """The batch sampled ahead for ``step``, if one was (waits for it)."""
        if step not in self.ahead:
            return None
        thread, box = self.ahead.pop(step)
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["batch"]


class RLSteps(StepHooks["RLConfig"]):
    """RL's part of the loop. Per step: gather the batch's rollouts (:meth:`gather`, through the
    off-policy window), turn them into datums with their advantages (:meth:`advantages`), and
    train them with the config's loss (:meth:`loss`). An RL algorithm (GSPO, DAPO, RLOO, ...)
    overrides what it changes of these three."""

    main_metric = "reward"
    on_policy = True

    def rows_per_step(self) -> int:
        return self.config.groups_per_batch

    def begin(self, loop: Loop) -> None:
        from baseten_loops_cli.training.rewards.judge import JudgeMeter

        self.sink = loop.sink
        self.rollouts = Rollouts(self.session, self.data.tokenizer, self.data.reward)
        self.judges = JudgeMeter([fn for _, fn, _ in self.data.reward or []], self.session)  # judges sample on the run's backend
        self.warnings = HealthWarnings(self.config.warn_logprob_diff)
        self.window = AheadSampler(self.sample)
        self.steps = loop.steps

    def sample(self, step: int, version: int) -> Batch:
        config = self.config
        prompts = [self.data.train[i] for i in self.rows(step)]
        return self.rollouts.sample(prompts, step=step, version=version, n=config.group_size,
                                    sampling=config.sampling, seed=config.seed)

    def gather(self, step: int, version: int) -> tuple[Batch, dict]:
        """This step's batch: sampled ahead when within the staleness bound, else now (with
        dynamic sampling, its groups without signal refilled: their metrics come with it); then
        the window is kept full for the next steps, with the weights published so far."""
        bound = self.config.max_steps_off_policy
        batch = self.window.take(step)
        if batch is None or step - batch.version > bound:
            batch = self.sample(step, version)  # synchronous, or the prefetched batch was too stale
        try:
            check_failures(batch, self.config)
        except Exception:
            self.sink.samples(self.samples(batch, step + 1))
            raise
        # DAPO's dynamic sampling refills groups without signal before the window moves on.
        resampled = fill_batch(batch, self.rollouts, self.data.train, version, self.config) if self.config.dynamic_sampling else {}
        for next_step in range(step + 1, min(step + bound, self.steps - 1) + 1):
            self.window.start(next_step, version)
        return batch, resampled

    def advantages(self, batch: Batch) -> tuple[list[dict], int, float | None]:
        """(datums, groups with signal, KL estimate): the config's advantage rule (``advantage:``,
        ``overlong:``; rl_algorithms.AdvantageRule), the KL penalty."""
        return _datums(batch.groups, self.config.kl_penalty_coef, algos.AdvantageRule.of(self.config))

    def loss(self, datums: list[dict]) -> tuple[list[dict], ProtocolLoss | CustomLoss]:
        """The datums to train and their loss: the protocol's (ppo/cispo with the config's clip
        bounds as thresholds), or GSPO as a custom loss over the sampler's logprobs."""
        loss = self.config.loss
        if loss.name == "gspo":
            data, compute = algos.gspo_custom_loss(datums, *algos.ratio_bounds(loss))
            return data, CustomLoss(compute, ref_key="logprobs")
        return datums, ProtocolLoss(*algos.protocol_loss(loss))

    @staticmethod
    def samples(batch: Batch, step: int) -> list[dict]:
        return [r.record(step, v) for g, v in zip(batch.groups, batch.versions) for r in g]

    def step(self, step: int, rows: list[int], version: int) -> StepWork:
        config = self.config
        batch, resampled = self.gather(step, version)
        datums, kept, kl_estimate = self.advantages(batch)
        train_datums, loss = self.loss(datums)
        rewards = [r.reward for g in batch.groups for r in g if not r.failed]
        fields: dict[str, Any] = {
            "reward": statistics.fmean(rewards) if rewards else float("nan"),
            "pass_rate": sum(x >= config.pass_threshold for x in rewards) / len(rewards) if rewards else float("nan"),
            "groups_trained": kept, "groups": len(batch.groups),
            "sampled_tokens": sum(len(r.tokens) for g in batch.groups for r in g),
            "sample_time_s": batch.sample_time_s, "sampled_with_version": batch.version, "staleness": step - batch.version,
        }  # fmt: skip
        if kl_estimate is not None:
            fields["kl_policy_base"] = kl_estimate
        fields.update(resampled)
        bounds = algos.clip_bounds(config.loss) if isinstance(loss, ProtocolLoss) else None

        def trained(result: dict | None) -> dict:
            out = health(batch, config, result, datums)
            if isinstance(loss, ProtocolLoss):  # a custom loss's own metrics (GSPO's loss, ratios) are in fields
                out["loss"] = ((result or {}).get("metrics") or {}).get("loss:sum")
            if bounds is not None:
                out.update(algos.clip_fractions(datums, (result or {}).get("loss_fn_outputs") or [], *bounds))
            for warning in self.warnings.check({"step": step + 1, **out}):
                self.sink.message(warning)
            return out

        return StepWork(train_datums, loss, fields, trained, self.samples(batch, step + 1), tokens=fields["sampled_tokens"])

    def submit_eval(self, version: int) -> Waiter | None:
        prompts = self.data.eval
        if not prompts:
            return None
        return lambda: evaluate(self.rollouts, prompts, self.config, version)

    def record_extras(self) -> dict:
        return self.judges.step_metrics()

    def final_line(self, baseline: dict | None, last: dict) -> str | None:
        return f"Final eval: mean reward {last['eval_reward_mean']:.3f}, pass rate {last['eval_pass_rate']:.0%}"

    def close(self) -> None:
        judges = getattr(self, "judges", None)
        if judges is not None:
            judges.close()


@dataclass
class _BaseModelRun:
    """A run as :class:`Rollouts` sees it, for `loops reward test`: the config and the base
    model's sampler, which samples the replies (there is no policy yet) and is the base too."""

    loaded: LoadedConfig[RLConfig]
    new_sampler: Callable[[], Any]

    @property
    def config(self) -> RLConfig:
        return self.loaded.config

    def new_sampler_client(self) -> Any:
        return self.new_sampler()

    def new_base_sampler_client(self) -> Any:
        return self.new_sampler()


def reward_test(loaded: LoadedConfig[RLConfig], data: LoadedData, new_sampler, rows: int, serving: Any = None) -> list[dict]:
    """`loops reward test`: one reply (or episode) per row for the first ``rows`` rows, sampled
    from the base model, scored as training scores them (isolated); their samples.jsonl records.
    ``serving`` (client, api_key, new_model_sampler_client) serves a checkpoint or base model judge."""
    from baseten_loops_cli.training.rewards.judge import JudgeMeter

    config = loaded.config
    rollouts = Rollouts(_BaseModelRun(loaded, new_sampler), data.tokenizer, data.reward)
    rollouts.kl = False
    judges = JudgeMeter([fn for _, fn, _ in data.reward or []], serving) if serving is not None else None
    try:
        batch = rollouts.sample(data.train[:rows], step=0, version=0, n=1, sampling=config.sampling, seed=config.seed)
    finally:
        if judges is not None:
            judges.close()
    return [r.record(0, 0) for g in batch.groups for r in g]


TEMPLATE = """\
# loops RL config (GRPO-style group advantages). Check it with `loops train validate FILE`.
kind: rl
""" + COMMON + GROUPS + """
data:
  prompts: data/prompts.jsonl   # JSONL: {{"prompt": "...", "answer": "..."}} (or "messages")
  # eval_prompts: data/eval_prompts.jsonl

reward: exact_match             # exact_match | numeric_match | contains | starts_with | regex | format | length | repetition | path/to/file.py:function
# reward:
#   fn: regex
#   pattern: "^ANSWER: \\\\d+$"
# reward:                       # or a weighted list, each logged as reward/NAME
#   - {{fn: exact_match}}
#   - {{fn: length, max_chars: 200, weight: 0.5}}
# env: envs/my_env.py:MyEnv     # multi-turn: an environment plays one episode per row (README "Environments")
# env_args: {{}}
# max_turns: 8
# reward_timeout_s: 60          # per reward/env call; past it (or on a raise) the rollout fails
# max_failed_fraction: 0.1      # the run stops (resumable) when more of a batch fails

loss:
  name: importance_sampling     # importance_sampling | ppo | cispo | dro | gspo
  # config: {{clip_low_threshold: 0.8, clip_high_threshold: 1.2}}
  # clip_low: 0.2               # or the epsilons: ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO: 0.2, 0.28)
  # clip_high: 0.28
# algorithm: dapo               # a preset: grpo | dr_grpo | dapo | gspo | rloo (docs/rl-algorithms.md); keys set here win
# advantage: {{baseline: group_mean, normalize: none, length_normalization: none}}
# overlong: {{max_tokens: 32, buffer: 8, penalty: 1.0}}   # DAPO's soft overlong punishment
# dynamic_sampling: {{max_rounds: 3}}                     # replace groups without signal by new ones

sampling:
  max_tokens: 32
  temperature: 1.0

max_steps_off_policy: 0         # 0 = synchronous; N >= 1 = sample the next batch while training this one
# kl_penalty_coef: 0.0          # per-token KL penalty against the base model
# eval:                         # optional: when training ends, score the final checkpoint as `loops eval` does
#   base: true                  # also score the base model (eval.json + eval.txt in the run directory)
#   # data: data/eval.jsonl     # default: data.eval (SFT) or data.eval_prompts (RL)
"""

KIND = Kind(
    name="rl",
    config_model=RLConfig,
    noun="prompts",
    main_metric="reward",
    metric_names=("reward", "pass_rate", "groups_trained", "groups", "loss", "sampled_tokens", "sample_time_s",
                  "sampled_with_version", "staleness", "kl_policy_base", "eval_reward_mean", "eval_pass_rate",
                  "reward_std", "zero_variance_groups", "completion_tokens", "max_tokens_share", "entropy",
                  "logprob_diff", "failed_rollouts", "judge_requests", "judge_prompt_tokens",
                  "judge_completion_tokens", "clip_low_fraction", "clip_high_fraction", "sequence_ratio_mean",
                  "sequence_ratio_std", "groups_resampled", "resample_rounds", "groups_unfilled", "overlong_penalty"),  # plus reward/NAME and reward_std/NAME for a list of rewards
    step_fields=(
        StepField("reward", "reward", ".3f"), StepField("pass_rate", "pass", ".0%"),
        StepField("groups_trained", "groups", of="groups"),
        StepField("eval_reward_mean", "eval_reward", ".3f", optional=True),
    ),
    template=lambda: TEMPLATE.format(name="my-rl", lr="4.0e-5", schedule="constant"),
    load_data=load_data,
    estimate=estimate,
    hooks=RLSteps,
    eval_data_key=("data", "eval_prompts"),
    train_data_key=("data", "prompts"),
    eval_task=eval_task,
    # `reward: file.py:fn`, `reward: {fn: ...}`, a list of either, `env: file.py:Class` ("*": each list item)
    code_keys=(("reward",), ("reward", "fn"), ("reward", "*"), ("reward", "*", "fn"), ("env",)),
    reward_key="reward",
    capabilities_use_case="rl",
    row_purpose="prompts",
    row_formats=("prompt_only",),
    render_rows=render_rows,
    reward_test=reward_test,
)
