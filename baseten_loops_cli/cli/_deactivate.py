"""The body of `loops runs deactivate` and `loops samplers deactivate`: the two differ only in
their noun, their service call and their messages, which the commands pass in."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state


def deactivate_command(
    ctx: typer.Context,
    ids: Sequence[str],
    *,
    yes: bool,
    noun: str,
    deactivate_many: Callable[..., list],
    question: Callable[[list], str],
    skipped: Callable[[Any], str],
    done: Callable[[Any], str],
) -> None:
    """Deactivate ``ids`` through ``deactivate_many(client, ids, confirm=, on_skipped=,
    on_done=)`` (services.runs.deactivate_runs / deactivate_samplers): ask ``question(todo)``
    first (exit 3 naming --yes without a terminal), say ``skipped(item)`` and ``done(item)``,
    drop the completion cache of ``noun``s and print the responses (-o json: a list).
    ``noun``: "run" or "sampler"."""
    state = get_state(ctx)
    out = state.output

    def confirm(todo: list) -> None:
        action = f"{noun} {todo[0].id}" if len(todo) == 1 else f"{len(todo)} {noun}s"
        out.confirm(question(todo), yes=yes, action=f"deactivating {action}")

    results = deactivate_many(
        state.backend().client,
        ids,
        confirm=confirm,
        on_skipped=lambda item: out.info(skipped(item)),
        on_done=lambda item: out.success(done(item)),
    )
    if results:
        _complete.invalidate(f"{noun}s")
    out.emit(results, rows=results, text=[])
