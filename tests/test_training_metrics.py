"""Metrics sink, W&B wiring, display, plot, templates and schedules: no server needed."""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest

from baseten_loops_cli.training.config import OptimizerConfig, load_config
from baseten_loops_cli.training import kinds
from baseten_loops_cli.output.training_view import PlainTrainingView, sparkline, step_line
from baseten_loops_cli.training.experiments.metrics import MetricsSink, open_wandb
from baseten_loops_cli.training.experiments.plot import plot_terminal
from baseten_loops_cli.training.experiments.rundir import RunDir
from baseten_loops_cli.training.session import learning_rate
from baseten_loops_cli.training.templates import template


def _config(tmp_path: Path, extra: str = ""):
    path = tmp_path / "c.yaml"
    path.write_text("kind: sft\nname: t\nbase_model: loops-local/tiny\ndata: {train: x.jsonl}\n" + extra)
    return load_config(path).config


def _rundir(tmp_path: Path) -> RunDir:
    rundir = RunDir(tmp_path / "run")
    rundir.create({"kind": "sft"}, tmp_path / "c.yaml")
    return rundir


def test_sink_writes_the_run_dir_and_the_reporter(tmp_path):
    rundir = _rundir(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    sink = MetricsSink(rundir, PlainTrainingView(jsonl=True, out=out, err=err))
    sink.start(2, 0, "loss")
    sink.step({"step": 1, "loss": 2.0, "learning_rate": 1e-3, "policy_version": 1})
    sink.step({"step": 2, "loss": 1.0, "learning_rate": 1e-3, "policy_version": 2})
    sink.final({"step": 2, "eval_loss": 0.5})
    sink.samples([{"step": 2, "completion": "x", "reward": 1.0}])
    sink.close()
    assert [r["step"] for r in rundir.metrics()] == [1, 2, 2] and rundir.metrics()[-1]["final"] is True
    assert [json.loads(l)["step"] for l in out.getvalue().splitlines()] == [1, 2]  # -o jsonl stream
    assert err.getvalue().splitlines()[0].startswith("step 1/2  loss 2.0000")
    assert json.loads(rundir.samples_file.read_text())["reward"] == 1.0


def test_step_records_are_fsynced_before_what_covers_them_not_per_step(tmp_path, monkeypatch):
    """A step's metrics cost no disk flush of their own; a checkpoint record or a state.json
    write first makes every record before it durable (what resume relies on after a power cut)."""
    import os

    rundir = _rundir(tmp_path)
    synced: list[str] = []
    real_fsync = os.fsync
    names = {}

    def fsync(fd: int) -> None:
        inode = os.fstat(fd).st_ino
        for path in (rundir.metrics_file, rundir.samples_file, rundir.checkpoints_file):
            if path.exists() and path.stat().st_ino == inode:
                names[inode] = path.name
        synced.append(names.get(inode, "other"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sink = MetricsSink(rundir)
    for step in (1, 2, 3):
        sink.step({"step": step, "loss": 1.0})
    sink.samples([{"step": 3, "completion": "x", "reward": 1.0}])
    assert synced == []  # three steps and their samples: no flush yet
    rundir.append_checkpoint({"step": 3, "name": "step-000003", "path": "p"})
    assert synced == ["metrics.jsonl", "samples.jsonl", "checkpoints.jsonl"]
    synced.clear()
    sink.step({"step": 4, "loss": 1.0})
    rundir.update_state(status="completed", step=4)
    assert synced[:2] == ["metrics.jsonl", "samples.jsonl"] and "other" in synced[2:]  # then state.json
    assert [r["step"] for r in rundir.metrics()] == [1, 2, 3, 4]


def test_wandb_missing_is_a_note_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    config = _config(tmp_path, "logging: {wandb_project: proj}\n")
    logger, note = open_wandb(config, _rundir(tmp_path), run_id="r1")
    assert logger is None and "wandb is not installed" in note
    assert open_wandb(_config(tmp_path), _rundir(tmp_path), run_id="r1") == (None, None)


def test_wandb_run_is_resumed_with_the_same_id(tmp_path, monkeypatch):
    calls: list = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    fake = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: "abc123"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = _config(tmp_path, "logging: {wandb_project: proj, wandb_name: nice}\n")
    rundir = _rundir(tmp_path)
    logger, note = open_wandb(config, rundir, run_id="r1", raw_config={"kind": "sft"})
    assert "abc123" in note and rundir.read_state()["wandb_id"] == "abc123"
    sink = MetricsSink(rundir, wandb=logger)
    sink.step({"step": 3, "loss": 1.5, "tokens_per_s": None, "ok": True})
    sink.close()
    init_kwargs = calls[0][1]
    assert init_kwargs["project"] == "proj" and init_kwargs["name"] == "nice" and init_kwargs["resume"] == "allow"
    assert calls[1] == ("log", 3, {"loss": 1.5})
    assert calls[-1] == ("finish",)
    # Resume: the same W&B run id, not a second run.
    fake.util.generate_id = lambda: "other"
    open_wandb(config, rundir, run_id="r1")
    assert calls[-1][1]["id"] == "abc123"


def test_learning_rate_schedules():
    opt = OptimizerConfig(learning_rate=1.0, schedule="linear", warmup_steps=2)
    lrs = [learning_rate(opt, s, 10) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0 and lrs[-1] < 0.2 and lrs == sorted(lrs[:2]) + sorted(lrs[2:], reverse=True)
    cosine = OptimizerConfig(learning_rate=1.0, schedule="cosine", min_lr_ratio=0.1)
    assert learning_rate(cosine, 0, 10) == 1.0 and learning_rate(cosine, 10, 10) == pytest.approx(0.1)
    assert learning_rate(OptimizerConfig(learning_rate=0.3, schedule="constant"), 7, 10) == 0.3


def test_display_lines_and_sparkline():
    assert sparkline([3, 2, 1]) == "█▄▁"
    assert sparkline([float("nan"), None]) == ""
    line = step_line({"step": 3, "reward": 0.5, "pass_rate": 0.25, "groups_trained": 2, "groups": 4,
                      "learning_rate": 4e-5, "tokens_per_s": 120.0, "policy_version": 3}, 10, kinds.get("rl").step_fields)
    assert line == "step 3/10  reward 0.500  pass 25%  groups 2/4  lr 4.00e-05  tok/s 120  v3"


def test_plot_terminal_draws_each_metric():
    records = [{"step": s, "loss": 1.0 / s, "reward": s / 10} for s in range(1, 21)]
    text = plot_terminal(records, ["loss", "reward"])
    assert "loss  (steps 1-20, first 1, last 0.05)" in text and "reward" in text and "•" in text


@pytest.mark.parametrize("kind", ["sft", "rl"])
def test_init_templates_pass_the_schema(tmp_path, kind):
    path = tmp_path / f"{kind}.yaml"
    path.write_text(template(kind))
    config = load_config(path).config
    assert config.kind == kind and config.base_model == "loops-local/tiny"


def test_cli_init_validate_and_plot(tmp_path):
    from typer.testing import CliRunner

    from baseten_loops_cli.cli.train import app

    runner = CliRunner()
    out = tmp_path / "new.yaml"
    result = runner.invoke(app, ["init", "--kind", "rl", "-O", str(out)])
    assert result.exit_code == 0, result.output
    assert "kind: rl" in out.read_text()
    again = runner.invoke(app, ["init", "--kind", "rl", "-O", str(out)])
    assert again.exit_code != 0  # no silent overwrite
    rundir = _rundir(tmp_path)
    for step in range(1, 6):
        rundir.append_metrics({"step": step, "loss": 1.0 / step})
    result = runner.invoke(app, ["plot", str(rundir.path)])
    assert result.exit_code == 0 and "loss" in result.output
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        result = runner.invoke(app, ["plot", str(rundir.path), "--out", str(tmp_path / "x.png")])
        assert result.exit_code != 0 and "matplotlib" in str(result.exception)
        assert "pip install matplotlib" in result.exception.hint
    else:
        result = runner.invoke(app, ["plot", str(rundir.path), "--out", str(tmp_path / "x.png")])
        assert result.exit_code == 0 and (tmp_path / "x.png").stat().st_size > 0


def test_plot_overlays_several_runs_one_legend_entry_each(tmp_path):
    """`loops train plot runs/tiny-sft-*/` (the README runs the example twice): every run is
    drawn on one chart, each with its own marker and legend entry."""
    from typer.testing import CliRunner

    from baseten_loops_cli.cli.train import app

    dirs = []
    for i, scale in enumerate((1.0, 3.0)):
        rundir = RunDir(tmp_path / f"tiny-sft-{i}")
        rundir.create({"kind": "sft"}, tmp_path / "c.yaml")
        for step in range(1, 21):
            rundir.append_metrics({"step": step, "loss": scale / step})
        dirs.append(str(rundir.path) + "/")
    result = CliRunner().invoke(app, ["plot", *dirs])
    assert result.exit_code == 0, result.output
    text = result.output
    for i, marker in enumerate("•x"):
        label = str(tmp_path / f"tiny-sft-{i}")
        assert f"{marker} {label}: steps 1-20" in text  # the summary line
        assert f"│ {marker} tiny-sft-{i} │" in text  # the legend entry in the chart
    chart = text[text.index("┌"):]
    assert chart.count("•") > 5 and chart.count("x") > 5  # both curves drawn
