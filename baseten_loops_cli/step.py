"""``Step``: what an RL environment's ``step`` returns (``from baseten_loops_cli import Step``).

Standard library only, so an environment file imports it for free and ``loops --help`` never
pays for it. A plain dict with the same keys is accepted too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Step:
    """One turn's outcome: the turn's ``reward``, whether the episode is ``done``, the
    ``messages`` (user or tool turns) appended before the model's next reply, and free-form
    ``info`` kept in samples.jsonl."""

    reward: float = 0.0
    done: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(reply: str) -> list[dict[str, Any]]:
    """The tool calls of a reply in the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    format that Hermes-style chat templates (Qwen, SmolLM2 and others) teach their models; a call
    whose JSON does not parse is skipped. For an environment's ``step``:

        for call in parse_tool_calls(reply):
            if call["name"] == "calc": ...
    """
    calls = []
    for body in _TOOL_CALL.findall(reply):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            calls.append({"name": call["name"], "arguments": arguments if arguments is not None else {}})
    return calls
