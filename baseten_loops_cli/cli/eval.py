"""`loops eval`: score sampler checkpoints (and the base model) side by side on a data set.

Parse, call :func:`services.evaluation.candidates` (the rows, and the samplers that serve them:
see there) and :func:`training.evaluation.scoring.evaluate`, render the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state


def _task(data_arg: Optional[str], config: Optional[Path], *, limit, seed, samples, k, columns: Optional[str] = None) -> Any:
    """The evaluation task from --data and --config (the config's kind builds it, as for its
    `eval:` block: an RL config brings the reward). The rows' columns are mapped by --columns,
    else by the config's data.columns."""
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training.evaluation import scoring as ev
    from baseten_loops_cli.training.data.formats.dataset import HUB_PREFIX, plain_spec, with_options
    from baseten_loops_cli.training.data.formats.spec import parse_columns

    mapping = parse_columns(columns) if columns else None
    # A file or folder of any type the data layer reads stays a Path; an hf:// name (a Path
    # would fold its "//") or mapped columns make it the data layer's spec.
    data: Any = None
    if data_arg is not None:
        data = plain_spec(data_arg, columns=mapping) if data_arg.startswith(HUB_PREFIX) or mapping else Path(data_arg)

    if config is not None:
        from baseten_loops_cli.training import kinds
        from baseten_loops_cli.training.config import load_config

        loaded = load_config(config)
        kind = kinds.of(loaded.config)
        if data is None and mapping:  # the config's eval data, read with --columns
            value = kinds.eval_data(loaded)
            if isinstance(value, str):
                data = with_options(loaded, loaded.resolve_path(value) if not value.startswith(HUB_PREFIX) else value,
                                    kind.train_data_key, mapping)
        elif data is not None:  # --data, read with the config's data section (columns, format, truncation)
            data = with_options(loaded, data, kind.train_data_key, mapping)
        task = kinds.eval_task(loaded, data, limit=limit, seed=seed, samples=samples, k=k)
        if task is None:
            key = ".".join(kind.eval_data_key or ("data", "eval"))
            raise UsageError(f"--data is missing and {config} has no {key}", hint="Pass --data FILE.jsonl.")
        return task
    if data is None:
        raise UsageError("nothing to score: pass --data FILE.jsonl (or --config with eval data)",
                         hint="For example: loops eval RUN:final --data examples/data/tiny_sft_eval.jsonl")
    if samples or k:
        raise UsageError("--samples and --k need an RL config (--config) with a reward", hint="SFT rows are scored by likelihood, not sampled.")
    from baseten_loops_cli.training.evaluation.multiple_choice import MCTask, is_multiple_choice

    if isinstance(data, Path) and is_multiple_choice(data):  # rows with choices + label
        return MCTask(data, limit)
    return ev.SFTTask(data, limit=limit)


