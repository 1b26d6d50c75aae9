"""`loops samplers`: the inference servers that sample from runs and checkpoints.

A *paired* sampler belongs to a run and serves its latest weights; a *standalone* sampler
serves a base model or one sampler checkpoint. `samplers list -o json` is
`{"samplers": [...]}` (LoopsSampler objects).
"""

from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._args import YesOpt, id_argument
from baseten_loops_cli.cli._state import get_state

app = typer.Typer(
    help="List, inspect, create and deactivate samplers (paired with a run, or standalone).",
    no_args_is_help=True,
)

SamplerArg = Annotated[str, id_argument("Sampler id (see `loops samplers list`).", _complete.complete_sampler)]


def _serves(s) -> str:
    """What a sampler serves: its checkpoint's URI, else its base model."""
    return str(s.model_path or s.base_model)


def _run_of(s) -> str:
    return s.run_id or "standalone"


def sampler_columns(org: bool) -> list:
    cols: list = [("ID", "id"), ("RUN", _run_of)]
    if org:
        cols.append(("OWNER", "user.email"))
    cols += [
        ("SERVES", _serves),
        ("STATUS", "status.name"),
        ("KIND", lambda s: "serverless" if s.is_serverless else "dedicated"),
        ("CREATED", "created_at"),
    ]
    return cols


@app.command("list")
def list_samplers(
    ctx: typer.Context,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include INACTIVE and failed samplers.")] = False,
    org: Annotated[bool, typer.Option("--org", help="Samplers of the whole organization (adds OWNER).")] = False,
    run_id: Annotated[Optional[str], typer.Option("--run-id", "--run", help="Only the sampler paired with this run.", autocompletion=_complete.complete_run)] = None,
    reverse: Annotated[bool, typer.Option("--reverse", "-r", help="Oldest first (default: newest first).")] = False,
) -> None:
    """List samplers, newest first; inactive ones are hidden unless --all.

    Examples:

      loops samplers list

      loops samplers list --all -o json --jq '.samplers[].id'
    """
    from baseten_loops_cli.cli.runs import hidden_hint
    from baseten_loops_cli.services.resolve import created_key, sampler_is_terminal

    state = get_state(ctx)
    out = state.output
    samplers = state.backend().client.samplers.list(scope="org" if org else None)
    if run_id:
        samplers = [s for s in samplers if s.run_id == run_id]
    shown = samplers if all_ else [s for s in samplers if not sampler_is_terminal(s)]
    hidden = len(samplers) - len(shown)
    samplers = sorted(shown, key=created_key, reverse=not reverse)
    out.emit(
        {"samplers": samplers},
        rows=samplers,
        columns=sampler_columns(org),
        empty="No Loops samplers found." if all_ else "No active Loops samplers found. Pass --all to include inactive ones.",
    )
    if samplers and hidden:
        out.hint(hidden_hint(hidden, "inactive sampler"))


def _sampler_fields() -> list:
    return [
        ("ID", "id"),
        ("Status", "status.name"),
        ("Run", _run_of),
        ("Serves", _serves),
        ("Base Model", "base_model"),
        ("Kind", lambda s: "serverless (shared endpoint)" if s.is_serverless else "dedicated"),
        ("Model", "model_id"),
        ("Deployment", "deployment_id"),
        ("Instance", "instance_type.name"),
        ("Nodes", "node_count"),
        ("Policy Version", "policy_version"),
        ("Base URL", "base_url"),
        ("Owner", "user.email"),
        ("Created", "created_at"),
    ]


@app.command("describe")
def describe(ctx: typer.Context, sampler_id: SamplerArg) -> None:
    """Show a sampler: what it serves, its status, endpoint and deployment.

    Examples:

      loops samplers describe smp1234

      loops samplers describe smp1234 -o json --jq .base_url
    """
    from baseten_loops_cli.services.resolve import get_sampler

    state = get_state(ctx)
    sampler = get_sampler(state.backend().client, sampler_id)
    state.output.emit(sampler, fields=_sampler_fields())


@app.command("create")
def create(
    ctx: typer.Context,
    base_model: Annotated[Optional[str], typer.Option("--base-model", "-m", help="Serve this base model (standalone).")] = None,
    run_id: Annotated[
        Optional[str], typer.Option("--run-id", "--run", help="The sampler paired with this run (returns it if it exists).", autocompletion=_complete.complete_run)
    ] = None,
    checkpoint: Annotated[
        Optional[str],
        typer.Option("--checkpoint", "-c", help="Serve this sampler checkpoint (id, bt:// URI or RUN:NAME).", autocompletion=_complete.complete_checkpoint),
    ] = None,
    max_seq_len: Annotated[Optional[int], typer.Option("--max-seq-len", min=1, help="Longest prompt + completion to serve.")] = None,
    replicas: Annotated[Optional[int], typer.Option("--replicas", min=1, help="Sampler replicas.")] = None,
) -> None:
    """Create a sampler for a base model, a run (its paired sampler) or a sampler checkpoint.

    Exactly one of --base-model, --run-id or --checkpoint. -o json prints the LoopsSampler.

    Examples:

      loops samplers create --checkpoint abc1234:step-100

      loops samplers create --run-id abc1234 -q

      loops samplers create --base-model Qwen/Qwen3-8B --max-seq-len 8192
    """
    from baseten_loops_cli.cli._args import exactly_one
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.services.sampling import create_sampler

    chosen = exactly_one(base_model=base_model, run_id=run_id, checkpoint=checkpoint)
    if chosen is None:
        raise UsageError("say what the sampler serves", hint="Pass one of --base-model, --run-id or --checkpoint.")
    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    sampler, what = create_sampler(client, base_model=base_model, run_id=run_id, checkpoint=checkpoint,
                                   max_seq_len=max_seq_len, replicas=replicas)
    _complete.invalidate("samplers")
    out.success(f"Sampler {sampler.id} serves {what}.")
    out.emit(sampler, fields=_sampler_fields())


@app.command("deactivate")
def deactivate(
    ctx: typer.Context,
    sampler_ids: Annotated[list[str], id_argument("Sampler ids.", _complete.complete_sampler)],
    yes: YesOpt = False,
) -> None:
    """Deactivate samplers: they stop serving. Checkpoints and runs are not touched.

    Examples:

      loops samplers deactivate smp1234 --yes
    """
    from baseten_loops_cli.cli._deactivate import deactivate_command
    from baseten_loops_cli.services.runs import deactivate_samplers

    def question(todo: list) -> str:
        names = ", ".join(f"{s.id} ({_serves(s)})" for s in todo)
        text = f"Deactivate {'sampler' if len(todo) == 1 else f'{len(todo)} samplers'} {names}? It stops serving; checkpoints stay."
        paired = [s.run_id for s in todo if s.run_id]
        if paired:
            text += f" Run {', '.join(paired)} keeps training; sampling from it needs a new sampler."
        return text

    deactivate_command(ctx, sampler_ids, yes=yes, noun="sampler", deactivate_many=deactivate_samplers, question=question,
                       skipped=lambda s: f"Sampler {s.id} is already {s.status_name}; skipping it.",
                       done=lambda s: f"Deactivated sampler {s.id}.")
