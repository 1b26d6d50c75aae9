"""The training config and data layer: errors name the file, line and key; nothing needs a server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baseten_loops_cli.errors import ConfigError, UsageError
from baseten_loops_cli.training.config import load_config
from baseten_loops_cli.training.data.datums import batches_for_step, rl_datum, sft_datum, Example
from baseten_loops_cli.training.plan import load_data
from baseten_loops_cli.training.rewards.builtins import RewardError, build_reward, score
from baseten_loops_cli.training.experiments.rundir import RunDir

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

SFT = """\
kind: sft
name: t
base_model: loops-local/tiny
max_seq_len: 64
batch_size: 2
data:
  train: train.jsonl
"""


def write(tmp_path: Path, text: str, rows: list | None = None, name: str = "c.yaml") -> Path:
    if rows is not None:
        (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / name
    path.write_text(text)
    return path


ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ANSWER: 1"}]}


def test_examples_are_valid():
    for name in ("tiny-sft.yaml", "tiny-rl.yaml", "smol-sft.yaml", "smol-rl.yaml"):
        loaded = load_config(EXAMPLES / name)
        if loaded.config.base_model == "loops-local/tiny":
            load_data(loaded)


def test_unknown_key_names_line_and_suggests(tmp_path):
    path = write(tmp_path, SFT + "optimizer:\n  learnin_rate: 0.1\n", [ROW])
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}:9:" in info.value.message
    assert "optimizer.learnin_rate" in info.value.message
    assert "did you mean 'optimizer.learning_rate'" in info.value.message


def test_top_level_typo(tmp_path):
    path = write(tmp_path, SFT + "batchsize: 4\n", [ROW])
    with pytest.raises(ConfigError, match=r":8: unknown key 'batchsize'; did you mean 'batch_size'"):
        load_config(path)


def test_wrong_type_names_key_and_line(tmp_path):
    path = write(tmp_path, SFT.replace("batch_size: 2", "batch_size: many"), [ROW])
    with pytest.raises(ConfigError, match=r"c.yaml:5: batch_size: "):
        load_config(path)


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, SFT + "data: [unclosed\n", [ROW])
    with pytest.raises(ConfigError, match=r"c.yaml:\d+: YAML syntax error"):
        load_config(path)


def test_yaml_syntax_error_names_where_the_broken_construct_starts(tmp_path):
    """PyYAML finds an unclosed [ or quote a line (or many) later: the message also names the
    line where it was opened, and the hint says what to look for."""
    path = write(tmp_path, "kind: sft\nname: [unclosed\nbase_model: loops-local/tiny\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.message.startswith(f"{path}:3: YAML syntax error: ")
    assert "(in the flow sequence that starts at line 2)" in info.value.message
    assert "unclosed bracket or quote" in info.value.hint


def test_duplicate_key_is_an_error_not_a_silent_loss(tmp_path):
    """YAML keeps the last of two equal keys: a second `optimizer:` block would silently drop
    the first one's learning rate. Merge keys (<<) still override as YAML means them to."""
    path = write(tmp_path, SFT + "optimizer:\n  learning_rate: 0.1\noptimizer:\n  warmup_steps: 2\n", [ROW])
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.message == f"{path}:10: duplicate key 'optimizer' (also at line 8)"
    assert "Keep one of them" in info.value.hint
    nested = write(tmp_path, SFT.replace("  train: train.jsonl\n", "  train: train.jsonl\n  train: other.jsonl\n"), [ROW])
    with pytest.raises(ConfigError, match=r"c.yaml:8: duplicate key 'train' \(also at line 7\)"):
        load_config(nested)
    merged = write(tmp_path, "opt: &o\n  learning_rate: 0.1\n  warmup_steps: 1\n" + SFT.replace("max_seq_len: 64\n", "max_seq_len: 64\noptimizer:\n  <<: *o\n  learning_rate: 0.2\n"), [ROW])
    with pytest.raises(ConfigError, match="unknown key 'opt'"):  # the anchor's holder, not a duplicate
        load_config(merged)


def test_set_problems_name_the_set_item_not_the_file(tmp_path):
    """A bad --set value is the command line's, not the file's: the error names the --set item
    (the file's line of that key would point at a value that is fine)."""
    path = write(tmp_path, SFT, [ROW])
    cases = {
        "optimizer.learning_rate=abc": "--set 'optimizer.learning_rate=abc': optimizer.learning_rate: Input should be a valid number",
        "batch_size=-3": "--set 'batch_size=-3': batch_size: Input should be greater than or equal to 1",
        "learnin_rate=1": "--set 'learnin_rate=1': unknown key 'learnin_rate'",
        "optimizer.nope.x=1": "--set 'optimizer.nope.x=1': unknown key 'optimizer.nope'",
        "name.first=1": "--set 'name.first=1': name: Input should be a valid string",
        "kind=ppo": "--set 'kind=ppo': kind must be 'sft', 'rl', 'dpo', 'kto' or 'distill', not 'ppo'",
    }
    for item, message in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config(path, [item])
        assert info.value.message.startswith(message), (item, info.value.message)
        assert str(path) not in info.value.message, item
        assert info.value.hint, item
    with pytest.raises(ConfigError) as info:
        load_config(path, ["data.train=nope.jsonl"], check_files=True)
    assert info.value.message.startswith("--set 'data.train=nope.jsonl': data.train: ")
    assert info.value.message.endswith("nope.jsonl: data file not found")
    # A problem of the file itself still names the file and line, next to the --set one.
    bad = write(tmp_path, SFT.replace("batch_size: 2", "batch_size: many"), [ROW])
    with pytest.raises(ConfigError) as info:
        load_config(bad, ["lora_rank=0"])
    assert f"{bad}:5: batch_size:" in info.value.message
    assert "--set 'lora_rank=0': lora_rank:" in info.value.message


def test_data_path_that_is_a_folder(tmp_path):
    """A folder of data files is a source (issue 27); one with none in it is an error at the key."""
    (tmp_path / "train.jsonl").mkdir()
    path = write(tmp_path, SFT)
    with pytest.raises(ConfigError) as info:
        load_config(path, check_files=True)
    assert info.value.message == f"{path}:7: data.train: {tmp_path / 'train.jsonl'} is a folder with no data files"
    assert ".parquet" in info.value.hint
    with pytest.raises(ConfigError) as info:
        load_data(load_config(path))
    assert info.value.message == f"{tmp_path / 'train.jsonl'} is a folder with no data files"
    (tmp_path / "train.jsonl" / "part-1.jsonl").write_text(json.dumps(ROW) + "\n")
    assert len(load_data(load_config(path, check_files=True)).train) == 1


def test_missing_and_bad_kind(tmp_path):
    with pytest.raises(ConfigError, match="missing required key 'kind'"):
        load_config(write(tmp_path, "name: x\n"))
    with pytest.raises(ConfigError, match=r"c.yaml:1: kind must be 'sft', 'rl', 'dpo', 'kto' or 'distill'"):
        load_config(write(tmp_path, "kind: ppo\nname: x\n"))
    with pytest.raises(ConfigError, match="missing required key 'base_model'"):
        load_config(write(tmp_path, "kind: sft\nname: x\ndata: {train: a}\n"))


def test_set_overrides_any_field(tmp_path):
    path = write(tmp_path, SFT, [ROW])
    loaded = load_config(path, ["optimizer.learning_rate=0.5", "batch_size=4", "data.shuffle=false"])
    assert loaded.config.optimizer.learning_rate == 0.5
    assert loaded.config.batch_size == 4
    assert loaded.config.data.shuffle is False
    with pytest.raises(UsageError, match="key.path=value"):
        load_config(path, ["batch_size"])
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        load_config(path, ["bogus=1"])


def test_data_row_errors_name_the_line(tmp_path):
    path = write(tmp_path, SFT, [ROW])
    with (tmp_path / "train.jsonl").open("a") as fh:
        fh.write("{not json\n")
    with pytest.raises(ConfigError, match=r"train.jsonl:2: not valid JSON") as info:
        load_data(load_config(path))
    assert info.value.hint.startswith("Fix or delete line 2: ")
    (tmp_path / "train.jsonl").write_text(json.dumps(ROW) + "\n" + json.dumps({"text": "x"}) + "\n")
    # A row of another format in a file of messages rows (issue 27: detected from every row).
    with pytest.raises(ConfigError, match=r"train.jsonl:2: missing key 'messages': this row looks like text") as info:
        load_data(load_config(path))
    assert "data.format" in info.value.hint
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"train.jsonl: no examples \(the file is empty\)") as info:
        load_data(load_config(path))
    assert "at least one row" in info.value.hint


