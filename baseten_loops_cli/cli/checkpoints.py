"""`loops checkpoints`: list, inspect, validate and download what runs saved.

A checkpoint is named by its id, its bt:// URI or RUN:NAME (add --target trainer|sampler when a
trainer and a sampler checkpoint share the name). `checkpoints list -o json` is
`{"checkpoints": [...]}` (ListLoopsCheckpointsResponse), as `baseten loops checkpoint list` prints.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state

if TYPE_CHECKING:
    from baseten_loops_cli.output.sink import Output

app = typer.Typer(
    help="List, inspect, validate and download checkpoints (by id, bt:// URI or RUN:NAME).",
    no_args_is_help=True,
)

CkptArg = Annotated[
    str,
    typer.Argument(
        help="Checkpoint: its id, bt:// URI, or RUN:NAME.",
        autocompletion=_complete.complete_checkpoint,
        show_default=False,
    ),
]
TargetOpt = Annotated[
    Optional[str],
    typer.Option("--target", "-t", help="sampler or trainer: which of two checkpoints sharing a name.", show_default=False),
]

SORT_KEYS = ("created", "name", "size", "target", "run")


def checkpoint_columns() -> list:
    from baseten_loops_cli.output.format import human_size

    return [
        ("ID", "id"),
        ("NAME", "checkpoint_id"),
        ("RUN", "run_id"),
        ("TARGET", "target"),
        ("TYPE", "checkpoint_type"),
        ("SIZE", lambda c: human_size(c.get("size_bytes"))),
        ("CREATED", "created_at"),
    ]


def _sort(cps: list[dict], sort: str, reverse: bool) -> list[dict]:
    keys = {
        "created": lambda c: c.get("created_at") or "",
        "name": lambda c: str(c.get("checkpoint_id") or ""),
        "size": lambda c: c.get("size_bytes") or 0,
        "target": lambda c: str(c.get("target") or ""),
        "run": lambda c: str(c.get("run_id") or ""),
    }
    # Newest (or largest) first by default; names, targets and runs A→Z.
    descending = sort in ("created", "size")
    ordered = sorted(cps, key=lambda c: c.get("created_at") or "", reverse=True)
    ordered = sorted(ordered, key=keys[sort], reverse=descending)
    return list(reversed(ordered)) if reverse else ordered


# ── list ──────────────────────────────────────────────────────────────────────────────────


@app.command("list")
def list_checkpoints(
    ctx: typer.Context,
    run_id: Annotated[
        Optional[str], typer.Option("--run-id", "--run", help="Checkpoints of this run.", autocompletion=_complete.complete_run)
    ] = None,
    base_model: Annotated[Optional[str], typer.Option("--base-model", "-m", help="Checkpoints of your runs of this base model.")] = None,
    uri: Annotated[Optional[str], typer.Option("--uri", help="The checkpoint at this bt:// URI.")] = None,
    target: TargetOpt = None,
    sort: Annotated[str, typer.Option("--sort", help=f"Sort by {', '.join(SORT_KEYS)}.")] = "created",
    reverse: Annotated[bool, typer.Option("--reverse", "-r", help="Reverse the order (default: newest first).")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="Show at most N (0 = all).")] = 0,
) -> None:
    """List checkpoints of a run, of a base model, at a URI, or of all your runs.

    Pick with --run-id, --base-model or --uri (at most one); with none of them, the checkpoints
    of all your runs are listed.

    -o json prints {"checkpoints": [...]} (LoopsCheckpoint objects).

    Examples:

      loops checkpoints list --run-id abc1234

      loops checkpoints list --base-model Qwen/Qwen3-8B --target sampler --sort size

      loops checkpoints list --run-id abc1234 -o json --jq '.checkpoints[] | select(.target != "trainer") | .checkpoint_id'
    """
    from baseten_loops_cli.cli._resolve import (
        all_checkpoints,
        checkpoints_of_run,
        exactly_one,
        list_checkpoints as api_list,
        parse_checkpoint_ref,
        parse_target,
    )
    from baseten_loops_cli.errors import UsageError

    selector = exactly_one(run_id=run_id, base_model=base_model, uri=uri)
    want_target = parse_target(target)
    if sort not in SORT_KEYS:
        raise UsageError(f"--sort must be one of {', '.join(SORT_KEYS)}, got {sort!r}")
    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    if selector is None:
        cps = all_checkpoints(client)
        where = ""
    elif selector[0] == "run_id":
        cps = checkpoints_of_run(client, run_id or "")
        where = f" for run {run_id}"
    elif selector[0] == "base_model":
        cps = api_list(client, base_model=base_model)
        where = f" for {base_model}"
    else:
        ref = parse_checkpoint_ref(uri or "")
        if ref.kind != "uri":
            raise UsageError(f"--uri needs a bt:// URI, got {uri!r}", hint="Use --run-id for RUN:NAME lookups.")
        cps = api_list(client, checkpoint_path=ref.text)
        where = f" at {ref.text}"
    if want_target:
        cps = [c for c in cps if c.get("target") == want_target]
    cps = _sort(cps, sort, reverse)
    total = len(cps)
    if limit:
        cps = cps[:limit]
    scope = f"{want_target} " if want_target else ""
    out.emit(
        {"checkpoints": cps},
        rows=cps,
        columns=checkpoint_columns(),
        empty=f"No Loops {scope}checkpoints found{where}.",
        empty_hint=None if run_id or uri else "Runs save them with save_state / save_weights_for_sampler.",
    )
    if out.human and total > len(cps):
        out.hint(f"Showing {len(cps)} of {total} checkpoints; pass --limit 0 to see all.")


# ── describe ──────────────────────────────────────────────────────────────────────────────


@app.command("describe")
def describe(ctx: typer.Context, checkpoint: CkptArg, target: TargetOpt = None) -> None:
    """Show one checkpoint: name, run, target, base model, LoRA rank, size, URI.

    -o json prints the LoopsCheckpoint object with its `uri`.

    Examples:

      loops checkpoints describe abc1234:step-100

      loops checkpoints describe bt://loops:abc1234/sampler_weights/step-100 -o json
    """
    from baseten_loops_cli.cli._resolve import resolve_checkpoint, uri_of
    from baseten_loops_cli.output.format import human_size

    state = get_state(ctx)
    client = state.backend().client
    cp = resolve_checkpoint(client, checkpoint, target)
    doc = {**cp, "uri": uri_of(cp)}
    rank = (cp.get("lora_adapter_config") or {}).get("r")
    lora = cp.get("lora_config") or {}
    state.output.emit(
        doc,
        fields=[
            ("ID", "id"),
            ("Name", "checkpoint_id"),
            ("Run", "run_id"),
            ("Target", lambda c: f"{c.get('target')} ({'deployable, servable' if c.get('target') == 'sampler' else 'trainer state: resume training with it'})"),
            ("Type", "checkpoint_type"),
            ("Base Model", "base_model"),
            ("LoRA Rank", lambda c: rank),
            ("LoRA Targets", lambda c: ", ".join(lora.get("targets") or []) or None),
            ("Size", lambda c: f"{human_size(c.get('size_bytes'))} ({c.get('size_bytes'):,} bytes)" if c.get("size_bytes") is not None else None),
            ("Sync Status", "sync_status"),
            ("Policy Version", "policy_version"),
            ("Created", "created_at"),
            ("Expires", "expires_at"),
            ("URI", "uri"),
        ],
    )


# ── files ─────────────────────────────────────────────────────────────────────────────────


def _files(client, checkpoint_id: str) -> list[dict]:
    """Every file of a checkpoint (all pages), with clear errors for unknown ids and
    volume-backed checkpoints."""
    from baseten_loops_cli.api.errors import ApiError, NotFoundError
    from baseten_loops_cli.cli._resolve import NotFound, as_dict
    from baseten_loops_cli.errors import LoopsError

    try:
        return as_dict(client.checkpoints.list_files(checkpoint_id)) or []
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


@app.command("files")
def files(ctx: typer.Context, checkpoint: CkptArg, target: TargetOpt = None) -> None:
    """List a checkpoint's files with their sizes and short-lived download links.

    The links are presigned: fetch them without an Authorization header. -o json prints
    {"checkpoint_id", "files": [CheckpointFile...]}; -o jsonl one CheckpointFile per line.

    Examples:

      loops checkpoints files abc1234:step-100

      loops checkpoints files vL3pQrS8 -o jsonl | jq -r .url
    """
    from baseten_loops_cli.cli._resolve import checkpoint_id_of
    from baseten_loops_cli.output.format import human_size

    state = get_state(ctx)
    client = state.backend().client
    checkpoint_id, _ = checkpoint_id_of(client, checkpoint, target)
    entries = _files(client, checkpoint_id)
    state.output.emit(
        {"checkpoint_id": checkpoint_id, "files": entries},
        rows=entries,
        columns=[("NAME", "relative_file_name"), ("SIZE", lambda f: human_size(f.get("size_bytes"))), ("URL", "url")],
        id_key="relative_file_name",
        empty="No files found for this Loops checkpoint.",
    )


# ── validate / source ─────────────────────────────────────────────────────────────────────


@app.command("validate")
def validate(
    ctx: typer.Context,
    checkpoint: CkptArg,
    run_id: Annotated[
        Optional[str],
        typer.Option("--run-id", "--run", help="Check it against this run's base model and LoRA config.", autocompletion=_complete.complete_run),
    ] = None,
    target: TargetOpt = None,
) -> None:
    """Check that a sampler checkpoint can be served (optionally by a given run's sampler).

    Exits 0 when the backend accepts it, 1 with its reason when not.

    Examples:

      loops checkpoints validate bt://loops:abc1234/sampler_weights/step-100

      loops checkpoints validate abc1234:step-100 --run-id def5678
    """
    from baseten_loops_cli.api.errors import ApiError
    from baseten_loops_cli.cli._resolve import get_run, parse_checkpoint_ref, resolve_checkpoint, uri_of
    from baseten_loops_cli.errors import LoopsError

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    ref = parse_checkpoint_ref(checkpoint, target)
    if ref.kind == "uri":
        path = ref.text
    else:
        path = uri_of(resolve_checkpoint(client, checkpoint, target, prefer="sampler")) or ""
    if run_id:
        get_run(client, run_id)
    try:
        client.checkpoints.validate(path, run_id=run_id)
    except ApiError as exc:
        if exc.status in (401, 403):
            raise
        raise LoopsError(f"{path} cannot be served: {exc.detail or exc.message}", hint=exc.hint) from None
    who = f"by run {run_id}'s sampler" if run_id else "by a sampler"
    out.success(f"{path} is valid: it can be served {who}.")
    if not out.human:
        out.emit({"checkpoint_path": path, "run_id": run_id, "valid": True}, id_key="checkpoint_path")


@app.command("source")
def source(ctx: typer.Context, checkpoint: CkptArg, target: TargetOpt = None) -> None:
    """Show where a checkpoint's files are stored (object storage, or a volume).

    Examples:

      loops checkpoints source abc1234:step-100 -o json
    """
    from baseten_loops_cli.api.errors import NotFoundError
    from baseten_loops_cli.cli._resolve import NotFound, as_dict, checkpoint_id_of

    state = get_state(ctx)
    client = state.backend().client
    checkpoint_id, _ = checkpoint_id_of(client, checkpoint, target)
    try:
        src = as_dict(client.checkpoints.get_source(checkpoint_id))
    except NotFoundError:
        raise NotFound(f"no checkpoint {checkpoint_id!r}", hint="List them with `loops checkpoints list`.") from None
    kind = src.get("kind")
    state.output.emit(
        {"checkpoint_id": checkpoint_id, "source": src},
        id_key="checkpoint_id",
        fields=[
            ("Checkpoint", "checkpoint_id"),
            ("Kind", lambda d: f"{kind} (downloadable with `loops checkpoints download`)" if kind == "s3" else kind),
            ("Volume", "source.volume_ref"),
            ("Path", "source.path"),
        ],
    )


# ── download ──────────────────────────────────────────────────────────────────────────────


class _RichProgress:
    """The downloader's progress on a terminal: bytes, rate and ETA (stderr)."""

    def __init__(self, out: "Output", label: str):
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[files]}"),
            console=out.err_console,
            transient=False,
        )
        self._label = label
        self._task = None
        self._files_total = 0
        self._files_done = 0

    def __enter__(self) -> "_RichProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def start(self, *, total_bytes: int, completed_bytes: int, files: int) -> None:
        self._files_total = files
        self._task = self._progress.add_task(self._label, total=total_bytes or None, completed=completed_bytes, files=f"0/{files} files")

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, nbytes)

    def file_done(self, name: str) -> None:
        self._files_done += 1
        if self._task is not None:
            self._progress.update(self._task, files=f"{self._files_done}/{self._files_total} files")


