"""`loops checkpoints download` and the downloader behind it (api/download.py), against the real
local server: parallel files, verified sizes, resume of .part files with Range, expired links
fetched again, refusal of a non-empty target, unwritable targets, a full disk mid download, and
file names that would leave the target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from baseten_loops_cli.api import download as dl
from tests.cli_support import api, cli_env, loops, one_line_error, seeded, wait_for  # noqa: F401  (fixture)
from tests.support import ctrl_c_as_a_terminal_sends


def _files(server, checkpoint_id: str) -> list[dict]:
    return api(server, "GET", f"/v1/loops/checkpoints/{checkpoint_id}/files")["presigned_urls"]


def _expected(server, checkpoint_id: str) -> dict[str, bytes]:
    return {f["relative_file_name"]: httpx.get(f["url"]).content for f in _files(server, checkpoint_id)}


def _on_disk(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def faults(seeded):
    """Add faults to the session server; they are cleared afterwards."""
    server = seeded.server

    def add(**spec):
        return api(server, "POST", "/v1/local/faults", json=spec)

    yield add
    api(server, "DELETE", "/v1/local/faults")


def test_download_by_name_writes_verified_files_and_reports_json(seeded, tmp_path):
    cp = seeded.cp("s2")
    dest = tmp_path / "adapter"
    result = loops(seeded.server, "checkpoints", "download", f"{seeded.run_id}:s2", "--target", "sampler",
                   "-O", str(dest), "-o", "json")
    assert result.code == 0, result
    doc = result.json()
    assert doc["checkpoint_id"] == cp["id"] and doc["path"] == str(dest)
    assert doc["files"] == 2 and doc["bytes"] == doc["bytes_downloaded"] > 0
    assert _on_disk(dest) == _expected(seeded.server, cp["id"])  # no .part, no marker left
    # human output: one line on stderr, nothing on stdout
    again = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(tmp_path / "b"))
    assert again.code == 0 and again.stdout == ""
    assert f"Downloaded {seeded.run_id}:s2 (2 files" not in again.stderr  # by id: no name lookup
    assert f"Downloaded {cp['id']} (2 files" in again.stderr and str(tmp_path / "b") in again.stderr


def test_default_folder_is_run_and_name(seeded, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = loops(seeded.server, "checkpoints", "download", f"{seeded.run_id}:s1")
    assert result.code == 0, result
    assert (tmp_path / f"{seeded.run_id}-s1" / "adapter_model.safetensors").is_file()


def test_non_empty_target_is_refused_without_force(seeded, tmp_path):
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    ref = f"bt://loops:{seeded.run_id}/sampler_weights/s1"
    result = loops(seeded.server, "checkpoints", "download", ref, "-O", str(dest))
    one_line_error(result, 2, "is not empty", "--force")
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    forced = loops(seeded.server, "checkpoints", "download", ref, "-O", str(dest), "--force")
    assert forced.code == 0, forced
    assert (dest / "notes.txt").read_text() == "mine"  # other files are left alone
    assert (dest / "adapter_config.json").is_file()


def test_partial_download_resumes_with_range(seeded, tmp_path):
    cp = seeded.cp("t1", "trainer")
    expected = _expected(seeded.server, cp["id"])
    dest = tmp_path / "resume"
    dest.mkdir()
    # What an interrupted run leaves: the marker, one finished file, .part halves of the others.
    (dest / dl.MARKER_NAME).write_text(json.dumps({"checkpoint_id": cp["id"]}))
    names = sorted(expected, key=lambda n: -len(expected[n]))
    done, partial = names[-1], names[:-1]
    (dest / done).parent.mkdir(parents=True, exist_ok=True)
    (dest / done).write_bytes(expected[done])
    for name in partial:
        part = dest / (name + dl.PART_SUFFIX)
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(expected[name][: len(expected[name]) // 2])
    result = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(dest), "-o", "json")
    assert result.code == 0, result
    doc = result.json()
    kept = sum(len(expected[n]) // 2 for n in partial)
    assert doc["files_skipped"] == 1 and doc["bytes_resumed"] == kept
    assert doc["bytes_downloaded"] == sum(len(expected[n]) for n in partial) - kept
    assert _on_disk(dest) == expected


def test_stale_part_longer_than_the_file_is_restarted(seeded, tmp_path):
    cp = seeded.cp("s1")
    expected = _expected(seeded.server, cp["id"])
    dest = tmp_path / "stale"
    dest.mkdir()
    (dest / dl.MARKER_NAME).write_text(json.dumps({"checkpoint_id": cp["id"]}))
    for name, data in expected.items():
        (dest / (name + dl.PART_SUFFIX)).write_bytes(b"x" * (len(data) + 10))
    result = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(dest))
    assert result.code == 0, result
    assert _on_disk(dest) == expected


def test_transient_errors_are_retried(seeded, tmp_path, faults):
    cp = seeded.cp("s1")
    faults(path=f"/files/{cp['id']}/*", status=503, times=2)
    result = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(tmp_path / "d"), "--parallel", "1")
    assert result.code == 0, result
    assert _on_disk(tmp_path / "d") == _expected(seeded.server, cp["id"])


def test_expired_links_are_fetched_again(seeded, tmp_path, faults):
    cp = seeded.cp("s2")
    faults(path=f"/files/{cp['id']}/*", status=403, times=2,
           body={"detail": "This file link has expired.", "error_class": "LinkExpired"})
    result = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(tmp_path / "d"), "-o", "json")
    assert result.code == 0, result
    assert result.json()["refreshed_links"] >= 1
    assert _on_disk(tmp_path / "d") == _expected(seeded.server, cp["id"])


def test_a_link_that_stays_forbidden_fails_with_one_line(seeded, tmp_path, faults):
    cp = seeded.cp("s1")
    faults(path=f"/files/{cp['id']}/adapter_config.json", status=403, times=50)
    result = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(tmp_path / "d"))
    one_line_error(result, 1, "adapter_config.json", "refused")


def test_unwritable_target(seeded, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = loops(seeded.server, "checkpoints", "download", seeded.cp("s1")["id"], "-O", str(blocker / "sub"))
    one_line_error(result, 1, "cannot write to", "-O DIR")
    result = loops(seeded.server, "checkpoints", "download", seeded.cp("s1")["id"], "-O", str(blocker))
    one_line_error(result, 2, "is a file")  # a bad -O, as export and train --run-dir say
    if os.geteuid() != 0:  # root ignores permissions
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        result = loops(seeded.server, "checkpoints", "download", seeded.cp("s1")["id"], "-O", str(locked / "x"))
        one_line_error(result, 1, "cannot write to", "permission denied")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_mid_download_keeps_what_was_saved_and_resumes(seeded, tmp_path):
    """A write that fails with ENOSPC (a .part that is /dev/full) stops the download with one
    line saying how to resume; the next run finishes it."""
    cp = seeded.cp("s2")
    dest = tmp_path / "full"
    dest.mkdir()
    (dest / dl.MARKER_NAME).write_text(json.dumps({"checkpoint_id": cp["id"]}))
    (dest / ("adapter_model.safetensors" + dl.PART_SUFFIX)).symlink_to("/dev/full")
    result = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(dest), "--parallel", "1")
    one_line_error(result, 1, "no space left", "run the same command again")
    (dest / ("adapter_model.safetensors" + dl.PART_SUFFIX)).unlink()  # space is back
    again = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(dest))
    assert again.code == 0, again
    assert _on_disk(dest) == _expected(seeded.server, cp["id"])


def test_unknown_checkpoint_and_bad_parallel(seeded, tmp_path):
    result = loops(seeded.server, "checkpoints", "download", "nOsUcH00", "-O", str(tmp_path / "x"))
    one_line_error(result, 1, "no checkpoint 'nOsUcH00'")
    result = loops(seeded.server, "checkpoints", "download", f"{seeded.run_id}:s2", "-O", str(tmp_path / "y"))
    one_line_error(result, 2, "named 's2'", "--target")
    result = loops(seeded.server, "checkpoints", "download", f"{seeded.run_id}:s1", "--parallel", "0")
    assert result.code == 2


def test_a_terminal_gets_a_progress_bar_on_stderr(seeded, tmp_path, monkeypatch):
    from baseten_loops_cli.output import sink

    original = sink.Streams.__post_init__

    def stderr_is_a_tty(self):
        original(self)
        self.stderr_tty = True

    monkeypatch.setattr(sink.Streams, "__post_init__", stderr_is_a_tty)
    result = loops(seeded.server, "checkpoints", "download", f"{seeded.run_id}:s1", "-O", str(tmp_path / "bar"))
    assert result.code == 0, result
    assert f"{seeded.run_id}:s1" in result.stderr and "2/2 files" in result.stderr and "KiB" in result.stderr
    assert result.stdout == ""
    # A program reads stdout (-o json, -q): no bar on the terminal either, as for every live view.
    for args in (["-o", "json"], ["-q"]):
        result = loops(seeded.server, "checkpoints", "download", f"{seeded.run_id}:s1", "-O", str(tmp_path / "bar"),
                       "--force", *args)
        assert result.code == 0, result
        assert "2/2 files" not in result.stderr and "/520" not in result.stderr, result
    assert json.loads(loops(seeded.server, "checkpoints", "download", f"{seeded.run_id}:s1", "-O",
                            str(tmp_path / "bar2"), "-o", "json").stdout)["files"] == 2


def test_ctrl_c_keeps_what_was_saved_and_the_next_run_resumes(seeded, tmp_path, faults):
    cp = seeded.cp("t1", "trainer")
    dest = tmp_path / "interrupted"
    faults(path=f"/files/{cp['id']}/*", delay_s=4, times=20)
    proc = subprocess.Popen([sys.executable, "-m", "baseten_loops_cli", "checkpoints", "download", cp["id"], "-O", str(dest)],
                            env=cli_env(seeded.server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_as_a_terminal_sends)

    def held() -> bool:  # the server holds a file request of this download (its fault was taken)
        faults_now = api(seeded.server, "GET", "/v1/local/faults")["faults"]
        return any(f.get("path") == f"/files/{cp['id']}/*" and f.get("remaining", 20) < 20 for f in faults_now)

    try:
        wait_for(lambda: (dest / dl.MARKER_NAME).exists() and held(), timeout=30, interval=0.05,
                 what="the download to be under way")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "download interrupted" in err and "Run the same command again to resume." in err
    assert "Traceback" not in err
    # It did not wait for the stalled files: they are not all on disk (the server holds each
    # answer 4 s; had the CLI waited for them, the download would be complete). The faults are
    # cleared first: what _expected fetches would be held 4 s a file too (16 s of this test).
    on_disk = _on_disk(dest)
    api(seeded.server, "DELETE", "/v1/local/faults")
    assert any(on_disk.get(name) != data for name, data in _expected(seeded.server, cp["id"]).items())
    assert (dest / dl.MARKER_NAME).exists()
    again = loops(seeded.server, "checkpoints", "download", cp["id"], "-O", str(dest))
    assert again.code == 0, again
    assert _on_disk(dest) == _expected(seeded.server, cp["id"])


# ── the downloader itself (names the server would never send) ────────────────────────────


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "a/../../b", "a//b", "./a", "a\\..\\b", "C:evil", "", "a/\x00"])
def test_names_that_would_leave_the_target_refuse_the_whole_download(tmp_path, name):
    files = [{"relative_file_name": "ok.bin", "url": "http://127.0.0.1:9/ok", "size_bytes": 1},
             {"relative_file_name": name, "url": "http://127.0.0.1:9/x", "size_bytes": 1}]
    with pytest.raises(dl.UnsafePathError) as err:
        dl.download_files(files, tmp_path / "out", checkpoint_id="c")
    assert "outside the target folder" in err.value.message
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_symlink_inside_the_target_cannot_redirect_writes(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    (dest / dl.MARKER_NAME).write_text(json.dumps({"checkpoint_id": "c"}))

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter([b"data"]))

    files = [{"relative_file_name": "sub/x.bin", "url": "http://files.test/x", "size_bytes": 4}]
    with pytest.raises(dl.UnsafePathError):
        dl.download_files(files, dest, checkpoint_id="c", transport=httpx.MockTransport(handler))
    assert list(outside.iterdir()) == []


def test_a_server_that_ignores_range_restarts_the_file(tmp_path):
    body = os.urandom(300_000)
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("range"))
        return httpx.Response(200, content=iter([body]))  # never 206

    dest = tmp_path / "d"
    dest.mkdir()
    (dest / dl.MARKER_NAME).write_text(json.dumps({"checkpoint_id": "c"}))
    (dest / ("f.bin" + dl.PART_SUFFIX)).write_bytes(body[:1000])
    result = dl.download_files([{"relative_file_name": "f.bin", "url": "http://files.test/f", "size_bytes": len(body)}],
                               dest, checkpoint_id="c", transport=httpx.MockTransport(handler))
    assert seen == ["bytes=1000-"]
    assert (dest / "f.bin").read_bytes() == body and result.bytes_resumed == 1000


def test_a_short_body_is_retried_from_where_it_stopped(tmp_path):
    body = os.urandom(200_000)
    calls: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        rng = request.headers.get("range")
        calls.append(rng)
        if rng is None:
            def dropped():
                yield body[:50_000]
                raise httpx.ReadError("connection reset")
            return httpx.Response(200, content=dropped())
        start = int(rng.split("=")[1].rstrip("-"))
        return httpx.Response(206, content=iter([body[start:]]),
                              headers={"content-range": f"bytes {start}-{len(body) - 1}/{len(body)}"})

    result = dl.download_files([{"relative_file_name": "f.bin", "url": "http://files.test/f", "size_bytes": len(body)}],
                               tmp_path / "d", checkpoint_id="c", transport=httpx.MockTransport(handler), sleep=lambda s: None)
    assert calls == [None, "bytes=50000-"]
    assert (tmp_path / "d" / "f.bin").read_bytes() == body
    assert result.bytes_downloaded == len(body)


def test_a_size_mismatch_is_never_renamed_into_place(tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("range"):
            return httpx.Response(416, headers={"content-range": "bytes */5"})
        return httpx.Response(200, content=iter([b"short"]))

    with pytest.raises(dl.DownloadError) as err:
        dl.download_files([{"relative_file_name": "f.bin", "url": "http://files.test/f", "size_bytes": 10}],
                          tmp_path / "d", checkpoint_id="c", transport=httpx.MockTransport(handler), sleep=lambda s: None)
    assert "giving up" in err.value.message and "f.bin" in err.value.message
    assert not (tmp_path / "d" / "f.bin").exists()


def test_a_checksum_mismatch_is_fetched_again(tmp_path):
    import hashlib

    body = os.urandom(100_000)
    bad = bytearray(body)
    bad[500] ^= 0xFF
    responses = [bytes(bad), body]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter([responses.pop(0)]))

    files = [{"relative_file_name": "w.bin", "url": "http://files.test/w", "size_bytes": len(body),
              "sha256": hashlib.sha256(body).hexdigest()}]
    dl.download_files(files, tmp_path / "d", checkpoint_id="c", transport=httpx.MockTransport(handler), sleep=lambda s: None)
    assert (tmp_path / "d" / "w.bin").read_bytes() == body and responses == []


def test_link_expiry_is_read_from_presigned_urls():
    assert dl.link_expires_at("http://x/f?expires=1700000000&sig=ab") == 1700000000
    assert dl.link_expires_at("https://b.s3.amazonaws.com/k?X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600&X-Amz-Signature=s") == 1704070800
    assert dl.link_expires_at("https://storage.googleapis.com/b/k?X-Goog-Date=20240101T000000Z&X-Goog-Expires=60") == 1704067260
    assert dl.link_expires_at("https://example.com/file") is None


def test_colliding_names_of_other_node_ranks_get_their_own_folder():
    files = [dl.RemoteFile("model.bin", "u0", 1, 0), dl.RemoteFile("model.bin", "u1", 1, 1), dl.RemoteFile("a.json", "u2", 1, 1)]
    layout = dl.plan_paths(files)
    assert [str(layout[f.key]) for f in files] == ["model.bin", "node-1/model.bin", "a.json"]


def test_downloads_read_the_socket_in_large_pieces(seeded, tmp_path, monkeypatch):
    """httpcore's 64 KiB reads made the download threads fight over the GIL (a transfer at 0.41
    of curl's speed, bench/download.py); a download reads 1 MiB at a time. Checked on the reads
    the real transfer makes."""
    from httpcore._backends import sync as sync_backend
    from httpcore._sync import http11

    cp = seeded.cp("s2")
    files = _files(seeded.server, cp["id"])
    monkeypatch.setattr(http11.HTTP11Connection, "READ_NUM_BYTES", 64 * 1024)
    sizes: list[int] = []
    real_read = sync_backend.SyncStream.read

    def read(self, max_bytes, timeout=None):
        sizes.append(max_bytes)
        return real_read(self, max_bytes, timeout)

    monkeypatch.setattr(sync_backend.SyncStream, "read", read)
    result = dl.download_files(files, tmp_path / "out", checkpoint_id=cp["id"])
    assert result.files == 2 and sizes and min(sizes) >= dl.READ_BYTES
