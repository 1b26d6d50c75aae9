"""`loops usage` against the real local backend (CPU allocations, tokens and compute per run),
plus the GPU accounting of Baseten-shaped payloads (pure functions, no server)."""

from __future__ import annotations

import re

import pytest

from baseten_loops_cli.api.models import LoopsDeployment, LoopsSampler
from baseten_loops_cli.cli import usage as usage_cmd
from baseten_loops_cli.services import usage as usage_service
from tests.cli_support import api, create_run, loops, one_line_error, seeded, trainer, wait_for  # noqa: F401  (fixture)

# `baseten loops usage -o json` (loops-protocol §4.2)
GO_SUMMARY_KEYS = {"trainer_in_use", "trainer_scaled_to_zero", "sampler_in_use", "sampler_scaled_to_zero"}
GO_ROW_KEYS = {"run_id", "owner", "base_model", "created_at", "trainer_status", "trainer_instance_type",
               "trainer_node_count", "trainer_gpus", "sampler_status", "sampler_instance_type",
               "sampler_node_count", "sampler_gpus"}


def test_usage_table_and_json_keys_match_the_go_cli(seeded):
    table = loops(seeded.server, "usage")
    assert table.code == 0, table
    assert re.search(r"Trainers: \d+ in use, \d+ scaled to zero\. Samplers: \d+ in use, \d+ scaled to zero\.", table.stderr)
    assert "local backend: CPU workers" in table.stderr
    header = table.lines[0]
    for column in ("RUN", "BASE MODEL", "TRAINER GPU", "TRAINER STATUS", "SAMPLER GPU", "SAMPLER STATUS",
                   "TOKENS TRAINED", "TOKENS SAMPLED", "COMPUTE", "CREATED"):
        assert column in header
    row = next(line for line in table.lines if line.startswith(seeded.run_id))
    assert "Local CPU" in row

    doc = loops(seeded.server, "usage", "--all", "-o", "json").json()
    assert set(doc) == {"summary", "rows"}
    assert GO_SUMMARY_KEYS <= set(doc["summary"]) and doc["summary"]["unit"] == "allocations"
    mine = next(r for r in doc["rows"] if r["run_id"] == seeded.run_id)
    assert GO_ROW_KEYS <= set(mine)
    assert mine["trainer_instance_type"] == "Local CPU" and mine["trainer_gpus"] == 0
    assert mine["tokens_trained"] > 0 and mine["compute_seconds"] > 0
    assert loops(seeded.server, "usage", "-q").lines.count(seeded.run_id) == 1


def test_idle_allocations_are_hidden_with_a_hint(seeded):
    run = create_run(seeded.server)

    def trainer_status() -> str:
        return api(seeded.server, "GET", f"/v1/loops/deployments/{run['deployment_id']}")["deployment"]["status"]["name"]

    wait_for(lambda: trainer_status() == "RUNNING")
    api(seeded.server, "POST", f"/v1/loops/runs/{run['id']}/deactivate", json={})
    assert trainer_status() == "STOPPED"
    shown = loops(seeded.server, "usage")
    assert run["id"] not in shown.stdout
    assert re.search(r"\d+ allocations? holding no live GPUs hidden; pass --all to show", shown.stderr), shown
    everything = loops(seeded.server, "usage", "--all", "-o", "json").json()["rows"]
    row = next(r for r in everything if r["run_id"] == run["id"])
    assert row["trainer_status"] == "STOPPED"


def test_by_run_reports_tokens_and_compute(seeded):
    table = loops(seeded.server, "usage", "--by-run")
    assert table.code == 0, table
    assert table.lines[0].split()[:3] == ["RUN", "BASE", "MODEL"]
    assert re.search(r"Total: [\d,]+ tokens trained, [\d,]+ sampled \([\d,]+ by deployments\), .* of compute\.", table.stderr)
    doc = loops(seeded.server, "usage", "--by-run", "--all", "-o", "json").json()
    assert set(doc) == {"runs", "totals"}
    mine = next(r for r in doc["runs"] if r["run_id"] == seeded.run_id)
    assert mine["tokens_trained"] > 0 and mine["operations"] > 0
    assert doc["totals"]["tokens_trained"] >= mine["tokens_trained"]


