"""The data format layer: the files, folders and hub datasets users have, in the row formats
they come in, read once into the rows the training loops take.

- ``readers``: JSONL (plain Python, as fast as before), JSON, CSV/TSV (the ``csv`` module, so a
  broken row names its line), Parquet and Arrow (pyarrow) and Hugging Face hub datasets
  (``datasets``); the last three need the ``[data]`` extra, imported only when such a source is
  read. Each yields ``(where, row)``: ``file:line`` or ``file: row N``.
- ``rows``: which format a file's rows are in (OpenAI messages, ShareGPT, Alpaca, TRL's
  preference / unpaired preference / prompt-completion / prompt-only / text, standard or
  conversational), detected from every row, and the conversion of each row to the internal row
  of a purpose: ``sft`` (``messages`` or ``prompt``/``completion`` strings), ``prompts`` (RL:
  ``messages`` or ``prompt`` plus the row's other fields, ``answer`` from the reference reply)
  ``preference`` (DPO: ``prompt``/``messages`` + ``chosen`` + ``rejected``) or ``unpaired``
  (KTO: ``prompt``/``messages`` + ``completion`` + a boolean ``label``).
- ``spec``: the config's schema pieces (``data.train`` as a path, a source or a list of sources
  with ``weight`` / ``max_rows``; ``data.eval: {from_train: 0.05}``; ``data.format``,
  ``data.columns``) and :class:`DataSpec`, what a loader reads.
- ``dataset``: :func:`read_rows`, the one entry point: sources -> detection -> conversion ->
  mixture -> hold-out split, reporting what it found ("alpaca, 1,203 rows").

Nothing downstream knows which format a row came from.
"""

from baseten_loops_cli.training.data.formats.dataset import read_rows  # noqa: F401
from baseten_loops_cli.training.data.formats.dataset import DataSpec, data_notes, data_specs, eval_source  # noqa: F401
