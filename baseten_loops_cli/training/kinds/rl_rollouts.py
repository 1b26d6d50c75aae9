"""Kind rl's rollouts: a step's groups sampled through the sampler (every request in flight
together), scored by the config's rewards (each run isolated: training/rewards/isolation.py) or
played as environment episodes (training/rewards/envs.py), and scored by the frozen base model
when a KL penalty is on. kinds/rl.py turns them into datums and drives the loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from baseten_loops_cli.training.config import RewardConfig
from baseten_loops_cli.training.data.datums import Prompt
from baseten_loops_cli.training.rewards.builtins import completion_text

if TYPE_CHECKING:
    from baseten_loops_cli.training.config import LoadedConfig
    from baseten_loops_cli.training.kinds.rl import RLConfig

__all__ = ["Batch", "Rollout", "RolloutSession", "Rollouts"]


class RolloutSession(Protocol):
    """What :class:`Rollouts` uses of a run: its config and the samplers of the policy and the
    base model (a TrainingSession; `loops reward test` passes the base model's sampler for both)."""

    @property
    def config(self) -> "RLConfig": ...

    @property
    def loaded(self) -> "LoadedConfig[RLConfig]": ...

    def new_sampler_client(self) -> Any: ...

    def new_base_sampler_client(self) -> Any: ...


@dataclass
class Rollout:
    prompt: Prompt
    tokens: list[int]
    logprobs: list[float]
    text: str
    reward: float
    stop_reason: str
    base_logprobs: list[float] | None = None  # the base model's, when a KL penalty is on
    components: dict[str, float] | None = None  # each reward of a list of rewards, unweighted
    error: str | None = None  # the rollout failed (its reward or environment): the reason
    traceback: str | None = None
    episode: Any = None  # envs.Episode, for an environment's rollouts

    @property
    def failed(self) -> bool:
        return self.error is not None

    def record(self, step: int, version: int) -> dict:
        """Its line of samples.jsonl: the prompt and reply, or the whole transcript of an episode."""
        out: dict[str, Any] = {"step": step, "prompt": self.prompt.text, "completion": self.text, "reward": self.reward,
                               "policy_version": version, "stop_reason": self.stop_reason}
        if self.components:
            out["rewards"] = self.components
        if self.episode is not None:
            from baseten_loops_cli.training.rewards.envs import transcript

            out.update(source=self.prompt.source, transcript=transcript(self.episode),
                       turn_rewards=[t.reward for t in self.episode.turns], turns=len(self.episode.turns),
                       done=self.episode.done)
        if self.error is not None:
            out.update(failed=True, error=self.error, traceback=self.traceback)
        return out


@dataclass
class Batch:
    """The sampled groups of one step, each tagged with the policy version that sampled it
    (the sampler's ``x-trainers-policy-version``, or the floor asked for when it does not say)."""

    step: int
    groups: list[list[Rollout]]
    versions: list[int]
    sample_time_s: float

    @property
    def version(self) -> int:
        """The oldest policy among the groups: what staleness is measured by."""
        return min(self.versions) if self.versions else 0


class Rollouts:
    """Samples groups through the sampler (async, all requests in flight) and scores them."""

    def __init__(self, session: RolloutSession, tokenizer: Any, rewards: list[tuple[str, Any, float]] | None):
        from baseten_loops_cli.training.rewards.envs import load_env

        config = session.config
        self.session = session
        self.tokenizer = tokenizer
        self.rewards = rewards or []
        self.reward_fn = self.rewards or None  # truthy when the config has a reward
        self.listed = isinstance(config.reward, list)
        self.reward_name = config.reward.fn if isinstance(config.reward, RewardConfig) else None
        self.kl = config.kl_penalty_coef > 0
        self.env_cls = load_env(config.env, session.loaded.base_dir) if config.env else None
        self.timeout_s, self.workers = config.reward_timeout_s, config.reward_workers

    async def _score(self, isolated, prompt: Prompt, text: str) -> tuple[float, str | None, str | None, dict | None]:
        """(weighted sum, error, traceback, each reward): the rewards of one reply, each run isolated."""
        return (await self._score_group(isolated, prompt, [text]))[0]

    async def _score_group(self, isolated, prompt: Prompt, texts: list[str]) -> list[tuple[float, str | None, str | None, dict | None]]:
        """:meth:`_score` for every reply of a group. A reward with ``score_group(texts, row)``
        (a judge in ``mode: group``) is called once for the whole group, under the same isolation
        (its own thread, reward_timeout_s); its failure fails every rollout of the group."""
        from baseten_loops_cli.training.rewards.isolation import RolloutFailed
        from baseten_loops_cli.training.rewards.builtins import reward_value

        def checked(what: str, value: Any) -> tuple[float | None, str | None, str | None]:
            number = reward_value(value)
            if number is None:
                return None, f"{what} returned {value!r:.100}, not a finite number (prompt {prompt.source})", None
            return number, None, None

        async def one(what: str, fn: Any, text: str) -> tuple[float | None, str | None, str | None]:
            try:
                value = await isolated.call(what, fn, text, prompt.row)
            except RolloutFailed as failed:
                return None, f"{failed} (prompt {prompt.source})", failed.detail
            return checked(what, value)

        async def each(label: str, fn: Any) -> list[tuple[float | None, str | None, str | None]]:
            what = f"reward {self.reward_name or label!r}"
            group = getattr(fn, "score_group", None)
            if group is None:
                return list(await asyncio.gather(*(one(what, fn, text) for text in texts)))
            try:
                values = await isolated.call(what, group, texts, prompt.row)
            except RolloutFailed as failed:
                return [(None, f"{failed} (prompt {prompt.source})", failed.detail)] * len(texts)
            if not isinstance(values, (list, tuple)) or len(values) != len(texts):
                count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
                error = f"{what} returned {count} scores for a group of {len(texts)} replies (prompt {prompt.source})"
                return [(None, error, None)] * len(texts)
            return [checked(what, v) for v in values]

        per_reward = await asyncio.gather(*(each(label, fn) for label, fn, _ in self.rewards))
        out: list[tuple[float, str | None, str | None, dict | None]] = []
        for i in range(len(texts)):
            results = [values[i] for values in per_reward]
            failed = next(((error, trace) for _, error, trace in results if error is not None), None)
            if failed is not None:
                out.append((0.0, failed[0], failed[1], None))
                continue
            scores = [value for value, _, _ in results if value is not None]  # no error: every one a number
            total = sum(weight * value for (_, _, weight), value in zip(self.rewards, scores))
            components = {label: value for (label, _, _), value in zip(self.rewards, scores)} if self.listed else None
            out.append((total, None, None, components))
        return out

    async def _episodes(self, sampler, isolated, prompt: Prompt, *, n: int, seed: int, version: int,
                        sampling) -> tuple[list[Rollout], int]:
        """``n`` episodes of the environment on one row, every turn's request in flight together."""
        from baseten_loops_cli.training.rewards.envs import run_episode

        config = self.session.config
        stop = list(self.tokenizer.stop_token_ids)

        async def sample(tokens: list[int], max_tokens: int, turn_seed: int):
            result = await sampler.asample(
                tokens, n=1, max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, seed=turn_seed, stop=stop, min_policy_version=version or None,
            )  # fmt: skip
            seq = result.sequences[0]
            served = result.policy_version if result.policy_version is not None else version
            return list(seq.tokens), list(seq.logprobs or []), seq.stop_reason, int(served)

        def reply(tokens: list[int]) -> str:
            return completion_text(self.tokenizer, tokens, sampling.stop)

        episodes = await asyncio.gather(*(
            run_episode(self.env_cls, config.env_args, prompt.row, tokenizer=self.tokenizer, isolated=isolated,
                        sample=sample, seed=seed * 1009 + j, max_turns=config.max_turns,
                        max_tokens=sampling.max_tokens, max_seq_len=config.max_seq_len, reply_text=reply)
            for j in range(n)
        ))  # fmt: skip
        rollouts = []
        for ep in episodes:
            last = ep.turns[-1] if ep.turns else None
            opening = prompt if prompt.text else Prompt([], prompt.row, prompt.source,
                                                        ep.opening[-1]["content"] if ep.opening else "")
            rollout = Rollout(opening, [t for turn in ep.turns for t in turn.tokens],
                              [lp for turn in ep.turns for lp in turn.logprobs], last.text if last else "",
                              ep.total(config.turn_discount), last.stop_reason if last else "none",
                              error=ep.error, traceback=ep.traceback, episode=ep)
            if rollout.error is None and self.reward_fn is not None and last is not None:
                extra, rollout.error, rollout.traceback, rollout.components = await self._score(isolated, prompt, last.text)
                rollout.reward += extra * config.turn_discount ** (len(ep.turns) - 1)
            rollouts.append(rollout)
        served = min((ep.version for ep in episodes if ep.turns), default=version)
        return rollouts, served

    async def _base_logprobs(self, base_sampler, rollout: Rollout) -> None:
        """Score the completion under the frozen base model (prompt logprobs of prompt+completion)."""
        full = rollout.prompt.tokens + rollout.tokens
        result = await base_sampler.asample(full, n=1, max_tokens=1, temperature=1.0, prompt_logprobs=True)
        scored = result.prompt_logprobs or []
        tail = scored[len(rollout.prompt.tokens) :]
        rollout.base_logprobs = [float(x) if x is not None else 0.0 for x in tail]

    async def _group(
        self, sampler, isolated, prompt: Prompt, *, n: int, seed: int, version: int, sampling
    ) -> tuple[list[Rollout], int]:
        if self.env_cls is not None:
            return await self._episodes(sampler, isolated, prompt, n=n, seed=seed, version=version, sampling=sampling)
        result = await sampler.asample(
            prompt.tokens,
            n=n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=seed,
            stop=list(self.tokenizer.stop_token_ids),
            min_policy_version=version or None,
        )
        texts = [completion_text(self.tokenizer, seq.tokens, sampling.stop) for seq in result.sequences]
        scores = await self._score_group(isolated, prompt, texts)
        rollouts = [
            Rollout(prompt, list(seq.tokens), list(seq.logprobs or []), text, value, seq.stop_reason,
                    components=components, error=error, traceback=trace)
            for seq, text, (value, error, trace, components) in zip(result.sequences, texts, scores)
        ]
        served = result.policy_version if result.policy_version is not None else version
        return rollouts, int(served)

    def sample(self, prompts: list[Prompt], *, step: int, version: int, n: int, sampling, seed: int) -> Batch:
        started = time.monotonic()

        # One client per batch: batches may be sampled from two threads (async mode), and an
        # async HTTP client belongs to the event loop that made it.
        sampler = self.session.new_sampler_client()
        base_sampler = self.session.new_base_sampler_client() if self.kl else None

        async def gather() -> list[tuple[list[Rollout], int]]:
            from baseten_loops_cli.training.rewards.isolation import Isolated

            isolated = Isolated(timeout_s=self.timeout_s, workers=self.workers)
            try:
                tagged = await asyncio.gather(
                    *(self._group(sampler, isolated, p, n=n, seed=seed * 1_000_003 + step * 1009 + i, version=version, sampling=sampling)
                      for i, p in enumerate(prompts))
                )  # fmt: skip
                if base_sampler is not None:
                    await asyncio.gather(
                        *(self._base_logprobs(base_sampler, r) for g, _ in tagged for r in g
                          if r.tokens and r.episode is None)
                    )
                return tagged
            finally:
                for client in (sampler, base_sampler):
                    if client is not None:
                        await client.aclose()
                        client.close()

        tagged = asyncio.run(gather())
        return Batch(step, [g for g, _ in tagged], [v for _, v in tagged], time.monotonic() - started)
