"""Per-invocation state shared by every command (``ctx.obj``): global options, the output sink
and a lazily opened backend. Nothing heavy is imported until a command asks for it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from baseten_loops_cli.output.sink import Output
    from baseten_loops_cli.cli._backend import Backend


@dataclass
class AppState:
    output_format: str | None = None
    jq: str | None = None
    quiet: bool = False
    profile: str | None = None
    debug: bool = False
    _output: "Output | None" = field(default=None, repr=False)
    _backend: "Backend | None" = field(default=None, repr=False)

    @property
    def output(self) -> "Output":
        if self._output is None:
            from baseten_loops_cli.output.sink import Output

            self._output = Output(self.output_format, jq=self.jq, quiet=self.quiet)
        return self._output

    def backend(self, profile: str | None = None) -> "Backend":
        """The connected backend of ``profile`` (default: the --profile / selected one)."""
        if self._backend is None:
            from baseten_loops_cli.cli._backend import open_backend

            self._backend = open_backend(profile or self.profile, announce=self.output.info)
        return self._backend

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None


def get_state(ctx: typer.Context) -> AppState:
    """The AppState of this invocation (created on first use, e.g. under CliRunner)."""
    root = ctx.find_root()
    if not isinstance(root.obj, AppState):
        root.obj = AppState(debug=os.environ.get("LOOPS_DEBUG", "") in {"1", "true"})
    return root.obj
