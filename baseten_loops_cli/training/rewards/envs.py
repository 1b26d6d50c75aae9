"""RL environments (``env: path/to/file.py:ClassName`` in an ``kind: rl`` config): multi-turn
episodes, one per data row.

The protocol (README "Environments")::

    class MyEnv:
        def __init__(self, row: dict, **env_args): ...
        def reset(self) -> list[dict]: ...         # the opening messages
        def step(self, reply: str) -> Step: ...    # Step(reward, done, messages, info) or a dict

``reset`` and ``step`` may be ``async def``. Every call into the environment goes through
:class:`~baseten_loops_cli.training.rewards.isolation.Isolated` (per-call timeout, worker threads), so
an environment that raises, hangs or returns nonsense fails its episode, not the run.

An episode is one token sequence: the opening prompt, then for each turn the sampled reply
(exactly the sampler's tokens and logprobs, which is what the trainer scores) followed by the
environment's tokens: the end-of-turn the reply did not sample itself, the environment's
messages and the next generation prompt, rendered with the model's chat template. The trained
datum covers every reply token (advantage, sampler logprob) and weighs the environment's
tokens 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from baseten_loops_cli.training.rewards.isolation import Isolated, RolloutFailed
from baseten_loops_cli.training.rewards.builtins import load_from_file, reward_value

STEP_KEYS = ("reward", "done", "messages", "info")


def load_env(spec: str, base_dir: Path) -> Any:
    """The environment class named by ``path/to/file.py:ClassName`` (relative to the config)."""
    return load_from_file(spec, base_dir, "env", callable_hint="class")


@dataclass
class Turn:
    """One reply of an episode and what the environment made of it."""

    env_tokens: list[int]  # tokens before this reply that the environment added (turn 0: the prompt)
    tokens: list[int]
    logprobs: list[float]
    text: str
    stop_reason: str
    reward: float = 0.0
    messages: list[dict] = field(default_factory=list)  # what the environment answered
    info: dict = field(default_factory=dict)


@dataclass
class Episode:
    opening: list[dict]
    turns: list[Turn] = field(default_factory=list)
    done: bool = False  # the environment ended it (else max_turns or max_seq_len did)
    error: str | None = None  # set when the episode failed: the reason
    traceback: str | None = None
    version: int = 0  # the oldest policy version that sampled a turn

    def total(self, discount: float) -> float:
        return sum(t.reward * discount**i for i, t in enumerate(self.turns))


def _messages(value: Any, what: str) -> list[dict]:
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        raise RolloutFailed(f"{what} must return a list of {{'role': str, 'content': str}} messages, got {value!r:.200}")
    return value


def as_step(value: Any) -> tuple[float, bool, list[dict], dict]:
    """(reward, done, messages, info) of what ``step`` returned: a Step or a dict with its keys."""
    if isinstance(value, dict):
        unknown = set(value) - set(STEP_KEYS)
        if unknown:
            raise RolloutFailed(f"env step returned unknown keys {sorted(unknown)}; a Step has {', '.join(STEP_KEYS)}")
        reward, done = value.get("reward", 0.0), value.get("done", False)
        messages, info = value.get("messages") or [], value.get("info") or {}
    elif all(hasattr(value, k) for k in STEP_KEYS):
        reward, done, messages, info = value.reward, value.done, value.messages or [], value.info or {}
    else:
        raise RolloutFailed(f"env step must return a Step (from baseten_loops_cli import Step) or a dict, got {value!r:.200}")
    number = reward_value(reward)
    if number is None:
        raise RolloutFailed(f"env step returned reward {reward!r}, not a finite number")
    if not isinstance(info, dict):
        info = {"info": info}
    return number, bool(done), _messages(messages, "env step's messages"), info


def conversation_text(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    """The conversation as the model sees it (chat template, or the built-in ChatML)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template_text(messages, generation_prompt)
    from baseten_loops_cli.tokenization.chat import render_chat

    tokens, _ = render_chat(tokenizer, messages, train_on="all", add_generation_prompt=generation_prompt)
    return tokenizer.decode(tokens, skip_special_tokens=False)


