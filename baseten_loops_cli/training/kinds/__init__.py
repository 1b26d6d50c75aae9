"""The registry of training kinds: the one table that maps a config's ``kind:`` to its plug-in.

A kind is one module here (``sft.py``, ``rl.py``, ``dpo.py``, ``kto.py``, ``distill.py``) that ends with ``KIND = Kind(...)``:
its config model (the pydantic class of the whole config, built on ``config.CommonConfig``), its
data loading, its plan estimate, its hooks into the one training loop (``training/loop/core.py``:
the step's datums and loss, its record fields, its eval), its main metric and step fields, its ``train init``
template, the config keys that name data files, and how its ``eval:`` task is built. Nothing
outside this package asks which kind a config is: config loading, plans, the training service,
``train init`` and ``loops eval --config`` all go through :func:`get`.

The built-in kinds are imported on first use (by module name, so ``loops --help`` imports none
of them); :func:`register` adds one at run time (a test's toy kind, a plug-in of a user).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.training.config import LoadedConfig
    from baseten_loops_cli.training.loop.core import StepHooks

# kind -> the module that defines it (its KIND), in the order messages list them.
_BUILTIN = {
    "sft": "baseten_loops_cli.training.kinds.sft",
    "rl": "baseten_loops_cli.training.kinds.rl",
    "dpo": "baseten_loops_cli.training.kinds.dpo",
    "kto": "baseten_loops_cli.training.kinds.kto",
    "distill": "baseten_loops_cli.training.kinds.distill",
}
_REGISTRY: dict[str, "Kind | str"] = dict(_BUILTIN)


@dataclass(frozen=True)
class StepField:
    """One ``label value`` pair of a step's progress line: ``loss 0.1234``, ``pass 25%``, or
    ``groups 2/4`` (``of`` names the record key of the total). ``optional`` fields are shown only
    when the record has them (an eval on some steps only)."""

    key: str
    label: str
    spec: str = ".4f"
    of: str | None = None
    optional: bool = False


@dataclass
class LoadedData:
    """What a kind's ``load_data`` returns: the tokenizer and the rows of the train and eval
    splits (the kind's own row type), plus whatever else its loop needs (RL: the reward)."""

    tokenizer: Any
    train: list
    eval: list | None
    reward: Any = None  # RL: [(metric name, fn, weight)] of its reward(s), or None with only an env
    notes: list[str] = field(default_factory=list)  # what the data layer found: formats, rows, overlaps


@dataclass
class Estimate:
    """A kind's share of a plan, counted on the real batches of every step: steps, tokens
    trained, tokens sampled, tokens only scored (a forward pass without backward, e.g. the DPO
    reference: planned at a third of a trained token), and notes about the counts."""

    steps: int
    train_tokens: int
    sample_tokens: int = 0
    scored_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    # A judge reward's planned requests and tokens (judge.plan_tokens): the plan prices them.
    judge: dict | None = None


class EvalTaskMaker(Protocol):
    """``Kind.eval_task``: the evaluation task of a config's rows in ``data`` (a file's path or
    the data layer's spec); returns an ``evaluation.EvalTask``."""

    def __call__(self, loaded: "LoadedConfig[Any]", data: Any, *, limit: int | None = None, seed: int | None = None,
                 samples: int | None = None, k: int | None = None) -> Any: ...


class RowRenderer(Protocol):
    """``Kind.render_rows``: each row of ``spec`` (a ``formats.DataSpec``) as the kind trains or
    samples it: its sequences (``.tokens``, and ``.weights`` when trained)."""

    def __call__(self, spec: Any, tokenizer: Any, *, max_seq_len: int, train_on: str = ...) -> list[list[Any]]: ...


class RewardTester(Protocol):
    """``Kind.reward_test`` (`loops reward test`): ``rows`` samples.jsonl records; ``new_sampler()``
    opens a base-model sampler, ``serving`` (client, api_key, new_model_sampler_client) serves judges."""

    def __call__(self, loaded: "LoadedConfig[Any]", data: LoadedData, new_sampler: Callable[[], Any], rows: int,
                 serving: Any = None) -> list[dict]: ...


@dataclass(frozen=True)
class Kind:
    """A kind of training, as the rest of the code sees it (see the module docstring)."""

    name: str  # the config's `kind:` value
    config_model: type  # pydantic model of the whole config (subclass of config.CommonConfig)
    noun: str  # what a row of its data is called in plans: examples, prompts, pairs
    main_metric: str  # what the summary reports first/last of and plots by default
    metric_names: tuple[str, ...]  # the per-step numbers its records carry
    step_fields: tuple[StepField, ...]  # the progress line's kind-specific part
    template: Callable[[], str]  # `loops train init --kind NAME`
    load_data: Callable[["LoadedConfig", Any], LoadedData]  # (loaded, tokenizer): every row checked
    estimate: Callable[[Any, LoadedData], Estimate]  # (config, data)
    hooks: type["StepHooks[Any]"]  # each kind its own config model; its part of the one training loop (training/loop/core.py), made with (session, data)
    eval_data_key: tuple[str, str] | None = None  # the config key of the default eval data (`eval:` and `loops eval --config`)
    train_data_key: tuple[str, str] = ("data", "train")  # the config key of the training rows (what from_train holds out of)
    # config keys naming data files (relative to the config); default: train_data_key and eval_data_key
    data_path_keys: tuple[tuple[str, str], ...] = ()
    eval_task: EvalTaskMaker | None = None  # (loaded, data, *, limit, seed, samples, k) -> evaluation.EvalTask
    code_keys: tuple[tuple[str, ...], ...] = ()  # keys whose value may be path/to/file.py:function (RL: reward)
    reward_key: str | None = None  # the key of its reward(s) (RL, distill: reward): judges are checked before provisioning
    capabilities_use_case: str = "sft"  # the backend's model list that must offer base_model (sft, rl)
    check: Callable[["LoopsClient", "LoadedConfig"], None] | None = None  # (client, loaded): before provisioning
    # Its rows, for the data layer and `loops data check|preview`:
    row_purpose: str = "sft"  # the internal row type its loader reads (formats.rows.PURPOSES)
    row_formats: tuple[str, ...] = ()  # row formats `loops data` takes as this kind's when --kind is not given
    row_sides: tuple[str | None, ...] = (None,)  # what each rendered sequence of a row is (DPO: chosen, rejected)
    render_rows: RowRenderer | None = None  # (spec, tokenizer, *, max_seq_len, train_on) -> each row's sequences (.tokens, .weights)
    reward_test: RewardTester | None = None  # (loaded, data, new_sampler, rows, serving=): `loops reward test`
    title: str = ""  # how plans name it (default: NAME in capitals)

    def __post_init__(self) -> None:
        if not self.data_path_keys:
            keys = tuple(key for key in (self.train_data_key, self.eval_data_key) if key is not None)
            object.__setattr__(self, "data_path_keys", keys)

    @property
    def display_name(self) -> str:
        return self.title or self.name.upper()


def register(kind: Kind) -> Kind:
    """Add (or replace) a kind; returns it. Replacing a built-in one is allowed (a test's fake)."""
    _REGISTRY[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind added by :func:`register` (a built-in one goes back to its module)."""
    if name in _BUILTIN:
        _REGISTRY[name] = _BUILTIN[name]
    else:
        _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered kinds, built-in ones first (no kind module is imported)."""
    return tuple(_REGISTRY)


def names_text(*, quoted: bool = True) -> str:
    """``'sft', 'rl', 'dpo', 'kto' or 'distill'``: the registered kinds, for messages (unquoted
    for help texts)."""
    kinds = [repr(k) if quoted else k for k in names()]
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + f" or {kinds[-1]}"


def get(name: str) -> Kind:
    """The kind registered as ``name`` (KeyError when there is none: config loading reports an
    unknown kind with the file and line before anything calls this)."""
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        entry = importlib.import_module(entry).KIND
        _REGISTRY[name] = entry
    return entry


def reading(purpose: str) -> str | None:
    """The first registered kind whose loader reads ``purpose`` rows (``row_purpose``), for
    messages ("a paired row under kind: kto"); None when no kind reads them."""
    return next((name for name in names() if get(name).row_purpose == purpose), None)


def can_score(name: str) -> bool:
    """Whether the kind defines an eval task: its config may have an ``eval:`` block (the loop
    scores the final checkpoint) and ``loops eval --config`` takes it."""
    return get(name).eval_task is not None


def of(config: Any) -> Kind:
    """The kind of a validated config."""
    return get(config.kind)


def eval_task(loaded: "LoadedConfig", data: "Path | None" = None, *, limit: int | None = None,
              seed: int | None = None, samples: int | None = None, k: int | None = None) -> Any:
    """The one construction of an evaluation task from a config: what `loops eval --config` and
    the config's ``eval:`` block both score. ``data`` defaults to the kind's eval data; returns
    None when neither names a file (the callers say so in their own words)."""
    kind = of(loaded.config)
    if kind.eval_task is None:
        from baseten_loops_cli.errors import UsageError

        raise UsageError(
            f"{loaded.path}: a {kind.name} config does not define how to evaluate",
            hint="Score its checkpoints with `loops eval CKPT --data FILE.jsonl` (SFT rows).",
        )
    if data is None:
        value = eval_data(loaded)
        if value is None:
            return None
        data = eval_source(loaded, value)
    return kind.eval_task(loaded, data, limit=limit, seed=seed, samples=samples, k=k)


def data_specs(loaded: "LoadedConfig") -> tuple[Any, Any]:
    """The training and eval data of a config as the data layer reads them
    (``formats.DataSpec``: sources, mixture, hold-out), from the kind's data keys."""
    from baseten_loops_cli.training.data.formats import data_specs as specs

    kind = of(loaded.config)
    return specs(loaded, kind.train_data_key, kind.eval_data_key)


def eval_source(loaded: "LoadedConfig", value: Any) -> Any:
    """What an eval scores for ``value`` (``eval.data`` or the kind's eval data): a file's path,
    or the data layer's spec of a hub dataset, a mixture or a hold-out of the training rows."""
    from baseten_loops_cli.training.data.formats import eval_source as source

    kind = of(loaded.config)
    return source(loaded, value, kind.train_data_key, kind.eval_data_key)


def eval_data(loaded: "LoadedConfig") -> Any:
    """The config's default eval data (the value of the kind's ``eval_data_key``: a path, a
    source, a list of sources or a hold-out), or None."""
    key = of(loaded.config).eval_data_key
    if key is None:
        return None
    section = getattr(loaded.config, key[0], None)
    return getattr(section, key[1], None) if section is not None else None
