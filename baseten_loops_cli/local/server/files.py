"""Presigned checkpoint-file links: ``/files/<checkpoint_pk>/<relative_path>?expires=..&sig=..``.

Like an S3 presigned URL, a link is a capability: it needs no auth header, names exactly
one file of one checkpoint, and stops working at ``expires`` (unix seconds). The signature
is HMAC-SHA256 over ``pk \\n relative_path \\n expires`` with a per-data-dir secret that
survives restarts (links handed out before a restart keep working until they expire).

Serving is careful about the usual file-server pitfalls: the relative path must be a
plain descendant of the checkpoint directory (no ``..``, no absolute paths, no symlinks
escaping it), and single ``Range`` requests get ``206 Partial Content`` so large
downloads can resume.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import time
from pathlib import Path, PurePosixPath
from typing import AsyncIterator
from urllib.parse import quote, urlencode

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from baseten_loops_cli.local.server.errors import ApiError

DEFAULT_LINK_TTL_S = 3600
_CHUNK = 256 * 1024
_SECRET_FILE = "presign.key"


def load_or_create_secret(data_dir: Path) -> bytes:
    """The signing secret, created (0600) on first use."""
    path = data_dir / _SECRET_FILE
    try:
        secret = path.read_bytes()
        if len(secret) >= 32:
            return secret
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret)
    return secret


def safe_relative_path(raw: str) -> PurePosixPath:
    """Validate a checkpoint-relative path, refusing anything that could leave the folder."""
    if not raw or "\\" in raw or "\x00" in raw:
        raise _forbidden_path(raw)
    path = PurePosixPath(raw)
    if path.is_absolute() or any(part in ("", ".", "..") for part in raw.split("/")):
        raise _forbidden_path(raw)
    return path


def _forbidden_path(raw: str) -> ApiError:
    return ApiError(403, f"Refused file path {raw!r}: it must be a plain path inside the "
                         "checkpoint. Use the URLs from /v1/loops/checkpoints/{id}/files.",
                    "PathNotAllowed")


class Presigner:
    def __init__(self, secret: bytes, ttl_s: int = DEFAULT_LINK_TTL_S) -> None:
        self._secret = secret
        self.ttl_s = ttl_s

    def _sign(self, pk: str, relative_path: str, expires: int) -> str:
        message = f"{pk}\n{relative_path}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def url(self, base_url: str, pk: str, relative_path: str, now: float | None = None) -> str:
        # Rounded up: a link is good for at least ttl_s (int() would shave up to a second,
        # which matters with the short TTLs tests use).
        expires = math.ceil((now or time.time()) + self.ttl_s)
        query = urlencode({"expires": expires, "sig": self._sign(pk, relative_path, expires)})
        return f"{base_url}/files/{quote(pk, safe='')}/{quote(relative_path)}?{query}"

    def verify(self, pk: str, relative_path: str, expires: str | None, sig: str | None) -> None:
        if not expires or not sig:
            raise ApiError(403, "This file link is not signed. Get a fresh link from "
                                "/v1/loops/checkpoints/{id}/files.", "SignatureMissing")
        try:
            expires_at = int(expires)
        except ValueError:
            raise ApiError(403, "Malformed 'expires' on this file link. Get a fresh link from "
                                "/v1/loops/checkpoints/{id}/files.", "SignatureInvalid") from None
        expected = self._sign(pk, relative_path, expires_at)
        if not hmac.compare_digest(expected, sig):
            raise ApiError(403, "This file link's signature does not match (it was altered, "
                                "or belongs to another file). Get a fresh link from "
                                "/v1/loops/checkpoints/{id}/files.", "SignatureInvalid")
        if expires_at < time.time():
            raise ApiError(403, "This file link has expired. Get a fresh link from "
                                "/v1/loops/checkpoints/{id}/files (links last "
                                f"{self.ttl_s} s).", "LinkExpired")


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` -> inclusive (start, end).

    Returns None when the header is absent or not a single byte range we understand (the
    caller then sends the whole file, which RFC 9110 allows); raises 416 when the range
    is well-formed but lies outside the file.
    """
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if first == "":
            suffix = int(last)
            if suffix <= 0:
                raise _unsatisfiable(size)
            start, end = max(size - suffix, 0), size - 1
        else:
            start = int(first)
            end = int(last) if last else size - 1
    except ValueError:
        return None
    if start < 0 or start >= size or end < start:
        raise _unsatisfiable(size)
    return start, min(end, size - 1)


def _unsatisfiable(size: int) -> ApiError:
    return ApiError(416, f"Requested range is outside the file ({size} bytes).",
                    "RangeNotSatisfiable", headers={"Content-Range": f"bytes */{size}"})


async def _stream(path: Path, start: int, length: int) -> AsyncIterator[bytes]:
    # Plain blocking reads of <=256 KiB from local disk: fast enough that pushing
    # each into a thread would cost more than it saves.
    with open(path, "rb") as fh:
        fh.seek(start)
        remaining = length
        while remaining > 0:
            chunk = fh.read(min(_CHUNK, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk


def file_response(request: Request, root: Path, relative: PurePosixPath,
                  sha256: str | None = None) -> Response:
    """Serve ``root/relative`` (already validated) with Range support. ``sha256`` (the
    whole file's, from the checkpoint manifest) is sent as the ETag and as
    ``X-Checksum-Sha256`` so a client can verify, and resume safely with If-Range."""
    root = root.resolve()
    path = (root / relative).resolve()
    if root not in path.parents or not path.is_file():
        # Either a symlink pointing out of the checkpoint or simply no such file.
        if path.exists() and root not in path.parents:
            raise _forbidden_path(str(relative))
        raise ApiError(404, f"No file {str(relative)!r} in this checkpoint.", "FileNotFound")
    stat = path.stat()
    size = stat.st_size
    headers = {
        "Accept-Ranges": "bytes",
        "Last-Modified": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(stat.st_mtime)),
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(relative.name)}",
    }
    if sha256:
        headers["ETag"] = f'"{sha256}"'
        headers["X-Checksum-Sha256"] = sha256
    if_range = request.headers.get("if-range")
    if if_range and sha256 and if_range.strip() != f'"{sha256}"':
        request_range = ""  # the file changed since the client's partial copy: send it all
    else:
        request_range = request.headers.get("range", "")
    byte_range = parse_range(request_range, size) if size and request_range else None
    if byte_range is not None:
        start, end = byte_range
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = str(end - start + 1)
        status = 206
    else:
        start, end = 0, size - 1
        headers["Content-Length"] = str(size)
        status = 200
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers,
                        media_type="application/octet-stream")
    return StreamingResponse(_stream(path, start, end - start + 1), status_code=status,
                             headers=headers, media_type="application/octet-stream")
