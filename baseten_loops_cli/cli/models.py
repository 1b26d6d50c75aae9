"""`loops models`: the backend's model catalog (model, max sequence length, use cases).

Parse, call :func:`baseten_loops_cli.services.models.catalog`, render. ``-o json`` prints the
list of models (``[{model, max_seq_len, use_cases, enabled, ...}]``).
"""

from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state


def models(
    ctx: typer.Context,
    model: Annotated[
        Optional[str],
        typer.Argument(help="Only this model (a Hugging Face id; on the local backend also a local model folder).",
                       autocompletion=_complete.complete_model, show_default=False),
    ] = None,
    use_case: Annotated[Optional[str], typer.Option("--use-case", help="Only models offered for this use case: sft or rl.", show_default=False)] = None,
) -> None:
    """The models this backend trains: max sequence length and use cases (sft, rl).

    From GET /v1/loops/capabilities. On the local backend: the built-in models, those pulled
    into its cache and the local model folders runs have used, with SOURCE and READY (its
    files are on this machine). -o json prints the list.

    Examples:

      loops models

      loops models --use-case rl -o json --jq '.[].model'

      loops models Qwen/Qwen3-8B
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.services import models as service

    if use_case is not None and use_case not in service.USE_CASES:
        raise UsageError(f"--use-case must be sft or rl, not {use_case!r}", hint="e.g. --use-case sft")
    if model is not None:
        from pathlib import Path

        from baseten_loops_cli.settings.model_files import local_model_dir

        # A folder is named to the server by its absolute path (the server has its own cwd).
        folder = local_model_dir(model, Path.cwd())
        model = str(folder) if folder is not None else model
    state = get_state(ctx)
    out = state.output
    rows = service.catalog(state.backend(), model=model, use_case=use_case)
    local = any(r.source is not None for r in rows)
    columns: list = [
        ("MODEL", "model"),
        ("MAX SEQ LEN", lambda r: f"{r.max_seq_len:,}" if r.max_seq_len else None),
        ("USE CASES", lambda r: ", ".join(r.use_cases)),
        ("ENABLED", lambda r: "yes" if r.enabled else f"no ({r.not_enabled_reason})" if r.not_enabled_reason else "no"),
    ]
    if local:
        columns += [("SOURCE", "source"), ("READY", lambda r: "yes" if r.ready else "no")]
    out.emit(
        rows,
        rows=rows,
        columns=columns,
        id_key="model",
        empty=f"This backend offers no model {model!r}." if model else "This backend offers no models.",
        hint="`loops server pull-model NAME` fetches a model that is not ready yet." if local and not all(r.ready for r in rows) else None,
    )
