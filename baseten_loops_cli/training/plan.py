"""Validate a config end to end and compute its plan: examples, steps, tokens, time and cost.

Everything here is checked before any capacity is provisioned: the schema, that every file
exists and every row parses, token lengths against max_seq_len, the reward, and (when a
backend is reachable) that the base model is offered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.config import DPOConfig, LoadedConfig, RLConfig

ANSWER_REWARDS = ("exact_match", "numeric_match", "contains", "starts_with")

# Rough rates for an uncalibrated time estimate (before the first local run of a model has been
# measured on this machine; see calibration.py): (tokens/s through forward+backward, sampled tokens/s,
# seconds of fixed cost per step). Local rates are measured on 2 CPU cores; remote GPUs are far
# faster, and the estimate there leaves out provisioning (minutes for a cold trainer).
_LOCAL_RATES = {"loops-local/tiny": (15000.0, 2000.0, 0.3)}  # fitted to tiny-sft/tiny-rl, 2026-12-04
_LOCAL_DEFAULT = (250.0, 25.0, 1.0)  # a ~100M-parameter model such as SmolLM2-135M
_REMOTE_RATES = (50000.0, 5000.0, 1.0)
_STARTUP_S = {"local": 5.0}


def _rates(backend_kind: str, base_model: str) -> tuple[float, float, float]:
    if backend_kind == "local":
        return _LOCAL_RATES.get(base_model, _LOCAL_DEFAULT)
    return _REMOTE_RATES


@dataclass
class Plan:
    kind: str
    base_model: str
    examples: int
    eval_examples: int
    steps: int
    train_tokens: int
    sample_tokens: int
    est_seconds: float | None
    est_cost_usd: float | None
    notes: list[str] = field(default_factory=list)
    data: Any = field(default=None, repr=False)  # the loaded examples/prompts, for the loops

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "base_model": self.base_model,
            "examples": self.examples,
            "eval_examples": self.eval_examples,
            "steps": self.steps,
            "train_tokens": self.train_tokens,
            "sample_tokens": self.sample_tokens,
            "estimated_seconds": self.est_seconds,
            "estimated_cost_usd": self.est_cost_usd,
            "notes": self.notes,
        }


@dataclass
class LoadedData:
    tokenizer: Any
    train: list
    eval: list | None
    reward: tuple[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # what the data layer found: formats, rows, overlaps


def load_data(loaded: LoadedConfig) -> LoadedData:
    from baseten_loops_cli.tokenization import get_tokenizer
    from baseten_loops_cli.training import data as data_mod

    config = loaded.config
    try:
        tokenizer = get_tokenizer(config.base_model)
    except Exception as exc:
        message = getattr(exc, "message", None) or str(exc)
        raise ConfigError(f"{loaded.path}: base_model {config.base_model!r}: {message}",
                          hint=getattr(exc, "hint", None)) from None
    from baseten_loops_cli.training.formats import data_specs

    train_spec, eval_spec = data_specs(loaded)
    if isinstance(config, RLConfig):
        from baseten_loops_cli.training.rewards import build_reward

        kwargs = {"max_seq_len": config.max_seq_len, "max_tokens": config.sampling.max_tokens}
        train = data_mod.load_prompts(train_spec, tokenizer, **kwargs)
        evals = data_mod.load_prompts(eval_spec, tokenizer, **kwargs) if eval_spec else None
        reward = build_reward(config.reward, loaded.base_dir)
        if config.reward.fn in ANSWER_REWARDS:
            # Catch a missing answer now, not after capacity is provisioned.
            for prompt in train + (evals or []):
                if "answer" not in prompt.row:
                    raise ConfigError(
                        f"{prompt.source}: reward {config.reward.fn!r} needs an 'answer' field in each prompt row"
                    )
        return LoadedData(tokenizer, train, evals, reward, _data_notes(train_spec, eval_spec))
    if isinstance(config, DPOConfig):
        train = data_mod.load_preference_pairs(train_spec, tokenizer, max_seq_len=config.max_seq_len)
        evals = data_mod.load_preference_pairs(eval_spec, tokenizer, max_seq_len=config.max_seq_len) if eval_spec else None
        return LoadedData(tokenizer, train, evals, notes=_data_notes(train_spec, eval_spec))
    kwargs = {"train_on": config.data.train_on, "max_seq_len": config.max_seq_len}
    train = data_mod.load_sft_examples(train_spec, tokenizer, **kwargs)
    evals = data_mod.load_sft_examples(eval_spec, tokenizer, **kwargs) if eval_spec else None
    return LoadedData(tokenizer, train, evals, notes=_data_notes(train_spec, eval_spec))


def _data_notes(*specs) -> list[str]:
    return [line for spec in specs if spec is not None for line in spec.reports]


def check_base_model(client: Any, loaded: LoadedConfig) -> list[str]:
    """Ask the backend's capabilities whether the config's base model is offered (and its
    max_seq_len allowed); return notes, or raise an error that starts with the file and line
    (or the ``--set`` item) of the value."""
    config = loaded.config
    base_model, max_seq_len = config.base_model, config.max_seq_len

    def at(key: str) -> str:
        return f"{loaded.where(key)}: "

    # The capabilities API knows sft and rl; DPO needs a sampler (to score the reference) as RL does.
    use_case = "rl" if config.kind == "dpo" else config.kind
    models = client.capabilities(use_case=use_case)
    names = [m.model_name for m in models]
    match = next((m for m in models if m.model_name == base_model), None)
    if match is None and os.path.isabs(base_model):  # a model folder: offered when the backend can load it
        match = next((m for m in client.capabilities(model=base_model, use_case=use_case) if m.model_name == base_model), None)
    if match is None:
        import difflib

        close = difflib.get_close_matches(base_model, names, n=1)
        raise ConfigError(
            f"{at('base_model')}base_model {base_model!r} is not offered by this backend"
            + (f"; did you mean {close[0]!r}?" if close else ""),
            hint=f"Set base_model to one this backend offers: {', '.join(names) or '(none)'}.",
        )
    notes = []
    limit = getattr(match, "max_enabled_seq_len", None) or getattr(match, "max_seq_len", None)
    if limit and max_seq_len > limit:
        raise ConfigError(
            f"{at('max_seq_len')}max_seq_len {max_seq_len} is over what {base_model} allows here ({limit})",
            hint=f"Set max_seq_len to {limit} or less.",
        )
    if getattr(match, "enabled", True) is False:
        detail = getattr(match, "enablement_details", None)
        raise ConfigError(f"{at('base_model')}{base_model} is not enabled for this workspace" + (f": {detail}" if detail else ""))
    return notes


def planned_tokens(config, data: LoadedData) -> tuple[int, int, int]:
    """(steps, tokens trained, tokens sampled), counted on the real batches of every step.

    SFT counts are exact: the datums' input tokens of each step's batch, as the loop builds them.
    RL counts take each step's real prompts and ``sampling.max_tokens`` per completion, so they
    are upper bounds (completions may stop early; groups without signal are not trained)."""
    from baseten_loops_cli.training import sft as sft_mod
    from baseten_loops_cli.training.data import batches_for_step

    if isinstance(config, DPOConfig):  # exact: each step's pairs, chosen + rejected (whole sequences)
        steps = sft_mod.total_steps(len(data.train), config)
        train_tokens = sum(
            len(data.train[i].chosen.tokens) + len(data.train[i].rejected.tokens)
            for step in range(steps)
            for i in batches_for_step(len(data.train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
        )
        return steps, train_tokens, 0
    if isinstance(config, RLConfig):
        from baseten_loops_cli.training import rl as rl_mod  # here: it imports asyncio (~15 ms)

        steps = rl_mod.total_steps(len(data.train), config)
        completions = config.groups_per_batch * config.group_size
        prompt_tokens = sum(len(p.tokens) for step in range(steps) for p in rl_mod.prompts_for_step(data.train, step, config))
        sample_tokens = steps * completions * config.sampling.max_tokens
        return steps, prompt_tokens * config.group_size + sample_tokens - steps * completions, sample_tokens
    steps = sft_mod.total_steps(len(data.train), config)
    train_tokens = sum(
        len(data.train[i].tokens) - 1
        for step in range(steps)
        for i in batches_for_step(len(data.train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
    )
    return steps, train_tokens, 0


def make_plan(loaded: LoadedConfig, data: LoadedData, backend_kind: str) -> Plan:
    from baseten_loops_cli.training import calibration

    config = loaded.config
    pricing = config.pricing
    steps, train_tokens, sample_tokens = planned_tokens(config, data)
    measured = calibration.lookup(config.kind, config.base_model) if backend_kind == "local" else None
    if measured is not None:
        # Seconds per planned token, measured on this machine by the last run of this model.
        est = measured.startup_s + (train_tokens + sample_tokens) * measured.s_per_token
    else:
        train_rate, sample_rate, per_step = _rates(backend_kind, config.base_model)
        est = _STARTUP_S.get(backend_kind, 0.0) + steps * per_step + train_tokens / train_rate + sample_tokens / sample_rate
    if isinstance(config, DPOConfig):
        # The reference scores every sequence once (a prefill each, no backward).
        scored = sum(len(p.chosen.tokens) + len(p.rejected.tokens) for p in data.train + (data.eval or []))
        est += scored * (measured.s_per_token if measured is not None else 1 / _rates(backend_kind, config.base_model)[0]) / 3
    cost = None
    if any(v is not None for v in (pricing.usd_per_million_train_tokens, pricing.usd_per_million_sample_tokens, pricing.usd_per_hour)):
        cost = (
            train_tokens / 1e6 * (pricing.usd_per_million_train_tokens or 0.0)
            + sample_tokens / 1e6 * (pricing.usd_per_million_sample_tokens or 0.0)
            + est / 3600 * (pricing.usd_per_hour or 0.0)
        )
    notes = list(data.notes)
    if backend_kind == "local" and measured is None:
        notes.append("time estimate not calibrated yet: it is measured on this machine by the first run of this model")
    if isinstance(config, RLConfig):
        notes.append("RL token counts are upper bounds (every completion at sampling.max_tokens)")
    if backend_kind != "local":
        notes.append("the time estimate leaves out provisioning (a cold trainer can take minutes)")
        if cost is None:
            notes.append("no cost estimate: set pricing.* in the config to get one")
    if config.max_steps and steps < config.max_steps:
        notes.append(f"max_steps {config.max_steps} is more than the data gives ({steps} steps)")
    if isinstance(config, DPOConfig):
        notes.append(
            f"before step 1 the reference ({config.reference}) scores {2 * (len(data.train) + len(data.eval or []))} sequences (~{scored:,} tokens) once"
        )
    return Plan(
        kind=config.kind,
        base_model=config.base_model,
        examples=len(data.train),
        eval_examples=len(data.eval or []),
        steps=steps,
        train_tokens=train_tokens,
        sample_tokens=sample_tokens,
        est_seconds=est,
        est_cost_usd=cost,
        notes=notes,
        data=data,
    )
