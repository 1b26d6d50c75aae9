"""The config's data schema pieces: sources, mixtures, hold-outs, ``format`` and ``columns``.

``data.train`` (and ``data.eval``, ``data.prompts``, ``data.eval_prompts``) is a path as
before, one source mapping, or a list of them::

    train:
      - path: data/alpaca.json            # a file or a folder of files
        weight: 2.0                       # seen twice per epoch (0.5: a seeded half)
      - dataset: org/name                 # or path: hf://datasets/org/name
        split: train
        subset: default
        revision: main
        max_rows: 500                     # the first 500 rows
    eval: {from_train: 0.05}              # a seeded 5% of the training rows (or a row count)

The types are checked here; the values that need a line and a hint (weight <= 0, a hold-out
that leaves nothing to train on) are checked when the data is read (``dataset``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

FORMAT_NAMES = (
    "messages", "sharegpt", "alpaca", "preference", "unpaired_preference", "prompt_completion", "prompt_only", "text",
)
FormatName = Literal[
    "messages", "sharegpt", "alpaca", "preference", "unpaired_preference", "prompt_completion", "prompt_only", "text",
]
HUB_PREFIX = "hf://datasets/"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SourceSpec(_Strict):
    """One source of rows: a file or folder (``path``) or a hub dataset (``dataset``)."""

    path: str | None = Field(None, description="A file or folder (relative to the config), or hf://datasets/ORG/NAME.")
    dataset: str | None = Field(None, description="A Hugging Face hub dataset name, ORG/NAME.")
    split: str | None = Field(None, description="Hub datasets: the split (default: train).")
    subset: str | None = Field(None, description="Hub datasets: the configuration (subset) name.")
    revision: str | None = Field(None, description="Hub datasets: a branch, tag or commit.")
    weight: float = Field(1.0, description="How often each row is seen per epoch (2 = twice, 0.5 = a seeded half).")
    max_rows: int | None = Field(None, description="Keep only the first N rows.")
    format: FormatName | None = Field(None, description="Force the row format (default: detected from the rows).")
    columns: dict[str, str] | None = Field(None, description="Column names of this source: {prompt: question}.")

    @model_validator(mode="after")
    def _one_place(self) -> "SourceSpec":
        if (self.path is None) == (self.dataset is None):
            raise ValueError("a source names either 'path' (a file, folder or hf://datasets/...) or 'dataset' (a hub name), not both or neither")
        return self


class FromTrain(_Strict):
    """``eval: {from_train: 0.05}``: hold out a seeded share (or a count) of the training rows."""

    from_train: float = Field(..., gt=0, description="A fraction (0 < f < 1) or a number of rows (>= 1).")

    @field_validator("from_train")
    @classmethod
    def _whole_count(cls, value: float) -> float:
        if value >= 1 and value != int(value):
            raise ValueError(f"a fraction below 1 or a whole number of rows, not {value}")
        return value


def _sources_tag(value: Any) -> str:
    if isinstance(value, (dict, SourceSpec)):
        return "<source>"
    if isinstance(value, list):
        return "<sources>"
    return "<path>"


def _eval_sources_tag(value: Any) -> str:
    if isinstance(value, (dict, FromTrain)) and (isinstance(value, FromTrain) or "from_train" in value):
        return "<from_train>"
    return _sources_tag(value)


# A path (as before), one source, or a list of sources/paths. The discriminator picks the one
# shape the value has, so a mistake is reported once, not once per shape it could have been.
_SourceItem = Annotated[
    Union[Annotated[str, Tag("<path>")], Annotated[SourceSpec, Tag("<source>")]], Discriminator(_sources_tag)
]
Sources = Annotated[
    Union[
        Annotated[str, Tag("<path>")],
        Annotated[SourceSpec, Tag("<source>")],
        Annotated[list[_SourceItem], Tag("<sources>")],
    ],
    Discriminator(_sources_tag),
]
EvalSources = Annotated[
    Union[
        Annotated[str, Tag("<path>")],
        Annotated[SourceSpec, Tag("<source>")],
        Annotated[list[_SourceItem], Tag("<sources>")],
        Annotated[FromTrain, Tag("<from_train>")],
    ],
    Discriminator(_eval_sources_tag),
]
# The tags in an error's location (config.py leaves them out of the key it names).
SOURCE_TAGS = ("<path>", "<source>", "<sources>", "<from_train>")


class FormatOptions(_Strict):
    """``data.format`` and ``data.columns``, for every kind's ``data:`` section."""

    format: FormatName | None = Field(None, description="Force the row format of every source (default: detected).")
    columns: dict[str, str] = Field(
        default_factory=dict, description="Map the format's names to the data's columns: {prompt: question, completion: answer}.",
    )
    truncation: Literal["error", "drop", "right", "left"] = Field(
        "error", description="A row over max_seq_len: error (refuse it), drop (skip and count it), right (keep its "
                             "first tokens) or left (keep its last). Pairs: the prompt from the left, then the replies "
                             "from the right; RL/distill prompts: from the left. See docs/data.md.",
    )


