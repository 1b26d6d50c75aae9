"""`loops runs create|list|describe|logs|deactivate|watch` against the real local backend:
table and JSON output, empty results, bad inputs; plus dynamic tab completion of run ids,
checkpoint names and profile names (cli/_complete.py)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from tests.cli_support import (
    SEEDED_STEPS,
    TINY,
    api,
    cli_env,
    create_run,
    loops,
    one_line_error,
    seeded,  # noqa: F401  (fixture)
    wait_for,
)
from tests.support import ctrl_c_as_a_terminal_sends

# The LoopsRun keys of `baseten loops run list -o json` ({"runs": [LoopsRun]}), loops-protocol §2.3.
GO_RUN_KEYS = {"id", "session_id", "deployment_id", "name", "base_model", "base_url", "created_at", "status", "user", "sampler"}


@pytest.fixture
def faults(local_server):
    def add(**spec):
        return api(local_server, "POST", "/v1/local/faults", json=spec)

    yield add
    api(local_server, "DELETE", "/v1/local/faults")


# ── list ──────────────────────────────────────────────────────────────────────────────────


def test_list_table_and_json_match_the_go_cli(seeded):
    table = loops(seeded.server, "runs", "list")
    assert table.code == 0, table
    header = table.lines[0].split()
    assert header[:2] == ["ID", "NAME"] and "STATUS" in header and header[-1] == "CREATED"
    row = next(line for line in table.lines if line.startswith(seeded.run_id))
    assert "seeded-run" in row and TINY in row and "ACTIVE" in row

    doc = loops(seeded.server, "runs", "list", "-o", "json").json()
    assert set(doc) == {"runs", "filter"} and doc["filter"] == "active"  # a script knows what it got
    run = next(r for r in doc["runs"] if r["id"] == seeded.run_id)
    assert GO_RUN_KEYS <= set(run)
    assert run["status"] == {"name": "ACTIVE"} and run["created_at"].endswith("Z")
    created = [r["created_at"] for r in doc["runs"]]
    assert created == sorted(created, reverse=True)  # newest first

    ids = loops(seeded.server, "runs", "list", "-q").lines
    assert seeded.run_id in ids and all(re.fullmatch(r"[0-9a-z]+", i) for i in ids)
    jsonl = loops(seeded.server, "runs", "list", "-o", "jsonl").lines
    assert [json.loads(line)["id"] for line in jsonl] == ids


def test_inactive_runs_are_hidden_with_a_hint_and_shown_with_all(seeded):
    server = seeded.server
    run = create_run(server)
    done = loops(server, "runs", "deactivate", run["id"], "--yes")
    assert done.code == 0, done
    assert f"Deactivated Loops run {run['id']}. Saved checkpoints remain accessible." in done.stderr

    default = loops(server, "runs", "list")
    assert run["id"] not in default.stdout
    assert re.search(r"\d+ inactive runs? hidden; pass --all", default.stderr), default
    everything = loops(server, "runs", "list", "--all", "-o", "json").json()
    assert everything["filter"] == "all"
    listed = everything["runs"]
    assert next(r for r in listed if r["id"] == run["id"])["status"]["name"] == "INACTIVE"
    again = loops(server, "runs", "deactivate", run["id"], "--yes")
    assert again.code == 0 and "already INACTIVE" in again.stderr


def test_list_empty_results(seeded):
    empty = loops(seeded.server, "runs", "list", "--base-model", "nobody/none")
    assert empty.code == 0 and empty.stdout == ""
    assert "No active Loops runs of nobody/none found. Pass --all to include inactive runs." in empty.stderr
    everything = loops(seeded.server, "runs", "list", "--all", "--base-model", "nobody/none")
    assert "No Loops runs of nobody/none found." in everything.stderr
    assert loops(seeded.server, "runs", "list", "-m", "nobody/none", "-o", "json").json() == {"runs": [], "filter": "active"}


def test_list_sort_limit_and_bad_flags(seeded):
    newest = loops(seeded.server, "runs", "list", "--all", "-q", "--limit", "1")
    assert len(newest.lines) == 1
    limited = loops(seeded.server, "runs", "list", "--all", "--limit", "1")
    all_ids = loops(seeded.server, "runs", "list", "--all", "-q").lines
    if len(all_ids) > 1:
        assert f"Showing 1 of {len(all_ids)} runs" in limited.stderr
    oldest_first = loops(seeded.server, "runs", "list", "--all", "-q", "--reverse").lines
    assert oldest_first == list(reversed(all_ids))
    by_name = loops(seeded.server, "runs", "list", "--all", "--sort", "name", "-o", "json").json()["runs"]
    assert [r["name"].lower() for r in by_name] == sorted(r["name"].lower() for r in by_name)
    one_line_error(loops(seeded.server, "runs", "list", "--sort", "colour"), 2, "--sort must be one of")
    assert loops(seeded.server, "runs", "list", "--limit", "-1").code == 2


# ── create ────────────────────────────────────────────────────────────────────────────────


def test_create_waits_for_the_trainer_and_prints_the_run(seeded):
    result = loops(seeded.server, "runs", "create", "--base-model", TINY, "--name", "made-by-cli",
                   "--lora-rank", "4", "--wait", "-o", "json")
    assert result.code == 0, result
    run = result.json()
    assert GO_RUN_KEYS <= set(run) and run["name"] == "made-by-cli" and run["base_model"] == TINY
    assert "Provisioning Loops run and sampler for loops-local/tiny..." in result.stderr
    assert f"Run {run['id']} is ready." in result.stderr
    quiet = loops(seeded.server, "runs", "create", "-m", TINY, "--from", f"{seeded.run_id}:t1", "-q")
    assert quiet.code == 0, quiet
    assert re.fullmatch(r"[0-9a-z]+\n", quiet.stdout)
    loops(seeded.server, "runs", "deactivate", run["id"], quiet.stdout.strip(), "--yes")


def test_create_bad_inputs(seeded):
    one_line_error(loops(seeded.server, "runs", "create", "--base-model", "nobody/none"), 1, "nobody/none")
    one_line_error(loops(seeded.server, "runs", "create", "-m", TINY, "--from", f"{seeded.run_id}:s1"),
                   2, "holds sampler weights")
    one_line_error(loops(seeded.server, "runs", "create", "-m", TINY, "--from", f"{seeded.run_id}:nope"),
                   1, "no checkpoint named 'nope' in run")
    one_line_error(loops(seeded.server, "runs", "create", "-m", TINY, "--from", f"{seeded.run_id}:t1", "--lora-rank", "4"),
                   2, "has LoRA rank 16, not 4")
    one_line_error(loops(seeded.server, "runs", "create", "-m", TINY, "--reuse-from", "zzzzzzz"), 1, "no run 'zzzzzzz'")
    assert loops(seeded.server, "runs", "create").code == 2  # --base-model is required
    assert loops(seeded.server, "runs", "create", "-m", TINY, "--lora-rank", "0").code == 2


# ── describe ──────────────────────────────────────────────────────────────────────────────


def test_describe_table_and_json(seeded):
    table = loops(seeded.server, "runs", "describe", seeded.run_id)
    assert table.code == 0, table
    text = table.stdout
    for needle in ("ID:", "Base Model:", "Trainer", "Sampler", "Usage", "Tokens Trained:", "Latest Checkpoints", "Step:"):
        assert needle in text, needle
    assert re.search(rf"Step:\s+{SEEDED_STEPS}\b", text)
    doc = loops(seeded.server, "runs", "describe", seeded.run_id, "-o", "json").json()
    assert GO_RUN_KEYS <= set(doc)
    assert doc["deployment"]["status"]["name"] in ("RUNNING", "SCALED_TO_ZERO")
    assert doc["policy_version"] == SEEDED_STEPS
    assert doc["checkpoint_count"] == 4 and {c["checkpoint_id"] for c in doc["latest_checkpoints"]} == {"s1", "t1", "s2"}
    assert doc["usage"]["tokens_trained"] > 0
    assert loops(seeded.server, "runs", "describe", seeded.run_id, "-q").stdout.strip() == seeded.run_id


def test_unknown_run_suggests_a_close_id(seeded):
    typo = seeded.run_id[:-1] + ("x" if seeded.run_id[-1] != "x" else "y")
    result = loops(seeded.server, "runs", "describe", typo)
    one_line_error(result, 1, f"no run '{typo}'", f"Did you mean {seeded.run_id}?")
    far = loops(seeded.server, "runs", "describe", "qqqqqqqqqqqq")
    one_line_error(far, 1, "no run 'qqqqqqqqqqqq'", "loops runs list --all")
    assert "Did you mean" not in far.stderr


# ── deactivate ────────────────────────────────────────────────────────────────────────────


def test_deactivate_needs_yes_without_a_terminal(seeded):
    result = loops(seeded.server, "runs", "deactivate", seeded.run_id)
    one_line_error(result, 3, f"not deactivating run {seeded.run_id} without confirmation", "Pass --yes")
    status = loops(seeded.server, "runs", "describe", seeded.run_id, "-o", "json").json()["status"]["name"]
    assert status == "ACTIVE"


def test_deactivate_several_runs_checks_every_id_first(seeded):
    a, b = create_run(seeded.server), create_run(seeded.server)
    bad = loops(seeded.server, "runs", "deactivate", a["id"], "nosuchrun", "--yes")
    one_line_error(bad, 1, "no run 'nosuchrun'")
    assert loops(seeded.server, "runs", "describe", a["id"], "-o", "json").json()["status"]["name"] == "ACTIVE"
    both = loops(seeded.server, "runs", "deactivate", a["id"], b["id"], "--yes", "-o", "json")
    assert both.code == 0, both
    assert sorted(r["id"] for r in both.json()) == sorted([a["id"], b["id"]])


def test_deactivate_prompt_names_what_stops_and_that_checkpoints_stay(seeded, monkeypatch):
    """On a terminal the question is asked; "n" cancels with exit 3 and nothing stops."""
    from baseten_loops_cli.output import sink

    run = create_run(seeded.server)
    original = sink.Streams.__post_init__

    def tty(self):
        original(self)
        self.stdin_tty = True

    monkeypatch.setattr(sink.Streams, "__post_init__", tty)
    declined = loops(seeded.server, "runs", "deactivate", run["id"], input="n\n")
    assert declined.code == 3, declined
    assert f"Deactivate Loops run {run['id']}" in declined.stderr
    assert "stops its trainer and paired sampler; saved checkpoints stay available" in declined.stderr
    accepted = loops(seeded.server, "runs", "deactivate", run["id"], input="y\n")
    assert accepted.code == 0 and "Deactivated Loops run" in accepted.stderr


# ── logs ──────────────────────────────────────────────────────────────────────────────────


def test_logs_table_and_json(seeded):
    table = loops(seeded.server, "runs", "logs", seeded.run_id, "--since", "1d")
    assert table.code == 0, table
    assert table.lines and all(re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]: \(local-0\) ", line) for line in table.lines)
    assert any("optim_step" in line for line in table.lines)
    doc = loops(seeded.server, "runs", "logs", seeded.run_id, "--since", "1d", "-o", "json", "--limit", "2").json()
    assert set(doc) == {"logs"} and len(doc["logs"]) == 2
    assert {"timestamp", "message"} <= set(doc["logs"][0])
    stamps = [int(e["timestamp"]) for e in doc["logs"]]
    assert stamps == sorted(stamps)
    every = loops(seeded.server, "runs", "logs", seeded.run_id, "-o", "jsonl", "--since", "1d").lines
    assert len(every) > 2 and stamps[-1] == int(json.loads(every[-1])["timestamp"])  # --limit keeps the newest
    sampler = loops(seeded.server, "runs", "logs", seeded.run_id, "--sampler", "--since", "1d")
    assert sampler.code == 0 and "Paired sampler" in sampler.stdout


def test_logs_empty_window_and_bad_flags(seeded):
    quiet = loops(seeded.server, "runs", "logs", seeded.run_id, "--min-level", "error")
    assert quiet.code == 0 and quiet.stdout == ""
    assert "No logs from trainer deployment" in quiet.stderr
    assert loops(seeded.server, "runs", "logs", seeded.run_id, "--min-level", "error", "-o", "json").json() == {"logs": []}
    for args, needle in [
        (["--tail", "--since", "1h"], "--tail cannot be combined"),
        (["--since", "1h", "--start", "2026-01-01T00:00"], "--since cannot be combined"),
        (["--since", "8d"], "longer than 7 days"),
        (["--since", "soon"], "invalid duration"),
        (["--start", "yesterday"], "invalid time"),
        (["--start", "2026-01-02T00:00", "--end", "2026-01-01T00:00"], "--start is after --end"),
        (["--min-level", "loud"], "--min-level must be one of"),
    ]:
        one_line_error(loops(seeded.server, "runs", "logs", seeded.run_id, *args), 2, needle)
    one_line_error(loops(seeded.server, "runs", "logs", "nosuchrun"), 1, "no run 'nosuchrun'")


def test_tail_stops_following_on_ctrl_c_and_the_run_keeps_running(seeded):
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", "runs", "logs", seeded.run_id, "--tail"],
                            env=cli_env(seeded.server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_as_a_terminal_sends)
    try:
        first = proc.stdout.readline()  # the backlog arrives, then it follows
        assert first.startswith("["), first
        said = ""  # it says when it follows: Ctrl-C from then on stops the following
        while "Following" not in said and proc.poll() is None:
            said += proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        err = said + err
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert f"Stopped following logs. Run {seeded.run_id} keeps running." in err
    assert "Traceback" not in err
    assert api(seeded.server, "GET", f"/v1/loops/runs/{seeded.run_id}")["run"]["status"]["name"] == "ACTIVE"


def test_tail_prints_each_backlog_line_once(local_server):
    """The backlog's newest lines share the millisecond following starts at (an inclusive
    start): they were printed twice ("Trainer running at step 0" on a fresh run)."""
    run = create_run(local_server, name="tail-once")
    wait_for(lambda: "Trainer running at step 0" in loops(local_server, "runs", "logs", run["id"]).stdout, timeout=60,
             what="the trainer to come up")
    api(local_server, "POST", f"/v1/loops/runs/{run['id']}/deactivate")
    tailed = loops(local_server, "runs", "logs", run["id"], "--tail")
    assert tailed.code == 0, tailed
    assert tailed.lines and tailed.lines[-1].endswith("Run deactivated; trainer stopped. Checkpoints are kept."), tailed
    assert len(tailed.lines) == len(set(tailed.lines)), tailed
    plain = loops(local_server, "runs", "logs", run["id"])
    assert tailed.lines == plain.lines
    jsonl = loops(local_server, "runs", "logs", run["id"], "--tail", "-o", "jsonl")
    assert [json.loads(line)["message"] for line in jsonl.lines] == [e["message"] for e in
                                                                      loops(local_server, "runs", "logs", run["id"], "-o", "json").json()["logs"]]


# ── watch ─────────────────────────────────────────────────────────────────────────────────


def test_watch_ends_when_the_run_is_deactivated(seeded):
    run = create_run(seeded.server)
    api(seeded.server, "POST", f"/v1/loops/runs/{run['id']}/deactivate", json={})
    result = loops(seeded.server, "runs", "watch", run["id"], "--exit-status")
    assert result.code == 0, result
    assert re.search(rf"\[\d\d:\d\d:\d\d\] {run['id']}: run INACTIVE", result.stdout)
    assert f"Run {run['id']} was deactivated." in result.stderr
    records = loops(seeded.server, "runs", "watch", run["id"], "-o", "jsonl").lines
    record = json.loads(records[-1])
    assert record["run_id"] == run["id"] and record["run_status"] == "INACTIVE"
    assert {"trainer_status", "sampler_status", "step", "policy_version", "time"} <= set(record)


def test_watch_exit_status_is_5_when_the_trainer_fails(seeded, faults):
    faults(job="deploy *", error="injected: no memory for the adapter", times=1)
    run = create_run(seeded.server)
    result = loops(seeded.server, "runs", "watch", run["id"], "--exit-status", "--interval", "0.3")
    one_line_error(result, 5, f"run {run['id']}'s trainer FAILED", "injected")
    without = loops(seeded.server, "runs", "watch", run["id"])
    assert without.code == 0 and "Warning:" in without.stderr and "FAILED" in without.stderr
    one_line_error(loops(seeded.server, "runs", "watch", "nosuchrun"), 1, "no run 'nosuchrun'")


# ── completion ────────────────────────────────────────────────────────────────────────────


def _complete(server, words: str, *, shell: str = "bash", extra_env: dict | None = None) -> list[str]:
    """Candidates of a TAB at the end of ``words`` (in process, as the shell script asks)."""
    from typer.testing import CliRunner

    from baseten_loops_cli.cli.main import app

    env = {k: (v or None) for k, v in cli_env(server).items()}
    env.update({"_LOOPS_COMPLETE": f"complete_{shell}", "COMP_WORDS": words,
                "COMP_CWORD": str(len(words.split(" ")) - 1), "_TYPER_COMPLETE_ARGS": words})
    env.update(extra_env or {})
    result = CliRunner().invoke(app, [], env=env, prog_name="loops")
    assert result.exit_code == 0, result.output
    return [line.split(":::")[0] if shell == "zsh" else line for line in result.stdout.splitlines() if line]


def test_completion_of_run_ids_and_checkpoint_names_uses_a_short_lived_cache(seeded, monkeypatch, tmp_path):
    from baseten_loops_cli.cli import _complete as comp

    monkeypatch.setenv("LOOPS_CACHE_DIR", str(tmp_path / "cache"))
    extra = {"LOOPS_CACHE_DIR": str(tmp_path / "cache")}
    prefix = seeded.run_id[:3]
    assert seeded.run_id in _complete(seeded.server, f"loops runs describe {prefix}", extra_env=extra)
    assert (tmp_path / "cache" / comp.CACHE_FILE).is_file()

    # Served from the cache: the network is not asked again while the entry is fresh.
    def boom(*_a, **_k):
        raise AssertionError("the network was asked")

    monkeypatch.setitem(comp.FETCHERS, "runs", boom)
    assert seeded.run_id in _complete(seeded.server, f"loops runs logs {prefix}", extra_env=extra)

    names = _complete(seeded.server, f"loops checkpoints describe {seeded.run_id}:", extra_env=extra)
    assert {f"{seeded.run_id}:s1", f"{seeded.run_id}:s2", f"{seeded.run_id}:t1"} <= set(names)
    assert _complete(seeded.server, f"loops checkpoints download {seeded.run_id}:s", extra_env=extra) == [
        n for n in names if n.startswith(f"{seeded.run_id}:s")]


def test_completion_never_waits_long_on_a_slow_backend(seeded, faults, monkeypatch, tmp_path):
    from baseten_loops_cli.cli import _complete as comp

    handed_off: list[tuple] = []
    monkeypatch.setattr(comp, "_spawn_refresher", lambda *a: handed_off.append(a))
    faults(path="/v1/loops/runs", method="GET", delay_s=3, times=1)
    extra = {"LOOPS_CACHE_DIR": str(tmp_path / "cache")}
    # The TAB answered (nothing to offer yet) while the fetch was still in flight, and handed
    # the fetch to the background refresher; had it waited, the runs would be listed.
    assert _complete(seeded.server, "loops runs describe ", extra_env=extra) == []
    assert [a[1] for a in handed_off] == ["runs"]


def test_profile_names_complete_from_the_config(seeded):
    assert {"local", "baseten"} <= set(_complete(seeded.server, "loops --profile "))
    assert _complete(seeded.server, "loops --profile ba") == ["baseten"]


def test_completion_served_from_cache_imports_nothing_heavy(seeded, tmp_path):
    cache = tmp_path / "cache"
    _complete(seeded.server, "loops runs describe ", extra_env={"LOOPS_CACHE_DIR": str(cache)})
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['loops']\n"
        "try:\n"
        "    from baseten_loops_cli.cli.main import main\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        # A None entry is an import blocked on purpose (httpx._main), not a loaded module.
        "heavy = sorted({m.split('.')[0] for m, mod in sys.modules.items() if mod is not None}"
        " & {'httpx', 'pydantic', 'keyring', 'torch', 'yaml'})\n"
        "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
    )
    env = {k: v for k, v in cli_env(seeded.server).items() if not k.startswith("COMP_")}
    env.update(LOOPS_CACHE_DIR=str(cache), _LOOPS_COMPLETE="complete_bash",
               COMP_WORDS=f"loops runs describe {seeded.run_id[:3]}", COMP_CWORD="3")
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert seeded.run_id in proc.stdout, proc.stderr
    assert "HEAVY=\n" in proc.stderr or proc.stderr.strip().endswith("HEAVY="), proc.stderr
