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
    # On a busy machine (calibration.slowdown): (est_seconds, the most it may take at this load).
    est_range: tuple[float, float] | None = None

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
            "estimated_seconds_range": list(self.est_range) if self.est_range is not None else None,
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
    if limit and max_seq_len > limit and "max_seq_len" not in loaded.raw:
        # The default (min(2048, the model's limit)) where this machine did not know the limit.
        config.max_seq_len = limit
        notes.append(f"max_seq_len {limit}: the default, lowered to what {base_model} allows here")
    elif limit and max_seq_len > limit:
        raise ConfigError(
            f"{at('max_seq_len')}max_seq_len {max_seq_len} is over what {base_model} allows here ({limit})",
            hint=f"Set max_seq_len to {limit} or less.",
        )
    if getattr(match, "enabled", True) is False:
        detail = getattr(match, "enablement_details", None)
        raise ConfigError(f"{at('base_model')}{base_model} is not enabled for this workspace" + (f": {detail}" if detail else ""))
    return notes


def problems_together(errors: list[ConfigError]) -> ConfigError:
    """Every problem `loops train validate` found (the backend's, the data's) as one error: one
    as it is, several each on its line(s), so none hides another."""
    if len(errors) == 1:
        return errors[0]
    lines = [f"{len(errors)} problems:"]
    for error in errors:
        lines += [f"  {line}" for line in error.message.splitlines()]
    hints = [e.hint for e in errors if e.hint]
    return ConfigError("\n".join(lines), hint=hints[0] if len(hints) == 1 else "Fix them all, then run `loops train validate` again.")


def planned_tokens(config, data: LoadedData) -> tuple[int, int, int]:
    """(steps, tokens trained, tokens sampled), counted by the kind on the real batches of every
    step (``Kind.estimate``; RL: upper bounds)."""
    from baseten_loops_cli.training import kinds

    estimate = kinds.of(config).estimate(config, data)
    return estimate.steps, estimate.train_tokens, estimate.sample_tokens


def longest_row(config, data: LoadedData) -> int:
    """Tokens of the longest row a step trains: the longest row's tokens (plus the sampled reply,
    ``sampling.max_tokens``, for the kinds that sample), at most max_seq_len; max_seq_len for
    rows whose tokens are not counted here (an upper bound: longer rows are refused)."""
    longest = max((len(getattr(row, "tokens", None) or ()) for row in data.train), default=0)
    if not longest:
        return int(config.max_seq_len)
    sampled = int(getattr(getattr(config, "sampling", None), "max_tokens", 0) or 0)
    return min(int(config.max_seq_len), longest + sampled)


def machine_memory_bytes() -> int | None:
    """This machine's RAM (MemTotal), None where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_notes(config, data: LoadedData, ram: int | None = None) -> list[str]:
    """The local server's estimated peak for the longest row (memory_estimate, float32: an upper
    bound for a bf16 server), and a warning when it passes this machine's RAM. Nothing when the
    model's config.json is not on this machine (the tiny model is built in code)."""
    import json

    from baseten_loops_cli.memory_estimate import training_peak_bytes
    from baseten_loops_cli.settings.model_files import find_model_dir
    from baseten_loops_cli.sizes import human_size

    folder = find_model_dir(config.base_model)
    try:
        model_config = json.loads((folder / "config.json").read_text()) if folder else None
    except (OSError, ValueError):
        model_config = None
    if not isinstance(model_config, dict):
        return []
    tokens = longest_row(config, data)
    peak = training_peak_bytes(model_config, tokens)
    ram = ram if ram is not None else machine_memory_bytes()
    estimate = f"~{human_size(peak)} server peak for the longest row ({tokens:,} tokens)"
    if ram and peak > ram:
        return [(f"warning: {estimate} is more than this machine's {human_size(ram)} of RAM; "
                 "lower max_seq_len or train on a machine with more memory")]
    return [f"memory: {estimate}" + (f" of this machine's {human_size(ram)}" if ram else "")]


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
    est_range = None
    if capabilities.calibrated_plans:
        notes.append(measured.note(config.base_model) if measured is not None else
                     "time estimate not calibrated yet: it is measured on this machine by the first run of this model")
        # The run shares this machine's cores with whatever else runs: a busy machine makes the
        # estimate a range (a SmolLM2 plan of 1m14s took 16 min at load 10 on 2 cores).
        load, cores = calibration.machine_load()
        factor = calibration.slowdown(load, cores)
        if factor is not None:
            est_range = (est, est * factor)
            notes.append(f"this machine is busy (load average {load:.1f} on {cores} cores): the run may take up to "
                         f"{factor:.1f}x the estimate, as long as that load lasts")
    if capabilities.billable:
        notes.append("the time estimate leaves out provisioning (a cold trainer can take minutes)")
        if cost is None:
            notes.append("no cost estimate: set pricing.* in the config to get one")
    notes += estimate.notes
    if capabilities.calibrated_plans:  # this machine trains: will the longest row fit?
        notes += memory_notes(config, data)
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
        est_range=est_range,
        noun=kinds.of(config).noun,
        title=kinds.of(config).display_name,
    )
