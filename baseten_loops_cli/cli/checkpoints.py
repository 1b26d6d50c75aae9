"""`loops checkpoints`: list, inspect, validate, download and export what runs saved.

A checkpoint is named by its id, its bt:// URI or RUN:NAME (add --target trainer|sampler when a
trainer and a sampler checkpoint share the name). `checkpoints list -o json` is
`{"checkpoints": [...]}` (ListLoopsCheckpointsResponse), as `baseten loops checkpoint list` prints.
"""

from pathlib import Path
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state

app = typer.Typer(
    help="List, inspect, validate, download and export checkpoints (by id, bt:// URI or RUN:NAME).",
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
        ("SIZE", lambda c: human_size(c.size_bytes)),
        ("CREATED", "created_at"),
    ]


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
    from baseten_loops_cli.cli._args import exactly_one
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.services.checkpoints import list_checkpoints as list_service
    from baseten_loops_cli.services.resolve import parse_target

    exactly_one(run_id=run_id, base_model=base_model, uri=uri)
    want_target = parse_target(target)
    if sort not in SORT_KEYS:
        raise UsageError(f"--sort must be one of {', '.join(SORT_KEYS)}, got {sort!r}")
    state = get_state(ctx)
    listing = list_service(state.backend().client, run_id=run_id, base_model=base_model, uri=uri, target=want_target,
                           sort=sort, reverse=reverse, limit=limit)
    cps = listing.checkpoints
    scope = f"{want_target} " if want_target else ""
    state.output.emit(
        {"checkpoints": cps},
        rows=cps,
        columns=checkpoint_columns(),
        empty=f"No Loops {scope}checkpoints found{listing.where}.",
        empty_hint=None if run_id or uri else "Runs save them with save_state / save_weights_for_sampler.",
        hint=f"Showing {len(cps)} of {listing.total} checkpoints; pass --limit 0 to see all." if listing.total > len(cps) else None,
    )


# ── describe ──────────────────────────────────────────────────────────────────────────────


@app.command("describe")
def describe(ctx: typer.Context, checkpoint: CkptArg, target: TargetOpt = None) -> None:
    """Show one checkpoint: name, run, target, base model, LoRA rank, size, URI.

    -o json prints the LoopsCheckpoint object with its `uri`.

    Examples:

      loops checkpoints describe abc1234:step-100

      loops checkpoints describe bt://loops:abc1234/sampler_weights/step-100 -o json
    """
    from baseten_loops_cli.output.format import human_size
    from baseten_loops_cli.services.resolve import resolve_checkpoint, uri_of

    state = get_state(ctx)
    cp = resolve_checkpoint(state.backend().client, checkpoint, target)
    doc = {**cp.model_dump(), "uri": uri_of(cp)}
    state.output.emit(
        doc,
        fields=[
            ("ID", "id"),
            ("Name", "checkpoint_id"),
            ("Run", "run_id"),
            ("Target", lambda d: f"{cp.target} ({'deployable, servable' if cp.target == 'sampler' else 'trainer state: resume training with it'})"),
            ("Type", "checkpoint_type"),
            ("Base Model", "base_model"),
            ("LoRA Rank", "lora_adapter_config.r"),
            ("LoRA Targets", lambda d: ", ".join(cp.lora_config.targets) if cp.lora_config and cp.lora_config.targets else None),
            ("Size", lambda d: f"{human_size(cp.size_bytes)} ({cp.size_bytes:,} bytes)"),
            ("Sync Status", "sync_status"),
            ("Policy Version", "policy_version"),
            ("Created", "created_at"),
            ("Expires", "expires_at"),
            ("URI", "uri"),
        ],
    )


# ── files ─────────────────────────────────────────────────────────────────────────────────


