"""Service functions: what commands do, as plain Python (no printing, no argument parsing).

A command in ``cli/`` parses its arguments, calls one function here and hands the result to the
output sink. The functions take a :class:`~baseten_loops_cli.api.client.LoopsClient` (or a
connected backend) and typed models from ``api.models`` and return typed models, so they are
usable from a notebook or a script as well as from the CLI. Progress that a command shows while
a function works (a trainer coming up, a deployment's status) arrives through an ``on_status``
callback; nothing here writes to stdout or stderr.

- ``resolve``: turn what users type (run ids, checkpoint ids, bt:// URIs, RUN:NAME) into models.
- ``runs``: list with the recent-window rule, describe, wait for a trainer, page and follow logs,
  deactivate many runs or samplers.
- ``sampling``: resolve what serves a prompt, tokenize, sample, decode.
- ``checkpoints``: list, list files, plan and run a download.
- ``deployments``: plan, create, wait for, list, describe and stop checkpoint deployments.
- ``usage``: allocations now, and tokens and compute per run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.settings.connection import Capabilities


class Connected(Protocol):
    """A backend the command line has connected to (``cli._backend.Backend`` is one): its
    control-plane client and the facts about the connection that services need."""

    @property
    def client(self) -> "LoopsClient": ...

    @property
    def kind(self) -> str: ...  # "local" or "baseten": a name for messages; branch on capabilities

    @property
    def capabilities(self) -> "Capabilities": ...  # settings.connection.Capabilities

    @property
    def base_url(self) -> str: ...

    @property
    def api_key(self) -> str: ...

    @property
    def key_source(self) -> str: ...  # where the key came from ("local-server", "env", ...)

    @property
    def profile_name(self) -> str: ...
