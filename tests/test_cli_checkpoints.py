"""`loops checkpoints list|describe|files|validate|source` against the real local backend (download
is in test_download.py): the three ways to name a checkpoint, table and JSON output, empty
results and bad inputs."""

from __future__ import annotations

import json

import pytest

from tests.cli_support import TINY, loops, one_line_error, seeded  # noqa: F401  (fixture)

# LoopsCheckpoint keys (loops-protocol §2.3) of `baseten loops checkpoint list -o json`.
GO_CHECKPOINT_KEYS = {"id", "checkpoint_id", "run_id", "target", "checkpoint_type", "base_model", "size_bytes", "created_at"}


def test_list_table_and_json(seeded):
    table = loops(seeded.server, "checkpoints", "list", "--run-id", seeded.run_id)
    assert table.code == 0, table
    assert table.lines[0].split() == ["ID", "NAME", "RUN", "TARGET", "TYPE", "SIZE", "CREATED"]
    assert len(table.lines) == 5
    assert any(" KiB " in line for line in table.lines[1:])
    doc = loops(seeded.server, "checkpoints", "list", "--run-id", seeded.run_id, "-o", "json").json()
    assert set(doc) == {"checkpoints"} and len(doc["checkpoints"]) == 4
    assert all(GO_CHECKPOINT_KEYS <= set(c) for c in doc["checkpoints"])
    created = [c["created_at"] for c in doc["checkpoints"]]
    assert created == sorted(created, reverse=True)
    jq = loops(seeded.server, "checkpoints", "list", "--run-id", seeded.run_id, "--jq",
               '.checkpoints[] | select(.target != "trainer") | .checkpoint_id')
    assert sorted(jq.lines) == ['"s1"', '"s2"'] or sorted(jq.lines) == ["s1", "s2"]


def test_list_filters_sorting_and_selectors(seeded):
    samplers = loops(seeded.server, "checkpoints", "list", "--run", seeded.run_id, "--target", "sampler", "-o", "json").json()
    assert {c["checkpoint_id"] for c in samplers["checkpoints"]} == {"s1", "s2"}
    by_size = loops(seeded.server, "checkpoints", "list", "--run-id", seeded.run_id, "--sort", "size", "-o", "json").json()
    sizes = [c["size_bytes"] for c in by_size["checkpoints"]]
    assert sizes == sorted(sizes, reverse=True)
    smallest_first = loops(seeded.server, "checkpoints", "list", "--run-id", seeded.run_id, "--sort", "size", "--reverse", "-q").lines
    assert smallest_first == [c["id"] for c in reversed(by_size["checkpoints"])]
    by_model = loops(seeded.server, "checkpoints", "list", "--base-model", TINY, "-q").lines
    assert {c["id"] for c in seeded.checkpoints.values()} <= set(by_model)
    everything = loops(seeded.server, "checkpoints", "list", "-q").lines
    assert {c["id"] for c in seeded.checkpoints.values()} <= set(everything)
    uri = f"bt://loops:{seeded.run_id}/weights/t1"
    at_uri = loops(seeded.server, "checkpoints", "list", "--uri", uri, "-o", "json").json()["checkpoints"]
    assert [c["id"] for c in at_uri] == [seeded.cp("t1", "trainer")["id"]]
    assert loops(seeded.server, "checkpoints", "list", "--run-id", seeded.run_id, "--limit", "1", "-q").lines == [created_newest(seeded)]


def created_newest(seeded) -> str:
    return max(seeded.checkpoints.values(), key=lambda c: c["created_at"])["id"]


def test_list_empty_results(seeded):
    result = loops(seeded.server, "checkpoints", "list", "--base-model", "nobody/none")
    assert result.code == 0 and result.stdout == ""
    assert "No Loops checkpoints found for nobody/none." in result.stderr
    assert loops(seeded.server, "checkpoints", "list", "-m", "nobody/none", "-o", "json").json() == {"checkpoints": []}
    missing = f"bt://loops:{seeded.run_id}/weights/never-saved"
    assert loops(seeded.server, "checkpoints", "list", "--uri", missing, "-o", "json").json() == {"checkpoints": []}


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["--run-id", "abc", "--base-model", "x/y"], 2, "--run-id and --base-model cannot be used together"),
        (["--uri", "abc:s1"], 2, "--uri needs a bt:// URI"),
        (["--uri", "bt://loops:abc/nope/x"], 2, "malformed checkpoint URI"),
        (["--target", "both"], 2, "--target must be 'sampler' or 'trainer'"),
        (["--sort", "colour"], 2, "--sort must be one of"),
        (["--run-id", "nosuchrun"], 1, "no run 'nosuchrun'"),
    ],
)
def test_list_bad_inputs(seeded, args, code, needle):
    one_line_error(loops(seeded.server, "checkpoints", "list", *args), code, needle)


