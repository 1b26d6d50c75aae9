"""`loops runs` (being built)."""

import typer

app = typer.Typer(help="runs commands.", no_args_is_help=True)
