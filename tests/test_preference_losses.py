"""The preference losses of training/losses/preference_losses.py (issue 29): each loss's value, metrics
and per-token weights against an independent torch computation written from the papers'
formulas (autograd through per-token logprob tensors gives the reference gradient; our code is
never called for the reference); the weights, sent through the SDK's custom-loss path on the real
engine, giving the gradient that autograd through the loss on the model gives; a few steps on the
real local server lowering each loss; parameter and KTO-row errors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.losses import preference_losses as pl
from baseten_loops_cli.training.data.kto_rows import (
    check_kto_labels, check_paired_row, kl_examples, kto_row, load_kto_examples,
)  # fmt: skip
from tests.cli_support import create_run, trainer

torch = pytest.importorskip("torch")
F = torch.nn.functional

ROOT = Path(__file__).resolve().parent.parent
TINY = "loops-local/tiny"
DPO_TRAIN = ROOT / "examples" / "data" / "tiny_dpo_train.jsonl"
PARAMS = {
    "dpo": {"beta": 0.3, "label_smoothing": 0.1},
    "ipo": {"beta": 0.2},
    "simpo": {"beta": 2.0, "gamma": 0.7},
    "orpo": {"lambda": 0.4},
}
KTO_PARAMS = {"beta": 0.3, "desirable_weight": 1.2, "undesirable_weight": 0.8}


# ── the reference: the papers' formulas in torch, on per-token logprob tensors ─────────────
# Each takes lists of 1-D tensors (policy lp, reference ref, mask m with 1 on the reply) and
# returns per-pair (per-example) losses; nothing here calls training/losses/preference_losses.py.


def _sum(lp, m):
    return (lp * m).sum()


def _avg(lp, m):
    return (lp * m).sum() / m.sum()


def reference_paired(loss, lp, ref, m, p):
    out = []
    for c, r in [(i, i + 1) for i in range(0, len(lp), 2)]:
        if loss == "dpo":  # Rafailov et al. eq. 7, with cDPO's label smoothing
            pi_logratios = _sum(lp[c], m[c]) - _sum(lp[r], m[r])
            ref_logratios = _sum(ref[c], m[c]) - _sum(ref[r], m[r])
            logits = p["beta"] * (pi_logratios - ref_logratios)
            eps = p["label_smoothing"]
            out.append(-(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits))
        elif loss == "ipo":  # Azar et al. eq. 17, log-ratios averaged per token (TRL)
            h_w = (_sum(lp[c], m[c]) - _sum(ref[c], m[c])) / m[c].sum()
            h_l = (_sum(lp[r], m[r]) - _sum(ref[r], m[r])) / m[r].sum()
            out.append((h_w - h_l - 1 / (2 * p["beta"])) ** 2)
        elif loss == "simpo":  # Meng et al. eq. 6
            out.append(-F.logsigmoid(p["beta"] / m[c].sum() * _sum(lp[c], m[c])
                                     - p["beta"] / m[r].sum() * _sum(lp[r], m[r]) - p["gamma"]))
        else:  # orpo, Hong et al. eqs. 2, 4-7: odds(y) = P / (1 - P), P = exp(mean token logprob)
            p_w, p_l = torch.exp(_avg(lp[c], m[c])), torch.exp(_avg(lp[r], m[r]))
            log_odds_ratio = torch.log((p_w / (1 - p_w)) / (p_l / (1 - p_l)))
            out.append(-_avg(lp[c], m[c]) + p["lambda"] * -F.logsigmoid(log_odds_ratio))
    return torch.stack(out)


def reference_kto(lp, ref, m, labels, kl_lp, kl_ref, kl_m, p):
    """Ethayarajh et al. eq. 8: z0 = max(0, mean KL over mismatched pairs), not back-propagated."""
    z0 = torch.stack([_sum(a, k) - _sum(b, k) for a, b, k in zip(kl_lp, kl_ref, kl_m)]).mean().detach().clamp(min=0)
    out = []
    for a, b, k, label in zip(lp, ref, m, labels):
        r = _sum(a, k) - _sum(b, k)
        if label:
            out.append(p["desirable_weight"] * (1 - torch.sigmoid(p["beta"] * (r - z0))))
        else:
            out.append(p["undesirable_weight"] * (1 - torch.sigmoid(p["beta"] * (z0 - r))))
    return torch.stack(out), z0


# ── one batch ──────────────────────────────────────────────────────────────────────────────


def _batch(n, seed):
    """n sequences of varied length: a prompt (weight 0, some logprobs None as on the wire), a
    reply (weight 1), per-token policy and reference logprobs."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        prompt, reply = 3 + i % 3, 2 + (i * 5) % 7
        lp = -F.softplus(torch.randn(prompt + reply, generator=g, dtype=torch.float64)) - 0.05
        ref = lp.detach() + 0.3 * torch.randn(prompt + reply, generator=g, dtype=torch.float64)
        ref = ref.clamp(max=-1e-3)
        m = torch.tensor([0.0] * prompt + [1.0] * reply, dtype=torch.float64)
        seqs.append((lp, ref, m))
    return seqs