def test_describe_by_id_uri_and_name(seeded):
    cp = seeded.cp("s2")
    by_id = loops(seeded.server, "checkpoints", "describe", cp["id"], "-o", "json").json()
    by_uri = loops(seeded.server, "checkpoints", "describe", f"bt://loops:{seeded.run_id}/sampler_weights/s2", "-o", "json").json()
    by_name = loops(seeded.server, "checkpoints", "describe", f"{seeded.run_id}:s2", "--target", "sampler", "-o", "json").json()
    assert by_id == by_uri == by_name
    assert by_id["id"] == cp["id"] and by_id["uri"] == f"bt://loops:{seeded.run_id}/sampler_weights/s2"
    assert GO_CHECKPOINT_KEYS <= set(by_id)
    table = loops(seeded.server, "checkpoints", "describe", f"{seeded.run_id}:t1")
    assert table.code == 0, table
    for needle in ("Name:", "t1", "Target:", "trainer state", "LoRA Rank:", "16", "URI:", f"bt://loops:{seeded.run_id}/weights/t1"):
        assert needle in table.stdout


def test_describe_bad_inputs_and_suggestions(seeded):
    shared = loops(seeded.server, "checkpoints", "describe", f"{seeded.run_id}:s2")
    one_line_error(shared, 2, "2 checkpoints of run", "are named 's2'", "--target")
    typo = loops(seeded.server, "checkpoints", "describe", f"{seeded.run_id}:t2")
    one_line_error(typo, 1, f"no checkpoint named 't2' in run {seeded.run_id}", "Did you mean")
    wrong_target = loops(seeded.server, "checkpoints", "describe", f"{seeded.run_id}:t1", "--target", "sampler")
    one_line_error(wrong_target, 1, "no sampler checkpoint named 't1'", "There is a trainer checkpoint of that name")
    contradiction = loops(seeded.server, "checkpoints", "describe", f"bt://loops:{seeded.run_id}/weights/t1", "--target", "sampler")
    one_line_error(contradiction, 2, "contradicts")
    one_line_error(loops(seeded.server, "checkpoints", "describe", "nosuchrun:s1"), 1, "no run 'nosuchrun'")
    cp_id = seeded.cp("s1")["id"]
    near = cp_id[:-1] + ("A" if cp_id[-1] != "A" else "B")
    one_line_error(loops(seeded.server, "checkpoints", "describe", near), 1, f"no checkpoint '{near}'", f"Did you mean {cp_id}?")
    for bad in ("abc:", ":name", "a/b", "s3://bucket/x"):
        assert loops(seeded.server, "checkpoints", "describe", bad).code == 2, bad


def test_files_table_json_and_jsonl(seeded):
    cp = seeded.cp("s1")
    table = loops(seeded.server, "checkpoints", "files", f"{seeded.run_id}:s1")
    assert table.code == 0, table
    assert table.lines[0].split() == ["NAME", "SIZE", "URL"]
    assert any(line.startswith("adapter_model.safetensors") and "/files/" in line for line in table.lines)
    doc = loops(seeded.server, "checkpoints", "files", cp["id"], "-o", "json").json()
    assert doc["checkpoint_id"] == cp["id"]
    assert {f["relative_file_name"] for f in doc["files"]} == {"adapter_config.json", "adapter_model.safetensors"}
    assert all({"url", "relative_file_name", "size_bytes", "node_rank", "last_modified"} <= set(f) for f in doc["files"])
    lines = loops(seeded.server, "checkpoints", "files", cp["id"], "-o", "jsonl").lines
    assert [json.loads(line)["relative_file_name"] for line in lines] == [f["relative_file_name"] for f in doc["files"]]
    assert loops(seeded.server, "checkpoints", "files", cp["id"], "-q").lines == [f["relative_file_name"] for f in doc["files"]]
    one_line_error(loops(seeded.server, "checkpoints", "files", "nOsUcH00"), 1, "no checkpoint 'nOsUcH00'")


def test_validate(seeded):
    ok = loops(seeded.server, "checkpoints", "validate", f"bt://loops:{seeded.run_id}/sampler_weights/s2")
    assert ok.code == 0, ok
    assert "is valid: it can be served by a sampler" in ok.stderr
    by_name = loops(seeded.server, "checkpoints", "validate", f"{seeded.run_id}:s2", "--run-id", seeded.run_id, "-o", "json")
    assert by_name.json() == {"checkpoint_path": f"bt://loops:{seeded.run_id}/sampler_weights/s2", "run_id": seeded.run_id, "valid": True}
    trainer = loops(seeded.server, "checkpoints", "validate", f"bt://loops:{seeded.run_id}/weights/t1")
    one_line_error(trainer, 1, "cannot be served", "trainer state")
    missing = loops(seeded.server, "checkpoints", "validate", f"bt://loops:{seeded.run_id}/sampler_weights/zz")
    one_line_error(missing, 1, "cannot be served")
    one_line_error(loops(seeded.server, "checkpoints", "validate", f"{seeded.run_id}:s2", "--run-id", "nosuchrun"), 1, "no run 'nosuchrun'")


def test_source(seeded):
    doc = loops(seeded.server, "checkpoints", "source", f"{seeded.run_id}:s1", "-o", "json").json()
    assert doc["checkpoint_id"] == seeded.cp("s1")["id"] and doc["source"]["kind"] == "s3"
    table = loops(seeded.server, "checkpoints", "source", seeded.cp("s1")["id"])
    assert "Kind:" in table.stdout and "downloadable" in table.stdout
    one_line_error(loops(seeded.server, "checkpoints", "source", "nOsUcH00"), 1, "no checkpoint 'nOsUcH00'")
