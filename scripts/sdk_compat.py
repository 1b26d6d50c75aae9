#!/usr/bin/env python3
"""Drive the local server with the official SDK (``baseten-loops`` 0.32.0).

The SDK is the judge of protocol fidelity: if it can run its quickstart against our
server, the envelopes, statuses, long-polls and weight-sync headers are right.

Run it with the SDK's own interpreter (Python >= 3.12, outside this repo's venv; by default
``scripts/install_sdk_venv.sh`` makes it in ``~/.cache/loops-tests/sdk-venv``):

    eval "$(loops server env)"                 # LOOPS_BASE_URL + BASETEN_API_KEY
    SDK_VENV/bin/python scripts/sdk_compat.py [--model loops-local/tiny] [--json]

It prints one line per step and, with ``--json``, a final JSON summary on stdout.
Exit status 0 = every step passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

STEPS: list[tuple[str, float, str]] = []  # (name, seconds, outcome)


def run_step(name: str, fn: Callable[[], Any]) -> Any:
    """Run one step of the flow, timing it and recording the outcome."""
    started = time.monotonic()
    try:
        value = fn()
    except Exception:
        STEPS.append((name, time.monotonic() - started, "FAILED"))
        print(f"FAIL {name}", file=sys.stderr, flush=True)
        raise
    STEPS.append((name, time.monotonic() - started, "ok"))
    print(f"ok   {name} ({time.monotonic() - started:.1f}s)", file=sys.stderr, flush=True)
    return value


def make_datum(tokens: list[int]):
    from baseten.loops import Datum, ModelInput, TensorData

    # Inputs are tokens[:-1]; the label at position i is token i+1 (no internal shift).
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
            "weights": TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32",
                                  shape=[len(tokens) - 1]),
        },
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="loops-local/tiny")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    parser.add_argument("--verbose", action="store_true", help="SDK INFO logs on stderr")
    args = parser.parse_args()
    for var in ("LOOPS_BASE_URL", "BASETEN_API_KEY"):
        if not os.environ.get(var):
            print(f"{var} is not set; run: eval \"$(loops server env)\"", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # Quiet the SDK's "set the log level to INFO" nudge when not verbose.
    logging.getLogger("baseten.loops.service_client").setLevel(
        logging.INFO if args.verbose else logging.ERROR)

    from baseten.loops import AdamParams, ModelInput, SamplingParams, ServiceClient

    summary: dict[str, Any] = {"base_url": os.environ["LOOPS_BASE_URL"], "model": args.model}
    try:
        service = run_step("ServiceClient() creates a session", ServiceClient)
        caps = run_step("get_server_capabilities", service.get_server_capabilities)
        assert args.model in [m.model_name for m in caps.supported_models], caps
        training = run_step(
            "create_lora_training_client (trainer ready)",
            lambda: service.create_lora_training_client(args.model, rank=args.rank,
                                                        ready_timeout=120))
        summary["run_id"] = training.run_id

        data = [make_datum([1, 5, 9, 13, 17, 21, 25, 29]), make_datum([2, 4, 6, 8, 10, 12])]

        def train_steps() -> list[float]:
            losses = []
            for _ in range(3):
                fb = training.forward_backward(data, "cross_entropy")  # pipelined with:
                opt = training.optim_step(AdamParams(learning_rate=5e-2))
                losses.append(fb.result().loss)
                opt.result()
            return losses

        summary["losses"] = run_step("forward_backward + optim_step x3 (pipelined)", train_steps)
        summary["policy_version"] = run_step("policy_version", lambda: training.policy_version)
        assert summary["policy_version"] == 3, summary

        fwd = run_step("forward (eval)", lambda: training.forward(data, "cross_entropy").result())
        assert len(fwd.loss_fn_outputs) == len(data)

        if importlib.util.find_spec("torch") is None:  # the SDK's optional torch extra
            STEPS.append(("forward_backward_custom", 0.0, "skipped (no torch in this venv)"))
            print("skip forward_backward_custom (pip install 'baseten-loops[torch]')",
                  file=sys.stderr)
            run_step("forward_backward + optim_step", lambda: (
                training.forward_backward(data, "cross_entropy").result(),
                training.optim_step(AdamParams(learning_rate=1e-3)).result()))
        else:
            run_step("forward_backward_custom", lambda: training.forward_backward_custom(
                data, lambda d, lps: (-sum(lp.sum() for lp in lps), {"custom": 1.0})).result())
            run_step("optim_step after the custom loss",
                     lambda: training.optim_step(AdamParams(learning_rate=1e-3)).result())

        sampler = run_step("save_weights_and_get_sampling_client",
                           training.save_weights_and_get_sampling_client)
        prompt = ModelInput.from_ints([1, 5, 9])
        resp = run_step("sample (2 sequences, pinned to the new policy)", lambda: sampler.sample(
            prompt, num_samples=2,
            sampling_params=SamplingParams(max_tokens=6, temperature=0.8, seed=1)))
        assert len(resp.sequences) == 2 and all(s.tokens for s in resp.sequences), resp
        assert resp.policy_version == 4, resp.policy_version
        summary["sample"] = [s.tokens for s in resp.sequences]
        logprobs = run_step("compute_logprobs", lambda: sampler.compute_logprobs(prompt))
        assert logprobs[0] is None and all(lp is not None for lp in logprobs[1:]), logprobs

        saved = run_step("save_state", lambda: training.save_state("step-4").result())
        assert saved.path.endswith("/weights/step-4"), saved

        checkpoints = run_step("list_checkpoints", training.list_checkpoints)
        names = sorted((c.checkpoint_id, c.target.value) for c in checkpoints)
        summary["checkpoints"] = names
        assert ("default", "sampler") in names and ("step-4", "trainer") in names, names

        with tempfile.TemporaryDirectory() as tmp:
            download = run_step(
                "download_checkpoint (sampler weights)",
                lambda: training.download_checkpoint(name="default", target="sampler",
                                                     dest_dir=str(Path(tmp) / "adapter")))
            files = sorted(p.name for p in Path(download.dest_dir).rglob("*") if p.is_file())
            summary["downloaded"] = {"files": files, "bytes": download.bytes_written}
            assert download.file_count == len(files) > 0, download

        pinned = run_step(
            "TrainingClient.create_sampling_client(model_path)",
            lambda: training.create_sampling_client(
                f"bt://loops:{training.run_id}/sampler_weights/default"))
        run_step("sample from the pinned checkpoint", lambda: pinned.sample(
            prompt, sampling_params=SamplingParams(max_tokens=3, temperature=0.0)))

        base = run_step(
            "ServiceClient.create_sampling_client(base_model)",
            lambda: service.create_sampling_client(base_model=args.model, ready_timeout=60))
        run_step("sample from the base model", lambda: base.sample(
            prompt, sampling_params=SamplingParams(max_tokens=3, temperature=0.0)))

        resumed = run_step(
            "create_training_client_from_state_with_optimizer",
            lambda: service.create_training_client_from_state_with_optimizer(
                f"bt://loops:{training.run_id}/weights/step-4"))
        summary["resumed_policy_version"] = resumed.policy_version
        assert resumed.policy_version == 4, resumed.policy_version
        run_step("train one step on the resumed run", lambda: (
            resumed.forward_backward(data, "cross_entropy").result(),
            resumed.optim_step(AdamParams(learning_rate=1e-3)).result()))

        for client in (sampler, pinned, base):
            client.close()
        training.close()
        resumed.close()
        summary["ok"] = True
    except Exception:
        traceback.print_exc()
        summary["ok"] = False
    summary["steps"] = [{"name": n, "seconds": round(t, 2), "outcome": o} for n, t, o in STEPS]
    if args.json:
        print(json.dumps(summary, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