def _wire(lp, ref, m):
    """What the client sees: lists, None where the trainer masks a position."""
    lps = [None if (w == 0 and i % 2 == 0) else float(x) for i, (x, w) in enumerate(zip(lp.tolist(), m.tolist()))]
    return lps, m.tolist(), ref.tolist()


def _scores(seqs):
    return [pl.score_sequence(*_wire(lp, ref, m)) for lp, ref, m in seqs]


def _check_weights(seqs, grads):
    """Our per-token cross_entropy weights against -dL/dlp from autograd, position by position."""
    for (lp, _, m), grad in zip(seqs, grads):
        weights = pl.token_weights(m.tolist(), grad)
        torch.testing.assert_close(torch.tensor(weights, dtype=torch.float64), -lp.grad, rtol=0, atol=1e-5)
        assert any(abs(w) > 1e-4 for w in weights)  # a real gradient, not zeros matching zeros


@pytest.mark.parametrize("loss", pl.PAIRED_LOSSES)
def test_paired_loss_value_gradient_and_metrics_match_the_papers_formulas(loss):
    seqs = _batch(8, seed=11)
    for lp, _, _ in seqs:
        lp.requires_grad_(True)
    lps, refs, masks = zip(*seqs)
    per_pair = reference_paired(loss, list(lps), list(refs), list(masks), PARAMS[loss])
    per_pair.sum().backward()

    result = pl.paired_loss(loss, _scores(seqs), PARAMS[loss])
    assert result.loss_sum == pytest.approx(per_pair.sum().item(), abs=1e-5)
    assert result.loss == pytest.approx(per_pair.mean().item(), abs=1e-5)
    _check_weights(seqs, result.grads)

    # The metrics, from the same formulas (TRL's rewards: beta * summed log-ratio for dpo/ipo,
    # beta * mean logprob for simpo, the mean logprob for orpo).
    with torch.no_grad():
        if loss in ("dpo", "ipo"):
            reward = [PARAMS[loss]["beta"] * (_sum(lp, m) - _sum(ref, m)) for lp, ref, m in seqs]
        elif loss == "simpo":
            reward = [PARAMS[loss]["beta"] * _avg(lp, m) for lp, _, m in seqs]
        else:
            reward = [_avg(lp, m) for lp, _, m in seqs]
        chosen, rejected = torch.stack(reward[0::2]), torch.stack(reward[1::2])
    m = result.metrics
    assert m["loss"] == result.loss
    assert m["chosen_reward"] == pytest.approx(chosen.mean().item(), abs=1e-6)
    assert m["rejected_reward"] == pytest.approx(rejected.mean().item(), abs=1e-6)
    assert m["reward_margin"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-6)
    assert m["preference_accuracy"] == pytest.approx((chosen > rejected).double().mean().item())
    assert 0 < m["preference_accuracy"] < 1  # the batch has pairs either way round
    if loss == "orpo":
        with torch.no_grad():
            nll = torch.stack([-_avg(lp, mk) for lp, _, mk in seqs[0::2]]).mean()
        assert m["nll_loss"] == pytest.approx(nll.item(), abs=1e-6)


