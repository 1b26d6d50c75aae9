"""A tool-use environment: the model must call the `calc` tool, then answer with its result.

    env: envs/calc.py:CalcEnv           (examples/tiny-calc.yaml)

The tool adds the row's hidden offset to the number it is called with, so the answer can only
come from the tool's reply. A call is ``calc N``; with ``strict: false`` (the tiny model's
setting, so that a model that starts from random weights finds it in seconds) any reply that
holds a number calls it. Rewards: 0.2 for a call, 1 for a later reply that contains the tool's
result (the episode ends), else 0.2 x the share of digits in the reply.
"""

import re

from baseten_loops_cli import Step

CALL = re.compile(r"calc\s*\(?\s*(-?\d+)")
NUMBER = re.compile(r"-?\d+")


class CalcEnv:
    def __init__(self, row: dict, strict: bool = True):
        self.offset = int(row["offset"])
        self.strict = strict
        self.result: int | None = None

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": "Call the calc tool with a number (calc 12), then reply with its result."}]

    def step(self, reply: str) -> Step:
        text = reply.strip()
        digits = sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
        if self.result is None:  # no tool call yet
            match = CALL.search(text) or (None if self.strict else NUMBER.search(text))
            if match is None:
                return Step(reward=0.0, messages=[{"role": "user", "content": "Call calc first."}])
            self.result = int(match.group(1) if match.groups() else match.group()) + self.offset
            return Step(reward=0.2, messages=[{"role": "tool", "content": str(self.result)}],
                        info={"called": int(match.group(match.lastindex or 0))})
        if str(self.result) in text:
            return Step(reward=1.0, done=True, info={"answered": self.result})
        return Step(reward=0.2 * digits, messages=[{"role": "user", "content": "Reply with the tool's result."}])
