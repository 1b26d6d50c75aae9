"""Chat and prompt/completion rendering with loss weights.

``render_chat`` returns the token ids of a conversation and one weight per token: 1.0 for
the tokens to train on, 0.0 for the rest. What counts as trained depends on ``train_on``:

- ``"last_assistant"``: the content of the last assistant message and its end-of-turn token
- ``"all_assistant"``: the same for every assistant message
- ``"all"``: every token

Two renderers:

- **ChatML** (the built-in template, used for tokenizers without their own, e.g. the byte
  tokenizer of ``loops-local/tiny``): ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, and
  ``<|im_start|>assistant\\n`` as the generation prompt. Built token by token, so the
  weights are exact.
- **The tokenizer's own chat template** (HF tokenizers): the whole conversation is rendered
  to text once with ``apply_chat_template`` and tokenized once, so the ids are exactly what
  the model sees at inference. The trained character ranges come from rendering prefixes:
  assistant message *i* spans from the end of ``render(messages[:i],
  add_generation_prompt=True)`` (its header) to the end of ``render(messages[:i+1])``, cut
  after its last end-of-turn token (so trailing newlines are not trained). Tokens are
  mapped to those ranges with the tokenizer's offset mapping. This needs a template whose
  renderings of prefixes are prefixes of the full rendering; templates that rewrite
  earlier turns (e.g. dropping past reasoning) are rejected with a ValueError.
"""

from __future__ import annotations

from typing import Any, Sequence

TRAIN_ON = ("last_assistant", "all_assistant", "all")

_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"


def _content(message: Any, index: int) -> tuple[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{index}] must be an object with a string 'role'.")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI-style content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ValueError(f"messages[{index}].content parts must all be text parts.")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string.")
    return message["role"], content


def _trained_messages(messages: Sequence[dict], train_on: str) -> set[int]:
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}.")
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if train_on == "last_assistant":
        return set(assistant[-1:])
    return set(assistant)


def render_chat(tokenizer: Any, messages: Sequence[dict], train_on: str = "last_assistant",
                add_generation_prompt: bool = False) -> tuple[list[int], list[float]]:
    """Render ``messages`` to ``(tokens, weights)``; see the module docstring."""
    pairs = [_content(m, i) for i, m in enumerate(messages)]
    trained = _trained_messages(messages, train_on)
    if getattr(tokenizer, "chat_template", None):
        return _render_with_template(tokenizer, messages, trained, train_on == "all",
                                     add_generation_prompt)
    return _render_chatml(tokenizer, pairs, trained, train_on == "all", add_generation_prompt)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tool definitions and tool calls (it names
    ``tools``); the built-in ChatML rendering has no tools."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    return "tools" in template and "tool_calls" in template


def render_generation_prompt(tokenizer: Any, messages: Sequence[dict],
                             tools: list[dict] | None = None,
                             template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt that asks the model for the next assistant turn (serving): the same
    tokens :func:`render_chat` gives for ``add_generation_prompt=True``, without the loss
    mask, so none of its checks (a template rendering prefixes the same way) apply.
    ``tools`` (OpenAI function definitions) go to the template; ``ValueError`` when the
    template has no tools. Content must already be strings (or None beside tool_calls).
    ``template_kwargs``: more template variables (``chat_template_kwargs``; the built-in
    ChatML rendering takes none)."""
    if getattr(tokenizer, "chat_template", None):
        if tools and not template_supports_tools(tokenizer):
            raise ValueError(f"{tokenizer.name}'s chat template has no tools.")
        return tokenizer.encode(tokenizer.apply_chat_template_text(messages, True, tools=tools,
                                                                   **(template_kwargs or {})))
    if tools:
        raise ValueError(f"{tokenizer.name} has no chat template of its own (the built-in "
                         "ChatML rendering has no tools).")
    if template_kwargs:
        raise ValueError(f"{tokenizer.name} has no chat template of its own, so "
                         "chat_template_kwargs have nothing to go to.")
    pairs = [_content(m, i) for i, m in enumerate(messages)]
    return _render_chatml(tokenizer, pairs, set(), False, True)[0]


def _special_id(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise ValueError(f"{tokenizer.name} has no {text} token, which the ChatML template needs.")
    return ids


def _render_chatml(tokenizer: Any, pairs: list[tuple[str, str]], trained: set[int],
                   train_all: bool, add_generation_prompt: bool
                   ) -> tuple[list[int], list[float]]:
    im_start, im_end = _special_id(tokenizer, _IM_START), _special_id(tokenizer, _IM_END)
    newline = tokenizer.encode("\n")
    tokens: list[int] = []
    weights: list[float] = []

    def add(ids: list[int], weight: bool) -> None:
        tokens.extend(ids)
        weights.extend([1.0 if weight or train_all else 0.0] * len(ids))

    for i, (role, content) in enumerate(pairs):
        add(im_start + tokenizer.encode(role) + newline, False)
        add(tokenizer.encode(content) + im_end, i in trained)
        add(newline, False)
    if add_generation_prompt:
        add(im_start + tokenizer.encode("assistant") + newline, False)
    return tokens, weights


def _render_with_template(tokenizer: Any, messages: Sequence[dict], trained: set[int],
                          train_all: bool, add_generation_prompt: bool
                          ) -> tuple[list[int], list[float]]:
    render = tokenizer.apply_chat_template_text
    full = render(messages, add_generation_prompt)
    stop_texts = [tokenizer.decode([t]) for t in tokenizer.stop_token_ids]
    spans: list[tuple[int, int]] = []
    for i in sorted(trained):
        header = render(messages[:i], True)
        through = render(messages[: i + 1], False)
        if not (full.startswith(through) and through.startswith(header)):
            raise ValueError(f"{tokenizer.name}'s chat template does not render message {i} "
                             "the same way in a prefix of the conversation as in the whole, "
                             "so its tokens cannot be located for the loss mask.")
        # End the span after the turn's last end-of-turn marker (drop trailing newlines).
        turn = through[len(header):]
        cut = max((turn.rfind(s) + len(s) for s in stop_texts if s and s in turn), default=-1)
        spans.append((len(header), len(header) + (cut if cut >= 0 else len(turn))))
    tokens, offsets = tokenizer.encode_with_offsets(full)
    if train_all:
        return tokens, [1.0] * len(tokens)
    weights = [1.0 if any(start < end_ and end > start_ for start_, end_ in spans) else 0.0
               for start, end in offsets]
    return tokens, weights


def render_prompt_completion(tokenizer: Any, prompt: str, completion: str,
                             add_eos: bool = True) -> tuple[list[int], list[float]]:
    """``prompt`` (weight 0) followed by ``completion`` (weight 1) and, by default, the eos
    token (weight 1, so the model learns to stop)."""
    prompt_ids = tokenizer.encode(prompt)
    completion_ids = tokenizer.encode(completion)
    if add_eos and tokenizer.eos_token_id is not None:
        completion_ids.append(tokenizer.eos_token_id)
    return prompt_ids + completion_ids, [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
