"""The RL algorithms of `kind: rl` (training/losses/rl_algorithms.py): each loss and advantage against
an independent torch computation written from the papers' formulas (value and gradient, 1e-5),
each `algorithm:` preset learning the tiny RL example through the real local server, and a
SIGKILL + resume of a DAPO run (dynamic sampling draws the same groups again)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PRESETS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo")


def loops(server, *args, timeout=300):
    from tests.support import cli_env

    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], check=False, env=cli_env(server),
                          capture_output=True, text=True, timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


@pytest.mark.local
@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_lifts_the_tiny_rl_reward(local_server, tmp_path, preset):
    """6 steps of `--set algorithm=PRESET` on examples/tiny-rl.yaml. Measured (seed 0, float32
    CPU server): the step reward goes from ~0.02 at step 1 to 0.27 (dapo, which also pays the
    overlong penalty) .. 0.95 (dr_grpo) at step 6; the bound is the last two steps' mean above
    0.2 and 0.15 above the first two's."""
    run_dir = tmp_path / preset
    result = loops(local_server, "train", "run", str(EXAMPLES / "tiny-rl.yaml"), "--run-dir", str(run_dir),
                   "--set", f"algorithm={preset}", "--set", "max_steps=6", "--set", "data.eval_prompts=null")
    assert result.returncode == 0, result.stderr
    records = [r for r in metrics(run_dir) if not r.get("final")]
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert len(rewards) == 6 and last > 0.2 and last > first + 0.15, rewards
    # Each piece logs its own health signal.
    if preset in ("grpo", "dr_grpo", "dapo", "gspo"):
        assert all(0 <= r["clip_low_fraction"] <= 1 and 0 <= r["clip_high_fraction"] <= 1 for r in records)
    if preset == "gspo":
        assert all(r["sequence_ratio_std"] >= 0 and r["sequence_ratio_mean"] > 0 for r in records)
    if preset == "dapo":
        assert all(r["groups_resampled"] >= 0 and r["overlong_penalty"] <= 0 for r in records)
    if preset == "rloo":
        assert "clip_low_fraction" not in records[-1]


def test_validate_prints_the_expansion_and_an_unknown_name_lists_the_known_ones(local_server, tmp_path):
    result = loops(local_server, "train", "validate", str(EXAMPLES / "tiny-rl.yaml"), "--offline",
                   "--set", "algorithm=dapo", "--set", "loss.clip_high=0.3")
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert ("algorithm dapo: advantage group_mean, normalize std, length_normalization token; loss ppo (ratio clipped "
            "to [0.8, 1.3]); overlong penalty 1 over the last 2 of 8 tokens; dynamic sampling (up to 3 rounds)") in out, out
    bad = loops(local_server, "train", "validate", str(EXAMPLES / "tiny-rl.yaml"), "--offline", "--set", "algorithm=ppo2")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    (line,) = [l for l in bad.stderr.splitlines() if l.startswith("Error: ")]
    assert "algorithm" in line and all(repr(name) in line for name in PRESETS), line


def _dapo_config(tmp_path: Path) -> Path:
    """tiny-rl under DAPO with an all-or-nothing reward (a digit anywhere), so that many groups
    score alike and dynamic sampling draws replacements."""
    (tmp_path / "anydigit.py").write_text(
        "def any_digit(completion, row):\n    return float(any(c.isdigit() for c in completion))\n")
    config = (EXAMPLES / "tiny-rl.yaml").read_text()
    config = config.replace("data/tiny_rl_prompts.jsonl", str(EXAMPLES / "data/tiny_rl_prompts.jsonl"))
    config = config.replace("rewards.py:digit_fraction", "anydigit.py:any_digit")
    config = config.replace("group_size: 8", "group_size: 4").replace("groups_per_batch: 8", "groups_per_batch: 4")
    config = config.replace("save_every: 5", "save_every: 1")
    config += "algorithm: dapo\nmax_steps: 4\n"
    path = tmp_path / "dapo.yaml"
    path.write_text(config.replace("  eval_prompts: data/tiny_rl_eval.jsonl\n", ""))
    return path


def test_sigkill_then_resume_of_a_dapo_run_gives_the_same_steps(local_server, tmp_path):
    """Dynamic sampling's draws are a function of (seed, step, round): the resumed run redraws
    the same groups and ends with the clean run's adapter."""
    from tests.cli_support import kill_once_then_resume

    kill_once_then_resume(local_server, _dapo_config(tmp_path), tmp_path, steps=4, kill_after=2, atol=1e-4)
    clean = [r for r in metrics(tmp_path / "clean") if not r.get("final")]
    killed = {r["step"]: r for r in metrics(tmp_path / "killed") if not r.get("final")}
    assert sum(r["groups_resampled"] for r in clean) > 0, clean  # the piece under test did run
    for record in clean:
        again = killed[record["step"]]
        assert (again["groups_resampled"], again["reward"]) == (record["groups_resampled"], record["reward"])


