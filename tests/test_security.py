"""Security properties of the local server and the CLI.

- the server listens on 127.0.0.1 only and refuses requests without its token (presigned
  file URLs aside: HMAC-signed, expiring, scoped to one file);
- traversal (``..``, absolute paths, symlinks) is refused by the server's file route and by
  the downloader;
- the API key never appears in stdout, stderr, logs or ``--debug`` output;
- credential and config files are 0600;
- YAML is loaded safely; reward code is loaded only from the path a config names.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import cli_env, wait_for

ROOT = Path(__file__).resolve().parent.parent


# ── helpers ─────────────────────────────────────────────────────────────────────────────────


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of LISTEN sockets on ``port``, from /proc/net/tcp{,6} (no traffic)."""
    found = []
    for name, width in (("tcp", 8), ("tcp6", 32)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            parts = line.split()
            local, state = parts[1], parts[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A = LISTEN
                continue
            if width == 8:
                found.append(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr_hex)[::-1]))
            else:
                raw = bytes.fromhex(addr_hex)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.append(socket.inet_ntop(socket.AF_INET6, raw))
    return found


def _loops(args: list[str], env: dict[str, str], cwd: Path, stdin: str = "", timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=env, cwd=cwd,
                          input=stdin, capture_output=True, text=True, timeout=timeout, check=False)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _grep_tree(root: Path, needle: str, skip: set[Path] = frozenset()) -> list[Path]:
    hits = []
    raw = needle.encode()
    for path in root.rglob("*"):
        if path in skip or not path.is_file() or path.is_symlink():
            continue
        try:
            if path.stat().st_size > 50 * 1024 * 1024:
                continue
            if raw in path.read_bytes():
                hits.append(path)
        except OSError:
            continue
    return hits


# ── the server: loopback only, token required ───────────────────────────────────────────────


def test_server_listens_on_loopback_only(local_server):
    assert local_server.url.startswith("http://127.0.0.1:")
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp on this platform")
    addresses = _listening_addresses(local_server.port)
    assert addresses, f"nothing listens on port {local_server.port}"
    assert set(addresses) <= {"127.0.0.1", "::1"}, addresses


PROTECTED = [
    ("GET", "/v1/loops/runs"),
    ("POST", "/v1/loops/runs"),
    ("POST", "/v1/loops/sessions"),
    ("GET", "/v1/loops/samplers"),
    ("GET", "/v1/loops/checkpoints?run_id=x"),
    ("GET", "/v1/loops/deployments"),
    ("GET", "/v1/loops/user_config"),
    ("GET", "/v1/teams"),
    ("GET", "/v1/teams/local/loops/runs"),
    ("GET", "/v1/local/status"),
    ("GET", "/v1/local/usage"),
    ("GET", "/v1/local/models"),
    ("GET", "/v1/local/faults"),
    ("POST", "/v1/local/faults"),
    ("GET", "/trainers/any-run/health"),
    ("POST", "/trainers/any-run/forward_backward"),
    ("GET", "/trainers/any-run/operations/x"),
    ("POST", "/samplers/any/sync/sample"),
    ("GET", "/samplers/any/sync/v1/models"),
    ("POST", "/deployments/any/v1/chat/completions"),
    ("GET", "/v1/models/m/deployments/d"),
    ("GET", "/no/such/route"),
]

BAD_AUTH = [
    None,
    "Api-Key",
    "Api-Key wrong-token",
    "Bearer wrong-token",
    "Basic dXNlcjpwYXNz",
    "{token}",  # the right token without a scheme
    "Token {token}",
    "Api-Key {token}x",
    "Api-Key {token_prefix}",
]


@pytest.mark.parametrize("method,path", PROTECTED)
def test_requests_without_the_token_are_refused(local_server, method, path):
    with httpx.Client(base_url=local_server.url, timeout=30) as c:
        for header in BAD_AUTH:
            headers = {}
            if header is not None:
                headers["Authorization"] = header.format(token=local_server.token,
                                                         token_prefix=local_server.token[:8])
            r = c.request(method, path, headers=headers, json={} if method == "POST" else None)
            assert r.status_code == 401, (method, path, header, r.status_code, r.text[:200])
            assert r.json()["error_class"] in ("AuthenticationRequired", "InvalidApiKey")
            assert local_server.token not in r.text



