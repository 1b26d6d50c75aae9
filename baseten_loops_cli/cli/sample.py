"""`loops sample` (being built)."""

import typer


def sample(ctx: typer.Context) -> None:
    """Generate from a run's latest weights or a checkpoint."""
    raise typer.Exit(1)
