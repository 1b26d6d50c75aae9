"""`loops usage`: what your runs and samplers hold right now, and what they used.

Parse, call :mod:`baseten_loops_cli.services.usage`, render. The JSON keys are the Go CLI's
(`{summary: {trainer_in_use, ...}, rows: [{run_id, ...}]}`); `--by-run` prints
`{runs: [...], totals: {...}}`.
"""

from typing import Annotated, Any, Optional

import typer

from baseten_loops_cli.cli._state import get_state


def _gpu_cell(instance_type: str | None, gpus: int | None, nodes: int | None) -> str | None:
    """``<instance type> (<n> GPUs)`` or ``(<n> GPUs across <k> nodes)`` (the Go CLI's cell)."""
    if not instance_type and not gpus:
        return None
    name = instance_type or "?"
    if not gpus:
        return name
    if nodes and nodes > 1:
        return f"{name} ({gpus} GPUs across {nodes} nodes)"
    return f"{name} ({gpus} GPU{'s' if gpus != 1 else ''})"


def _count(value: Any) -> str | None:
    return f"{value:,}" if isinstance(value, int) else None


def _compute(seconds: float | None) -> str | None:
    from baseten_loops_cli.output.format import human_duration

    return human_duration(seconds) if seconds is not None else None


def _usage_columns(org: bool, with_usage: bool) -> list:
    cols: list = [("RUN", lambda r: r.run_id or (f"sampler {r.sampler_id}" if r.sampler_id else None))]
    if org:
        cols.append(("OWNER", "owner"))
    cols += [
        ("BASE MODEL", "base_model"),
        ("TRAINER GPU", lambda r: _gpu_cell(r.trainer_instance_type, r.trainer_gpus, r.trainer_node_count)),
        ("TRAINER STATUS", "trainer_status"),
        ("SAMPLER GPU", lambda r: _gpu_cell(r.sampler_instance_type, r.sampler_gpus, r.sampler_node_count)),
        ("SAMPLER STATUS", "sampler_status"),
    ]
    if with_usage:
        cols += [
            ("TOKENS TRAINED", lambda r: _count(r.tokens_trained)),
            ("TOKENS SAMPLED", lambda r: _count(r.tokens_sampled)),
            ("COMPUTE", lambda r: _compute(r.compute_seconds)),
        ]
    cols.append(("CREATED", "created_at"))
    return cols


def usage(
    ctx: typer.Context,
    org: Annotated[bool, typer.Option("--org", help="The whole organization's allocations (adds OWNER).")] = False,
    user: Annotated[Optional[str], typer.Option("--user", help="Only this user's allocations (by email; implies --org).")] = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Also show allocations holding no live GPUs (idle, scaled to zero, stopped).")] = False,
    by_run: Annotated[bool, typer.Option("--by-run", help="One row per run: tokens trained and sampled (its checkpoints' sampling anywhere, deployments' share apart), compute time (active runs, or the last 24 hours' when none is active; --all for every run).")] = False,
) -> None:
    """GPU allocations of your runs and samplers, and the tokens and time they used.

    GPUs in use vs scaled to zero, plus tokens trained and sampled and compute time per run
    where the backend reports them. Your own allocations by default (--org for everyone's). Rows holding no live GPUs are
    hidden unless --all. On the local backend the allocations are CPU workers. -o json prints
    {"summary": {...}, "rows": [...]} with the Go CLI's keys; --by-run -o json prints
    {"runs": [...], "totals": {...}}.

    Examples:

      loops usage

      loops usage --org --all

      loops usage --by-run -o json --jq '.totals'
    """
    from baseten_loops_cli.cli.runs import hidden_hint
    from baseten_loops_cli.services import usage as service

    state = get_state(ctx)
    out = state.output
    backend = state.backend()
    org = org or bool(user)
    if by_run:
        _by_run(out, service.usage_by_run(backend, org=org, user=user, include_inactive=all_), org, all_)
        return
    report = service.allocations(backend, org=org, user=user, include_idle=all_)
    summary = report.summary
    gpus = summary.unit == "gpus"
    out.emit(
        report.document(),
        rows=report.rows,
        columns=_usage_columns(org, report.reports_usage),
        id_key="run_id",
        empty="No Loops trainers or samplers found." if not report.any_rows else None,
        note=(
            f"{'Trainer GPUs' if gpus else 'Trainers'}: {summary.trainer_in_use} in use, {summary.trainer_scaled_to_zero} scaled to zero. "
            f"{'Sampler GPUs' if gpus else 'Samplers'}: {summary.sampler_in_use} in use, {summary.sampler_scaled_to_zero} scaled to zero."
            + ("" if gpus else " (local backend: CPU workers, no GPUs)")
        ) if report.any_rows else None,
    )
    if report.hidden:
        out.hint(hidden_hint(report.hidden, "allocation").replace(" hidden;", " holding no live GPUs hidden;"))


def _by_run(out, report, org: bool, all_: bool) -> None:
    from baseten_loops_cli.cli.runs import hidden_hint
    from baseten_loops_cli.output.format import human_duration

    cols: list = [("RUN", "run_id")]
    if org:
        cols.append(("OWNER", "owner"))
    cols += [
        ("BASE MODEL", "base_model"),
        ("STATUS", "status"),
        ("TOKENS TRAINED", lambda r: _count(r.tokens_trained)),
        ("TOKENS SAMPLED", lambda r: _count(r.tokens_sampled)),
        ("BY DEPLOYMENTS", lambda r: _count(r.tokens_sampled_by_deployments)),
        ("COMPUTE", lambda r: _compute(r.compute_seconds)),
        ("CREATED", "created_at"),
    ]
    totals = report.totals
    if report.recent:
        out.info("No active Loops runs; showing the ones created in the last 24 hours.")
    out.emit(
        report.document(),
        rows=report.runs,
        columns=cols,
        id_key="run_id",
        empty="No Loops runs found." if all_ else "No active Loops runs found. Pass --all to include inactive runs.",
        hint=(
            f"Total: {totals.tokens_trained:,} tokens trained, {totals.tokens_sampled:,} sampled "
            f"({totals.tokens_sampled_by_deployments:,} by deployments), "
            f"{human_duration(totals.compute_seconds)} of compute."
        ) if totals else "This backend does not report tokens or compute per run.",
    )
    if report.runs and report.hidden:
        out.hint(hidden_hint(report.hidden, "inactive run", recent=report.recent))
