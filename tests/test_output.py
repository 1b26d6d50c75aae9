"""The output sink: every format, TTY and non-TTY behaviour, jq, quiet, confirmations."""

from __future__ import annotations

import io
import json
from datetime import datetime, timezone

import pytest

from baseten_loops_cli.errors import CancelledError, UsageError
from baseten_loops_cli.output.sink import Output, Streams

ROWS = [
    {"id": "abc1234", "base_model": "loops-local/tiny", "status": "ACTIVE",
     "created_at": datetime(2026, 12, 3, 9, 30, tzinfo=timezone.utc)},
    {"id": "def5678", "base_model": "loops-local/tiny", "status": "INACTIVE",
     "created_at": datetime(2026, 12, 2, 8, 0, tzinfo=timezone.utc)},
]
COLUMNS = [("ID", "id"), ("BASE MODEL", "base_model"), ("STATUS", "status"), ("CREATED", "created_at")]


def make(fmt=None, *, tty=False, stdin="", **kwargs):
    streams = Streams(
        stdin=io.StringIO(stdin), stdout=io.StringIO(), stderr=io.StringIO(),
        stdin_tty=tty, stdout_tty=tty, stderr_tty=tty,
    )
    return Output(fmt, streams=streams, **kwargs), streams


def emit_runs(out):
    out.emit({"runs": ROWS}, rows=ROWS, columns=COLUMNS, empty="No runs.", empty_hint="Pass --all.")


def test_json_is_stable_snake_case_with_utc_timestamps():
    out, s = make("json")
    emit_runs(out)
    doc = json.loads(s.stdout.getvalue())
    assert doc["runs"][0]["created_at"] == "2026-12-03T09:30:00Z"
    assert set(doc["runs"][0]) == {"id", "base_model", "status", "created_at"}
    assert s.stderr.getvalue() == ""


def test_jsonl_prints_one_object_per_row():
    out, s = make("jsonl")
    emit_runs(out)
    lines = s.stdout.getvalue().splitlines()
    assert [json.loads(l)["id"] for l in lines] == ["abc1234", "def5678"]


def test_yaml_output():
    import yaml

    out, s = make("yaml")
    emit_runs(out)
    assert yaml.safe_load(s.stdout.getvalue())["runs"][1]["status"] == "INACTIVE"


def test_csv_is_the_tables_rows_and_columns_read_back_by_the_csv_module():
    import csv
    import io

    out, s = make("csv")
    emit_runs(out)
    rows = list(csv.reader(io.StringIO(s.stdout.getvalue())))
    assert rows[0] == [h for h, _ in COLUMNS] and len(rows) == 1 + len(ROWS)
    assert rows[2][[h for h, _ in COLUMNS].index("STATUS")] == "INACTIVE"
    out, s = make("csv")
    out.emit({"runs": [{"run": "a,b", "tags": ["x", "y"], "loss": None}]}, rows=[{"run": "a,b", "tags": ["x", "y"], "loss": None}],
             columns=[("run", "run"), ("tags", "tags"), ("loss", "loss")])
    assert list(csv.reader(io.StringIO(s.stdout.getvalue()))) == [["run", "tags", "loss"], ["a,b", "x;y", ""]]


def test_table_marks_the_cells_marked_and_documents_do_not():
    row = {"run": "a", "loss": 0.5, "best": ["loss"]}
    out, s = make("table", tty=False)
    out.emit({"runs": [row]}, rows=[row], columns=[("run", "run"), ("loss", "loss")],
             marked=lambda r, column: column in r["best"])
    assert s.stdout.getvalue().splitlines()[1].split() == ["a", "0.5*"]
    out, s = make("json")
    out.emit({"runs": [row]}, rows=[row], columns=[("run", "run"), ("loss", "loss")],
             marked=lambda r, column: column in r["best"])
    assert json.loads(s.stdout.getvalue())["runs"][0]["loss"] == 0.5


def test_none_prints_nothing():
    out, s = make("none")
    emit_runs(out)
    assert s.stdout.getvalue() == ""


