"""The one output sink every command writes through.

Data goes to stdout in the chosen format; messages, hints, warnings and progress go to stderr.
- ``table`` (default): a Rich table on a TTY; plain aligned columns (no colour, no box) off a TTY.
- ``json``: one JSON document; ``jsonl``: one JSON object per row (streams).
- ``yaml``; ``none`` (nothing on stdout; exit code only).
- ``--jq EXPR`` implies json and filters through the ``jq`` package.
- ``-q/--quiet``: the IDs only, one per line, and no messages.

Colour and animation follow the terminal: none when the stream is not a TTY, when ``NO_COLOR``
is set or ``TERM=dumb``. That decision is made once, in :class:`Streams` (``stdout_color``,
``stderr_color``; ``Output.animate`` adds "a person is reading"), the one seam tests replace. Commands never branch on the format
or the terminal themselves: they hand models to :meth:`Output.emit` (a document, with its table,
key/value or text view), :meth:`Output.report` (a document people read as messages: a plan),
:meth:`Output.summary` (the end of a command that streamed its progress), :meth:`Output.stream` (one record of a live stream: a log line, a watch
snapshot), :meth:`Output.live` (a line redrawn in place), :meth:`Output.status` (a spinner while a step
runs), :meth:`Output.progress` (a transfer bar), :meth:`Output.confirm` and
:meth:`Output.ask_secret`; the sink picks what each format shows.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from typing import Any, Callable, Iterable, Sequence, TextIO

from baseten_loops_cli.errors import CancelledError, UsageError

FORMATS = ("table", "json", "jsonl", "yaml", "csv", "none")

# A column is (header, key or function of the row). A key is a dotted path in the row's JSON
# ("user.email"); a function gets the row as it was given (a model, or a dict).
Column = tuple[str, "str | Callable[[Any], Any]"]


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

    @staticmethod
    def _styling_allowed() -> bool:
        return not (os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb")

    @property
    def stdout_color(self) -> bool:
        """Colour and Rich tables on stdout."""
        return bool(self.stdout_tty) and self._styling_allowed()

    @property
    def stderr_color(self) -> bool:
        """Colour, live views and progress bars on stderr."""
        return bool(self.stderr_tty) and self._styling_allowed()


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
    def animate(self) -> bool:
        """Live views and progress bars are drawn (on stderr) for a person at a terminal."""
        return self.human and bool(self.streams.stderr_tty)

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            color = self.streams.stdout_color
            self._console = Console(
                file=self.streams.stdout, force_terminal=color, no_color=not color, highlight=False, soft_wrap=False
            )
        return self._console

    @property
    def err_console(self):
        if self._err_console is None:
            from rich.console import Console

            color = self.streams.stderr_color
            self._err_console = Console(file=self.streams.stderr, force_terminal=color, no_color=not color, highlight=False)
        return self._err_console

    # ------------------------------------------------------------------ messages (stderr)
    def _message(self, text: str, style: str | None = None) -> None:
        if style and self.streams.stderr_tty:
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

    # ------------------------------------------------------------------ confirmation
    def confirm(self, question: str, *, yes: bool, action: str | None = None, default: bool = False) -> None:
        """Ask ``question``; raise CancelledError on "no". ``--yes`` skips the question.

        Prompting needs a terminal: without one, the command is cancelled (exit 3) with a short
        message naming ``action`` ("deactivating run abc1234") and the flag to pass.
        """
        if yes:
            return
        if not self.streams.stdin_tty:
            what = f"not {action} without confirmation (stdin is not a terminal)" if action else (
                f"{question.rstrip('?')}: confirmation needed but stdin is not a terminal"
            )
            raise CancelledError(what, hint="Pass --yes to confirm non-interactively.")
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

    def ask_secret(self, question: str, *, what: str, hint: str) -> str:
        """Ask for a secret on the terminal without echoing it. Without a terminal, a usage
        error: "no terminal to prompt for the ``what``", with ``hint`` (how to pipe it in)."""
        if not self.streams.stdin_tty:
            raise UsageError(f"no terminal to prompt for the {what}", hint=hint)
        if self.streams.stdin is not sys.stdin:  # a stream handed in (tests, embedding): read it
            self.streams.stderr.write(f"{question}: ")
            self.streams.stderr.flush()
            return self.streams.stdin.readline().strip()
        import getpass

        return getpass.getpass(f"{question}: ", stream=self.streams.stderr).strip()

    # ------------------------------------------------------------------ data (stdout)
    def marked(self, text: str, spans: Sequence[Sequence[int]], style: str = "bold green reverse") -> list[str]:
        """Lines showing ``text`` with its character ``spans`` ([start, end)) marked: highlighted
        where stdout shows colour; elsewhere the plain text and a line of the spans as offsets
        (`loops data preview`: which tokens are trained)."""
        if self.streams.stdout_color:
            from rich.text import Text

            marked = Text(text)
            for start, end in spans:
                marked.stylize(style, start, end)
            with self.console.capture() as capture:
                self.console.print(marked, end="")
            return [capture.get()]
        offsets = " ".join(f"[{start}, {end})" for start, end in spans) or "none"
        return [text, f"trained characters: {offsets}"]

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
            raise UsageError(f"--jq: invalid expression {expr!r}: {first}",
                             hint="Check the expression's brackets and quotes; e.g. --jq '.runs[].id'.") from None

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
        id_key: str | Callable[[Any], Any] = "id",
        empty: str | None = None,
        empty_hint: str | None = None,
        text: Iterable[str] | None = None,
        note: str | None = None,
        hint: str | None = None,
        marked: Callable[[dict, str], bool] | None = None,
    ) -> None:
        """Write ``data`` (the JSON document: a model, or a dict of models) in the chosen format.

        ``rows`` + ``columns`` describe the table view (and the jsonl/quiet views) of a list;
        ``fields`` describes a key/value view of a single object; ``text`` is a view of plain
        lines (an empty one: the messages on stderr already said it all). Without any of them,
        tables fall back to JSON. For people only (the table view): ``note`` is said on stderr
        before the view, ``hint`` after a non-empty one. ``marked(row, header)`` says which cells
        the table marks with ``*`` (the best of a column); documents carry that in their data.
        """
        payload = to_jsonable(data)
        originals = list(rows) if rows is not None else None
        row_list = [to_jsonable(r) for r in originals] if originals is not None else None
        if self.format == "none":
            return
        if self.quiet:
            pairs = zip(row_list, originals) if row_list is not None and originals is not None else [(payload, data)]
            for row, original in pairs:
                value = _cell(row, id_key, original)
                if value is not None and (value != "" or text is not None):
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
        if self.format == "csv":
            self._csv(row_list, originals, columns, payload)
            return
        # table
        if note:
            self.info(note)
        if row_list is not None and not row_list and (columns is not None or text is not None):
            if empty:
                self.info(empty)
            if empty_hint:
                self.hint(empty_hint)
            return
        if text is not None:
            for line in text:
                self._write(line)
        elif row_list is not None and originals is not None and columns is not None:
            self._table(list(zip(row_list, originals)), columns, title, marked)
        elif fields is not None:
            self._fields(payload, data, fields)
        else:
            self._emit_json_value(payload)
        if hint:
            self.hint(hint)

    def report(self, data: Any, *, id_key: str | Callable[[Any], Any] = "id", lines: Sequence[str] = (),
               done: str | None = None) -> None:
        """A document whose view for people is messages on stderr, not a table (a training
        plan): the table view says each of ``lines``, then ``done`` as a success, and leaves
        stdout empty; every other format (and -q) prints ``data`` as :meth:`emit` does."""
        if not self.human:
            self.emit(data, id_key=id_key)
            return
        for line in lines:
            self.info(line)
        if done:
            self.success(done)

    def summary(self, data: Any, *, id_key: str | Callable[[Any], Any] = "id", done: str | None = None,
                hint: str | None = None) -> None:
        """The end of a command that streamed its progress (`train run`): -o json prints ``data``,
        -q its ``id_key``; the other formats (the table; jsonl, whose stream was the records;
        yaml; none) say ``done`` as a success on stderr, then ``hint``."""
        if self.format == "json" or self.quiet:
            self.emit(data, id_key=id_key)
            return
        if done:
            self.success(done)
        if hint:
            self.hint(hint)

    def note(self, text: str) -> None:
        """A message for a person reading the table view (not -q, nor json, jsonl, yaml, none):
        what :meth:`emit`'s ``note`` says, on its own (a plan shown before the work starts)."""
        if self.human:
            self.info(text)

    def check_text_stream(self, option: str, *, hint: str) -> None:
        """Refuse ``option``, which prints text as it comes (:meth:`text_piece`), with a format
        that prints documents (json, jsonl, yaml, --jq): a usage error naming both."""
        if self.format in ("json", "jsonl", "yaml", "csv"):
            raise UsageError(f"{option} prints text as it is generated, not -o {self.format}", hint=hint)

    def stream(self, record: Any, *, text: str | None, quiet_text: str | None = None) -> None:
        """One item of a stream that is printed as it comes (a log line, a watch snapshot):
        json/jsonl print the record as one JSON line, the table view ``text``, -q
        ``quiet_text``; ``none`` prints nothing."""
        if self.format in ("json", "jsonl"):
            self._emit_json_value(to_jsonable(record), lines=True)
        elif self.quiet:
            if quiet_text is not None:
                self._write(quiet_text)
        elif self.format == "table" and text is not None:
            self._write(text)

    def text_piece(self, piece: str) -> None:
        """Text printed as it comes (a streamed answer): no newline added, flushed at once;
        ``none`` prints nothing."""
        if self.format != "none":
            self.streams.stdout.write(piece)
            self.streams.stdout.flush()

    def live(self) -> "LiveLine":
        """A line redrawn in place on stderr for a person at a terminal; elsewhere its
        :meth:`LiveLine.update` streams each state like :meth:`stream` (with a time stamp in
        the table view)."""
        return LiveLine(self)

    def status(self, text: str) -> "LiveLine":
        """A spinner with a line of text on stderr while a step runs, for a person at a
        terminal (``update(record, text)`` changes the text); elsewhere nothing (say each step
        with :meth:`info`). A context manager."""
        return LiveLine(self, spinner=text)

    def progress(self, label: str):
        """A transfer bar on stderr (bytes, rate, ETA, files) for a person at a terminal
        (:attr:`animate`: the table view, not -q), or a
        silent stand-in: either way it has ``start``/``advance``/``file_done`` and is a
        context manager. The rate is the transfer's average, as the summary reports it."""
        if self.animate:
            from baseten_loops_cli.output.progress import TransferBar

            return TransferBar(self.err_console, label)
        from baseten_loops_cli.api.download import NoProgress  # what a download draws by default

        return NoProgress()

    def count_progress(self, label: str):
        """A bar of items done out of a total (with the time left) on stderr for a person at a
        terminal (:attr:`animate`), silent otherwise; ``start(total)``/``advance(n)``, a context manager."""
        from baseten_loops_cli.output.progress import CountBar

        return CountBar(self.err_console if self.animate else None, label)

    def training_view(self):
        """How a training run shows its steps (``training.experiments.metrics.TrainingView``): a Rich live
        view (progress bar, ETA, step line, sparkline) for a person at a terminal
        (:attr:`animate`); otherwise one plain line per step on stderr (none with -q), and with
        ``-o jsonl`` each step's record on stdout as it comes."""
        from baseten_loops_cli.output.training_view import LiveTrainingView, PlainTrainingView

        if self.animate:
            return LiveTrainingView(self.err_console)
        return PlainTrainingView(jsonl=self.format == "jsonl", quiet=self.quiet,
                                 out=self.streams.stdout, err=self.streams.stderr)

    # ------------------------------------------------------------------ renderers
    def _table(self, rows: list[tuple[dict, Any]], columns: Sequence[Column], title: str | None,
               marked: Callable[[dict, str], bool] | None = None) -> None:
        headers = [h for h, _ in columns]
        cells = [[format_cell(_cell(row, key, original)) + ("*" if marked is not None and marked(row, header) else "")
                  for header, key in columns] for row, original in rows]
        if self.is_tty:
            from rich.table import Table

            table = Table(title=title, header_style="bold", box=None)
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

    def _csv(self, rows: list[dict] | None, originals: list[Any] | None, columns: Sequence[Column] | None,
             payload: Any) -> None:
        """RFC 4180 CSV: the table's rows and columns (headers as the table's); without a table,
        one row of the document's top-level scalar fields. Lists are joined with ``;``."""
        import csv
        import io

        def cell(value: Any) -> Any:
            if value is None:
                return ""
            if isinstance(value, (list, tuple)):
                return ";".join(str(v) for v in value)
            if isinstance(value, dict):
                return json.dumps(value, separators=(",", ":"))
            return value

        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        if rows is not None and originals is not None and columns is not None:
            writer.writerow([h for h, _ in columns])
            for row, original in zip(rows, originals):
                writer.writerow([cell(_cell(row, key, original)) for _, key in columns])
        elif isinstance(payload, dict):
            writer.writerow(list(payload))
            writer.writerow([cell(v) for v in payload.values()])
        else:
            writer.writerow([cell(payload)])
        self._write(buffer.getvalue().rstrip("\n"))

    def _fields(self, obj: dict, original: Any, fields: Sequence[Column]) -> None:
        width = max(len(label) for label, _ in fields) + 1
        for label, key in fields:
            if label.startswith("#"):  # a section heading
                self._write("")
                self._write(label[1:].strip())
                continue
            self._write(f"{(label + ':').ljust(width)} {format_cell(_cell(obj, key, original))}")


