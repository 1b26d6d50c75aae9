"""The root of the ``loops`` command tree and its entry point.

Only typer and the small ``cli`` modules are imported here: ``loops --help``, ``--version`` and
tab completion must stay fast, so httpx, pydantic, yaml, keyring and torch are imported inside
command bodies. ``main()`` is the one place where errors become messages and exit codes.
"""

import contextlib
import os
import sys
from typing import Annotated, Any, Iterator, Optional

import typer

from baseten_loops_cli import __version__

# httpx imports its own command line (click, pygments, rich.syntax) whenever click is installed,
# as it is with the [local] extra (uvicorn needs it): 70 ms of every command that makes a
# request. The CLI never runs it; httpx falls back to a stub when that import fails.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
from baseten_loops_cli.cli import (  # noqa: E402 - after the stub above, which must come first
    _complete,
    _help,
    auth,
    checkpoints,
    completion,
    config,
    data,
    deploy,
    reward,
    eval as eval_,
    models,
    runs,
    sample,
    samplers,
    server,
    train,
    usage,
)
from baseten_loops_cli.cli._state import get_state  # noqa: E402
from baseten_loops_cli.errors import EXIT_CODE_HELP, ExitCode  # noqa: E402

HELP = f"""\
Loops: LoRA post-training of LLMs on Baseten, or on the embedded local backend.

Manage runs, samplers, checkpoints and deployments; run YAML-defined training loops of every kind ({_help.kinds_text()}) with `loops train`. With no Baseten key set up, commands use the local backend (`loops server`).

Global options (-o, --jq, -q, --profile, --debug) may be given anywhere on the line.

Exit codes: {EXIT_CODE_HELP}.
"""

EPILOG = """\
Examples:

  loops train run examples/tiny-sft.yaml --yes

  loops runs list -o json

  loops checkpoints download RUN:final --target sampler -O ./adapter
"""

app = typer.Typer(
    name="loops",
    help=HELP,
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

RUNS = "Runs"
CHECKPOINTS = "Checkpoints"
TRAINING = "Training"
SETUP = "Setup"

app.add_typer(runs.app, name="runs", rich_help_panel=RUNS)
app.add_typer(samplers.app, name="samplers", rich_help_panel=RUNS)
app.command("usage", rich_help_panel=RUNS)(usage.usage)
app.command("models", rich_help_panel=RUNS)(models.models)
app.command("sample", rich_help_panel=RUNS)(sample.sample)
app.add_typer(checkpoints.app, name="checkpoints", rich_help_panel=CHECKPOINTS)
app.add_typer(deploy.app, name="deploy", rich_help_panel=CHECKPOINTS)
app.command("eval", rich_help_panel=CHECKPOINTS)(eval_.eval_command)
app.add_typer(train.app, name="train", rich_help_panel=TRAINING)
app.add_typer(data.app, name="data", rich_help_panel=TRAINING)
app.add_typer(reward.app, name="reward", rich_help_panel=TRAINING)
app.add_typer(auth.app, name="auth", rich_help_panel=SETUP)
app.add_typer(config.app, name="config", rich_help_panel=SETUP)
app.add_typer(server.app, name="server", rich_help_panel=SETUP)
app.add_typer(completion.app, name="completion", rich_help_panel=SETUP)
_help.reflow_tree(app)
_help.use_click_names()


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"loops {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    output: Annotated[
        Optional[str],
        typer.Option("-o", "--output", help="Output format: table, json, jsonl, yaml, csv or none.", envvar="LOOPS_OUTPUT", show_envvar=True),
    ] = None,
    jq: Annotated[
        Optional[str], typer.Option("--jq", help="Filter JSON output with a jq expression (implies -o json).")
    ] = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Print IDs only, no messages.")] = False,
    profile: Annotated[
        Optional[str],
        typer.Option(
            "--profile",
            help="Profile to use (default: LOOPS_PROFILE, then the active one).",
            envvar="LOOPS_PROFILE",
            show_envvar=True,
            autocompletion=_complete.complete_profile,
        ),
    ] = None,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks and HTTP debug logs (keys redacted).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version and exit."),
    ] = False,
) -> None:
    state = get_state(ctx)
    state.output_format = output
    state.jq = jq
    state.quiet = quiet
    state.profile = profile
    state.debug = debug or state.debug
    if state.debug:
        os.environ["LOOPS_DEBUG"] = "1"
    ctx.call_on_close(state.close)


