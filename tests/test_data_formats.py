"""The data format layer (issue 27): every row format and file type of tests/data/formats (written
by make_fixtures.py) is detected from its rows and converted once into the loops' internal rows;
mixtures, hold-outs and column maps; and a few formats train the tiny model end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.config import load_config
from baseten_loops_cli.training.data.formats.dataset import plain_spec, read_rows
from baseten_loops_cli.training.plan import load_data

FORMATS = Path(__file__).resolve().parent / "data" / "formats"
ROOT = Path(__file__).resolve().parents[1]

U = {"role": "user", "content": "What is 0+0?"}
A = {"role": "assistant", "content": "ANSWER: 0"}
SYS = {"role": "system", "content": "Answer as ANSWER: N."}

# (fixture, purpose, what the report says, the first internal row)
CASES = [
    ("messages.jsonl", "sft", "messages, 12 rows", {"messages": [SYS, U, A]}),
    ("messages.jsonl", "prompts", "messages, 12 rows", {"messages": [SYS, U], "answer": "ANSWER: 0"}),
    ("alpaca.json", "sft", "alpaca, 12 rows", {"messages": [U, A]}),
    ("alpaca.tsv", "sft", "alpaca, 12 rows", {"messages": [U, A]}),
    ("alpaca.json", "prompts", "alpaca, 12 rows",
     {"instruction": "What is 0+0?", "input": "", "output": "ANSWER: 0", "messages": [U], "answer": "ANSWER: 0"}),
    ("sharegpt.jsonl", "sft", "sharegpt, 12 rows", {"messages": [SYS, U, A]}),
    ("sharegpt_messages.json", "sft", "sharegpt, 12 rows", {"messages": [U, A]}),
    ("prompt_completion.csv", "sft", "prompt_completion (standard), 12 rows", {"prompt": "What is 0+0?", "completion": " ANSWER: 0"}),
    ("prompt_completion_conversational.arrow", "sft", "prompt_completion (conversational), 12 rows", {"messages": [U, A]}),
    ("text.parquet", "sft", "text (standard), 12 rows", {"prompt": "", "completion": "What is 0+0? ANSWER: 0"}),
    ("folder", "sft", "alpaca, 12 rows", {"messages": [U, A]}),
    ("preference.jsonl", "preference", "preference (standard), 12 rows", {"prompt": "What is 0+0?", "chosen": "ANSWER: 0", "rejected": "0"}),
    ("preference_implicit.jsonl", "preference", "preference (standard), 12 rows",
     {"prompt": "What is 0+0?", "chosen": " ANSWER: 0", "rejected": " 1"}),
    ("preference_conversational.parquet", "preference", "preference (conversational), 12 rows",
     {"prompt": [U], "chosen": [A], "rejected": [{"role": "assistant", "content": "0"}]}),
    ("alpaca_preference.json", "preference", "alpaca, 12 rows", {"prompt": [U], "chosen": "ANSWER: 0", "rejected": "0"}),
    ("sharegpt_preference.jsonl", "preference", "sharegpt, 12 rows",
     {"messages": [U], "chosen": [A], "rejected": [{"role": "assistant", "content": "0"}]}),
    ("unpaired_preference.jsonl", "unpaired", "unpaired_preference (standard), 12 rows",
     {"prompt": "What is 0+0?", "completion": "ANSWER: 0", "label": True}),
    ("unpaired_preference_conversational.parquet", "unpaired", "unpaired_preference (conversational), 12 rows",
     {"prompt": [U], "completion": [A], "label": True}),
    ("prompt_only.csv", "prompts", "prompt_only (standard), 12 rows", {"prompt": "Say a number like 00.", "answer": "00"}),
    ("prompt_only_conversational.jsonl", "prompts", "prompt_only (conversational), 12 rows",
     {"messages": [{"role": "user", "content": "Say a number like 00."}], "answer": "00"}),
]


@pytest.mark.parametrize("name,purpose,report,first", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_fixture_is_detected_and_converted(name, purpose, report, first):
    spec = plain_spec(FORMATS / name)
    rows = list(read_rows(spec, purpose))
    assert len(rows) == 12
    assert rows[0][1] == first
    assert spec.reports == [f"{FORMATS / name}: {report}"]
    where = rows[0][0]
    assert where.startswith(str(FORMATS / name)) and (where.endswith(":1") or where.endswith(":2") or "row 1" in where)


def test_tool_calls_and_tool_roles_are_carried():
    rows = [r for _, r in read_rows(FORMATS / "sharegpt.jsonl", "sft")]
    last = rows[-1]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "tool", "assistant"]
    assert last[1]["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert rows[-1]["tools"] == [{"name": "add"}]
    openai = [r for _, r in read_rows(FORMATS / "messages.jsonl", "sft")][-1]
    assert openai["messages"][1]["tool_calls"][0]["function"]["name"] == "add"
    assert openai["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "3"}


def test_alpaca_input_system_and_history():
    rows = [r for _, r in read_rows(FORMATS / "alpaca.json", "sft")]
    assert rows[1]["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Add the numbers.\n1 and 1"},
                                   {"role": "assistant", "content": "ANSWER: 2"}]
    assert [m["content"] for m in rows[2]["messages"]] == ["What is 1+1?", "ANSWER: 2", "And 2+2?", "ANSWER: 4"]


def test_every_fixture_renders_through_the_loaders():
    """The converted rows are what the loaders take: tokens for every SFT, RL and DPO fixture."""
    from baseten_loops_cli.tokenization import get_tokenizer
    from baseten_loops_cli.training.data import datums as data
    from baseten_loops_cli.training.data.kto_rows import load_kto_examples

    tok = get_tokenizer("loops-local/tiny")
    for name, purpose, _, _ in CASES:
        path = FORMATS / name
        if purpose == "sft":
            assert len(data.load_sft_examples(path, tok, train_on="last_assistant", max_seq_len=256)) == 12
        elif purpose == "prompts":
            assert len(data.load_prompts(path, tok, max_seq_len=256, max_tokens=8)) == 12
        elif purpose == "unpaired":
            assert [e.label for e in load_kto_examples(path, tok, max_seq_len=256)] == [True, False] * 6
        else:
            assert len(data.load_preference_pairs(path, tok, max_seq_len=256)) == 12


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_detection_reads_every_row_not_the_first(tmp_path):
    alpaca = json.dumps({"instruction": "a", "output": "b"})
    sharegpt = json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]})
    # The first row is the odd one out: the file is alpaca, the error names line 1.
    path = _write(tmp_path, "d.jsonl", "\n".join([sharegpt, alpaca, alpaca, alpaca]) + "\n")
    with pytest.raises(ConfigError) as info:
        list(read_rows(path, "sft"))
    assert info.value.message.startswith(f"{path}:1: missing key 'instruction': this row looks like sharegpt")
    assert "3 of the 4 rows" in info.value.message and "data.format" in info.value.hint
    # A ShareGPT file with one stray Alpaca row on line 3.
    path = _write(tmp_path, "e.jsonl", "\n".join([sharegpt, sharegpt, alpaca, sharegpt]) + "\n")
    with pytest.raises(ConfigError, match=r"e.jsonl:3: missing key 'conversations': this row looks like alpaca"):
        list(read_rows(path, "sft"))


SFT_CONFIG = """\
kind: sft
name: t
base_model: loops-local/tiny
max_seq_len: 128
batch_size: 2
seed: 3
data:
"""


def _config(tmp_path: Path, data: str) -> Path:
    return _write(tmp_path, "c.yaml", SFT_CONFIG + "".join(f"  {line}\n" for line in data.strip().splitlines()))


def test_columns_map_and_forced_format(tmp_path):
    path = _config(tmp_path, f"""
