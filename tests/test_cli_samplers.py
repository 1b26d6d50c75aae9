"""`loops samplers list|describe|create|deactivate` against the real local backend."""

from __future__ import annotations

import re

from tests.cli_support import TINY, loops, one_line_error, seeded  # noqa: F401  (fixture)

# LoopsSampler keys (loops-protocol §2.3)
SAMPLER_KEYS = {"id", "base_url", "base_model", "created_at", "model_id", "deployment_id", "status", "user", "instance_type", "node_count"}


def _paired(seeded) -> str:
    """The seeded run's paired sampler (created on demand)."""
    doc = loops(seeded.server, "samplers", "create", "--run-id", seeded.run_id, "-o", "json")
    assert doc.code == 0, doc
    return doc.json()["id"]


def test_list_table_and_json(seeded):
    paired = _paired(seeded)
    table = loops(seeded.server, "samplers", "list")
    assert table.code == 0, table
    assert table.lines[0].split() == ["ID", "RUN", "SERVES", "STATUS", "KIND", "CREATED"]
    row = next(line for line in table.lines if line.startswith(paired))
    assert seeded.run_id in row and TINY in row and "dedicated" in row
    doc = loops(seeded.server, "samplers", "list", "-o", "json").json()
    assert set(doc) == {"samplers"}
    assert all(SAMPLER_KEYS <= set(s) for s in doc["samplers"])
    only = loops(seeded.server, "samplers", "list", "--run-id", seeded.run_id, "-q").lines
    assert only == [paired]


def test_create_describe_and_deactivate_a_standalone_sampler(seeded):
    created = loops(seeded.server, "samplers", "create", "--checkpoint", f"{seeded.run_id}:s2", "-o", "json")
    assert created.code == 0, created
    sampler = created.json()
    assert sampler["model_path"] == f"bt://loops:{seeded.run_id}/sampler_weights/s2"
    assert f"Sampler {sampler['id']} serves bt://loops:{seeded.run_id}/sampler_weights/s2." in created.stderr

    table = loops(seeded.server, "samplers", "describe", sampler["id"])
    assert table.code == 0, table
    for needle in ("ID:", sampler["id"], "Run:", "standalone", "Serves:", "sampler_weights/s2", "Base URL:"):
        assert needle in table.stdout
    assert loops(seeded.server, "samplers", "describe", sampler["id"], "-o", "json").json()["id"] == sampler["id"]

    refused = loops(seeded.server, "samplers", "deactivate", sampler["id"])
    one_line_error(refused, 3, f"not deactivating sampler {sampler['id']}", "--yes")
    done = loops(seeded.server, "samplers", "deactivate", sampler["id"], "--yes")
    assert done.code == 0 and f"Deactivated sampler {sampler['id']}." in done.stderr
    assert sampler["id"] not in loops(seeded.server, "samplers", "list", "-q").lines
    assert re.search(r"\d+ inactive samplers? hidden; pass --all", loops(seeded.server, "samplers", "list").stderr)
    assert sampler["id"] in loops(seeded.server, "samplers", "list", "--all", "-q").lines
    again = loops(seeded.server, "samplers", "deactivate", sampler["id"], "--yes")
    assert again.code == 0 and "already INACTIVE" in again.stderr


def test_create_for_a_base_model_and_a_run(seeded):
    base = loops(seeded.server, "samplers", "create", "--base-model", TINY, "--max-seq-len", "256", "-q")
    assert base.code == 0 and re.fullmatch(r"\w+\n", base.stdout), base
    paired_twice = {_paired(seeded), _paired(seeded)}
    assert len(paired_twice) == 1  # one paired sampler per run
    loops(seeded.server, "samplers", "deactivate", base.stdout.strip(), "--yes")


def test_empty_list(seeded):
    result = loops(seeded.server, "samplers", "list", "--run-id", "nosuchrun")
    assert result.code == 0 and result.stdout == ""
    assert "No active Loops samplers found." in result.stderr
    assert loops(seeded.server, "samplers", "list", "--run-id", "nosuchrun", "-o", "json").json() == {"samplers": []}


def test_bad_inputs(seeded):
    one_line_error(loops(seeded.server, "samplers", "create"), 2, "say what the sampler serves", "--base-model")
    one_line_error(loops(seeded.server, "samplers", "create", "--base-model", TINY, "--run-id", seeded.run_id), 2,
                   "cannot be used together")
    one_line_error(loops(seeded.server, "samplers", "create", "--checkpoint", f"{seeded.run_id}:t1"), 2, "is trainer state")
    one_line_error(loops(seeded.server, "samplers", "create", "--base-model", "nobody/none"), 1, "nobody/none")
    one_line_error(loops(seeded.server, "samplers", "create", "--run-id", "nosuchrun"), 1, "no run 'nosuchrun'")
    paired = _paired(seeded)
    typo = paired[:-1] + ("x" if paired[-1] != "x" else "y")
    one_line_error(loops(seeded.server, "samplers", "describe", typo), 1, f"no sampler '{typo}'", f"Did you mean {paired}?")
    one_line_error(loops(seeded.server, "samplers", "deactivate", typo, "--yes"), 1, f"no sampler '{typo}'")
