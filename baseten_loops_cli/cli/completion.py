"""`loops completion` (being built)."""

import typer

app = typer.Typer(help="completion commands.", no_args_is_help=True)
