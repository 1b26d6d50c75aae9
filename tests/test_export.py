"""`loops checkpoints export` against the real local server: the seeded tiny run's final sampler
checkpoint exported as peft, hf and gguf and each reloaded independently (plain peft,
AutoModelForCausalLM, gguf's reader); SmolLM2 merged and answering like its adapter; bad input
(trainer checkpoint, existing target, unknown format/dtype, missing base, a full disk)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cli_support import TINY, loops, one_line_error, seeded  # noqa: F401  (fixture)

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")

PROBE = [[257, 259, 72, 101, 108, 108, 111, 10]]


@pytest.fixture(scope="module")
def reference(seeded, tmp_path_factory) -> dict:
    """Base + adapter of the seeded run's final sampler checkpoint (downloaded with the CLI)."""
    from baseten_loops_cli.export.writers import load_adapted

    adapter = tmp_path_factory.mktemp("adapter") / "s2"
    got = loops(seeded.server, "checkpoints", "download", f"{seeded.run_id}:s2", "--target", "sampler", "-O", str(adapter))
    assert got.code == 0, got
    model = load_adapted(adapter, TINY)
    merged = load_adapted(adapter, TINY).merge_and_unload()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE)).logits
    return {"adapter": adapter, "logits": logits, "merged": merged.state_dict()}


def export(seeded, *args: str):
    return loops(seeded.server, "checkpoints", "export", f"{seeded.run_id}:s2", "--target", "sampler", *args)


def logits(model) -> "torch.Tensor":
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE)).logits


def test_peft_folder_loads_with_plain_peft(seeded, reference, tmp_path):
    from peft import AutoPeftModelForCausalLM

    out = tmp_path / "peft"
    got = export(seeded, "-O", str(out), "-o", "json")
    assert got.code == 0, got
    doc = got.json()
    assert doc["format"] == "peft" and doc["max_abs_diff"] <= 1e-5 and doc["checkpoint"] == f"{seeded.run_id}:s2"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "base/config.json"} <= set(doc["files"])
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(out / "base")
    model = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
    assert (logits(model) - reference["logits"]).abs().max() <= 1e-5
    card = (out / "README.md").read_text()
    assert TINY in card and seeded.run_id in card and "loops checkpoints export" in card
    assert not list(tmp_path.glob(".*partial"))
    # The folder and its base/ each load with AutoTokenizer (the README's promise for every export).
    assert {"tokenizer.json", "tokenizer_config.json", "base/tokenizer.json", "base/tokenizer_config.json"} <= set(doc["files"])
    assert_tokenizer_is_the_byte_tokenizer(out)
    assert_tokenizer_is_the_byte_tokenizer(out / "base")


