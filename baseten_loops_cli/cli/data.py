"""`loops data`: what a data file holds and what training would make of it, before paying for it."""

from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _help
from baseten_loops_cli.cli._state import get_state

app = typer.Typer(help="Check and preview training data in any format loops reads.", no_args_is_help=True)

KindOpt = Annotated[Optional[str], typer.Option("--kind", "-k", help=f"{_help.kinds_text()} (default: what the format trains with).", show_default=False)]
BaseModelOpt = Annotated[str, typer.Option("--base-model", "-m", help="The model whose tokenizer and chat template render the rows.")]
TrainOnOpt = Annotated[str, typer.Option("--train-on", help="SFT: last_assistant, all_assistant or all.")]
ColumnsOpt = Annotated[Optional[str], typer.Option(
    "--columns", metavar="NAME=COLUMN,...",
    help="Map the format's names to the data's columns, as a config's data.columns: prompt=question,completion=answer.",
    show_default=False)]


def _columns(text: Optional[str]) -> Optional[dict]:
    from baseten_loops_cli.training.data.formats.spec import parse_columns

    return parse_columns(text) if text else None


@app.command("check")
def check(
    ctx: typer.Context,
    path: Annotated[str, typer.Argument(metavar="FILE", help="A data file, a folder of them, or hf://datasets/ORG/NAME.")],
    kind: KindOpt = None,
    base_model: BaseModelOpt = "loops-local/tiny",
    max_seq_len: Annotated[Optional[int], typer.Option("--max-seq-len", min=8, help="The max_seq_len to check token lengths against (default: min(2048, the model's limit), as a config).", show_default=False)] = None,
    train_on: TrainOnOpt = "last_assistant",
    columns: ColumnsOpt = None,
) -> None:
    """Report a data file's format, row count, token lengths against max_seq_len, what each data.truncation policy would do to the rows over it, per-role counts, empty and duplicate rows, and every row `loops train validate` would refuse, with its file and line.

    Exit 1 when a row would be refused (under the default data.truncation: error).

    Examples:

      loops data check alpaca.json

      loops data check qa.csv --columns prompt=question,completion=answer

      loops data check prefs.parquet --kind dpo --base-model HuggingFaceTB/SmolLM2-135M-Instruct --max-seq-len 512 -o json
    """
    from baseten_loops_cli.errors import ConfigError
    from baseten_loops_cli.training.data.formats.inspect import check as check_data

    out = get_state(ctx).output
    report = check_data(path, kind=kind, base_model=base_model, max_seq_len=max_seq_len, train_on=train_on,
                        columns=_columns(columns))
    out.emit(report.as_dict(), text=_check_lines(report))
    if report.problems:
        first = report.problems[0]
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise ConfigError(f"{first.where}: {first.message}{more}", hint=first.hint)


def _check_lines(report) -> list[str]:
    lines = [f"{report.path}: {report.format}, {report.rows:,} rows (kind {report.kind}, {report.base_model})"]
    if report.tokens:
        t = report.tokens
        lines.append(f"tokens per row: min {t['min']:,}, mean {t['mean']:,}, max {t['max']:,} (max_seq_len {report.max_seq_len:,})")
        top = max(b["rows"] for b in report.histogram) or 1
        for bucket in report.histogram:
            bar = "#" * round(30 * bucket["rows"] / top)
            flag = "  over max_seq_len" if bucket["up_to"] > report.max_seq_len and bucket["rows"] else ""
            lines.append(f"  <= {bucket['up_to']:>7,} {bucket['rows']:>7,} {bar}{flag}")
    lines.append("roles: " + (", ".join(f"{role} {n:,}" for role, n in sorted(report.roles.items())) or "none"))
    lines.append(f"rows over max_seq_len: {report.over_max_seq_len:,}" + (" (data.truncation decides: see below)" if report.over_max_seq_len else ""))
    if report.over_max_seq_len:
        t = report.truncation
        lines.append(f"  data.truncation: error (default) refuses {t['error']['refused']:,}; drop skips {t['drop']['dropped']:,}; "
                     + "; ".join(f"{p} cuts {t[p]['cut']:,}" + (f" and refuses {t[p]['refused']:,} (nothing left to train on)" if t[p]["refused"] else "")
                                 for p in ("right", "left")))
    lines.append("empty rows: " + (", ".join(report.empty_rows[:5]) + (" ..." if len(report.empty_rows) > 5 else "") if report.empty_rows else "none"))
    lines.append("duplicate rows: " + (", ".join(f"{b} = {a}" for a, b in report.duplicate_rows[:5])
                                       + (" ..." if len(report.duplicate_rows) > 5 else "") if report.duplicate_rows else "none"))
    if report.problems:
        lines.append(f"problems ({len(report.problems):,}):")
        lines += [f"  {p.where}: {p.message}" for p in report.problems[:20]]
    return lines


@app.command("preview")
def preview(
    ctx: typer.Context,
    path: Annotated[str, typer.Argument(metavar="FILE", help="A data file, a folder of them, or hf://datasets/ORG/NAME.")],
    rows: Annotated[int, typer.Option("--rows", "-n", min=1, help="How many rows to show.")] = 3,
    kind: KindOpt = None,
    base_model: BaseModelOpt = "loops-local/tiny",
    train_on: TrainOnOpt = "last_assistant",
    columns: ColumnsOpt = None,
) -> None:
    """Show the first rows as the model sees them: rendered through the base model's chat template, with the trained tokens highlighted (off a terminal and in -o json: as character offsets).

    Examples:

      loops data preview sharegpt.jsonl --rows 2 --base-model HuggingFaceTB/SmolLM2-135M-Instruct

      loops data preview alpaca.json --train-on all_assistant -o json

      loops data preview qa.csv --columns prompt=question,completion=answer
    """
    from baseten_loops_cli.training.data.formats.inspect import preview as preview_rows

    from dataclasses import asdict

    out = get_state(ctx).output
    kind, fmt, items = preview_rows(path, rows=rows, kind=kind, base_model=base_model, train_on=train_on,
                                    columns=_columns(columns))
    records = [asdict(item) for item in items]
    doc = {"path": path, "format": fmt, "kind": kind, "base_model": base_model, "rows": records}
    lines = [f"{path}: {fmt} (kind {kind}, {base_model})"]
    for item in items:
        lines.append(f"--- {item.where}" + (f" ({item.side})" if item.side else "")
                     + f": {item.tokens:,} tokens, {item.trained_tokens:,} trained")
        lines += out.marked(item.text, item.trained)
    out.emit(doc, rows=records, text=lines, id_key="where")
