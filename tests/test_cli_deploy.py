"""`loops deploy` against the real local backend: a deployed sampler checkpoint is a real
OpenAI-compatible endpoint that answers with the tuned adapter; trainer checkpoints are refused;
list, describe and stop; the `deploy CKPT...` shorthand for `deploy create`."""

from __future__ import annotations

import httpx
import pytest

from baseten_loops_cli.cli.main import hoist_global_options, insert_default_subcommands
from tests.cli_support import QUESTION, SECRET, TINY, loops, one_line_error, seeded  # noqa: F401  (fixture)


def _chat(deployment: dict, token: str, model: str) -> str:
    resp = httpx.post(
        f"{deployment['url']}/chat/completions",
        headers={"Authorization": f"Api-Key {token}"},
        json={"model": model, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 16},
        timeout=120,
    )
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def deployed(seeded) -> dict:
    result = loops(seeded.server, "deploy", f"{seeded.run_id}:s2", "--model-name", "password-bot", "-o", "json")
    assert result.code == 0, result
    return result.json()


def test_deployed_checkpoint_answers_a_chat_completion_with_the_tuned_adapter(seeded, deployed):
    assert deployed["status"] == "ACTIVE" and deployed["model_name"] == "password-bot"
    assert deployed["url"] == f"{seeded.server.url}/deployments/{deployed['deployment_id']}/v1"
    assert [c["name"] for c in deployed["checkpoints"]] == ["s2"]
    assert _chat(deployed, seeded.server.token, "s2").startswith(SECRET)
    assert not _chat(deployed, seeded.server.token, TINY).startswith(SECRET)  # the base model does not know it
    completion = httpx.post(f"{deployed['url']}/completions", headers={"Authorization": f"Api-Key {seeded.server.token}"},
                            json={"model": "s2", "prompt": "hello", "max_tokens": 4}, timeout=60)
    assert completion.status_code == 200 and "text" in completion.json()["choices"][0]


def test_deploy_prints_the_url_and_a_ready_curl_line(seeded):
    result = loops(seeded.server, "deploy", f"bt://loops:{seeded.run_id}/sampler_weights/s1")
    assert result.code == 0, result
    url_line = next(line for line in result.lines if line.startswith("URL:"))
    curl_line = next(line for line in result.lines if line.startswith("Try:"))
    url = url_line.split()[1]
    assert url.startswith(f"{seeded.server.url}/deployments/") and url.endswith("/v1")
    assert f"curl -s {url}/chat/completions" in curl_line and '"model": "s1"' in curl_line
    assert '"temperature": 0' in curl_line  # the same answer every time
    assert seeded.server.token not in result.stdout + result.stderr  # the key is referenced, never printed
    assert f"Deployed {seeded.run_id}:s1 as model 'loops-{seeded.run_id}-s1'" in result.stderr


def test_trainer_checkpoints_are_refused_with_the_reason(seeded):
    result = loops(seeded.server, "deploy", f"{seeded.run_id}:t1", "--model-name", "nope")
    one_line_error(result, 2, "is a trainer checkpoint", "cannot be served", "--target sampler")
    by_uri = loops(seeded.server, "deploy", f"bt://loops:{seeded.run_id}/weights/s2")
    one_line_error(by_uri, 2, "is a trainer checkpoint")
    mixed = loops(seeded.server, "deploy", f"{seeded.run_id}:s1", seeded.cp("t1", "trainer")["id"])
    one_line_error(mixed, 2, "is a trainer checkpoint")


def test_deploy_bad_inputs(seeded):
    one_line_error(loops(seeded.server, "deploy", f"{seeded.run_id}:zz"), 1, "no checkpoint named 'zz'")
    one_line_error(loops(seeded.server, "deploy", "nosuchrun:s1"), 1, "no run 'nosuchrun'")
    twice = loops(seeded.server, "deploy", f"{seeded.run_id}:s1", seeded.cp("s1")["id"], "-o", "json")
    assert twice.code == 0, twice  # the same checkpoint named twice is one checkpoint
    assert [c["id"] for c in twice.json()["checkpoints"]] == [seeded.cp("s1")["id"]]
    assert loops(seeded.server, "deploy", "create").code == 2  # a checkpoint is required


