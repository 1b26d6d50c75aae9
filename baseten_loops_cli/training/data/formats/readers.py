"""Readers: a file, a folder of files or a hub dataset -> ``(where, row)`` pairs.

``where`` is what an error about the row starts with: ``file:line`` for line-based files
(JSONL, CSV/TSV: the line the record starts on), ``file: row N`` (1-based) for the others.
JSONL, JSON and CSV/TSV need nothing beyond the standard library; Parquet and Arrow need
pyarrow and hub datasets need ``datasets``: the ``[data]`` extra, imported only here, only
when such a source is read.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterator

from baseten_loops_cli.errors import ConfigError

JSONL_HINT = "a data file is JSON Lines, one JSON object per line."
SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow")
EXTRA_HINT = "Install the data extra: pip install 'baseten-loops-cli[data]'."

Rows = Iterator[tuple[str, dict]]


def open_data_file(path: Path, what: str):
    """``path`` opened for reading (binary); a missing file, a folder or an unreadable file is a
    one-line ConfigError naming it (``what``: the format expected, for the folder's hint)."""
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise ConfigError(f"{path}: data file not found", hint="Check the path in the config (relative to the config file).") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a folder, not a {what} file", hint="Name a file, not a folder: " + JSONL_HINT) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, row) for each non-blank line; a bad line is an error naming it."""
    with open_data_file(path, "JSONL") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{path}:{lineno}: not UTF-8 text (byte {exc.start + 1})",
                    hint="Save the file as UTF-8 JSON Lines.",
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not valid JSON: {exc.msg} (column {exc.colno})",
                                  hint=f"Fix or delete line {lineno}: {JSONL_HINT}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{lineno}: each line must be a JSON object", hint=f"Fix or delete line {lineno}: {JSONL_HINT}")
            yield lineno, row


def _read_text(path: Path, what: str) -> str:
    with open_data_file(path, what) as handle:
        data = handle.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {exc.start + 1})", hint=f"Save the file as UTF-8 {what}.") from None


def read_json(path: Path) -> Rows:
    """A JSON array of row objects, or ``{"data": [...]}`` (a JSON Lines file named .json is
    read as JSON Lines, as ``datasets`` does)."""
    text = _read_text(path, "JSON")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            yield from ((f"{path}:{n}", row) for n, row in read_jsonl(path))
            return
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})",
                          hint="A .json data file holds an array of row objects, or {\"data\": [...]}.") from None
    rows = doc.get("data") if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise ConfigError(f"{path}: expected a JSON array of rows or {{\"data\": [...]}}, found a {type(doc).__name__}",
                          hint="Write the rows as [{...}, {...}], or as JSON Lines in a .jsonl file.")
    for n, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: row {n}: each row must be a JSON object, not {type(row).__name__}",
                              hint="Write the rows as [{...}, {...}].")
        yield f"{path}: row {n}", row


def read_csv(path: Path, columns: dict[str, str] | None = None) -> Rows:
    """CSV (or TSV, by suffix) with a header line. A record whose field count differs from the
    header's is an error at the line it starts on: the usual cause is a newline (or a
    delimiter) inside a field that is not quoted."""
    text = _read_text(path, "CSV")
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    reader = csv.reader(text.splitlines(keepends=True), delimiter=delimiter)
    try:
        header = next(reader, None)
        if header is None:
            return
        _check_columns(path, header, columns)
        start = reader.line_num + 1
        for record in reader:
            line, start = start, reader.line_num + 1
            if not record:
                continue
            if len(record) != len(header):
                raise ConfigError(
                    f"{path}:{line}: {len(record)} field{'s' if len(record) != 1 else ''} where the header has {len(header)}",
                    hint=f"A field with a newline, {'a tab' if delimiter == chr(9) else 'a comma'} or a quote in it "
                         "must be in double quotes (\"...\"); look at this line and the one before it.",
                )
            yield f"{path}:{line}", dict(zip(header, record))
    except csv.Error as exc:
        raise ConfigError(f"{path}:{reader.line_num}: not valid CSV: {exc}", hint="Quote fields that hold quotes or newlines.") from None


def _check_columns(path: Path | str, names: list[str], columns: dict[str, str] | None) -> None:
    """A mapped column the file does not have is an error naming it, before any row is read."""
    for target, source in (columns or {}).items():
        if source not in names and target not in names:
            raise ConfigError(
                f"{path}: no column {source!r} (data.columns.{target}); its columns are {', '.join(map(str, names))}",
                hint=f"Map {target} to one of its columns (data.columns.{target}, or --columns {target}=COLUMN).",
            )


def _pyarrow(path: Path | str):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ConfigError(f"{path}: reading {Path(str(path)).suffix or 'this'} files needs pyarrow", hint=EXTRA_HINT) from None
    return pyarrow