train: {FORMATS / 'mapped_columns.parquet'}
columns: {{prompt: question, completion: response}}
""")
    data = load_data(load_config(path, check_files=True))
    assert len(data.train) == 12 and "data.train: prompt_completion (standard), 12 rows" in data.notes[0]
    # A mapped column the file does not have: the file and the column, before any row is read.
    path = _config(tmp_path, f"""
train: {FORMATS / 'mapped_columns.parquet'}
columns: {{prompt: query, completion: response}}
""")
    with pytest.raises(ConfigError) as info:
        load_data(load_config(path))
    assert info.value.message.startswith(f"{FORMATS / 'mapped_columns.parquet'}: no column 'query' (data.columns.prompt)")
    assert "question, response" in info.value.message
    # Forced: text rows read as prompt_completion say which field they lack.
    path = _config(tmp_path, f"""
train: {FORMATS / 'text.parquet'}
format: prompt_completion
""")
    with pytest.raises(ConfigError, match=r"text.parquet: row 1: missing key 'prompt' \(prompt_completion rows have it\)"):
        load_data(load_config(path))


KTO_CONFIG = """\
kind: kto
name: t
base_model: loops-local/tiny
max_seq_len: 128
batch_size: 4
seed: 3
data:
"""


def test_unpaired_rows_read_from_csv_columns_and_parquet_with_a_hold_out(tmp_path):
    """KTO's rows through the data layer: a CSV with its own column names and labels as text,
    a conversational Parquet file, a from_train hold-out; pairs under kind: kto name the fix."""
    path = _write(tmp_path, "k.yaml", KTO_CONFIG + f"""\
  train:
    - path: {FORMATS / 'unpaired_preference_mapped.csv'}
      columns: {{prompt: question, completion: response, label: thumbs_up}}
    - {FORMATS / 'unpaired_preference_conversational.parquet'}
  eval: {{from_train: 4}}