def eval_command(
    ctx: typer.Context,
    checkpoints: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="CKPT",
            help="Sampler checkpoints: id, bt:// URI, RUN:NAME, or RUN:* for all of a run's.",
            autocompletion=_complete.complete_checkpoint,
            show_default=False,
        ),
    ] = None,
    data: Annotated[Optional[str], typer.Option("--data", "-d", help="Rows to score: a file (JSONL, JSON, CSV, TSV, Parquet, Arrow), a folder of them or hf://datasets/NAME[@REV] (default: the config's eval data).", show_default=False)] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="A training config: SFT rendering, or an RL config's reward and sampling.", show_default=False)] = None,
    base: Annotated[bool, typer.Option("--base", help="Also score the base model (one row per base model).")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Score only the first N rows.", show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="RL: sampling seed (default: the config's seed).", show_default=False)] = None,
    samples: Annotated[Optional[int], typer.Option("--samples", "-n", min=1, max=64, help="RL: completions per prompt (default: the config's group_size).", show_default=False)] = None,
    k: Annotated[Optional[int], typer.Option("--k", min=1, help="RL: the k of pass@k (default: --samples).", show_default=False)] = None,
    columns: Annotated[Optional[str], typer.Option("--columns", metavar="NAME=COLUMN,...", help="Map the format's names to the data's columns, as a config's data.columns (default: the config's): prompt=question,completion=answer.", show_default=False)] = None,
    fail_under: Annotated[Optional[list[str]], typer.Option("--fail-under", metavar="METRIC=VALUE", help="Exit 1 when the best checkpoint's METRIC is below VALUE (accuracy, accuracy_norm, reward, pass_rate, pass_at_k).", show_default=False)] = None,
    fail_over: Annotated[Optional[list[str]], typer.Option("--fail-over", metavar="METRIC=VALUE", help="Exit 1 when the best checkpoint's METRIC is above VALUE (nll, perplexity).", show_default=False)] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Score again even when a result is cached.")] = False,
) -> None:
    """Score checkpoints side by side on a data set; the best value per column is marked *.

    SFT rows (chat messages or prompt/completion) give NLL per token, perplexity and next-token accuracy on the assistant tokens, from one forward pass per row through a sampler (no training). Multiple-choice rows ({"prompt", "choices", "label"}) give accuracy and length-normalised accuracy, each choice scored by its logprobs after the prompt. Prompt rows with an RL config (--config) give the mean reward, pass rate at the config's pass_threshold, unbiased pass@k and mean completion length over --samples completions per prompt.

    Results are cached per checkpoint, data and settings, so re-running a table is instant. Exit 1 when a gate (--fail-under / --fail-over) fails or a reward raises on a row.

    Examples:

      loops eval abc1234:step-000010 abc1234:final --base --data eval.jsonl

      loops eval abc1234:* --config examples/tiny-rl.yaml --samples 8 --k 4

      loops eval abc1234:final --data eval.jsonl --fail-under accuracy=0.8 -o json

      loops eval abc1234:final --base --data multiple_choice.jsonl

      loops eval abc1234:final --data qa.csv --columns prompt=question,completion=answer
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.settings.paths import cache_dir
    from baseten_loops_cli.training.evaluation import scoring as ev

    state = get_state(ctx)
    out = state.output
    refs = list(checkpoints or [])
    if not refs and not base:
        raise UsageError("name at least one checkpoint, or --base", hint="For example: loops eval RUN:final --base --data eval.jsonl")
    task = _task(data, config, limit=limit, seed=seed, samples=samples, k=k, columns=columns)
    gates = [ev.parse_gate(g, task, "under") for g in fail_under or []]
    gates += [ev.parse_gate(g, task, "over") for g in fail_over or []]

    backend = state.backend()

    def config_base_model() -> str:  # --base without a checkpoint: the config's base model
        from baseten_loops_cli.training.config import load_config

        assert config is not None  # passed to candidates only when --config is given (below)
        return load_config(config).config.base_model

    from baseten_loops_cli.services.evaluation import SamplerPool, candidates as eval_candidates

    samplers = SamplerPool(backend.client, backend.api_key,
                           lambda sampler_id, what: out.info(f"Started sampler {sampler_id} for {what} "
                                                             "(stopped when the evaluation ends)."))
    candidates = eval_candidates(backend, refs, samplers, base=base,
                                 config_base_model=config_base_model if config is not None else None)
    try:
        with out.count_progress("Scoring rows") as bar:
            report = ev.evaluate(candidates, task, cache_dir=None if no_cache else cache_dir() / "eval", progress=bar)
    finally:
        for sampler_id in samplers.close():
            out.warn(f"could not stop sampler {sampler_id}; stop it with `loops samplers deactivate {sampler_id}`")
        if samplers.started:
            _complete.invalidate("samplers")
    _render(out, report)
    _fail_on(out, report, gates)


def _fail_on(out: Any, report: Any, gates: list[Any]) -> None:
    """Exit 1 (LoopsError) when a reward failed on a row, or a gate failed; the rows' errors
    are warned first (five at most)."""
    from baseten_loops_cli.errors import LoopsError
    from baseten_loops_cli.training.evaluation import scoring as ev

    for error in report.errors[:5]:
        out.warn(f"{error.source}: {error.message}")
    if report.errors:
        first = report.errors[0]
        more = f" (and {len(report.errors) - 1} more row(s))" if len(report.errors) > 1 else ""
        raise LoopsError(
            f"the reward failed on {first.source}: {first.message}{more}",
            hint="Those rows are left out of the numbers above; fix the reward and run again.",
        )
    failures = ev.check_gates(report, gates)
    if failures:
        raise LoopsError("; ".join(failures), hint="The gate was set with --fail-under / --fail-over.")


def _render(out: Any, report: Any) -> None:
    rows, columns = report.table()
    hint = None
    if len(report.results) > 1:
        cached = sum(r.cached for r in report.results)
        note = f"; {cached} of {len(report.results)} from the cache (--no-cache to score again)" if cached else ""
        hint = f"* best per column{note}."
    out.emit(report.as_dict(), rows=rows, columns=columns, id_key="checkpoint", hint=hint)
