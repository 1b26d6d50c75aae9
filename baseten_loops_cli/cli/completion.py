"""`loops completion`: print or install the shell completion script (bash, zsh, fish, PowerShell).

The scripts are Typer's: thin shims that call ``loops`` back with ``_LOOPS_COMPLETE=complete_<shell>``
on every TAB, so completion always matches the installed version (and costs one CLI startup).
The same scripts are shipped in ``completions/`` (``scripts/gen_completions.py``) for packagers.

The root app is built with ``add_completion=False`` (no ``--install-completion`` /
``--show-completion`` on every command), and that also skips Typer's registration of its
completion classes, without which every ``_LOOPS_COMPLETE`` request fails with "Shell bash not
supported". :func:`enable_shell_completion` does that registration. :func:`defer_typer_coercion`
keeps Typer from importing pydantic on ``--help`` and TAB (see :class:`_DeferredRuntimeParam`).
Both run when this module is imported (``cli.main`` imports it at top level); both are
idempotent, so ``main()`` may call them too, which it must if this module is ever loaded lazily.
"""

import os
import re
import shutil
import subprocess
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from baseten_loops_cli.cli._state import get_state

PROG_NAME = "loops"
COMPLETE_VAR = "_LOOPS_COMPLETE"


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"
    powershell = "powershell"


# ---------------------------------------------------------------------------- Typer workarounds
def enable_shell_completion() -> None:
    """Register Typer's bash/zsh/fish/PowerShell completion classes (idempotent, no imports).

    ``typer.completion`` is already imported by ``import typer``; ``completion_init`` is what
    ``Typer(add_completion=True)`` would have called while building the command.
    """
    import typer.completion

    typer.completion.completion_init()


def _typer_script(shell: str) -> str:
    """Typer's completion script for ``shell``, exactly as ``loops --show-completion SHELL`` would
    print it with ``_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION=1`` (the shell is taken as given,
    never detected). This is the one call into Typer's completion internals:
    ``get_completion_script`` lives in the private ``typer._completion_shared`` and is re-exported
    by the public module ``typer.completion``; should that change, only this function moves."""
    import typer.completion

    return typer.completion.get_completion_script(
        prog_name=PROG_NAME, complete_var=COMPLETE_VAR, shell=shell
    )


# A file in $fpath that starts with `#compdef` is autoloaded by compinit: its body becomes the
# function `_loops`, run on the first TAB. Typer's body only *defines* the completion function
# and registers it, so that first TAB would complete nothing. When autoloaded, also call it.
_ZSH_COMPDEF_LINE = re.compile(r"^compdef (\S+) (\S+)$", re.MULTILINE)
_ZSH_AUTOLOAD_DISPATCH = """\
if [[ "$funcstack[1]" == "_\\2" ]]; then
  # autoloaded from $fpath by compinit: this is the first TAB, complete it now
  \\1 "$@"
else
  # sourced (e.g. eval "$(loops completion show zsh)"): register the function
  compdef \\1 \\2
fi"""


def completion_script(shell: Shell | str) -> str:
    """The completion script for ``shell`` (newline-terminated), as shipped and installed."""
    name = Shell(shell).value
    script = _typer_script(name)
    if name == Shell.bash.value:
        # Typer's template holds IFS=$'<a literal newline>' (same value); write it as $'\n'.
        script = script.replace("local IFS=$'\n'", "local IFS=$'\\n'")
    if name == Shell.zsh.value:
        script, count = _ZSH_COMPDEF_LINE.subn(_ZSH_AUTOLOAD_DISPATCH, script)
        if count != 1:  # Typer changed its template: fail loudly rather than ship a broken script
            raise RuntimeError("unexpected zsh completion template from Typer")
    return script.rstrip("\n") + "\n"


class _DeferredRuntimeParam:
    """Typer's per-parameter coercer, built only when there is a value to coerce.

    Typer 0.29 builds a pydantic ``TypeAdapter`` for a parameter the first time it processes
    it, even when the value is ``None`` (an option not given, the ``--help`` flag of every
    command) and the adapter is never used: ``RuntimeParam.coerce`` returns ``None`` (or ``()``
    for multi-value parameters) before touching it. That imports pydantic (~100 ms) on
    ``loops runs list --help`` and on every TAB. This stand-in answers the ``None`` case the same
    way and builds the real coercer (Typer's own, cached on the parameter) for anything else,
    except while resolving a completion request (``ctx.resilient_parsing``), where a default
    such as ``--checkpoints 5`` would otherwise pull pydantic into every ``runs describe <TAB>``.
    """

    __slots__ = ("_param", "_build")

    def __init__(self, param, build) -> None:
        self._param = param
        self._build = build

    def coerce(self, value, param, ctx):
        if value is None:
            return () if (param.multiple or param.nargs == -1) else None
        if getattr(ctx, "resilient_parsing", False):
            # Resolving a TAB: values only feed completion callbacks, which get them as typed
            # on the line (or the Python default) rather than coerced, e.g. "3" for an int.
            return value
        return self._build(self._param).coerce(value, param=param, ctx=ctx)

    def __getattr__(self, name):  # anything else: the real one
        return getattr(self._build(self._param), name)