# ------------------------------------------------------------------ against the papers' formulas
G = 4  # replies per group
GROUPS = 3


def _batch(seed: int = 0, *, rewards=None, lengths=None):
    """GROUPS groups of G replies: rewards, reply lengths, the sampler's logprobs and the
    policy's (leaf tensors, off-policy by up to ~0.3 nats so that the clips bite)."""
    gen = torch.Generator().manual_seed(seed)
    rewards = rewards or [[float(x) for x in torch.rand(G, generator=gen)] for _ in range(GROUPS)]
    lengths = lengths or [[int(x) for x in torch.randint(2, 9, (G,), generator=gen)] for _ in range(GROUPS)]
    old = [[-torch.rand(n, generator=gen, dtype=torch.float64) * 2 for n in ns] for ns in lengths]
    new = [[(o + (torch.rand(o.shape, generator=gen, dtype=torch.float64) - 0.5) * 0.6).requires_grad_(True)
            for o in os] for os in old]
    return rewards, lengths, old, new


def _our_loss(rewards, lengths, old, new, *, algorithm: str, **overrides):
    """The loss our code sends (datums from kinds.rl._datums with the preset's rule) as the local
    engine computes it, or (gspo) as the custom loss computes it, and d loss / d new."""
    from baseten_loops_cli.local.engine import losses
    from baseten_loops_cli.training.losses import rl_algorithms as algos
    from baseten_loops_cli.training.data.datums import Prompt
    from baseten_loops_cli.training.kinds.rl import RLConfig, _datums
    from baseten_loops_cli.training.kinds.rl_rollouts import Rollout
    from baseten_loops_cli.training.losses.preference_losses import score_sequence

    config = RLConfig.model_validate({
        "kind": "rl", "name": "t", "base_model": "loops-local/tiny", "data": {"prompts": "p.jsonl"},
        "reward": "exact_match", "group_size": G, "sampling": {"max_tokens": 8}, "algorithm": algorithm, **overrides})
    prompt = Prompt([1, 2, 3], {}, "row 1", "p")
    groups = [[Rollout(prompt, [5] * n, [float(x) for x in o], "", r, "stop")
               for r, n, o in zip(rs, ns, os)] for rs, ns, os in zip(rewards, lengths, old)]
    datums, kept, _ = _datums(groups, 0.0, algos.AdvantageRule.of(config))
    assert kept == GROUPS and len(datums) == GROUPS * G
    leaves = [x for group in new for x in group]
    if config.loss.name == "gspo":
        low, high = algos.clip_bounds(config.loss)
        scores, advantages = [], []
        for datum, lp in zip(datums, leaves):
            data = algos.gspo_datum(datum)["loss_fn_inputs"]
            weights = data["weights"]["data"]
            full = [0.0] * (len(weights) - len(lp)) + [float(x) for x in lp.detach()]
            scores.append(score_sequence(full, weights, data["logprobs"]["data"]))
            advantages.append(algos._sequence_advantage(datum))
        result = algos.gspo_loss(scores, advantages, low, high)
        # The backward pass's weights are -dL/dlp_t = -w_t * dL/dS: the gradient is dL/dS per token.
        grads = [torch.full_like(lp, g) for lp, g in zip(leaves, result.grads)]
        return torch.tensor(result.loss_sum, dtype=torch.float64), grads, result.metrics
    loss_fn, loss_fn_config = algos.protocol_loss(config.loss)
    resolved = losses.resolve_config(loss_fn, loss_fn_config)
    data = []
    for datum, lp in zip(datums, leaves):
        inputs = {k: torch.tensor(v["data"], dtype=torch.float64) for k, v in datum["loss_fn_inputs"].items()}
        pad = inputs["mask"].shape[0] - lp.shape[0]
        target = torch.cat([torch.zeros(pad, dtype=torch.float64), lp])
        data.append(losses.DatumLossInput(target, torch.ones_like(target, dtype=torch.bool), inputs))
    total = losses.compute(loss_fn, data, resolved).total
    return total, list(torch.autograd.grad(total, leaves)), {}


def _std_adv(r: torch.Tensor) -> torch.Tensor:
    return (r - r.mean()) / (r.std() + 1e-4)  # GRPO's A_i; the std as TRL's (unbiased) with its 1e-4


def _clip_min(ratio, adv, low, high):
    return torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