""")
    data = load_data(load_config(path, check_files=True))
    assert (len(data.train), len(data.eval)) == (20, 4)
    assert sum(item.label for item in data.train + data.eval) == 12
    assert not {i.source for i in data.train} & {i.source for i in data.eval}
    notes = "\n".join(data.notes)
    assert "unpaired_preference (standard), 12 rows" in notes and "unpaired_preference (conversational), 12 rows" in notes
    assert "data.eval: 4 rows held out of the training data (seed 3)" in notes
    # The mapped CSV's rows (labels "true"/"false" as text) are the JSONL fixture's rows.
    jsonl = [r for _, r in read_rows(FORMATS / "unpaired_preference.jsonl", "unpaired")]
    by_source = {i.source: i for i in data.train + data.eval}
    csv = [by_source[f"{FORMATS / 'unpaired_preference_mapped.csv'}:{n + 2}"] for n in range(12)]
    assert [i.label for i in csv] == [r["label"] for r in jsonl] == [True, False] * 6
    # Preference pairs under kind: kto: the row, and both kinds in the fix.
    path = _write(tmp_path, "p.yaml", KTO_CONFIG + f"  train: {FORMATS / 'preference.jsonl'}\n")
    with pytest.raises(ConfigError) as info:
        load_data(load_config(path))
    assert info.value.message.startswith(f"{FORMATS / 'preference.jsonl'}:1: a paired row ('chosen'/'rejected') under kind: kto")
    assert "kind: dpo" in info.value.hint and '"label": false' in info.value.hint
    # SFT rows under kind: kto name what KTO needs.
    path = _write(tmp_path, "s.yaml", KTO_CONFIG + f"  train: {FORMATS / 'prompt_completion.csv'}\n")
    with pytest.raises(ConfigError, match=r"prompt_completion.csv:2: prompt_completion rows do not have a 'completion' "
                                          r"and a 'label', which kind kto needs"):
        load_data(load_config(path))


def test_mixture_weights_caps_and_report(tmp_path):
    path = _config(tmp_path, f"""
train:
  - path: {FORMATS / 'alpaca.json'}
    weight: 2
  - path: {FORMATS / 'sharegpt.jsonl'}
    max_rows: 3
  - path: {FORMATS / 'prompt_completion.csv'}
    weight: 0.5
""")
    data = load_data(load_config(path, check_files=True))
    assert len(data.train) == 12 * 2 + 3 + 6
    assert any("sharegpt, 3 of 12 rows" in n for n in data.notes)
    assert any("mixture of 33 rows per epoch" in n and "x2" in n and "x0.5" in n for n in data.notes)
    again = load_data(load_config(path))
    assert [e.tokens for e in again.train] == [e.tokens for e in data.train]  # seeded


def test_mixture_weight_must_be_positive(tmp_path):
    path = _config(tmp_path, f"""
train:
  - path: {FORMATS / 'alpaca.json'}
  - path: {FORMATS / 'sharegpt.jsonl'}
    weight: 0
""")
    with pytest.raises(ConfigError) as info:
        load_data(load_config(path))
    assert info.value.message.startswith(f"{path}:11: data.train.1.weight is 0; a weight must be above 0")
    assert "how often" in info.value.hint


def test_hub_keys_on_a_file_are_refused(tmp_path):
    path = _config(tmp_path, f"""
train:
  - path: {FORMATS / 'alpaca.json'}
    split: test
""")
    with pytest.raises(ConfigError) as info:
        load_data(load_config(path))
    assert info.value.message == f"{path}:10: data.train.0.split is for hub datasets, not a file or folder"


def test_from_train_hold_out_is_seeded_and_disjoint(tmp_path):
    path = _config(tmp_path, f"""