@pytest.mark.parametrize("kl_shift", [0.0, 2.0], ids=["z0-clamped", "z0-positive"])
def test_kto_value_gradient_and_metrics_match_the_paper(kl_shift):
    seqs = _batch(6, seed=5)
    labels = [True, False, False, True, True, False]
    kl = _batch(6, seed=6)
    # Shift the mismatched pairs' policy logprobs: with 0 the KL estimate is negative here and
    # clamps at 0; with +2 nats a token it is positive, and still carries no gradient.
    kl = [(lp + kl_shift * m, ref, m) for lp, ref, m in kl]
    for lp, _, _ in seqs + kl:
        lp.requires_grad_(True)
    per_example, z0 = reference_kto(*zip(*seqs), labels, *zip(*kl), KTO_PARAMS)
    per_example.sum().backward()
    assert (z0 > 0) == (kl_shift > 0)

    result = pl.kto_loss(_scores(seqs), labels, _scores(kl), KTO_PARAMS)
    assert result.loss_sum == pytest.approx(per_example.sum().item(), abs=1e-5)
    assert result.loss == pytest.approx(per_example.mean().item(), abs=1e-5)
    assert result.metrics["kl_estimate"] == pytest.approx(z0.item(), abs=1e-6)
    _check_weights(seqs, result.grads)
    for lp, _, _ in kl:
        assert lp.grad is None or not lp.grad.any()  # z0 is a constant to the gradient
    beta = KTO_PARAMS["beta"]
    with torch.no_grad():
        rewards = [beta * (_sum(lp, m) - _sum(ref, m)).item() for lp, ref, m in seqs]
    good = [r for r, label in zip(rewards, labels) if label]
    bad = [r for r, label in zip(rewards, labels) if not label]
    assert result.metrics["desirable_reward"] == pytest.approx(sum(good) / len(good), abs=1e-6)
    assert result.metrics["undesirable_reward"] == pytest.approx(sum(bad) / len(bad), abs=1e-6)
    assert result.metrics["reward_margin"] == pytest.approx(sum(good) / len(good) - sum(bad) / len(bad), abs=1e-6)


def test_dpo_matches_the_loops_dpo_metrics_and_ties_count_half():
    """Our dpo is the protocol's (training/kinds/dpo.py computes the same metrics from the same rows),
    and the tie rule is the one training/kinds/dpo.py and the local engine use."""
    from baseten_loops_cli.training.kinds import dpo

    assert pl.TIE_NATS == dpo.TIE_NATS
    seqs = _batch(6, seed=3)
    datums, outputs = [], []
    for lp, ref, m in seqs:
        lps, weights, refs = _wire(lp, ref, m)
        datums.append({"loss_fn_inputs": {"weights": {"data": weights}, "ref_logprobs": {"data": refs}}})
        outputs.append({"logprobs": {"data": lps}})
    theirs = dpo.preference_metrics(datums, outputs, 0.3, 0.1)
    ours = pl.paired_loss("dpo", _scores(seqs), {"beta": 0.3, "label_smoothing": 0.1}).metrics
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, abs=1e-9), key
    tie = [pl.SequenceScore(-2.0, 2, -2.0), pl.SequenceScore(-3.0, 3, -3.0)]  # policy == reference
    assert pl.paired_loss("dpo", tie).metrics["preference_accuracy"] == 0.5
    assert pl.paired_loss("ipo", tie).metrics["preference_accuracy"] == 0.5


def test_orpo_stays_finite_where_the_model_is_certain():
    certain = [pl.SequenceScore(0.0, 3), pl.SequenceScore(-2.0, 2)]
    result = pl.paired_loss("orpo", certain)
    assert all(math.isfinite(x) for x in [result.loss, *result.grads])