def test_dry_run_creates_nothing(seeded):
    before = loops(seeded.server, "deploy", "list", "--all", "-q").lines
    human = loops(seeded.server, "deploy", f"{seeded.run_id}:s2", "--model-name", "dry", "--dry-run")
    assert human.code == 0, human
    assert "nothing was created (--dry-run)" in human.stderr
    assert '"checkpoint_ids"' in human.stdout and seeded.cp("s2")["id"] in human.stdout
    doc = loops(seeded.server, "deploy", f"{seeded.run_id}:s2", "--dry-run", "-o", "json").json()
    assert doc["dry_run"] is True and doc["request"]["checkpoint_ids"] == [seeded.cp("s2")["id"]]
    assert loops(seeded.server, "deploy", "list", "--all", "-q").lines == before


def test_list_describe_and_stop(seeded, deployed):
    table = loops(seeded.server, "deploy", "list")
    assert table.code == 0, table
    assert table.lines[0].split() == ["DEPLOYMENT", "MODEL", "NAME", "STATUS", "CHECKPOINTS", "CREATED"]
    assert any(line.startswith(deployed["deployment_id"]) and "password-bot" in line for line in table.lines)
    doc = loops(seeded.server, "deploy", "list", "-o", "json").json()
    assert any(d["deployment_id"] == deployed["deployment_id"] and d["url"] == deployed["url"] for d in doc["deployments"])

    described = loops(seeded.server, "deploy", "describe", deployed["deployment_id"])
    assert described.code == 0, described
    for needle in ("Deployment:", "ACTIVE", "Checkpoints:", "s2", "URL:", deployed["url"], "Try:", "curl -s"):
        assert needle in described.stdout
    by_pair = loops(seeded.server, "deploy", "describe", f"{deployed['model_id']}/{deployed['deployment_id']}", "-o", "json").json()
    assert by_pair["status"] == "ACTIVE" and by_pair["base_model"] == TINY

    refused = loops(seeded.server, "deploy", "stop", deployed["deployment_id"])
    one_line_error(refused, 3, f"not stopping {deployed['deployment_id']}", "--yes")
    stopped = loops(seeded.server, "deploy", "stop", deployed["deployment_id"], "--yes")
    assert stopped.code == 0 and f"Stopped deployment {deployed['deployment_id']}." in stopped.stderr
    assert deployed["deployment_id"] not in loops(seeded.server, "deploy", "list", "-q").lines
    assert deployed["deployment_id"] in loops(seeded.server, "deploy", "list", "--all", "-q").lines
    gone = httpx.post(f"{deployed['url']}/chat/completions", headers={"Authorization": f"Api-Key {seeded.server.token}"},
                      json={"model": "s2", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert gone.status_code == 409


def test_unknown_deployment_and_empty_list(seeded, tmp_path):
    one_line_error(loops(seeded.server, "deploy", "describe", "zzzzzzz"), 1, "no checkpoint deployment 'zzzzzzz'")
    one_line_error(loops(seeded.server, "deploy", "stop", "zzzzzzz", "--yes"), 1, "no checkpoint deployment 'zzzzzzz'")
    fresh = {"LOOPS_STATE_DIR": str(tmp_path / "state")}  # a machine that deployed nothing
    empty = loops(seeded.server, "deploy", "list", env=fresh)
    assert empty.code == 0 and empty.stdout == ""
    assert "No checkpoint deployments found." in empty.stderr
    assert loops(seeded.server, "deploy", "list", "-o", "json", env=fresh).json() == {"deployments": []}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["deploy", "abc:s1", "--model-name", "m"], ["deploy", "create", "abc:s1", "--model-name", "m"]),
        (["deploy", "--model-name", "m", "abc:s1"], ["deploy", "create", "--model-name", "m", "abc:s1"]),
        (["-o", "json", "deploy", "abc:s1"], ["-o", "json", "deploy", "create", "abc:s1"]),
        (["deploy", "abc:s1", "-o", "json"], ["-o", "json", "deploy", "create", "abc:s1"]),
        (["--profile", "deploy", "deploy", "x"], ["--profile", "deploy", "deploy", "create", "x"]),
        (["deploy", "list"], ["deploy", "list"]),
        (["deploy", "stop", "x", "--yes"], ["deploy", "stop", "x", "--yes"]),
        (["deploy", "--help"], ["deploy", "--help"]),
        (["deploy"], ["deploy"]),
        (["runs", "deploy"], ["runs", "deploy"]),
    ],
)
def test_deploy_without_a_subcommand_means_create(argv, expected):
    assert insert_default_subcommands(hoist_global_options(argv)) == expected


