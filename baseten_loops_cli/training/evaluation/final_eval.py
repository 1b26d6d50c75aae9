"""The end of a training run (``eval:`` in the config): score the final checkpoint as
``loops eval`` does and write the table into the run directory.

The table is drawn by the run's view (``sink.table_text``: the output layer's plain table),
so nothing in ``training`` renders.
"""

from __future__ import annotations

import json
from typing import Any

from baseten_loops_cli.errors import LoopsError
from baseten_loops_cli.training.evaluation.scoring import Candidate, EvalReport, SamplerLike, evaluate


def evaluate_final(session: Any, record: dict, sink: Any) -> EvalReport | None:
    """Score the final checkpoint ``record`` (and the base model with ``eval.base``) on the
    config's eval data; write eval.json and eval.txt into the run directory and show the table.

    The run is still active here, so its paired sampler serves the checkpoint (pinned) and the
    session's base sampler serves the base model: nothing else is provisioned."""
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.experiments.rundir import atomic_write

    loaded, config = session.loaded, session.config
    spec = config.eval
    if spec is None:
        return None
    data = spec.data or kinds.eval_data(loaded)
    if not data:
        sink.message("eval: no data to score (set eval.data, or data.eval / data.eval_prompts); skipped.")
        return None
    # a file, or a hub dataset / mixture / hold-out of the training rows (the data layer's spec)
    source = kinds.eval_source(loaded, data)
    task = kinds.eval_task(loaded, source, limit=spec.limit, samples=spec.samples, k=spec.k)
    sampler_path = record.get("sampler_path")
    run_label = f"{session.run_id}:{record.get('name', 'final')}"

    def checkpoint_client() -> SamplerLike:
        client = session.new_sampler_client()
        client.checkpoint_path = sampler_path
        return client

    candidates = [Candidate(run_label, config.base_model, f"final:{sampler_path}", checkpoint_client, uri=sampler_path)]
    if spec.base:
        candidates.insert(
            0, Candidate("base", config.base_model, f"base:{config.base_model}",
                         session.new_base_sampler_client, is_base=True),
        )  # fmt: skip
    try:
        report = evaluate(candidates, task)  # no cache: a run's final checkpoint is scored once
    except LoopsError as exc:
        # Training is done and saved; a failed eval must not make the run look failed.
        sink.message(f"eval failed: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""))
        return None
    doc = report.as_dict()
    rundir = session.rundir
    atomic_write(rundir.path / "eval.json", json.dumps(doc, indent=2, allow_nan=True) + "\n")
    rows, columns = report.table()
    text = sink.table_text(rows, columns)
    if text is not None:  # None: no view draws tables (a caller that shows nothing)
        atomic_write(rundir.path / "eval.txt", text)
        sink.message(f"Eval on {data}:")
        for line in text.rstrip("\n").splitlines():
            sink.message(f"  {line}")
    for error in report.errors:
        sink.message(f"eval: {error.source}: {error.message}")
    return report
