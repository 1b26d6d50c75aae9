"""Row formats: which one a source's rows are in, and each row as the internal row of a purpose.

Formats (keys after ``data.columns`` renames them):

- ``messages``: OpenAI chat, ``{"messages": [{"role", "content", "tool_calls"?, ...}], "tools"?}``
- ``sharegpt``: ``{"conversations" | "messages": [{"from", "value"}], "system"?, "tools"?}`` with
  tags human/gpt/system/function_call/observation (user/assistant/tool too)
- ``alpaca``: ``{"instruction", "input"?, "output", "system"?, "history"?: [[user, assistant]]}``
  (``chosen``/``rejected`` instead of ``output`` for preference data)
- TRL's types, standard (strings) or conversational (message lists): ``text``; ``prompt_only``
  ``{"prompt"}``; ``prompt_completion``; ``preference`` ``{"prompt"?, "chosen", "rejected"}``
  (no prompt: the shared prefix is the prompt); ``unpaired_preference`` ``{"prompt",
  "completion", "label"}``

Purposes (what a loader in ``training/data/datums.py`` takes):

- ``sft``: ``{"messages": [...]}`` or ``{"prompt": str, "completion": str}``
- ``prompts`` (RL): ``{"messages": [...]}`` or ``{"prompt": str}``, plus the row's other fields;
  a reference reply (a final assistant turn, ``output``, ``completion``) becomes ``answer``
  unless the row has one
- ``preference`` (DPO): ``{"prompt": str | [...], "chosen", "rejected"}`` or
  ``{"messages": [...], "chosen", "rejected"}``
- ``unpaired`` (KTO): ``{"prompt": str | [...], "completion": str | [...], "label": bool}`` or
  ``{"messages": [...], "completion", "label"}`` (or no prompt: the completion is a whole
  conversation); a label "true"/"false"/1/0 (CSV) is a bool
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from baseten_loops_cli.errors import ConfigError

# "env": an environment's rows, passed as they are (no format detection: the environment reads them).
ENV_ROWS = "env"
PURPOSES = ("sft", "prompts", "preference", "unpaired", ENV_ROWS)
# The field each format cannot do without (named when a row of another format is found).
KEY_FIELD = {
    "messages": "messages", "sharegpt": "conversations", "alpaca": "instruction", "preference": "chosen",
    "unpaired_preference": "label", "prompt_completion": "completion", "prompt_only": "prompt", "text": "text",
}
# The fields a row of a format needs all of (the first missing one is named).
REQUIRED = {"unpaired_preference": ("completion", "label"), "preference": ("chosen", "rejected")}
EXPECTED = ("expected a 'messages' list, ShareGPT 'conversations', Alpaca 'instruction'/'output', "
            "'prompt'/'completion', 'chosen'/'rejected' or 'text'")
FORMATS_HINT = ("Map the columns: data.columns in a config ({prompt: question, completion: answer}), "
                "--columns prompt=question,completion=answer for `loops data` and `loops eval`; "
                "or set data.format to one of: messages, sharegpt, alpaca, preference, prompt_completion, prompt_only, text.")
# The row types loops read before formats were detected, which a file may mix as it always could.
NATIVE_MIX = (frozenset({"messages", "prompt_completion"}), frozenset({"messages", "prompt_only"}))
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
    "observation": "tool", "tool": "tool", "function_response": "tool", "function_call": "assistant",
}


def classify(row: dict) -> str | None:
    """The format one row is in, by its keys (the most specific match), or None."""
    messages = row.get("messages")
    if "conversations" in row or (isinstance(messages, list) and messages
                                  and all(isinstance(m, dict) and "from" in m and "role" not in m for m in messages)):
        return "sharegpt"
    if "instruction" in row:
        return "alpaca"
    if "chosen" in row or "rejected" in row:  # one side missing is a preference row's mistake
        return "preference"
    if "completion" in row and "label" in row:  # prompt or messages, a completion and a thumbs up/down
        return "unpaired_preference"
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "text" in row:
        return "text"
    if "prompt" in row:
        return "prompt_only"
    return None


def describe(fmt: str, rows: list[tuple[str, dict]]) -> str:
    """'alpaca' or 'prompt_completion (conversational)': TRL's types say which of their forms."""
    if fmt in ("preference", "unpaired_preference", "prompt_completion", "prompt_only", "text") and rows:
        first = rows[0][1]
        value = first.get(KEY_FIELD[fmt] if fmt != "unpaired_preference" else "completion")
        return f"{fmt} ({'conversational' if isinstance(value, list) else 'standard'})"
    return fmt


