"""What a newcomer sees right after `loops train run` (issue 14), against a fresh local server:
the run it made and deactivated is listed, `--all` is named whenever rows were hidden (on stderr,
in every format), the sampler's policy version says what it serves, a name saved as both a
trainer and a sampler checkpoint completes once, the download bar's rate agrees with the
summary's, and help paragraphs wrap at the terminal's width, not the source's."""

from __future__ import annotations

import io
import json
import re
from datetime import datetime, timedelta, timezone

import pytest

from tests.cli_support import api, cli_env, create_run, loops, seeded, train_steps, trainer  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fresh server holding one run trained 3 steps, its sampler never published to, with a
    trainer and a sampler checkpoint both named `final`, then deactivated: `loops train run`'s
    end state."""
    from tests.conftest import LocalServer

    server = LocalServer(tmp_path_factory.mktemp("after-training")).start()
    try:
        run = create_run(server, name="tour-run")
        api(server, "POST", "/v1/loops/samplers", json={"session_id": run["session_id"], "run_id": run["id"]})
        train_steps(server, run["id"], 3, {3: [("trainer", "final")]})
        with trainer(server, run["id"]) as tc:
            tc.save_weights_for_sampler("final").result(timeout=120)  # saved, not published
        described = loops(server, "runs", "describe", run["id"])
        api(server, "POST", f"/v1/loops/runs/{run['id']}/deactivate", json={})
        yield server, run, described
    finally:
        server.stop()


def test_runs_list_shows_the_runs_just_made_when_none_is_active(trained):
    server, run, _ = trained
    table = loops(server, "runs", "list")
    assert table.code == 0, table
    assert any(line.startswith(run["id"]) and "INACTIVE" in line for line in table.lines), table
    assert "No active Loops runs; showing the ones created in the last 24 hours." in table.stderr
    ids = loops(server, "runs", "list", "-o", "json", "--jq", ".runs[].id")
    assert ids.code == 0 and ids.lines == [run["id"]], ids
    # Machine output says which rule chose the runs (stderr said it for people).
    assert loops(server, "runs", "list", "-o", "json").json()["filter"] == "recent"
    assert loops(server, "runs", "list", "--all", "-q").lines == [run["id"]]


def test_usage_by_run_shows_the_runs_just_made(trained):
    server, run, _ = trained
    table = loops(server, "usage", "--by-run")
    assert table.code == 0, table
    assert "No active Loops runs found" not in table.stderr
    row = next(line for line in table.lines if line.startswith(run["id"]))
    assert "INACTIVE" in row
    doc = loops(server, "usage", "--by-run", "-o", "json").json()
    assert [r["run_id"] for r in doc["runs"]] == [run["id"]] and doc["runs"][0]["tokens_trained"] > 0


def test_hidden_rows_are_named_with_all_in_json_modes_on_stderr(seeded):
    server = seeded.server
    gone = create_run(server)
    api(server, "POST", f"/v1/loops/runs/{gone['id']}/deactivate", json={})
    for fmt in ("json", "jsonl", "yaml"):
        result = loops(server, "runs", "list", "-o", fmt)
        assert result.code == 0, result
        assert gone["id"] not in result.stdout
        assert re.search(r"\d+ inactive runs? hidden; pass --all to show", result.stderr), (fmt, result)
    assert json.loads(loops(server, "runs", "list", "-o", "json").stdout)["runs"]  # stdout stays the document
    by_run = loops(server, "usage", "--by-run", "-o", "json")
    assert re.search(r"\d+ inactive runs? hidden; pass --all to show", by_run.stderr), by_run
    quiet = loops(server, "runs", "list", "-q")
    assert quiet.stderr == "" and seeded.run_id in quiet.lines


def test_the_recent_window_rule():
    from baseten_loops_cli.api.models import LoopsRun
    from baseten_loops_cli.services.runs import RECENT_WINDOW_S, select_runs

    now = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)

    def run(ident: str, status: str, age_s: float) -> LoopsRun:
        return LoopsRun(id=ident, status={"name": status}, created_at=now - timedelta(seconds=age_s))

    fresh, old, live = run("fresh", "INACTIVE", 60), run("old", "INACTIVE", RECENT_WINDOW_S + 60), run("live", "ACTIVE", 10)
    shown, hidden, recent = select_runs([fresh, old], include_inactive=False, now=now.timestamp())
    assert [r.id for r in shown] == ["fresh"] and hidden == 1 and recent
    shown, hidden, recent = select_runs([fresh, old, live], include_inactive=False, now=now.timestamp())
    assert [r.id for r in shown] == ["live"] and hidden == 2 and not recent  # an active run: the plain rule
    shown, hidden, recent = select_runs([fresh, old], include_inactive=True, now=now.timestamp())
    assert len(shown) == 2 and hidden == 0 and not recent


def test_describe_says_what_the_sampler_serves_next_to_its_policy_version(trained):
    server, run, described = trained
    assert described.code == 0, described
    line = next(line for line in described.lines if line.startswith("Policy Version:"))
    assert "0 (serves the base model; the trainer is at step 3" in line, described
    doc = loops(server, "runs", "describe", run["id"], "-o", "json").json()
    assert doc["policy_version"] == 3 and doc["sampler"]["policy_version"] == 0  # JSON keeps the raw values


def test_a_name_saved_as_trainer_and_sampler_checkpoint_completes_once(trained, tmp_path):
    from typer.testing import CliRunner

    from baseten_loops_cli.cli.main import app

    server, run, _ = trained
    words = f"loops checkpoints describe {run['id']}:"
    env = {k: (v or None) for k, v in cli_env(server).items()}
    env.update({"_LOOPS_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": "3",
                "_TYPER_COMPLETE_ARGS": words, "LOOPS_CACHE_DIR": str(tmp_path / "cache")})
    result = CliRunner().invoke(app, [], prog_name="loops", env=env)
    candidates = result.output.split()
    assert candidates.count(f"{run['id']}:final") == 1, candidates


def test_the_download_bar_rate_is_the_summary_rate():
    from rich.console import Console

    from baseten_loops_cli.output.progress import TransferBar, average_rate

    ticks = iter([0.0, 0.0, 2.0, 2.0, 2.0])
    buffer = io.StringIO()
    bar = TransferBar(Console(file=buffer, force_terminal=False, width=200), "abc:final", clock=lambda: next(ticks))
    with bar:
        bar.start(total_bytes=4 * 1024 * 1024, completed_bytes=0, files=1)
        bar.advance(4 * 1024 * 1024)
        bar.file_done("adapter_model.safetensors")
    assert average_rate(4 * 1024 * 1024, 2.0) == "2.0 MiB/s"
    assert "2.0 MiB/s" in buffer.getvalue() and "kB/s" not in buffer.getvalue()


def test_help_paragraphs_wrap_at_the_terminal_not_the_source():
    import click
    import typer.main

    from baseten_loops_cli.cli.main import app

    def walk(command: click.Command, path: str):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    for path, command in walk(typer.main.get_command(app), "loops"):
        for para in (command.help or "").split("\n\n"):
            lines = para.split("\n")
            if any(line.startswith((" ", "\b")) for line in lines):
                continue  # examples and verbatim blocks keep their lines
            assert all(re.match(r"([-*]|\d+[.)]) ", line) for line in lines[1:]), (path, para)


def test_runs_watch_help_has_no_orphan_words(seeded):
    result = loops(seeded.server, "runs", "watch", "--help", env={"COLUMNS": "80"})
    assert result.code == 0, result
    stripped = [line.strip(" │") for line in result.stdout.splitlines()]
    assert "trainer" not in stripped and "-o jsonl" not in stripped, result.stdout