def test_over_long_example_says_how_long_and_what_to_change(tmp_path):
    long_row = {"prompt": "x" * 100, "completion": "y"}
    path = write(tmp_path, SFT, [ROW, long_row])
    with pytest.raises(ConfigError) as info:
        load_data(load_config(path))
    assert "train.jsonl:2" in info.value.message and "over max_seq_len 64" in info.value.message
    assert "Raise max_seq_len" in info.value.hint


def test_missing_data_file(tmp_path):
    path = write(tmp_path, SFT)
    with pytest.raises(ConfigError, match="train.jsonl: data file not found"):
        load_data(load_config(path))


def test_validate_lists_every_problem_in_line_order(tmp_path):
    """One run of validate shows everything to fix: each with file, line, key and a fix, in line
    order; a missing data file at the line of its key; the count is right."""
    from baseten_loops_cli.training.config import ConfigProblems

    text = (
        "kind: sft\nname: x\nbase_model: loops-local/tiny\nbatch_size: -3\n"
        "optimizer:\n  lerning_rate: 1e-3\n  warmup_steps: -1\n"
        "data:\n  train: nope.jsonl\n  shufle: true\nloging:\n  run_dir: x\n"
    )
    path = write(tmp_path, text)
    with pytest.raises(ConfigProblems) as info:
        load_config(path, check_files=True)
    problems = info.value.problems
    assert [p.line for p in problems] == [4, 6, 7, 9, 10, 11]
    assert [p.key for p in problems] == [
        "batch_size", "optimizer.lerning_rate", "optimizer.warmup_steps", "data.train", "data.shufle", "loging",
    ]
    assert all(p.fix for p in problems)
    message = info.value.message
    assert message.splitlines()[0] == f"{path}: 6 problems"
    assert len(message.splitlines()) == 7
    assert f"{path}:9: data.train:" in message and "data file not found" in message
    assert "did you mean 'optimizer.learning_rate'" in message and "more problem" not in message


