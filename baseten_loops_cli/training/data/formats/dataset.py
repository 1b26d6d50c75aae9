"""Reading a config's data: sources -> detected format -> internal rows -> mixture -> split.

:func:`read_rows` is the one entry point (``training/data/datums.py``'s loaders call it): it takes a
plain path (``loops eval --data FILE``) or a :class:`DataSpec` built from a config by
:func:`data_specs`, and yields ``(where, row)`` with ``row`` the internal row of a purpose
(see ``rows``). What it detected goes to ``DataSpec.reports``, for the plan's notes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.data.formats import readers, rows as rows_mod

HUB_PREFIX = "hf://datasets/"


@dataclass
class Source:
    """One resolved source: a local path or a hub dataset, with its mixture settings."""

    name: str  # what reports and errors call it
    path: Path | None = None
    dataset: str | None = None
    split: str | None = None
    subset: str | None = None
    revision: str | None = None
    weight: float = 1.0
    max_rows: int | None = None
    format: str | None = None
    columns: dict[str, str] = field(default_factory=dict)

    def records(self) -> Iterator[tuple[str, dict]]:
        if self.dataset is not None:
            return readers.read_hub(self.dataset, split=self.split, subset=self.subset, revision=self.revision,
                                    columns=self.columns)
        # Every Source is built with a dataset or a path (plain_spec, _sources_of).
        assert self.path is not None
        return readers.read_path(self.path, self.columns)


@dataclass(eq=False)
class DataSpec:
    """What one data key of a config (``data.train``, ``data.eval``, ...) reads."""

    label: str
    sources: list[Source]
    seed: int = 0
    # A hold-out of the training rows: (fraction or count, "train" | "eval", where it was set).
    holdout: tuple[float, str, str] | None = None
    compare_with: "DataSpec | None" = None  # eval: the training data, to report rows in both
    truncation: str = "error"  # data.truncation: what the loaders do with a row over max_seq_len
    reports: list[str] = field(default_factory=list)
    _cache: dict[str, list] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        if len(self.sources) == 1 and self.holdout is None:
            return str(self.sources[0].path or self.sources[0].name)
        return f"{self.label} ({', '.join(s.name for s in self.sources)})"


def _map_columns(row: dict, columns: dict[str, str]) -> dict:
    if not columns:
        return row
    row = dict(row)
    for target, source in columns.items():
        if source in row and source != target:
            row[target] = row.pop(source)
    return row


def _source_rows(source: Source, purpose: str) -> tuple[list[tuple[str, dict]], str, int]:
    """(converted rows, format description, rows before max_rows) of one source."""
    records = [(where, _map_columns(row, source.columns)) for where, row in source.records()]
    if not records:
        return [], "empty", 0
    if purpose == rows_mod.ENV_ROWS:  # an environment reads its rows itself: any JSON object, as it is
        kept = records[: source.max_rows] if source.max_rows is not None else records
        return kept, "environment rows", len(records)
    fmt, row_formats = rows_mod.detect(records, source.name, source.format, source.columns, purpose)
    described = rows_mod.describe(fmt, records)
    total = len(records)
    if source.max_rows is not None:
        records = records[: source.max_rows]
    converted = [(where, rows_mod.convert(where, row, row_fmt, purpose, source.columns))
                 for (where, row), row_fmt in zip(records, row_formats)]
    return converted, described, total


def _key(row: dict) -> str:
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)


def _weighted(rows: list, weight: float, rng: random.Random) -> list:
    """Each row ``int(weight)`` times, plus a seeded sample for the fraction left over."""
    whole, part = divmod(weight, 1.0)
    out = rows * int(whole)
    extra = round(part * len(rows))
    if extra:
        out += [rows[i] for i in sorted(rng.sample(range(len(rows)), extra))]
    return out or rows[:1]


def _load(spec: DataSpec, purpose: str) -> list[tuple[str, dict]]:
    cached = spec._cache.get(purpose)
    if cached is not None:
        return cached
    per_source: list[list[tuple[str, dict]]] = []
    for source in spec.sources:
        converted, described, total = _source_rows(source, purpose)
        kept = f"{len(converted):,} of {total:,} rows" if len(converted) != total else f"{total:,} row{'s' if total != 1 else ''}"
        spec.reports.append(f"{spec.label}: {described}, {kept}" + (f" ({source.name})" if spec.label != source.name else ""))
        per_source.append(converted)
    if spec.holdout is not None:
        amount, side, where = spec.holdout
        total = sum(len(rows) for rows in per_source)
        n_eval = int(amount) if amount >= 1 else max(1, round(amount * total))
        if n_eval >= total:
            raise ConfigError(
                f"{where}: from_train {amount:g} holds out {n_eval:,} of the {total:,} training rows, leaving none to train on",
                hint="Lower from_train (a fraction such as 0.05, or fewer rows) or add training rows.",
            )
        flat = [(i, j) for i, rows in enumerate(per_source) for j in range(len(rows))]
        held = set(random.Random(f"{spec.seed}:holdout").sample(flat, n_eval))
        if side == "eval":
            result = [per_source[i][j] for i, j in flat if (i, j) in held]
            spec.reports.append(f"{spec.label}: {n_eval:,} rows held out of the training data (seed {spec.seed})")
            spec._cache[purpose] = result
            _report_duplicates(spec, purpose, result)
            return result
        per_source = [[row for j, row in enumerate(rows) if (i, j) not in held] for i, rows in enumerate(per_source)]
    rng = random.Random(f"{spec.seed}:mixture")
    result = []
    for source, rows in zip(spec.sources, per_source):
        result += _weighted(rows, source.weight, rng) if source.weight != 1.0 and rows else rows
    if len(spec.sources) > 1 or spec.sources[0].weight != 1.0:
        parts = ", ".join(f"{s.name} x{s.weight:g}" if s.weight != 1.0 else s.name for s in spec.sources)
        spec.reports.append(f"{spec.label}: mixture of {len(result):,} rows per epoch ({parts})")
    spec._cache[purpose] = result
    _report_duplicates(spec, purpose, result)
    return result


def _report_duplicates(spec: DataSpec, purpose: str, rows: list[tuple[str, dict]]) -> None:
    if spec.compare_with is None:
        return
    train: dict[str, str] = {}  # row key -> where the training data has it
    for where, row in _load(spec.compare_with, purpose):
        train.setdefault(_key(row), where)
    both = [(where, train[_key(row)]) for where, row in rows if _key(row) in train]
    if both:
        first, other = both[0]
        spec.reports.append(
            f"{spec.label}: {len(both):,} of {len(rows):,} rows are also in {spec.compare_with.label} "
            f"(first: {first}, as {other}); their eval loss flatters the model"
        )


def read_rows(data: Any, purpose: str) -> Iterator[tuple[str, dict]]:
    """``(where, internal row)`` for each row of ``data`` (a path or a :class:`DataSpec`)."""
    if purpose not in rows_mod.PURPOSES:
        raise ValueError(f"unknown purpose {purpose!r}")
    spec = data if isinstance(data, DataSpec) else plain_spec(data)
    yield from _load(spec, purpose)


def plain_spec(value: Any, label: str | None = None, *, columns: dict[str, str] | None = None,
               format: str | None = None, truncation: str = "error") -> DataSpec:
    """A path given on its own (``loops eval --data``, ``loops data check``) as a DataSpec,
    with the format options a config's ``data:`` section (or ``--columns``) gives it."""
    text = str(value)
    if text.startswith(HUB_PREFIX):
        name, revision = readers.hub_name(text)
        source = Source(text, dataset=name, revision=revision, format=format, columns=dict(columns or {}))
    else:
        source = Source(text, path=Path(text), format=format, columns=dict(columns or {}))
    return DataSpec(label or text, [source], truncation=truncation)


