"""`loops checkpoints download` under faults: interrupted and resumed, truncated or corrupted
files detected and fetched again, expired links re-signed. Real server, real CLI, the fault
proxy in between (LOOPS_BASE_URL points at it, so presigned links do too)."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.faultproxy import FaultProxy
from tests.support import cli_env, ctrl_c_as_a_terminal_sends, kill, wait_for

pytest.importorskip("torch")

MODEL = "loops-local/tiny"


# ── helpers ─────────────────────────────────────────────────────────────────────────────────


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): _sha(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".loops-download") and not p.name.endswith(".part")}


def _loops_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "baseten_loops_cli", *args]


def _download(server, ckpt: str, dest: Path, base_url: str | None = None, *extra: str,
              timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(_loops_cmd("checkpoints", "download", ckpt, "-O", str(dest), "-o", "json", *extra),
                          env=cli_env(server, LOOPS_BASE_URL=base_url or server.url), capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=dest.parent)


class Ckpt:
    def __init__(self, server, run_id: str, cp: dict) -> None:
        self.server, self.run_id, self.cp = server, run_id, cp
        with server.client() as c:
            self.source = Path(c.get(f"/v1/loops/checkpoints/{cp['id']}/source").json()["source"]["path"])
        self.expected = _tree(self.source)

    @property
    def ref(self) -> str:
        return f"{self.run_id}:{self.cp['checkpoint_id']}"


def _make_checkpoint(server, name: str = "dl", lora_rank: int = 4) -> Ckpt:
    from baseten_loops_cli.workers.trainer import TrainerClient

    with server.client() as c:
        session = c.post("/v1/loops/sessions", json={}).json()["session"]["id"]
        run = c.post("/v1/loops/trainers", json={"session_id": session, "base_model": MODEL,
                                                 "lora_rank": lora_rank}).json()["run"]
    with TrainerClient(f"{server.url}/trainers/{run['id']}", api_key=server.token, run_id=run["id"],
                       base_model=MODEL) as tc:
        tc.save_state(name).result(timeout=120)
    with server.client() as c:
        cps = c.get("/v1/loops/checkpoints", params={"run_id": run["id"]}).json()["checkpoints"]
    return Ckpt(server, run["id"], next(x for x in cps if x["checkpoint_id"] == name))


@pytest.fixture(scope="module")
def ckpt(local_server) -> Ckpt:
    """A trainer checkpoint (4 files, ~2.2 MB at rank 64: weights, config, optimizer, state).
    Big enough that a throttled download is interrupted with whole MiBs on disk (the
    downloader writes in 1 MiB blocks)."""
    return _make_checkpoint(local_server, lora_rank=64)


def _port(url: str) -> int:
    return httpx.URL(url).port


# ── tests ───────────────────────────────────────────────────────────────────────────────────


def test_download_through_transport_faults(local_server, ckpt, tmp_path):
    """Resets, lost responses, 5xx, 408s, delays and replays on the listing and the files."""
    dest = tmp_path / "out"
    with FaultProxy("127.0.0.1", _port(local_server.url), rate=0.3, seed=77, delay_s=0.1,
                    retry_after_s=0) as proxy:
        p = _download(local_server, ckpt.ref, dest, proxy.url)
        snap = proxy.snapshot()
    assert p.returncode == 0, p.stderr
    assert snap["injected"] > 0
    assert _tree(dest) == ckpt.expected
    assert not list(dest.glob("*.part")) and not (dest / ".loops-download.json").exists()


def test_download_killed_then_resumed(local_server, ckpt, tmp_path):
    """SIGKILL half way (a throttled link); the same command again finishes the job, keeping
    what was saved, and the files are byte-identical to the checkpoint."""
    dest = tmp_path / "out"
    with FaultProxy("127.0.0.1", _port(local_server.url), rate=0.0, throttle_bps=400_000,
                    throttle_path=r"^/files/") as proxy:
        proc = subprocess.Popen(_loops_cmd("checkpoints", "download", ckpt.ref, "-O", str(dest), "--parallel", "1"),
                                env=cli_env(local_server, LOOPS_BASE_URL=proxy.url), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=tmp_path)
        def part_bytes() -> int:
            return sum(p.stat().st_size for p in dest.glob("*.part")) if dest.exists() else 0

        try:
            wait_for(lambda: proc.poll() is not None or part_bytes() >= 1 << 20, timeout=60, interval=0.05,
                     what="1 MiB of .part files")
            assert proc.poll() is None, "the download finished before it could be interrupted"
        finally:
            kill(proc)
        assert part_bytes() > 0
        assert (dest / ".loops-download.json").exists()
        proxy.set_throttle(None)
        p = _download(local_server, ckpt.ref, dest, proxy.url)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["bytes_resumed"] > 0 or doc["files_skipped"] > 0, doc
    assert doc["bytes_downloaded"] < doc["bytes"], doc  # what was saved was not fetched again
    assert _tree(dest) == ckpt.expected


def test_download_interrupted_with_ctrl_c_says_how_to_resume(local_server, ckpt, tmp_path):
    dest = tmp_path / "out"
    with FaultProxy("127.0.0.1", _port(local_server.url), rate=0.0, throttle_bps=200_000,
                    throttle_path=r"^/files/") as proxy:
        proc = subprocess.Popen(_loops_cmd("checkpoints", "download", ckpt.ref, "-O", str(dest)),
                                env=cli_env(local_server, LOOPS_BASE_URL=proxy.url), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path, preexec_fn=ctrl_c_as_a_terminal_sends)
        # The transfer has started (its resume record is written) and bytes are arriving.
        wait_for(lambda: proc.poll() is not None or ((dest / ".loops-download.json").exists() and any(
            p.stat().st_size > 0 for p in dest.glob("*.part"))), timeout=60, interval=0.05, what="bytes on disk")
        assert proc.poll() is None, "the download finished before Ctrl-C"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "resume" in err.lower() and "Traceback" not in err


def test_truncated_transfers_are_resumed_to_full_size(local_server, ckpt, tmp_path):
    """Half of the file responses are cut mid-body (RST): each file is continued with a Range
    request until it is complete."""
    dest = tmp_path / "out"
    with FaultProxy("127.0.0.1", _port(local_server.url), rate=0.5, seed=5, mix=["truncate"],
                    only=r"^/files/") as proxy:
        p = _download(local_server, ckpt.ref, dest, proxy.url)
        snap = proxy.snapshot()
    assert p.returncode == 0, p.stderr
    assert snap["by_kind"].get("truncate", 0) > 0, snap
    assert _tree(dest) == ckpt.expected


def test_corrupted_transfer_is_detected_and_fetched_again(local_server, ckpt, tmp_path):
    """A flipped byte in transit (same length). Only a checksum can catch it; the download
    must not end 'successfully' with a corrupt adapter."""
    dest = tmp_path / "out"
    fired = {"n": 0}

    def first_file_response_only(kind, method, path):
        fired["n"] += 1
        return fired["n"] == 1

    with FaultProxy("127.0.0.1", _port(local_server.url), rate=1.0, mix=["corrupt"], only=r"^/files/",
                    allow=first_file_response_only) as proxy:
        p = _download(local_server, ckpt.ref, dest, proxy.url, "--parallel", "1")
        assert proxy.counts["corrupt"] == 1
    assert p.returncode == 0, p.stderr
    assert _tree(dest) == ckpt.expected, "a corrupted file was kept as if it were complete"


def test_damaged_files_of_an_interrupted_download_are_fetched_again(local_server, ckpt, tmp_path):
    """An interrupted download left one file truncated and one with a flipped byte (same size)
    on disk. The rerun must detect both and fetch them again."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / ".loops-download.json").write_text(json.dumps({"checkpoint_id": ckpt.cp["id"],
                                                          "started_at": time.time()}))
    names = sorted(ckpt.expected)
    weights = next(n for n in names if n.endswith(".safetensors"))
    config = next(n for n in names if n.endswith("adapter_config.json"))
    data = (ckpt.source / weights).read_bytes()
    (dest / weights).write_bytes(data[: len(data) // 3])  # truncated
    cfg = bytearray((ckpt.source / config).read_bytes())
    cfg[len(cfg) // 2] ^= 0x01  # corrupted, same size
    (dest / config).write_bytes(bytes(cfg))
    p = _download(local_server, ckpt.ref, dest)
    assert p.returncode == 0, p.stderr
    got = _tree(dest)
    assert got[weights] == ckpt.expected[weights], "a truncated file was not fetched again"
    assert got[config] == ckpt.expected[config], "a corrupted file (same size) was not fetched again"


def test_expired_links_are_re_signed(server_factory, tmp_path):
    """Links that expired before use are refused (403) and re-listed, then fetched."""
    from baseten_loops_cli.api.download import download_files

    server = server_factory(link_ttl_s=1)
    ck = _make_checkpoint(server, "exp")

    with FaultProxy("127.0.0.1", _port(server.url), rate=0.0) as proxy:
        def list_files() -> list[dict]:
            with httpx.Client(base_url=proxy.url, headers={"Authorization": f"Api-Key {server.token}"},
                              timeout=30) as c:
                return c.get(f"/v1/loops/checkpoints/{ck.cp['id']}/files").json()["presigned_urls"]

        stale = list_files()
        wait_for(lambda: all(httpx.get(f["url"], timeout=30).status_code == 403 for f in stale), timeout=30,
                 interval=0.2, what="every link to expire")
        for f in stale[:1]:
            r = httpx.get(f["url"], timeout=30)
            assert r.status_code == 403 and r.json()["error_class"] == "LinkExpired"
        result = download_files(stale, tmp_path / "out", checkpoint_id=ck.cp["id"], refresh=list_files,
                                check_free_space=False)
        listings = [e for e in proxy.events_list() if e.path.endswith("/files")]
    assert result.refreshed_links >= 1
    assert len(listings) >= 2
    assert _tree(tmp_path / "out") == ck.expected

    # The CLI end to end with 1 s links through a slow link: still complete.
    with FaultProxy("127.0.0.1", _port(server.url), rate=0.3, seed=2, mix=["truncate"], only=r"^/files/",
                    throttle_bps=60_000, throttle_path=r"^/files/") as proxy:
        p = _download(server, ck.ref, tmp_path / "cli", proxy.url, "--parallel", "1")
    assert p.returncode == 0, p.stderr
    assert _tree(tmp_path / "cli") == ck.expected


def test_a_ctrl_c_while_the_workers_start_settles_without_joining_unstarted_ones():
    """CI saw "cannot join thread before it is started" (exit 1, not 130) when the Ctrl-C landed
    while download_files was starting its workers: _settle joined one that never ran."""
    import threading
    from types import SimpleNamespace

    from baseten_loops_cli.api import download

    shared = SimpleNamespace(cancel=threading.Event())
    started = threading.Thread(target=shared.cancel.wait)
    started.start()
    download._settle(shared, [started, threading.Thread(target=lambda: None)], wait_s=1.0)
    assert shared.cancel.is_set() and not started.is_alive()
