"""Checkpoints: list (by run, base model, URI, or all of yours), describe, list files, download.

Use from Python::

    listing = list_checkpoints(client, run_id="abc1234", target="sampler")
    result = download(client, "abc1234:final", Path("adapter"))
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel

from baseten_loops_cli.api.models import CheckpointFile, LoopsCheckpoint
from baseten_loops_cli.errors import LoopsError, UsageError
from baseten_loops_cli.services.resolve import (
    NotFound,
    all_checkpoints,
    checkpoints_of_run,
    created_key,
    display_name,
    parse_checkpoint_ref,
    resolve_checkpoint,
)

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.api.download import DownloadResult, Progress

SORT_KEYS = ("created", "name", "size", "target", "run")


class CheckpointListing(BaseModel):
    checkpoints: list[LoopsCheckpoint]
    total: int  # before --limit
    where: str  # " for run X", " for MODEL", " at URI" or ""


def sort_checkpoints(cps: list[LoopsCheckpoint], sort: str, reverse: bool) -> list[LoopsCheckpoint]:
    keys: dict[str, Callable[[LoopsCheckpoint], Any]] = {
        "created": created_key,
        "name": lambda c: c.checkpoint_id,
        "size": lambda c: c.size_bytes or 0,
        "target": lambda c: c.target or "",
        "run": lambda c: c.run_id,
    }
    # Newest (or largest) first by default; names, targets and runs A→Z.
    ordered = sorted(cps, key=created_key, reverse=True)
    ordered = sorted(ordered, key=keys[sort], reverse=sort in ("created", "size"))
    return list(reversed(ordered)) if reverse else ordered


def list_checkpoints(
    client: "LoopsClient",
    *,
    run_id: str | None = None,
    base_model: str | None = None,
    uri: str | None = None,
    target: str | None = None,
    sort: str = "created",
    reverse: bool = False,
    limit: int = 0,
) -> CheckpointListing:
    """Checkpoints of a run, of a base model, at a URI (give at most one), or of all your runs."""
    if run_id:
        cps, where = checkpoints_of_run(client, run_id), f" for run {run_id}"
    elif base_model:
        cps, where = client.checkpoints.list(base_model=base_model), f" for {base_model}"
    elif uri:
        ref = parse_checkpoint_ref(uri)
        if ref.kind != "uri":
            raise UsageError(f"--uri needs a bt:// URI, got {uri!r}", hint="Use --run-id for RUN:NAME lookups.")
        cps, where = client.checkpoints.list(checkpoint_path=ref.text), f" at {ref.text}"
    else:
        cps, where = all_checkpoints(client), ""
    if target:
        cps = [c for c in cps if c.target == target]
    ordered = sort_checkpoints(cps, sort, reverse)
    return CheckpointListing(checkpoints=ordered[:limit] if limit else ordered, total=len(ordered), where=where)


def files_of(client: "LoopsClient", checkpoint_id: str) -> list[CheckpointFile]:
    """Every file of a checkpoint (all pages), with clear errors for unknown ids and
    volume-backed checkpoints."""
    from baseten_loops_cli.api.errors import ApiError, NotFoundError

    try:
        return client.checkpoints.list_files(checkpoint_id)
    except NotFoundError:
        raise NotFound(
            f"no checkpoint {checkpoint_id!r}",
            hint="Name a checkpoint by id, bt:// URI or RUN:NAME; list them with `loops checkpoints list`.",
        ) from None
    except ApiError as exc:
        if exc.reason == "NOT_PRESIGNABLE":
            raise LoopsError(
                f"checkpoint {checkpoint_id} lives on a volume and has no download links",
                hint=f"`loops checkpoints source {checkpoint_id}` shows where its files are.",
            ) from None
        raise


class DownloadPlan(BaseModel):
    checkpoint_id: str
    label: str  # RUN:NAME, or the id
    dest: Path
    files: list[CheckpointFile]


def default_download_dir(cp: LoopsCheckpoint | None, checkpoint_id: str) -> Path:
    stem = f"{cp.run_id}-{cp.checkpoint_id}" if cp else checkpoint_id
    return Path(re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or checkpoint_id)


def plan_download(client: "LoopsClient", ref: str, output_dir: Path | None, target: str | None = None) -> DownloadPlan:
    """Which checkpoint, where to, and its files (an id with an explicit folder skips the
    lookup: the files route knows the id, or says it does not)."""
    parsed = parse_checkpoint_ref(ref, target)
    cp: LoopsCheckpoint | None = None
    if parsed.kind == "id" and output_dir is not None:
        checkpoint_id = parsed.id or ""
    else:
        cp = resolve_checkpoint(client, ref, target)
        checkpoint_id = cp.id
    label = display_name(cp) if cp else checkpoint_id
    files = files_of(client, checkpoint_id)
    if not files:
        raise LoopsError(f"checkpoint {label} has no files to download")
    dest = (output_dir or default_download_dir(cp, checkpoint_id)).expanduser()
    return DownloadPlan(checkpoint_id=checkpoint_id, label=label, dest=dest, files=files)


def download(
    client: "LoopsClient", plan: DownloadPlan, *, parallel: int = 8, force: bool = False, progress: "Progress | None" = None
) -> "DownloadResult":
    """Fetch the plan's files into its folder (parallel, resumable, links refreshed when they
    expire)."""
    from baseten_loops_cli.api.download import download_files

    def refresh() -> list[dict]:
        return [f.model_dump() for f in files_of(client, plan.checkpoint_id)]

    entries = [f.model_dump() for f in plan.files]
    return download_files(
        entries, plan.dest, checkpoint_id=plan.checkpoint_id, refresh=refresh, parallel=parallel, force=force, progress=progress
    )
