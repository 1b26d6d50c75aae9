"""On-policy distillation (``kind: distill``): the student samples, a teacher scores its tokens.

Per step: publish the student's weights to its sampler, sample ``group_size`` completions for
each of ``groups_per_batch`` prompts (with the sampler's logprobs), have the teacher score every
completion (its prompt logprobs over prompt + completion, training/rewards/teacher.py), and train with
the ``importance_sampling`` loss on the per-token advantage

    A_t = kl_coef * (logp_teacher(t) - logp_student(t))  [+ reward_weight * (reward - group mean)]

the negative reverse KL of Thinking Machines' "On-Policy Distillation" (and the Tinker cookbook's
distillation recipe), optionally mixed with a task reward. Only protocol routes are used (sampler
prompt logprobs, ``forward_backward`` with a built-in loss), so it runs on Baseten unchanged.

Metrics: ``reverse_kl`` (mean over sampled tokens of logp_student - logp_teacher), and on the eval
prompts ``eval_reverse_kl`` and ``eval_teacher_agreement`` (the fraction of the student's greedy
tokens that are the teacher's top-1 choice), plus ``eval_reward_mean`` with a reward.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from baseten_loops_cli.training.config import CommonConfig, PromptsData, RewardConfig, SamplingConfig, Section
from baseten_loops_cli.training.data.datums import Prompt, rl_datum
from baseten_loops_cli.training.kinds import Estimate, Kind, LoadedData, StepField
from baseten_loops_cli.training.loop.core import Loop, ProtocolLoss, StepHooks, StepWork, Waiter, step_rows, total_steps
from baseten_loops_cli.training.session import TrainingSession
from baseten_loops_cli.training.templates import COMMON, GROUPS
from baseten_loops_cli.training.rewards.teacher import (
    Endpoint, ServedModel, TeacherScores, ascore_with_sampler, check_same_tokenizer, is_checkpoint_ref,
)  # fmt: skip

LOSS = "importance_sampling"


class TeacherConfig(Section):
    """``teacher: RUN:final`` (shorthand for ``model:``), or ``model:`` a sampler checkpoint
    (``RUN:NAME``, ``bt://...``) or a base model; or ``url:`` an OpenAI-compatible endpoint
    (``model:`` then names the endpoint's model) with ``api_key_env:`` naming the variable
    holding its key (the key itself is never written anywhere)."""

    model: str | None = Field(None, description="RUN:NAME or bt:// sampler checkpoint, or a base model name.")
    url: str | None = Field(None, description="OpenAI-compatible base URL (.../v1) returning prompt logprobs.")
    api_key_env: str | None = Field(None, description="The environment variable holding the endpoint's key.")

    @model_validator(mode="after")
    def _one_teacher(self) -> "TeacherConfig":
        if not self.model and not self.url:
            raise ValueError("name the teacher: model (RUN:NAME, bt:// URI or a base model) or url (an OpenAI-compatible endpoint)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, not {self.url!r}")
        if self.api_key_env and not self.url:
            raise ValueError("api_key_env goes with url (a checkpoint or base model teacher uses the backend's key)")
        return self


class DistillConfig(CommonConfig):
    SECTIONS = CommonConfig.SECTIONS + ("sampling",)
    kind: Literal["distill"]
    data: PromptsData
    teacher: TeacherConfig
    group_size: int = Field(4, ge=1)
    groups_per_batch: int = Field(8, ge=1)
    kl_coef: float = Field(1.0, gt=0, description="Weight of the per-token negative reverse KL advantage.")
    reward: RewardConfig | None = Field(None, description="Optional task reward mixed into the advantage.")
    reward_weight: float = Field(1.0, ge=0, description="Weight of (reward - group mean) in the advantage.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    pass_threshold: float = Field(1.0, description="With a reward: a rollout passes when its reward is at least this.")

    @field_validator("teacher", mode="before")
    @classmethod
    def _teacher_shorthand(cls, value: Any) -> Any:
        return {"model": value} if isinstance(value, str) else value

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_shorthand(cls, value: Any) -> Any:
        return {"fn": value} if isinstance(value, str) else value


# ------------------------------------------------------------------ data, checks, estimate
def load_data(loaded, tokenizer: Any) -> LoadedData:
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.data.datums import load_prompts

    config = loaded.config
    train_spec, eval_spec = kinds.data_specs(loaded)  # any format and source, read by the data layer
    kwargs = {"max_seq_len": config.max_seq_len, "max_tokens": config.sampling.max_tokens}
    train = load_prompts(train_spec, tokenizer, **kwargs)
    evals = load_prompts(eval_spec, tokenizer, **kwargs) if eval_spec else None
    reward = None
    if config.reward is not None:
        from baseten_loops_cli.training.rewards.builtins import build_reward

        reward = build_reward(config.reward, loaded.base_dir)
    teacher = config.teacher
    if teacher.url is None and not is_checkpoint_ref(teacher.model):
        # A base model teacher: its tokenizer is known without a backend (validate --offline too).
        from baseten_loops_cli.tokenization import get_tokenizer

        check_same_tokenizer(tokenizer, get_tokenizer(teacher.model), student_name=config.base_model,
                             teacher_name=teacher.model, where=loaded.where("teacher"))  # fmt: skip
    return LoadedData(tokenizer, train, evals, reward, train_spec.reports + (eval_spec.reports if eval_spec else []))  # the data notes


def check(client: Any, loaded: Any) -> None:
    """Before provisioning: the teacher exists, scores prompts, and tokenizes as the student."""
    from baseten_loops_cli.tokenization import get_tokenizer

    config = loaded.config
    teacher = config.teacher
    student = get_tokenizer(config.base_model)
    if teacher.url:
        where = f"{loaded.where('teacher', 'url')}: teacher.url"
        Endpoint(teacher.url, teacher.model, teacher.api_key_env, where=where).check(student, config.base_model)
        return
    if not is_checkpoint_ref(teacher.model):
        return  # a base model: checked in load_data
    from baseten_loops_cli.services.resolve import resolve_checkpoint

    checkpoint = resolve_checkpoint(client, teacher.model, prefer="sampler")
    if checkpoint.base_model and checkpoint.base_model != config.base_model:
        check_same_tokenizer(student, get_tokenizer(checkpoint.base_model), student_name=config.base_model,
                             teacher_name=f"{teacher.model} ({checkpoint.base_model})", where=loaded.where("teacher"))  # fmt: skip


def prompts_for_step(prompts: list[Prompt], step: int, config) -> list[Prompt]:
    return [prompts[i] for i in step_rows(len(prompts), config.groups_per_batch, step, config, shuffle=config.data.shuffle)]


def estimate(config, data: LoadedData) -> Estimate:
    """Upper bounds: every completion at ``sampling.max_tokens``; the teacher scores each
    prompt + completion once (a forward pass, no backward), and each eval prompt once per eval."""
    steps = total_steps(len(data.train), config.groups_per_batch, config.epochs, config.max_steps)
    completions = config.groups_per_batch * config.group_size
    prompt_tokens = sum(len(p.tokens) for step in range(steps) for p in prompts_for_step(data.train, step, config))
    sample_tokens = steps * completions * config.sampling.max_tokens
    sequences = prompt_tokens * config.group_size + sample_tokens
    evals = times = 0
    if data.eval:
        times = 1 + (steps // config.eval_every if config.eval_every else 0)
        evals = times * sum(len(p.tokens) + config.sampling.max_tokens for p in data.eval)
    where = config.teacher.url or config.teacher.model
    notes = ["distill token counts are upper bounds (every completion at sampling.max_tokens)",
             f"the teacher ({where}) scores every sampled sequence: ~{sequences + evals:,} tokens"]
    judge = None
    if config.reward is not None:
        from baseten_loops_cli.training.rewards.judge import plan_tokens

        passes = [prompts_for_step(data.train, step, config) for step in range(steps)]
        if data.eval:  # before training, every eval_every steps and at the end: one reply per prompt
            passes += [[p] for _ in range(times + 1) for p in data.eval]
        judge = plan_tokens(config.reward, data.tokenizer, passes, group_size=config.group_size,
                            reply_tokens=config.sampling.max_tokens)
    return Estimate(steps, sequences - steps * completions, sample_tokens + evals, scored_tokens=sequences + evals,
                    notes=notes, judge=judge)


# ------------------------------------------------------------------ the teacher, as the loop uses it
class Teacher:
    """Scores sequences for one run: opened once (a checkpoint's sampler may be started for it),
    closed at the end (a sampler it started is deactivated)."""

    def __init__(self, session: TrainingSession[DistillConfig]):
        self.session = session
        spec = session.config.teacher
        self.endpoint: Endpoint | None = None
        self._served: ServedModel | None = None
        if spec.url:
            self.endpoint = Endpoint(spec.url, spec.model, spec.api_key_env)
        else:
            assert spec.model, "TeacherConfig._one_teacher: without a url, a model"
            self._served = ServedModel(session, spec.model)
        self._model_name: str | None = None

    def clients(self) -> tuple[Any, Any]:
        """(client, pin) for one event loop."""
        if self._served is not None:
            return self._served.client()
        assert self.endpoint is not None  # __init__ opens one or the other
        client = self.endpoint._client()
        if self._model_name is None:
            self._model_name = self.endpoint.model_name(client)
        return client, None

    async def ascore(self, client: Any, pin: str | None, tokens: list[int], prompt_len: int) -> TeacherScores:
        if self.endpoint is not None:
            return await self.endpoint.ascore(client, self._model_name or "", tokens, prompt_len)
        return await ascore_with_sampler(client, tokens, prompt_len, pin)

    def close(self) -> None:
        if self._served is not None:
            self._served.close()


# ------------------------------------------------------------------ rollouts and advantages
@dataclass
class Rollout:
    prompt: Prompt
    tokens: list[int]
    logprobs: list[float]  # the student's (sampler) logprobs of its tokens
    text: str
    stop_reason: str
    teacher: TeacherScores | None = None
    reward: float | None = None


def advantages(rollout: Rollout, kl_coef: float, reward_term: float = 0.0) -> list[float]:
    """Per completion token: ``kl_coef * (logp_teacher - logp_student) + reward_term``."""
    assert rollout.teacher is not None
    return [kl_coef * (t - s) + reward_term for t, s in zip(rollout.teacher.logprobs, rollout.logprobs)]


def datums_of(groups: list[list[Rollout]], config) -> tuple[list[dict], list[float]]:
    """The importance_sampling datums of a batch, and every token's reverse KL estimate
    (logp_student - logp_teacher)."""
    datums: list[dict] = []
    kl_terms: list[float] = []
    for group in groups:
        rewards = [r.reward for r in group if r.reward is not None]  # all or none: one reward scores the group
        mean = statistics.fmean(rewards) if rewards else 0.0
        for r in group:
            if not r.tokens or r.teacher is None or len(r.logprobs) != len(r.tokens):
                continue
            reward_term = config.reward_weight * (r.reward - mean) if r.reward is not None else 0.0
            kl_terms.extend(s - t for s, t in zip(r.logprobs, r.teacher.logprobs))
            datums.append(rl_datum(r.prompt.tokens, r.tokens, r.logprobs, advantages(r, config.kl_coef, reward_term)))
    return datums, kl_terms


def sample_and_score(session: TrainingSession[DistillConfig], teacher: Teacher, tokenizer: Any, reward: tuple[str, Any] | None,
                     prompts: list[Prompt], *, n: int, sampling: Any, seed: int, version: int | None) -> list[list[Rollout]]:
    """Sample ``n`` completions per prompt (all in flight), then have the teacher score each."""
    from baseten_loops_cli.training.rewards.builtins import completion_text, score

    async def gather() -> list[list[Rollout]]:
        sampler = session.new_sampler_client()
        scorer, pin = teacher.clients()
        try:
            async def group(i: int, prompt: Prompt) -> list[Rollout]:
                result = await sampler.asample(
                    prompt.tokens, n=n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                    top_p=sampling.top_p, top_k=sampling.top_k, seed=seed + i, stop=list(tokenizer.stop_token_ids),
                    min_policy_version=version or None,
                )  # fmt: skip
                texts = [completion_text(tokenizer, seq.tokens, sampling.stop) for seq in result.sequences]
                if reward is None:
                    values: list = [None] * len(texts)
                elif hasattr(reward[1], "score_group"):  # a judge in mode: group grades the group at once
                    values = await asyncio.to_thread(reward[1].score_group, texts, prompt.row)
                else:
                    values = [score(reward[0], reward[1], text, prompt.row, prompt.source) for text in texts]
                rollouts = [Rollout(prompt, list(seq.tokens), list(seq.logprobs or []), text, seq.stop_reason, reward=value)
                            for seq, text, value in zip(result.sequences, texts, values)]
                async def teach(r: Rollout) -> None:
                    r.teacher = await teacher.ascore(scorer, pin, r.prompt.tokens + r.tokens, len(r.prompt.tokens))
                await asyncio.gather(*(teach(r) for r in rollouts if r.tokens))
                return rollouts

            return list(await asyncio.gather(*(group(i, p) for i, p in enumerate(prompts))))
        finally:
            for client in (sampler, scorer):
                aclose = getattr(client, "aclose", None)
                if aclose is not None:
                    await aclose()
                client.close()

    return asyncio.run(gather())


def evaluate(session: TrainingSession[DistillConfig], teacher: Teacher, tokenizer: Any, reward, prompts: list[Prompt], config,
             version: int | None) -> dict:
    """The student's greedy answers to the eval prompts, scored by the teacher."""
    greedy = config.sampling.model_copy(update={"temperature": 0.0})
    groups = sample_and_score(session, teacher, tokenizer, reward, prompts, n=1, sampling=greedy,
                              seed=config.seed + 7, version=version)  # fmt: skip
    scored = [(r, r.teacher) for g in groups for r in g if r.teacher is not None]
    kl = [s - t for r, teacher in scored for s, t in zip(r.logprobs, teacher.logprobs)]
    agree = [a for _, teacher in scored if teacher.agrees is not None for a in teacher.agrees]
    out = {"eval_reverse_kl": statistics.fmean(kl) if kl else float("nan"),
           "eval_teacher_agreement": statistics.fmean(agree) if agree else float("nan")}
    rewards = [r.reward for g in groups for r in g if r.reward is not None]
    if rewards:
        out["eval_reward_mean"] = statistics.fmean(rewards)
        out["eval_pass_rate"] = sum(x >= config.pass_threshold for x in rewards) / len(rewards)
    return out


class DistillSteps(StepHooks[DistillConfig]):
    """Per step: the student samples ``group_size`` completions of each prompt with its current
    weights, the teacher scores every token, and the datums carry the per-token advantage."""

    main_metric = "reverse_kl"
    on_policy = True
    baseline_eval = True

    def rows_per_step(self) -> int:
        return self.config.groups_per_batch

    def begin(self, loop: Loop) -> None:
        from baseten_loops_cli.training.rewards.judge import JudgeMeter

        reward = self.data.reward
        self.teacher = Teacher(self.session)
        self.judges = JudgeMeter([reward[1]] if reward else [], self.session)  # judges sample on the run's backend

    def step(self, step: int, rows: list[int], version: int) -> StepWork:
        config, started = self.config, time.monotonic()
        groups = sample_and_score(self.session, self.teacher, self.data.tokenizer, self.data.reward,
                                  [self.data.train[i] for i in rows], n=config.group_size, sampling=config.sampling,
                                  seed=config.seed * 1_000_003 + step * 1009, version=version)  # fmt: skip
        datums, kl_terms = datums_of(groups, config)
        sampled = sum(len(r.tokens) for g in groups for r in g)
        fields = {"reverse_kl": statistics.fmean(kl_terms) if kl_terms else float("nan"), "sampled_tokens": sampled,
                  "sample_time_s": time.monotonic() - started}
        rewards = [r.reward for g in groups for r in g if r.reward is not None]
        if rewards:
            fields["reward"] = statistics.fmean(rewards)
        samples = [
            {"step": step + 1, "prompt": r.prompt.text, "completion": r.text, "stop_reason": r.stop_reason,
             "reverse_kl": statistics.fmean(s - t for s, t in zip(r.logprobs, r.teacher.logprobs)) if r.teacher and r.tokens else None,
             **({"reward": r.reward} if r.reward is not None else {})}
            for g in groups for r in g
        ]  # fmt: skip
        return StepWork(datums, ProtocolLoss(LOSS), fields, _loss_sum, samples, tokens=sampled)

    def submit_eval(self, version: int) -> Waiter | None:
        prompts = self.data.eval
        if not prompts:
            return None
        return lambda: evaluate(self.session, self.teacher, self.data.tokenizer, self.data.reward, prompts, self.config,
                                version)

    def record_extras(self) -> dict:
        return self.judges.step_metrics()  # the judge's requests and tokens since the last record

    def baseline_line(self, baseline: dict) -> str | None:
        return "Before training: teacher agreement {:.1%}, reverse KL {:.3f}".format(
            baseline["eval_teacher_agreement"], baseline["eval_reverse_kl"])

    def final_line(self, baseline: dict | None, last: dict) -> str | None:
        return "Final eval: teacher agreement {:.1%}, reverse KL {:.3f}".format(
            last["eval_teacher_agreement"], last["eval_reverse_kl"])

    def close(self) -> None:
        for opened in (getattr(self, "teacher", None), getattr(self, "judges", None)):
            if opened is not None:
                opened.close()


def _loss_sum(result: dict | None) -> dict:
    return {"loss": ((result or {}).get("metrics") or {}).get("loss:sum")}


TEMPLATE = """\
# loops on-policy distillation config: the student samples, the teacher scores every token.
# Check it with `loops train validate FILE`.
kind: distill
""" + COMMON + GROUPS + """
data:
  prompts: data/prompts.jsonl   # JSONL: {{"prompt": "..."}} (or "messages"; "answer" for a reward)
  # eval_prompts: data/eval_prompts.jsonl   # teacher agreement on held-out prompts

teacher: RUN_ID:final           # a sampler checkpoint (RUN:NAME, bt://...) or a base model of the same tokenizer
# teacher:
#   url: https://.../v1         # an OpenAI-compatible endpoint returning prompt logprobs (echo + logprobs)
#   model: my-teacher
#   api_key_env: TEACHER_API_KEY  # the variable holding its key (never written anywhere)

kl_coef: 1.0                    # advantage = kl_coef * (logp_teacher - logp_student) per token
# reward: exact_match           # optional task reward, mixed in as reward_weight * (reward - group mean)
# reward_weight: 1.0

sampling:
  max_tokens: 32
  temperature: 1.0
"""

KIND = Kind(
    name="distill",
    config_model=DistillConfig,
    noun="prompts",
    main_metric="reverse_kl",
    metric_names=("reverse_kl", "loss", "reward", "judge_requests", "judge_prompt_tokens", "judge_completion_tokens", "sampled_tokens", "sample_time_s", "eval_reverse_kl",
                  "eval_teacher_agreement", "eval_reward_mean", "eval_pass_rate"),
    step_fields=(
        StepField("reverse_kl", "kl", ".4f"),
        StepField("reward", "reward", ".3f", optional=True),
        StepField("eval_teacher_agreement", "agree", ".0%", optional=True),
    ),
    train_data_key=("data", "prompts"),
    eval_data_key=("data", "eval_prompts"),
    row_purpose="prompts",
    template=lambda: TEMPLATE.format(name="my-distill", lr="1.0e-4", schedule="constant"),
    load_data=load_data,
    estimate=estimate,
    hooks=DistillSteps,
    code_keys=(("reward",), ("reward", "fn")),
    reward_key="reward",
    capabilities_use_case="rl",
    check=check,
    title="On-policy distillation",
)