# Options that belong to the root but that users type after the subcommand
# (`loops runs list -o json`). They are moved in front of the subcommand before parsing.
_GLOBAL_WITH_VALUE = {"-o", "--output", "--jq", "--profile"}
_GLOBAL_FLAGS = {"-q", "--quiet", "--debug"}


def hoist_global_options(argv: list[str]) -> list[str]:
    """Move global options found after the subcommand to the front (stops at ``--``)."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg
        if name in _GLOBAL_WITH_VALUE:
            if "=" in arg and arg.startswith("--"):
                front.append(arg)
            elif i + 1 < len(argv):
                front.extend([arg, argv[i + 1]])
                i += 1
            else:  # last on the line: the subcommand's parser would call it an unknown option
                from baseten_loops_cli.errors import UsageError

                raise UsageError(f"Option '{arg}' requires an argument.",
                                 hint=f"Give it a value, e.g. `{arg} json`." if arg in ("-o", "--output")
                                 else f"Give {arg} a value.")
        elif arg.startswith("-o") and len(arg) > 2 and not arg.startswith("--"):
            front.append(arg)  # -ojson
        elif arg in _GLOBAL_FLAGS:
            front.append(arg)
        else:
            rest.append(arg)
        i += 1
    return front + rest


def insert_default_subcommands(argv: list[str]) -> list[str]:
    """``loops deploy CKPT... --model-name M`` is ``loops deploy create CKPT...``: insert
    ``create`` when the word after ``deploy`` is neither a ``deploy`` subcommand nor a help flag.

    Runs after :func:`hoist_global_options`, so the first word that is not an option is the
    command (root flags without a value, e.g. ``--version``, may precede it).
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        if arg.startswith("-"):
            i += 2 if arg in _GLOBAL_WITH_VALUE else 1  # skip the option (and its value)
            continue
        if arg != "deploy" or i + 1 >= len(argv):
            return argv
        following = argv[i + 1]
        if following in deploy.SUBCOMMANDS or following in ("-h", "--help"):
            return argv
        return [*argv[: i + 1], "create", *argv[i + 1 :]]
    return argv


def _print_error(message: str, hint: str | None) -> None:
    from baseten_loops_cli.output.sink import Streams

    prefix = "\x1b[31mError:\x1b[0m" if Streams().stderr_color else "Error:"
    print(f"{prefix} {message}", file=sys.stderr)
    if hint:
        print(f"Hint: {hint}", file=sys.stderr)


def _click_exceptions():
    """Click's exception classes as Typer raises them: Typer >= 0.26 vendors Click as
    ``typer._click`` (its ``ClickException`` derives from the public ``typer.TyperException``)."""
    try:
        from typer._click import exceptions
    except ImportError:  # pragma: no cover - a Typer that uses click itself
        from click import exceptions
    return exceptions


# Training flags users try on commands that take a config (`loops train run CONFIG --steps 10`):
# the config field each one means, for a hint with the `--set` spelling.
_SET_SPELLINGS = {
    "--steps": "max_steps",
    "--max-steps": "max_steps",
    "--lr": "optimizer.learning_rate",
    "--learning-rate": "optimizer.learning_rate",
    "--batch-size": "batch_size",
    "--epochs": "epochs",
    "--name": "name",
    "--lora-rank": "lora_rank",
    "--max-seq-len": "max_seq_len",
}


def _set_spelling(exc: Exception, argv: list[str]) -> str | None:
    """``Use --set max_steps=10`` for an unknown training flag of a command that takes --set."""
    option = getattr(exc, "option_name", None)
    ctx = getattr(exc, "ctx", None)
    field = _SET_SPELLINGS.get(option or "")
    if field is None or ctx is None or not any("--set" in getattr(p, "opts", ()) for p in ctx.command.params):
        return None
    value = "VALUE"
    for i, arg in enumerate(argv):
        if arg.startswith(f"{option}="):
            value = arg.split("=", 1)[1]
        elif arg == option and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value = argv[i + 1]
    return (f"Use --set {field}={value} (config fields are set with --set key.path=value); "
            f"run '{ctx.command_path} --help' for usage.")


