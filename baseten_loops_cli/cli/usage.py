"""`loops usage` (being built)."""

import typer


def usage(ctx: typer.Context) -> None:
    """GPU allocations and tokens per run."""
    raise typer.Exit(1)
