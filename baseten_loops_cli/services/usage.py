"""What your runs and samplers hold right now, and what they used (``loops usage``).

Like ``baseten loops usage``: a client-side join of the trainer deployments
(``GET /v1/loops/deployments``) with the standalone samplers (``GET /v1/loops/samplers``), one
row per allocation, and a summary of GPUs in use vs scaled to zero. The keys are the Go CLI's,
plus tokens trained and sampled and compute time per run where the backend reports them (the
local backend does, through ``/v1/local/usage``). On the local backend allocations are CPU
workers: the summary counts allocations instead of GPUs (``summary.unit``).

With ``--since/--until`` (:func:`usage_over_time`): tokens and compute per hour or day of a
window, per owner, priced by a training config's ``pricing:`` section. The local backend keeps
its counters by the minute for that; Baseten has no such route.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from baseten_loops_cli.api.models import SAMPLER_LIVE, TRAINER_LIVE, InstanceType, LoopsDeployment, LoopsSampler
from baseten_loops_cli.errors import LoopsError, UsageError
from baseten_loops_cli.services.resolve import created_key
from baseten_loops_cli.services.runs import select_runs

if TYPE_CHECKING:
    from baseten_loops_cli.services import Connected as Backend


class UsageRow(BaseModel):
    run_id: str | None = None
    owner: str | None = None
    base_model: str | None = None
    created_at: Any = None
    trainer_status: str | None = None
    trainer_instance_type: str | None = None
    trainer_node_count: int | None = None
    trainer_gpus: int | None = None
    sampler_status: str | None = None
    sampler_instance_type: str | None = None
    sampler_node_count: int | None = None
    sampler_gpus: int | None = None
    tokens_trained: int | None = None
    tokens_sampled: int | None = None
    compute_seconds: float | None = None
    sampler_id: str | None = None  # standalone samplers only (left out of the JSON otherwise)

    @property
    def in_use(self) -> bool:
        return self.trainer_status in TRAINER_LIVE or self.sampler_status in SAMPLER_LIVE


class UsageSummary(BaseModel):
    trainer_in_use: int = 0
    trainer_scaled_to_zero: int = 0
    sampler_in_use: int = 0
    sampler_scaled_to_zero: int = 0
    unit: str = "gpus"


class UsageReport(BaseModel):
    """``loops usage -o json``: ``rows`` are the shown ones; ``hidden`` counts idle rows left out."""

    summary: UsageSummary
    rows: list[UsageRow]
    hidden: int = 0
    any_rows: bool = False
    reports_usage: bool = False

    def document(self) -> dict[str, Any]:
        rows = [r.model_dump(exclude={"sampler_id"} if r.sampler_id is None else set()) for r in self.rows]
        return {"summary": self.summary, "rows": rows}


class RunUsage(BaseModel):
    run_id: str
    owner: str | None = None
    name: str | None = None
    base_model: str | None = None
    status: str | None = None
    created_at: Any = None
    tokens_trained: int | None = None
    tokens_sampled: int | None = None
    # Of tokens_sampled, what deployments served from this run's checkpoints.
    tokens_sampled_by_deployments: int | None = None
    compute_seconds: float | None = None
    operations: int | None = None
    sample_requests: int | None = None


class UsageTotals(BaseModel):
    tokens_trained: int
    tokens_sampled: int
    tokens_sampled_by_deployments: int
    compute_seconds: float


class RunUsageReport(BaseModel):
    """``loops usage --by-run -o json`` (``{runs, totals}``)."""

    runs: list[RunUsage]
    totals: UsageTotals | None = None
    hidden: int = 0
    recent: bool = False

    def document(self) -> dict[str, Any]:
        return {"runs": self.runs, "totals": self.totals}


def _alloc(component: LoopsDeployment | LoopsSampler | None) -> tuple[str | None, int | None, int | None]:
    """(instance type name, node count, GPUs) of a deployment or sampler."""
    if component is None:
        return None, None, None
    it: InstanceType | None = component.instance_type
    nodes = component.node_count or 1
    gpus = (it.gpu_count or 0) * nodes if it else 0
    return (it.name or it.id) if it else None, nodes, gpus


def _counters(backend: "Backend") -> dict[str, dict[str, Any]] | None:
    """Per-owner counters keyed by run / sampler id, or None when the backend reports none
    (only the local backend does)."""
    if not backend.capabilities.usage_counters:
        return None
    try:
        rows = backend.client.local_usage()
    except LoopsError:
        return None
    return {str(r.get("owner_id")): r for r in rows}


def _row(run_id: str | None, source: LoopsDeployment | LoopsSampler, trainer: LoopsDeployment | None,
         sampler: LoopsSampler | None, used: dict[str, Any] | None) -> UsageRow:
    t_type, t_nodes, t_gpus = _alloc(trainer)
    s_type, s_nodes, s_gpus = _alloc(sampler)
    return UsageRow(
        run_id=run_id,
        owner=source.user.email if source.user else None,
        base_model=source.base_model,
        created_at=source.created_at,
        trainer_status=trainer.status_name if trainer else None,
        trainer_instance_type=t_type,
        trainer_node_count=t_nodes,
        trainer_gpus=t_gpus,
        sampler_status=sampler.status_name if sampler else None,
        sampler_instance_type=s_type,
        sampler_node_count=s_nodes,
        sampler_gpus=s_gpus,
        tokens_trained=used.get("tokens_trained") if used else None,
        tokens_sampled=used.get("tokens_sampled") if used else None,
        compute_seconds=used.get("compute_seconds") if used else None,
    )


def build_rows(deployments: list[LoopsDeployment], samplers: list[LoopsSampler], usage: dict[str, dict]) -> list[UsageRow]:
    rows: list[UsageRow] = []
    bound: set[str] = set()
    for dep in deployments:
        if dep.sampler is not None:
            bound.add(dep.sampler.id)
        run_id = dep.active_run_id or dep.latest_run_id
        rows.append(_row(run_id, dep, dep, dep.sampler, usage.get(run_id or "")))
    for s in samplers:
        if s.id in bound:
            continue
        owner_run = s.run_id
        row = _row(owner_run, s, None, s, usage.get(owner_run or s.id))
        row.sampler_id = s.id
        rows.append(row)
    rows.sort(key=created_key, reverse=True)
    return rows


def summarize(rows: list[UsageRow], unit: str) -> UsageSummary:
    summary = UsageSummary(unit=unit)
    for row in rows:
        for side, live in (("trainer", TRAINER_LIVE), ("sampler", SAMPLER_LIVE)):
            status = getattr(row, f"{side}_status")
            amount = 1 if unit == "allocations" else (getattr(row, f"{side}_gpus") or 0)
            if status in live:
                setattr(summary, f"{side}_in_use", getattr(summary, f"{side}_in_use") + amount)
            elif status == "SCALED_TO_ZERO":
                setattr(summary, f"{side}_scaled_to_zero", getattr(summary, f"{side}_scaled_to_zero") + amount)
    return summary


def allocations(backend: "Backend", *, org: bool = False, user: str | None = None, include_idle: bool = False) -> UsageReport:
    """One row per allocation (trainer + paired sampler, or standalone sampler); rows holding
    nothing live are left out unless ``include_idle``. ``user`` (an email) implies ``org``."""
    scope = "org" if org or user else None
    counters = _counters(backend)
    client = backend.client
    rows = build_rows(client.deployments.list(scope=scope), client.samplers.list(scope=scope), counters or {})
    if user:
        rows = [r for r in rows if (r.owner or "").lower() == user.lower()]
    gpu_rows = any((r.trainer_gpus or 0) + (r.sampler_gpus or 0) for r in rows)
    unit = "gpus" if gpu_rows or backend.capabilities.gpu_allocations else "allocations"
    shown = rows if include_idle else [r for r in rows if r.in_use]
    return UsageReport(summary=summarize(rows, unit), rows=shown, hidden=len(rows) - len(shown), any_rows=bool(rows),
                       reports_usage=counters is not None)


def usage_by_run(backend: "Backend", *, org: bool = False, user: str | None = None, include_inactive: bool = False) -> RunUsageReport:
    """Tokens trained and sampled and compute per run; which runs by :func:`select_runs`.
    A run's tokens sampled include its checkpoints sampled by standalone samplers and
    deployments (``tokens_sampled_by_deployments`` is the deployments' part)."""
    counters = _counters(backend)
    runs = backend.client.runs.list(scope="org" if org or user else None)
    if user:
        runs = [r for r in runs if ((r.user.email if r.user else None) or "").lower() == user.lower()]
    shown, hidden, recent = select_runs(runs, include_inactive=include_inactive)
    shown.sort(key=created_key, reverse=True)
    zero = 0 if counters is not None else None
    rows = []
    for r in shown:
        used = (counters or {}).get(r.id)
        # Sampling of the run's checkpoints counts for the run wherever it was served: its own
        # sampler, a standalone sampler (`loops sample`, `loops eval`) or a deployment.
        elsewhere = (used or {}).get("checkpoints_sampled_by") or []
        sampled = (used.get("tokens_sampled", 0) if used else zero)
        if sampled is not None:
            sampled += sum(int(o.get("tokens_sampled") or 0) for o in elsewhere)
        requests = used.get("sample_requests") if used else None
        if requests is not None:
            requests += sum(int(o.get("sample_requests") or 0) for o in elsewhere)
        rows.append(RunUsage(
            run_id=r.id,
            owner=r.user.email if r.user else None,
            name=r.name,
            base_model=r.base_model,
            status=r.status_name,
            created_at=r.created_at,
            tokens_trained=used.get("tokens_trained", 0) if used else zero,
            tokens_sampled=sampled,
            tokens_sampled_by_deployments=None if counters is None else sum(
                int(o.get("tokens_sampled") or 0) for o in elsewhere if o.get("owner_kind") == "deployment"),
            compute_seconds=used.get("compute_seconds", 0.0) if used else (0.0 if counters is not None else None),
            operations=used.get("operations") if used else None,
            sample_requests=requests,
        ))
    totals = None
    if counters is not None:
        totals = UsageTotals(
            tokens_trained=sum(r.tokens_trained or 0 for r in rows),
            tokens_sampled=sum(r.tokens_sampled or 0 for r in rows),
            tokens_sampled_by_deployments=sum(r.tokens_sampled_by_deployments or 0 for r in rows),
            compute_seconds=round(sum(r.compute_seconds or 0 for r in rows), 3),
        )
    return RunUsageReport(runs=rows, totals=totals, hidden=hidden, recent=recent)


# ── usage over time (`loops usage --since/--until`) ─────────────────────────────────────────

PERIODS = {"hour": 3600, "day": 86400}


class PeriodUsage(BaseModel):
    """What one owner (run, standalone sampler, deployment) used in one period, for the run it
    counts for (its own, or the run whose checkpoint it served)."""

    period_start: datetime
    owner_id: str
    owner_kind: str
    run_id: str | None = None
    tokens_trained: int = 0
    tokens_sampled: int = 0
    compute_seconds: float = 0.0
    sample_requests: int = 0
    cost_usd: float | None = None  # with --pricing


class PeriodTotals(BaseModel):
    tokens_trained: int
    tokens_sampled: int
    compute_seconds: float
    cost_usd: float | None = None


class UsageOverTime(BaseModel):
    """``loops usage --since ... -o json``: ``{since, until, period, pricing, periods, totals}``."""

    since: datetime
    until: datetime
    period: str
    pricing: dict[str, Any] | None = None
    periods: list[PeriodUsage]
    totals: PeriodTotals

    def document(self) -> dict[str, Any]:
        return self.model_dump()


def cost_usd(pricing: Any, *, tokens_trained: int, tokens_sampled: int, compute_seconds: float) -> float | None:
    """What a training config's ``pricing:`` (training.config.PricingConfig) makes of some use:
    tokens trained and sampled at their per-million prices, compute at its hourly price. None
    when no price is set."""
    prices = (pricing.usd_per_million_train_tokens, pricing.usd_per_million_sample_tokens, pricing.usd_per_hour)
    if all(p is None for p in prices):
        return None
    train, sample, hour = (p or 0.0 for p in prices)
    return round(tokens_trained / 1e6 * train + tokens_sampled / 1e6 * sample + compute_seconds / 3600 * hour, 6)


def usage_over_time(backend: "Backend", *, since: datetime, until: datetime, period: str = "day",
                    pricing: Any = None) -> UsageOverTime:
    """Tokens and compute per period (UTC hours or days) of ``[since, until)``, per owner, and
    their cost under ``pricing`` (a training.config.PricingConfig). Only backends that keep
    usage counters (the local one, to the minute) report it."""
    if not backend.capabilities.usage_counters:
        raise LoopsError(f"the {backend.kind} backend does not report usage over time",
                         hint="Run `loops usage` (allocations now) or `loops usage --by-run`; Baseten bills on your workspace's usage page.")
    if since >= until:
        raise UsageError(f"--since ({since.isoformat()}) is not before --until ({until.isoformat()})",
                         hint="e.g. --since 7d, or --since 2026-12-01 --until 2026-12-08")
    raw = backend.client.local_usage_periods(int(since.timestamp()), math.ceil(until.timestamp()), PERIODS[period])
    rows = []
    for r in raw:
        row = PeriodUsage(period_start=datetime.fromtimestamp(r["start"], tz=timezone.utc), owner_id=r["owner_id"],
                          owner_kind=r["owner_kind"], run_id=r.get("run_id"), tokens_trained=r["tokens_trained"],
                          tokens_sampled=r["tokens_sampled"], compute_seconds=r["compute_seconds"],
                          sample_requests=r["sample_requests"])
        if pricing is not None:
            row.cost_usd = cost_usd(pricing, tokens_trained=row.tokens_trained, tokens_sampled=row.tokens_sampled,
                                    compute_seconds=row.compute_seconds)
        rows.append(row)
    trained, sampled = sum(r.tokens_trained for r in rows), sum(r.tokens_sampled for r in rows)
    seconds = round(sum(r.compute_seconds for r in rows), 3)
    totals = PeriodTotals(tokens_trained=trained, tokens_sampled=sampled, compute_seconds=seconds,
                          cost_usd=None if pricing is None else cost_usd(pricing, tokens_trained=trained,
                                                                         tokens_sampled=sampled, compute_seconds=seconds))
    return UsageOverTime(since=since, until=until, period=period, periods=rows, totals=totals,
                         pricing=pricing.model_dump(exclude_none=True) if pricing is not None else None)
