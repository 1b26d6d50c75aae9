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
- ``deployments``: plan, create, wait for, list, describe and stop checkpoint deployments.
"""
