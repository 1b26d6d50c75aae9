"""`loops deploy` (being built)."""

import typer

app = typer.Typer(help="deploy commands.", no_args_is_help=True)
