"""`loops sample` against the real local backend: from a run's latest weights and from a
checkpoint (by name, URI or id), chat templates, JSON with tokens and logprobs, and bad inputs."""

from __future__ import annotations

import json

from tests.cli_support import QUESTION, SECRET, api, create_run, loops, one_line_error, seeded, trainer  # noqa: F401


def test_sample_a_checkpoint_with_the_chat_template(seeded):
    result = loops(seeded.server, "sample", f"{seeded.run_id}:s2", "--chat", "--prompt", QUESTION,
                   "--temperature", "0", "--max-tokens", "16")
    assert result.code == 0, result
    assert result.stdout.strip().startswith(SECRET)
    assert f"Sampled {seeded.run_id}:s2 (loops-local/tiny" in result.stderr


def test_sample_a_run_uses_its_latest_published_weights(seeded):
    result = loops(seeded.server, "sample", seeded.run_id, "--chat", "--prompt", QUESTION, "--temperature", "0",
                   "--max-tokens", "16", "-o", "json")
    assert result.code == 0, result
    doc = result.json()
    assert doc["run_id"] == seeded.run_id and doc["checkpoint"] is None
    assert doc["samples"][0]["text"].startswith(SECRET)
    assert doc["policy_version"] is not None and doc["policy_version"] > 0


def test_json_has_tokens_and_logprobs(seeded):
    result = loops(seeded.server, "sample", seeded.cp("s1")["id"], "--prompt", "hello", "-n", "2", "--max-tokens", "5",
                   "--seed", "7", "-o", "json")
    assert result.code == 0, result
    doc = result.json()
    assert doc["checkpoint_id"] == seeded.cp("s1")["id"] and doc["uri"].endswith("/sampler_weights/s1")
    assert doc["prompt"] == "hello" and doc["prompt_tokens"] and not doc["chat"]
    assert len(doc["samples"]) == 2
    for s in doc["samples"]:
        assert 0 < len(s["tokens"]) <= 5 and len(s["logprobs"]) == len(s["tokens"])
        assert all(lp <= 0 for lp in s["logprobs"]) and s["stop_reason"] in ("length", "stop")
    again = loops(seeded.server, "sample", seeded.cp("s1")["id"], "--prompt", "hello", "-n", "2", "--max-tokens", "5",
                  "--seed", "7", "-o", "json").json()
    assert [s["tokens"] for s in again["samples"]] == [s["tokens"] for s in doc["samples"]]  # --seed reproduces


def test_several_samples_in_table_and_jsonl(seeded):
    uri = f"bt://loops:{seeded.run_id}/sampler_weights/s2"
    table = loops(seeded.server, "sample", uri, "--prompt", "hi", "-n", "2", "--max-tokens", "4")
    assert table.code == 0, table
    assert sum(line.startswith("--- sample ") for line in table.lines) == 2
    lines = loops(seeded.server, "sample", uri, "--prompt", "hi", "-n", "3", "--max-tokens", "4", "-o", "jsonl").lines
    assert [json.loads(line)["index"] for line in lines] == [0, 1, 2]
    stdin = loops(seeded.server, "sample", uri, "--chat", "--prompt", "-", "--temperature", "0", "--max-tokens", "16",
                  input=QUESTION)
    assert stdin.code == 0 and stdin.stdout.strip().startswith(SECRET)


def test_sampling_a_deactivated_runs_checkpoint_starts_a_standalone_sampler(seeded):
    run = create_run(seeded.server)
    with trainer(seeded.server, run["id"]) as tc:
        tc.save_weights_for_sampler("frozen").result(timeout=120)
    api(seeded.server, "POST", f"/v1/loops/runs/{run['id']}/deactivate", json={})
    first = loops(seeded.server, "sample", f"{run['id']}:frozen", "--prompt", "hi", "--max-tokens", "3", "-o", "json")
    assert first.code == 0, first
    assert "Started sampler" in first.stderr and "loops samplers deactivate" in first.stderr
    second = loops(seeded.server, "sample", f"{run['id']}:frozen", "--prompt", "hi", "--max-tokens", "3", "-o", "json")
    assert second.code == 0 and "Started sampler" not in second.stderr  # reused
    assert second.json()["sampler_id"] == first.json()["sampler_id"]
    # A run without a checkpoint name: the hint offers its newest sampler checkpoint as RUN:NAME
    # (RUN:final after `loops train`, below).
    one_line_error(loops(seeded.server, "sample", run["id"], "--prompt", "hi"), 1, f"run {run['id']} is INACTIVE",
                   f"Sample its newest checkpoint: loops sample {run['id']}:frozen")
    trained = create_run(seeded.server)
    with trainer(seeded.server, trained["id"]) as tc:
        tc.save_weights_for_sampler("final").result(timeout=120)
    api(seeded.server, "POST", f"/v1/loops/runs/{trained['id']}/deactivate", json={})
    one_line_error(loops(seeded.server, "sample", trained["id"], "--prompt", "hi"), 1, "no live weights",
                   f"loops sample {trained['id']}:final")


def test_sample_bad_inputs(seeded):
    one_line_error(loops(seeded.server, "sample", f"{seeded.run_id}:t1", "--prompt", "hi"), 2, "is a trainer checkpoint")
    one_line_error(loops(seeded.server, "sample", f"bt://loops:{seeded.run_id}/weights/t1", "--prompt", "hi"), 2,
                   "is a trainer checkpoint")
    typo = seeded.run_id[:-1] + ("x" if seeded.run_id[-1] != "x" else "y")
    one_line_error(loops(seeded.server, "sample", typo, "--prompt", "hi"), 1, f"no run or checkpoint '{typo}'",
                   f"Did you mean {seeded.run_id}?")
    one_line_error(loops(seeded.server, "sample", seeded.run_id, "--prompt", "  "), 2, "the prompt is empty")
    one_line_error(loops(seeded.server, "sample", seeded.run_id, "--prompt", "hi", "--system", "be brief"), 2,
                   "--system needs --chat")
    assert loops(seeded.server, "sample", seeded.run_id).code == 2  # --prompt is required
    assert loops(seeded.server, "sample", seeded.run_id, "--prompt", "hi", "-n", "0").code == 2
    too_long = loops(seeded.server, "sample", seeded.run_id, "--prompt", "hi", "--max-tokens", "100000")
    one_line_error(too_long, 1, "max_tokens")
