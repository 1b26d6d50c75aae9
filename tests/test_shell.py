"""Shell integration: the shipped completion scripts and man pages.

- drift: completions/ and man/ equal what the generators write from the live app;
- every man page renders without warnings, and covers every command and section;
- every environment variable the package reads is documented;
- `loops completion show` / `install` (bash, zsh, fish, PowerShell), idempotent;
- real bash, zsh and fish run the shipped scripts: `loops ru<TAB>` gives `runs`, and
  `loops runs describe <TAB>` gives run ids of the local backend.

Without a shell, man or groff their tests skip; CI installs them all and fails such a skip
(``required_in_ci``, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import in_ci

from tests.support import wait_for

ROOT = Path(__file__).resolve().parent.parent
COMPLETIONS = ROOT / "completions"
MAN = ROOT / "man"
REGENERATE = "python scripts/gen_completions.py && python scripts/gen_man.py"

HAVE_BASH = shutil.which("bash") is not None
HAVE_ZSH = shutil.which("zsh") is not None


def needs_marks(program: str) -> list[pytest.MarkDecorator]:
    """Skip without ``program``: a skip that CI, which installs it, turns into a failure."""
    return [pytest.mark.skipif(shutil.which(program) is None,
                               reason=f"{program} not installed (.ci/run installs it)"),
            pytest.mark.required_in_ci]


def needs(program: str):
    def decorate(test):
        for mark in needs_marks(program):
            test = mark(test)
        return test
    return decorate


needs_bash, needs_zsh, needs_fish = needs("bash"), needs("zsh"), needs("fish")


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def generated(tmp_path_factory) -> Path:
    """completions/ and man/ as the generators write them now, in a temporary directory."""
    out = tmp_path_factory.mktemp("generated")
    for script, sub in (("gen_completions.py", "completions"), ("gen_man.py", "man")):
        result = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / script), "--out-dir", str(out / sub)],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, f"{script} failed:\n{result.stderr}"
    return out


@pytest.fixture(scope="session")
def loops_bin(tmp_path_factory) -> Path:
    """A directory holding a `loops` executable that runs this checkout (what the scripts call)."""
    bindir = tmp_path_factory.mktemp("bin")
    exe = bindir / "loops"
    exe.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from baseten_loops_cli.cli.main import main\n"
        "main()\n"
    )
    exe.chmod(0o755)
    return bindir


def _clean_env(base: dict) -> dict:
    return {
        k: v for k, v in base.items()
        if not k.startswith(("LOOPS_", "BASETEN_", "_LOOPS_", "_TYPER_", "COMP_", "ZDOTDIR", "XDG_"))
    }


@pytest.fixture
def env(tmp_path, loops_bin) -> dict:
    home = tmp_path / "home"
    home.mkdir()
    env = _clean_env(dict(os.environ))
    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        env[f"LOOPS_{name}_DIR"] = str(tmp_path / name.lower())
    env.update(
        HOME=str(home),
        PATH=f"{loops_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        LOOPS_NO_AUTOSTART="1",
        LOOPS_KEYRING_DISABLED="1",
        TERM="dumb",
        SHELL="/bin/bash",
    )
    return env


def loops(env, *args, check=True):
    result = subprocess.run(["loops", *args], env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result


# --------------------------------------------------------------------------- drift
def _tree(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        return {}
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("sub", ["completions", "man"])
def test_shipped_files_match_the_generators(generated, sub):
    shipped = _tree(ROOT / sub)
    fresh = _tree(generated / sub)
    if sub == "man":  # man/ may hold other files one day; compare the generated pages only
        shipped = {k: v for k, v in shipped.items() if k.startswith("loops") and k.endswith(".1")}
    missing = sorted(set(fresh) - set(shipped))
    stale = sorted(set(shipped) - set(fresh))
    changed = sorted(name for name in set(fresh) & set(shipped) if fresh[name] != shipped[name])
    assert not (missing or stale or changed), (
        f"{sub}/ is out of date with the CLI (missing: {missing}, stale: {stale}, changed: {changed}); "
        f"run `{REGENERATE}`"
    )


def test_generators_are_deterministic(generated, tmp_path):
    again = tmp_path / "again"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_man.py"), "--out-dir", str(again)],
                   cwd=ROOT, check=True, capture_output=True,
                   env=dict(os.environ, HOME=str(tmp_path), PYTHONHASHSEED="12345"))
    assert _tree(again) == _tree(generated / "man")
    text = "".join(_tree(generated / "man").values())
    machine_paths = [str(ROOT)] + ([f"{Path.home()}/"] if Path.home() != Path("/") else [])
    assert not [p for p in machine_paths if p in text], "man pages name a path of this machine"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "no dates in man pages"


def _gen_man():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_man", ROOT / "scripts" / "gen_man.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_man", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_environment_variable_is_documented():
    gen_man = _gen_man()
    scanned = gen_man.scan_env_vars()
    assert {"LOOPS_CONFIG_DIR", "LOOPS_PROFILE", "BASETEN_API_KEY", "NO_COLOR"} <= scanned  # the scan works
    assert gen_man.undocumented_env_vars() == [], (
        "environment variables read by the package but missing from ENVIRONMENT in scripts/gen_man.py "
        f"(document them, or add internal ones to IGNORED_ENV_VARS), then run `{REGENERATE}`"
    )


# --------------------------------------------------------------------------- man pages
def _command_paths() -> list[list[str]]:
    import typer.main

    from baseten_loops_cli.cli.main import app

    paths: list[list[str]] = []

    def walk(cmd, path):
        paths.append(path)
        for name, sub in getattr(cmd, "commands", {}).items():
            if not sub.hidden:
                walk(sub, path + [name])

    walk(typer.main.get_command(app), ["loops"])
    return paths


def test_man_pages_cover_every_command_and_section(generated):
    from baseten_loops_cli.errors import ExitCode

    pages = _tree(generated / "man")
    for path in _command_paths():
        name = "-".join(path) + ".1"
        assert name in pages, f"no man page for `{' '.join(path)}`"
        text = pages[name]
        for section in ("NAME", "SYNOPSIS", "OPTIONS", "ENVIRONMENT", "FILES", "EXIT STATUS", "SEE ALSO"):
            assert f"\n.SH {section}\n" in text, f"{name}: no {section} section"
        exit_status = text.split(".SH EXIT STATUS", 1)[1].split(".SH ", 1)[0]
        for code in ExitCode:
            assert f"\\fB{int(code)}\\fR" in exit_status, f"{name}: exit code {int(code)} missing"
    root = pages["loops.1"]
    assert "\\fB\\-\\-output\\fR" in root and "LOOPS_CONFIG_DIR" in root
    assert "~/.config/baseten\\-loops/config.toml" in root
    # Examples come from the docstrings: `loops config get` has some.
    assert ".SH EXAMPLES" in pages["loops-config-get.1"]
    assert "loops config get active" in pages["loops-config-get.1"]


def _render_warnings(renderer: str, page: Path) -> list[str]:
    problems = []
    if renderer == "groff":
        result = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(page)],
                                capture_output=True, text=True, timeout=60)
        if result.returncode or result.stderr.strip():
            problems.append(f"groff: {result.stderr.strip()}")
    else:
        result = subprocess.run(["man", "--warnings", "-l", str(page)], capture_output=True, text=True,
                                timeout=60, env=dict(os.environ, MANWIDTH="80", MANPAGER="cat", PAGER="cat"))
        if result.returncode or result.stderr.strip():
            problems.append(f"man: {result.stderr.strip()}")
        elif "NAME" not in result.stdout:
            problems.append("man: rendered nothing")
    return problems


@pytest.mark.parametrize("renderer", [
    pytest.param("groff", marks=needs_marks("groff")),
    pytest.param("man", marks=needs_marks("man")),
])
def test_man_pages_render_without_warnings(renderer):
    pages = sorted(MAN.glob("loops*.1"))
    assert pages, f"man/ is empty; run `{REGENERATE}`"
    problems = {p.name: w for p in pages for w in [_render_warnings(renderer, p)] if w}
    assert not problems, problems


@needs("man")
def test_an_installed_wheel_puts_the_man_pages_where_man_looks(tmp_path):
    """`pip install` of the wheel puts man/ in PREFIX/share/man/man1 (pyproject.toml's
    data-files), and `man loops` finds it from the venv's PATH alone (man-db maps PATH's
    PREFIX/bin to PREFIX/share/man), with no MANPATH set. The wheel is built from a copy of the
    files it needs, so the checkout gets no build/ folder."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "man", src / "man")
    shutil.copytree(ROOT / "baseten_loops_cli", src / "baseten_loops_cli", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    prefix = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=120)
    wheel = next((tmp_path / "dist").glob("*.whl"))
    # --ignore-installed: with --prefix alone pip uninstalled this checkout's own (editable)
    # install from the running venv first, and every later `python -m baseten_loops_cli` failed.
    installed = subprocess.run([*pip, "install", "-q", "--no-deps", "--no-index", "--ignore-installed", "--prefix", str(prefix), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    shipped = sorted(p.name for p in MAN.glob("*.1"))
    assert sorted(p.name for p in (prefix / "share" / "man" / "man1").glob("*.1")) == shipped
    env = {k: v for k, v in os.environ.items() if k not in ("MANPATH", "MANOPT")}
    env.update(PATH=f"{prefix / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", MANPAGER="cat", PAGER="cat", MANWIDTH="80")
    for page in ("loops", "loops-train-run"):
        found = subprocess.run(["man", "-w", page], env=env, capture_output=True, text=True, timeout=60)
        assert found.stdout.strip() == str(prefix / "share" / "man" / "man1" / f"{page}.1"), (found.stdout, found.stderr)
    shown = subprocess.run(["man", "loops"], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "SYNOPSIS" in shown.stdout, shown.stderr


# --------------------------------------------------------------------------- completion show
def test_completion_show_prints_the_shipped_scripts(env):
    for shell, name in (("bash", "loops.bash"), ("zsh", "_loops"), ("fish", "loops.fish"), ("powershell", "loops.ps1")):
        out = loops(env, "completion", "show", shell).stdout
        assert "_LOOPS_COMPLETE" in out, shell
        assert out == (COMPLETIONS / name).read_text(), f"{shell}: differs from completions/{name}"
    assert (COMPLETIONS / "_loops").read_text().splitlines()[0] == "#compdef loops"
    assert "complete -o default -F _loops_completion loops" in (COMPLETIONS / "loops.bash").read_text()


def test_completion_show_rejects_an_unknown_shell(env):
    result = loops(env, "completion", "show", "tcsh", check=False)
    assert result.returncode == 2
    assert "tcsh" in result.stderr


# --------------------------------------------------------------------------- bash
def _bash_complete(env, words: list[str], script: Path = COMPLETIONS / "loops.bash") -> list[str]:
    """Run the completion function the shipped script registers for `loops`, as bash does on TAB."""
    line = " ".join(words)
    program = f"""
source {json.dumps(str(script))}
spec=$(complete -p loops) || exit 90
func=$(sed -E 's/.* -F ([^ ]+) .*/\\1/' <<<"$spec")
COMP_WORDS=({" ".join(json.dumps(w) for w in words)})
COMP_CWORD={len(words) - 1}
COMP_LINE={json.dumps(line)}
COMP_POINT={len(line)}
"$func" loops {json.dumps(words[-1])} {json.dumps(words[-2])}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    result = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [w for w in result.stdout.splitlines() if w]


@needs_bash
def test_bash_script_completes_commands(env):
    assert _bash_complete(env, ["loops", "ru"]) == ["runs"]
    assert set(_bash_complete(env, ["loops", "c"])) == {"checkpoints", "config", "completion"}
    assert _bash_complete(env, ["loops", "completion", "show", "z"]) == ["zsh"]
    assert _bash_complete(env, ["loops", "-o", "json", "ru"]) == ["runs"]


# --------------------------------------------------------------------------- interactive shells (pty)
_ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|[\x07\r]")


class Terminal:
    """An interactive shell on a pseudo-terminal: type keys, wait for text on the screen."""

    def __init__(self, argv: list[str], env: dict):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True, close_fds=True)
        os.close(slave)
        self.screen = b""

    def wait_for(self, pattern: bytes, timeout: float = 30) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if re.search(pattern, _ANSI.sub(b"", self.screen)):
                return True
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:
                    break
        return bool(re.search(pattern, _ANSI.sub(b"", self.screen)))

    def type(self, keys: str) -> None:
        self.screen = b""
        os.write(self.master, keys.encode())

    @property
    def text(self) -> str:
        return _ANSI.sub(b"", self.screen).decode(errors="replace")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        os.close(self.master)


PROMPT = b"READY> "


def _bash_terminal(env, rc_lines: list[str]) -> Terminal:
    rc = Path(env["HOME"]) / "test.bashrc"
    rc.write_text("\n".join(["PS1='READY> '", "bind 'set bell-style none'", *rc_lines]) + "\n")
    term = Terminal(["bash", "--noprofile", "--rcfile", str(rc), "-i"], env)
    assert term.wait_for(PROMPT), f"bash did not start: {term.text}"
    return term


def _zsh_terminal(env, rc_lines: list[str]) -> Terminal:
    zdotdir = Path(env["HOME"]) / "zdotdir"
    zdotdir.mkdir(exist_ok=True)
    (zdotdir / ".zshrc").write_text("\n".join([*rc_lines, "PS1='READY> '", "unsetopt BEEP"]) + "\n")
    term = Terminal(["zsh", "-i"], dict(env, ZDOTDIR=str(zdotdir)))
    assert term.wait_for(PROMPT), f"zsh did not start: {term.text}"
    return term


def _tab_completes(term: Terminal, typed: str, expected: bytes) -> str:
    term.type(typed + "\t")
    ok = term.wait_for(expected, timeout=30)
    text = term.text
    term.close()
    assert ok, f"typing {typed!r}<TAB> showed {text!r}, not {expected!r}"
    return text


@needs_bash
def test_interactive_bash_tab_completes_runs(env):
    term = _bash_terminal(env, [f"source {COMPLETIONS / 'loops.bash'}"])
    _tab_completes(term, "loops ru", rb"loops runs ")


@needs_zsh
def test_interactive_zsh_tab_completes_runs_from_fpath(env):
    """The packager's way: _loops in $fpath, autoloaded by compinit on the first TAB."""
    dump = Path(env["HOME"]) / ".zcompdump"
    term = _zsh_terminal(env, [f"fpath=({COMPLETIONS} $fpath)", "autoload -Uz compinit", f"compinit -u -d {dump}"])
    _tab_completes(term, "loops ru", rb"loops runs ")


@needs_zsh
def test_interactive_zsh_tab_completes_runs_when_sourced(env):
    dump = Path(env["HOME"]) / ".zcompdump"
    term = _zsh_terminal(env, ["autoload -Uz compinit", f"compinit -u -d {dump}", 'eval "$(loops completion show zsh)"'])
    _tab_completes(term, "loops ru", rb"loops runs ")


@needs_fish
def test_fish_script_completes_commands(env):
    result = subprocess.run(
        ["fish", "--no-config", "-c", f"source {COMPLETIONS / 'loops.fish'}; complete -C 'loops ru'"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [ln.split("\t")[0] for ln in result.stdout.splitlines()] == ["runs"], result.stdout


# --------------------------------------------------------------------------- completion install
def test_install_bash_is_idempotent_and_works(env):
    home = Path(env["HOME"])
    (home / ".bashrc").write_text("alias ll='ls -l'")  # no trailing newline: must stay intact
    for _ in range(2):
        loops(env, "completion", "install", "bash")
    script = home / ".bash_completions" / "loops.sh"
    assert script.read_text() == (COMPLETIONS / "loops.bash").read_text()
    rc = (home / ".bashrc").read_text()
    assert rc.startswith("alias ll='ls -l'\n")
    assert rc.count("source ~/.bash_completions/loops.sh") == 1
    if HAVE_BASH or in_ci():
        result = subprocess.run(["bash", "--norc", "-c", "source ~/.bashrc && complete -p loops"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "_loops_completion" in result.stdout, result.stderr
        assert _bash_complete(env, ["loops", "ru"], script) == ["runs"]


def test_install_zsh_is_idempotent_and_works(env):
    home = Path(env["HOME"])
    env = dict(env, SHELL="/usr/bin/zsh")  # detected from $SHELL
    for _ in range(2):
        result = loops(env, "completion", "install")
    assert "zsh" in result.stderr
    assert (home / ".zfunc" / "_loops").read_text() == (COMPLETIONS / "_loops").read_text()
    zshrc = (home / ".zshrc").read_text()
    assert zshrc.count("fpath+=~/.zfunc; autoload -Uz compinit; compinit") == 1
    if HAVE_ZSH or in_ci():  # the installed setup, for real: only ~/.zshrc, as the user has it
        with (home / ".zshrc").open("a") as fh:
            fh.write("PS1='READY> '\n")
        term = Terminal(["zsh", "-i"], dict(env, ZDOTDIR=str(home)))
        assert term.wait_for(PROMPT), term.text
        _tab_completes(term, "loops ru", rb"loops runs ")


def test_install_zsh_respects_zdotdir_and_an_existing_fpath_line(env, tmp_path):
    zdotdir = tmp_path / "zdot"
    zdotdir.mkdir()
    (zdotdir / ".zshrc").write_text("fpath+=~/.zfunc\nautoload -Uz compinit && compinit\n")
    loops(dict(env, ZDOTDIR=str(zdotdir)), "completion", "install", "zsh")
    assert (zdotdir / ".zshrc").read_text() == "fpath+=~/.zfunc\nautoload -Uz compinit && compinit\n"
    assert not (Path(env["HOME"]) / ".zshrc").exists()


def test_install_fish(env, tmp_path):
    config_home = tmp_path / "xdg"
    loops(dict(env, XDG_CONFIG_HOME=str(config_home)), "completion", "install", "fish")
    target = config_home / "fish" / "completions" / "loops.fish"
    assert target.read_text() == (COMPLETIONS / "loops.fish").read_text()


def test_install_powershell_appends_one_block_to_the_profile(env, tmp_path):
    profile = tmp_path / "Documents" / "PowerShell" / "Microsoft.PowerShell_profile.ps1"
    profile.parent.mkdir(parents=True)
    profile.write_text("Set-Alias ll Get-ChildItem\n")
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "pwsh").write_text(f"#!/bin/sh\necho '{profile}'\n")  # answers `pwsh -Command $PROFILE`
    (fake / "pwsh").chmod(0o755)
    env = dict(env, PATH=f"{fake}{os.pathsep}{env['PATH']}", SHELL="/usr/bin/pwsh")
    for _ in range(2):
        loops(env, "completion", "install")
    text = profile.read_text()
    assert text.startswith("Set-Alias ll Get-ChildItem\n")
    assert text.count("# >>> loops completion >>>") == 1
    assert text.count("Register-ArgumentCompleter -Native -CommandName loops") == 1


def test_install_without_a_known_shell_asks_for_one(env):
    result = loops(dict(env, SHELL="/bin/tcsh"), "completion", "install", check=False)
    assert result.returncode == 2
    assert "Error: cannot tell your shell" in result.stderr
    assert "loops completion install bash" in result.stderr


def test_install_reports_json(env):
    record = json.loads(loops(env, "-o", "json", "completion", "install", "bash").stdout)
    assert record["shell"] == "bash"
    assert record["script"].endswith("/.bash_completions/loops.sh")
    assert record["rc_updated"] is True


# --------------------------------------------------------------------------- run ids from the backend
def _describe_argument_completion_reason() -> str | None:
    """None when `loops runs describe` has an argument with a completion callback, else why not."""
    import typer.main

    from baseten_loops_cli.cli.main import app

    group = typer.main.get_command(app)
    for name in ("runs", "describe"):
        group = getattr(group, "commands", {}).get(name)
        if group is None:
            return "`loops runs describe` does not exist"
    arguments = [p for p in group.params if p.param_type_name == "argument"]
    if not arguments:
        return "`loops runs describe` has no argument"
    # Typer keeps an `autocompletion=` / `shell_complete=` callback here (no public accessor).
    if getattr(arguments[0], "_custom_shell_complete", None) is None:
        return "`loops runs describe RUN` lost its completion callback (cli/_complete.py)"
    return None


def _api(env: dict, method: str, path: str, body: dict | None = None) -> dict:
    """Call the local backend the fixture started, with its URL and key (as the CLI would)."""
    request = urllib.request.Request(
        env["LOOPS_BASE_URL"].rstrip("/") + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Api-Key {env['BASETEN_API_KEY']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read() or b"{}")


@pytest.fixture
def backend_env(local_server, env):
    """The CLI's environment pointed at the session's local server, with its own cache dir."""
    reason = _describe_argument_completion_reason()
    assert reason is None, reason
    return {**env, **local_server.env, "LOOPS_CACHE_DIR": env["LOOPS_CACHE_DIR"]}


@pytest.fixture
def run_id(backend_env) -> str:
    """A run of our own on the local backend (deactivated afterwards)."""
    try:
        capabilities = _api(backend_env, "GET", "/v1/loops/capabilities")
    except urllib.error.HTTPError as exc:
        if exc.code == 503:  # EngineUnavailable: the [local] extra (torch) is not installed
            pytest.skip(f"the local backend cannot create runs: {exc.read().decode(errors='replace')[:200]}")
        raise
    models = [m["model_name"] for m in capabilities["supported_models"]]
    model = next((m for m in models if "tiny" in m), models[0])
    session = _api(backend_env, "POST", "/v1/loops/sessions", {})["session"]["id"]
    run = _api(backend_env, "POST", "/v1/loops/runs",
               {"session_id": session, "base_model": model, "name": "completion-test"})["run"]["id"]
    yield run
    try:
        _api(backend_env, "POST", f"/v1/loops/runs/{run}/deactivate", {})
    except OSError:
        pass


# The first TAB may be answered before the run list is fetched (cli/_complete.py waits 0.3 s,
# then refreshes in the background for the next TAB): these tests ask until it is there.
COMPLETION_POLL_S = 0.5


@needs_bash
def test_bash_completes_run_ids_from_the_local_backend(backend_env, run_id):
    completed = wait_for(lambda: run_id in _bash_complete(backend_env, ["loops", "runs", "describe", ""]),
                         interval=COMPLETION_POLL_S, what="the run id among the completions")
    assert completed, _bash_complete(backend_env, ["loops", "runs", "describe", ""])
    prefix = run_id[: max(1, len(run_id) - 2)]
    assert run_id in _bash_complete(backend_env, ["loops", "runs", "describe", prefix])


@needs_zsh
def test_zsh_completes_run_ids_from_the_local_backend(backend_env, run_id):
    # Warm the completion cache first, so the one interactive TAB below is answered at once.
    wait_for(lambda: run_id in _bash_complete(backend_env, ["loops", "runs", "describe", ""]) if HAVE_BASH else True,
             interval=COMPLETION_POLL_S, what="the run id among the completions")
    dump = Path(backend_env["HOME"]) / ".zcompdump"
    term = _zsh_terminal(backend_env, [f"fpath=({COMPLETIONS} $fpath)", "autoload -Uz compinit",
                                       f"compinit -u -d {dump}"])
    _tab_completes(term, "loops runs describe " + run_id[:-1], re.escape(run_id.encode()))


@needs_bash
def test_bash_completes_checkpoint_refs_after_deploy(backend_env, run_id):
    """`loops deploy CKPT` is `loops deploy create CKPT`: `loops deploy <TAB>` offers RUN:NAME
    references beside the subcommands."""
    prefix = run_id[:-1]
    completed = wait_for(lambda: any(c.startswith(f"{run_id}:") for c in _bash_complete(backend_env, ["loops", "deploy", prefix])),
                         interval=COMPLETION_POLL_S, what="RUN: among the deploy completions")
    assert completed, _bash_complete(backend_env, ["loops", "deploy", prefix])
    assert {"create", "list", "describe", "stop"} <= set(_bash_complete(backend_env, ["loops", "deploy", ""]))
