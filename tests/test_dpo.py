"""`kind: dpo`: preference pairs, the SDK's datum layout, the local engine's dpo loss against an
independent torch computation, the tiny example learning a held-out preference, bad input
refused before anything is provisioned, a checkpoint as the reference, SIGKILL + resume, a
Ctrl-C during the last step, and reference scores lost mid-run (scored again on resume).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.config import load_config
from baseten_loops_cli.training.data.datums import dpo_datum, load_preference_pairs, reference_logprobs_field
from tests.cli_support import cli_env, kill_once_then_resume, loops_subprocess, one_line_error, seeded  # noqa: F401 - fixture
from tests.cli_support import preference_config, run_metrics as metrics, write_rows

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY = "loops-local/tiny"
TRAIN = EXAMPLES / "data" / "tiny_dpo_train.jsonl"


def tokenizer():
    from baseten_loops_cli.tokenization import get_tokenizer

    return get_tokenizer(TINY)


def dpo_config(tmp: Path, train: Path, *, extra: str = "", steps: int = 4) -> Path:
    return preference_config(tmp, "dpo", train, extra=extra, steps=steps)


# ── rows, config and datums (no server) ────────────────────────────────────────────────────


def test_every_row_shape_renders_the_same_pair(tmp_path):
    user = {"role": "user", "content": "What is 2+1?"}
    rows = [
        {"prompt": "What is 2+1?", "chosen": "ANSWER: 3", "rejected": "3"},
        {"messages": [user], "chosen": "ANSWER: 3", "rejected": "3"},
        {"prompt": [user], "chosen": [{"role": "assistant", "content": "ANSWER: 3"}],
         "rejected": {"role": "assistant", "content": "3"}},
        {"chosen": [user, {"role": "assistant", "content": "ANSWER: 3"}],
         "rejected": [user, {"role": "assistant", "content": "3"}]},
    ]  # fmt: skip
    pairs = load_preference_pairs(write_rows(tmp_path / "p.jsonl", rows), tokenizer(), max_seq_len=64)
    assert len({(tuple(p.chosen.tokens), tuple(p.rejected.tokens)) for p in pairs}) == 1
    chosen = pairs[0].chosen
    reply = tokenizer().encode("ANSWER: 3") + tokenizer().encode("<|im_end|>")
    assert [t for t, w in zip(chosen.tokens, chosen.weights) if w] == reply  # only the reply is trained


def test_datum_is_laid_out_as_the_sdk_builds_it():
    pair = load_preference_pairs(TRAIN, tokenizer(), max_seq_len=64)[0]
    tokens = pair.chosen.tokens
    # The sampler's prompt logprobs: [i] scores token i, [0] is None (nothing precedes it).
    prompt_logprobs = [None] + [-0.5 - i / 100 for i in range(1, len(tokens))]
    ref = reference_logprobs_field(prompt_logprobs)
    datum = dpo_datum(pair.chosen, ref)
    n = len(tokens)
    inputs = datum["loss_fn_inputs"]
    assert datum["model_input"]["chunks"][0]["tokens"] == tokens  # the whole sequence, as scored
    assert inputs["target_tokens"]["data"][:-1] == tokens[1:] and inputs["target_tokens"]["shape"] == [n]
    # ref_logprobs[i] is the logprob of target i = token i+1; the last position is padded.
    assert inputs["ref_logprobs"]["data"] == prompt_logprobs[1:] + [0.0]
    assert inputs["weights"]["data"] == pair.chosen.weights[1:] + [0.0]


def test_dpo_config_defaults_and_reference_errors(tmp_path):
    config = load_config(dpo_config(tmp_path, TRAIN)).config
    assert (config.kind, config.loss, config.loss_params, config.reference) == ("dpo", "dpo", {"beta": 0.1, "label_smoothing": 0.0}, "base")
    path = dpo_config(tmp_path, TRAIN, extra="reference: bt://loops:abc1234/weights/step-2\n")
    with pytest.raises(ConfigError, match=r"dpo\.yaml:16: reference: .*trainer state.*sampler_weights/step-2"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"dpo\.yaml:16: label_smoothing"):
        load_config(dpo_config(tmp_path, TRAIN, extra="label_smoothing: 0.5\n"))


def test_reference_scores_survive_a_torn_append(tmp_path):
    """A kill mid-append leaves a torn last line: it is dropped, and the next scores append on
    a line of their own (read back whole, nothing lost after the tear)."""
    from baseten_loops_cli.training.experiments.rundir import RunDir

    rundir = RunDir(tmp_path)
    rundir.append_references([{"key": "a", "ref_logprobs": [-1.5, 0.0]}])
    with rundir.reference_file.open("a") as fh:
        fh.write('{"key": "b", "ref_log')
    assert [r["key"] for r in rundir.references()] == ["a"]
    rundir.append_references([{"key": "b", "ref_logprobs": [-0.25, 0.0]}])
    assert rundir.references() == [{"key": "a", "ref_logprobs": [-1.5, 0.0]}, {"key": "b", "ref_logprobs": [-0.25, 0.0]}]


BAD_ROWS = [
    ({"prompt": "What is 1+1?", "chosen": "ANSWER: 2"}, "missing key 'rejected'"),
    ({"prompt": "What is 1+1?", "rejected": "2"}, "missing key 'chosen'"),
    ({"prompt": "What is 1+1?", "chosen": "ANSWER: 2", "rejected": "ANSWER: 2"}, "'chosen' and 'rejected' are identical"),
    ({"prompt": "What is 1+1?", "chosen": "ANSWER: 2", "rejected": "x" * 80}, "'rejected' is 113 tokens with its prompt, over max_seq_len 64"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}, "differ before their final reply"),
    ({"prompt": "hi", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"}, "'chosen' must end with an assistant message"),
]  # fmt: skip


@pytest.mark.parametrize("row,message", BAD_ROWS, ids=["no-rejected", "no-chosen", "identical", "too-long", "other-prompt", "no-reply"])
def test_bad_rows_name_file_line_and_key(tmp_path, row, message):
    good = {"prompt": "What is 2+1?", "chosen": "ANSWER: 3", "rejected": "3"}
    path = write_rows(tmp_path / "p.jsonl", [good, "", row])
    with pytest.raises(ConfigError) as err:
        load_preference_pairs(path, tokenizer(), max_seq_len=64)
    assert str(err.value.message).startswith(f"{path}:3: ") and message in err.value.message


# ── the local engine's dpo loss ────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("peft")
    from baseten_loops_cli.local.engine import registry
    from baseten_loops_cli.local.engine.sampler import SamplerEngine

    base = registry.load_base(TINY)
    return base, SamplerEngine(base)


def _reference_datums(engine, pairs) -> list[dict]:
    """Datums whose ref_logprobs are the base model's, scored by the sampler engine with prompt
    logprobs (the SDK's ``compute_logprobs``) and shifted as the SDK does."""
    from baseten_loops_cli.local.engine.sampler import SampleRequest

    examples = [e for p in pairs for e in (p.chosen, p.rejected)]
    results = engine[1].sample([SampleRequest(e.tokens, max_tokens=1, temperature=0.0, prompt_logprobs=0) for e in examples])
    return [
        dpo_datum(e, reference_logprobs_field([None if x is None else x.logprob for x in r.prompt_logprobs]))
        for e, r in zip(examples, results)
    ]


@pytest.mark.local
def test_dpo_loss_and_gradient_match_an_independent_torch_computation(engine):
    import torch
    import torch.nn.functional as F

    from baseten_loops_cli.local.engine.trainer import LoraTrainer
    from baseten_loops_cli.training.data.datums import sft_datum
    from baseten_loops_cli.training.kinds.dpo import preference_metrics

    base, _ = engine
    pairs = load_preference_pairs(TRAIN, tokenizer(), max_seq_len=64)[:4]
    datums = _reference_datums(engine, pairs)
    trainer = LoraTrainer(base, "test-dpo-independent", 4, seed=1)
    try:
        # Move the policy off the reference first, so the margins (and gradients) are not trivial.
        trainer.forward_backward([sft_datum(p.chosen) for p in pairs], "cross_entropy")
        trainer.optim_step({"learning_rate": 2e-2})
        beta, smoothing = 0.3, 0.1
        out = trainer.forward_backward(datums, "dpo", {"beta": beta, "label_smoothing": smoothing})
        params = [p for _, p in base.adapter_parameters(trainer.adapter_name)]
        engine_grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None

        # Independently: one unpadded forward per sequence, log_softmax, the DPO objective.
        with base.activate(trainer.adapter_name) as model:
            sums = []
            for datum in datums:
                tokens = datum["model_input"]["chunks"][0]["tokens"]
                logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)
                weights = torch.tensor(datum["loss_fn_inputs"]["weights"]["data"][:-1])
                ref = torch.tensor(datum["loss_fn_inputs"]["ref_logprobs"]["data"][:-1])
                sums.append((weights * (lp - ref)).sum())
            chosen, rejected = torch.stack(sums[0::2]), torch.stack(sums[1::2])
            z = beta * (chosen - rejected)
            pair_losses = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
            pair_losses.sum().backward()
        assert abs(out["metrics"]["loss:sum"] - pair_losses.sum().item()) < 1e-5
        assert (z.abs() > 1e-3).all(), z  # a real test: the policy has moved
        for got, want in zip(engine_grads, (p.grad for p in params)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

        # The engine's metrics, the loop's (computed from the returned logprobs) and torch agree.
        m = out["metrics"]
        loop = preference_metrics(datums, out["loss_fn_outputs"], beta, smoothing)
        expected = {"loss": pair_losses.mean().item(), "reward_margin": z.mean().item(),
                    "chosen_reward": beta * chosen.mean().item(), "rejected_reward": beta * rejected.mean().item(),
                    "preference_accuracy": (z > 0).float().mean().item()}  # fmt: skip
        for key, value in expected.items():
            assert abs(loop[key] - value) < 1e-5, key
            assert abs(m[f"dpo_{key}" if key != "loss" else "dpo_loss"] - value) < 1e-5, key
    finally:
        trainer.release()


@pytest.mark.local
def test_untrained_policy_is_its_own_reference(engine):
    """Sampler-scored ref_logprobs line up with the trainer's target logprobs position by
    position, so at step 0 every margin is ~0 and preference accuracy is exactly 0.5."""
    from baseten_loops_cli.local.engine.trainer import LoraTrainer
    from baseten_loops_cli.training.kinds.dpo import preference_metrics

    base, _ = engine
    pairs = load_preference_pairs(TRAIN, tokenizer(), max_seq_len=64)[:4]
    datums = _reference_datums(engine, pairs)
    trainer = LoraTrainer(base, "test-dpo-untrained", 4, seed=2)
    try:
        out = trainer.forward(datums, "dpo")
    finally:
        trainer.release()
    for datum, row in zip(datums, out["loss_fn_outputs"]):
        ref, lp = datum["loss_fn_inputs"]["ref_logprobs"]["data"], row["logprobs"]["data"]
        assert max(abs(a - b) for a, b in zip(ref[:-1], lp[:-1])) < 1e-4
    assert out["metrics"]["dpo_preference_accuracy"] == 0.5
    assert out["metrics"]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert preference_metrics(datums, out["loss_fn_outputs"], 0.1, 0.0)["preference_accuracy"] == 0.5


# ── end to end against the local server ────────────────────────────────────────────────────


@pytest.mark.local
def test_tiny_dpo_example_raises_heldout_preference_accuracy(local_server, tmp_path):
    run_dir = tmp_path / "dpo"
    result = loops_subprocess(local_server, "train", "run", str(EXAMPLES / "tiny-dpo.yaml"), "--run-dir", str(run_dir),
                              "-o", "jsonl", timeout=600)
    assert result.code == 0, result
    records = metrics(run_dir)
    baseline, steps = records[0], [r for r in records if "loss" in r]
    # Before training the policy is its own reference: accuracy 0.5, loss log 2.
    assert baseline["step"] == 0 and baseline["eval_preference_accuracy"] == 0.5
    assert baseline["eval_loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert {"loss", "reward_margin", "preference_accuracy", "chosen_reward", "rejected_reward"} <= set(steps[0])
    final = steps[-1]
    assert final["eval_preference_accuracy"] >= 0.9 and final["eval_reward_margin"] > 0.5, final
    assert final["eval_loss"] < 0.5 * math.log(2)
    assert "preference accuracy 50% -> " in result.stderr
    last_line = next(line for line in result.stderr.splitlines() if line.startswith("step 12/12"))
    assert "pref_acc" in last_line and "eval_pref_acc" in last_line  # the per-step view
    # Every sequence was scored once by the reference and kept in the run directory.
    refs = [json.loads(line) for line in (run_dir / "reference_logprobs.jsonl").read_text().splitlines()]
    assert len(refs) == len({r["key"] for r in refs}) == 2 * (48 + 16)
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "completed" and state["step"] == 12
    plot = loops_subprocess(local_server, "train", "plot", str(run_dir), "-m", "preference_accuracy", "-m", "loss")
    assert plot.code == 0 and "preference_accuracy" in plot.stdout, plot


@pytest.mark.local
def test_init_dpo_template_validates(local_server, tmp_path):
    init = loops_subprocess(local_server, "train", "init", "--kind", "dpo", "-O", str(tmp_path / "my-dpo.yaml"))
    assert init.code == 0, init
    (tmp_path / "data").mkdir()
    write_rows(tmp_path / "data" / "pairs.jsonl", [{"prompt": "hi", "chosen": "hello!", "rejected": "go away"}] * 8)
    check = loops_subprocess(local_server, "train", "validate", str(tmp_path / "my-dpo.yaml"))
    assert check.code == 0, check
    assert "8 pairs, 1 steps" in check.stderr and "scores 16 sequences" in check.stderr


def _run_ids(server) -> set[str]:
    with server.client() as c:
        return {r["id"] for r in c.get("/v1/loops/runs").json()["runs"]}


@pytest.mark.local
@pytest.mark.parametrize("row,message", BAD_ROWS[:4], ids=["no-rejected", "no-chosen", "identical", "too-long"])
def test_bad_pairs_fail_before_anything_is_provisioned(local_server, tmp_path, row, message):
    train = write_rows(tmp_path / "pairs.jsonl", [{"prompt": "What is 2+1?", "chosen": "ANSWER: 3", "rejected": "3"}, row])
    before = _run_ids(local_server)
    result = loops_subprocess(local_server, "train", "run", str(dpo_config(tmp_path, train)), "--run-dir", str(tmp_path / "r"))
    one_line_error(result, 1, f"{train}:2: ", message)
    assert _run_ids(local_server) == before and not (tmp_path / "r").exists()


@pytest.mark.local
def test_missing_reference_checkpoint_fails_before_anything_is_provisioned(local_server, tmp_path):
    missing = "bt://loops:nope123/sampler_weights/final"
    config = dpo_config(tmp_path, TRAIN, extra=f"reference: {missing}\n")
    before = _run_ids(local_server)
    for args in (["run", str(config), "--run-dir", str(tmp_path / "r")], ["validate", str(config)]):
        result = loops_subprocess(local_server, "train", *args)
        one_line_error(result, 1, f"{config}:16: reference: no checkpoint {missing}", "loops checkpoints list --run-id nope123")
    assert _run_ids(local_server) == before and not (tmp_path / "r").exists()


@pytest.mark.local
def test_a_sampler_checkpoint_can_be_the_reference(local_server, seeded, tmp_path, engine):
    """The reference is scored with the checkpoint pinned on the run's sampler: its logprobs
    are the fine-tuned adapter's, not the base model's."""
    reference = f"bt://loops:{seeded.run_id}/sampler_weights/s2"
    train = write_rows(tmp_path / "pairs.jsonl", [json.loads(line) for line in TRAIN.read_text().splitlines()[:4]])
    run_dir = tmp_path / "run"
    result = loops_subprocess(local_server, "train", "run", str(dpo_config(tmp_path, train, extra=f"reference: {reference}\n", steps=1)),
                              "--run-dir", str(run_dir), timeout=300)
    assert result.code == 0, result
    assert f"reference policy ({reference})" in result.stderr
    scored = {r["key"]: r["ref_logprobs"] for r in map(json.loads, (run_dir / "reference_logprobs.jsonl").read_text().splitlines())}
    from baseten_loops_cli.training.kinds.dpo import sequence_key

    pairs = load_preference_pairs(train, tokenizer(), max_seq_len=64)
    base_refs = _reference_datums(engine, pairs)
    gaps = [max(abs(a - b) for a, b in zip(scored[sequence_key(d["model_input"]["chunks"][0]["tokens"])],
                                           d["loss_fn_inputs"]["ref_logprobs"]["data"])) for d in base_refs]
    assert len(scored) == 8 and min(gaps) > 1e-2, gaps


# ── SIGKILL, then resume ───────────────────────────────────────────────────────────────────


@pytest.mark.local
def test_dpo_killed_mid_run_then_resumed_gives_the_same_adapter(server_factory, tmp_path):
    # One request per sampler batch: the clean and the killed run must score the reference
    # bit for bit alike (a padded batch sums floats in another order than a lone sequence).
    server = server_factory(max_sample_batch=1)
    train = write_rows(tmp_path / "pairs.jsonl", [json.loads(line) for line in TRAIN.read_text().splitlines()[:16]])
    resumed = kill_once_then_resume(server, dpo_config(tmp_path, train, steps=6), tmp_path, steps=6, timeout=300)
    assert "Resuming at step" in resumed.stderr and "Scoring" not in resumed.stderr  # references reused



# ── Ctrl-C in-process, then `loops train resume` ───────────────────────────────────────────


def _ctrl_c_at_step(server, run_dir: Path, monkeypatch, at_step: int, overrides: list[str], *,
                    deactivate: bool = True) -> tuple[str, str]:
    """Run the tiny DPO example in-process until the step ``at_step`` record, then "Ctrl-C" (set
    the stop flag, what the SIGINT handler does) and end as `loops train run` does: state saved,
    run deactivated (or kept active, as `--keep-run` or a killed client leaves it). Returns
    (status, run id)."""
    from baseten_loops_cli.cli._backend import open_backend
    from baseten_loops_cli.training.service import absolute_raw
    from baseten_loops_cli.training.kinds.dpo import DPOSteps
    from baseten_loops_cli.training.loop.core import run
    from baseten_loops_cli.training.experiments.metrics import MetricsSink
    from baseten_loops_cli.training.plan import load_data
    from baseten_loops_cli.training.experiments.rundir import RunDir
    from baseten_loops_cli.training.session import StopRequested, open_session

    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    loaded = load_config(EXAMPLES / "tiny-dpo.yaml", overrides)
    data = load_data(loaded)
    rundir = RunDir(run_dir)
    rundir.create(absolute_raw(loaded), loaded.path)
    session = open_session(loaded, rundir, open_backend(), resume=False, announce=lambda _: None)
    stop = StopRequested()  # not entered: no signal handler; the "Ctrl-C" is set below

    class CtrlCAtStep(MetricsSink):
        def step(self, record: dict) -> None:
            super().step(record)
            if record["step"] == at_step:
                stop.requested = True

    try:
        status = run(DPOSteps(session, data), CtrlCAtStep(rundir), stop)
        rundir.update_state(status=status)
    finally:
        session.close(deactivate=deactivate)
    return status, session.run_id


@pytest.mark.local
def test_ctrl_c_during_the_last_step_is_honoured_then_resumed(local_server, tmp_path, monkeypatch):
    rundir_path = tmp_path / "run"
    status, old_run = _ctrl_c_at_step(local_server, rundir_path, monkeypatch, 2,
                                      ["max_steps=2", "eval_every=0", "data.eval=null"])
    assert status == "interrupted"  # -> exit 130 in `loops train run`, like any other step
    checkpoints = [json.loads(line) for line in (rundir_path / "checkpoints.jsonl").read_text().splitlines()]
    assert checkpoints[-1]["step"] == 2 and checkpoints[-1]["name"] != "final"

    resumed = loops_subprocess(local_server, "train", "resume", str(rundir_path), timeout=300)
    assert resumed.code == 0, resumed
    assert "Scoring" not in resumed.stderr  # the reference scores were kept
    state = json.loads((rundir_path / "state.json").read_text())
    assert state["status"] == "completed" and state["resumed_from"] == [old_run]
    assert [r["step"] for r in metrics(rundir_path)] == [1, 2]  # nothing repeated
    assert json.loads((rundir_path / "checkpoints.jsonl").read_text().splitlines()[-1])["name"] == "final"


@pytest.mark.local
def test_lost_reference_scores_are_scored_again_on_resume(local_server, tmp_path, monkeypatch):
    """reference_logprobs.jsonl deleted after training began: the resumed run scores again, on
    the base model, what is left to use (the reference was the step-0 snapshot of a fresh LoRA,
    which adds exactly zero) and gets the same numbers. The run is kept active, so its own
    sampler serves trained weights: the reference must not be scored there. Each pass scores
    only the pairs its steps train, plus the eval split: 4 of 6 batches (2 x 32 + 2 x 16), not
    all 48 train pairs."""
    from baseten_loops_cli.training.kinds.dpo import rows_to_train, sequence_key
    from baseten_loops_cli.training.plan import load_data

    rundir_path = tmp_path / "run"
    status, run_id = _ctrl_c_at_step(local_server, rundir_path, monkeypatch, 2, ["max_steps=4", "eval_every=2"],
                                     deactivate=False)
    assert status == "interrupted"
    ref_file = rundir_path / "reference_logprobs.jsonl"
    original = {r["key"]: r["ref_logprobs"] for r in map(json.loads, ref_file.read_text().splitlines())}
    assert len(original) == 2 * (4 * 8 + 16)
    done = [r["step"] for r in metrics(rundir_path) if "loss" in r]
    assert done and max(done) < 4, done
    ref_file.unlink()
    loaded = load_config(EXAMPLES / "tiny-dpo.yaml", ["max_steps=4", "eval_every=2"])
    data = load_data(loaded)
    left = [data.train[i] for i in rows_to_train(len(data.train), loaded.config, max(done))] + data.eval
    wanted = {sequence_key(e.tokens) for pair in left for e in (pair.chosen, pair.rejected)}
    assert len(wanted) < len(original)

    resumed = loops_subprocess(local_server, "train", "resume", str(rundir_path), "-o", "jsonl", timeout=300)
    assert resumed.code == 0, resumed
    assert f"Scoring {len(wanted)} sequences with the reference policy (base)" in resumed.stderr
    rescored = {r["key"]: r["ref_logprobs"] for r in map(json.loads, ref_file.read_text().splitlines())}
    assert rescored.keys() == wanted
    gaps = [max(abs(a - b) for a, b in zip(original[k], rescored[k])) for k in wanted]
    assert all(len(original[k]) == len(rescored[k]) for k in wanted)
    assert max(gaps) < 1e-4, max(gaps)
    assert [r["step"] for r in metrics(rundir_path) if "loss" in r] == [1, 2, 3, 4]
    final = [r for r in metrics(rundir_path) if r.get("step") == 4 and "eval_loss" in r]
    assert final and final[-1]["eval_preference_accuracy"] > 0.5, final
    state = json.loads((rundir_path / "state.json").read_text())
    assert state["status"] == "completed" and state["step"] == 4 and state["run_id"] == run_id
