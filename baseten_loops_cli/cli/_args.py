"""Checks on combinations of command-line options, shared by commands."""

from __future__ import annotations

from typing import Annotated, Any, Callable

import typer

from baseten_loops_cli.errors import UsageError

# `--yes` of a command that asks before it acts (deactivate): scripts need it, having no terminal.
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (needed without a terminal).")]


def id_argument(help: str, complete: Callable[..., Any]) -> Any:
    """The typer Argument of one or more ids (``RUN_ID``, ``SAMPLER_IDS...``): TAB-completed by
    ``complete`` (a ``cli._complete`` function), no default shown."""
    return typer.Argument(help=help, autocompletion=complete, show_default=False)


def exactly_one(**options: Any) -> tuple[str, Any] | None:
    """The one option given among ``options`` (None when none is); two or more is a usage
    error naming them."""
    given = [(k, v) for k, v in options.items() if v not in (None, False, "")]
    if len(given) > 1:
        names = " and ".join("--" + k.replace("_", "-") for k, _ in given)
        raise UsageError(
            f"{names} cannot be used together",
            hint=f"Pass one of {', '.join('--' + k.replace('_', '-') for k in options)}.",
        )
    return given[0] if given else None
