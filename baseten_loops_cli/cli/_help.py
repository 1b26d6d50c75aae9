"""Help texts as paragraphs: the terminal renderer wraps them, not the source's line breaks.

Docstrings and ``help=`` strings are written wrapped at the source's width. Typer keeps the line
breaks inside every paragraph after the first, so on a narrower terminal a sentence came out as
a full line followed by one or two orphan words ("trainer", "-o jsonl"). :func:`reflow_tree`
joins the lines of each prose paragraph once, when the command tree is assembled; Rich then
wraps them to the terminal. Indented paragraphs (examples), lists and ``\\b`` blocks keep their
lines.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

_LIST_ITEM = re.compile(r"^([-*•]|\d+[.)])\s")


def reflow(text: str | None) -> str | None:
    """``text`` with the lines of each prose paragraph joined by spaces."""
    if not text:
        return text
    paragraphs = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines = para.split("\n")
        if para.startswith("\b") or any(line.startswith((" ", "\t")) for line in lines):
            paragraphs.append(para)
            continue
        items: list[str] = []
        for line in lines:
            if items and not _LIST_ITEM.match(line):
                items[-1] += " " + line.strip()
            else:
                items.append(line.strip())
        paragraphs.append("\n".join(items))
    return "\n\n".join(paragraphs)


def reflow_tree(app: Any) -> None:
    """Reflow the help of ``app`` (a ``typer.Typer``), its commands and its sub-apps."""
    app.info.help = reflow(app.info.help if isinstance(app.info.help, str) else None) or app.info.help
    for command in app.registered_commands:
        text = command.help if isinstance(command.help, str) else inspect.getdoc(command.callback)
        if text:
            command.help = reflow(text)
    for group in app.registered_groups:
        if isinstance(group.help, str):
            group.help = reflow(group.help)
        if group.typer_instance is not None:
            reflow_tree(group.typer_instance)


def use_click_names() -> None:
    """Click's usual names in help, usage lines and errors, in place of Typer 0.29's: an argument
    is ``RUN_IDS...`` / ``[NAME]`` (not ``{run_ids}...``; errors say ``Missing argument 'RUN_ID'``)
    and a boolean flag shows no ``<bool>`` type. Man pages (scripts/gen_man.py) already spell
    arguments this way. Display only: parsing and completion do not read these. Applied once to
    Typer's parameter classes; a Typer without them keeps its own display."""
    from typer import core

    argument, option = getattr(core, "TyperArgument", None), getattr(core, "TyperOption", None)
    if argument is None or option is None or getattr(argument, "_loops_click_names", False):
        return

    def display_name_raw(self) -> str:
        return self.metavar if self.metavar is not None else (self.name or "").upper()

    def get_usage_pieces(self, ctx: Any) -> list[str]:
        name = self.display_name_raw + ("..." if self.nargs != 1 else "")
        return [name if self.required else f"[{name}]"]

    typer_display_type = option.display_type_rich

    def display_type_rich(self, ctx: Any) -> str | None:
        if getattr(self, "is_bool_flag", False) and self.metavar is None:
            return None
        return typer_display_type(self, ctx)

    argument.display_name_raw = property(display_name_raw)
    argument.get_usage_pieces = get_usage_pieces
    option.display_type_rich = display_type_rich
    argument._loops_click_names = True


def kinds_text() -> str:
    """``sft, rl, dpo, kto or distill``: the training kinds as the registry names them, for help
    texts. The registry module lists them without importing any kind (``loops --help`` stays free
    of pydantic, yaml and torch)."""
    from baseten_loops_cli.training.kinds import names_text

    return names_text(quoted=False)
