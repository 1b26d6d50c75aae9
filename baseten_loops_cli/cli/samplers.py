"""`loops samplers` (being built)."""

import typer

app = typer.Typer(help="samplers commands.", no_args_is_help=True)