train: {FORMATS / 'alpaca.json'}
eval: {{from_train: 0.25}}
""")
    data = load_data(load_config(path, check_files=True))
    assert (len(data.train), len(data.eval)) == (9, 3)
    assert not {tuple(e.tokens) for e in data.train} & {tuple(e.tokens) for e in data.eval}
    assert any("data.eval: 3 rows held out of the training data (seed 3)" in n for n in data.notes)
    assert [e.source for e in load_data(load_config(path)).eval] == [e.source for e in data.eval]
    path = _config(tmp_path, f"""
train: {FORMATS / 'alpaca.json'}
eval: {{from_train: 12}}
""")
    with pytest.raises(ConfigError) as info:
        load_data(load_config(path))
    assert info.value.message == f"{path}:9: from_train 12 holds out 12 of the 12 training rows, leaving none to train on"


def test_duplicates_between_train_and_eval_are_reported(tmp_path):
    # The same rows in two formats are the same internal rows: alpaca train, sharegpt eval.
    eval_rows = [{"conversations": [{"from": "human", "value": "What is 1+2?"}, {"from": "gpt", "value": "ANSWER: 3"}]},
                 {"conversations": [{"from": "human", "value": "new"}, {"from": "gpt", "value": "row"}]}]
    _write(tmp_path, "eval.jsonl", "".join(json.dumps(r) + "\n" for r in eval_rows))
    path = _config(tmp_path, f"""
train: {FORMATS / 'alpaca.json'}
eval: eval.jsonl
""")
    data = load_data(load_config(path, check_files=True))
    note = next(n for n in data.notes if "also in data.train" in n)
    assert note.startswith(f"data.eval: 1 of 2 rows are also in data.train (first: {tmp_path / 'eval.jsonl'}:1, as {FORMATS / 'alpaca.json'}: row 6)")


def test_bad_rows_name_file_row_and_field(tmp_path):
    path = _write(tmp_path, "s.jsonl", json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}) + "\n")
    with pytest.raises(ConfigError) as info:
        list(read_rows(path, "sft"))
    assert info.value.message == f"{path}:1: conversations[1].from is 'bot', not a ShareGPT role"
    assert "human, gpt" in info.value.hint
    path = _write(tmp_path, "n.csv", "prompt,completion\nWhat is 1+1?,ANSWER: 2\nWrite two lines,first\nsecond\n")
    with pytest.raises(ConfigError) as info:
        list(read_rows(path, "sft"))
    assert info.value.message == f"{path}:4: 1 field where the header has 2"
    assert "double quotes" in info.value.hint
    quoted = _write(tmp_path, "q.csv", 'prompt,completion\n"Write two lines","first\nsecond"\nnext,row\n')
    assert [w for w, _ in read_rows(quoted, "sft")] == [f"{quoted}:2", f"{quoted}:4"]
    path = _write(tmp_path, "x.json", json.dumps({"rows": []}))
    with pytest.raises(ConfigError, match=r'expected a JSON array of rows or \{"data": \[...\]\}'):
        list(read_rows(path, "sft"))


def test_parquet_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ConfigError) as info:
        list(read_rows(FORMATS / "text.parquet", "sft"))
    assert "needs pyarrow" in info.value.message and "[data]" in info.value.hint


def test_ci_installs_the_data_extra():
    """CI installs .[local,dev]: the dev extra carries the [data] extra's packages, so the
    Parquet, Arrow and hub tests here run there instead of failing on an import."""
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(reqs):
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}

    assert names(extras["data"]) <= names(extras["dev"])


def test_jsonl_needs_no_extra():
    """Plain JSONL (and JSON, CSV) never import pyarrow, pandas or datasets."""
    code = ("import sys; from baseten_loops_cli.training.data.formats import read_rows; "
            f"rows = list(read_rows({str(FORMATS / 'messages.jsonl')!r}, 'sft')) + list(read_rows({str(FORMATS / 'alpaca.tsv')!r}, 'sft')); "
            "print(sorted(m for m in ('pyarrow', 'pandas', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"


def _cli(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "HF_"))}
    base.update({"PYTHONPATH": str(ROOT), "LOOPS_CONFIG_DIR": str(tmp_path / "cfg"), "LOOPS_NO_AUTOSTART": "1",
                 "HF_HOME": str(tmp_path / "hf"), "NO_COLOR": "1"})
    base.update(env or {})
    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=base, timeout=120)


def test_hub_sources(tmp_path):
    """A hub name without hub access says so in one line; with the hub offline, ``datasets``
    still loads what it can (here a local folder as the dataset), split and all."""
    path = _config(tmp_path, "train: hf://datasets/no-such-org/no-such-data@main\n")
    out = _cli(["train", "validate", str(path), "--offline"], tmp_path, {"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1, out.stderr
    assert "hf://datasets/no-such-org/no-such-data@main: the Hugging Face hub is unreachable" in out.stderr
    assert "Traceback" not in out.stderr and "pass the file" in out.stderr
    path = _config(tmp_path, f"train:\n  - dataset: {FORMATS / 'folder'}\n    split: train\n")
    out = _cli(["train", "validate", str(path), "--offline", "-o", "json"], tmp_path, {"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)["plan"]
    assert "Generating" not in out.stderr  # no progress bars of datasets' own
    assert plan["examples"] == 12 and any("alpaca, 12 rows" in n for n in plan["notes"])


# ------------------------------------------------------------------ end to end, tiny model
pytest_local = pytest.mark.local


def _train(server, config: Path, run_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "WANDB_"))}
    env.update(server.env)
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "train", "run", str(config), "--run-dir", str(run_dir),
                          "--yes", "-o", "json"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "completed" and state["step"] == 2, state
    return state


@pytest_local
def test_tiny_sft_trains_on_a_mixture_of_formats_and_a_hold_out(local_server, tmp_path):
    """Alpaca JSON + ShareGPT JSONL + Parquet text + CSV prompt/completion, with a from_train eval."""
    pytest.importorskip("torch")
    config = _write(tmp_path, "sft.yaml", f"""\