def detect(rows: list[tuple[str, dict]], label: str, forced: str | None = None,
           mapped: dict[str, str] | None = None, purpose: str | None = None) -> tuple[str, list[str]]:
    """The format of a source's rows, from every row: the most common one, and the format to
    read each row as. A row of another format (or of none) is an error at that row, naming the
    field it lacks (and, given the ``purpose`` it is read for, the kind: a paired row among
    unpaired ones "under kind: kto"); OpenAI messages rows may mix with prompt/completion (or
    prompt) rows."""
    kinds = [classify(row) for _, row in rows]
    if forced:
        return forced, [forced] * len(rows)
    counts = Counter(k for k in kinds if k is not None)
    if not counts:
        where, row = rows[0]
        raise ConfigError(f"{where}: no known row format in keys {sorted(row)}; {EXPECTED}", hint=FORMATS_HINT)
    fmt = counts.most_common(1)[0][0]
    row_formats: list[str] = []  # every row's format (a row of none is an error below)
    for (where, row), kind in zip(rows, kinds):
        if kind is not None and (kind == fmt or frozenset({kind, fmt}) in NATIVE_MIX):
            row_formats.append(kind)
            continue
        field = next((k for k in REQUIRED.get(fmt, ()) if k not in row), KEY_FIELD[fmt])
        looks = f"this row looks like {kind}" if kind else "this row is in no known format"
        hint = "Fix or remove the row, or set data.format if every row is meant to be read as one format."
        if frozenset({kind, fmt}) == _PAIRED_AND_UNPAIRED:
            # The mistake users make most with preference data: thumbs-up/down rows among pairs.
            looks = ("this is an unpaired row ('completion'/'label')" if kind == "unpaired_preference"
                     else "this is a paired row ('chosen'/'rejected')")
            reader = _kind_reading(purpose) if purpose else None
            if reader is not None:
                looks += f" under kind: {reader}"
            hint = ("Pairs (chosen/rejected) train with kind: dpo, unpaired rows (completion + label) "
                    "with kind: kto; keep one kind of row per file.")
        raise ConfigError(
            f"{where}: missing key {field!r}{_mapped_note(field, mapped)}: {looks} (keys {', '.join(sorted(map(str, row)))}), "
            f"but {counts[fmt]:,} of the {len(rows):,} rows of {label} are {fmt}",
            hint=hint,
        )
    return fmt, row_formats


_PAIRED_AND_UNPAIRED = frozenset({"preference", "unpaired_preference"})


def _mapped_note(field: str, mapped: dict[str, str] | None) -> str:
    return f" (data.columns maps it to {mapped[field]!r})" if mapped and field in mapped else ""