def _print_click_error(exc: Exception, argv: list[str] | None = None) -> int:
    """A Click/Typer error (bad option value, missing or unknown option or argument, unknown
    command, bad choice) as our one ``Error:`` line plus a ``Hint:`` naming the command's
    ``--help`` (or, for a training flag such as ``--steps``, the ``--set`` spelling), instead of
    Typer's usage box. Returns the exit code (2 for usage errors)."""
    exceptions = _click_exceptions()
    code = int(getattr(exc, "exit_code", ExitCode.USAGE))
    if type(exc).__name__ == "NoArgsIsHelpError":  # `loops` / `loops runs` alone: the help
        text = exc.format_message()  # type: ignore[attr-defined]
        if text.strip():  # plain Click help (Rich help was already printed while it was made)
            exc.show()  # type: ignore[attr-defined]
        return code
    message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]  # one line
    hint = None
    if isinstance(exc, exceptions.UsageError):
        ctx = exc.ctx
        command = ctx.command_path if ctx is not None else "loops"
        hint = f"Run '{command} --help' for usage."
        if isinstance(exc, exceptions.NoSuchOption):
            hint = _set_spelling(exc, argv or []) or hint
    _print_error(message, hint)
    return code


_TYPER_FORCING = ("GITHUB_ACTIONS", "FORCE_COLOR", "PY_COLORS")
_TYPER_TERMINAL_OFF = "_TYPER_FORCE_DISABLE_TERMINAL"


@contextlib.contextmanager
def _typer_takes_the_sinks_colour_decision() -> Iterator[None]:
    """Typer draws help with a Rich console of its own, which detects a terminal per stream but
    is forced onto one by GITHUB_ACTIONS, FORCE_COLOR or PY_COLORS (ANSI in piped output: CI
    logs, `loops --help > file`) and keeps bold and dim under NO_COLOR. Where that differs from
    the sink's decision (``Streams``: colour only at a terminal, without NO_COLOR or
    TERM=dumb), turn its terminal off for this call. Typer reads the switch when it first
    imports ``typer.rich_utils`` (to draw help, not before); the switch is undone afterwards,
    so it neither leaks into child processes nor sticks to a later call in the same process."""
    from baseten_loops_cli.output.sink import Streams

    streams = Streams()
    mixed = streams.stdout_color or streams.stderr_color  # Typer's per-stream detection agrees
    forced = any(os.environ.get(name) for name in _TYPER_FORCING)
    if (streams.stdout_color and streams.stderr_color) or (mixed and not forced):
        yield
        return
    rich_utils: Any = sys.modules.get("typer.rich_utils")  # FORCE_TERMINAL is set at import time
    before = rich_utils.FORCE_TERMINAL if rich_utils is not None else None
    os.environ[_TYPER_TERMINAL_OFF] = "1"
    if rich_utils is not None:
        rich_utils.FORCE_TERMINAL = False
    try:
        yield
    finally:
        os.environ.pop(_TYPER_TERMINAL_OFF, None)
        rich_utils = sys.modules.get("typer.rich_utils")
        if rich_utils is not None:  # imported before or during this call: Typer's own default
            rich_utils.FORCE_TERMINAL = before if before is not None else (True if forced else None)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, map errors to one line and an exit code."""
    from baseten_loops_cli.errors import LoopsError

    raw = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in raw or os.environ.get("LOOPS_DEBUG", "") in {"1", "true"}
    exceptions = _click_exceptions()
    try:
        args = insert_default_subcommands(hoist_global_options(raw))
        # Not standalone: Click's own errors reach us (not Typer's usage box), and an Exit (help,
        # --version, typer.Exit(n), Ctrl-C inside a command = 130) comes back as its code.
        with _typer_takes_the_sinks_colour_decision():
            code = app(args=args, prog_name="loops", standalone_mode=False)
        sys.exit(code if type(code) is int else 0)  # no command returns a value
    except exceptions.ClickException as exc:
        sys.exit(_print_click_error(exc, raw))
    except typer.Abort:  # typer.confirm(abort=True) answered no, or EOF at a prompt
        print("Aborted.", file=sys.stderr)
        sys.exit(int(ExitCode.ERROR))
    except LoopsError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        _print_error(exc.message, exc.hint)
        sys.exit(int(exc.exit_code))
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        sys.exit(int(ExitCode.INTERRUPTED))
    except Exception as exc:  # an unexpected failure: one line, traceback only with --debug
        if debug:
            raise
        _print_error(
            f"unexpected {type(exc).__name__}: {exc}",
            "Run again with --debug for the traceback, and report it if it persists.",
        )
        sys.exit(int(ExitCode.ERROR))
    finally:
        # The interpreter's last garbage collection walks every object the imports made (typer,
        # rich, httpx, pydantic's schemas): 0.75 s of `checkpoints download` on a loaded 2-core box.
        # Nothing the CLI keeps needs that pass (files are closed explicitly), so skip it.
        import gc

        gc.freeze()