def _reference(name: str, rewards, lengths, new, old, gspo_clip=(3e-4, 4e-4)) -> torch.Tensor:
    """The papers' objectives, negated, as a sum over groups of G times each group's (the
    protocol's losses sum over datums where the papers average over a group's G replies)."""
    total = torch.zeros((), dtype=torch.float64)
    all_tokens = sum(n for ns in lengths for n in ns)
    replies = sum(len(ns) for ns in lengths)
    for rs, ns, lps, olds in zip(rewards, lengths, new, old):
        r = torch.tensor(rs, dtype=torch.float64)
        if name == "grpo":  # DeepSeekMath eq. 3 (no KL term): 1/G sum_i 1/|o_i| sum_t min(...)
            adv = _std_adv(r)
            j = sum(_clip_min(torch.exp(lp - o), adv[i], 0.8, 1.2).sum() / len(lp)
                    for i, (lp, o) in enumerate(zip(lps, olds))) / G
        elif name == "dr_grpo":  # Dr. GRPO: no std, no 1/|o_i|; a constant (the generation budget, 8)
            adv = r - r.mean()
            j = sum(_clip_min(torch.exp(lp - o), adv[i], 0.8, 1.2).sum() / 8
                    for i, (lp, o) in enumerate(zip(lps, olds))) / G
        elif name == "dapo":  # DAPO eq. 8 + 13: token-level sum / sum |o_i| over the batch, clip-higher, soft overlong
            shaped = torch.tensor([x + (0.0 if n <= 6 else (6 - n) / 2) for x, n in zip(rs, ns)], dtype=torch.float64)
            adv = _std_adv(shaped)
            j = sum(_clip_min(torch.exp(lp - o), adv[i], 0.8, 1.28).sum()
                    for i, (lp, o) in enumerate(zip(lps, olds))) / all_tokens * replies / G
        elif name == "gspo":  # GSPO eq. 5-7: s_i = (pi/pi_old)^(1/|o_i|), clipped per sequence
            adv = _std_adv(r)
            j = sum(_clip_min(torch.exp((lp - o).sum() / len(lp)), adv[i], 1 - gspo_clip[0], 1 + gspo_clip[1])
                    for i, (lp, o) in enumerate(zip(lps, olds))) / G
        elif name == "rloo":  # RLOO: A_i = r_i - mean of the others; REINFORCE (importance-weighted), 1/|o_i|
            adv = torch.stack([r[i] - (r.sum() - r[i]) / (G - 1) for i in range(G)])
            j = sum((torch.exp(lp - o) * adv[i]).sum() / len(lp) for i, (lp, o) in enumerate(zip(lps, olds))) / G
        total = total - G * j
    return total


@pytest.mark.parametrize("preset,overrides", [(p, {}) for p in PRESETS] + [
    # GSPO's own bounds clip nearly every reply of an off-policy batch: wider ones let both sides bite.
    ("gspo", {"loss": {"name": "gspo", "clip_low": 0.05, "clip_high": 0.08}}),
])
def test_each_preset_matches_its_paper_value_and_gradient(preset, overrides):
    clip = (overrides["loss"]["clip_low"], overrides["loss"]["clip_high"]) if overrides else (3e-4, 4e-4)
    for seed in range(3):
        rewards, lengths, old, new = _batch(seed)
        ours, our_grads, metrics = _our_loss(rewards, lengths, old, new, algorithm=preset, **overrides)
        ref = _reference(preset, rewards, lengths, new, old, gspo_clip=clip)
        ref_grads = torch.autograd.grad(ref, [x for g in new for x in g])
        assert ours.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-5)
        assert any(g.abs().sum() > 0 for g in our_grads)
        if overrides:  # some replies clipped, some not
            assert 0 < metrics["clip_low_fraction"] + metrics["clip_high_fraction"] < 1, metrics
        for a, b in zip(our_grads, ref_grads):
            assert torch.allclose(a.to(torch.float64), b, rtol=1e-5, atol=1e-5), (preset, a, b)