def test_hf_merged_folder_matches_base_plus_adapter(seeded, reference, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    got = export(seeded, "-O", str(out), "--merge")
    assert got.code == 0, got
    assert "verified" in got.stderr
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    assert not (out / "adapter_config.json").exists()
    # An export is meant to be shared: the user's umask decides its modes (not 0600/0700).
    import os

    mask = os.umask(0)
    os.umask(mask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
    for path in out.rglob("*"):
        assert (path.stat().st_mode & 0o777) == (0o777 if path.is_dir() else 0o666) & ~mask, path
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert (logits(model) - reference["logits"]).abs().max() <= 1e-4
    assert_tokenizer_is_the_byte_tokenizer(out)
    # An existing target is refused without --force, replaced with it.
    again = export(seeded, "-O", str(out), "--merge")
    one_line_error(again, 2, "already exists", "--force")
    half = export(seeded, "-O", str(out), "--format", "hf", "--dtype", "bfloat16", "--force", "-o", "json")
    assert half.code == 0, half
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert half.json()["max_abs_diff"] < 0.5


def test_gguf_tensors_read_back_as_the_merged_weights(seeded, reference, tmp_path):
    from baseten_loops_cli.export.writers import llama_permute

    out = tmp_path / "gguf"
    got = export(seeded, "-O", str(out), "--format", "gguf", "-o", "json")
    assert got.code == 0, got
    path = Path(got.json()["path"])
    assert path.suffix == ".gguf" and path.parent == out
    reader = gguf.GGUFReader(str(path))
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    merged = reference["merged"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 4)
    assert len(tensors) == len(merged)
    for key, value in merged.items():
        if key.endswith("q_proj.weight"):
            value = llama_permute(value, 4)
        elif key.endswith("k_proj.weight"):
            value = llama_permute(value, 2)
        read = tensors[names.get_name(key, try_suffixes=(".weight",))]
        assert read.shape == value.shape and torch.equal(read, value), key
    # transformers' GGUF loader, an independent reader, gives the same logits.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=path.name, dtype=torch.float32).eval()
    assert (logits(model) - reference["logits"]).abs().max() <= 1e-4
    assert_tokenizer_is_the_byte_tokenizer(out)
    # The file alone carries the tokenizer too (its metadata, as llama.cpp reads it).
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / path.name).write_bytes(path.read_bytes())
    assert_tokenizer_is_the_byte_tokenizer(alone, gguf_file=path.name)


def assert_tokenizer_is_the_byte_tokenizer(folder: Path, **kwargs: str) -> None:
    """The tiny model's export loads with AutoTokenizer, which encodes, decodes and renders chat
    exactly as the built-in byte tokenizer (what `loops sample` uses)."""
    from transformers import AutoTokenizer

    from baseten_loops_cli.tokenization import get_tokenizer, render_chat

    loaded = AutoTokenizer.from_pretrained(str(folder), **kwargs)
    ours = get_tokenizer(TINY)
    for text in ("What is 2+3?", "héllo ✓ <|im_end|>\n  x"):
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == ours.encode(text) and loaded.decode(ids) == text
    chat = [{"role": "user", "content": "What is 2+3?"}]
    rendered = loaded.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert list(rendered) == render_chat(ours, chat, add_generation_prompt=True)[0]


def test_bad_input(seeded, tmp_path):
    trainer = loops(seeded.server, "checkpoints", "export", f"{seeded.run_id}:t1", "-O", str(tmp_path / "x"))
    one_line_error(trainer, 2, "trainer checkpoint", "sampler")
    one_line_error(export(seeded, "-O", str(tmp_path / "x"), "--format", "onnx"), 2, "--format", "peft, hf, gguf")
    one_line_error(export(seeded, "-O", str(tmp_path / "x"), "--dtype", "int4"), 2, "--dtype", "bfloat16")
    one_line_error(export(seeded, "-O", str(tmp_path / "x"), "--format", "peft", "--merge"), 2, "--merge")
    assert not (tmp_path / "x").exists()


def test_missing_base_says_how_to_get_it(tmp_path, monkeypatch):
    from baseten_loops_cli.errors import LoopsError
    from baseten_loops_cli.export import export_adapter

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    monkeypatch.setenv("LOOPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(LoopsError) as err:
        export_adapter(tmp_path / "adapter", "nobody/missing-model", tmp_path / "out", fmt="hf")
    assert "no files for the base model nobody/missing-model" in str(err.value)
    assert "loops server pull-model nobody/missing-model" in (err.value.hint or "")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*partial"))


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (smaller than the tiny model's merged weights)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_leaves_nothing_behind(seeded, tiny_disk):
    got = export(seeded, "-O", str(tiny_disk / "hf"), "--merge")
    one_line_error(got, 1, "filled up")
    assert list(tiny_disk.iterdir()) == []


@pytest.mark.slow
@pytest.mark.required_in_ci
def test_smollm2_merged_answers_like_the_adapter(smollm2_cache, tmp_path, monkeypatch):
    """A small LoRA on SmolLM2 (random, non-zero B, so it changes the answer), merged: the
    merged folder loads with AutoModelForCausalLM and greedily answers the smol-sft prompt with
    the same tokens as base + adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from baseten_loops_cli.export import export_adapter
    from baseten_loops_cli.export.writers import load_adapted, load_base

    monkeypatch.setenv("LOOPS_CACHE_DIR", str(smollm2_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(load_base(name), lora).save_pretrained(tmp_path / "adapter")
    result = export_adapter(tmp_path / "adapter", name, tmp_path / "merged", fmt="hf")
    assert result.max_abs_diff <= 1e-3
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    line = (Path(__file__).parent.parent / "examples" / "data" / "smol_sft_eval.jsonl").read_text().splitlines()[0]
    question = json.loads(line)["messages"][:1]
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    adapted = load_adapted(tmp_path / "adapter", name)
    with torch.no_grad():
        want = adapted.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
        got = merged.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    assert got.tolist() == want.tolist()


def test_gguf_takes_head_dim_from_the_config(tmp_path):
    """A llama-architecture base whose head_dim (32) is not hidden_size / heads (16): the GGUF
    file says 32 for the RoPE dimension and the key/value lengths, and transformers' GGUF loader
    (the export's own verification) rebuilds the same model from it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from baseten_loops_cli.export import export_adapter

    config = LlamaConfig(vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base.save_pretrained(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")
    result = export_adapter(tmp_path / "adapter", str(tmp_path / "base"), tmp_path / "out", fmt="gguf")
    assert result.max_abs_diff <= 1e-4
    fields = gguf.GGUFReader(result.path).fields
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        assert int(fields[key].parts[-1][0]) == 32, key


@pytest.mark.slow
@pytest.mark.required_in_ci
def test_smollm2_peft_export_loads_offline_with_plain_peft(smollm2_cache, tmp_path, monkeypatch):
    """A SmolLM2 adapter's peft export names the base's local folder (model card, result) and,
    with --base-path, writes it into adapter_config.json: plain peft then loads it with the hub
    switched off (HF_HUB_OFFLINE=1), answering as base + adapter."""
    import os
    import sys

    from peft import LoraConfig, get_peft_model

    from baseten_loops_cli.export import export_adapter
    from baseten_loops_cli.export.writers import base_dir, load_base

    monkeypatch.setenv("LOOPS_CACHE_DIR", str(smollm2_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    folder = str(base_dir(name))
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(load_base(name), lora).save_pretrained(tmp_path / "adapter")
    plain = export_adapter(tmp_path / "adapter", name, tmp_path / "plain", fmt="peft")
    assert plain.base_path == folder and folder in (tmp_path / "plain" / "README.md").read_text()
    assert "--base-path" in (tmp_path / "plain" / "README.md").read_text()
    result = export_adapter(tmp_path / "adapter", name, tmp_path / "offline", fmt="peft", base_path=folder)
    assert json.loads((tmp_path / "offline" / "adapter_config.json").read_text())["base_model_name_or_path"] == folder
    script = (
        "import sys, torch\n"
        "from peft import AutoPeftModelForCausalLM\n"
        "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()\n"
        "print(float(m(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.abs().sum()))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-hub")}
    loaded = subprocess.run([sys.executable, "-c", script, str(tmp_path / "offline")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert result.max_abs_diff <= 1e-4
