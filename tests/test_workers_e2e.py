"""TrainerClient + SamplerClient + LoopsClient end to end against the real local backend."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from baseten_loops_cli.api.client import LoopsClient  # noqa: E402
from baseten_loops_cli.api.errors import NotFoundError, RemoteOpError  # noqa: E402
from baseten_loops_cli.api.uri import CheckpointUri  # noqa: E402
from baseten_loops_cli.workers import (  # noqa: E402
    AdamParams,
    Datum,
    ModelInput,
    SamplerClient,
    TensorData,
    TrainerClient,
)

MODEL = "loops-local/tiny"


def _datum(tokens: list[int]) -> Datum:
    n = len(tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData(data=tokens[1:], dtype="int64", shape=[n]),
            "weights": TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
        },
    )


def test_train_publish_sample(local_server):
    with LoopsClient(local_server.url, local_server.token) as api:
        session = api.sessions.create()
        run = api.runs.create({"session_id": session.id, "base_model": MODEL, "lora_rank": 4, "seed": 1})
        assert run.base_url and run.is_active
        with TrainerClient(run.base_url, api_key=local_server.token, run_id=run.id, base_model=MODEL) as tc:
            tc.health()
            losses = []
            for step in range(2):
                fb = tc.forward_backward([_datum([1, 5, 9, 13, 2 + step]), _datum([3, 4, 5, 6])])
                opt = tc.optim_step(AdamParams(learning_rate=0.05))  # pipelined before fb is awaited
                losses.append(fb.parsed(timeout=300).loss)
                opt.result(timeout=300)
            assert tc.policy_version() == 2
            # bump_version=True publishes to the paired sampler (hot swap), as the SDK's
            # save_weights_and_get_sampling_client; a plain save only stages the adapter.
            saved = tc.save_weights_for_sampler("e2e", bump_version=True).parsed(timeout=300)
            assert saved.version == 2
            uri = CheckpointUri.parse(saved.path)
            assert (uri.run_id, uri.target, uri.name) == (run.id, "sampler", "e2e")
            with pytest.raises(RemoteOpError):
                tc.load_state(f"bt://loops:{run.id}/weights/missing").result(timeout=120)

        ckpts = api.checkpoints.list(run_id=run.id)
        assert any(c.checkpoint_id == "e2e" for c in ckpts)

        sampler = api.runs.get(run.id).sampler
        if sampler is None:
            sampler = api.samplers.create({"session_id": session.id, "run_id": run.id})
        with SamplerClient(sampler.base_url, api_key=local_server.token, run_id=run.id, ready_timeout=120) as sc:
            sc.wait_for_policy_version(2, timeout=120)
            res = sc.sample([1, 5, 9], n=2, max_tokens=4, temperature=1.0, seed=3, min_policy_version=2)
            assert len(res.sequences) == 2
            for seq in res.sequences:
                assert 1 <= len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)
                assert seq.stop_reason in ("stop", "length")
            assert res.policy_version is None or res.policy_version >= 2
            assert sc.trainers_policy_version() >= 2

        api.runs.deactivate(run.id)
        with pytest.raises(NotFoundError):
            api.runs.get("no-such-run")
