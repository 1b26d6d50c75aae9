"""The one output sink every command writes through.

Data goes to stdout in the chosen format; messages, hints, warnings and progress go to stderr.
- ``table`` (default): a Rich table on a TTY; plain aligned columns (no colour, no box) off a TTY.
- ``json``: one JSON document; ``jsonl``: one JSON object per row (streams).
- ``yaml``; ``none`` (nothing on stdout; exit code only).
- ``--jq EXPR`` implies json and filters through the ``jq`` package.
- ``-q/--quiet``: the IDs only, one per line, and no messages.

Colour and animation follow the terminal: none when the stream is not a TTY, when ``NO_COLOR``
is set or ``TERM=dumb``. The TTY checks live in :class:`Streams`, the one seam tests replace.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from typing import Any, Callable, Iterable, Sequence, TextIO

from baseten_loops_cli.errors import CancelledError, UsageError

FORMATS = ("table", "json", "jsonl", "yaml", "none")

# A column is (header, key or function of the row).
Column = tuple[str, "str | Callable[[dict], Any]"]


@dataclass
class Streams:
    """stdin/stdout/stderr and whether each is an interactive terminal."""

    stdin: TextIO = field(default_factory=lambda: sys.stdin)
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    stdin_tty: bool | None = None
    stdout_tty: bool | None = None
    stderr_tty: bool | None = None

    def __post_init__(self) -> None:
        if self.stdin_tty is None:
            self.stdin_tty = _isatty(self.stdin)
        if self.stdout_tty is None:
            self.stdout_tty = _isatty(self.stdout)
        if self.stderr_tty is None:
            self.stderr_tty = _isatty(self.stderr)

    @property
    def color(self) -> bool:
        if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
            return False
        return bool(self.stdout_tty)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def to_jsonable(value: Any) -> Any:
    """Convert models, datetimes and containers to plain JSON values (stable snake_case keys)."""
    if hasattr(value, "model_dump"):
        return to_jsonable(value.model_dump(mode="python", exclude_none=False))
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "value") and type(value).__module__ != "builtins" and hasattr(type(value), "__members__"):
        return value.value  # enums
    if hasattr(value, "__fspath__"):
        return os.fspath(value)
    return value


class Output:
    def __init__(
        self,
        format: str | None = None,
        *,
        jq: str | None = None,
        quiet: bool = False,
        streams: Streams | None = None,
    ):
        fmt = (format or os.environ.get("LOOPS_OUTPUT") or "table").lower()
        if fmt not in FORMATS:
            raise UsageError(
                f"unknown output format {fmt!r}",
                hint=f"Use one of: {', '.join(FORMATS)}.",
            )
        if jq and fmt not in ("json", "jsonl"):
            fmt = "json"
        self.format = fmt
        self.jq = jq
        self.quiet = quiet
        self.streams = streams or Streams()
        self._compiled_jq = self._compile_jq(jq) if jq else None
        self._console = None
        self._err_console = None

    # ------------------------------------------------------------------ properties
    @property
    def human(self) -> bool:
        """True when stdout is for a person (a table), not for a program."""
        return self.format == "table" and not self.quiet

    @property
    def is_tty(self) -> bool:
        return bool(self.streams.stdout_tty)

    @property
    def interactive(self) -> bool:
        return bool(self.streams.stdin_tty and self.streams.stderr_tty)

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(
                file=self.streams.stdout,
                force_terminal=self.streams.stdout_tty and self.streams.color,
                no_color=not self.streams.color,
                highlight=False,
                soft_wrap=False,
            )
        return self._console

    @property
    def err_console(self):
        if self._err_console is None:
            from rich.console import Console

            color = bool(self.streams.stderr_tty) and not (
                os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb"
            )
            self._err_console = Console(
                file=self.streams.stderr,
                force_terminal=color,
                no_color=not color,
                highlight=False,
            )
        return self._err_console

    # ------------------------------------------------------------------ messages (stderr)
    def _message(self, text: str, style: str | None = None) -> None:
        if self.streams.stderr_tty and style and self.streams.color is not None:
            self.err_console.print(text, style=style, markup=False, highlight=False)
        else:
            print(text, file=self.streams.stderr, flush=True)

    def info(self, text: str) -> None:
        if not self.quiet:
            self._message(text)

    def success(self, text: str) -> None:
        if not self.quiet:
            self._message(text, "green")

    def warn(self, text: str) -> None:
        self._message(f"Warning: {text}", "yellow")

    def hint(self, text: str) -> None:
        if not self.quiet:
            self._message(text, "dim")

    def progress(self, description: str) -> "ProgressBar":
        """A progress bar on stderr: drawn on a terminal only (and not with -q), silent
        otherwise, so it never mixes with data or logs."""
        return ProgressBar(self if (self.streams.stderr_tty and not self.quiet) else None, description)

    # ------------------------------------------------------------------ confirmation
    def confirm(self, question: str, *, yes: bool, default: bool = False) -> None:
        """Ask ``question``; raise CancelledError on "no". ``--yes`` skips the question.

        Prompting needs a terminal: without one, the user is told which flag to pass.
        """
        if yes:
            return
        if not self.streams.stdin_tty:
            raise CancelledError(
                f"{question.rstrip('?')}: confirmation needed but stdin is not a terminal",
                hint="Pass --yes to confirm non-interactively.",
            )
        suffix = " [Y/n] " if default else " [y/N] "
        self.streams.stderr.write(question + suffix)
        self.streams.stderr.flush()
        answer = self.streams.stdin.readline()
        if not answer:
            raise CancelledError("cancelled (no answer)")
        answer = answer.strip().lower()
        accepted = (answer in {"y", "yes"}) or (not answer and default)
        if not accepted:
            raise CancelledError("cancelled")

    # ------------------------------------------------------------------ data (stdout)
    def _write(self, text: str) -> None:
        self.streams.stdout.write(text)
        if not text.endswith("\n"):
            self.streams.stdout.write("\n")
        self.streams.stdout.flush()

    @staticmethod
    def _compile_jq(expr: str):
        try:
            import jq as jq_module
        except ImportError:
            raise UsageError(
                "--jq needs the 'jq' package",
                hint="pip install 'baseten-loops-cli[jq]'",
            ) from None
        try:
            return jq_module.compile(expr)
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "syntax error"
            raise UsageError(f"--jq: invalid expression {expr!r}: {first}") from None

    def _emit_json_value(self, value: Any, *, lines: bool = False) -> None:
        if self._compiled_jq is not None:
            try:
                results = self._compiled_jq.input_value(value).all()
            except ValueError as exc:
                raise UsageError(f"--jq: {str(exc).strip().splitlines()[0]}") from None
            for item in results:
                self._write(item if isinstance(item, str) else json.dumps(item, ensure_ascii=False))
            return
        if lines:
            self._write(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        else:
            self._write(json.dumps(value, indent=2, ensure_ascii=False))

    def emit(
        self,
        data: Any,
        *,
        rows: Iterable[Any] | None = None,
        columns: Sequence[Column] | None = None,
        fields: Sequence[Column] | None = None,
        title: str | None = None,
        id_key: str | Callable[[dict], Any] = "id",
        empty: str | None = None,
        empty_hint: str | None = None,
    ) -> None:
        """Write ``data`` (the JSON document) in the chosen format.

        ``rows`` + ``columns`` describe the table view (and the jsonl/quiet views) of a list;
        ``fields`` describes a key/value view of a single object. Without either, tables fall
        back to JSON.
        """
        payload = to_jsonable(data)
        row_list = [to_jsonable(r) for r in rows] if rows is not None else None
        if self.format == "none":
            return
        if self.quiet:
            for row in row_list if row_list is not None else [payload]:
                value = _cell(row, id_key)
                if value not in (None, ""):
                    self._write(str(value))
            return
        if self.format == "json":
            self._emit_json_value(payload)
            return
        if self.format == "jsonl":
            for row in row_list if row_list is not None else [payload]:
                self._emit_json_value(row, lines=True)
            return
        if self.format == "yaml":
            import yaml

            self._write(yaml.safe_dump(payload, sort_keys=False, allow_unicode=True).rstrip("\n"))
            return
        # table
        if row_list is not None and columns is not None:
            if not row_list:
                if empty:
                    self.info(empty)
                if empty_hint:
                    self.hint(empty_hint)
                return
            self._table(row_list, columns, title)
            return
        if fields is not None:
            self._fields(payload, fields)
            return
        self._emit_json_value(payload)

    def emit_record(self, record: Any) -> None:
        """Stream one record (jsonl/json modes); tables ignore records (they render their own)."""
        if self.format in ("json", "jsonl"):
            self._emit_json_value(to_jsonable(record), lines=True)

    # ------------------------------------------------------------------ renderers
    def _table(self, rows: list[dict], columns: Sequence[Column], title: str | None) -> None:
        headers = [h for h, _ in columns]
        cells = [[format_cell(_cell(row, key)) for _, key in columns] for row in rows]
        if self.is_tty:
            from rich.table import Table

            table = Table(title=title, header_style="bold", box=None if not self.streams.color else None)
            for header in headers:
                table.add_column(header, overflow="fold")
            for line in cells:
                table.add_row(*line)
            self.console.print(table)
            return
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        self._write("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
        for line in cells:
            self._write("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())

    def _fields(self, obj: dict, fields: Sequence[Column]) -> None:
        width = max(len(label) for label, _ in fields) + 1
        for label, key in fields:
            if label.startswith("#"):  # a section heading
                self._write("")
                self._write(label[1:].strip())
                continue
            self._write(f"{(label + ':').ljust(width)} {format_cell(_cell(obj, key))}")


class ProgressBar:
    """``with out.progress("Scoring") as bar: bar.start(total); bar.advance()``: a Rich bar with
    a count and the time left, or nothing when ``out`` is None (not a terminal)."""

    def __init__(self, out: Output | None, description: str) -> None:
        self._out = out
        self._description = description
        self._progress: Any = None
        self._task: Any = None

    def start(self, total: int) -> None:
        if self._out is None or total <= 0 or self._progress is not None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            console=self._out.err_console, transient=True,
        )  # fmt: skip
        self._task = self._progress.add_task(self._description, total=total)
        self._progress.start()

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _cell(row: Any, key: str | Callable[[dict], Any]) -> Any:
    if callable(key):
        try:
            return key(row)
        except (KeyError, TypeError, AttributeError):
            return None
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def format_cell(value: Any) -> str:
    from baseten_loops_cli.output.format import human_time

    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str) and _looks_like_iso_time(value):
        return human_time(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _looks_like_iso_time(value: str) -> bool:
    return len(value) >= 20 and value[4] == "-" and value[7] == "-" and value[10] == "T"
