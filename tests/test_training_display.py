"""The live view's pieces as units: the ETA estimator and the sparkline."""

from __future__ import annotations

import random

from baseten_loops_cli.output.training_view import SPARK, EtaEstimator, sparkline


def _estimates(step_times: list[float], start_step: int = 0) -> list[float]:
    eta = EtaEstimator(start_step + len(step_times), start_step, now=0.0)
    now, out = 0.0, []
    for i, dt in enumerate(step_times, start=start_step + 1):
        now += dt
        out.append(eta.update(i, now=now))
    return out


def test_eta_never_jumps_more_than_2x_after_the_first_tenth():
    rng = random.Random(0)
    # Noisy steps, slow first steps (warm-up), and a checkpoint/eval every 10th step at 10x.
    times = [3.0, 2.0] + [rng.uniform(0.2, 0.6) * (10 if i % 10 == 0 else 1) for i in range(2, 200)]
    estimates = _estimates(times)
    for step, (prev, cur) in enumerate(zip(estimates, estimates[1:]), start=2):
        if step >= 0.1 * len(times) and prev > 0 and cur > 0:
            assert 0.5 <= cur / prev <= 2.0, (step, prev, cur)
    assert estimates[-1] == 0.0


def test_eta_is_right_for_steady_steps_and_after_resume():
    estimates = _estimates([0.5] * 40, start_step=60)  # steps 61..100, resumed at 60
    assert abs(estimates[0] - 39 * 0.5) < 1e-9
    assert abs(estimates[19] - 20 * 0.5) < 1e-9


def test_sparkline_scales_to_the_whole_run():
    # Loss drops 5.7 -> ~0.4, then a flat tail with tiny noise: the tail must look flat (lowest
    # bar), not be stretched over the full height.
    values = [5.7 - i * 0.5 for i in range(10)] + [0.40 + 0.01 * (i % 3) for i in range(40)]
    line = sparkline(values, width=30)
    assert len(line) == 30
    assert set(line) == {SPARK[0]}
    assert sparkline([1.0, 2.0, 3.0]) == SPARK[0] + SPARK[3] + SPARK[-1]
    assert sparkline([]) == ""