class _Row:
    """One row being converted: typed field access whose errors name the row and the field."""

    def __init__(self, where: str, row: dict, fmt: str, mapped: dict[str, str] | None):
        self.where, self.row, self.fmt, self.mapped = where, row, fmt, mapped

    def error(self, message: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{self.where}: {message}", hint=hint)

    def has(self, key: str) -> bool:
        return self.row.get(key) is not None

    def get(self, key: str) -> Any:
        if key not in self.row:
            raise self.error(f"missing key {key!r}{_mapped_note(key, self.mapped)} ({self.fmt} rows have it)",
                             hint=f"Add it to the row, or map the column that holds it with data.columns.{key}.")
        return self.row[key]

    def text(self, key: str, default: str | None = None) -> str:
        value = self.row.get(key) if default is not None else self.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, str):
            raise self.error(f"field {key!r} must be a string, not {type(value).__name__}")
        return value

    def structured(self, key: str) -> Any:
        """A list or object field; from CSV it arrives as JSON text."""
        value = self.get(key)
        if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise self.error(f"field {key!r} is not valid JSON: {exc.msg}") from None
        return value

    def messages(self, key: str) -> list[dict]:
        value = self.structured(key)
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
            raise self.error(f"field {key!r} must be a list of messages ({{\"role\", \"content\"}} objects)")
        # Parquet/Arrow give every message every key of the column's struct: drop the empty ones
        # (a template tests `tool_calls is defined`).
        return [{k: v for k, v in m.items() if v is not None} for m in value]

    def reply(self, key: str) -> str | list[dict]:
        """A reply: a string, or one message / a list of messages."""
        value = self.structured(key)
        return value if isinstance(value, str) else self.messages(key)

    def turns(self, key: str) -> list[dict]:
        """ShareGPT turns as chat messages."""
        value = self.structured(key)
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list):
            raise self.error(f"field {key!r} must be a list of {{\"from\", \"value\"}} turns")
        out = []
        for i, turn in enumerate(value):
            if not isinstance(turn, dict):
                raise self.error(f"{key}[{i}] must be an object with 'from' and 'value'")
            tag = turn.get("from", turn.get("role"))
            content = turn.get("value", turn.get("content"))
            role = SHAREGPT_ROLES.get(str(tag).lower()) if isinstance(tag, str) else None
            if role is None:
                raise self.error(
                    f"{key}[{i}].from is {tag!r}, not a ShareGPT role",
                    hint="Use human, gpt, system, function_call or observation (or user, assistant, tool).",
                )
            if not isinstance(content, str):
                raise self.error(f"{key}[{i}].value must be a string, not {type(content).__name__}")
            if tag == "function_call":
                try:
                    call = json.loads(content)
                except json.JSONDecodeError:
                    raise self.error(f"{key}[{i}]: a function_call's value must be JSON {{\"name\", \"arguments\"}}") from None
                calls = call if isinstance(call, list) else [call]
                out.append({"role": "assistant", "content": "",
                            "tool_calls": [{"type": "function", "function": c} for c in calls]})
            else:
                out.append({"role": role, "content": content})
        return out

    def tools(self, out: dict) -> dict:
        if self.has("tools"):
            out["tools"] = self.structured("tools")
        return out


