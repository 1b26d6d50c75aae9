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
    since: Annotated[Optional[str], typer.Option("--since", help="Usage over time from this moment: a date or ISO time (2026-12-01, 2026-12-01T10:00Z; local time without a zone) or a duration back from now (7d, 12h, 90m).", show_default=False)] = None,
    until: Annotated[Optional[str], typer.Option("--until", help="With --since: up to this moment (same forms; default now).", show_default=False)] = None,
    period: Annotated[str, typer.Option("--period", help="With --since: one row per owner and UTC hour or day.")] = "day",
    pricing: Annotated[Optional[str], typer.Option("--pricing", help="With --since: a YAML file whose pricing: section (a training config's) prices the usage (COST column).", show_default=False)] = None,
) -> None:
    """GPU allocations of your runs and samplers, and the tokens and time they used.

    GPUs in use vs scaled to zero, plus tokens trained and sampled and compute time per run
    where the backend reports them. Your own allocations by default (--org for everyone's). Rows holding no live GPUs are
    hidden unless --all. On the local backend the allocations are CPU workers. -o json prints
    {"summary": {...}, "rows": [...]} with the Go CLI's keys; --by-run -o json prints
    {"runs": [...], "totals": {...}}. --since/--until: tokens, compute and (with --pricing)
    cost per hour or day of a window, per run, sampler and deployment (local backend; kept to
    the minute); -o json prints {"since", "until", "period", "pricing", "periods", "totals"}.

    Examples:

      loops usage

      loops usage --org --all

      loops usage --by-run -o json --jq '.totals'

      loops usage --since 7d --pricing examples/tiny-sft.yaml -o csv
    """
    from baseten_loops_cli.cli.runs import hidden_hint
    from baseten_loops_cli.services import usage as service

    state = get_state(ctx)
    out = state.output
    backend = state.backend()
    org = org or bool(user)
    if since is not None or until is not None or pricing is not None:
        _over_time(out, backend, since, until, period, pricing, org=org, by_run=by_run, all_=all_)
        return
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


def _when(text: str, flag: str):
    """A moment as typed: a duration back from now (``7d``, ``1h30m``) or a date / ISO time."""
    from datetime import datetime, timedelta, timezone

    from baseten_loops_cli.cli.runs import _DURATION_RE, parse_duration, parse_when

    if _DURATION_RE.match(text.strip()):
        return datetime.now(timezone.utc) - timedelta(seconds=parse_duration(text))
    return parse_when(text, flag)


def _over_time(out, backend, since: str | None, until: str | None, period: str, pricing: str | None, *,
               org: bool, by_run: bool, all_: bool) -> None:
    from datetime import datetime, timezone

    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.services import usage as service

    if since is None:
        raise UsageError("--until and --pricing go with --since", hint="e.g. loops usage --since 7d")
    if org or by_run or all_:
        raise UsageError("--since cannot be combined with --org, --user, --by-run or --all",
                         hint="--since lists every run, sampler and deployment of the window.")
    if period not in service.PERIODS:
        raise UsageError(f"--period must be hour or day, not {period!r}", hint="e.g. --period hour")
    prices = None
    if pricing is not None:
        from baseten_loops_cli.training.config import load_pricing

        prices = load_pricing(pricing)
    start = _when(since, "--since")
    end = _when(until, "--until") if until is not None else datetime.now(timezone.utc)
    report = service.usage_over_time(backend, since=start, until=end, period=period, pricing=prices)
    cols: list = [
        ("PERIOD", lambda r: r.period_start.strftime("%Y-%m-%d %H:%M" if period == "hour" else "%Y-%m-%d")),
        ("OWNER", "owner_id"),
        ("KIND", "owner_kind"),
        ("RUN", "run_id"),
        ("TOKENS TRAINED", "tokens_trained"),
        ("TOKENS SAMPLED", "tokens_sampled"),
        ("COMPUTE S", "compute_seconds"),
        ("REQUESTS", "sample_requests"),
    ]
    if prices is not None:
        cols.append(("COST USD", "cost_usd"))
    totals = report.totals
    out.emit(
        report.document(),
        rows=report.periods,
        columns=cols,
        id_key="owner_id",
        empty=f"No usage between {start.isoformat(timespec='seconds')} and {end.isoformat(timespec='seconds')}.",
        hint=(f"Total: {totals.tokens_trained:,} tokens trained, {totals.tokens_sampled:,} sampled, "
              f"{_compute(totals.compute_seconds)} of compute"
              + (f", ${totals.cost_usd:,.4f}" if totals.cost_usd is not None else "") + " (UTC periods)."),
    )
