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