def test_token_is_accepted_with_both_schemes_and_health_is_open(local_server):
    with httpx.Client(base_url=local_server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert "token" not in c.get("/health").text.lower()
        for scheme in ("Api-Key", "Bearer", "api-key", "bearer"):
            r = c.get("/v1/loops/runs", headers={"Authorization": f"{scheme} {local_server.token}"})
            assert r.status_code == 200, scheme


def test_token_in_query_string_is_refused_and_not_logged(server_factory):
    """A key pasted into a URL is not a credential, and the access log must not keep it."""
    server = server_factory()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for param in ("api_key", "token", "key"):
            r = c.get(f"/v1/loops/runs?{param}={server.token}")
            assert r.status_code == 401
    # The access log writes each line after its answer: wait until all three are in (as
    # written, redacted or not), then look for the key.
    wait_for(lambda: all(f"/v1/loops/runs?{param}=" in server.log_text for param in ("api_key", "token", "key")),
             timeout=10, interval=0.05, what="the three requests in the access log")
    assert server.token not in server.log_text, (
        "the server's access log recorded the API key from a query string; redact query "
        "strings (api_key/token/key/sig) in the access log")


# ── private files ───────────────────────────────────────────────────────────────────────────


def test_server_secrets_are_private(local_server):
    state = local_server.state_dir
    assert _mode(state / "token") == 0o600
    assert _mode(state / "server.json") & 0o077 == 0
    key = local_server.data_dir / "presign.key"
    assert key.exists() and _mode(key) == 0o600


def test_credential_and_config_files_are_0600(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "_LOOPS_"))}
    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        env[f"LOOPS_{name}_DIR"] = str(tmp_path / name.lower())
    env.update(LOOPS_KEYRING_DISABLED="1", LOOPS_NO_AUTOSTART="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    secret = "sk-test-" + os.urandom(12).hex()
    p = _loops(["auth", "login", "--with-key", "--no-verify", "--profile", "prod",
                "--base-url", "http://127.0.0.1:9"], env, tmp_path, stdin=secret + "\n")
    assert p.returncode == 0, p.stderr
    assert secret not in p.stdout + p.stderr
    p = _loops(["config", "list"], env, tmp_path)
    assert p.returncode == 0, p.stderr
    config_dir = tmp_path / "config"
    files = [f for f in config_dir.rglob("*") if f.is_file()]
    assert {f.name for f in files} >= {"config.toml", "credentials.toml"}
    for f in files:
        assert _mode(f) == 0o600, f"{f} is {oct(_mode(f))}"
    assert _mode(config_dir) & 0o077 == 0
    # The key is in the credentials file only, never in config.toml.
    assert secret in (config_dir / "credentials.toml").read_text()
    assert secret not in (config_dir / "config.toml").read_text()
    # Loosened by hand: the next write puts 0600 back.
    os.chmod(config_dir / "credentials.toml", 0o644)
    p = _loops(["auth", "login", "--with-key", "--no-verify", "--profile", "other",
                "--base-url", "http://127.0.0.1:9"], env, tmp_path, stdin=secret + "2\n")
    assert p.returncode == 0, p.stderr
    assert _mode(config_dir / "credentials.toml") == 0o600


# ── the API key never printed ───────────────────────────────────────────────────────────────


def test_wrong_api_key_is_never_echoed_even_with_debug(local_server, tmp_path):
    """A rejected key (the classic leak: 'invalid key sk-...') in every output, --debug on."""
    secret = "sk-live-" + os.urandom(16).hex()
    env = cli_env(local_server, BASETEN_API_KEY=secret)
    outputs = []
    for args in (["--debug", "runs", "list"], ["runs", "list", "-o", "json", "--debug"],
                 ["--debug", "auth", "status"], ["--debug", "config", "list"],
                 ["runs", "list"], ["runs", "list", "-o", "json"], ["auth", "status"], ["config", "list"]):
        p = _loops(args, env, tmp_path, timeout=120)
        outputs.append((args, p.returncode, p.stdout + p.stderr))
    for args, rc, text in outputs:
        assert secret not in text, f"loops {' '.join(args)} leaked the key:\n{text}"
        if "--debug" not in args:  # --debug shows the traceback of an error on purpose
            assert "Traceback" not in text, f"loops {' '.join(args)}:\n{text}"
    # A bad key is an auth failure: exit 4 with a hint, for the commands that used the server.
    by_args = {tuple(args): (rc, text) for args, rc, text in outputs}
    for args in (("--debug", "runs", "list"), ("runs", "list"), ("runs", "list", "-o", "json")):
        assert by_args[args][0] == 4, by_args[args][1]
    assert secret not in local_server.log_text


def test_a_key_with_stray_whitespace_is_never_echoed(local_server, tmp_path):
    """A key pasted with a line break (CI secrets often end in one): the HTTP library's
    "Illegal header value b'Api-Key sk-...\\n'" quoted it, escaped, past the scrubber. Surrounding
    whitespace is dropped; a key an HTTP header cannot carry is refused (exit 4) unnamed."""
    secret = "sk-live-" + os.urandom(16).hex()
    # Surrounding whitespace is ignored: the server's own token with a newline still works.
    p = _loops(["runs", "list", "-o", "json"], cli_env(local_server, BASETEN_API_KEY=local_server.token + "\n"),
               tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    json.loads(p.stdout)
    for key in (" " + secret + "\r\n", secret[:12] + "\n" + secret[12:], secret[:12] + " " + secret[12:],
                secret[:-1] + "é"):
        env = cli_env(local_server, BASETEN_API_KEY=key)
        for args in (["runs", "list", "-o", "json"], ["--debug", "runs", "list"]):
            p = _loops(args, env, tmp_path, timeout=120)
            text = p.stdout + p.stderr
            for part in (secret[:12], secret[12:-1]):
                assert part not in text, f"loops {' '.join(args)} with {key!r} leaked the key:\n{text}"
            assert p.returncode == 4, text
        p = _loops(["auth", "login", "--with-key", "--profile", "p", "--base-url", local_server.url], env, tmp_path,
                   stdin=key + "\n", timeout=120)
        assert secret[12:-1] not in p.stdout + p.stderr and p.returncode == 4, p.stderr
    assert secret[12:-1] not in local_server.log_text


def _assert_key_not_leaked(server, key: str, texts: list[tuple[list[str], str]], tmp_path: Path) -> None:
    """``key`` in none of the outputs, nor in any file the CLI and server wrote (logs, caches,
    run dirs) except the token file and the credentials store, which exist to hold it."""
    assert any("***" in t or "Api-Key" in t for _, t in texts), "no HTTP debug log seen at all"
    for args, text in texts:
        assert key not in text, f"loops {' '.join(args)} printed the API key"
    skip = {server.state_dir / "token"}
    leaks = []
    for d in (server.state_dir, server.dirs["CACHE"], server.dirs["CONFIG"], tmp_path):
        leaks += _grep_tree(d, key, skip)
    leaks = [p for p in leaks if p.name != "credentials.toml"]
    assert not leaks, f"API key found in {leaks}"


def test_api_key_never_in_debug_output_or_logs(local_server, tmp_path):
    env = cli_env(local_server)
    texts = []
    for args in (["--debug", "runs", "list"], ["--debug", "usage"], ["--debug", "auth", "status"],
                 ["--debug", "runs", "describe", "no-such-run"], ["--debug", "checkpoints", "list", "--run-id", "nope"],
                 ["--debug", "samplers", "list"]):
        p = _loops(args, env, tmp_path, timeout=120)
        texts.append((args, p.stdout + p.stderr))
        if "no-such-run" in args:  # the API's 404 (a request that carried the key), not a usage error
            assert p.returncode == 1 and "Error: no run 'no-such-run'" in p.stderr, p.stderr
            assert "404" in p.stderr, p.stderr  # the debug log of the request that answered it
    _assert_key_not_leaked(local_server, local_server.token, texts, tmp_path)


@pytest.mark.local
def test_api_key_never_in_debug_output_or_logs_of_a_training_run(local_server, tmp_path):
    """A whole training run with --debug: HTTP debug log of every control-plane and worker call."""
    pytest.importorskip("torch")
    env = cli_env(local_server)
    texts = []
    cfg = tmp_path / "sft.yaml"
    cfg.write_text("kind: sft\nname: keyleak\nbase_model: loops-local/tiny\nlora_rank: 4\nmax_seq_len: 64\n"
                   "batch_size: 4\nmax_steps: 2\ncheckpointing:\n  save_every: 1\n"
                   f"data:\n  train: {ROOT / 'examples' / 'data' / 'tiny_sft_train.jsonl'}\n")
    p = _loops(["--debug", "train", "run", str(cfg), "--run-dir", str(tmp_path / "rd")], env, tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr
    texts.append((["--debug", "train", "run"], p.stdout + p.stderr))
    run_id = json.loads((tmp_path / "rd" / "state.json").read_text())["run_id"]
    p = _loops(["--debug", "checkpoints", "download", f"{run_id}:final", "-O", str(tmp_path / "dl"), "--target", "sampler"],
               env, tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    texts.append((["--debug", "checkpoints", "download"], p.stdout + p.stderr))
    _assert_key_not_leaked(local_server, local_server.token, texts, tmp_path)


# ── traversal in downloads (the client side) ────────────────────────────────────────────────


EVIL_NAMES = [
    "../escape.bin",
    "a/../../escape.bin",
    "/etc/loops-escape",
    "..",
    "./a",
    "a//b",
    "a\\..\\..\\escape.bin",
    "C:/Windows/escape.bin",
    "nul\x00byte",
    "",
]


@pytest.mark.parametrize("name", EVIL_NAMES, ids=[repr(n) for n in EVIL_NAMES])
def test_download_refuses_names_that_leave_the_target(tmp_path, name):
    from baseten_loops_cli.api.download import UnsafePathError, download_files

    dest = tmp_path / "out"
    files = [{"relative_file_name": "ok.bin", "url": "http://127.0.0.1:9/ok", "size_bytes": 1},
             {"relative_file_name": name, "url": "http://127.0.0.1:9/evil", "size_bytes": 1}]
    with pytest.raises(UnsafePathError) as info:
        download_files(files, dest, checkpoint_id="ckpt-1", check_free_space=False)
    assert "outside the target" in info.value.message
    # Refused before anything was written: not even the target folder exists.
    assert not dest.exists()
    assert not (tmp_path / "escape.bin").exists()


def test_download_refuses_to_write_through_a_symlink_out_of_the_target(tmp_path):
    from baseten_loops_cli.api.download import UnsafePathError, download_files

    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "sub").symlink_to(outside, target_is_directory=True)
    files = [{"relative_file_name": "sub/adapter.safetensors", "url": "http://127.0.0.1:9/x", "size_bytes": 4}]
    with pytest.raises(UnsafePathError):
        download_files(files, dest, checkpoint_id="ckpt-1", force=True, check_free_space=False, parallel=1)
    assert list(outside.iterdir()) == []


# ── presigned file links and the server's file route ────────────────────────────────────────


@pytest.fixture(scope="module")
def signed_checkpoint(local_server):
    """(checkpoint row, its folder on disk, its file listing) for a fresh trainer checkpoint."""
    pytest.importorskip("torch")
    from baseten_loops_cli.workers.trainer import TrainerClient

    with local_server.client() as c:
        session = c.post("/v1/loops/sessions", json={}).json()["session"]["id"]
        run = c.post("/v1/loops/trainers", json={"session_id": session, "base_model": "loops-local/tiny",
                                                 "lora_rank": 4}).json()["run"]
        with TrainerClient(f"{local_server.url}/trainers/{run['id']}", api_key=local_server.token,
                           run_id=run["id"], base_model="loops-local/tiny") as tc:
            tc.save_state("sec").result(timeout=120)
        cp = c.get("/v1/loops/checkpoints", params={"run_id": run["id"]}).json()["checkpoints"][0]
        folder = Path(c.get(f"/v1/loops/checkpoints/{cp['id']}/source").json()["source"]["path"])
        files = c.get(f"/v1/loops/checkpoints/{cp['id']}/files").json()["presigned_urls"]
    return cp, folder, files


def _presigner(server):
    from baseten_loops_cli.local.server.files import Presigner

    return Presigner((server.data_dir / "presign.key").read_bytes())


def _raw_get(server, path_and_query: str) -> httpx.Response:
    """GET exactly this path (no client-side normalisation of .. or %2e)."""
    url = httpx.URL(server.url).copy_with(raw_path=path_and_query.encode())
    with httpx.Client(timeout=30) as c:
        return c.get(url)


def test_presigned_link_works_without_auth_for_its_file_only(local_server, signed_checkpoint):
    cp, folder, files = signed_checkpoint
    by_name = {f["relative_file_name"]: f for f in files}
    cfg = by_name["adapter_config.json"]
    r = httpx.get(cfg["url"], timeout=30)  # no Authorization header at all
    assert r.status_code == 200 and r.content == (folder / "adapter_config.json").read_bytes()
    assert "authorization" not in {k.lower() for k in r.request.headers}
    # The same signature on another file of the same checkpoint: refused.
    other = cfg["url"].replace("/adapter_config.json?", "/adapter_model.safetensors?")
    r = httpx.get(other, timeout=30)
    assert r.status_code == 403 and r.json()["error_class"] == "SignatureInvalid"
    # A later expiry with the old signature: refused.
    url = httpx.URL(cfg["url"])
    later = url.copy_set_param("expires", str(int(url.params["expires"]) + 3600))
    r = httpx.get(later, timeout=30)
    assert r.status_code == 403
    # The signature of one checkpoint on another checkpoint's id: refused.
    r = httpx.get(cfg["url"].replace(f"/files/{cp['id']}/", "/files/zzzzzzzz/"), timeout=30)
    assert r.status_code in (403, 404)


def test_presigned_link_expires(server_factory, tmp_path):
    from baseten_loops_cli.local.server.files import Presigner

    server = server_factory(link_ttl_s=1)
    presigner = Presigner((server.data_dir / "presign.key").read_bytes(), ttl_s=1)
    # An expired, correctly signed link for a file that need not exist: expiry is checked
    # before the lookup, and the answer says what to do.
    url = presigner.url(server.url, "anything", "adapter_config.json", now=time.time() - 10)
    r = httpx.get(url, timeout=30)
    assert r.status_code == 403 and r.json()["error_class"] == "LinkExpired"
    assert "fresh link" in r.json()["detail"]


@pytest.mark.parametrize("path", [
    "%2e%2e/%2e%2e/%2e%2e/presign.key",
    "..%2f..%2f..%2fpresign.key",
    "%2fetc%2fpasswd",
    "/etc/passwd",
    "a/%2e%2e/%2e%2e/%2e%2e/%2e%2e/presign.key",
    "..\\..\\presign.key",
])
def test_file_route_refuses_traversal_even_when_signed(local_server, signed_checkpoint, path):
    """The attacker holds a *valid signature* for the traversal path (e.g. a leaked key):
    the path check still refuses it, before any file is opened."""
    from urllib.parse import unquote

    cp, _, _ = signed_checkpoint
    presigner = _presigner(local_server)
    expires = int(time.time()) + 600
    sig = presigner._sign(cp["id"], unquote(path), expires)  # noqa: SLF001
    r = _raw_get(local_server, f"/files/{cp['id']}/{path}?expires={expires}&sig={sig}")
    assert r.status_code in (403, 404), (path, r.status_code, r.text[:200])
    assert b"-----" not in r.content and len(r.content) < 2000
    assert (local_server.data_dir / "presign.key").read_bytes() not in r.content


def test_file_route_refuses_symlinks_out_of_the_checkpoint(local_server, signed_checkpoint, tmp_path):
    cp, folder, _ = signed_checkpoint
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret, outside every checkpoint\n")
    (tmp_path / "secret_dir").mkdir()
    (tmp_path / "secret_dir" / "inner.txt").write_text("also secret\n")
    links = {"leak.txt": secret, "key.bin": local_server.data_dir / "presign.key",
             "leakdir": tmp_path / "secret_dir"}
    for name, target in links.items():
        (folder / name).symlink_to(target)
    try:
        presigner = _presigner(local_server)
        for rel in ("leak.txt", "key.bin", "leakdir/inner.txt"):
            url = presigner.url(local_server.url, cp["id"], rel)
            r = httpx.get(url, timeout=30)
            assert r.status_code == 403, (rel, r.status_code, r.text[:200])
            assert b"secret" not in r.content
            assert r.json()["error_class"] == "PathNotAllowed"
        # And the listing does not advertise them as checkpoint files.
        with local_server.client() as c:
            names = {f["relative_file_name"] for f in
                     c.get(f"/v1/loops/checkpoints/{cp['id']}/files").json()["presigned_urls"]}
        assert not names & {"leak.txt", "key.bin", "leakdir/inner.txt"}, names
    finally:
        for name in links:
            (folder / name).unlink()


# ── YAML loaded safely; reward code only from the file the config names ─────────────────────

_TAGS = [
    '!!python/object/apply:os.system ["touch {marker}"]',
    '!!python/object/new:subprocess.Popen [["touch", "{marker}"]]',
    "!!python/name:os.system",
    "!!python/module:os",
]


@pytest.mark.parametrize("tag", _TAGS)
def test_yaml_with_python_tags_is_refused_not_executed(local_server, tmp_path, tag):
    marker = tmp_path / "PWNED"
    env = cli_env(local_server)
    data = ROOT / "examples" / "data" / "tiny_sft_train.jsonl"
    bodies = [
        tag.format(marker=marker) + "\n",
        f"kind: sft\nname: {tag.format(marker=marker)}\nbase_model: loops-local/tiny\ndata:\n  train: {data}\n",
        f"kind: sft\nname: x\nbase_model: loops-local/tiny\nseed: {tag.format(marker=marker)}\ndata:\n  train: {data}\n",
    ]
    for i, body in enumerate(bodies):
        cfg = tmp_path / f"c{i}.yaml"
        cfg.write_text(body)
        for args in (["train", "validate", str(cfg), "--offline"],
                     ["train", "run", str(cfg), "--run-dir", str(tmp_path / f"rd{i}")]):
            p = _loops(args, env, tmp_path, timeout=120)
            assert p.returncode != 0, (body, p.stdout)
            assert "Traceback" not in p.stderr and "Error: unexpected" not in p.stderr, p.stderr
            assert not marker.exists(), f"YAML tag executed: {body}"
    # The same through --set (values are parsed as YAML too).
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"kind: sft\nname: x\nbase_model: loops-local/tiny\ndata:\n  train: {data}\n")
    p = _loops(["train", "validate", str(ok), "--offline", "--set", "name=" + tag.format(marker=marker)],
               env, tmp_path, timeout=120)
    assert not marker.exists()
    assert "Traceback" not in p.stderr and "Error: unexpected" not in p.stderr, p.stderr


def test_run_dir_config_is_loaded_safely_on_resume(local_server, tmp_path):
    """`loops train resume` reads RUN_DIR/config.yaml: a tampered one is refused, not run."""
    rd = tmp_path / "rd"
    rd.mkdir()
    marker = tmp_path / "PWNED"
    (rd / "config.yaml").write_text(f'!!python/object/apply:os.system ["touch {marker}"]\n')
    (rd / "state.json").write_text(json.dumps({"status": "failed", "step": 0}))
    p = _loops(["train", "resume", str(rd)], cli_env(local_server), tmp_path, timeout=120)
    assert p.returncode != 0 and not marker.exists()
    assert "Traceback" not in p.stderr and "Error: unexpected" not in p.stderr, p.stderr


def _rl_config(folder: Path, reward: str, prompts: Path) -> Path:
    cfg = folder / "rl.yaml"
    cfg.write_text(
        "kind: rl\nname: reward-path\nbase_model: loops-local/tiny\nlora_rank: 4\nmax_seq_len: 128\n"
        "group_size: 2\ngroups_per_batch: 1\nmax_steps: 1\nsampling:\n  max_tokens: 4\n"
        f"data:\n  prompts: {prompts}\nreward: {reward}\n"
    )
    return cfg


def test_reward_code_is_loaded_only_from_the_file_the_config_names(local_server, tmp_path):
    prompts = ROOT / "examples" / "data" / "tiny_rl_prompts.jsonl"
    cwd = tmp_path / "cwd"
    cfg_dir = tmp_path / "project"
    cwd.mkdir()
    cfg_dir.mkdir()
    evil_marker, legit_marker = tmp_path / "EVIL_IMPORTED", tmp_path / "LEGIT_IMPORTED"
    evil = f"open({str(evil_marker)!r}, 'w').close()\ndef score(c, row):\n    return 0.0\n"
    legit = f"open({str(legit_marker)!r}, 'w').close()\ndef score(c, row):\n    return 1.0\n"
    # A rewards.py in the working directory and on PYTHONPATH: it must never be the one used.
    (cwd / "rewards.py").write_text(evil)
    (cfg_dir / "rewards.py").write_text(legit)
    env = cli_env(local_server)
    env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(cwd)

    cfg = _rl_config(cfg_dir, "rewards.py:score", prompts)
    p = _loops(["train", "validate", str(cfg), "--offline"], env, cwd, timeout=120)
    assert p.returncode == 0, p.stderr
    assert legit_marker.exists(), "the reward file beside the config was not the one loaded"
    assert not evil_marker.exists(), "a rewards.py from the working directory / PYTHONPATH was imported"
    legit_marker.unlink()

    # Import paths are not file paths: no module is imported by name.
    for spec in ("rewards:score", "os:system", "json:loads", "rewards.score", "baseten_loops_cli.training.rewards.builtins:score"):
        p = _loops(["train", "validate", str(_rl_config(cfg_dir, spec, prompts)), "--offline"], env, cwd, timeout=120)
        assert p.returncode != 0, spec
        assert "unknown reward" in p.stderr, p.stderr
        assert not evil_marker.exists() and not legit_marker.exists(), spec

    # A finished run's directory pins the absolute path: resuming from another directory
    # (which has its own rewards.py) still loads the original file.
    cfg = _rl_config(cfg_dir, "rewards.py:score", prompts)
    rd = tmp_path / "rd"
    p = _loops(["train", "run", str(cfg), "--run-dir", str(rd)], env, cfg_dir, timeout=600)
    assert p.returncode == 0, p.stderr
    saved = (rd / "config.yaml").read_text()
    assert f"{cfg_dir / 'rewards.py'}:score" in saved, saved
    legit_marker.unlink(missing_ok=True)
    evil_marker.unlink(missing_ok=True)
    state = json.loads((rd / "state.json").read_text())
    state["status"] = "failed"  # as if interrupted, so resume loads the config again
    (rd / "state.json").write_text(json.dumps(state))
    p = _loops(["train", "resume", str(rd)], env, cwd, timeout=600)
    assert p.returncode == 0, p.stderr
    assert legit_marker.exists() and not evil_marker.exists()