def _shared_prefix(a: Any, b: Any) -> int:
    """TRL's implicit prompt: the length of what ``chosen`` and ``rejected`` share (characters or
    messages), not cutting a space that starts the replies."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if isinstance(a, str) and n > 0 and n < len(a) and a[n - 1] == " ":
        n -= 1
    return n


def _with_answer(r: _Row, out: dict, reply: Any) -> dict:
    """An RL prompt row keeps its other fields; the reference reply is its answer."""
    if "answer" not in r.row and reply is not None:
        out["answer"] = reply if isinstance(reply, str) else (reply[-1].get("content") if reply else None)
    return out


def _prompt_row(r: _Row, prompt: str | list[dict], reply: Any) -> dict:
    out = {k: v for k, v in r.row.items() if k not in ("messages", "conversations", "prompt")}
    if isinstance(prompt, str):
        out["prompt"] = prompt
    else:
        out["messages"] = prompt
    return r.tools(_with_answer(r, out, reply))


def _split_reply(messages: list[dict]) -> tuple[list[dict], dict | None]:
    if messages and messages[-1].get("role") == "assistant":
        return messages[:-1], messages[-1]
    return messages, None


def _alpaca_prompt(r: _Row) -> list[dict]:
    messages = []
    system = r.text("system", "")
    if system:
        messages.append({"role": "system", "content": system})
    if r.has("history"):
        history = r.structured("history")
        if not isinstance(history, list) or not all(isinstance(t, (list, tuple)) and len(t) == 2 for t in history):
            raise r.error("field 'history' must be a list of [user, assistant] pairs")
        for user, assistant in history:
            messages += [{"role": "user", "content": str(user)}, {"role": "assistant", "content": str(assistant)}]
    instruction, extra = r.text("instruction"), r.text("input", "")
    messages.append({"role": "user", "content": instruction + ("\n" + extra if extra else "")})
    return messages


def _kind_reading(purpose: str) -> str | None:
    """The kind that reads ``purpose`` rows, from the registry (for messages)."""
    from baseten_loops_cli.training import kinds

    return kinds.reading(purpose)


def _wrong_purpose(r: _Row, purpose: str) -> ConfigError:
    needs = {"sft": "a reply to train on (messages, conversations, output or completion)",
             "prompts": "a prompt", "preference": "a 'chosen' and a 'rejected' reply",
             "unpaired": "a 'completion' and a 'label'"}[purpose]
    kind = _kind_reading(purpose)
    paired = r.has("chosen") and r.has("rejected")
    if purpose == "unpaired" and paired:
        return r.error(
            "a paired row ('chosen'/'rejected') under kind: kto, which takes one 'completion' and a 'label' per row",
            hint="Pairs train with kind: dpo; for kind: kto split each pair into {\"prompt\": ..., \"completion\": "
                 "<chosen>, \"label\": true} and {\"prompt\": ..., \"completion\": <rejected>, \"label\": false}.",
        )
    hint = {
        "unpaired_preference": "Unpaired preference rows (completion + label) train with kind: kto; for kind: dpo, "
                               "pair a good and a bad completion per prompt as chosen/rejected.",
        "preference": "Preference pairs train with kind: dpo.",
        "prompt_only": "Prompts without replies train with kind: rl.",
        "text": "Plain text rows train with kind: sft.",
    }.get("preference" if paired else r.fmt, f"Kind {kind} needs {needs}.")
    if purpose == "unpaired" and not paired and r.fmt != "unpaired_preference":
        hint = ("Give each row a 'completion' and a 'label' (true for a desirable completion, false for an "
                "undesirable one), or map the columns that hold them with data.columns.")
    return r.error(f"{r.fmt} rows do not have {needs}, which kind {kind} needs", hint=hint)


def _unpaired_row(r: _Row) -> dict:
    """KTO's row: the prompt (a string, messages, or none: the completion is a whole
    conversation), the completion, and the label as a bool."""
    label = r.get("label")
    if isinstance(label, str) and label.strip().lower() in ("true", "false", "1", "0"):
        label = label.strip().lower() in ("true", "1")
    if not isinstance(label, bool) and label not in (0, 1):
        raise r.error(f"field 'label' must be true or false, not {label!r}",
                      hint="Write true for a desirable completion, false for an undesirable one.")
    out: dict = {}
    if r.has("prompt"):
        out["prompt"] = r.reply("prompt")
    elif r.has("messages"):
        out["messages"] = r.messages("messages")
    out["completion"] = r.reply("completion")
    out["label"] = bool(label)
    return r.tools(out)


def _preference_row(r: _Row, row: dict, purpose: str) -> dict:
    """A ``preference`` row (chosen + rejected, with or without a prompt) as the internal row of
    ``purpose``: a pair, or kind rl's prompt (the chosen reply as its reference)."""
    if purpose == "sft":
        raise _wrong_purpose(r, purpose)
    chosen, rejected = r.reply("chosen"), r.reply("rejected")
    if "prompt" in row:
        out = {"prompt": r.reply("prompt"), "chosen": chosen, "rejected": rejected}
    elif "messages" in row:
        out = {"messages": r.messages("messages"), "chosen": chosen, "rejected": rejected}
    else:  # implicit prompt: what both sides share
        if type(chosen) is not type(rejected):
            raise r.error("'chosen' and 'rejected' must both be strings or both be message lists")
        n = _shared_prefix(chosen, rejected)
        out = {"chosen": chosen[n:], "rejected": rejected[n:]}
        if n:
            out["prompt"] = chosen[:n]
    if purpose == "prompts":
        prompt = out.get("prompt", out.get("messages"))
        if not prompt:
            raise r.error("a preference pair without a prompt (and nothing shared by chosen and rejected) has no prompt for kind rl")
        return _prompt_row(r, prompt, out["chosen"])
    return r.tools(out)


