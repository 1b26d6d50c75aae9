"""loops: the command line for Baseten Loops."""

__version__ = "0.1.0"
