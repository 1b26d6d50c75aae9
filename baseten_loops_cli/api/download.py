"""Download a checkpoint's files from their presigned URLs: parallel, resumable, verified.

A transfer in three parts: :func:`plan` (validate the names, claim the target, list what is
left), :func:`fetch_file` (one file: attempts decided by ``api.retry.decide``, resume, verify,
rename) and :func:`run` (the files in parallel on the shared transport).
``download_files(files, dest, ...)`` (plan, then run) is what ``loops checkpoints download``
runs. The file list
comes from ``GET /v1/loops/checkpoints/{id}/files`` (every page); this module never talks to the
control plane itself, except through the ``refresh`` callable it is given to re-list the files
when a link has expired.

What it guarantees:

* **Safe paths.** Every ``relative_file_name`` is checked before anything is written: absolute
  paths, ``..``, backslashes, empty parts or NUL bytes refuse the whole download, and a write
  through a symlink that leads out of the target folder is refused too.
* **No clobbering.** A target that already holds files is refused unless ``force`` is set.
  An interrupted download of the *same* checkpoint is not "files": the target keeps a small
  marker (``.loops-download.json``) until the download completes, and a rerun resumes it.
* **Resume.** Each file is written to ``<name>.part`` and renamed once complete. A rerun (or a
  retry after a dropped connection) continues a ``.part`` with ``Range: bytes=<size>-``; a server
  that ignores the range gets the file again from the start.
* **Verification.** A finished file must have exactly ``size_bytes`` bytes, and, when the
  listing gives its SHA-256 (the local backend does) or the response carries
  ``X-Checksum-Sha256``, that digest; otherwise it is fetched again, never renamed into place.
  Resumed ``.part`` files are continued with ``If-Range`` so a changed file is sent whole.
* **Expired links.** A 403 re-lists the files (once per expiry, shared by all workers) and
  retries with the fresh link; links that will expire within a minute are refreshed up front.
* **Clear failures.** An unwritable target, a full disk (ENOSPC/EDQUOT, with what was saved
  and how to resume), and a link that keeps failing are one-line :class:`LoopsError` s.

Presigned URLs carry their own credentials: no ``Authorization`` header is ever sent with them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Mapping, Protocol
from urllib.parse import parse_qs, urlsplit

import httpx

from baseten_loops_cli.api.http import HttpClient
from baseten_loops_cli.api.download_target import (
    _DISK_FULL,
    MARKER_NAME,
    DiskFullError,
    DownloadError,
    TargetNotEmptyError,
    UnsafePathError,
    _inside,
    _write_error,
    _hex_digest,
    file_sha256,
    plan_paths,
    prepare_target,
    safe_relative_path,
)
from baseten_loops_cli.api.retry import RetryPolicy, RetryState, decide
from baseten_loops_cli.errors import InterruptedByUser, UsageError

PART_SUFFIX = ".part"
DEFAULT_PARALLEL = 8
MAX_PARALLEL = 64
# Attempts per file without progress before giving up (a retry that received bytes resets it).
MAX_ATTEMPTS = 5
# Link refreshes per file before a 403 is taken at its word.
MAX_REFRESHES = 3
# Refresh a link before using it when it expires sooner than this (seconds).
EXPIRY_MARGIN_S = 60.0
CONNECT_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 60.0


# ── inputs and outputs ─────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class RemoteFile:
    """One entry of the files route (``CheckpointFile``), with its place under the target."""

    relative_file_name: str
    url: str
    size_bytes: int | None
    node_rank: int = 0
    sha256: str | None = None  # not in the hosted schema; the local backend lists it

    @classmethod
    def from_json(cls, entry: Mapping[str, Any] | Any) -> "RemoteFile":
        get = entry.get if isinstance(entry, Mapping) else (lambda k, d=None: getattr(entry, k, d))
        size = get("size_bytes")
        digest = get("sha256")
        return cls(
            relative_file_name=str(get("relative_file_name")),
            url=str(get("url")),
            size_bytes=int(size) if size is not None else None,
            node_rank=int(get("node_rank") or 0),
            sha256=_hex_digest(digest),
        )

    @property
    def key(self) -> tuple[int, str]:
        return (self.node_rank, self.relative_file_name)


@dataclass
class DownloadResult:
    path: Path
    files: int
    bytes_total: int
    bytes_downloaded: int  # fetched by this invocation
    files_skipped: int  # already complete from an earlier, interrupted run
    bytes_resumed: int  # already on disk in .part files when this run started
    seconds: float
    refreshed_links: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "files": self.files,
            "bytes": self.bytes_total,
            "bytes_downloaded": self.bytes_downloaded,
            "files_skipped": self.files_skipped,
            "bytes_resumed": self.bytes_resumed,
            "seconds": round(self.seconds, 3),
            "bytes_per_second": round(self.bytes_downloaded / self.seconds) if self.seconds > 0 else None,
            "refreshed_links": self.refreshed_links,
        }


class Progress(Protocol):
    """What the downloader reports (the CLI draws it with Rich on a TTY)."""

    def start(self, *, total_bytes: int, completed_bytes: int, files: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def file_done(self, name: str) -> None: ...


class NoProgress:
    """A :class:`Progress` that draws nothing (the default; also the CLI's when nobody watches:
    ``Output.progress`` off a terminal). A context manager, as the CLI's bar is."""

    def __enter__(self) -> "NoProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def start(self, *, total_bytes: int, completed_bytes: int, files: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def file_done(self, name: str) -> None:
        pass


