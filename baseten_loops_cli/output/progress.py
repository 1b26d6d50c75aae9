"""Transfer progress on a terminal (stderr), drawn for :meth:`Output.progress`.

The bar's rate is the transfer's average (bytes fetched by this run / time since it started),
in the same binary units as the summary line (``human_size``): Rich's own speed column is a
short-window estimate in decimal units, which disagreed with the summary by an order of
magnitude on bursty transfers.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from baseten_loops_cli.output.format import human_size


def average_rate(bytes_moved: int, seconds: float) -> str:
    """``13.4 MiB/s``: the one formatting of a transfer rate (bar and summary)."""
    if seconds <= 0 or bytes_moved <= 0:
        return "-"
    return f"{human_size(bytes_moved / seconds)}/s"


class TransferBar:
    """bytes done/total, average rate, ETA and files done, for ``api.download``'s progress."""

    def __init__(self, console: Any, label: str, *, clock: Callable[[], float] = time.monotonic):
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[files]}"),
            console=console,
            transient=False,
        )
        self._label = label
        self._task: Any = None
        self._files_total = 0
        self._files_done = 0
        self._moved = 0
        self._clock = clock
        self._started = clock()

    def __enter__(self) -> "TransferBar":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def start(self, *, total_bytes: int, completed_bytes: int, files: int) -> None:
        self._files_total = files
        self._started = self._clock()
        self._task = self._progress.add_task(
            self._label, total=total_bytes or None, completed=completed_bytes, files=f"0/{files} files", rate="-"
        )

    def advance(self, nbytes: int) -> None:
        self._moved += nbytes
        if self._task is not None:
            rate = average_rate(self._moved, self._clock() - self._started)
            self._progress.update(self._task, advance=nbytes, rate=rate)

    def file_done(self, name: str) -> None:
        self._files_done += 1
        if self._task is not None:
            self._progress.update(self._task, files=f"{self._files_done}/{self._files_total} files")


class CountBar:
    """Items done out of a total and the time left (e.g. rows scored by ``loops eval``); draws
    nothing when ``console`` is None."""

    def __init__(self, console: Any, label: str):
        self._console = console
        self._label = label
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> "CountBar":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def start(self, total: int) -> None:
        if self._console is None or total <= 0 or self._progress is not None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            console=self._console, transient=True,
        )  # fmt: skip
        self._task = self._progress.add_task(self._label, total=total)
        self._progress.start()

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)