COLUMNS_EXAMPLE = "prompt=question,completion=answer"


def parse_columns(text: str, flag: str = "--columns") -> dict[str, str]:
    """``prompt=question,completion=answer`` (the command line's spelling of ``data.columns``)
    as the mapping the config's ``data.columns`` holds, checked by the same schema."""
    from pydantic import ValidationError

    from baseten_loops_cli.errors import UsageError

    mapping: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        name, sep, column = (s.strip() for s in item.partition("="))
        if not sep or not name or not column:
            raise UsageError(f"{flag} {text!r}: expected NAME=COLUMN[,NAME=COLUMN...], not {item!r}",
                             hint=f"e.g. {flag} {COLUMNS_EXAMPLE} (the format's name = the data's column).")
        if name in mapping:
            raise UsageError(f"{flag} {text!r}: {name!r} is mapped twice", hint="Map each name once.")
        mapping[name] = column
    try:
        return FormatOptions(columns=mapping).columns
    except ValidationError as exc:  # the same schema as data.columns
        raise UsageError(f"{flag} {text!r}: {exc.errors()[0]['msg']}", hint=f"e.g. {flag} {COLUMNS_EXAMPLE}") from None


def source_paths(value: Any) -> list[tuple[tuple, str]]:
    """The local paths a sources value names, each with its key path below the value's key
    (``()`` for a plain string, ``(0, "path")`` in a list): what must exist before a run."""
    found: list[tuple[tuple, str]] = []
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        sub: tuple = (i,) if isinstance(value, list) else ()
        if isinstance(item, dict):
            item, sub = item.get("path"), sub + ("path",)
        if isinstance(item, str) and item and not item.startswith(HUB_PREFIX):
            found.append((sub, item))
    return found


def path_problem(resolved: Path) -> tuple[str, str] | None:
    """(message, hint) when a local data path cannot be read as data, else None."""
    from baseten_loops_cli.training.data.formats.readers import SUFFIXES, data_files

    if not resolved.exists():
        return f"{resolved}: data file not found", "Check the path (relative to the config file)."
    if resolved.is_dir() and not data_files(resolved):
        return (f"{resolved} is a folder with no data files",
                f"Put data files in it ({', '.join(SUFFIXES)}) or point at a file.")
    return None


def absolute_sources(value: Any, resolve) -> Any:
    """``value`` with each local path made absolute by ``resolve`` (hub names kept as they are),
    for the run directory's copy of the config (resume works from any folder)."""
    if isinstance(value, str):
        return value if value.startswith(HUB_PREFIX) else str(resolve(value).resolve())
    if isinstance(value, list):
        return [absolute_sources(v, resolve) for v in value]
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return {**value, "path": absolute_sources(value["path"], resolve)}
    return value
