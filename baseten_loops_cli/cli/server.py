"""`loops server` (being built)."""

import typer

app = typer.Typer(help="server commands.", no_args_is_help=True)
