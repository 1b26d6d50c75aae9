"""`loops sample --stream`: the answer is printed as the sampler decodes it (the same
streaming path as deployments: the sampler's `/sample` with `stream: true`). The first text
reaches stdout while decoding is provably paused (a fault hook holds the engine after its
first token), and the streamed text is the unstreamed answer."""

from __future__ import annotations

import subprocess
import sys

from tests.cli_support import QUESTION, SECRET, api, cli_env, loops, one_line_error, seeded  # noqa: F401  (fixture)

MAX_TOKENS = 12


def _args(seeded, *extra: str) -> list[str]:
    return ["sample", f"{seeded.run_id}:s2", "--chat", "--prompt", QUESTION, "-T", "0",
            "--max-tokens", str(MAX_TOKENS), *extra]


def test_stream_prints_the_same_answer(seeded):
    whole = loops(seeded.server, *_args(seeded))
    streamed = loops(seeded.server, *_args(seeded, "--stream"))
    assert whole.code == 0 and streamed.code == 0, (whole, streamed)
    assert streamed.stdout.startswith(SECRET)
    assert streamed.stdout == whole.stdout
    assert "Sampled" in streamed.stderr


def test_stream_yields_pieces_as_the_sampler_decodes(seeded):
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.services.sampling import SampleRequest, resolve_source, stream_text

    server = seeded.server
    with LoopsClient(server.url, server.token) as client:
        source = resolve_source(client, f"{seeded.run_id}:s2")
    request = SampleRequest(prompt=QUESTION, chat=True, max_tokens=MAX_TOKENS, temperature=0)
    pieces = list(stream_text(source, request, api_key=server.token))
    assert len(pieces) > 1 and "".join(pieces).startswith(SECRET)


def test_the_first_text_is_printed_while_the_sampler_is_still_decoding(seeded):
    server = seeded.server
    env = cli_env(server)
    api(server, "POST", "/v1/local/faults", json={"job": "sample *", "pause_after_tokens": 1})
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", *_args(seeded, "--stream")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.read(1)
        models = api(server, "GET", "/v1/local/status")["models"]
        assert any((m["current_job"] or "").startswith("sample") for m in models), models  # held: not done
    finally:
        api(server, "DELETE", "/v1/local/faults")
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert (first + rest).startswith(SECRET) and first == SECRET[0]


def test_stream_bad_combinations(seeded):
    one_line_error(loops(seeded.server, *_args(seeded, "--stream", "-n", "2")), 2, "--stream prints one sample")
    one_line_error(loops(seeded.server, *_args(seeded, "--stream", "-o", "json")), 2, "--stream")