def test_quiet_prints_ids_only_and_no_messages():
    out, s = make("table", quiet=True)
    emit_runs(out)
    out.info("chatter")
    assert s.stdout.getvalue().split() == ["abc1234", "def5678"]
    assert s.stderr.getvalue() == ""


def test_table_off_tty_is_plain_columns_without_escape_codes():
    out, s = make("table", tty=False)
    emit_runs(out)
    text = s.stdout.getvalue()
    assert "\x1b" not in text and "│" not in text
    header, first, _ = text.splitlines()
    assert header.split() == ["ID", "BASE", "MODEL", "STATUS", "CREATED"]
    assert first.startswith("abc1234  loops-local/tiny  ACTIVE")


def test_table_on_tty_uses_rich(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    out, s = make("table", tty=True)
    emit_runs(out)
    assert "abc1234" in s.stdout.getvalue()
    assert "\x1b[" in s.stdout.getvalue()  # styled header


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_no_color_and_dumb_terminal_disable_styling(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out, s = make("table", tty=True)
    emit_runs(out)
    assert "\x1b[" not in s.stdout.getvalue()


def test_empty_table_says_so_on_stderr_with_hint():
    out, s = make("table")
    out.emit({"runs": []}, rows=[], columns=COLUMNS, empty="No runs.", empty_hint="Pass --all.")
    assert s.stdout.getvalue() == ""
    assert s.stderr.getvalue().splitlines() == ["No runs.", "Pass --all."]


def test_empty_json_is_still_a_document():
    out, s = make("json")
    out.emit({"runs": []}, rows=[], columns=COLUMNS)
    assert json.loads(s.stdout.getvalue()) == {"runs": []}


def test_jq_filters_and_implies_json():
    out, s = make("table", jq=".runs[] | select(.status == \"ACTIVE\") | .id")
    assert out.format == "json"
    emit_runs(out)
    assert s.stdout.getvalue().strip() == "abc1234"


def test_jq_syntax_error_is_a_usage_error():
    with pytest.raises(UsageError, match="--jq"):
        make(jq=".runs[")


def test_unknown_format_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown output format 'xml'"):
        make("xml")


def test_confirm_without_tty_refuses_with_the_flag_to_use():
    out, _ = make("table", tty=False)
    with pytest.raises(CancelledError) as info:
        out.confirm("Deactivate run abc?", yes=False)
    assert "--yes" in info.value.hint
    out.confirm("Deactivate run abc?", yes=True)  # --yes skips the question


def test_secret_prompt_needs_a_terminal_and_reads_the_answer():
    out, _ = make("table", tty=False, stdin="sk-live\n")
    with pytest.raises(UsageError) as info:
        out.ask_secret("API key", what="key", hint="Pipe it in.")
    assert info.value.message == "no terminal to prompt for the key" and info.value.hint == "Pipe it in."
    out, s = make("table", tty=True, stdin=" sk-live \n")
    assert out.ask_secret("API key", what="key", hint="Pipe it in.") == "sk-live"
    assert s.stderr.getvalue() == "API key: " and s.stdout.getvalue() == ""


@pytest.mark.parametrize("fmt,tty,drawn", [("table", True, True), ("table", False, False), ("json", True, False)])
def test_status_spinner_only_for_a_person_at_a_terminal(monkeypatch, fmt, tty, drawn):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    out, s = make(fmt, tty=tty)
    with out.status("Converting tiny") as status:
        status.update({"event": "convert"}, "Converting tiny (3s)")
    assert ("Converting tiny" in s.stderr.getvalue()) is drawn, s.stderr.getvalue()
    assert s.stdout.getvalue() == ""


def test_confirm_on_tty_declined_and_accepted():
    out, _ = make("table", tty=True, stdin="n\n")
    with pytest.raises(CancelledError):
        out.confirm("Proceed?", yes=False)
    out, _ = make("table", tty=True, stdin="y\n")
    out.confirm("Proceed?", yes=False)


def test_fields_view_for_one_object():
    out, s = make("table")
    out.emit(ROWS[0], fields=[("ID", "id"), ("Status", "status")])
    assert s.stdout.getvalue().splitlines() == ["ID:     abc1234", "Status: ACTIVE"]


# ── the views commands used to pick themselves (train, eval, sample) ───────────────────────

PLAN = {"config": "my.yaml", "valid": True, "plan": {"kind": "sft", "steps": 3}}


@pytest.mark.parametrize("fmt, quiet, stdout, stderr", [
    ("table", False, "", "Plan: 3 steps\nmy.yaml: OK\n"),
    ("table", True, "my.yaml\n", ""),
    ("json", False, json.dumps(PLAN, indent=2) + "\n", ""),
    ("jsonl", False, json.dumps(PLAN, separators=(",", ":")) + "\n", ""),
    ("yaml", False, "config: my.yaml\nvalid: true\nplan:\n  kind: sft\n  steps: 3\n", ""),
    ("none", False, "", ""),
])
def test_report_is_messages_for_people_and_a_document_for_programs(fmt, quiet, stdout, stderr):
    out, s = make(fmt, quiet=quiet)
    out.report(PLAN, id_key="config", lines=["Plan: 3 steps"], done="my.yaml: OK")
    assert (s.stdout.getvalue(), s.stderr.getvalue()) == (stdout, stderr)


SUMMARY = {"run_id": "abc1234", "status": "completed", "steps": 2}


@pytest.mark.parametrize("fmt, quiet, stdout, stderr", [
    ("table", False, "", "Done: 2 steps\nTry it\n"),
    ("table", True, "abc1234\n", ""),
    ("json", False, json.dumps(SUMMARY, indent=2) + "\n", ""),
    ("jsonl", False, "", "Done: 2 steps\nTry it\n"),  # the stream was the records
    ("yaml", False, "", "Done: 2 steps\nTry it\n"),
    ("none", False, "", "Done: 2 steps\nTry it\n"),
])
def test_summary_ends_a_streamed_command(fmt, quiet, stdout, stderr):
    out, s = make(fmt, quiet=quiet)
    out.summary(SUMMARY, id_key="run_id", done="Done: 2 steps", hint="Try it")
    assert (s.stdout.getvalue(), s.stderr.getvalue()) == (stdout, stderr)
    out, s = make(fmt, quiet=quiet)
    out.summary(SUMMARY, id_key="run_id")  # nothing to say (an error message follows)
    assert s.stdout.getvalue() == stdout and s.stderr.getvalue() == ""


def test_note_is_for_a_person_reading_the_table_only():
    for fmt, quiet, said in [("table", False, "plan\n"), ("table", True, ""), ("json", False, ""), ("jsonl", False, "")]:
        out, s = make(fmt, quiet=quiet)
        out.note("plan")
        assert (s.stdout.getvalue(), s.stderr.getvalue()) == ("", said)


def test_text_streams_are_refused_with_document_formats():
    for fmt in ("table", "none"):
        make(fmt)[0].check_text_stream("--stream", hint="h")
    make("table", quiet=True)[0].check_text_stream("--stream", hint="h")
    for fmt, kwargs in [("json", {}), ("jsonl", {}), ("yaml", {}), (None, {"jq": "."})]:
        with pytest.raises(UsageError, match="--stream prints text as it is generated, not -o "):
            make(fmt, **kwargs)[0].check_text_stream("--stream", hint="h")


def test_commands_never_pick_the_view_from_the_format():
    """DEVELOPERS.md: commands hand documents to the sink; the sink picks what each format shows."""
    import re
    from pathlib import Path

    cli = Path(__file__).resolve().parents[1] / "baseten_loops_cli" / "cli"
    offenders = [f"{path.name}:{n}: {line.strip()}"
                 for path in sorted(cli.glob("*.py")) if path.name != "_state.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"\bout\.(format|human|quiet)\b", line)]
    assert offenders == [], offenders