def test_sampling_a_runs_checkpoints_anywhere_counts_for_the_run(seeded):
    """`loops sample RUN:NAME` (a standalone sampler) and a deployment's chat request both
    count for the run whose checkpoint they served; the deployments' share is shown apart."""
    import httpx

    def mine() -> dict:
        doc = loops(seeded.server, "usage", "--by-run", "--all", "-o", "json").json()
        return next(r for r in doc["runs"] if r["run_id"] == seeded.run_id)

    before = mine()
    sampled = loops(seeded.server, "sample", f"{seeded.run_id}:s2", "--prompt", "hi", "--max-tokens", "5",
                    "--temperature", "0", "-o", "json")
    assert sampled.code == 0, sampled
    after_sample = mine()
    assert after_sample["tokens_sampled"] > before["tokens_sampled"], (before, after_sample)
    assert after_sample["sample_requests"] > (before["sample_requests"] or 0)
    assert after_sample["tokens_sampled_by_deployments"] == before["tokens_sampled_by_deployments"]

    deployed = loops(seeded.server, "deploy", f"{seeded.run_id}:s2", "--model-name", "usage-bot", "-o", "json")
    assert deployed.code == 0, deployed
    answer = httpx.post(f"{deployed.json()['url']}/chat/completions",
                        headers={"Authorization": f"Api-Key {seeded.server.token}"},
                        json={"model": "s2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                        timeout=60)
    assert answer.status_code == 200, answer.text
    served = answer.json()["usage"]["completion_tokens"]
    after_deploy = mine()
    assert after_deploy["tokens_sampled"] == after_sample["tokens_sampled"] + served
    assert after_deploy["tokens_sampled_by_deployments"] == before["tokens_sampled_by_deployments"] + served
    table = loops(seeded.server, "usage", "--by-run", "--all")
    assert "BY DEPLOYMENTS" in table.lines[0], table
    assert re.search(r"sampled \([\d,]+ by deployments\)", table.stderr)


def test_sampling_and_evaluating_an_inactive_runs_checkpoint_counts_for_the_run(seeded):
    """An inactive run's checkpoint is served by a standalone sampler (`loops sample`, `loops
    eval`): its tokens and requests still count for the run in --by-run, while `usage --all`
    keeps them on the sampler's own row."""
    from pathlib import Path

    run = create_run(seeded.server)
    with trainer(seeded.server, run["id"]) as tc:
        tc.save_weights_for_sampler("frozen").result(timeout=120)
    api(seeded.server, "POST", f"/v1/loops/runs/{run['id']}/deactivate", json={})

    def row() -> dict:
        doc = loops(seeded.server, "usage", "--by-run", "--all", "-o", "json").json()
        return next(r for r in doc["runs"] if r["run_id"] == run["id"])

    assert row()["tokens_sampled"] == 0
    sampled = loops(seeded.server, "sample", f"{run['id']}:frozen", "--prompt", "hi", "--max-tokens", "4", "-o", "json")
    assert sampled.code == 0, sampled
    after_sample = row()
    assert after_sample["tokens_sampled"] == sum(len(s["tokens"]) for s in sampled.json()["samples"]) > 0
    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "tiny_sft_eval.jsonl"
    scored = loops(seeded.server, "eval", f"{run['id']}:frozen", "--data", str(data), "--limit", "2", "--no-cache", "-o", "json")
    assert scored.code == 0, scored
    assert row()["sample_requests"] > after_sample["sample_requests"]
    sampler_id = sampled.json()["sampler_id"]
    rows = loops(seeded.server, "usage", "--all", "-o", "json").json()["rows"]
    assert any(r.get("sampler_id") == sampler_id and r["tokens_sampled"] > 0 for r in rows), rows


def test_usage_empty_results(seeded):
    nobody = loops(seeded.server, "usage", "--user", "nobody@example.com")
    assert nobody.code == 0 and nobody.stdout == ""
    assert "No Loops trainers or samplers found." in nobody.stderr
    doc = loops(seeded.server, "usage", "--user", "nobody@example.com", "-o", "json").json()
    assert doc["rows"] == [] and all(doc["summary"][k] == 0 for k in GO_SUMMARY_KEYS)
    assert "OWNER" in loops(seeded.server, "usage", "--org").lines[0]
    by_run = loops(seeded.server, "usage", "--by-run", "--user", "nobody@example.com", "-o", "json").json()
    assert by_run["runs"] == []


def test_usage_bad_flags(seeded):
    assert loops(seeded.server, "usage", "--by").code == 2
    one_line_error(loops(seeded.server, "usage", "-o", "xml"), 2, "unknown output format")


# ── GPU accounting of hosted (Baseten) payloads ──────────────────────────────────────────


def _instance(name: str, gpus: int) -> dict:
    return {"id": name.lower(), "name": name, "gpu_count": gpus, "gpu_type": "H100"}


def test_rows_and_summary_from_baseten_shaped_payloads():
    deployments = [
        {"id": "d1", "active_run_id": "run1", "latest_run_id": "run1", "base_model": "Qwen/Qwen3-8B",
         "status": {"name": "RUNNING"}, "user": {"email": "a@x.com"}, "created_at": "2026-01-02T00:00:00Z",
         "instance_type": _instance("H100:8", 8), "node_count": 2,
         "sampler": {"id": "s1", "status": {"name": "SCALED_TO_ZERO"}, "instance_type": _instance("H100:1", 1), "node_count": 1}},
        {"id": "d2", "active_run_id": None, "latest_run_id": "run0", "base_model": "Qwen/Qwen3-8B",
         "status": {"name": "STOPPED"}, "user": {"email": "b@x.com"}, "created_at": "2026-01-01T00:00:00Z",
         "instance_type": _instance("H100:8", 8), "node_count": 1, "sampler": None},
    ]
    samplers = [
        {"id": "s1", "status": {"name": "SCALED_TO_ZERO"}},  # bound to d1: not a row of its own
        {"id": "s9", "base_model": "Qwen/Qwen3-8B", "status": {"name": "ACTIVE"}, "user": {"email": "a@x.com"},
         "created_at": "2026-01-03T00:00:00Z", "instance_type": _instance("H100:2", 2), "node_count": 1},
    ]
    models = usage_service.build_rows([LoopsDeployment.model_validate(d) for d in deployments],
                                      [LoopsSampler.model_validate(s) for s in samplers],
                                      {"run1": {"tokens_trained": 5, "tokens_sampled": 7, "compute_seconds": 1.5}})
    rows = [r.model_dump() for r in models]
    assert [r["run_id"] for r in rows] == [None, "run1", "run0"]
    standalone, live, stopped = rows
    assert standalone["sampler_id"] == "s9" and standalone["sampler_gpus"] == 2 and standalone["trainer_status"] is None
    assert live["trainer_gpus"] == 16 and live["sampler_gpus"] == 1 and live["tokens_trained"] == 5
    assert stopped["tokens_trained"] is None
    summary = usage_service.summarize(models, "gpus").model_dump()
    assert summary == {"trainer_in_use": 16, "trainer_scaled_to_zero": 0, "sampler_in_use": 2,
                       "sampler_scaled_to_zero": 1, "unit": "gpus"}
    assert usage_cmd._gpu_cell("H100:8", 16, 2) == "H100:8 (16 GPUs across 2 nodes)"
    assert usage_cmd._gpu_cell("H100:1", 1, 1) == "H100:1 (1 GPU)"
    assert usage_cmd._gpu_cell(None, None, None) is None


# ── usage over time: --since / --until ─────────────────────────────────────────────────────


def test_usage_since_lists_the_window_per_owner_as_csv_with_cost(seeded, tmp_path):
    """The seeded run trained within the last hour: `--since 1h` has all its tokens (as
    `--by-run` counts them), a window that ends an hour ago has none of them, and --pricing
    (a training config's pricing: section) prices each row and the total."""
    import csv
    import io
    from datetime import datetime

    by_run = loops(seeded.server, "usage", "--by-run", "--all", "-o", "json").json()
    trained = next(r for r in by_run["runs"] if r["run_id"] == seeded.run_id)["tokens_trained"]
    assert trained > 0

    got = loops(seeded.server, "usage", "--since", "1h", "-o", "csv")
    assert got.code == 0, got
    rows = list(csv.DictReader(io.StringIO(got.stdout)))
    assert list(rows[0]) == ["PERIOD", "OWNER", "KIND", "RUN", "TOKENS TRAINED", "TOKENS SAMPLED", "COMPUTE S", "REQUESTS"]
    mine = [r for r in rows if r["OWNER"] == seeded.run_id]
    assert sum(int(r["TOKENS TRAINED"]) for r in mine) == trained
    assert all(r["KIND"] == "run" and r["RUN"] == seeded.run_id for r in mine)
    assert {r["PERIOD"] for r in mine} <= {datetime.utcnow().strftime("%Y-%m-%d"), rows[0]["PERIOD"]}

    before = loops(seeded.server, "usage", "--since", "2d", "--until", "1h", "-o", "json")
    assert before.code == 0, before
    assert before.json()["periods"] == [] and before.json()["totals"]["tokens_trained"] == 0
    # A date (local midnight) and an hour's periods.
    today = datetime.now().strftime("%Y-%m-%d")
    hourly = loops(seeded.server, "usage", "--since", today, "--period", "hour", "-o", "json").json()
    assert sum(p["tokens_trained"] for p in hourly["periods"] if p["owner_id"] == seeded.run_id) == trained

    prices = tmp_path / "config.yaml"
    prices.write_text("kind: sft\npricing:\n  usd_per_million_train_tokens: 2.0\n  usd_per_hour: 3.6\n")
    priced = loops(seeded.server, "usage", "--since", "1h", "--pricing", str(prices), "-o", "json")
    assert priced.code == 0, priced
    doc = priced.json()
    assert doc["pricing"] == {"usd_per_million_train_tokens": 2.0, "usd_per_hour": 3.6}
    totals = doc["totals"]
    want = totals["tokens_trained"] / 1e6 * 2.0 + totals["compute_seconds"] / 3600 * 3.6
    assert totals["cost_usd"] == pytest.approx(want, rel=1e-4) and totals["cost_usd"] > 0
    for p in doc["periods"]:
        assert p["cost_usd"] == pytest.approx(p["tokens_trained"] / 1e6 * 2.0 + p["compute_seconds"] / 3600 * 3.6, abs=1e-6)
    table = loops(seeded.server, "usage", "--since", "1h", "--pricing", str(prices))
    assert "COST USD" in table.lines[0] and re.search(r"Total: [\d,]+ tokens trained, .*, \$\d", table.stderr), table


def test_usage_since_bad_input(seeded, tmp_path):
    one_line_error(loops(seeded.server, "usage", "--since", "yesterday"), 2, "--since", "ISO 8601")
    one_line_error(loops(seeded.server, "usage", "--since", "1h", "--until", "2h"), 2, "is not before --until")
    one_line_error(loops(seeded.server, "usage", "--until", "1h"), 2, "--since")
    one_line_error(loops(seeded.server, "usage", "--since", "1h", "--by-run"), 2, "--by-run")
    one_line_error(loops(seeded.server, "usage", "--since", "1h", "--period", "week"), 2, "--period", "hour or day")
    bad = tmp_path / "prices.yaml"
    bad.write_text("pricing:\n  usd_per_hour: -1\n")
    one_line_error(loops(seeded.server, "usage", "--since", "1h", "--pricing", str(bad)), 1, f"{bad}:2", "usd_per_hour")
    none = tmp_path / "none.yaml"
    none.write_text("kind: sft\n")
    one_line_error(loops(seeded.server, "usage", "--since", "1h", "--pricing", str(none)), 1, "no pricing: section")