def continuation(tokenizer: Any, history: list[dict], reply: str, sampled: list[int], new: list[dict]) -> list[int]:
    """The tokens after a sampled reply up to the next generation prompt: the end of the
    assistant turn the sample did not include itself, then ``new`` messages, rendered."""
    with_reply = history + [{"role": "assistant", "content": reply}]
    header = conversation_text(tokenizer, history, True)
    through = conversation_text(tokenizer, with_reply, False)
    full = conversation_text(tokenizer, with_reply + new, True)
    if not (through.startswith(header) and full.startswith(through)):
        raise RolloutFailed(f"{tokenizer.name}'s chat template renders earlier turns differently once a turn "
                            "is added, so an episode cannot be one token sequence")
    turn = through[len(header):]
    closing = turn[len(reply):] if turn.startswith(reply) else ""
    raw = tokenizer.decode(sampled, skip_special_tokens=False)
    kept = next((j for j in range(len(closing), 0, -1) if raw.endswith(closing[:j])), 0)
    return tokenizer.encode(closing[kept:] + full[len(through):])


# sample(tokens, max_tokens, seed) -> (tokens, logprobs, stop_reason, policy_version)
Sampler = Callable[[list[int], int, int], Awaitable[tuple[list[int], list[float], str, int]]]


async def run_episode(env_cls: Any, env_args: dict, row: dict, *, tokenizer: Any, isolated: Isolated,
                      sample: Sampler, seed: int, max_turns: int, max_tokens: int, max_seq_len: int,
                      reply_text: Callable[[list[int]], str]) -> Episode:
    """Play one episode; a failure of the environment ends it with ``error`` set (never raises
    for the environment's faults)."""
    from baseten_loops_cli.tokenization.chat import render_generation_prompt

    episode = Episode(opening=[])
    try:
        env = await isolated.call("env __init__", lambda: env_cls(row, **env_args))
        episode.opening = _messages(await isolated.call("env reset", env.reset), "env reset")
        history = list(episode.opening)
        tokens = list(render_generation_prompt(tokenizer, history))
        env_tokens = list(tokens)
        versions = []
        for turn_index in range(max_turns):
            budget = min(max_tokens, max_seq_len - len(tokens))
            if budget < 1:
                break  # the conversation filled max_seq_len: truncated like max_turns
            sampled, logprobs, stop_reason, version = await sample(tokens, budget, seed * 131 + turn_index)
            versions.append(version)
            text = reply_text(sampled)
            turn = Turn(env_tokens, list(sampled), list(logprobs), text, stop_reason)
            episode.turns.append(turn)
            turn.reward, done, turn.messages, turn.info = as_step(await isolated.call("env step", env.step, text))
            if done:
                episode.done = True
                break
            history.append({"role": "assistant", "content": text})
            env_tokens = continuation(tokenizer, history[:-1], text, sampled, turn.messages)
            history.extend(turn.messages)
            tokens = tokens + list(sampled) + env_tokens
        episode.version = min(versions) if versions else 0
    except RolloutFailed as failed:
        episode.error, episode.traceback = str(failed), failed.detail
    return episode


def episode_datum(episode: Episode, advantage: float) -> dict | None:
    """The RL datum of a whole episode: every reply token carries ``advantage`` and its sampler
    logprob; the environment's tokens are context (mask 0)."""
    tokens: list[int] = []
    behaviour: list[float] = []
    advantages: list[float] = []
    mask: list[float] = []
    for turn in episode.turns:
        if len(turn.logprobs) != len(turn.tokens):
            return None
        tokens += turn.env_tokens + turn.tokens
        behaviour += [0.0] * len(turn.env_tokens) + [float(x) for x in turn.logprobs]
        advantages += [0.0] * len(turn.env_tokens) + [float(advantage)] * len(turn.tokens)
        mask += [0.0] * len(turn.env_tokens) + [1.0] * len(turn.tokens)
    if not tokens or not any(mask):
        return None
    n = len(tokens) - 1
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
            "logprobs": {"data": behaviour[1:], "dtype": "float32", "shape": [n]},
            "advantages": {"data": advantages[1:], "dtype": "float32", "shape": [n]},
            "mask": {"data": mask[1:], "dtype": "float32", "shape": [n]},
        },
    }


def transcript(episode: Episode) -> list[dict]:
    """The whole conversation, each reply with its turn's reward (for samples.jsonl)."""
    messages = list(episode.opening)
    for turn in episode.turns:
        messages.append({"role": "assistant", "content": turn.text, "reward": turn.reward,
                         **({"info": turn.info} if turn.info else {})})
        messages.extend(turn.messages)
    return messages


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
