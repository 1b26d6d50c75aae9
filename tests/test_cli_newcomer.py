"""What a new user tripped on (issue 42, point 9), each pinned by a test:

- `loops --help`, `loops train --help` and `loops data check --help` name every training kind
  (from the registry, without importing a kind or pydantic/yaml/torch/httpx);
- a bad `--set` value is a usage error (exit 2), like any bad flag;
- `loops reward test` prints the traceback its hint promises;
- `export --base-path` does not suggest passing `--base-path` again;
- the terminal plot's legend sits outside the plot area (it hid curves inside it).

`loops deploy <TAB>` offering RUN:NAME is in tests/test_shell.py (it needs bash), the deploy
section's `--jq` line in tests/test_readme.py (it runs the documented lines).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli_support import loops, one_line_error, seeded  # noqa: F401  (fixture)
from tests.support import ROOT

KINDS = ("sft", "rl", "dpo", "kto", "distill")


def _help(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args, "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("command", [[], ["train"], ["data", "check"], ["train", "init"]])
def test_help_names_every_kind(command):
    from baseten_loops_cli.training.kinds import names

    assert set(KINDS) <= set(names())  # the registry's names are the ones the help shows
    text = _help(*command)
    listed = ", ".join(names()[:-1]) + f" or {names()[-1]}"
    assert listed in " ".join(text.replace("│", " ").split()), text


def test_root_help_imports_no_kind_and_nothing_heavy():
    probe = ("import sys\nsys.argv = ['loops', '--help']\nfrom baseten_loops_cli.cli.main import main\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "heavy = [m for m, mod in sys.modules.items() if mod is not None and m.split('.')[0] in ('pydantic', 'yaml', 'torch', 'httpx')"
             " or m.startswith('baseten_loops_cli.training.kinds.')]\nprint('HEAVY', heavy, file=sys.stderr)\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in result.stderr, result.stderr[-2000:]
    assert "distill" in result.stdout


@pytest.mark.parametrize("item, needle", [
    ("lora_rank=abc", "valid integer"),
    ("optimizer.learnin_rate=0.1", "did you mean 'optimizer.learning_rate'"),
    ("kind=xx", "kind must be"),
])
def test_a_bad_set_value_is_a_usage_error(tmp_path, item, needle):
    result = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "train", "validate", str(ROOT / "examples" / "tiny-sft.yaml"),
                             "--offline", "--set", item], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert f"Error: --set {item!r}" in result.stderr and needle in result.stderr and "Traceback" not in result.stderr


def test_a_bad_value_in_the_file_stays_exit_1(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text((ROOT / "examples" / "tiny-sft.yaml").read_text().replace("name: tiny-sft", "name: tiny-sft\nlora_rank: abc"))
    (tmp_path / "data").symlink_to(ROOT / "examples" / "data")
    result = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "train", "validate", str(config), "--offline",
                             "--set", "seed=1"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "lora_rank" in result.stderr


def test_reward_test_prints_the_traceback_its_hint_promises(local_server, tmp_path):
    from tests.test_training_envs import faulty_config

    bad = loops(local_server, "reward", "test", str(faulty_config(tmp_path, max_failed_fraction=0.5)), "--rows", "1")
    one_line_error(bad, 1, "1 of 1 rows failed", "traceback is printed above")
    assert "Traceback (most recent call last)" in bad.stdout, bad.stdout
    failed_at = bad.stdout.index("FAILED:")
    assert bad.stdout.index("ZeroDivisionError", failed_at) > failed_at  # under its FAILED line


def test_export_with_base_path_does_not_suggest_base_path(seeded, tmp_path):
    pytest.importorskip("peft")
    first = loops(seeded.server, "checkpoints", "export", f"{seeded.run_id}:s2", "--target", "sampler", "-O", str(tmp_path / "a"))
    assert first.code == 0, first
    assert "pass --base-path" in first.stderr  # not named yet: the hint is right here
    named = loops(seeded.server, "checkpoints", "export", f"{seeded.run_id}:s2", "--target", "sampler",
                  "-O", str(tmp_path / "b"), "--base-path", str(tmp_path / "a" / "base"))
    assert named.code == 0, named
    assert "pass --base-path" not in named.stderr and "named in adapter_config.json" in named.stderr, named.stderr


def test_model_card_of_a_base_path_export_does_not_suggest_base_path():
    from baseten_loops_cli.export.writers import model_card

    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    plain = model_card("peft", "float32", hub, {"base_path": "/m/smol"}, 0.0)
    assert "--base-path BASE_FOLDER" in plain
    named = model_card("peft", "float32", hub, {"base_path": "/m/smol", "named_base": "/m/smol"}, 0.0)
    assert "/m/smol" in named and "export with `--base-path" not in named


def test_plot_legend_is_outside_the_plot_area():
    """A flat curve along the top right (where the legend was drawn) is fully visible: every
    step of both runs has its marker inside the frame, and the labels appear only outside it."""
    from baseten_loops_cli.training.experiments.plot import plot_terminal

    runs = {"runs/flat-a": [{"step": s, "loss": 5.0} for s in range(1, 61)],
            "runs/fall-b": [{"step": s, "loss": 5.0 / s} for s in range(1, 61)]}
    text = plot_terminal(runs, ["loss"], width=72, height=16)
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if "┌" in line)  # the frame (the header lines come first)
    bottom = next(i for i, line in enumerate(lines) if i > top and "└" in line and "┬" in line)
    plot_area = lines[top + 1:bottom]
    assert not any("flat-a" in line or "fall-b" in line for line in plot_area), "\n".join(plot_area)
    flat_row = next(line for line in plot_area if "┤" in line)  # the top row: loss 5.0
    assert flat_row.count("•") >= 55, flat_row  # nothing covers the flat curve (60 steps on 66 columns)
    legend = "\n".join(lines[bottom + 1:])
    assert "│ • flat-a │ x fall-b │" in legend


def _plan_under_load(server, monkeypatch, load: float, cores: int):
    from baseten_loops_cli.training import calibration

    monkeypatch.setattr(calibration, "machine_load", lambda: (load, cores))  # a load figure, not spinning CPUs
    config = str(ROOT / "examples" / "tiny-sft.yaml")
    return loops(server, "train", "validate", config, "-o", "json"), loops(server, "train", "validate", config)


def test_the_plan_gives_a_range_on_a_busy_machine(local_server, monkeypatch):
    as_json, text = _plan_under_load(local_server, monkeypatch, load=10.0, cores=2)
    assert as_json.code == 0 and text.code == 0, (as_json, text)
    plan = as_json.json()["plan"]
    low, high = plan["estimated_seconds_range"]
    assert low == plan["estimated_seconds"] and high == pytest.approx(6.0 * low)  # (2 + 10) / 2
    assert any("busy (load average 10.0 on 2 cores)" in note and "6.0x" in note for note in plan["notes"])
    line = next(ln for ln in text.stdout.splitlines() + text.stderr.splitlines() if "estimated time:" in ln)
    assert "-" in line.split("estimated time:")[1] and "busy machine" in line, line


def test_the_plan_gives_one_figure_on_an_idle_machine(local_server, monkeypatch):
    as_json, text = _plan_under_load(local_server, monkeypatch, load=0.4, cores=2)
    plan = as_json.json()["plan"]
    assert plan["estimated_seconds_range"] is None and not any("busy" in n for n in plan["notes"])
    line = next(ln for ln in text.stdout.splitlines() + text.stderr.splitlines() if "estimated time:" in ln)
    assert "busy" not in line
