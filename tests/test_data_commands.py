"""`loops data check` and `loops data preview` (issue 27): their output on and off a terminal and
in JSON, run as a user runs them (a child process; no server needed)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "NO_COLOR"))}
    env.update({"PYTHONPATH": str(ROOT), "LOOPS_CONFIG_DIR": str(tmp_path / "cfg"), "LOOPS_NO_AUTOSTART": "1",
                "COLUMNS": "200", "TERM": "xterm-256color"})
    env.update(extra)
    return env


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], capture_output=True, text=True,
                          env=_env(tmp_path), cwd=tmp_path, timeout=120)


def run_tty(tmp_path: Path, *args: str) -> str:
    """stdout and stderr of ``loops ARGS`` at a terminal (a pseudo-terminal)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", *args], stdin=follower, stdout=follower,
                            stderr=follower, env=_env(tmp_path), cwd=tmp_path)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


def test_check_reports_format_lengths_roles_and_json(tmp_path):
    out = run(tmp_path, "data", "check", str(FORMATS / "alpaca.json"), "--max-seq-len", "64", "-o", "json")
    assert out.returncode == 1, out.stderr  # two rows (system, history) are over 64 tokens
    doc = json.loads(out.stdout)
    assert (doc["format"], doc["kind"], doc["rows"]) == ("alpaca", "sft", 12)
    assert doc["roles"] == {"user": 13, "assistant": 13, "system": 1}
    assert doc["over_max_seq_len"] == 2 and sum(b["rows"] for b in doc["histogram"]) == 12
    assert [p["where"] for p in doc["problems"]] == [f"{FORMATS / 'alpaca.json'}: row 2", f"{FORMATS / 'alpaca.json'}: row 3"]
    assert "over max_seq_len 64" in doc["problems"][0]["message"]
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error: ")]
    assert errors == [f"Error: {FORMATS / 'alpaca.json'}: row 2: {doc['problems'][0]['message']} (and 1 more)"]