class LiveLine:
    """See :meth:`Output.live` and :meth:`Output.status`. Use as a context manager; ``update``
    whenever the state changes. With ``spinner`` (its first text) it is a spinner that goes
    away at the end and says nothing off a terminal; without, a line that stays, streamed
    (time-stamped) off a terminal."""

    def __init__(self, out: Output, spinner: str | None = None):
        self._out = out
        self._spinner_text = spinner
        self._spinner: Any = None  # rich.spinner.Spinner while one turns
        self._live: Any = None  # rich.live.Live while animated

    def __enter__(self) -> "LiveLine":
        if self._out.animate:
            from rich.live import Live
            from rich.spinner import Spinner
            from rich.text import Text

            if self._spinner_text is not None:
                self._spinner = Spinner("dots", Text(self._spinner_text))
            self._live = Live(self._spinner or Text(""), console=self._out.err_console, transient=self._spinner is not None,
                              refresh_per_second=12.5 if self._spinner is not None else 4)  # fmt: skip
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def update(self, record: Any, text: str) -> None:
        if self._live is not None:
            from rich.text import Text

            if self._spinner is not None:
                self._spinner.update(text=Text(text))
            else:
                self._live.update(Text(text))
            return
        if self._spinner_text is None:
            stamp = datetime.now().strftime("%H:%M:%S")
            self._out.stream(record, text=f"[{stamp}] {text}")


def _cell(row: Any, key: "str | Callable[[Any], Any]", original: Any = None) -> Any:
    """The value of ``key`` in ``row`` (JSON); a function of the row gets ``original``."""
    if callable(key):
        try:
            return key(row if original is None else original)
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