def _table_rows(table: Any, path: Path | str, columns: dict[str, str] | None) -> Rows:
    _check_columns(path, list(table.column_names), columns)
    for n, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {n}", row


def read_parquet(path: Path, columns: dict[str, str] | None = None) -> Rows:
    _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors have no common base worth naming
        raise ConfigError(f"{path}: not a readable Parquet file: {str(exc).splitlines()[0]}",
                          hint="Write it again (e.g. with pandas or datasets' to_parquet).") from None
    yield from _table_rows(table, path, columns)


def read_arrow(path: Path, columns: dict[str, str] | None = None) -> Rows:
    """An Arrow IPC file or stream (what ``datasets``' ``save_to_disk`` writes)."""
    _pyarrow(path)
    import pyarrow as pa

    table = None
    for opener in (pa.ipc.open_file, pa.ipc.open_stream):
        try:
            with pa.memory_map(str(path)) as source:
                table = opener(source).read_all()
            break
        except (pa.ArrowInvalid, OSError):
            continue
    if table is None:
        raise ConfigError(f"{path}: not a readable Arrow file", hint="Write it with pyarrow or datasets' save_to_disk.")
    yield from _table_rows(table, path, columns)


def data_files(folder: Path) -> list[Path]:
    """The data files in a folder and its subfolders, in name order (hidden ones left out)."""
    return sorted(
        p for p in folder.rglob("*")
        if p.is_file() and p.suffix.lower() in SUFFIXES and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def read_path(path: Path, columns: dict[str, str] | None = None) -> Rows:
    """Rows of a file (by its suffix; anything else is read as JSON Lines, as before) or of
    every data file in a folder."""
    if path.is_dir():
        files = data_files(path)
        if not files:
            raise ConfigError(f"{path} is a folder with no data files",
                              hint=f"Put data files in it ({', '.join(SUFFIXES)}) or point at a file.")
        for file in files:
            yield from read_path(file, columns)
        return
    suffix = path.suffix.lower()
    if suffix == ".json":
        yield from read_json(path)
    elif suffix in (".csv", ".tsv"):
        yield from read_csv(path, columns)
    elif suffix == ".parquet":
        yield from read_parquet(path, columns)
    elif suffix == ".arrow":
        yield from read_arrow(path, columns)
    else:
        yield from ((f"{path}:{n}", row) for n, row in read_jsonl(path))


def hub_name(text: str) -> tuple[str, str | None]:
    """``hf://datasets/ORG/NAME[@REVISION]`` -> (ORG/NAME, revision)."""
    if not text.startswith("hf://datasets/"):
        return text, None  # a name as given (``dataset:``), revision in its own key
    name, _, revision = text[len("hf://datasets/"):].partition("@")
    return name.strip("/"), revision or None


def _unreachable(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        text = f"{type(seen).__name__} {seen}".lower()
        if any(s in text for s in ("offline", "connection", "couldn't reach", "could not reach", "resolve", "timed out",
                                   "timeout", "network", "max retries")):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _offline() -> bool:
    """datasets' own offline switch (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, read as it does)."""
    from datasets import config

    return bool(getattr(config, "HF_HUB_OFFLINE", False) or getattr(config, "HF_DATASETS_OFFLINE", False))


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub (its configured endpoint) opens within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)), timeout=timeout).close()
    except OSError:
        return False
    return True


def read_hub(name: str, *, split: str | None, subset: str | None, revision: str | None,
             columns: dict[str, str] | None = None) -> Rows:
    """A Hugging Face hub dataset (or one in the local ``datasets`` cache) through ``datasets``."""
    label = f"hf://datasets/{name}" + (f"@{revision}" if revision else "")
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{label}: reading hub datasets needs the 'datasets' package", hint=EXTRA_HINT) from None
    datasets.disable_progress_bars()  # stderr carries the plan and errors, not datasets' bars
    datasets.logging.set_verbosity_error()
    split = split or "train"
    unreachable = ConfigError(
        f"{label}: the Hugging Face hub is unreachable from here, so the dataset cannot be loaded",
        hint="Download it where the hub is reachable and pass the file or folder as the path "
             "(or set HF_HUB_OFFLINE=1 to use a copy in the datasets cache).",
    )
    if not _offline() and not _hub_reachable():
        raise unreachable  # at once, not after datasets' retries (half a minute of warnings)
    try:
        loaded = datasets.load_dataset(name, subset, split=split, revision=revision)
    except Exception as exc:  # noqa: BLE001 - datasets raises many unrelated types
        if _unreachable(exc):
            raise unreachable from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{label}: cannot load split {split!r}: {first}",
                          hint="Check the dataset name, subset, split and revision on huggingface.co, or pass a file.") from None
    _check_columns(label, list(loaded.column_names), columns)
    for n, row in enumerate(loaded, start=1):
        yield f"{label}[{split}]: row {n}", dict(row)