# ── parameters ─────────────────────────────────────────────────────────────────────────────


def test_parameter_table_defaults_and_owners():
    assert pl.params_for("dpo") == {"beta": 0.1, "label_smoothing": 0.0}
    assert pl.params_for("ipo") == {"beta": 0.1}
    assert pl.params_for("simpo") == {"beta": 2.0, "gamma": 1.0}
    assert pl.params_for("orpo") == {"lambda": 0.1}
    assert pl.params_for("kto") == {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}
    assert pl.resolve_params("simpo", {"gamma": 0}) == {"beta": 2.0, "gamma": 0.0}
    assert set(pl.NEEDS_REFERENCE) == {"dpo", "ipo", "kto"}


PARAM_ERRORS = [
    ("cpo", {}, "loss", "loss: unknown loss 'cpo' (one of dpo, ipo, simpo, orpo; unpaired rows: kind kto)"),
    ("orpo", {"beta": 0.1}, "beta", "beta belongs to losses dpo, ipo, simpo and kto, not to orpo"),
    ("dpo", {"gamma": 0.5}, "gamma", "gamma belongs to loss simpo, not to dpo"),
    ("simpo", {"desirable_weight": 1}, "desirable_weight", "desirable_weight belongs to loss kto, not to simpo"),
    ("dpo", {"beta": 0}, "beta", "beta: must be > 0, got 0"),
    ("dpo", {"label_smoothing": 0.5}, "label_smoothing", "label_smoothing: must be >= 0 and < 0.5, got 0.5"),
    ("simpo", {"gamma": -0.1}, "gamma", "gamma: must be >= 0, got -0.1"),
    ("orpo", {"lambda": float("nan")}, "lambda", "lambda: must be a number, got nan"),
    ("kto", {"undesirable_weight": True}, "undesirable_weight", "undesirable_weight: must be a number, got True"),
    ("ipo", {"temperature": 1}, "temperature", "temperature: not a parameter of loss ipo (it takes beta)"),
]  # fmt: skip


