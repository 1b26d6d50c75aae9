"""`loops usage`: what your runs and samplers hold right now, and what they used.

Like `baseten loops usage`: a client-side join of the trainer deployments
(`GET /v1/loops/deployments`) with the standalone samplers (`GET /v1/loops/samplers`), one row
per allocation, a summary of GPUs in use vs scaled to zero, and idle rows hidden unless --all.
The JSON keys are the Go CLI's (`{summary: {trainer_in_use, ...}, rows: [{run_id, ...}]}`),
plus tokens trained and sampled and compute time per run where the backend reports them (the
local backend does, through `/v1/local/usage`). On the local backend allocations are CPU
workers: the summary counts allocations instead of GPUs (`summary.unit`).
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


def _alloc(component: dict | None) -> tuple[str | None, int | None, int | None]:
    """(instance type name, node count, GPUs) of a deployment or sampler."""
    if not component:
        return None, None, None
    it = component.get("instance_type") or {}
    nodes = component.get("node_count") or 1
    gpus = (it.get("gpu_count") or 0) * nodes
    return it.get("name") or it.get("id"), nodes, gpus


def build_rows(deployments: list[dict], samplers: list[dict], usage: dict[str, dict]) -> list[dict]:
    from baseten_loops_cli.cli._resolve import status_name

    rows: list[dict] = []
    bound: set[str] = set()
    for dep in deployments:
        sampler = dep.get("sampler") or None
        if sampler:
            bound.add(sampler.get("id"))
        t_type, t_nodes, t_gpus = _alloc(dep)
        s_type, s_nodes, s_gpus = _alloc(sampler)
        run_id = dep.get("active_run_id") or dep.get("latest_run_id")
        rows.append(_row(run_id, dep, status_name(dep), t_type, t_nodes, t_gpus,
                         status_name(sampler) if sampler else None, s_type, s_nodes, s_gpus, usage.get(run_id or "")))
    for s in samplers:
        if s.get("id") in bound:
            continue
        s_type, s_nodes, s_gpus = _alloc(s)
        owner_usage = usage.get(s.get("run_id") or "") if s.get("run_id") else usage.get(s.get("id") or "")
        row = _row(s.get("run_id"), s, None, None, None, None, status_name(s), s_type, s_nodes, s_gpus, owner_usage)
        row["sampler_id"] = s.get("id")
        rows.append(row)
    rows.sort(key=lambda r: r.get("created_at") or "", reverse=True)
    return rows


def _row(run_id, source: dict, t_status, t_type, t_nodes, t_gpus, s_status, s_type, s_nodes, s_gpus, used: dict | None) -> dict:
    return {
        "run_id": run_id,
        "owner": (source.get("user") or {}).get("email"),
        "base_model": source.get("base_model"),
        "created_at": source.get("created_at"),
        "trainer_status": t_status,
        "trainer_instance_type": t_type,
        "trainer_node_count": t_nodes,
        "trainer_gpus": t_gpus,
        "sampler_status": s_status,
        "sampler_instance_type": s_type,
        "sampler_node_count": s_nodes,
        "sampler_gpus": s_gpus,
        "tokens_trained": used.get("tokens_trained") if used else None,
        "tokens_sampled": used.get("tokens_sampled") if used else None,
        "compute_seconds": used.get("compute_seconds") if used else None,
    }


def summarize(rows: list[dict], unit: str) -> dict:
    from baseten_loops_cli.cli._resolve import SAMPLER_LIVE, TRAINER_LIVE

    def amount(row: dict, side: str) -> int:
        if unit == "allocations":
            return 1
        return row.get(f"{side}_gpus") or 0

    out = {"trainer_in_use": 0, "trainer_scaled_to_zero": 0, "sampler_in_use": 0, "sampler_scaled_to_zero": 0}
    for row in rows:
        for side, live in (("trainer", TRAINER_LIVE), ("sampler", SAMPLER_LIVE)):
            status = row.get(f"{side}_status")
            if status in live:
                out[f"{side}_in_use"] += amount(row, side)
            elif status == "SCALED_TO_ZERO":
                out[f"{side}_scaled_to_zero"] += amount(row, side)
    out["unit"] = unit
    return out


def _in_use(row: dict) -> bool:
    from baseten_loops_cli.cli._resolve import SAMPLER_LIVE, TRAINER_LIVE

    return row.get("trainer_status") in TRAINER_LIVE or row.get("sampler_status") in SAMPLER_LIVE


def _fetch_usage(backend) -> dict[str, dict] | None:
    """Per-owner counters keyed by run / sampler id, or None when the backend reports none
    (only the local backend does)."""
    from baseten_loops_cli.errors import LoopsError

    if backend.kind != "local":
        return None
    try:
        rows = backend.client.local_usage()
    except LoopsError:
        return None
    return {str(r.get("owner_id")): r for r in rows}


def _count(value: Any) -> str | None:
    return f"{value:,}" if isinstance(value, int) else None


def _usage_columns(org: bool, with_usage: bool) -> list:
    from baseten_loops_cli.output.format import human_duration

    cols: list = [("RUN", lambda r: r.get("run_id") or (f"sampler {r['sampler_id']}" if r.get("sampler_id") else None))]
    if org:
        cols.append(("OWNER", "owner"))
    cols += [
        ("BASE MODEL", "base_model"),
        ("TRAINER GPU", lambda r: _gpu_cell(r.get("trainer_instance_type"), r.get("trainer_gpus"), r.get("trainer_node_count"))),
        ("TRAINER STATUS", "trainer_status"),
        ("SAMPLER GPU", lambda r: _gpu_cell(r.get("sampler_instance_type"), r.get("sampler_gpus"), r.get("sampler_node_count"))),
        ("SAMPLER STATUS", "sampler_status"),
    ]
    if with_usage:
        cols += [
            ("TOKENS TRAINED", lambda r: _count(r.get("tokens_trained"))),
            ("TOKENS SAMPLED", lambda r: _count(r.get("tokens_sampled"))),
            ("COMPUTE", lambda r: human_duration(r["compute_seconds"]) if r.get("compute_seconds") is not None else None),
        ]
    cols.append(("CREATED", "created_at"))
    return cols


def usage(
    ctx: typer.Context,
    org: Annotated[bool, typer.Option("--org", help="The whole organization's allocations (adds OWNER).")] = False,
    user: Annotated[Optional[str], typer.Option("--user", help="Only this user's allocations (by email; implies --org).")] = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Also show allocations holding no live GPUs (idle, scaled to zero, stopped).")] = False,
    by_run: Annotated[bool, typer.Option("--by-run", help="One row per run: tokens trained and sampled, compute time.")] = False,
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
    from baseten_loops_cli.cli._resolve import as_dict

    state = get_state(ctx)
    out = state.output
    backend = state.backend()
    client = backend.client
    if user:
        org = True
    scope = "org" if org else None
    counters = _fetch_usage(backend)
    if by_run:
        _by_run(out, client, scope, counters, all_, user, org)
        return
    deployments = as_dict(client.deployments.list(scope=scope)) or []
    samplers = as_dict(client.samplers.list(scope=scope)) or []
    rows = build_rows(deployments, samplers, counters or {})
    if user:
        rows = [r for r in rows if (r.get("owner") or "").lower() == user.lower()]
    gpu_rows = any((r.get("trainer_gpus") or 0) + (r.get("sampler_gpus") or 0) for r in rows)
    unit = "gpus" if gpu_rows or backend.kind != "local" else "allocations"
    summary = summarize(rows, unit)
    shown = rows if all_ else [r for r in rows if _in_use(r)]
    hidden = len(rows) - len(shown)
    doc = {"summary": summary, "rows": shown}
    with_usage = counters is not None
    if out.human:
        if rows:
            word = "Trainer GPUs" if unit == "gpus" else "Trainers"
            sword = "Sampler GPUs" if unit == "gpus" else "Samplers"
            out.info(
                f"{word}: {summary['trainer_in_use']} in use, {summary['trainer_scaled_to_zero']} scaled to zero. "
                f"{sword}: {summary['sampler_in_use']} in use, {summary['sampler_scaled_to_zero']} scaled to zero."
                + ("" if unit == "gpus" else " (local backend: CPU workers, no GPUs)")
            )
    out.emit(
        doc,
        rows=shown,
        columns=_usage_columns(org, with_usage),
        id_key="run_id",
        empty="No Loops trainers or samplers found." if not rows else None,
    )
    if out.human and hidden:
        out.hint(f"{hidden} allocation{'s' if hidden != 1 else ''} holding no live GPUs hidden; pass --all to show {'them' if hidden != 1 else 'it'}.")


def _by_run(out, client, scope: str | None, counters: dict[str, dict] | None, all_: bool, user: str | None, org: bool) -> None:
    from baseten_loops_cli.cli._resolve import as_dict, status_name
    from baseten_loops_cli.output.format import human_duration

    runs = as_dict(client.runs.list(scope=scope)) or []
    if user:
        runs = [r for r in runs if ((r.get("user") or {}).get("email") or "").lower() == user.lower()]
    hidden = 0
    if not all_:
        shown = [r for r in runs if status_name(r) == "ACTIVE"]
        hidden = len(runs) - len(shown)
        runs = shown
    runs.sort(key=lambda r: r.get("created_at") or "", reverse=True)
    rows = []
    for r in runs:
        used = (counters or {}).get(r["id"])
        rows.append({
            "run_id": r["id"],
            "owner": (r.get("user") or {}).get("email"),
            "name": r.get("name"),
            "base_model": r.get("base_model"),
            "status": status_name(r),
            "created_at": r.get("created_at"),
            "tokens_trained": used.get("tokens_trained", 0) if used else (0 if counters is not None else None),
            "tokens_sampled": used.get("tokens_sampled", 0) if used else (0 if counters is not None else None),
            "compute_seconds": used.get("compute_seconds", 0.0) if used else (0.0 if counters is not None else None),
            "operations": used.get("operations") if used else None,
            "sample_requests": used.get("sample_requests") if used else None,
        })
    totals = None
    if counters is not None:
        totals = {
            "tokens_trained": sum(r["tokens_trained"] or 0 for r in rows),
            "tokens_sampled": sum(r["tokens_sampled"] or 0 for r in rows),
            "compute_seconds": round(sum(r["compute_seconds"] or 0 for r in rows), 3),
        }
    cols: list = [("RUN", "run_id")]
    if org:
        cols.append(("OWNER", "owner"))
    cols += [
        ("BASE MODEL", "base_model"),
        ("STATUS", "status"),
        ("TOKENS TRAINED", lambda r: _count(r.get("tokens_trained"))),
        ("TOKENS SAMPLED", lambda r: _count(r.get("tokens_sampled"))),
        ("COMPUTE", lambda r: human_duration(r["compute_seconds"]) if r.get("compute_seconds") is not None else None),
        ("CREATED", "created_at"),
    ]
    out.emit(
        {"runs": rows, "totals": totals},
        rows=rows,
        columns=cols,
        id_key="run_id",
        empty="No Loops runs found." if all_ else "No active Loops runs found. Pass --all to include inactive runs.",
    )
    if out.human and rows:
        if totals:
            out.info(
                f"Total: {totals['tokens_trained']:,} tokens trained, {totals['tokens_sampled']:,} sampled, "
                f"{human_duration(totals['compute_seconds'])} of compute."
            )
        else:
            out.hint("This backend does not report tokens or compute per run.")
        if hidden:
            out.hint(f"{hidden} inactive run{'s' if hidden != 1 else ''} hidden; pass --all to show {'them' if hidden != 1 else 'it'}.")