def section_options(section: Any) -> dict:
    """A config ``data:`` section's format options (``columns``, ``format``, ``truncation``),
    as :func:`plain_spec` takes them."""
    return dict(columns=getattr(section, "columns", None) or {}, format=getattr(section, "format", None),
                truncation=getattr(section, "truncation", None) or "error")


# ------------------------------------------------------------------ from a loaded config
def _sources_of(loaded: Any, key: tuple, value: Any, options: Any) -> list[Source]:
    """The config value at ``key`` (a path, a source mapping or a list of either) resolved."""
    from baseten_loops_cli.training.data.formats.spec import SourceSpec

    items = value if isinstance(value, list) else [value]
    sources = []
    for i, item in enumerate(items):
        at = key + ((i,) if isinstance(value, list) else ())
        if isinstance(item, str):
            item = SourceSpec(path=item)
        if item.weight <= 0:
            raise ConfigError(f"{loaded.where(*at, 'weight')}: {'.'.join(map(str, at))}.weight is {item.weight:g}; a weight must be above 0",
                              hint="A weight is how often the source's rows are seen per epoch (2 = twice, 0.5 = a seeded half); "
                                   "remove the source to leave it out.")
        if item.max_rows is not None and item.max_rows < 1:
            raise ConfigError(f"{loaded.where(*at, 'max_rows')}: {'.'.join(map(str, at))}.max_rows must be 1 or more",
                              hint="Remove max_rows to keep every row.")
        columns = {**(getattr(options, "columns", None) or {}), **(item.columns or {})}
        fmt = item.format or getattr(options, "format", None)
        common = dict(split=item.split, subset=item.subset, revision=item.revision, weight=item.weight,
                      max_rows=item.max_rows, format=fmt, columns=columns)
        if item.dataset is not None or (item.path or "").startswith(HUB_PREFIX):
            name, revision = readers.hub_name(item.dataset or item.path)
            common["revision"] = item.revision or revision
            label = f"hf://datasets/{name}" + (f"[{item.split}]" if item.split else "")
            sources.append(Source(label, dataset=name, **common))
        else:
            for hub_key in ("split", "subset", "revision"):
                if getattr(item, hub_key) is not None:
                    raise ConfigError(f"{loaded.where(*at, hub_key)}: {'.'.join(map(str, at))}.{hub_key} is for hub datasets, not a file or folder",
                                      hint="Remove it, or name a hub dataset with `dataset: ORG/NAME` (or path: hf://datasets/ORG/NAME).")
            sources.append(Source(item.path, path=loaded.resolve_path(item.path), **common))
    return sources


