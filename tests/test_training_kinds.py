"""A kind of training is one module: a toy kind, written here and registered from this test
module, runs through `loops train init|validate|run` end to end against the real local server.

The toy kind ("toy") trains plain text rows ({"text": ...}) with cross-entropy on every token,
through the same protocol routes the built-in kinds use; it declares its own config keys
(``data.texts``, ``repeat``), data loading, plan estimate (noun "texts"), loop, main metric
(``toy_loss``) and step fields, template and data path keys; its loop is the one every kind
runs (training/loop/core.py), fed by its :class:`ToySteps` hooks. Nothing outside the registry
knows it exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training import kinds
from baseten_loops_cli.training.config import CommonConfig, Section, load_config
from baseten_loops_cli.training.data.datums import Example, read_jsonl, sft_datum, weighted_nll
from baseten_loops_cli.training.kinds import Estimate, Kind, LoadedData, StepField
from baseten_loops_cli.training.loop.core import ProtocolLoss, StepHooks, StepWork, total_steps
from tests.cli_support import TINY, loops


class ToyData(Section):
    texts: str


class ToyConfig(CommonConfig):
    kind: Literal["toy"]
    data: ToyData
    repeat: int = Field(1, ge=1, description="Steps per text.")


def _load(loaded, tokenizer) -> LoadedData:
    path = loaded.resolve_path(loaded.config.data.texts)
    rows = []
    for lineno, row in read_jsonl(path):
        if not isinstance(row.get("text"), str):
            raise ConfigError(f"{path}:{lineno}: expected a string 'text'")
        tokens = tokenizer.encode(row["text"])
        rows.append(Example(list(tokens), [1.0] * len(tokens), f"{path}:{lineno}"))
    return LoadedData(tokenizer, rows, None)


class ToySteps(StepHooks):
    """One text a step, in order, ``repeat`` times over: cross-entropy on every token."""

    main_metric = "toy_loss"

    def rows_per_step(self) -> int:
        return 1

    def epochs(self) -> int:
        return self.config.repeat

    def shuffle(self) -> bool:
        return False

    def step(self, step: int, rows: list[int], version: int) -> StepWork:
        datums = [sft_datum(self.data.train[i]) for i in rows]

        def fields(result: dict | None) -> dict:
            nll, trained = weighted_nll(datums, result["loss_fn_outputs"])
            return {"toy_loss": nll, "trained_tokens": trained}

        return StepWork(datums, ProtocolLoss("cross_entropy"), fields_from=fields)


def _estimate(config, data: LoadedData) -> Estimate:
    steps = total_steps(len(data.train), 1, config.repeat, config.max_steps)
    tokens = sum(len(data.train[s % len(data.train)].tokens) - 1 for s in range(steps))
    return Estimate(steps, tokens, notes=["toy: one text per step"])


TOY = Kind(
    name="toy",
    config_model=ToyConfig,
    noun="texts",
    main_metric="toy_loss",
    metric_names=("toy_loss", "trained_tokens"),
    step_fields=(StepField("toy_loss", "toyloss", ".3f"),),
    data_path_keys=(("data", "texts"),),
    template=lambda: f"kind: toy\nname: my-toy\nbase_model: {TINY}\ndata:\n  texts: texts.jsonl\n",
    load_data=_load,
    estimate=_estimate,
    hooks=ToySteps,
)


@pytest.fixture
def toy_kind():
    kinds.register(TOY)
    yield TOY
    kinds.unregister("toy")


def _config(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "texts.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ("the cat sat", "on the mat")) + "\n")
    config = tmp_path / "toy.yaml"
    config.write_text(
        "kind: toy\nname: toy-run\nbase_model: loops-local/tiny\nlora_rank: 16\nmax_seq_len: 64\n"
        "optimizer:\n  learning_rate: 3.0e-3\n  schedule: constant\nrepeat: 2\ndata:\n  texts: data/texts.jsonl\n"
    )
    return config


def test_a_registered_kind_runs_end_to_end(local_server, tmp_path, toy_kind):
    config = _config(tmp_path)
    plan = loops(local_server, "train", "validate", str(config), "-o", "json")
    assert plan.code == 0, plan
    assert plan.json()["plan"]["kind"] == "toy" and plan.json()["plan"]["steps"] == 4
    assert "toy: one text per step" in plan.json()["plan"]["notes"]
    shown = loops(local_server, "train", "validate", str(config))
    assert shown.code == 0, shown
    assert "(TOY)" in shown.stderr and "2 texts, 4 steps" in shown.stderr  # the kind's noun, in the plan people read

    run_dir = tmp_path / "run"
    result = loops(local_server, "train", "run", str(config), "--run-dir", str(run_dir), "-o", "json")
    assert result.code == 0, result
    assert "step 1/4  toyloss " in result.stderr  # the kind's step fields, in the plain view
    summary = result.json()
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert summary["first_toy_loss"] is not None and summary["last_toy_loss"] is not None
    assert summary["final_checkpoint"].startswith("bt://loops:") and summary["final_checkpoint"].endswith("/final")

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all("toy_loss" in r for r in records)
    losses = [r["toy_loss"] for r in records]  # texts alternate: each is seen twice, and learned
    assert losses[2] < losses[0] and losses[3] < losses[1], losses
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "completed" and state["run_status"] == "INACTIVE"  # deactivated at the end
    saved = load_config(run_dir / "config.yaml").config
    assert isinstance(saved, ToyConfig) and Path(saved.data.texts).is_absolute()  # the kind's data path key

    plot = loops(local_server, "train", "plot", str(run_dir))  # the kind's main metric by default
    assert plot.code == 0 and "toy_loss  (steps 1-4" in plot.stdout, plot

    # The checkpoint is a real one on the server: the same sampler weights `loops eval` would score.
    listed = loops(local_server, "checkpoints", "list", "--run-id", summary["run_id"], "-o", "json")
    assert listed.code == 0, listed
    assert {(c["checkpoint_id"], c["target"]) for c in listed.json()["checkpoints"]} >= {("final", "sampler"), ("final", "trainer")}, listed


def test_a_registered_kind_has_its_template_and_its_errors(local_server, tmp_path, toy_kind):
    init = loops(local_server, "train", "init", "--kind", "toy")
    assert init.code == 0, init
    assert init.stdout.startswith("kind: toy\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: toy\nname: x\nbase_model: loops-local/tiny\nrepeat: 0\ndata:\n  txts: a.jsonl\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "bad.yaml:4: repeat:" in err.value.message and "unknown key 'data.txts'; did you mean 'data.texts'?" in err.value.message
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("name: x\nkind: ppo\n")
    with pytest.raises(ConfigError, match=r"unknown.yaml:2: kind must be 'sft', 'rl', 'dpo', 'kto', 'distill' or 'toy', not 'ppo'"):
        load_config(unknown)


def test_without_registration_the_kind_is_unknown(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("kind: toy\nname: x\n")
    with pytest.raises(ConfigError, match=r"c.yaml:1: kind must be 'sft', 'rl', 'dpo', 'kto' or 'distill', not 'toy'"):
        load_config(config)


@pytest.mark.parametrize("kind, total, record, line", [
    ("sft", 10, {"step": 2, "loss": 1.0, "eval_loss": 0.5, "learning_rate": 1e-3},
     "step 2/10  loss 1.0000  eval_loss 0.5000  lr 1.00e-03  tok/s -  v-"),
    ("rl", 10, {"step": 4, "reward": 0.5, "pass_rate": 0.25, "groups": 4, "eval_reward_mean": 0.7, "learning_rate": 4e-5},
     "step 4/10  reward 0.500  pass 25%  groups 0/4  eval_reward 0.700  lr 4.00e-05  tok/s -  v-"),
    ("dpo", 12, {"step": 0, "eval_loss": 0.69, "eval_preference_accuracy": 0.5, "eval_reward_margin": 0.0},
     "step 0/12  loss -  eval_loss 0.6900  eval_pref_acc 50%  lr -  tok/s -  v-"),
    ("dpo", 12, {"step": 2, "loss": 0.5, "preference_accuracy": 0.8, "reward_margin": 0.2, "eval_loss": 0.4,
                 "eval_preference_accuracy": 0.9, "learning_rate": 1e-4, "policy_version": 2},
     "step 2/12  loss 0.5000  pref_acc 80%  margin 0.200  eval_loss 0.4000  eval_pref_acc 90%  lr 1.00e-04  tok/s -  v2"),
    ("kto", 16, {"step": 3, "loss": 0.4, "reward_margin": 1.5, "kl_estimate": 0.25, "eval_loss": 0.3,
                 "eval_reward_margin": 2.0, "learning_rate": 1e-4, "policy_version": 3},
     "step 3/16  loss 0.4000  margin 1.500  kl 0.250  eval_loss 0.3000  eval_margin 2.000  lr 1.00e-04  tok/s -  v3"),
])
def test_each_built_in_kind_declares_its_part_of_the_step_line(kind, total, record, line):
    """The step line is the view's; what it shows between the step and the learning rate is the
    kind's declaration (the same lines the per-kind branches of the old display printed)."""
    from baseten_loops_cli.output.training_view import step_line

    assert step_line(record, total, kinds.get(kind).step_fields) == line
