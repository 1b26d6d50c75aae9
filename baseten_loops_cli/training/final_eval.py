"""The end of a training run (``eval:`` in the config): score the final checkpoint as
``loops eval`` does and write the table into the run directory.

Kept apart from :mod:`training.evaluation` because it renders a table (``output``): the
scoring itself stays free of rendering, so ``services`` can build on it.
"""

from __future__ import annotations

import json
from typing import Any

from baseten_loops_cli.errors import LoopsError
from baseten_loops_cli.training.evaluation import Candidate, EvalReport, EvalTask, RLTask, SamplerLike, SFTTask, evaluate


def render_text(report: EvalReport) -> str:
    """The table as plain text (what a run directory's eval.txt holds)."""
    import io

    from baseten_loops_cli.output.sink import Output, Streams

    buffer = io.StringIO()
    out = Output("table", streams=Streams(stdout=buffer, stderr=io.StringIO(), stdin_tty=False, stdout_tty=False, stderr_tty=False))
    rows, columns = report.table()
    out.emit(report.as_dict(), rows=rows, columns=columns)
    return buffer.getvalue()


def evaluate_final(session: Any, record: dict, sink: Any) -> EvalReport | None:
    """Score the final checkpoint ``record`` (and the base model with ``eval.base``) on the
    config's eval data; write eval.json and eval.txt into the run directory and show the table.

    The run is still active here, so its paired sampler serves the checkpoint (pinned) and the
    session's base sampler serves the base model: nothing else is provisioned."""
    from baseten_loops_cli.training.config import RLConfig
    from baseten_loops_cli.training.formats import eval_source
    from baseten_loops_cli.training.rundir import atomic_write

    loaded, config = session.loaded, session.config
    spec = config.eval
    if spec is None:
        return None
    is_rl = isinstance(config, RLConfig)
    data = spec.data or (config.data.eval_prompts if is_rl else config.data.eval)
    if not data:
        sink.message("eval: no data to score (set eval.data, or data.eval / data.eval_prompts); skipped.")
        return None
    task: EvalTask
    if is_rl:
        samples = spec.samples or config.group_size
        task = RLTask(
            eval_source(loaded, data), config.reward, loaded.base_dir, config.sampling, samples, spec.k,
            config.pass_threshold, config.seed, config.max_seq_len, spec.limit,
        )  # fmt: skip
    else:
        task = SFTTask(eval_source(loaded, data), config.data.train_on, config.max_seq_len, spec.limit)
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
    text = render_text(report)
    atomic_write(rundir.path / "eval.txt", text)
    sink.message(f"Eval on {data}:")
    for line in text.rstrip("\n").splitlines():
        sink.message(f"  {line}")
    for error in report.errors:
        sink.message(f"eval: {error.source}: {error.message}")
    return report
