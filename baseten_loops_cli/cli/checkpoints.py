"""`loops checkpoints` (being built)."""

import typer

app = typer.Typer(help="checkpoints commands.", no_args_is_help=True)