def test_validate_lists_every_problem_through_the_cli(tmp_path):
    import os
    import subprocess
    import sys

    path = write(tmp_path, "kind: rl\nname: x\nbase_model: loops-local/tiny\ngroup_size: 1\n"
                           "data:\n  prompts: missing.jsonl\nrewrd: exact_match\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPS_")}
    env.update(LOOPS_NO_AUTOSTART="1", NO_COLOR="1", LOOPS_CONFIG_DIR=str(tmp_path / "cfg"),
               PYTHONPATH=str(EXAMPLES.parent))
    proc = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "train", "validate", str(path), "--offline"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == f"Error: {path}: 4 problems", proc.stderr
    listed = [line.strip().split(": ")[0] for line in lines[1:5]]
    # The missing 'reward' has no line (it is not there): it comes first, then lines 4, 6, 7.
    assert listed == [str(path), f"{path}:4", f"{path}:6", f"{path}:7"], proc.stderr
    assert "missing required key 'reward'" in lines[1] and "data file not found" in lines[3]
    assert "did you mean 'reward'" in lines[4]


def test_sft_datum_shifts_by_one():
    datum = sft_datum(Example([1, 2, 3, 4], [0, 0, 1, 1], "x"))
    assert datum["model_input"]["chunks"][0]["tokens"] == [1, 2, 3]
    assert datum["loss_fn_inputs"]["target_tokens"]["data"] == [2, 3, 4]
    assert datum["loss_fn_inputs"]["weights"]["data"] == [0, 1, 1]


def test_rl_datum_puts_advantage_on_completion_only():
    datum = rl_datum([1, 2, 3], [7, 8], [-0.5, -0.25], 0.75)
    inputs = datum["loss_fn_inputs"]
    assert datum["model_input"]["chunks"][0]["tokens"] == [1, 2, 3, 7]
    assert inputs["target_tokens"]["data"] == [2, 3, 7, 8]
    assert inputs["logprobs"]["data"] == [0.0, 0.0, -0.5, -0.25]
    assert inputs["advantages"]["data"] == [0.0, 0.0, 0.75, 0.75]
    assert inputs["mask"]["data"] == [0.0, 0.0, 1.0, 1.0]


