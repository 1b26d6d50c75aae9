"""The one table that maps what went wrong to a message, a hint and an exit code.

Every layer raises a subclass of :class:`LoopsError`; ``cli.main.main`` turns it into one
``Error: ...`` line (plus an optional ``Hint: ...`` line) on stderr and the exit code below.
Nothing here imports anything heavy: it is on the ``--help`` path.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Documented exit codes (``loops --help``, ``man loops``)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    CANCELLED = 3
    AUTH = 4
    RUN_FAILED = 5
    INTERRUPTED = 130


EXIT_CODE_HELP = (
    "0 ok · 1 error · 2 usage error · 3 cancelled or declined · "
    "4 auth missing or rejected · 5 a watched run failed · 130 interrupted"
)


class LoopsError(Exception):
    """Base class of every error the CLI reports as a one-line message."""

    exit_code: int = ExitCode.ERROR

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message


class UsageError(LoopsError):
    """Bad flags or arguments: conflicting selectors, malformed values."""

    exit_code = ExitCode.USAGE


class CancelledError(LoopsError):
    """The user declined a confirmation, or one was needed and could not be asked."""

    exit_code = ExitCode.CANCELLED


class AuthError(LoopsError):
    """No credentials, or the backend rejected them (401/403)."""

    exit_code = ExitCode.AUTH


class RunFailedError(LoopsError):
    """A watched run ended in a failed state (``runs watch --exit-status``)."""

    exit_code = ExitCode.RUN_FAILED


class ConfigError(LoopsError):
    """A malformed config or profile file, or an unknown profile."""

    exit_code = ExitCode.ERROR


class InterruptedByUser(LoopsError):
    """Ctrl-C, after cleanup; carries the message to print (e.g. the resume command)."""

    exit_code = ExitCode.INTERRUPTED
