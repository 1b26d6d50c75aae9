"""`loops models` against a real local server: the catalog (built-in models, and a local folder
once a run used it) in the table and as JSON, one model by name, the use-case filter, bad
input, and TAB completion of model names (`loops models`, `runs create --base-model`) from the
completion cache."""

from __future__ import annotations

import pytest

from tests.cli_support import TINY, api, loops, one_line_error
from tests.test_cli_runs import _complete

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of its own: a run here adds a local folder to the catalog."""
    from tests.conftest import LocalServer

    server = LocalServer(tmp_path_factory.mktemp("models-server")).start()
    yield server
    server.stop()


def llama_folder(path):
    """A small random Llama as a Hugging Face folder (config.json is what the catalog reads)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=261, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
                     ).save_pretrained(path)
    return path


def test_models_lists_the_catalog_as_table_and_json(server, tmp_path, monkeypatch):
    got = loops(server, "models", "-o", "json")
    assert got.code == 0, got
    rows = {r["model"]: r for r in got.json()}
    assert rows[TINY] == {"model": TINY, "max_seq_len": 1024, "use_cases": ["sft", "rl"], "enabled": True,
                          "not_enabled_reason": None, "serverless": False, "supports_vision_language": False,
                          "source": "built-in", "ready": True, "description": rows[TINY]["description"]}
    assert rows[SMOLLM2]["max_seq_len"] == 8192 and rows[SMOLLM2]["source"] == "built-in"
    table = loops(server, "models")
    assert table.code == 0, table
    header, *lines = table.stdout.splitlines()
    assert header.split() == ["MODEL", "MAX", "SEQ", "LEN", "USE", "CASES", "ENABLED", "SOURCE", "READY"]
    tiny = next(line for line in lines if line.startswith(TINY))
    assert tiny.split() == [TINY, "1,024", "sft,", "rl", "yes", "built-in", "yes"]

    # A local folder: offered when named, and listed once a run used it.
    folder = str(llama_folder(tmp_path / "llama"))
    named = loops(server, "models", folder, "-o", "json")
    assert named.code == 0, named
    assert [(r["model"], r["max_seq_len"], r["source"], r["ready"]) for r in named.json()] == [
        (folder, 512, "local folder", True)]
    assert folder not in {r["model"] for r in loops(server, "models", "-o", "json").json()}
    with monkeypatch.context() as here:  # a relative path names the folder here, not in the server's cwd
        here.chdir(tmp_path)
        relative = loops(server, "models", "./llama", "-o", "json")
    assert [r["model"] for r in relative.json()] == [folder], relative
    session = api(server, "POST", "/v1/loops/sessions", json={})["session"]["id"]
    api(server, "POST", "/v1/loops/runs", json={"session_id": session, "base_model": folder, "lora_rank": 4})
    listed = loops(server, "models", "--use-case", "rl", "-o", "json").json()
    assert [r["model"] for r in listed][:2] == [TINY, SMOLLM2] and listed[-1]["model"] == folder
    assert all(r["use_cases"] == ["rl"] for r in listed)

    # Unknown names list nothing; a bad use case is a one-line usage error.
    nothing = loops(server, "models", "nobody/none")
    assert nothing.code == 0 and "offers no model 'nobody/none'" in nothing.stderr + nothing.stdout
    one_line_error(loops(server, "models", "--use-case", "dpo"), 2, "--use-case", "sft or rl")


def test_model_names_complete_from_the_catalog(server, tmp_path, monkeypatch):
    from baseten_loops_cli.cli import _complete as comp

    extra = {"LOOPS_CACHE_DIR": str(tmp_path / "cache")}
    monkeypatch.setenv("LOOPS_CACHE_DIR", str(tmp_path / "cache"))
    # The server's first catalog loads its engine (seconds): past a TAB's budget, which then
    # answers nothing and leaves the fetch to a background refresher. Loaded, a TAB asks it.
    assert loops(server, "models").code == 0
    assert _complete(server, "loops models loops-l", extra_env=extra) == [TINY]
    assert (tmp_path / "cache" / comp.CACHE_FILE).is_file()

    def boom(*_a, **_k):
        raise AssertionError("the network was asked")

    # Served from the cache while fresh; zsh shows each name's max sequence length and use cases.
    monkeypatch.setitem(comp.FETCHERS, "models", boom)
    assert _complete(server, "loops runs create --base-model Hug", extra_env=extra) == [SMOLLM2]
    zsh = _complete_lines(server, "loops models loops-l", extra)
    assert len(zsh) == 1 and f'"{TINY}":"1,024 tokens · sft, rl"' in zsh[0], zsh


def _complete_lines(server, words: str, extra: dict) -> list[str]:
    from typer.testing import CliRunner

    from baseten_loops_cli.cli.main import app
    from tests.cli_support import cli_env

    env = {k: (v or None) for k, v in cli_env(server).items()}
    env.update({"_LOOPS_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": words, **extra})
    result = CliRunner().invoke(app, [], env=env, prog_name="loops")
    return [line for line in result.stdout.splitlines() if line]