def test_batches_are_a_pure_function_of_seed_and_step():
    first = [batches_for_step(10, 3, s, seed=1, shuffle=True) for s in range(6)]
    again = [batches_for_step(10, 3, s, seed=1, shuffle=True) for s in range(6)]
    assert first == again
    assert sorted(sum(first[:3], [])) == sorted(set(sum(first[:3], [])))  # no repeats in an epoch
    assert first[0] != batches_for_step(10, 3, 0, seed=2, shuffle=True)


class _Spec:
    def __init__(self, fn, **kw):
        self.fn, self.pattern, self.case_sensitive, self.partial_credit = fn, kw.get("pattern"), False, kw.get("partial", False)


def test_builtin_rewards(tmp_path):
    row = {"answer": "42"}
    assert build_reward(_Spec("exact_match"), tmp_path)[1](" 42 ", row) == 1.0
    assert build_reward(_Spec("numeric_match"), tmp_path)[1]("it is 42.", row) == 1.0
    assert build_reward(_Spec("contains"), tmp_path)[1]("x42y", row) == 1.0
    assert build_reward(_Spec("regex", pattern=r"^\d+$"), tmp_path)[1]("42", row) == 1.0
    assert build_reward(_Spec("starts_with", partial=True), tmp_path)[1]("4x", row) == 0.5
    with pytest.raises(ConfigError, match="did you mean 'exact_match'"):
        build_reward(_Spec("exact_mach"), tmp_path)


def test_file_reward_and_its_failures(tmp_path):
    (tmp_path / "r.py").write_text("def good(c, row):\n    return len(c)\ndef bad(c, row):\n    raise KeyError('x')\ndef nan(c, row):\n    return 'high'\n")
    name, fn = build_reward(_Spec("r.py:good"), tmp_path)
    assert score(name, fn, "abc", {}, "p.jsonl:1") == 3.0
    name, fn = build_reward(_Spec("r.py:bad"), tmp_path)
    with pytest.raises(RewardError, match=r"reward 'r.py:bad' raised KeyError.*p.jsonl:3"):
        score(name, fn, "abc", {}, "p.jsonl:3")
    name, fn = build_reward(_Spec("r.py:nan"), tmp_path)
    with pytest.raises(RewardError, match="returned 'high', not a finite number"):
        score(name, fn, "abc", {}, "p.jsonl:1")
    with pytest.raises(ConfigError, match="not found"):
        build_reward(_Spec("missing.py:f"), tmp_path)
    with pytest.raises(ConfigError, match="no function 'nope'"):
        build_reward(_Spec("r.py:nope"), tmp_path)