def test_the_smollm2_reasoning_example_is_valid(smollm2_cache, monkeypatch):
    """examples/smol-math-rl.yaml: every row loads with SmolLM2's tokenizer and fits 256-token
    replies, no held-out prompt is trained on, and its plan names what `algorithm: dr_grpo`
    expanded to."""
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.config import load_config
    from baseten_loops_cli.training.plan import load_data

    pytest.importorskip("math_verify")
    monkeypatch.setenv("LOOPS_CACHE_DIR", str(smollm2_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(smollm2_cache / "empty-hub"))
    loaded = load_config(EXAMPLES / "smol-math-rl.yaml")
    data = load_data(loaded)
    assert len(data.train) == 65 and len(data.eval) == 16
    assert not {tuple(p.tokens) for p in data.train} & {tuple(p.tokens) for p in data.eval}
    assert loaded.config.sampling.max_tokens == 256
    assert all(len(p.tokens) + 256 <= loaded.config.max_seq_len for p in data.train + data.eval)
    plan = kinds.of(loaded.config).estimate(loaded.config, data)
    assert any(n.startswith("algorithm dr_grpo: ") and "length_normalization constant" in n
               for n in plan.notes), plan.notes


# ------------------------------------------------------------------ the config and the pure pieces
def _config(**keys):
    from baseten_loops_cli.training.kinds.rl import RLConfig

    return RLConfig.model_validate({"kind": "rl", "name": "t", "base_model": "loops-local/tiny",
                                    "data": {"prompts": "p.jsonl"}, "reward": "exact_match", **keys})


def test_explicit_keys_override_the_preset_piece_by_piece():
    config = _config(algorithm="dapo", advantage={"normalize": "none"}, loss={"clip_high": 0.5}, dynamic_sampling=None)
    assert (config.advantage.normalize, config.advantage.length_normalization) == ("none", "token")
    assert (config.loss.name, config.loss.clip_low, config.loss.clip_high) == ("ppo", 0.2, 0.5)
    assert config.dynamic_sampling is None and config.overlong is not None
    other = _config(algorithm="dapo", loss={"name": "importance_sampling"}, overlong=False)
    assert (other.loss.name, other.loss.clip_low, other.overlong) == ("importance_sampling", None, None)
    plain = _config()  # no preset: the historical rule
    assert (plain.advantage.normalize, plain.advantage.length_normalization, plain.loss.name) == ("none", "none", "importance_sampling")
    assert plain.overlong is None and plain.dynamic_sampling is None


@pytest.mark.parametrize("keys,message", [
    ({"loss": {"name": "importance_sampling", "clip_low": 0.1}}, "clip_low applies to ppo, cispo and gspo"),
    ({"loss": {"name": "ppo", "clip_high": 0.3, "config": {"clip_high_threshold": 1.3}}}, "not both"),
    ({"algorithm": "gspo", "kl_penalty_coef": 0.1}, "not supported with loss gspo"),
    ({"advantage": {"baseline": "mean"}}, "group_mean"),
])
def test_bad_pieces_are_named(keys, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        _config(**keys)


def test_ppo_clip_epsilons_reach_the_protocol_as_thresholds():
    from baseten_loops_cli.training.losses import rl_algorithms as algos

    assert algos.protocol_loss(_config(algorithm="dapo").loss) == ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    assert algos.protocol_loss(_config(loss={"name": "ppo", "config": {"clip_low_threshold": 0.7}}).loss) == (
        "ppo", {"clip_low_threshold": 0.7})  # the config's own thresholds travel as they are
    assert algos.protocol_loss(_config().loss) == ("importance_sampling", None)


def test_overlong_penalty_follows_dapo_eq_13():
    from baseten_loops_cli.training.losses import rl_algorithms as algos

    limit, cache = 16, 4
    for length in range(0, 21):
        expected = 0.0 if length <= limit - cache else ((limit - cache) - length) / cache if length <= limit else -1.0
        assert algos.overlong_penalty(length, limit, cache, 1.0) == pytest.approx(expected)
    assert algos.overlong_penalty(16, 16, 4, 0.5) == pytest.approx(-0.5)


def test_dynamic_sampling_fills_from_new_groups_within_its_bound():
    from baseten_loops_cli.training.losses import rl_algorithms as algos

    groups = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.0]]
    versions = [3, 3, 3, 3]
    draws = iter([([[0.0, 0.0], [1.0, 0.0]], [4, 4]), ([[0.2, 0.3]], [5])])
    asked = []

    def draw(count, round_):
        asked.append((count, round_))
        return next(draws)

    out = algos.fill_groups(groups, versions, draw, 3, lambda g: g)
    assert asked == [(2, 1), (1, 2)]  # as many as were missing, each round
    assert groups == [[1.0, 0.0], [1.0, 0.0], [0.2, 0.3], [0.5, 0.0]] and versions == [3, 4, 5, 3]
    assert out == {"groups_resampled": 3, "resample_rounds": 2, "groups_unfilled": 0}
    stuck = [[0.0, 0.0]]
    out = algos.fill_groups(stuck, [0], lambda n, r: ([[1.0, 1.0]] * n, [0] * n), 2, lambda g: g)
    assert out == {"groups_resampled": 2, "resample_rounds": 2, "groups_unfilled": 1}  # bounded
    # The same (seed, step, round) draws the same prompts: what a resume relies on.
    assert algos.replacement_prompts(64, 5, seed=0, step=3, round_=1) == algos.replacement_prompts(64, 5, seed=0, step=3, round_=1)
    assert algos.replacement_prompts(64, 5, seed=0, step=3, round_=1) != algos.replacement_prompts(64, 5, seed=0, step=3, round_=2)