def defer_typer_coercion() -> None:
    """Install :class:`_DeferredRuntimeParam` (idempotent). Touches Typer internals
    (``typer.core._TyperParameter.get_runtime_param`` / ``_runtime_param``), so it does nothing
    when they are not there; tests/test_startup.py then fails and says pydantic is imported."""
    import typer.core

    cls: Any = getattr(typer.core, "_TyperParameter", None)
    build = getattr(cls, "get_runtime_param", None)
    if build is None or getattr(build, "_loops_deferred", False):
        return

    def get_runtime_param(self):
        if getattr(self, "_runtime_param", None) is None:
            return _DeferredRuntimeParam(self, build)
        return build(self)

    get_runtime_param._loops_deferred = True  # type: ignore[attr-defined]
    cls.get_runtime_param = get_runtime_param


enable_shell_completion()
defer_typer_coercion()


# ---------------------------------------------------------------------------- installation
def detect_shell() -> Shell | None:
    """The user's login shell, from ``$SHELL`` (``pwsh``/``powershell`` -> powershell)."""
    name = Path(os.environ.get("SHELL", "")).name.lower()
    name = name.removesuffix(".exe")
    if name in ("pwsh", "powershell"):
        return Shell.powershell
    try:
        return Shell(name)
    except ValueError:
        return None


def _home() -> Path:
    return Path.home()


def _tilde(path: Path) -> str:
    """``path`` written with ``~/`` when it is under the home directory (as users write rc lines)."""
    try:
        return "~/" + path.relative_to(_home()).as_posix()
    except ValueError:
        return str(path)


def _write_if_changed(path: Path, text: str) -> bool:
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def _append_lines(rc: Path, lines: list[str]) -> None:
    existing = rc.read_text(encoding="utf-8") if rc.is_file() else ""
    block = "\n".join(lines) + "\n"
    if existing and not existing.endswith("\n"):
        existing += "\n"
    sep = "\n" if existing else ""
    rc.parent.mkdir(parents=True, exist_ok=True)
    rc.write_text(existing + sep + block, encoding="utf-8")


_MARK = "# added by `loops completion install`"


def _install_with_rc(shell: Shell, script: Path, rc: Path, present: Callable[[str], bool], line: str,
                     activate: str) -> dict:
    """Write the shell's script to ``script`` and add ``line`` to ``rc`` unless ``present``
    (its text) says a line like it is already there."""
    written = _write_if_changed(script, completion_script(shell))
    rc_text = rc.read_text(encoding="utf-8") if rc.is_file() else ""
    rc_updated = not present(rc_text)
    if rc_updated:
        _append_lines(rc, [_MARK, line])
    return {"script": script, "script_written": written, "rc_file": rc, "rc_updated": rc_updated, "activate": activate}


def _install_bash() -> dict:
    script = _home() / ".bash_completions" / f"{PROG_NAME}.sh"
    rc = _home() / ".bashrc"
    return _install_with_rc(Shell.bash, script, rc, lambda text: f".bash_completions/{PROG_NAME}.sh" in text,
                            f"source {_tilde(script)}", activate=f"source {_tilde(rc)}")


def _install_zsh() -> dict:
    zfunc = _home() / ".zfunc"
    zdotdir = Path(os.environ["ZDOTDIR"]).expanduser() if os.environ.get("ZDOTDIR") else _home()
    rc = zdotdir / ".zshrc"
    # fpath must gain ~/.zfunc *before* compinit runs, so the line runs compinit again after it.
    done = _install_with_rc(Shell.zsh, zfunc / f"_{PROG_NAME}", rc,
                            lambda text: bool(re.search(r"^[^#\n]*fpath.*\.zfunc", text, re.MULTILINE)),
                            f"fpath+={_tilde(zfunc)}; autoload -Uz compinit; compinit", activate="exec zsh")
    return {**done, "note": f"{_tilde(zfunc)} must be in fpath before compinit runs in {_tilde(rc)}."}


def _install_fish() -> dict:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(_home() / ".config")
    script = Path(config_home).expanduser() / "fish" / "completions" / f"{PROG_NAME}.fish"
    written = _write_if_changed(script, completion_script(Shell.fish))
    return {"script": script, "script_written": written, "rc_file": None, "rc_updated": False, "activate": "exec fish"}