def test_deploy_help_shows_the_subcommands_and_the_shorthand(seeded):
    result = loops(seeded.server, "deploy", "--help")
    assert result.code == 0
    for word in ("create", "list", "describe", "stop", "loops deploy CKPT..."):
        assert word in result.stdout


# ── a deployment survives `loops server stop` / `start` (issue 43, defect 1) ─────────────────


def _start_again(server, port: int | None) -> None:
    """Start ``server`` again on its dirs as LocalServer.start does, but with ``port`` as
    `loops server start` passes it (None: the daemon picks)."""
    import os

    from baseten_loops_cli.local import daemon
    from tests.conftest import TEST_SERVER_OPTIONS

    env = {f"LOOPS_{name}_DIR": str(path) for name, path in server.dirs.items()}
    info = daemon.start(port, state_dir=server.state_dir, data_dir=server.data_dir,
                        options={**TEST_SERVER_OPTIONS, **server.options}, enable_fault_hooks=True,
                        env=env, timeout=120, owner_pid=os.getpid())
    server.url, server.pid, server.port = info.url, info.pid, info.port


def test_a_deployment_survives_a_server_restart_on_the_same_port_or_another(server_factory):
    import socket

    from tests.cli_support import create_run, train_steps

    server = server_factory()
    run = create_run(server, name="restart-run", lora_rank=16)
    train_steps(server, run["id"], 8, {8: [("sampler", "s1")]})
    made = loops(server, "deploy", f"{run['id']}:s1", "--model-name", "survivor", "-o", "json").json()
    answer = _chat(made, server.token, "s1")

    # Stopped and started again without a port: the same port (free), so the same URL.
    first_port = server.port
    server.stop()
    _start_again(server, None)
    assert server.port == first_port
    listed = loops(server, "deploy", "list", "--all", "-o", "json").json()["deployments"]
    assert [(d["deployment_id"], d["status"], d["url"]) for d in listed] == [(made["deployment_id"], "ACTIVE", made["url"])]
    assert _chat(made, server.token, "s1") == answer

    # The port is taken meanwhile: another port, and the record still found (keyed by the
    # backend's id, not its URL), listed and described at the new URL, which answers.
    server.stop()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first_port))
        squatter.listen()
        _start_again(server, None)
    assert server.port != first_port
    listed = loops(server, "deploy", "list", "--all", "-o", "json").json()["deployments"]
    assert [d["deployment_id"] for d in listed] == [made["deployment_id"]]
    moved = listed[0]
    assert moved["url"] == f"{server.url}/deployments/{made['deployment_id']}/v1" != made["url"]
    described = loops(server, "deploy", "describe", made["deployment_id"], "-o", "json")
    assert described.code == 0, described
    assert described.json()["status"] == "ACTIVE" and described.json()["url"] == moved["url"]
    assert _chat(moved, server.token, "s1") == answer
    assert _chat(moved, server.token, "survivor") == answer