def test_rundir_resume_trims_metrics_after_last_checkpoint(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create({"kind": "sft"}, tmp_path / "c.yaml")
    for step in range(1, 8):
        rundir.append_metrics({"step": step, "loss": 1.0 / step})
    rundir.append_checkpoint({"step": 4, "name": "step-4", "path": "bt://loops:r/weights/step-4"})
    with rundir.metrics_file.open("a") as fh:
        fh.write('{"step": 8, "lo')  # a kill mid-write
    assert [r["step"] for r in rundir.metrics()] == list(range(1, 8))
    rundir.trim_after(rundir.last_checkpoint()["step"])
    assert [r["step"] for r in rundir.metrics()] == [1, 2, 3, 4]


def test_kl_penalty_shapes_per_token_advantages():
    from baseten_loops_cli.training.data.datums import Prompt
    from baseten_loops_cli.training.kinds.rl import _datums
    from baseten_loops_cli.training.kinds.rl_rollouts import Rollout

    prompt = Prompt([1, 2], {}, "p:1")
    group = [
        Rollout(prompt, [5, 6], [-1.0, -2.0], "a", 1.0, "length", base_logprobs=[-1.5, -2.0]),
        Rollout(prompt, [7, 8], [-1.0, -1.0], "b", 0.0, "length", base_logprobs=[-1.0, -1.0]),
    ]
    datums, kept, kl = _datums([group], kl_coef=0.5)
    assert kept == 1 and kl == pytest.approx(0.125)
    adv = datums[0]["loss_fn_inputs"]["advantages"]["data"]
    assert adv == pytest.approx([0.0, 0.5 - 0.5 * 0.5, 0.5])
    datums, kept, kl = _datums([group])
    assert kl is None and datums[0]["loss_fn_inputs"]["advantages"]["data"] == pytest.approx([0.0, 0.5, 0.5])


def test_builtin_reward_needs_answer_field_named_by_line(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    path = tmp_path / "rl.yaml"
    path.write_text("kind: rl\nname: r\nbase_model: loops-local/tiny\nmax_seq_len: 128\n"
                    "data: {prompts: p.jsonl}\nreward: exact_match\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:2: reward 'exact_match' needs an 'answer' field"):
        load_data(load_config(path))


def test_example_number_answer_reward_gives_partial_credit():
    name, fn = build_reward(_Spec("rewards.py:number_answer"), EXAMPLES)
    row = {"answer": "7"}
    assert [fn(c, row) for c in ("7", "3 + 4 = 7", "12", "seven")] == [1.0, 0.5, 0.2, 0.0]


def test_max_seq_len_defaults_to_the_smaller_of_2048_and_the_models_limit(tmp_path):
    """Issue 42: a config without max_seq_len on loops-local/tiny (limit 1024) gets 1024, not a
    2048 the model refuses; one that sets it keeps its value."""
    from baseten_loops_cli.training.config import default_max_seq_len

    assert default_max_seq_len("loops-local/tiny") == 1024
    assert default_max_seq_len("no-such-org/no-such-model") == 2048  # limit unknown here: the backend's check lowers it
    path = write(tmp_path, SFT.replace("max_seq_len: 64\n", ""), [ROW])
    loaded = load_config(path)
    assert loaded.config.max_seq_len == 1024 and "max_seq_len" not in loaded.raw
    assert load_config(path, ["max_seq_len=512"]).config.max_seq_len == 512


def test_set_paths_are_relative_to_the_current_directory(tmp_path, monkeypatch):
    """Issue 42: `--set data.train=../x.jsonl` is a path typed in a shell (relative to the
    current directory); the paths written in the file stay relative to the file."""
    conf, work = tmp_path / "conf", tmp_path / "work"
    conf.mkdir()
    work.mkdir()
    (conf / "train.jsonl").write_text(json.dumps(ROW) + "\n")
    other = {"messages": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "ANSWER: 2"}]}
    (tmp_path / "x.jsonl").write_text(json.dumps(other) + "\n" + json.dumps(ROW) + "\n")
    path = write(conf, SFT)
    monkeypatch.chdir(work)
    in_file = load_data(load_config(path, check_files=True))
    assert len(in_file.train) == 1  # conf/train.jsonl, beside the config
    loaded = load_config(path, ["data.train=../x.jsonl"], check_files=True)
    assert loaded.config.data.train == str(tmp_path / "x.jsonl")
    assert len(load_data(loaded).train) == 2
    with pytest.raises(ConfigError) as info:  # relative to work/, where there is no x.jsonl
        load_config(path, ["data.train=x.jsonl"], check_files=True)
    assert str(work / "x.jsonl") in info.value.message and "data file not found" in info.value.message


def test_every_refused_row_is_listed(tmp_path):
    """Issue 42: three over-length rows and a bad role show four lines, not the first one."""
    long_row = {"prompt": "x" * 100, "completion": "y"}
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "y"}]}
    path = write(tmp_path, SFT, [ROW, long_row, long_row, bad_role, long_row])
    with pytest.raises(ConfigError) as info:
        load_data(load_config(path))
    lines = info.value.message.splitlines()
    assert lines[0] == "4 rows refused:"
    assert [line.split(": ")[0].rsplit("/", 1)[-1] for line in lines[1:]] == [
        "train.jsonl:2", "train.jsonl:3", "train.jsonl:4", "train.jsonl:5"]
    assert "has role 'wizard'" in lines[3] and "over max_seq_len 64" in lines[4]
    many = write(tmp_path, SFT, [ROW] + [long_row] * 8)
    with pytest.raises(ConfigError) as info:
        load_data(load_config(many))
    lines = info.value.message.splitlines()
    assert lines[0] == "8 rows refused:" and lines[-1] == "  ... and 3 more" and len(lines) == 7
