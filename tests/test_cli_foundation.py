"""The real `loops` entry point in a subprocess: exit codes, one-line errors, option placement,
auth and config commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import file_mode

SECRET = "sk-test-0123456789abcdef"


@pytest.fixture
def env(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_"))}
    base.pop("NO_COLOR", None)
    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        base[f"LOOPS_{name}_DIR"] = str(tmp_path / name.lower())
    base["LOOPS_NO_AUTOSTART"] = "1"
    base["LOOPS_KEYRING_DISABLED"] = "1"
    return base


def loops(env, *args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "baseten_loops_cli", *args],
        env=env, input=stdin, capture_output=True, text=True, timeout=60,
    )


def assert_one_line_error(result, code, *needles):
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr


def test_version_and_help(env):
    assert loops(env, "--version").stdout.strip().startswith("loops ")
    help_text = loops(env, "--help").stdout
    for word in ("runs", "checkpoints", "train", "auth", "Exit codes"):
        assert word in help_text


def test_help_names_every_training_kind_and_export(env):
    root = loops(env, "--help").stdout
    assert "training loops of every kind (sft, rl, dpo, kto or distill)" in " ".join(root.split())
    checkpoints = next(line for line in root.splitlines() if "checkpoints " in line and "List" in line)
    assert "export" in checkpoints, root


@pytest.mark.parametrize(("args", "spelling"), [
    (["--steps", "10"], "--set max_steps=10"),
    (["--max-steps=7"], "--set max_steps=7"),
    (["--lr", "3e-4"], "--set optimizer.learning_rate=3e-4"),
    (["--batch-size", "4"], "--set batch_size=4"),
    (["--epochs", "2"], "--set epochs=2"),
    (["--name", "mine"], "--set name=mine"),
])
def test_training_flags_users_try_get_the_set_spelling(env, args, spelling):
    examples = Path(__file__).resolve().parent.parent / "examples"
    result = loops(env, "train", "run", str(examples / "tiny-sft.yaml"), *args)
    assert_one_line_error(result, 2, "No such option", f"Hint: Use {spelling} ")
    # A command without --set keeps the plain hint.
    other = loops(env, "runs", "list", args[0].split("=")[0], "1")
    assert other.returncode == 2 and "Hint: Run 'loops runs list --help' for usage." in other.stderr


def test_a_missing_config_suggests_the_close_match(env):
    examples = Path(__file__).resolve().parent.parent / "examples"
    result = loops(env, "train", "run", str(examples / "tiny_sft.yaml"))
    assert_one_line_error(result, 1, "tiny_sft.yaml: no such file", f"Hint: Did you mean {examples / 'tiny-sft.yaml'}?")
    far = loops(env, "train", "validate", str(examples / "nothing-like-it.yaml"))
    assert_one_line_error(far, 1, "no such file", "loops train init")


def test_unknown_profile_exits_2_with_suggestion(env):
    loops(env, "config", "set", "base_url", "https://prod.example", "--profile", "prod")
    result = loops(env, "config", "get", "kind", "--profile", "prdo")
    assert_one_line_error(result, 2, "unknown profile 'prdo'", "'prod'")


def test_unknown_output_format_exits_2(env):
    assert_one_line_error(loops(env, "config", "list", "-o", "xml"), 2, "unknown output format")


def test_jq_syntax_error_exits_2(env):
    assert_one_line_error(loops(env, "config", "list", "--jq", ".profiles["), 2, "--jq")


def test_unknown_command_is_a_usage_error(env):
    assert loops(env, "runz").returncode == 2


# Click's own usage errors (parsed before any command runs) come out like ours: one `Error:` line
# naming the option, argument or command (with Click's "Did you mean" suggestion), one `Hint:`
# line naming the command's --help, exit 2, nothing on stdout; never Typer's usage box.
USAGE_ERRORS = [
    # root
    (["--bogus"], "loops", "No such option: --bogus"),
    (["runz"], "loops", "No such command 'runz'. Did you mean 'runs'?"),
    (["-o", "json", "runz"], "loops", "No such command 'runz'"),
    # a group
    (["runs", "lsit"], "loops runs", "No such command 'lsit'. Did you mean 'list'?"),
    (["runs", "--bogus"], "loops runs", "No such option: --bogus"),
    (["checkpoints", "lst", "-o", "json"], "loops checkpoints", "Did you mean 'list'?"),
    # a leaf: bad values, unknown and missing options, missing and extra arguments, bad choice
    (["sample", "X", "--max-tokens", "-5"], "loops sample", "Invalid value for '--max-tokens'"),
    (["sample", "X", "--temperature", "-1"], "loops sample", "Invalid value for '--temperature'"),
    (["sample", "X", "--top-p", "2", "-o", "json"], "loops sample", "Invalid value for '--top-p'"),
    (["runs", "list", "--limit", "abc"], "loops runs list", "Invalid value for '--limit'"),
    (["runs", "list", "--bogus", "-o", "json"], "loops runs list", "No such option: --bogus"),
    (["usage", "--by"], "loops usage", "(Possible options: --by-run)"),
    (["runs", "create"], "loops runs create", "Missing option '--base-model'"),
    (["runs", "describe"], "loops runs describe", "Missing argument"),
    (["runs", "list", "extra"], "loops runs list", "unexpected extra argument"),
    (["completion", "show", "nosh"], "loops completion show", "'nosh' is not one of"),
    (["deploy", "--model-name", "m"], "loops deploy create", "Missing argument"),  # the default subcommand
]


@pytest.mark.parametrize(("args", "command", "needle"), USAGE_ERRORS, ids=[" ".join(a) for a, _, _ in USAGE_ERRORS])
def test_click_usage_errors_are_our_one_line_error_and_hint(env, args, command, needle):
    result = loops(env, *args)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.splitlines()[0], f"Hint: Run '{command} --help' for usage."], result.stderr
    assert result.stderr.startswith("Error: ") and needle in result.stderr.splitlines()[0], result.stderr
    for box in ("Usage:", "Try '", "\u256d", "\u2502", "\x1b", "Traceback"):
        assert box not in result.stderr, result.stderr


def test_usage_errors_keep_help_and_exit_semantics(env):
    bare = loops(env)  # no arguments: the help, as Click's no_args_is_help has it (exit 2)
    assert bare.returncode == 2 and "Usage: loops" in bare.stdout and bare.stderr == ""
    group = loops(env, "runs")
    assert group.returncode == 2 and "Usage: loops runs" in group.stdout
    for args in (["--help"], ["runs", "list", "-h"], ["sample", "--help", "--max-tokens", "-5"]):
        helped = loops(env, *args)
        assert helped.returncode == 0 and "Usage: loops" in helped.stdout and helped.stderr == "", args
    assert loops(env, "--version").returncode == 0


def test_help_names_arguments_and_flags_as_click_does(env):
    """Arguments read RUN_IDS... / [SHELL] (Click's style, as the man pages have them), not
    Typer's {run_ids}...; a boolean flag shows no <bool> type; errors name RUN_ID."""
    env = {**env, "COLUMNS": "120", "NO_COLOR": "1"}
    usages = {
        ("runs", "deactivate"): "Usage: loops runs deactivate [OPTIONS] RUN_IDS...",
        ("runs", "describe"): "Usage: loops runs describe [OPTIONS] RUN_ID",
        ("completion", "install"): "Usage: loops completion install [OPTIONS] [SHELL]",
        ("sample",): "Usage: loops sample [OPTIONS] RUN|CKPT",
    }
    for args, usage in usages.items():
        helped = loops(env, *args, "--help")
        assert helped.returncode == 0 and usage in helped.stdout, helped.stdout
        assert "<bool>" not in helped.stdout and "{" not in helped.stdout.split("Usage:")[1].splitlines()[0]
    assert "RUN_IDS..." in loops(env, "runs", "deactivate", "--help").stdout.split("Arguments")[1]
    assert "<bool>" not in loops(env, "--help").stdout
    assert "Missing argument 'RUN_ID'." in loops(env, "runs", "describe").stderr


@pytest.mark.parametrize("forcing", [{"GITHUB_ACTIONS": "true"}, {"FORCE_COLOR": "1"}, {"PY_COLORS": "1"}])
def test_help_and_usage_errors_have_no_escape_codes_when_piped_even_in_ci(env, forcing):
    """Typer's own Rich console (help, usage errors) is forced onto a terminal by CI variables;
    the sink's decision (no colour off a terminal) wins: a CI log or `--help > file` stays plain."""
    env = {**env, **forcing}
    bad = loops(env, "runs", "list", "--bogus")
    assert bad.returncode == 2 and "--bogus" in bad.stderr
    helped = loops(env, "runs", "list", "--help")
    assert helped.returncode == 0 and "Usage" in helped.stdout
    for text in (bad.stdout, bad.stderr, helped.stdout, helped.stderr):
        assert "\x1b" not in text, text


def _at_a_terminal(env, *args):
    """``loops ARGS`` with stdout and stderr on a pseudo-terminal; what it wrote there."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=env, stdin=subprocess.DEVNULL,
                              stdout=follower, stderr=follower, timeout=60)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_no_color_at_a_terminal_means_no_escape_codes_in_help_and_errors(env):
    env = {**env, "TERM": "xterm-256color", "COLUMNS": "100"}
    code, text = _at_a_terminal(env, "runs", "list", "--bogus")
    assert code == 2 and "bogus" in text and "\x1b[" in text  # a person at a terminal: styled
    for args in (("runs", "list", "--bogus"), ("runs", "list", "--help"), ("runs", "describe", "x")):
        code, text = _at_a_terminal({**env, "NO_COLOR": "1"}, *args)
        assert code in (0, 1, 2) and text.strip(), text
        assert "\x1b" not in text, (args, text)


def test_global_options_work_before_and_after_the_subcommand(env):
    before = loops(env, "-o", "json", "config", "list")
    after = loops(env, "config", "list", "-o", "json")
    assert before.returncode == after.returncode == 0
    assert json.loads(before.stdout) == json.loads(after.stdout)


def test_malformed_config_names_file_and_line_and_is_not_overwritten(env, tmp_path):
    cfg = Path(env["LOOPS_CONFIG_DIR"]) / "config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("[profiles.prod\n")
    result = loops(env, "config", "use", "local")
    assert_one_line_error(result, 1, str(cfg), "line 1")
    assert cfg.read_text() == "[profiles.prod\n"


def test_auth_status_without_key_exits_4_with_login_hint(env):
    result = loops(env, "auth", "status", "--profile", "baseten")
    assert result.returncode == 4
    assert "loops auth login --profile baseten" in result.stderr


def test_login_with_key_from_stdin_then_status_never_shows_the_key(env):
    result = loops(env, "auth", "login", "--with-key", "--no-verify", "--profile", "prod",
                   "--base-url", "https://prod.example", stdin=SECRET + "\n")
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    creds = Path(env["LOOPS_CONFIG_DIR"]) / "credentials.toml"
    assert file_mode(creds) == 0o600
    assert file_mode(Path(env["LOOPS_CONFIG_DIR"]) / "config.toml") == 0o600
    status = loops(env, "auth", "status", "-o", "json")
    assert status.returncode == 0
    doc = json.loads(status.stdout)
    assert doc["profile"] == "prod" and doc["key_source"] == "file"
    assert doc["base_url"] == "https://prod.example"
    assert SECRET not in status.stdout + status.stderr
    # The SDK's variable wins over the stored key.
    env2 = dict(env, BASETEN_API_KEY="other")
    assert json.loads(loops(env2, "auth", "status", "-o", "json").stdout)["key_source"] == "env"
    out = loops(env, "auth", "logout")
    assert out.returncode == 0
    assert loops(env, "auth", "status").returncode == 4


def test_auth_status_says_a_key_no_header_can_carry_is_unusable(env):
    """Every command refuses such a key (exit 4); `auth status` said "present" and exited 0."""
    for key in (SECRET[:10] + "\n" + SECRET[10:], SECRET[:10] + " " + SECRET[10:], SECRET + "é"):
        bad = dict(env, BASETEN_API_KEY=key)
        table = loops(bad, "auth", "status", "--profile", "baseten")
        assert table.returncode == 4, table.stderr
        assert "unusable (from env)" in table.stdout and "BASETEN_API_KEY contains whitespace" in table.stderr
        doc = json.loads(loops(bad, "auth", "status", "--profile", "baseten", "-o", "json").stdout)
        assert doc["key_present"] is True and doc["key_usable"] is False and doc["key_source"] == "env"
        assert loops(bad, "runs", "list", "--profile", "baseten").returncode == 4  # the code it documents
        for text in (table.stdout + table.stderr, json.dumps(doc)):
            assert SECRET[:10] not in text and SECRET[10:] not in text
    # A stored key (edited by hand, or put in the keyring by another tool).
    creds = Path(env["LOOPS_CONFIG_DIR"]) / "credentials.toml"
    creds.parent.mkdir(parents=True, exist_ok=True)
    creds.write_text(f'[keys]\n"baseten" = "{SECRET[:10]} {SECRET[10:]}"\n')
    creds.chmod(0o600)
    stored = loops(env, "auth", "status", "--profile", "baseten")
    assert stored.returncode == 4 and "unusable (from file)" in stored.stdout, stored.stderr
    assert "loops auth login --profile baseten" in stored.stderr and SECRET[10:] not in stored.stdout + stored.stderr
    ok = loops(dict(env, BASETEN_API_KEY=SECRET), "auth", "status", "--profile", "baseten", "-o", "json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["key_usable"] is True


def test_login_without_terminal_or_with_key_flag_is_refused(env):
    result = loops(env, "auth", "login", "--no-verify", stdin="")
    assert_one_line_error(result, 2, "--with-key")


def test_config_set_get_use(env):
    assert loops(env, "config", "set", "base_url", "https://s.example", "--profile", "staging").returncode == 0
    assert loops(env, "config", "use", "staging").returncode == 0
    assert loops(env, "config", "get", "active").stdout.strip() == "staging"
    assert loops(env, "config", "get", "base_url").stdout.strip() == "https://s.example"
    env2 = dict(env, LOOPS_BASE_URL="http://127.0.0.1:1")
    assert loops(env2, "config", "get", "base_url").stdout.strip() == "http://127.0.0.1:1"
    bad = loops(env, "config", "set", "base_ulr", "x")
    assert_one_line_error(bad, 2, "did you mean 'base_url'")
    assert_one_line_error(loops(env, "config", "use", "nope"), 2, "unknown profile")


def test_typers_terminal_switch_does_not_outlive_the_call(monkeypatch, capsys):
    """main() turns Typer's terminal off for piped output; a later call in the same process (the
    test runner) and every child process must not inherit that."""
    from baseten_loops_cli.cli.main import main

    monkeypatch.setenv("FORCE_COLOR", "1")  # Typer would force ANSI into the pipe
    with pytest.raises(SystemExit) as exited:
        main(["runs", "--help"])
    assert exited.value.code == 0
    assert "\x1b[" not in capsys.readouterr().out
    assert "_TYPER_FORCE_DISABLE_TERMINAL" not in os.environ


@pytest.mark.parametrize("args", [["runs", "list", "-o"], ["runs", "list", "--profile"], ["usage", "-q", "--jq"]])
def test_a_global_option_left_without_its_value_says_so(env, args):
    """Global options are moved to the front of the line; one last on the line has no value to
    take, which is the error (not the subcommand's "No such option")."""
    result = loops(env, *args)
    assert result.returncode == 2 and result.stdout == ""
    error, hint = result.stderr.splitlines()
    assert error == f"Error: Option '{args[-1]}' requires an argument." and hint.startswith("Hint: Give "), result.stderr
