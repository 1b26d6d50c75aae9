"""loops: the command line for Baseten Loops."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `loops --help` imports nothing it does not need.
    if name in ("Step", "parse_tool_calls"):
        from baseten_loops_cli import step

        return getattr(step, name)
    raise AttributeError(f"module 'baseten_loops_cli' has no attribute {name!r}")
