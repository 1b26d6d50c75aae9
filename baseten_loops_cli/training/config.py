"""The YAML training config: a strict schema, loading with line numbers, ``--set`` overrides.

Every error names the file, the line and the key, and suggests the nearest valid key, because
a typo in a config that provisions GPUs should cost seconds, not a run.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, Mapping

from typing_extensions import TypeVar  # a TypeVar default (PEP 696): typing has it from 3.13

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from baseten_loops_cli.errors import ConfigError, ExitCode, UsageError
from baseten_loops_cli.training.data.formats.spec import SOURCE_TAGS, EvalSources, FormatOptions, Sources


# The keys of every kind that name files (relative to the config file); each kind adds its own
# (``Kind.data_path_keys``).
COMMON_PATH_KEYS = (("eval", "data"),)


def data_path_keys(kind: str) -> tuple[tuple[str, str], ...]:
    """The config keys of a ``kind`` config that name data files."""
    from baseten_loops_cli.training import kinds

    return tuple(kinds.get(kind).data_path_keys) + COMMON_PATH_KEYS


DEFAULT_MAX_SEQ_LEN = 2048


def default_max_seq_len(base_model: str) -> int:
    """``max_seq_len`` when a config leaves it out: min(2048, the model's limit), the limit as
    this machine knows it (``settings.model_files.model_max_seq_len``; a backend that knows a
    lower one lowers it again: ``plan.check_base_model``). `loops data check` takes the same."""
    from baseten_loops_cli.settings.model_files import model_max_seq_len

    return min(DEFAULT_MAX_SEQ_LEN, model_max_seq_len(base_model) or DEFAULT_MAX_SEQ_LEN)


def dotted_keys(raw: dict, prefix: str = "") -> dict[str, Any]:
    """A raw config as ``{"optimizer.learning_rate": value, ...}`` (the spelling of ``--set``);
    an empty mapping stays a value. `train compare` and the trackers' parameters read it."""
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(dotted_keys(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _kinds_text() -> str:
    """'sft', 'rl' or 'dpo': the registered kinds (training/kinds), for messages."""
    from baseten_loops_cli.training import kinds

    return kinds.names_text()


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainData(Section, FormatOptions):
    """``data:`` of the kinds that train on rows (sft, dpo, kto): the training rows, the held-out
    ones, whether to shuffle."""

    train: Sources
    eval: EvalSources | None = None
    shuffle: bool = True


class PromptsData(Section, FormatOptions):
    """``data:`` of the kinds that sample from prompts (rl, distill)."""

    prompts: Sources
    eval_prompts: EvalSources | None = None
    shuffle: bool = True


class OptimizerConfig(Section):
    learning_rate: float = Field(1e-4, gt=0)
    schedule: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Floor of the decay, as a fraction of learning_rate.")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(1.0, ge=0, description="0 disables clipping.")


class CheckpointConfig(Section):
    save_every: int = Field(0, ge=0, description="Save trainer state every N steps (0 = only at the end).")
    ttl_seconds: int | None = Field(None, ge=1)
    keep_final: bool = True


class LoggingConfig(Section):
    run_dir: str | None = Field(
        None,
        description="Relative to the working directory; --run-dir wins. Default: runs/<name>-<timestamp>.",
    )
    wandb_project: str | None = None
    wandb_name: str | None = None
    trackers: list[Literal["tensorboard", "mlflow", "trackio"]] = Field(
        default_factory=list,
        description="Also log to these (each an optional extra): tensorboard, mlflow, trackio.",
    )
    tracker_dir: str | None = Field(
        None,
        description="Where the trackers write (TensorBoard logdir, MLflow file store, trackio's folder); "
                    "relative to the working directory. Default: the run directory's trackers/ folder "
                    "(a sweep's own folder, shared by its runs).",
    )


class SweepConfig(Section):
    """`loops train sweep CONFIG` with no --grid: what to sweep (the command line's options win)."""

    grid: dict[str, list[Any]] = Field(..., description="key.path: [value, value, ...] (the product is swept).")
    random: int | None = Field(None, ge=1, description="Draw this many points of the grid instead of all.")
    seed: int | None = None
    parallel: int | None = Field(None, ge=1)
    max_runs: int | None = Field(None, ge=1)


class PricingConfig(Section):
    """Optional prices, for the plan's cost estimate (no public Loops prices exist)."""

    usd_per_million_train_tokens: float | None = Field(None, ge=0)
    usd_per_million_sample_tokens: float | None = Field(None, ge=0)
    usd_per_hour: float | None = Field(None, ge=0)
    usd_per_million_judge_tokens: float | None = Field(
        None, ge=0, description="A judge at reward.judge.url: its provider's price (prompt + answer tokens)."
    )



class JudgeConfig(Section):
    """``reward: {fn: judge, judge: {...}}``: a grader model scores replies (training/rewards/judge.py).
    The grader is ``url:`` an OpenAI-compatible endpoint (``model:`` then names its model), or,
    without ``url``, ``model:`` a Loops sampler checkpoint (``RUN:NAME``, ``bt://...``) or a base
    model, served by a sampler of the run's backend."""

    url: str | None = Field(None, description="OpenAI-compatible base URL of the grader (.../v1; a `loops deploy` URL too).")
    model: str | None = Field(None, description="With url: the endpoint's model name. Without: RUN:NAME, bt:// or a base model.")
    api_key_env: str | None = Field(None, description="The environment variable holding the grader's key (never written anywhere).")
    mode: Literal["single", "group"] = "single"
    rubric: str = Field(..., description="jinja2 template over prompt, reply (group: replies) and row.FIELD.")
    scale: tuple[float, float] = (0.0, 10.0)
    labels: dict[str, float] | None = Field(None, description="Labels the grader answers with, mapped to rewards.")
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    timeout_s: float = Field(60.0, gt=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, not {value!r}")
        return value

    @model_validator(mode="after")
    def _one_grader(self) -> "JudgeConfig":
        if not self.url and not self.model:
            raise ValueError("name the grader: url (an OpenAI-compatible endpoint) or model (RUN:NAME, bt:// URI "
                             "or a base model, served by a sampler of the run's backend)")
        if self.api_key_env and not self.url:
            raise ValueError("api_key_env goes with url (a checkpoint or base model judge uses the backend's key)")
        return self

    @property
    def served(self) -> bool:
        """Served by a sampler of the run's backend (a checkpoint or base model), not a URL."""
        return not self.url

    @property
    def label(self) -> str:
        return self.url or self.model or "judge"

    @field_validator("rubric")
    @classmethod
    def _rubric_fields(cls, value: str, info: Any) -> str:
        from baseten_loops_cli.training.rewards.judge import check_rubric

        check_rubric(value, info.data.get("mode", "single"))
        return value


class RewardConfig(Section):
    """A builtin reward (``exact_match``, ``numeric_match``, ``regex``, ``contains``,
    ``starts_with``, ``format``, ``length``, ``repetition``) or ``path/to/file.py:function``."""

    fn: str
    pattern: str | None = None
    case_sensitive: bool = False
    partial_credit: bool = Field(
        False, description="contains/starts_with: score the longest matched prefix of the answer."
    )
    weight: float = Field(1.0, description="In a list of rewards: this one's weight in the sum.")
    name: str | None = Field(None, description="In a list of rewards: its metric name (reward/NAME); default from fn.")
    max_chars: int | None = Field(None, ge=1, description="length: replies longer than this are penalised.")
    ngram: int = Field(3, ge=1, description="repetition: the n of the repeated word n-grams counted.")
    judge: JudgeConfig | None = Field(None, description="fn: judge: the grader, its rubric and how to read its score.")


class LossConfig(Section):
    name: Literal["importance_sampling", "ppo", "cispo", "dro", "gspo"] = "importance_sampling"
    config: dict[str, float] = Field(default_factory=dict)
    # The clip epsilons (DAPO's decoupled eps_low, eps_high): the ratio is clipped to
    # [1 - clip_low, 1 + clip_high]; ppo and cispo send them as the protocol's thresholds.
    clip_low: float | None = Field(None, ge=0, lt=1, description="ppo, cispo, gspo: the ratio's floor is 1 - clip_low.")
    clip_high: float | None = Field(None, ge=0, description="ppo, cispo, gspo: the ratio's ceiling is 1 + clip_high.")

    @model_validator(mode="after")
    def _known_keys(self) -> "LossConfig":
        allowed = {
            "importance_sampling": set(),
            "ppo": {"clip_low_threshold", "clip_high_threshold"},
            "cispo": {"clip_low_threshold", "clip_high_threshold"},
            "dro": {"beta"},
            "gspo": set(),
        }[self.name]
        for key in self.config:
            if key not in allowed:
                valid = ", ".join(sorted(allowed)) or "none"
                raise ValueError(f"unknown {self.name} config key {key!r} (valid: {valid})")
        clips = [k for k in ("clip_low", "clip_high") if getattr(self, k) is not None]
        if clips and self.name not in ("ppo", "cispo", "gspo"):
            raise ValueError(f"{clips[0]} applies to ppo, cispo and gspo, not to {self.name}; remove it")
        for eps, threshold in (("clip_low", "clip_low_threshold"), ("clip_high", "clip_high_threshold")):
            if getattr(self, eps) is not None and threshold in self.config:
                raise ValueError(f"set {eps} or config.{threshold}, not both")
        return self


class SamplingConfig(Section):
    max_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop: list[str] = Field(default_factory=list)


class EvalConfig(Section):
    """``eval:``: when training ends, score the final checkpoint (and the base model with
    ``base: true``) as ``loops eval`` does; the table goes to eval.json and eval.txt in the run
    directory. ``eval: true`` (or an empty ``eval:``) takes every default."""

    data: str | None = Field(None, description="JSONL to score (default: data.eval, or data.eval_prompts for RL).")
    base: bool = Field(False, description="Also score the base model, to show what training bought.")
    limit: int | None = Field(None, ge=1, description="Score only the first N rows.")
    samples: int | None = Field(None, ge=1, description="RL: completions per prompt (default: group_size).")
    k: int | None = Field(None, ge=1, description="RL: the k of pass@k (default: samples).")


class CommonConfig(Section):
    """What every kind's config has; a kind's model (training/kinds) adds ``kind``, ``data`` and
    its own keys."""

    kind: str
    name: str = Field(..., min_length=1, max_length=255)
    base_model: str
    profile: str | None = Field(None, description="Backend profile (default: the active one).")
    lora_rank: int = Field(32, ge=1)
    max_seq_len: int = Field(DEFAULT_MAX_SEQ_LEN, ge=8, description="Default: min(2048, the model's limit).")
    seed: int = 0
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    batch_size: int = Field(8, ge=1)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Train exactly this many steps: wins over epochs and cycles the data (HF Trainer, TRL).")
    eval_every: int = Field(0, ge=0)
    checkpointing: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    pricing: PricingConfig = Field(default_factory=PricingConfig)
    eval: EvalConfig | None = Field(None, description="Evaluate the final checkpoint when training ends.")
    sweep: SweepConfig | None = Field(None, description="What `loops train sweep` varies (ignored by `train run`).")
    # Sections whose keys may all be commented out (`logging:` alone means the defaults).
    SECTIONS: ClassVar[tuple[str, ...]] = ("optimizer", "checkpointing", "logging", "pricing", "eval")

    @field_validator("eval", mode="before")
    @classmethod
    def _eval_shorthand(cls, value: Any, info: ValidationInfo) -> Any:
        from baseten_loops_cli.training import kinds

        value = {} if value is True else None if value is False else value
        kind = info.data.get("kind")
        # The loop ends with final_eval.evaluate_final() for a kind that defines its eval task.
        if value is not None and kind in kinds.names() and not kinds.can_score(kind):
            raise ValueError("not offered for this kind; score the final checkpoint with `loops eval RUN:final --data FILE`")
        return value

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """A section whose keys are all commented out (``logging:`` alone) means the defaults."""
        if isinstance(data, dict):
            empty = [k for k in cls.SECTIONS if k in data and data[k] is None]
            if empty:
                data = {**data, **{k: {} for k in empty}}
        return data


# The config model of one kind (kinds/NAME.py's NAMEConfig): what LoadedConfig, TrainingSession
# and StepHooks carry, so a kind's hooks read their own keys with their types (covariant: they only
# read it, so a TrainingSession[RLConfig] is a TrainingSession).
ConfigT = TypeVar("ConfigT", bound=CommonConfig, default=CommonConfig, covariant=True)


class LoadedConfig(Generic[ConfigT]):
    """A validated config plus where it came from (paths in it are relative to its folder)."""

    def __init__(self, config: ConfigT, path: Path, raw: dict, lines: dict[tuple, int] | None = None,
                 overrides: dict[tuple, str] | None = None):
        self.config = config
        self.path = path
        self.raw = raw
        self.lines = lines or {}
        self.overrides = overrides or {}  # key path -> the --set item that set it

    def where(self, *key: str) -> str:
        """``file:line`` of a key (``where("data", "train")``), for errors about its value; the
        ``--set`` item instead when that set it."""
        if tuple(key) in self.overrides:
            return f"--set {self.overrides[tuple(key)]!r}"
        line = self.lines.get(tuple(key))
        return f"{self.path}:{line}" if line else str(self.path)

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def resolve_path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else (self.base_dir / p)


# ------------------------------------------------------------------ YAML with line numbers
def _load_yaml_with_lines(text: str, path: Path) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML safely and record the line of every mapping key, by key path."""
    import yaml

    lines: dict[tuple, int] = {}

    class _Loader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        # A key written twice would silently lose its first value (YAML keeps the last one).
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                raise ConfigError(
                    f"{path}:{line}: duplicate key {key_node.value!r} (also at line {seen[key_node.value]})",
                    hint="Keep one of them: YAML would silently drop the first one's value.",
                )
            seen[key_node.value] = line
        loader.flatten_mapping(node)
        mapping = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            mapping[key] = loader.construct_object(value_node, deep=True)
            lines[(id(mapping), key)] = key_node.start_mark.line + 1
        return mapping

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        # The problem is often found a line after its cause (an unclosed [ or quote): name where
        # the construct it broke began.
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and start is not None and (mark is None or start.line != mark.line):
            construct = re.sub(r"^while (?:parsing|scanning|constructing) an? ", "", context)
            problem += f" (in the {construct} that starts at line {start.line + 1})"
        raise ConfigError(
            f"{where}: YAML syntax error: {problem}",
            hint="Look there for an unclosed bracket or quote, a missing ': ' or a tab in the indentation.",
        ) from None
    # Re-key by path (ids are only valid while the objects live, which they do here).
    by_path: dict[tuple, int] = {}

    def walk(obj: Any, prefix: tuple) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                line = lines.get((id(obj), key))
                if line is not None:
                    by_path[prefix + (key,)] = line
                walk(value, prefix + (key,))
        elif isinstance(obj, list):
            for i, value in enumerate(obj):
                walk(value, prefix + (i,))

    walk(data, ())
    return data, by_path


def _model_for(raw: dict) -> type[CommonConfig]:
    from baseten_loops_cli.training import kinds

    return kinds.get(raw["kind"]).config_model


def _kind_lines() -> str:
    """```kind: sft`, `kind: rl` or `kind: dpo``` (the registered kinds)."""
    from baseten_loops_cli.training import kinds

    lines = [f"`kind: {k}`" for k in kinds.names()]
    return lines[0] if len(lines) == 1 else ", ".join(lines[:-1]) + f" or {lines[-1]}"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, Union, Annotated and lists:
    a data source inside ``data.train: [...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", None) or () for m in _models_in(arg)]


def _valid_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names valid at ``loc`` (the parent of an unknown key)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = next(iter(_models_in(field.annotation)), None)
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


@dataclass
class Problem:
    """One thing wrong with a config: where it is, which key, what is wrong and how to fix it."""

    line: int | None
    key: str
    message: str  # already names the key, e.g. "unknown key 'lr'; did you mean 'optimizer.lr'?"
    fix: str | None = None
    override: str | None = None  # the --set KEY=VALUE the value came from (not the file)

    def where(self, path: Path) -> str:
        if self.override is not None:
            return f"--set {self.override!r}"
        return f"{path}:{self.line}" if self.line else str(path)


class ConfigProblems(ConfigError):
    """Every problem found in one config file, in line order. With one problem it reads like any
    other one-line error (message + hint); with several, the message lists them all."""

    def __init__(self, path: Path, problems: list[Problem]):
        self.path = path
        self.problems = sorted(problems, key=lambda p: p.line or 0)
        # Only --set items are wrong: a bad value on the command line is a usage error (2), as a
        # bad flag is; a problem in the file itself is an error (1).
        code = ExitCode.USAGE if all(p.override is not None for p in self.problems) else None
        if len(self.problems) == 1:
            only = self.problems[0]
            super().__init__(f"{only.where(path)}: {only.message}", hint=only.fix, exit_code=code)
            return
        lines = [f"{path}: {len(self.problems)} problems"]
        for p in self.problems:
            sep = " " if p.message.endswith(("?", ".")) else ". "
            lines.append(f"  {p.where(path)}: {p.message}" + (f"{sep}Fix: {p.fix}" if p.fix else ""))
        super().__init__("\n".join(lines), hint="Fix them all, then run `loops train validate` again.", exit_code=code)


def _line_of(lines: dict[tuple, int], loc: tuple) -> int | None:
    """The line of ``loc``, or of its nearest parent that has one."""
    probe = loc
    while probe:
        if probe in lines:
            return lines[probe]
        probe = probe[:-1]
    return None


def _override_of(overrides: dict[tuple, str], loc: tuple) -> str | None:
    """The ``--set`` item behind a problem at ``loc``: one that set ``loc``, a key inside it, or a
    key under which ``loc`` lies (``--set name.first=1`` turned ``name`` into a mapping)."""
    if not loc:
        return None
    for parts, item in reversed(overrides.items()):
        if parts[: len(loc)] == loc or loc[: len(parts)] == parts:
            return item
    return None


def _problem(err: Mapping[str, Any], lines: dict[tuple, int], raw: dict, overrides: dict[tuple, str] | None = None) -> Problem:
    err = {**err, "loc": tuple(p for p in err["loc"] if p not in SOURCE_TAGS)}  # a data source's shape tag
    problem = _file_problem(err, lines, raw)
    loc = tuple(err["loc"])
    problem.override = _override_of(overrides or {}, loc)
    if problem.override is not None:
        problem.line = None
        problem.fix = problem.fix or "Fix the key path or the value of this --set."
    return problem


def _file_problem(err: Mapping[str, Any], lines: dict[tuple, int], raw: dict) -> Problem:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    line = _line_of(lines, loc)
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(_model_for(raw), loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        message = f"unknown key {key!r}"
        if close:
            better = ".".join(str(p) for p in loc[:-1] + (close[0],))
            return Problem(line, key, message + f"; did you mean {better!r}?", f"Rename it to {better!r}.")
        return Problem(line, key, message, f"Valid keys here: {', '.join(valid)}." if valid else "Remove it.")
    if err["type"] == "missing":
        return Problem(line, key, f"missing required key {key!r}", f"Add `{loc[-1]}: ...` here.")
    if err["type"] == "union_tag_invalid" or (err["type"] == "literal_error" and loc == ("kind",)):
        return Problem(line, key, f"kind must be {_kinds_text()}", f"Set kind to {_kinds_text()}.")
    value = err.get("input")
    fix = f"Change the value ({value!r})." if not isinstance(value, (dict, list)) else None
    # A validator that knows the fix names it in its error's context (config_error below).
    fix = (err.get("ctx") or {}).get("fix") or fix
    return Problem(line, key, f"{key}: {err['msg'].removeprefix('Value error, ')}", fix)


def config_error(message: str, fix: str | None = None) -> Exception:
    """What a config model's validator raises for a value it refuses: the message (after
    ``KEY: ``) and the fix the one-line error's hint gives (else "Change the value")."""
    from pydantic_core import PydanticCustomError

    return PydanticCustomError("config_value", "{message}", {"message": message, "fix": fix})


def _missing_data_files(raw: dict, lines: dict[tuple, int], base_dir: Path,
                        overrides: dict[tuple, str] | None = None) -> list[Problem]:
    """A data path that does not exist, reported at the line of its key (not later, at load)."""
    from baseten_loops_cli.training.data.formats.spec import path_problem, source_paths

    problems = []
    for loc in data_path_keys(raw["kind"]):
        value = (raw.get(loc[0]) or {}).get(loc[1]) if isinstance(raw.get(loc[0]), dict) else None
        for sub, text in source_paths(value):  # a path, or each path of a list of sources
            resolved = Path(text).expanduser()
            resolved = resolved if resolved.is_absolute() else base_dir / resolved
            found = path_problem(resolved)
            if found is None:
                continue
            key = ".".join(map(str, loc + sub))
            override = _override_of(overrides or {}, loc)
            line = None if override is not None else (lines.get(loc + sub) or lines.get(loc))
            problems.append(Problem(line, key, f"{key}: {found[0]}", found[1], override))
    return problems


def apply_overrides(raw: dict, overrides: list[str], applied: dict[tuple, str] | None = None) -> dict:
    """Apply ``key.path=value`` overrides; values are parsed as YAML scalars (``3``, ``true``).

    ``applied`` (if given) gets each key path and the item that set it, so a problem with the
    value is reported as the ``--set`` item's, not as the config file's."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise UsageError(f"--set {item!r}: expected key.path=value",
                             hint=f"e.g. --set {item.strip() or 'max_steps'}=VALUE")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise UsageError(f"--set {item!r}: empty key")
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        node = raw
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = parsed
        if applied is not None:
            applied[tuple(parts)] = item
    return raw


def _paths_from_here(raw: dict, applied: dict[tuple, str]) -> None:
    """A path typed on the command line (``--set data.train=../x.json``, ``--set
    base_model=./merged``) is relative to the current directory, as any path typed in a shell:
    made absolute here, before the rest (written relative to the config's folder) is resolved
    against the config."""
    from baseten_loops_cli.settings.model_files import looks_like_path
    from baseten_loops_cli.training.data.formats.spec import absolute_sources

    def here(value: str) -> Path:
        return Path(value).expanduser().absolute()

    for loc in data_path_keys(raw["kind"]):
        section = raw.get(loc[0])
        if not isinstance(section, dict) or loc[1] not in section:
            continue
        if loc in applied:  # the whole value typed on the command line
            section[loc[1]] = absolute_sources(section[loc[1]], here)
        elif loc + ("path",) in applied and isinstance(section[loc[1]], dict):  # --set data.train.path=...
            section[loc[1]] = absolute_sources(section[loc[1]], here)
    value = raw.get("base_model")
    if ("base_model",) in applied and isinstance(value, str) and (looks_like_path(value) or Path(value).is_dir()):
        raw["base_model"] = str(here(value))


def _missing_config_hint(path: Path) -> str:
    """A close match beside the missing config (``tiny_sft.yaml`` -> ``tiny-sft.yaml``), else init."""
    try:
        siblings = [p.name for p in path.parent.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()]
    except OSError:
        siblings = []
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.75)
    if close:
        return f"Did you mean {path.parent / close[0]}?"
    return "Create one with `loops train init`."


def load_config(path: str | Path, overrides: list[str] | None = None, *, check_files: bool = False) -> LoadedConfig:
    """Load and validate a config; every problem is reported at once (:class:`ConfigProblems`).

    ``check_files`` also reports data files that do not exist, at the line of their key (what
    `loops train validate` and `run` want; loading a run directory's config does not need it)."""
    from baseten_loops_cli.training import kinds

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint=_missing_config_hint(path)) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    raw, lines = _load_yaml_with_lines(text, path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}:1: the config must be a YAML mapping (key: value lines)",
                          hint="Start from `loops train init --kind sft -O FILE`.")
    applied: dict[tuple, str] = {}
    if overrides:
        raw = apply_overrides(raw, overrides, applied)
    if "kind" not in raw:
        raise ConfigError(f"{path}: missing required key 'kind'", hint=f"Add {_kind_lines()}.")
    if not isinstance(raw.get("kind"), str) or raw["kind"] not in kinds.names():
        where = Problem(lines.get(("kind",)) or 1, "kind", "", override=_override_of(applied, ("kind",))).where(path)
        raise ConfigError(f"{where}: kind must be {_kinds_text()}, not {raw.get('kind')!r}",
                          hint=f"Set kind to {_kinds_text()}.",
                          exit_code=ExitCode.USAGE if ("kind",) in applied else None)
    _paths_from_here(raw, applied)
    # Collect every problem before failing: the schema's (pydantic reports them all) and the
    # data files that do not exist, so one `validate` shows everything to fix.
    problems = _missing_data_files(raw, lines, path.resolve().parent, applied) if check_files else []
    # base_model written as a folder: validated as its absolute path (the server and the tokenizer
    # get the folder, wherever they run from), and checked for what a model folder needs.
    folder = _base_model_folder(raw, lines, path.resolve().parent, applied, problems if check_files else None)
    config = None
    try:
        config = _model_for(raw).model_validate(raw if folder is None else {**raw, "base_model": str(folder)})
    except ValidationError as exc:
        problems += [_problem(err, lines, raw, applied) for err in exc.errors()]
    if problems:
        raise ConfigProblems(path, problems)
    # Validation either set config or added a problem, which raised just above.
    assert config is not None
    if "max_seq_len" not in raw:
        config.max_seq_len = default_max_seq_len(config.base_model)
    return LoadedConfig(config, path.resolve(), raw, lines, applied)


def load_pricing(path: str | Path) -> PricingConfig:
    """The ``pricing:`` section of a YAML file (a training config, or a file holding only that
    section), for ``loops usage --pricing``; errors name the file, line and key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}", hint="Name a YAML file with a pricing: section.") from None
    raw, lines = _load_yaml_with_lines(text, path)
    if not isinstance(raw, dict) or not isinstance(raw.get("pricing"), dict):
        raise ConfigError(f"{path}: no pricing: section",
                          hint="Add e.g. `pricing: {usd_per_million_train_tokens: 2.0, usd_per_million_sample_tokens: 0.5}`.")
    try:
        return PricingConfig.model_validate(raw["pricing"])
    except ValidationError as exc:
        problems = [_problem({**err, "loc": ("pricing", *err["loc"])}, lines, raw) for err in exc.errors()]
        raise ConfigProblems(path, problems) from None


def _base_model_folder(raw: dict, lines: dict[tuple, int], base_dir: Path, overrides: dict[tuple, str],
                       problems: list[Problem] | None) -> Path | None:
    """``base_model`` written as a folder (relative to the config): its absolute path, and (with
    ``problems``) what it lacks, at the line of the key: no folder, no config.json, no weights,
    no tokenizer."""
    from baseten_loops_cli.settings.model_files import local_model_dir, local_model_problem

    value = raw.get("base_model")
    folder = local_model_dir(value, base_dir) if isinstance(value, str) and value else None
    if folder is None or problems is None:
        return folder
    found = local_model_problem(folder)
    if found is not None:
        override = _override_of(overrides, ("base_model",))
        problems.append(Problem(None if override else lines.get(("base_model",)), "base_model", f"base_model: {found}",
                                "Name a Hugging Face model folder (config.json, weights and tokenizer files) or a model "
                                "`loops server models` lists.", override))
    return folder