# ── link expiry ────────────────────────────────────────────────────────────────────────────


def link_expires_at(url: str) -> float | None:
    """Unix time at which a presigned URL stops working, when the URL says so.

    Understands the local backend's ``expires=<unix>``, S3 SigV4 (``X-Amz-Date`` +
    ``X-Amz-Expires``), S3 SigV2/CloudFront ``Expires=<unix>`` and GCS (``X-Goog-Date`` +
    ``X-Goog-Expires``).
    """
    try:
        query = {k.lower(): v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    except ValueError:
        return None
    try:
        if "expires" in query and query["expires"].isdigit():
            return float(query["expires"])
        for prefix in ("x-amz-", "x-goog-"):
            date, ttl = query.get(prefix + "date"), query.get(prefix + "expires")
            if date and ttl:
                import calendar

                start = calendar.timegm(time.strptime(date, "%Y%m%dT%H%M%SZ"))
                return float(start + int(ttl))
    except (ValueError, OverflowError):
        return None
    return None


class _Links:
    """The current URL of every file, re-listed through ``refresh`` at most once per expiry."""

    def __init__(self, files: list[RemoteFile], refresh: Callable[[], Iterable[Any]] | None):
        self._urls = {f.key: f.url for f in files}
        self._refresh = refresh
        self._lock = threading.Lock()
        self.generation = 0
        self.refreshes = 0

    def get(self, key: tuple[int, str]) -> tuple[str, int]:
        with self._lock:
            return self._urls[key], self.generation

    def refresh(self, seen_generation: int) -> bool:
        """Re-list the links unless another worker did since ``seen_generation``.

        Returns False when no refresh is possible (no ``refresh`` callable)."""
        if self._refresh is None:
            return False
        with self._lock:
            if self.generation != seen_generation:
                return True
            fresh = [RemoteFile.from_json(e) for e in self._refresh()]
            for f in fresh:
                if f.key in self._urls:
                    self._urls[f.key] = f.url
            self.generation += 1
            self.refreshes += 1
            return True


# ── HTTP: the shared transport, one attempt at a time ────────────────────────────────────────
#
# Files are fetched on the process's httpx client of their origin (``api.http.HttpClient``, with
# no Authorization: presigned URLs carry their own credentials) and streamed to disk as the
# chunks arrive (httpx's raw stream costs no more CPU than a hand-made http.client loop: 0.35
# vs 0.45 s per 256 MiB measured on loopback). Each attempt's outcome goes to
# ``api.retry.decide`` under DOWNLOAD_POLICY: Retry-After honoured, backoff with jitter, and at
# most MAX_ATTEMPTS attempts without progress (an attempt that received bytes restarts the count).

# httpcore reads a response 64 KiB at a time (``HTTP11Connection.READ_NUM_BYTES``, a class
# attribute with no public setting). At ~1 GB/s over 8 streams that is ~16k reads a second, each
# releasing and retaking the GIL: the worker threads spent more time waiting for the GIL than
# moving bytes (transfer 0.41 of curl's speed on 2 cores). With 1 MiB reads: 0.86. A read
# returns what has arrived, so small responses are unaffected.
READ_BYTES = 1 << 20


def _read_in_large_pieces() -> None:
    from httpcore._sync import http11

    if getattr(http11.HTTP11Connection, "READ_NUM_BYTES", READ_BYTES) < READ_BYTES:
        http11.HTTP11Connection.READ_NUM_BYTES = READ_BYTES


DOWNLOAD_POLICY = RetryPolicy(retry_statuses=frozenset({408, 425, 429, 500, 502, 503, 504}), max_retries=MAX_ATTEMPTS - 1)


class _BodyFailure(httpx.ReadError):
    """The body ended short, ran long, or had the wrong checksum: fetched again (a Range
    request continues what was saved). A read error to :func:`decide`."""


class _Clients:
    """The HttpClient of each origin the links point at (released when the run ends)."""

    def __init__(self, transport: httpx.BaseTransport | None, read_timeout: float):
        self._transport = transport
        self._timeout = httpx.Timeout(read_timeout, connect=CONNECT_TIMEOUT_S)
        self._lock = threading.Lock()
        self._by_origin: dict[str, HttpClient] = {}

    def get(self, url: str, headers: Mapping[str, str]) -> httpx.Response:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DownloadError(f"unsupported file link {parts.scheme}://{parts.hostname or ''}/...")
        origin = f"{parts.scheme}://{parts.netloc}"
        with self._lock:
            client = self._by_origin.get(origin)
            if client is None:
                client = self._by_origin[origin] = HttpClient(origin, None, timeout=self._timeout, transport=self._transport)
        try:
            return client.open("GET", url, headers={"Accept-Encoding": "identity", **headers}, follow_redirects=True)
        except httpx.TooManyRedirects:
            raise DownloadError(f"the file link {_shown(url)} redirected too many times") from None

    def close(self) -> None:
        with self._lock:
            clients, self._by_origin = list(self._by_origin.values()), {}
        for client in clients:
            client.close()


def _shown(url: str) -> str:
    """A file link without its query (the signature)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _BodyFailure):
        return str(exc)
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return f"no data for {READ_TIMEOUT_S:.0f}s (timeout)"
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


# ── plan: what to fetch, where ──────────────────────────────────────────────────────────────


@dataclass
class _Job:
    file: RemoteFile
    rel: PurePosixPath
    final: Path
    part: Path
    have: int = 0  # bytes already in .part when the run started
    expected_sha256: str | None = None  # from the listing, or the response's X-Checksum-Sha256
    hasher: Any = None  # SHA-256 of the .part's first ``hashed`` bytes, while it is known
    hashed: int = 0


@dataclass
class Plan:
    """What a download will do: the files to fetch (largest first), what is already there."""

    dest: Path
    files: list[RemoteFile]
    jobs: list[_Job]
    skipped: int  # complete from an earlier, interrupted run
    resumed_bytes: int  # in .part files already
    total_bytes: int

    @property
    def done_bytes(self) -> int:
        return self.total_bytes - sum((j.file.size_bytes or 0) - j.have for j in self.jobs)


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def plan(
    files: Iterable[RemoteFile | Mapping[str, Any]],
    dest: Path | str,
    *,
    checkpoint_id: str,
    force: bool = False,
    check_free_space: bool = True,
) -> Plan:
    """Validate every name, claim the target, and list what is left to fetch."""
    remote = [f if isinstance(f, RemoteFile) else RemoteFile.from_json(f) for f in files]
    dest = Path(dest).expanduser()
    layout = plan_paths(remote)  # validates every name before anything touches the disk
    resuming = prepare_target(dest, checkpoint_id, force=force)
    jobs: list[_Job] = []
    skipped = resumed_bytes = 0
    for f in remote:
        rel = layout[f.key]
        final = dest.joinpath(*rel.parts)
        part = final.with_name(final.name + PART_SUFFIX)
        job = _Job(f, rel, final, part, expected_sha256=f.sha256)
        if resuming and f.size_bytes is not None and final.is_file() and _size_of(final) == f.size_bytes:
            # Done in an earlier run; with a listed checksum it must also match (a file damaged
            # on disk since then, at the same size, is fetched again).
            if f.sha256 is None or file_sha256(final).hexdigest() == f.sha256:
                skipped += 1
                continue
        if resuming:
            job.have = _size_of(part)
            if f.size_bytes is not None and job.have > f.size_bytes:
                job.have = 0  # stale or foreign: start over
            resumed_bytes += job.have
        jobs.append(job)
    if check_free_space and jobs:
        needed = sum(max((j.file.size_bytes or 0) - j.have, 0) for j in jobs)
        try:
            free = shutil.disk_usage(dest).free
        except OSError:
            free = None
        if free is not None and needed > free:
            from baseten_loops_cli.sizes import human_size

            raise DiskFullError(
                f"not enough space in {dest}: the download needs {human_size(needed)}, "
                f"{human_size(free)} is free",
                hint="Free some space or pass another -O DIR; nothing was downloaded.",
            )
    # Largest first: the long poles start early, the small files fill the gaps.
    jobs.sort(key=lambda j: -(j.file.size_bytes or 0))
    total = sum(f.size_bytes or 0 for f in remote)
    return Plan(dest, remote, jobs, skipped, resumed_bytes, total)


# ── run: fetch the planned files in parallel ────────────────────────────────────────────────


@dataclass
class _Shared:
    http: _Clients
    links: _Links
    progress: Progress
    dest: Path
    cancel: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    downloaded: int = 0
    sleep: Callable[[float], Any] = time.sleep

    def add(self, n: int) -> None:
        with self.lock:
            self.downloaded += n
        self.progress.advance(n)


def run(
    planned: Plan,
    *,
    refresh: Callable[[], Iterable[Any]] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    progress: Progress | None = None,
    transport: httpx.BaseTransport | None = None,
    read_timeout: float = READ_TIMEOUT_S,
    sleep: Callable[[float], Any] | None = None,
) -> DownloadResult:
    """Fetch ``planned``'s files, ``parallel`` at once, then drop the resume marker.

    The workers are daemon threads: Ctrl-C (or a failed file) returns at once, without waiting
    for a worker blocked in a read; what they saved stays for a rerun to resume."""
    started = time.monotonic()
    if not 1 <= parallel <= MAX_PARALLEL:
        raise UsageError(f"--parallel must be between 1 and {MAX_PARALLEL}, got {parallel}")
    progress = progress or NoProgress()
    _read_in_large_pieces()
    progress.start(total_bytes=planned.total_bytes, completed_bytes=planned.done_bytes, files=len(planned.files))
    links = _Links(planned.files, refresh)
    clients = _Clients(transport, read_timeout)
    shared = _Shared(http=clients, links=links, progress=progress, dest=planned.dest)
    shared.sleep = sleep or shared.cancel.wait  # a pause between retries ends at once on Ctrl-C
    pending = list(reversed(planned.jobs))  # popped from the end: largest first
    errors: list[BaseException] = []

    def worker() -> None:
        while not shared.cancel.is_set():
            with shared.lock:
                if not pending:
                    return
                job = pending.pop()
            try:
                fetch_file(shared, job)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                with shared.lock:
                    errors.append(exc)
                shared.cancel.set()
                return

    threads = [threading.Thread(target=worker, name=f"loops-dl-{i}", daemon=True)
               for i in range(min(parallel, max(len(planned.jobs), 1)))]  # fmt: skip
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and not errors:
            for t in threads:
                t.join(timeout=0.25)
                if errors:
                    break
        if errors:
            _settle(shared, threads)
            raise errors[0]
    except KeyboardInterrupt:
        _settle(shared, threads)
        raise InterruptedByUser(
            f"download interrupted; what was saved in {planned.dest} is kept",
            hint="Run the same command again to resume.",
        ) from None
    finally:
        clients.close()
    try:
        (planned.dest / MARKER_NAME).unlink()
    except OSError:
        pass
    return DownloadResult(
        path=planned.dest,
        files=len(planned.files),
        bytes_total=planned.total_bytes,
        bytes_downloaded=shared.downloaded,
        files_skipped=planned.skipped,
        bytes_resumed=planned.resumed_bytes,
        seconds=time.monotonic() - started,
        refreshed_links=links.refreshes,
    )


def _settle(shared: _Shared, threads: list[threading.Thread], wait_s: float = 1.0) -> None:
    """Stop the workers; give those between two chunks a moment to finish their write."""
    shared.cancel.set()
    deadline = time.monotonic() + wait_s
    for t in threads:
        if t.ident is None:  # a Ctrl-C while the workers were being started: never ran
            continue
        t.join(timeout=max(deadline - time.monotonic(), 0))


def download_files(
    files: Iterable[RemoteFile | Mapping[str, Any]],
    dest: Path | str,
    *,
    checkpoint_id: str,
    refresh: Callable[[], Iterable[Any]] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    force: bool = False,
    progress: Progress | None = None,
    transport: httpx.BaseTransport | None = None,
    read_timeout: float = READ_TIMEOUT_S,
    sleep: Callable[[float], Any] | None = None,
    check_free_space: bool = True,
) -> DownloadResult:
    """Download ``files`` (``CheckpointFile`` dicts or :class:`RemoteFile`) into ``dest``:
    :func:`plan`, then :func:`run`.

    ``refresh`` returns the checkpoint's current file list (all pages); it is called when a link
    has expired. ``parallel`` files are fetched at once. ``transport`` (an httpx transport, for
    tests) replaces the network.
    """
    if not 1 <= parallel <= MAX_PARALLEL:
        raise UsageError(f"--parallel must be between 1 and {MAX_PARALLEL}, got {parallel}")
    planned = plan(files, dest, checkpoint_id=checkpoint_id, force=force, check_free_space=check_free_space)
    return run(planned, refresh=refresh, parallel=parallel, progress=progress, transport=transport,
               read_timeout=read_timeout, sleep=sleep)  # fmt: skip


# ── fetch one file ──────────────────────────────────────────────────────────────────────────


def fetch_file(shared: _Shared, job: _Job) -> None:
    """Fetch one file into its ``.part`` (resuming it), verify it and rename it into place."""
    name = job.rel.as_posix()
    try:
        job.part.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(job.part.parent, exc) from None
    if not _inside(shared.dest, job.part.parent):
        raise UnsafePathError(
            f"refusing to write {name!r}: {job.part.parent} leads outside {shared.dest} (a symlink)",
            hint="Remove the symlink or download into another folder.",
        )
    if job.have == 0 and job.part.exists():
        _truncate(job.part, shared.dest)
    refreshes = 0
    furthest = job.have  # the count of failed attempts restarts only when a retry gets further
    state = RetryState(started=time.monotonic())
    while not shared.cancel.is_set():
        url, generation = shared.links.get(job.file.key)
        expires = link_expires_at(url)
        if expires is not None and expires - time.time() < EXPIRY_MARGIN_S and refreshes < MAX_REFRESHES:
            if shared.links.refresh(generation):
                refreshes += 1
                continue
        outcome, detail = _attempt(shared, job, url)
        if outcome is _DONE:
            break
        if outcome is _EXPIRED:
            if refreshes < MAX_REFRESHES and shared.links.refresh(generation):
                refreshes += 1
                continue
            raise DownloadError(
                f"{name}: the file link was refused ({detail}) even with freshly listed links",
                hint="Check that your key can read this checkpoint (`loops checkpoints files CKPT`).",
            )
        if job.have > furthest:
            furthest = job.have
            state = RetryState(started=time.monotonic())
        decision, state = decide(DOWNLOAD_POLICY, outcome, state, now=time.monotonic(), repeatable=True)
        if decision.action != "retry":
            size = job.file.size_bytes if job.file.size_bytes is not None else "?"
            raise DownloadError(
                f"{name}: giving up after {state.attempt + 1} attempts ({detail}) at {_shown(url)}; "
                f"{job.have} of {size} bytes are saved",
                hint="Run the same command again to resume.",
            )
        shared.sleep(decision.delay)
    if shared.cancel.is_set():
        return
    try:
        if not job.part.exists():  # an empty file: nothing was streamed
            job.part.touch()
        os.replace(job.part, job.final)
    except OSError as exc:
        raise _write_error(job.final.parent, exc) from None
    shared.progress.file_done(name)


_DONE, _EXPIRED = "done", "expired"


def _attempt(shared: _Shared, job: _Job, url: str) -> tuple[Any, str]:
    """One GET of the rest of the file; updates ``job.have``. Returns ``(_DONE | _EXPIRED |
    the outcome to decide on - a retryable response or a transport failure, detail)``."""
    f = job.file
    name = job.rel.as_posix()
    if f.size_bytes is not None and job.have == f.size_bytes:
        return _DONE, ""
    headers = {"Range": f"bytes={job.have}-"} if job.have else {}
    if job.have and job.expected_sha256:
        headers["If-Range"] = f'"{job.expected_sha256}"'  # a changed file comes back whole
    try:
        resp = shared.http.get(url, headers)
    except httpx.TransportError as exc:
        return exc, _describe(exc)
    try:
        status = resp.status_code
        if status in (401, 403):
            return _EXPIRED, f"HTTP {status}"
        if status == 416 and job.have:
            # The .part is as long as the file already, or longer (stale): decide by size.
            total = _content_range_total(resp.headers.get("content-range"))
            if total is not None and total == job.have and f.size_bytes in (None, total):
                return _DONE, ""
            job.have = _restart(job, shared)
            return _BodyFailure("the saved part did not match the file"), "the saved part did not match the file"
        if status in DOWNLOAD_POLICY.retry_statuses:
            return resp, f"HTTP {status}"
        if status >= 400:
            raise DownloadError(
                f"{name}: the file link answered HTTP {status}{_reason(_error_text(resp))}",
                hint="Run the same command again; if it persists, check `loops checkpoints files CKPT`.",
            )
        if job.have and (status != 206 or _content_range_start(resp.headers.get("content-range")) != job.have):
            job.have = _restart(job, shared)  # the server ignored or misread the Range
        if job.expected_sha256 is None:
            job.expected_sha256 = _hex_digest(resp.headers.get("x-checksum-sha256"))
        job.have += _stream_to(resp, job, shared, job.have)
    except httpx.TransportError as exc:  # dropped mid-body: what arrived is saved
        job.have = _size_of(job.part)
        return exc, _describe(exc)
    finally:
        resp.close()
    if shared.cancel.is_set():
        return _DONE, ""
    failure = None
    if f.size_bytes is None or job.have == f.size_bytes:
        if job.expected_sha256 and job.hasher is not None and job.hashed == job.have:
            if job.hasher.hexdigest() != job.expected_sha256:
                job.have = _restart(job, shared)
                failure = "the file's SHA-256 did not match (corrupted in transit)"
        if failure is None:
            return _DONE, ""
    elif job.have > f.size_bytes:
        job.have = _restart(job, shared)
        failure = f"received more than the {f.size_bytes} bytes listed"
    else:
        failure = f"the connection closed after {job.have} of {f.size_bytes} bytes"
    return _BodyFailure(failure), failure


def _error_text(resp: httpx.Response) -> str:
    try:
        return resp.read()[: 64 * 1024].decode("utf-8", "replace")
    except httpx.HTTPError:
        return ""


def _stream_to(resp: httpx.Response, job: _Job, shared: _Shared, offset: int) -> int:
    """Append the body to the ``.part`` (which holds ``offset`` bytes), hashing it as it is
    written; return the bytes written. A dropped connection raises the httpx error after
    what arrived is on disk."""
    written = 0
    try:
        fd = os.open(job.part, os.O_WRONLY | os.O_CREAT | (0 if offset else os.O_TRUNC), 0o644)
    except OSError as exc:
        raise _write_error(job.part.parent, exc) from None
    hasher = None
    if job.expected_sha256:
        if offset == 0:
            job.hasher, job.hashed = hashlib.sha256(), 0
        elif job.hasher is None or job.hashed != offset:  # resuming a .part: hash what it holds
            job.hasher, job.hashed = file_sha256(job.part, offset), offset
        hasher = job.hasher
    try:
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
            os.ftruncate(fd, offset)
        for chunk in resp.iter_raw():
            if shared.cancel.is_set():
                break
            view = memoryview(chunk)
            if hasher is not None:
                hasher.update(view)
            while view:
                view = view[os.write(fd, view):]
            written += len(chunk)
            if hasher is not None:
                job.hashed += len(chunk)
            shared.add(len(chunk))
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            shared.cancel.set()
            from baseten_loops_cli.sizes import human_size

            raise DiskFullError(
                f"no space left on the device of {shared.dest} while writing {job.rel.as_posix()} "
                f"({human_size(shared.downloaded)} downloaded in this run)",
                hint="Free some space and run the same command again: the download resumes where it stopped.",
            ) from None
        raise _write_error(job.part.parent, exc) from None
    finally:
        os.close(fd)
    return written


def _truncate(path: Path, dest: Path) -> None:
    """Empty a ``.part`` that cannot be continued (regular files only)."""
    try:
        if path.is_file():
            os.truncate(path, 0)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise _write_error(dest, exc) from None


def _restart(job: _Job, shared: _Shared) -> int:
    """Throw away a ``.part`` that cannot be continued; returns the new offset (0)."""
    _truncate(job.part, shared.dest)
    job.hasher, job.hashed = None, 0
    if job.have:
        shared.add(-job.have)
    return 0


def _content_range_start(value: str | None) -> int | None:
    # "bytes 100-199/200"
    if not value or not value.startswith("bytes "):
        return None
    try:
        return int(value[6:].split("-", 1)[0])
    except ValueError:
        return None


def _content_range_total(value: str | None) -> int | None:
    # "bytes */200" or "bytes 0-9/200"
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


def _reason(text: str) -> str:
    """``: <detail>`` from an error body (JSON detail/error/message), or nothing."""
    if not text:
        return ""
    try:
        body = json.loads(text)
    except ValueError:
        return ""
    from baseten_loops_cli.api.http import error_fields

    detail, _, _ = error_fields(body)
    return f": {detail}" if detail else ""


__all__ = [
    "DEFAULT_PARALLEL",
    "DOWNLOAD_POLICY",
    "Plan",
    "fetch_file",
    "plan",
    "run",
    "DiskFullError",
    "DownloadError",
    "DownloadResult",
    "MARKER_NAME",
    "NoProgress",
    "Progress",
    "RemoteFile",
    "TargetNotEmptyError",
    "UnsafePathError",
    "download_files",
    "link_expires_at",
    "plan_paths",
    "prepare_target",
    "safe_relative_path",
]