def default_download_dir(cp: dict | None, checkpoint_id: str) -> Path:
    import re

    if cp:
        stem = f"{cp.get('run_id')}-{cp.get('checkpoint_id')}"
    else:
        stem = checkpoint_id
    return Path(re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or checkpoint_id)


@app.command("download")
def download(
    ctx: typer.Context,
    checkpoint: CkptArg,
    output_dir: Annotated[
        Optional[Path],
        typer.Option("--output-dir", "-O", help="Folder to download into (default: ./RUN-NAME).", show_default=False),
    ] = None,
    parallel: Annotated[int, typer.Option("--parallel", "-p", min=1, max=64, help="Files fetched at once.")] = 8,
    force: Annotated[bool, typer.Option("--force", help="Download into a folder that already has files (overwrites the checkpoint's files there).")] = False,
    target: TargetOpt = None,
) -> None:
    """Download a checkpoint's files into a folder, in parallel, resuming interrupted downloads.

    Files are written as NAME.part and renamed once their size checks out; running the same
    command again after a failure or Ctrl-C continues where it stopped. Expired links are
    fetched again. A folder that already has other files is refused unless --force.

    Examples:

      loops checkpoints download abc1234:step-100

      loops checkpoints download bt://loops:abc1234/sampler_weights/final -O ./adapter --parallel 16
    """
    from baseten_loops_cli.api.download import download_files
    from baseten_loops_cli.cli._resolve import display_name, parse_checkpoint_ref, resolve_checkpoint
    from baseten_loops_cli.output.format import human_duration, human_size

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    ref = parse_checkpoint_ref(checkpoint, target)
    cp: dict | None = None
    if ref.kind == "id" and output_dir is not None:
        checkpoint_id = ref.id or ""  # the files route knows it (or says it does not)
    else:  # a name to resolve, or the default folder needs the run and name
        cp = resolve_checkpoint(client, checkpoint, target)
        checkpoint_id = cp["id"]
    dest = (output_dir or default_download_dir(cp, checkpoint_id)).expanduser()
    label = display_name(cp) if cp else checkpoint_id
    entries = _files(client, checkpoint_id)
    if not entries:
        from baseten_loops_cli.errors import LoopsError

        raise LoopsError(f"checkpoint {label} has no files to download")

    def refresh() -> list[dict]:
        return _files(client, checkpoint_id)

    show_bar = out.streams.stderr_tty and not out.quiet
    if show_bar:
        with _RichProgress(out, label) as progress:
            result = download_files(entries, dest, checkpoint_id=checkpoint_id, refresh=refresh, parallel=parallel, force=force, progress=progress)
    else:
        result = download_files(entries, dest, checkpoint_id=checkpoint_id, refresh=refresh, parallel=parallel, force=force)
    doc: dict[str, Any] = {"checkpoint_id": checkpoint_id, "checkpoint": label, **result.to_json()}
    rate = f", {human_size(result.bytes_downloaded / result.seconds)}/s" if result.seconds > 0 and result.bytes_downloaded else ""
    resumed = ""
    if result.files_skipped or result.bytes_resumed:
        resumed = f"; resumed ({result.files_skipped} files already done, {human_size(result.bytes_resumed)} of partial files kept)"
    out.success(
        f"Downloaded {label} ({result.files} files, {human_size(result.bytes_total)}) to {dest} "
        f"in {human_duration(result.seconds) if result.seconds >= 1 else f'{result.seconds:.1f}s'}{rate}{resumed}."
    )
    if not out.human:
        out.emit(doc, id_key="path")