@pytest.mark.parametrize("loss,given,key,message", PARAM_ERRORS)
def test_parameter_errors_name_the_key(loss, given, key, message):
    problems = pl.param_problems(loss, given)
    assert [(p.key, p.message) for p in problems] == [(key, message)]
    assert problems[0].fix
    with pytest.raises(pl.PreferenceParamError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pl.resolve_params(loss, given)
    assert pl.param_problems(loss, given, known=[key]) == ([] if key != "loss" else problems)


def test_kto_weight_advice():
    assert pl.kto_weight_advice(30, 30, 1.0, 1.0) is None
    advice = pl.kto_weight_advice(10, 40, 1.0, 1.0)
    assert "0.25" in advice and "desirable_weight 4.00 to 5.33" in advice


# ── KTO rows ───────────────────────────────────────────────────────────────────────────────


def _rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _tokenizer():
    from baseten_loops_cli.tokenization import get_tokenizer

    return get_tokenizer(TINY)


def test_kto_row_shapes_render_the_same_sequence(tmp_path):
    user = {"role": "user", "content": "What is 2+1?"}
    reply = {"role": "assistant", "content": "ANSWER: 3"}
    rows = [
        {"prompt": "What is 2+1?", "completion": "ANSWER: 3", "label": True},
        {"prompt": [user], "completion": [reply], "label": False},
        {"messages": [user], "completion": reply, "label": True},
        {"completion": [user, reply], "label": False},
    ]
    examples = load_kto_examples(_rows(tmp_path / "k.jsonl", rows), _tokenizer(), max_seq_len=64)
    assert len({tuple(e.example.tokens) for e in examples}) == 1
    assert [e.label for e in examples] == [True, False, True, False]
    assert [e.row.prompt for e in examples] == [[user]] * 4
    kl = kl_examples(examples, _tokenizer(), max_seq_len=64)
    assert [e.source.endswith("(KL)") for e in kl] == [True] * 4


def test_kl_sequences_pair_each_prompt_with_the_previous_completion(tmp_path):
    """Row i's prompt with row i-1's completion (TRL's rule), cut at max_seq_len where a long
    prompt meets a long completion, always keeping the prompt and some of the completion."""
    rows = [{"prompt": "What is 0+1? Think about it for a long while first.", "completion": "ANSWER: 1", "label": True},
            {"prompt": "What is 1+1?", "completion": "ANSWER: 2", "label": False},
            {"prompt": "What is 2+1?", "completion": "ANSWER: 3, which is a long answer to give.", "label": True}]
    tok = _tokenizer()
    examples = load_kto_examples(_rows(tmp_path / "k.jsonl", rows), tok, max_seq_len=256)
    longest = max(len(e.example.tokens) for e in examples)
    kl = kl_examples(examples, tok, max_seq_len=longest)
    assert [pl.kto_mismatched_index(i, 3) for i in range(3)] == [2, 0, 1]
    assert len(kl[0].tokens) == longest  # the long prompt with the long completion: cut
    for i, seq in enumerate(kl):
        text = tok.decode(seq.tokens)
        assert f"What is {i}+1?" in text and len(seq.tokens) <= longest
        assert sum(seq.weights[1:]) > 0  # some of the other completion is always scored
    assert "ANSWER: 3" in tok.decode(kl[0].tokens) and "ANSWER: 1" in tok.decode(kl[1].tokens)
    assert "ANSWER: 2" in tok.decode(kl[2].tokens)


KTO_BAD_ROWS = [
    ({"prompt": "hi", "chosen": "a", "rejected": "b"}, "a paired row ('chosen'/'rejected') under kind: kto"),
    ({"prompt": "hi", "label": True}, "missing key 'completion'"),
    ({"prompt": "hi", "completion": "a"}, "missing key 'label'"),
    ({"prompt": "hi", "completion": "a", "label": "yes"}, "'label' must be true or false, not 'yes'"),
    ({"prompt": "hi", "completion": [{"role": "user", "content": "a"}], "label": True}, "'completion' must end with an assistant message"),
    ({"completion": "a", "label": True}, "no prompt"),
    ({"prompt": "hi", "completion": "x" * 80, "label": False}, "over max_seq_len 64"),
]  # fmt: skip


@pytest.mark.parametrize("row,message", KTO_BAD_ROWS, ids=["paired", "no-completion", "no-label", "label-string",
                                                           "no-reply", "no-prompt", "too-long"])
def test_bad_kto_rows_name_file_and_line(tmp_path, row, message):
    good = [{"prompt": "a", "completion": "b", "label": True}, {"prompt": "a", "completion": "c", "label": False}]
    path = _rows(tmp_path / "k.jsonl", [*good, "", row])
    with pytest.raises(ConfigError) as err:
        load_kto_examples(path, _tokenizer(), max_seq_len=64)
    assert err.value.message.startswith(f"{path}:4: ") and message in err.value.message, err.value.message
    assert err.value.hint or message in ("'completion' must end with an assistant message", "over max_seq_len 64")


def test_kto_needs_both_labels(tmp_path):
    path = _rows(tmp_path / "k.jsonl", [{"prompt": "a", "completion": "b", "label": True}] * 3)
    with pytest.raises(ConfigError, match=r"k\.jsonl: every row has label true; KTO needs rows labelled false \(undesirable\) too"):
        load_kto_examples(path, _tokenizer(), max_seq_len=64)
    assert check_kto_labels([True, False, True], "x.jsonl") == (2, 1)
    with pytest.raises(ConfigError, match="every row has label false"):
        check_kto_labels([False], "x.jsonl")


def test_an_unpaired_row_under_dpo_is_named():
    with pytest.raises(ConfigError, match=r"^f\.jsonl:7: an unpaired row \('completion'/'label'\) under kind: dpo") as err:
        check_paired_row({"prompt": "a", "completion": "b", "label": True}, "f.jsonl:7")
    assert "kind: kto" in err.value.hint
    check_paired_row({"prompt": "a", "chosen": "b", "rejected": "c"}, "f.jsonl:8")
    assert kto_row({"prompt": "a", "completion": "b", "label": False}, "f.jsonl:9").label is False


# ── the custom-loss path on the real engine and server ─────────────────────────────────────


def _pairs():
    from baseten_loops_cli.training.data.datums import load_preference_pairs

    return load_preference_pairs(DPO_TRAIN, _tokenizer(), max_seq_len=64)


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("peft")
    from baseten_loops_cli.local.engine import registry
    from baseten_loops_cli.local.engine.sampler import SamplerEngine

    base = registry.load_base(TINY)
    return base, SamplerEngine(base)


def _scored_datums(engine, examples):
    """dpo_datum rows whose ref_logprobs are the base model's, scored by the sampler engine the
    way the SDK's compute_logprobs does (tests/test_dpo.py does the same)."""
    from baseten_loops_cli.local.engine.sampler import SampleRequest
    from baseten_loops_cli.training.data.datums import dpo_datum, reference_logprobs_field

    results = engine[1].sample([SampleRequest(e.tokens, max_tokens=1, temperature=0.0, prompt_logprobs=0) for e in examples])
    return [dpo_datum(e, reference_logprobs_field([None if x is None else x.logprob for x in r.prompt_logprobs]))
            for e, r in zip(examples, results)]


def _model_logprobs(base, adapter, datum):
    """One unpadded forward through the model: the per-position logprob of each target."""
    tokens = datum["model_input"]["chunks"][0]["tokens"]
    with base.activate(adapter) as model:
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    targets = torch.tensor(datum["loss_fn_inputs"]["target_tokens"]["data"])
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _tensors(datum):
    inputs = datum["loss_fn_inputs"]
    return torch.tensor(inputs["ref_logprobs"]["data"]), torch.tensor(inputs["weights"]["data"])


@pytest.mark.local
def test_weights_through_the_engine_give_each_loss_its_gradient(engine):
    """The SDK's custom-loss path (forward, closed-form weights, unnormalized cross_entropy
    forward_backward) on the engine the server runs leaves the same LoRA gradient as autograd
    through the reference formula on the model's own logprobs, for every loss."""
    from baseten_loops_cli.local.engine.trainer import LoraTrainer
    from baseten_loops_cli.training.data.datums import sft_datum

    base, _ = engine
    pairs = _pairs()[:3]
    examples = [e for p in pairs for e in (p.chosen, p.rejected)]
    labels = [True, False] * len(pairs)
    datums = _scored_datums(engine, examples)
    kl_datums = _scored_datums(engine, [examples[(i + 1) % len(examples)] for i in range(len(examples))])
    trainer = LoraTrainer(base, "test-prefs-engine", 4, seed=1)
    try:
        # Move the policy off the reference first, so log-ratios and gradients are not trivial.
        trainer.forward_backward([sft_datum(p.chosen) for p in pairs], "cross_entropy")
        trainer.optim_step({"learning_rate": 2e-2})
        params = [p for _, p in base.adapter_parameters(trainer.adapter_name)]
        for loss in pl.LOSSES:
            everything = datums + (kl_datums if loss == "kto" else [])
            fwd = trainer.forward([pl.forward_datum(d) for d in everything], pl.CUSTOM_LOSS_FN, pl.CUSTOM_LOSS_CONFIG)
            scores = pl.scores_from_forward(everything, fwd)
            if loss == "kto":
                result = pl.kto_loss(scores[: len(datums)], labels, scores[len(datums):], KTO_PARAMS)
            else:
                result = pl.paired_loss(loss, scores, PARAMS[loss])
            trainer.forward_backward([pl.backward_datum(d, g) for d, g in zip(datums, result.grads)],
                                     pl.CUSTOM_LOSS_FN, pl.CUSTOM_LOSS_CONFIG)
            engine_grads = [p.grad.clone() for p in params]
            for p in params:
                p.grad = None

            lp = [_model_logprobs(base, trainer.adapter_name, d) for d in datums]
            ref, m = zip(*(_tensors(d) for d in datums))
            if loss == "kto":
                with torch.no_grad():
                    kl_lp = [_model_logprobs(base, trainer.adapter_name, d) for d in kl_datums]
                kl_ref, kl_m = zip(*(_tensors(d) for d in kl_datums))
                per_example, _ = reference_kto(lp, ref, m, labels, kl_lp, kl_ref, kl_m, KTO_PARAMS)
            else:
                per_example = reference_paired(loss, lp, list(ref), list(m), PARAMS[loss])
            per_example.sum().backward()
            assert result.loss_sum == pytest.approx(per_example.sum().item(), rel=1e-4, abs=1e-4), loss
            scale = max(p.grad.abs().max().item() for p in params)
            assert scale > 0, loss
            for got, want in zip(engine_grads, (p.grad for p in params)):
                # float32 on both sides: agreement relative to the gradient's scale
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{loss}: {m}")
            for p in params:
                p.grad = None
    finally:
        trainer.release()


@pytest.mark.local
@pytest.mark.parametrize("loss", ["dpo", "orpo", "kto"])  # with a reference, without, unpaired
def test_custom_loss_steps_on_the_local_server_lower_the_loss(local_server, loss):
    """Over real HTTP, two steps of submit_custom_loss + optim_step lower the loss (the engine
    test above covers every loss's gradient; this covers the wire). The reference is the policy
    before step 1 (a fresh LoRA adds zero: the SDK's recipe), read from the first /forward."""
    from baseten_loops_cli.training.data.datums import dpo_datum

    pairs = _pairs()[:4]
    examples = [e for p in pairs for e in (p.chosen, p.rejected)]
    labels = [True, False] * len(pairs)
    run = create_run(local_server, seed=0)
    with trainer(local_server, run["id"]) as tc:
        unscored = [dpo_datum(e, [0.0] * len(e.tokens)) for e in examples]
        first = tc.forward([pl.forward_datum(d) for d in unscored], pl.CUSTOM_LOSS_FN, pl.CUSTOM_LOSS_CONFIG)
        refs = [[0.0 if x is None else x for x in out["logprobs"]["data"]]
                for out in first.result(timeout=120)["loss_fn_outputs"]]
        datums = [dpo_datum(e, r) for e, r in zip(examples, refs)]
        kl = [datums[(i + 1) % len(datums)] for i in range(len(datums))]

        def compute(scores):
            if loss == "kto":
                return pl.kto_loss(scores[: len(datums)], labels, scores[len(datums):], KTO_PARAMS)
            return pl.paired_loss(loss, scores, PARAMS[loss])

        losses = []
        for _ in range(2):
            fb, result = pl.submit_custom_loss(tc, datums, compute, extra=kl if loss == "kto" else ())
            opt = tc.optim_step({"learning_rate": 2e-3})
            assert fb.result(timeout=120)["metrics"]["skip_token_normalization"] == 1.0
            opt.result(timeout=120)
            losses.append(result.loss)
        _, after = pl.submit_custom_loss(tc, datums, compute, extra=kl if loss == "kto" else (), backward=False)
        if loss == "dpo":  # the custom path's dpo is the protocol's dpo loss, on the same rows
            protocol = tc.forward(datums, "dpo", PARAMS["dpo"]).result(timeout=120)["metrics"]
            assert protocol["dpo_loss"] == pytest.approx(after.loss, abs=1e-4)
            assert protocol["dpo_reward_margin"] == pytest.approx(after.metrics["reward_margin"], abs=1e-4)
    assert after.loss < losses[0], (losses, after.loss)
    if loss == "dpo":  # step 0: the policy is its own reference
        assert losses[0] == pytest.approx(math.log(2), abs=1e-3)
