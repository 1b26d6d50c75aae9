"""`loops reward test`: a config's reward or environment on real samples of the base model, so a
broken reward is found before a run (nothing is trained; the samplers it starts are stopped)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from baseten_loops_cli.errors import UsageError

if TYPE_CHECKING:
    from baseten_loops_cli.services import Connected  # the backend: cli._backend.Backend is one
    from baseten_loops_cli.training.config import LoadedConfig


def test_rewards(backend: "Connected", loaded: "LoadedConfig", *, rows: int,
                 on_started: Callable[[str, str], None] | None = None) -> list[dict]:
    """One reply or episode per row (the first ``rows`` rows), each as samples.jsonl records it:
    reward, per-reward values, transcript and per-turn rewards, or the failure and traceback."""
    from baseten_loops_cli.services.evaluation import SamplerPool
    from baseten_loops_cli.training import kinds, service

    kind = kinds.of(loaded.config)
    if kind.reward_test is None:
        raise UsageError(f"{loaded.path}: a {kind.name} config has no reward or environment to test",
                         hint="Pass an RL config (kind: rl, with reward: or env:).")
    data = service.load_data(loaded)
    from types import SimpleNamespace

    pool = SamplerPool(backend.client, backend.api_key, on_started)
    # What a judge served by the backend (a checkpoint or base model) samples with, as in a run.
    serving = SimpleNamespace(client=backend.client, api_key=backend.api_key, new_model_sampler_client=pool.for_base)
    try:
        return kind.reward_test(loaded, data, lambda: pool.for_base(loaded.config.base_model), rows, serving=serving)
    finally:
        pool.close()