kind: sft
name: formats-sft
base_model: loops-local/tiny
lora_rank: 4
max_seq_len: 128
batch_size: 4
max_steps: 2
eval_every: 2
data:
  train:
    - {FORMATS / 'alpaca.json'}
    - path: {FORMATS / 'sharegpt.jsonl'}
      max_rows: 4
    - {FORMATS / 'text.parquet'}
    - path: {FORMATS / 'prompt_completion.csv'}
      weight: 0.5
  eval: {{from_train: 0.1}}
""")
    run_dir = tmp_path / "run"
    _train(local_server, config, run_dir)
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert any("eval_loss" in r for r in records)
    saved = (run_dir / "config.yaml").read_text()
    assert str(FORMATS / "alpaca.json") in saved  # paths inside source lists are kept absolute for resume


@pytest_local
def test_tiny_dpo_trains_on_conversational_parquet_preferences(local_server, tmp_path):
    pytest.importorskip("torch")
    config = _write(tmp_path, "dpo.yaml", f"""\
kind: dpo
name: formats-dpo
base_model: loops-local/tiny
lora_rank: 4
max_seq_len: 128
batch_size: 4
max_steps: 2
data:
  train: {FORMATS / 'preference_conversational.parquet'}
""")
    _train(local_server, config, tmp_path / "run")


@pytest_local
def test_tiny_kto_trains_on_mapped_csv_and_parquet_with_a_hold_out(local_server, tmp_path):
    pytest.importorskip("torch")
    config = _write(tmp_path, "kto.yaml", f"""\
kind: kto
name: formats-kto
base_model: loops-local/tiny
lora_rank: 4
max_seq_len: 128
batch_size: 4
max_steps: 2
eval_every: 2
data:
  train:
    - path: {FORMATS / 'unpaired_preference_mapped.csv'}
      columns: {{prompt: question, completion: response, label: thumbs_up}}
    - {FORMATS / 'unpaired_preference_conversational.parquet'}
  eval: {{from_train: 4}}
""")
    run_dir = tmp_path / "run"
    _train(local_server, config, run_dir)
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert any("eval_reward_margin" in r for r in records)


@pytest_local
def test_tiny_rl_trains_on_csv_prompts(local_server, tmp_path):
    pytest.importorskip("torch")
    config = _write(tmp_path, "rl.yaml", f"""\
kind: rl
name: formats-rl
base_model: loops-local/tiny
lora_rank: 4
max_seq_len: 96
group_size: 2
groups_per_batch: 2
max_steps: 2
reward: contains
sampling:
  max_tokens: 4
data:
  prompts: {FORMATS / 'prompt_only.csv'}