def data_specs(loaded: Any, train_key: tuple[str, str] = ("data", "train"),
               eval_key: tuple[str, str] | None = ("data", "eval")) -> tuple[DataSpec, DataSpec | None]:
    """The training and eval data of a loaded config, at the keys its kind names
    (``kinds.data_specs`` passes them: ``data.train``/``data.eval``, RL's ``data.prompts``/
    ``data.eval_prompts``). Format options (``format``, ``columns``) come from the training
    key's section."""
    config = loaded.config
    section = getattr(config, train_key[0])
    train_label = ".".join(train_key)
    truncation = section_options(section)["truncation"]
    train = DataSpec(train_label, _sources_of(loaded, train_key, getattr(section, train_key[1]), section), config.seed,
                     truncation=truncation)
    if eval_key is None:
        return train, None
    eval_section = getattr(config, eval_key[0], None)
    value = getattr(eval_section, eval_key[1], None) if eval_section is not None else None
    if value is None:
        return train, None
    eval_label = ".".join(eval_key)
    if hasattr(value, "from_train"):
        where = loaded.where(*eval_key, "from_train")
        train.holdout = (value.from_train, "train", where)
        evals = DataSpec(eval_label, train.sources, config.seed, holdout=(value.from_train, "eval", where),
                         truncation=truncation)
    else:
        evals = DataSpec(eval_label, _sources_of(loaded, eval_key, value, eval_section), config.seed,
                         truncation=truncation)
    evals.compare_with = train
    return train, evals


def data_notes(*specs: DataSpec | None) -> list[str]:
    """What reading the specs found (formats, rows kept, mixtures, rows in both splits): the plan's notes."""
    return [line for spec in specs if spec is not None for line in spec.reports]


def eval_source(loaded: Any, value: Any, train_key: tuple[str, str] = ("data", "train"),
                eval_key: tuple[str, str] | None = ("data", "eval")) -> Any:
    """What to score for an eval (``eval.data`` or the config's eval data): a path as before
    (a DataSpec with the config's ``data.columns``, ``format`` and ``truncation`` when it sets
    any), else the eval DataSpec (a hub dataset, a mixture or a hold-out of the training rows)."""
    if isinstance(value, str):
        return with_options(loaded, loaded.resolve_path(value) if not value.startswith(HUB_PREFIX) else value, train_key)
    return data_specs(loaded, train_key, eval_key)[1]


def with_options(loaded: Any, data: Any, train_key: tuple[str, str] = ("data", "train"),
                 columns: dict[str, str] | None = None) -> Any:
    """``data`` (a path or hf:// name) read with the format options of the config's data
    section (``columns`` given on the command line win over its ``data.columns``): a plain
    Path when there are none, as before."""
    options = section_options(getattr(loaded.config, train_key[0], None))
    if columns:
        options["columns"] = columns
    if isinstance(data, DataSpec):
        return data
    if options["columns"] or options["format"] or options["truncation"] != "error" or str(data).startswith(HUB_PREFIX):
        return plain_spec(data, **options)
    return data


def fingerprint(data: Any) -> str:
    """A sha256 of what ``data`` reads: its files' bytes (in order), hub names and revisions,
    weights, caps and hold-out, so an eval report says whether two evals scored the same rows."""
    import hashlib

    spec = data if isinstance(data, DataSpec) else plain_spec(data)
    digest = hashlib.sha256(repr((spec.holdout[:2] if spec.holdout else None, spec.seed)).encode())
    for source in spec.sources:
        digest.update(repr((source.dataset, source.split, source.subset, source.revision, source.weight,
                            source.max_rows, source.format, sorted(source.columns.items()))).encode())
        if source.path is not None:
            for file in readers.data_files(source.path) if source.path.is_dir() else [source.path]:
                digest.update(file.read_bytes())
    return digest.hexdigest()