def test_check_table_names_empty_duplicate_and_refused_rows(tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("prompt,completion\nWhat is 1+1?,ANSWER: 2\nWhat is 1+1?,ANSWER: 2\n,\n", encoding="utf-8")
    out = run(tmp_path, "data", "check", str(data))
    assert out.returncode == 1
    assert out.stdout.splitlines()[0] == f"{data}: prompt_completion (standard), 3 rows (kind sft, loops-local/tiny)"
    assert f"duplicate rows: {data}:3 = {data}:2" in out.stdout
    assert f"empty rows: {data}:4" in out.stdout
    assert f"  {data}:4: nothing to train on" in out.stdout
    assert "Traceback" not in out.stderr
    ok = run(tmp_path, "data", "check", str(FORMATS / "sharegpt.jsonl"))
    assert ok.returncode == 0, ok.stderr
    assert "sharegpt, 12 rows" in ok.stdout and "roles: assistant 13, system 11, tool 1, user 12" in ok.stdout


def test_preview_json_spans_are_the_trained_text(tmp_path):
    out = run(tmp_path, "data", "preview", str(FORMATS / "preference.jsonl"), "--rows", "2", "-o", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["format"], doc["kind"]) == ("preference (standard)", "dpo")
    assert [r["side"] for r in doc["rows"]] == ["chosen", "rejected", "chosen", "rejected"]
    first = doc["rows"][0]
    assert [first["text"][a:b] for a, b in first["trained"]] == ["ANSWER: 0<|im_end|>"]
    assert first["trained_tokens"] == len("ANSWER: 0") + 1  # the byte tokenizer: a token per byte, plus <|im_end|>


def test_preview_marks_trained_tokens_at_a_terminal_and_as_offsets_elsewhere(tmp_path):
    plain = run(tmp_path, "data", "preview", str(FORMATS / "alpaca.json"), "-n", "1")
    assert plain.returncode == 0, plain.stderr
    assert "\x1b[" not in plain.stdout
    lines = plain.stdout.splitlines()
    assert lines[0] == f"{FORMATS / 'alpaca.json'}: alpaca (kind sft, loops-local/tiny)"
    assert lines[-1].startswith("trained characters: [")
    tty = run_tty(tmp_path, "data", "preview", str(FORMATS / "alpaca.json"), "-n", "1")
    assert "trained characters" not in tty
    highlighted = tty[tty.index("assistant"):]
    assert "\x1b[" in highlighted and "ANSWER: 0" in highlighted
    before = highlighted[: highlighted.index("ANSWER: 0")]
    assert "\x1b[" in before  # the style starts before the trained reply


def test_check_and_preview_take_kto_rows(tmp_path):
    data = FORMATS / "unpaired_preference.jsonl"
    out = run(tmp_path, "data", "check", str(data), "--kind", "kto")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"{data}: unpaired_preference (standard), 12 rows (kind kto, loops-local/tiny)"
    # Without --kind the rows' format picks the kind; a Parquet file of conversational rows too.
    doc = json.loads(run(tmp_path, "data", "check", str(FORMATS / "unpaired_preference_conversational.parquet"),
                         "-o", "json").stdout)
    assert (doc["format"], doc["kind"], doc["rows"], doc["problems"]) == ("unpaired_preference (conversational)", "kto", 12, [])
    preview = run(tmp_path, "data", "preview", str(data), "--rows", "2", "-o", "json")
    assert preview.returncode == 0, preview.stderr
    rows = json.loads(preview.stdout)["rows"]
    assert [r["text"][a:b] for r in rows for a, b in r["trained"]] == ["ANSWER: 0<|im_end|>", "1<|im_end|>"]
    # Pairs checked as KTO rows: the error names the row and both kinds.
    paired = run(tmp_path, "data", "check", str(FORMATS / "preference.jsonl"), "--kind", "kto")
    assert paired.returncode != 0 and "Traceback" not in paired.stderr
    assert f"{FORMATS / 'preference.jsonl'}:1: a paired row ('chosen'/'rejected') under kind: kto" in paired.stderr
    assert "kind: dpo" in paired.stderr


def test_check_counts_what_each_truncation_policy_does(tmp_path):
    """Issue 40: `data check` says how many rows each data.truncation policy would change, and
    the rows a cut cannot save (right keeps a long prompt and loses the reply)."""
    data = tmp_path / "long.jsonl"
    rows = [{"prompt": "hi", "completion": "ok"}, {"prompt": "x" * 90, "completion": "ok"},
            {"prompt": "q", "completion": "y" * 90}, {"prompt": "x" * 90, "completion": "y" * 90}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = run(tmp_path, "data", "check", str(data), "--max-seq-len", "64", "-o", "json")
    assert out.returncode == 1, out.stderr  # refused under the default policy
    doc = json.loads(out.stdout)
    assert doc["over_max_seq_len"] == 3
    assert doc["truncation"] == {"error": {"refused": 3}, "drop": {"dropped": 3},
                                 "right": {"cut": 1, "refused": 2}, "left": {"cut": 3, "refused": 0}}
    assert "data.truncation" in out.stderr  # the hint names the fix that keeps the rows
    text = run(tmp_path, "data", "check", str(data), "--max-seq-len", "64")
    assert ("  data.truncation: error (default) refuses 3; drop skips 3; right cuts 1 and refuses 2 "
            "(nothing left to train on); left cuts 3") in text.stdout
    dpo = tmp_path / "pairs.jsonl"
    dpo.write_text(json.dumps({"prompt": "x" * 90, "chosen": "yes", "rejected": "no"}) + "\n"
                   + json.dumps({"prompt": "hi", "chosen": "yes", "rejected": "no"}) + "\n", encoding="utf-8")
    doc = json.loads(run(tmp_path, "data", "check", str(dpo), "--max-seq-len", "64", "-o", "json").stdout)
    assert doc["kind"] == "dpo" and doc["truncation"]["right"] == doc["truncation"]["left"] == {"cut": 1, "refused": 0}


def test_question_answer_csv_is_checked_and_previewed_with_columns(tmp_path):
    """Issue 42: a question,answer CSV (which trains with data.columns) is read by `data check`
    and `data preview` with --columns; without it, the hint names --columns."""
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\nWhat is 2+2?,4\nCapital of France?,Paris\n", encoding="utf-8")
    bare = run(tmp_path, "data", "check", str(data))
    assert bare.returncode == 1 and "no known row format in keys ['answer', 'question']" in bare.stderr
    assert "--columns prompt=question,completion=answer" in bare.stderr
    out = run(tmp_path, "data", "check", str(data), "--columns", "prompt=question,completion=answer", "-o", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["format"], doc["kind"], doc["rows"]) == ("prompt_completion (standard)", "sft", 2)
    assert doc["max_seq_len"] == 1024  # the default: min(2048, loops-local/tiny's limit)
    preview = run(tmp_path, "data", "preview", str(data), "--columns", "prompt=question,completion=answer", "-o", "json")
    assert preview.returncode == 0, preview.stderr
    first = json.loads(preview.stdout)["rows"][0]
    start, end = first["trained"][0]
    assert "What is 2+2?" in first["text"] and first["text"][start:end].startswith("4")
    wrong = run(tmp_path, "data", "check", str(data), "--columns", "prompt=q,completion=answer")
    assert wrong.returncode == 1 and "no column 'q' (data.columns.prompt)" in wrong.stderr and "--columns prompt=COLUMN" in wrong.stderr
    bad = run(tmp_path, "data", "preview", str(data), "--columns", "prompt")
    assert bad.returncode == 2 and "--columns 'prompt': expected NAME=COLUMN" in bad.stderr