""")
    _train(local_server, config, tmp_path / "run")


@pytest_local
def test_tiny_trains_on_every_other_format_and_file_type(local_server, tmp_path):
    """The formats and file types the tests above do not train on, one row each in one epoch (so
    each is trained on: 8 rows, 2 steps of 4): OpenAI messages with a system turn, tool call and tool result (JSONL),
    TRL conversational prompt-completion (Arrow), TRL text (Parquet), a folder of files, Alpaca
    TSV, ShareGPT in JSON ``{"data": [...]}``; then DPO on implicit-prompt preferences."""
    pytest.importorskip("torch")
    lines = (FORMATS / "messages.jsonl").read_text().splitlines()
    assert '"role": "system"' in lines[0] and '"role": "tool"' in lines[-1]
    messages = _write(tmp_path, "messages.jsonl", f"{lines[0]}\n{lines[-1]}\n")  # system turn; tool call + result
    sources = [FORMATS / name for name in ("prompt_completion_conversational.arrow", "text.parquet", "folder",
                                           "alpaca.tsv", "sharegpt_messages.json")]
    listed = f"    - {messages}\n" + "".join(  # 8 rows: two whole batches (a partial last one is dropped)
        f"    - path: {path}\n      max_rows: {2 if path.suffix == '.tsv' else 1}\n" for path in sources)
    config = _write(tmp_path, "sft.yaml", f"""\
kind: sft
name: formats-rest
base_model: loops-local/tiny
lora_rank: 4
max_seq_len: 256
batch_size: 4
max_steps: 2
data:
  train:
{listed}""")
    _train(local_server, config, tmp_path / "sft")
    dpo = _write(tmp_path, "dpo.yaml", f"""\
kind: dpo
name: formats-implicit
base_model: loops-local/tiny
lora_rank: 4
max_seq_len: 128
batch_size: 2
max_steps: 2
data:
  train: {FORMATS / 'preference_implicit.jsonl'}
""")
    _train(local_server, dpo, tmp_path / "dpo")


# ------------------------------------------------------------------ base models as folders
def test_base_model_folder_problems_name_what_is_missing(tmp_path):
    def problem(base_model: str) -> str:
        path = _write(tmp_path, "m.yaml", SFT_CONFIG.replace("loops-local/tiny", base_model) + f"  train: {FORMATS / 'alpaca.json'}\n")
        with pytest.raises(ConfigError) as info:
            load_config(path, check_files=True)
        assert info.value.message.startswith(f"{path}:3: base_model: "), info.value.message
        assert "config.json" in info.value.hint
        return info.value.message

    assert problem("./nope").endswith(f"{tmp_path / 'nope'}: no such folder")
    (tmp_path / "empty").mkdir()
    assert problem("./empty").endswith("has no config.json (not a Hugging Face model folder)")
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    assert problem("./empty").endswith("has no weights (*.safetensors or *.bin)")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    assert problem(str(tmp_path / "empty")).endswith("has no tokenizer.json (the tokenizer)")


@pytest_local
def test_a_merged_export_of_a_tiny_run_trains_again_as_base_model(local_server, tmp_path):
    """`loops checkpoints export --merge` writes a folder; `base_model: ./that-folder` (relative to
    the config) trains on the local backend: the server loads it, the client tokenizes for it."""
    pytest.importorskip("torch")
    config = _write(tmp_path, "sft.yaml", f"""\
kind: sft
name: formats-base
base_model: loops-local/tiny
lora_rank: 4
max_seq_len: 128
batch_size: 4
max_steps: 2
data:
  train: {FORMATS / 'alpaca.json'}
""")
    state = _train(local_server, config, tmp_path / "run1")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "WANDB_"))}
    env.update(local_server.env)
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "checkpoints", "export", f"{state['run_id']}:final",
                          "-O", str(tmp_path / "merged"), "--merge"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    again = _write(tmp_path, "again.yaml", config.read_text().replace("base_model: loops-local/tiny", "base_model: ./merged"))
    _train(local_server, again, tmp_path / "run2")
    saved = (tmp_path / "run2" / "config.yaml").read_text()
    assert f"base_model: {tmp_path / 'merged'}" in saved
    # `loops server models` names that folder (a run used it), next to the built-in models.
    listed = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "server", "models", "-o", "json"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    models = {m["name"]: m for m in json.loads(listed.stdout)}
    assert models["loops-local/tiny"]["max_seq_len"] == 1024 and models["loops-local/tiny"]["ready"] is True
    assert models["loops-local/tiny"]["source"] == "built-in" and models["loops-local/tiny"]["files"] is None
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in models
    folder = models[str(tmp_path / "merged")]
    assert folder["source"] == "local folder" and folder["ready"] is True
    assert folder["files"] == str(tmp_path / "merged") and folder["max_seq_len"] > 0
    table = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "server", "models"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "loops-local/tiny" in table.stdout and "built in code" in table.stdout