_PS_BEGIN = f"# >>> {PROG_NAME} completion >>>"
_PS_END = f"# <<< {PROG_NAME} completion <<<"


def _powershell_profile() -> Path:
    from baseten_loops_cli.errors import LoopsError

    exe = shutil.which("pwsh") or shutil.which("powershell")
    if exe is None:
        raise LoopsError(
            "cannot find pwsh or powershell to locate your PowerShell profile",
            hint=f"Add the output of `{PROG_NAME} completion show powershell` to your $PROFILE yourself.",
        )
    try:
        result = subprocess.run(
            [exe, "-NoLogo", "-NoProfile", "-Command", "$PROFILE"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise LoopsError(
            f"could not ask {Path(exe).name} for the profile path: {exc}",
            hint=f"Add the output of `{PROG_NAME} completion show powershell` to your $PROFILE yourself.",
        ) from None
    return Path(result.stdout.strip())


def _install_powershell() -> dict:
    profile = _powershell_profile()
    block = f"{_PS_BEGIN}\n{completion_script(Shell.powershell)}{_PS_END}\n"
    text = profile.read_text(encoding="utf-8-sig") if profile.is_file() else ""
    pattern = re.compile(re.escape(_PS_BEGIN) + r".*?" + re.escape(_PS_END) + r"\n?", re.DOTALL)
    if pattern.search(text):
        new = pattern.sub(lambda _: block, text, count=1)
    else:
        new = text + ("\n" if text and not text.endswith("\n") else "") + block
    written = _write_if_changed(profile, new)
    return {"script": profile, "script_written": written, "rc_file": profile, "rc_updated": written, "activate": ". $PROFILE"}


_INSTALLERS = {
    Shell.bash: _install_bash,
    Shell.zsh: _install_zsh,
    Shell.fish: _install_fish,
    Shell.powershell: _install_powershell,
}


def install(shell: Shell) -> dict:
    """Install completion for ``shell`` for the current user; safe to run again (idempotent)."""
    return _INSTALLERS[shell]()


# ---------------------------------------------------------------------------- commands
app = typer.Typer(
    help="Shell completion for bash, zsh, fish and PowerShell.",
    no_args_is_help=True,
)

ShellArg = Annotated[Shell, typer.Argument(help="bash, zsh, fish or powershell.", show_default=False)]


@app.command("show")
def show(shell: ShellArg) -> None:
    """Print the completion script for SHELL on stdout.

    Source it, or save it where your shell looks for completions. The same scripts are shipped
    in the completions/ directory of the source distribution.

    Examples:

      loops completion show bash > ~/.bash_completions/loops.sh

      eval "$(loops completion show zsh)"

      loops completion show fish > ~/.config/fish/completions/loops.fish

      loops completion show powershell >> $PROFILE
    """
    typer.echo(completion_script(shell), nl=False)


@app.command("install")
def install_command(
    ctx: typer.Context,
    shell: Annotated[
        Optional[Shell],
        typer.Argument(help="bash, zsh, fish or powershell (default: from $SHELL).", show_default=False),
    ] = None,
) -> None:
    """Install completion for your shell (detected from $SHELL unless given).

    bash: writes ~/.bash_completions/loops.sh and a source line in ~/.bashrc.
    zsh: writes ~/.zfunc/_loops and `fpath+=~/.zfunc; autoload -Uz compinit; compinit` in ~/.zshrc.
    fish: writes ~/.config/fish/completions/loops.fish.
    powershell: adds the script to your $PROFILE (between marker lines).
    Running it again updates the script and never duplicates the rc lines.

    Examples:

      loops completion install

      loops completion install zsh
    """
    from baseten_loops_cli.errors import UsageError

    out = get_state(ctx).output
    if shell is None:
        shell = detect_shell()
        if shell is None:
            raise UsageError(
                f"cannot tell your shell from $SHELL ({os.environ.get('SHELL') or 'unset'})",
                hint=f"Name it: {PROG_NAME} completion install bash|zsh|fish|powershell",
            )
    result = install(shell)
    record = {"shell": shell.value, **{k: str(v) if isinstance(v, Path) else v for k, v in result.items()}}
    where = _tilde(result["script"])
    if result["script_written"]:
        out.success(f"Installed {shell.value} completion in {where}")
    else:
        out.info(f"The {shell.value} completion in {where} is already up to date")
    if result["rc_updated"] and result["rc_file"] != result["script"]:
        out.info(f"Updated {_tilde(result['rc_file'])}")
    elif result.get("note"):  # the user's own rc lines: remind them of the one pitfall
        out.hint(result["note"])
    out.hint(f"Restart your shell or run `{result['activate']}` to use it.")
    out.emit(record, id_key="script", text=[])
