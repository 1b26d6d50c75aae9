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
from baseten_loops_cli.training.config import LoadedConfig
from baseten_loops_cli.training.kinds import LoadedData

# Rough rates for an uncalibrated time estimate (before the first local run of a model has been
# measured on this machine; see calibration.py): (tokens/s through forward+backward, sampled tokens/s,
# seconds of fixed cost per step). Local rates are measured on 2 CPU cores; remote GPUs are far
# faster, and the estimate there leaves out provisioning (minutes for a cold trainer).
_LOCAL_RATES = {"loops-local/tiny": (15000.0, 2000.0, 0.3)}  # fitted to tiny-sft/tiny-rl, 2026-12-04
_LOCAL_DEFAULT = (250.0, 25.0, 1.0)  # a ~100M-parameter model such as SmolLM2-135M
_REMOTE_RATES = (50000.0, 5000.0, 1.0)
_LOCAL_STARTUP_S = 5.0  # a backend on this machine: the server's run creation; remote: provisioning, left out


def _rates(capabilities: Any, base_model: str) -> tuple[float, float, float]:
    if capabilities.calibrated_plans:  # this machine trains
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
    noun: str = "examples"  # what the kind calls a row (examples, prompts, pairs), for people
    title: str = ""  # how people name the kind (SFT, RL, DPO)
    judge: dict | None = None  # a judge reward's planned requests and tokens (judge.plan_tokens)

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
            **({"judge": self.judge} if self.judge is not None else {}),
            "notes": self.notes,
        }


def load_data(loaded: LoadedConfig) -> LoadedData:
    """The kind's data loading (every row checked) with the base model's tokenizer."""
    from baseten_loops_cli.tokenization import get_tokenizer
    from baseten_loops_cli.training import kinds

    config = loaded.config
    try:
        tokenizer = get_tokenizer(config.base_model)
    except Exception as exc:
        message = getattr(exc, "message", None) or str(exc)
        raise ConfigError(f"{loaded.path}: base_model {config.base_model!r}: {message}",
                          hint=getattr(exc, "hint", None)) from None
    return kinds.of(config).load_data(loaded, tokenizer)


def check_base_model(client: Any, loaded: LoadedConfig) -> list[str]:
    """Ask the backend's capabilities whether the config's base model is offered (and its
    max_seq_len allowed); return notes, or raise an error that starts with the file and line
    (or the ``--set`` item) of the value."""
    config = loaded.config
    base_model, max_seq_len = config.base_model, config.max_seq_len

    def at(key: str) -> str:
        return f"{loaded.where(key)}: "

    from baseten_loops_cli.training import kinds

    use_case = kinds.of(config).capabilities_use_case
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
    """(steps, tokens trained, tokens sampled), counted by the kind on the real batches of every
    step (``Kind.estimate``; RL: upper bounds)."""
    from baseten_loops_cli.training import kinds

    estimate = kinds.of(config).estimate(config, data)
    return estimate.steps, estimate.train_tokens, estimate.sample_tokens


def make_plan(loaded: LoadedConfig, data: LoadedData, capabilities: Any) -> Plan:
    """The plan of a config on a backend whose ``capabilities`` (settings.connection.Capabilities)
    say whether this machine trains (calibrated estimates) and whether provisioning is billed."""
    from baseten_loops_cli.training import calibration, kinds

    config = loaded.config
    pricing = config.pricing
    estimate = kinds.of(config).estimate(config, data)
    steps, train_tokens, sample_tokens = estimate.steps, estimate.train_tokens, estimate.sample_tokens
    measured = calibration.lookup(config.kind, config.base_model) if capabilities.calibrated_plans else None
    if measured is not None:
        # Seconds per planned token, measured on this machine by the last run of this model.
        est = measured.startup_s + (train_tokens + sample_tokens) * measured.s_per_token
    else:
        train_rate, sample_rate, per_step = _rates(capabilities, config.base_model)
        startup = _LOCAL_STARTUP_S if capabilities.calibrated_plans else 0.0
        est = startup + steps * per_step + train_tokens / train_rate + sample_tokens / sample_rate
    if estimate.scored_tokens:
        # Forward passes only (a prefill each, no backward): a third of a trained token.
        s_per_token = measured.s_per_token if measured is not None else 1 / _rates(capabilities, config.base_model)[0]
        est += estimate.scored_tokens * s_per_token / 3
    judge = estimate.judge
    if judge is not None and judge["backend_tokens"]:
        # A judge sampled on the run's backend: its tokens take the sampler's time (an upper bound).
        est += judge["backend_tokens"] / _rates(capabilities, config.base_model)[1]
    cost = None
    prices = (pricing.usd_per_million_train_tokens, pricing.usd_per_million_sample_tokens, pricing.usd_per_hour,
              pricing.usd_per_million_judge_tokens)  # fmt: skip
    if any(v is not None for v in prices):
        cost = (
            train_tokens / 1e6 * (pricing.usd_per_million_train_tokens or 0.0)
            + sample_tokens / 1e6 * (pricing.usd_per_million_sample_tokens or 0.0)
            + est / 3600 * (pricing.usd_per_hour or 0.0)
        )
        if judge is not None:  # a served judge is the backend's sampling; a URL judge its provider's price
            cost += judge["backend_tokens"] / 1e6 * (pricing.usd_per_million_sample_tokens or 0.0)
            cost += judge["external_tokens"] / 1e6 * (pricing.usd_per_million_judge_tokens or 0.0)
    notes = list(data.notes)  # what the data layer found: formats, rows, mixtures, overlaps
    if capabilities.calibrated_plans:
        notes.append(measured.note(config.base_model) if measured is not None else
                     "time estimate not calibrated yet: it is measured on this machine by the first run of this model")
    if capabilities.billable:
        notes.append("the time estimate leaves out provisioning (a cold trainer can take minutes)")
        if cost is None:
            notes.append("no cost estimate: set pricing.* in the config to get one")
    notes += estimate.notes
    if judge is not None:
        notes.append(f"the judge ({judge['served_by']}) grades up to {judge['requests']:,} requests: ~{judge['prompt_tokens']:,} "
                     f"prompt + {judge['completion_tokens']:,} answer tokens (upper bounds; recorded per step as judge_* metrics)")
        if judge["external_tokens"] and pricing.usd_per_million_judge_tokens is None and cost is not None:
            notes.append("the cost leaves out the judge at its URL: set pricing.usd_per_million_judge_tokens to include it")
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
        judge={k: v for k, v in judge.items()} if judge is not None else None,
        noun=kinds.of(config).noun,
        title=kinds.of(config).display_name,
    )
