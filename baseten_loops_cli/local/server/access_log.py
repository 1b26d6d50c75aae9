"""Keep credentials out of server.log.

uvicorn's access log records each request's path *with its query string*. Two kinds of
secret can ride there: a presigned link's ``sig`` (a capability: anyone holding the URL
can download the file), and an API key a user pasted into a URL (never accepted as a
credential, but still a secret). Their values are replaced before the line is written.
"""

from __future__ import annotations

import logging
import re

SENSITIVE_QUERY_KEYS = ("sig", "signature", "api_key", "apikey", "key", "token",
                        "access_token")
_SENSITIVE = re.compile(
    r"(?P<key>(?:^|[?&])(?:" + "|".join(SENSITIVE_QUERY_KEYS) + r")=)[^&#\s]*", re.IGNORECASE)


def redact_query(path: str) -> str:
    """``/files/a/b?expires=1&sig=abc`` -> ``/files/a/b?expires=1&sig=REDACTED``."""
    if "?" not in path:
        return path
    base, _, query = path.partition("?")
    return f"{base}?{_SENSITIVE.sub(lambda m: m.group('key') + 'REDACTED', query)}"


class RedactQueryFilter(logging.Filter):
    """For ``uvicorn.access``: its records carry (client, method, path, version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def install() -> None:
    logging.getLogger("uvicorn.access").addFilter(RedactQueryFilter())
