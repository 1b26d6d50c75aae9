"""A model's tokenizer from its files, without torch or transformers: ``tokenizer.json`` with
the ``tokenizers`` package, the chat template with jinja2.

The template is rendered in the environment ``transformers``' ``apply_chat_template`` uses
(sandboxed, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that keeps
non-ASCII, ``raise_exception``, ``strftime_now``, the ``{% generation %}`` tag, the special
tokens as variables), so the text and therefore the token ids are the same
(tests/test_tokenization.py compares them with transformers on SmolLM2).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

# Turn-ending tokens of common chat templates; whichever the vocabulary has are stop tokens.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _clean_up_spaces(text: str) -> str:
    # What transformers' ``clean_up_tokenization_spaces=True`` does on decode.
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text


class FileTokenizer:
    """A ``tokenizers.Tokenizer`` plus the model's special tokens and chat template."""

    def __init__(self, name: str, raw: Any, config: dict[str, Any],
                 chat_template: str | None) -> None:
        self.name = name
        self.raw = raw
        self.chat_template = chat_template
        self.special_tokens = {key: text for key in _SPECIAL_KEYS
                               if (text := _token_text(config.get(key))) is not None}
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self.vocab_size: int = raw.get_vocab_size(with_added_tokens=True)
        ids = {key: raw.token_to_id(text) for key, text in self.special_tokens.items()}
        self.eos_token_id: int | None = ids.get("eos_token")
        self.bos_token_id: int | None = ids.get("bos_token")
        pad = ids.get("pad_token")
        self.pad_token_id: int | None = pad if pad is not None else self.eos_token_id
        stops = {self.eos_token_id} if self.eos_token_id is not None else set()
        stops.update(i for tok in _TURN_END_TOKENS if (i := raw.token_to_id(tok)) is not None)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

    def encode(self, text: str) -> list[int]:
        return list(self.raw.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in ``text``."""
        enc = self.raw.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(span) for span in enc.offsets]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # Ids the vocabulary does not know decode to U+FFFD instead of raising.
        out: list[str] = []
        run: list[int] = []
        for token in map(int, ids):
            if 0 <= token < self.vocab_size:
                run.append(token)
                continue
            out.append(self._decode(run, skip_special_tokens))
            out.append("\ufffd")
            run = []
        out.append(self._decode(run, skip_special_tokens))
        return "".join(out)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if not ids:
            return ""
        text = self.raw.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def apply_chat_template_text(self, messages: Sequence[dict], add_generation_prompt: bool,
                                 tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """``template_kwargs``: more variables for the template (a request's
        ``chat_template_kwargs``, e.g. ``enable_thinking``)."""
        if not self.chat_template:
            raise ValueError(f"{self.name} has no chat template.")
        template = compile_chat_template(self.chat_template)
        return template.render(messages=[dict(m) for m in messages], tools=tools,
                               documents=None, add_generation_prompt=add_generation_prompt,
                               **{**self.special_tokens, **template_kwargs})

    def __repr__(self) -> str:
        return f"FileTokenizer({self.name!r}, vocab_size={self.vocab_size})"


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> Any:
    """A chat template compiled in transformers' ``apply_chat_template`` environment."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for
        transformers' assistant masks; for rendering it is just its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def load_file_tokenizer(name: str, directory: Path) -> FileTokenizer:
    """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``)."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    template = config.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():  # where newer transformers save it
        template = template_file.read_text(encoding="utf-8")
    elif isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"),
                        None)
    return FileTokenizer(name, raw, config, template if isinstance(template, str) else None)


__all__ = ["FileTokenizer", "compile_chat_template", "load_file_tokenizer"]