def convert(where: str, row: dict, fmt: str, purpose: str, mapped: dict[str, str] | None = None) -> dict:
    """One row of format ``fmt`` as the internal row of ``purpose``."""
    r = _Row(where, row, fmt, mapped)
    if purpose == "unpaired" and fmt != "unpaired_preference":
        raise _wrong_purpose(r, purpose)
    prompt: str | list[dict] | None  # each format's branch below sets it its own way
    if fmt in ("messages", "sharegpt"):
        if fmt == "sharegpt":
            messages = r.turns("conversations" if "conversations" in row else "messages")
            system = r.text("system", "")
            if system and not (messages and messages[0]["role"] == "system"):
                messages.insert(0, {"role": "system", "content": system})
        else:
            messages = r.messages("messages")
        if purpose == "sft":
            if r.has("chosen") and r.has("rejected"):
                raise _wrong_purpose(r, purpose)
            return r.tools({"messages": messages})
        if purpose == "prompts":
            prompt, reply = _split_reply(messages)
            return _prompt_row(r, prompt, [reply] if reply else None)
        if r.has("chosen") and r.has("rejected"):
            sides = [r.turns(k) if fmt == "sharegpt" and isinstance(r.structured(k), (dict, list)) else r.reply(k)
                     for k in ("chosen", "rejected")]
            return r.tools({"messages": messages, "chosen": sides[0], "rejected": sides[1]})
        raise _wrong_purpose(r, purpose)
    if fmt == "alpaca":
        prompt = _alpaca_prompt(r)
        if purpose == "preference":
            return r.tools({"prompt": prompt, "chosen": r.reply("chosen"), "rejected": r.reply("rejected")})
        if purpose == "prompts":
            return _prompt_row(r, prompt, r.text("output") if r.has("output") else None)
        if r.has("chosen") and r.has("rejected") and not r.has("output"):
            raise _wrong_purpose(r, purpose)
        return r.tools({"messages": prompt + [{"role": "assistant", "content": r.text("output")}]})
    if fmt == "preference":
        return _preference_row(r, row, purpose)
    if fmt == "prompt_completion":
        prompt, completion = r.reply("prompt"), r.reply("completion")
        if purpose == "prompts":
            return _prompt_row(r, prompt, completion)
        if purpose != "sft":
            raise _wrong_purpose(r, purpose)
        if isinstance(prompt, str) and isinstance(completion, str):
            return {"prompt": prompt, "completion": completion}
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        return r.tools({"messages": prompt + completion})
    if fmt == "prompt_only":
        if purpose != "prompts":
            raise _wrong_purpose(r, purpose)
        return _prompt_row(r, r.reply("prompt"), None)
    if fmt == "text":
        if purpose != "sft":
            raise _wrong_purpose(r, purpose)
        text = r.structured("text")
        if isinstance(text, list):  # conversational language modelling: the messages themselves
            return {"messages": r.messages("text")}
        return {"prompt": "", "completion": r.text("text")}
    if fmt == "unpaired_preference":
        row_out = _unpaired_row(r)  # a bad label is named whatever the kind
        if purpose != "unpaired":
            raise _wrong_purpose(r, purpose)
        return row_out
    raise r.error(f"unknown format {fmt!r}")