@app.command("files")
def files(ctx: typer.Context, checkpoint: CkptArg, target: TargetOpt = None) -> None:
    """List a checkpoint's files with their sizes and short-lived download links.

    The links are presigned: fetch them without an Authorization header. -o json prints
    {"checkpoint_id", "files": [CheckpointFile...]}; -o jsonl one CheckpointFile per line.

    Examples:

      loops checkpoints files abc1234:step-100

      loops checkpoints files vL3pQrS8 -o jsonl | jq -r .url
    """
    from baseten_loops_cli.output.format import human_size
    from baseten_loops_cli.services.checkpoints import files_of
    from baseten_loops_cli.services.resolve import checkpoint_id_of

    state = get_state(ctx)
    client = state.backend().client
    checkpoint_id, _ = checkpoint_id_of(client, checkpoint, target)
    entries = files_of(client, checkpoint_id)
    state.output.emit(
        {"checkpoint_id": checkpoint_id, "files": entries},
        rows=entries,
        columns=[("NAME", "relative_file_name"), ("SIZE", lambda f: human_size(f.size_bytes)), ("URL", "url")],
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
    from baseten_loops_cli.errors import LoopsError
    from baseten_loops_cli.services.resolve import get_run, parse_checkpoint_ref, resolve_checkpoint, uri_of

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
    out.emit({"checkpoint_path": path, "run_id": run_id, "valid": True}, id_key="checkpoint_path", text=[])


@app.command("source")
def source(ctx: typer.Context, checkpoint: CkptArg, target: TargetOpt = None) -> None:
    """Show where a checkpoint's files are stored (object storage, or a volume).

    Examples:

      loops checkpoints source abc1234:step-100 -o json
    """
    from baseten_loops_cli.api.errors import NotFoundError
    from baseten_loops_cli.services.resolve import NotFound, checkpoint_id_of

    state = get_state(ctx)
    client = state.backend().client
    checkpoint_id, _ = checkpoint_id_of(client, checkpoint, target)
    try:
        src = client.checkpoints.get_source(checkpoint_id)
    except NotFoundError:
        raise NotFound(f"no checkpoint {checkpoint_id!r}", hint="List them with `loops checkpoints list`.") from None
    kind = src.kind
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
    from baseten_loops_cli.output.format import human_duration, human_size
    from baseten_loops_cli.output.progress import average_rate
    from baseten_loops_cli.services import checkpoints as service

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    plan = service.plan_download(client, checkpoint, output_dir, target)
    with out.progress(plan.label) as progress:
        result = service.download(client, plan, parallel=parallel, force=force, progress=progress)
    rate = f", {average_rate(result.bytes_downloaded, result.seconds)}" if result.seconds > 0 and result.bytes_downloaded else ""
    resumed = ""
    if result.files_skipped or result.bytes_resumed:
        resumed = f"; resumed ({result.files_skipped} files already done, {human_size(result.bytes_resumed)} of partial files kept)"
    took = human_duration(result.seconds) if result.seconds >= 1 else f"{result.seconds:.1f}s"
    out.success(f"Downloaded {plan.label} ({result.files} files, {human_size(result.bytes_total)}) to {plan.dest} in {took}{rate}{resumed}.")
    out.emit({"checkpoint_id": plan.checkpoint_id, "checkpoint": plan.label, **result.to_json()}, id_key="path", text=[])


# ── export ────────────────────────────────────────────────────────────────────────────────


@app.command("export")
def export(
    ctx: typer.Context,
    checkpoint: CkptArg,
    output_dir: Annotated[Path, typer.Option("--output-dir", "-O", help="Folder to write (it must not exist, unless --force).", show_default=False)],
    fmt: Annotated[
        Optional[str],
        typer.Option("--format", "-f", help="peft (the adapter; default), hf (merged transformers folder) or gguf (merged, one file).", show_default=False),
    ] = None,
    merge: Annotated[bool, typer.Option("--merge", help="Merge the adapter into the base (the same as --format hf).")] = False,
    dtype: Annotated[str, typer.Option("--dtype", help="float32, float16 or bfloat16.")] = "float32",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
    target: TargetOpt = None,
    base_path: Annotated[
        Optional[Path],
        typer.Option("--base-path", help="peft: name this local base-model folder in adapter_config.json, so the adapter loads offline.", show_default=False),
    ] = None,
) -> None:
    """Export a sampler checkpoint as a PEFT adapter, a merged HF model or a GGUF file.

    The checkpoint is downloaded (local backend or a Baseten profile), loaded on its base
    model, written, then reloaded and checked against base + adapter (the max abs difference
    of a forward pass is reported). Needs the local extra (torch, peft) and the base model's files
    (`loops server pull-model NAME`). A failure leaves no partial output. See README, "Export".

    Examples:

      loops checkpoints export abc1234:final -O ./adapter

      loops checkpoints export abc1234:final -O ./merged --merge --dtype bfloat16

      loops checkpoints export abc1234:final -O ./gguf --format gguf
    """
    import shlex

    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.export import check_options, export_checkpoint

    if base_path is not None and (fmt or ("hf" if merge else "peft")) != "peft":
        raise UsageError("--base-path names the base of a peft adapter; merged exports carry the base themselves",
                         hint="Drop --base-path, or export with --format peft.")
    if merge and fmt == "peft":
        raise UsageError("--merge writes a merged model; --format peft writes the adapter alone", hint="Drop one of them (--merge means --format hf).")
    fmt = fmt or ("hf" if merge else "peft")
    check_options(fmt, dtype)
    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    # Rebuilt from the parsed options, not argv: global options may carry secrets.
    command = shlex.join(["loops", "checkpoints", "export", checkpoint, "-O", str(output_dir), "--format", fmt, "--dtype", dtype]
                         + (["--target", target] if target else [])
                         + (["--base-path", str(base_path)] if base_path else []))
    with out.progress(f"export {checkpoint}") as progress:
        result = export_checkpoint(client, checkpoint, output_dir, fmt=fmt, dtype=dtype, force=force, target=target,
                                   progress=progress, command=command, base_path=str(base_path) if base_path else None)
    out.success(f"Exported {result.checkpoint} as {fmt} ({dtype}) to {result.path}; reloaded and verified "
                f"(max abs diff {result.max_abs_diff:.3g}).")
    if result.base_path and base_path is not None:  # already named: suggesting --base-path again would be wrong
        out.info(f"Base model files: {result.base_path}, named in adapter_config.json (--base-path), so the adapter "
                 "loads offline while that folder is there.")
    elif result.base_path:
        out.info(f"Base model files: {result.base_path} (load offline from there, or pass --base-path to name it in "
                 "adapter_config.json; see the README.md written beside the adapter).")
    out.emit(result.to_json(), id_key="path", text=[])
