"""`loops samplers`: the inference servers that sample from runs and checkpoints.

A *paired* sampler belongs to a run and serves its latest weights; a *standalone* sampler
serves a base model or one sampler checkpoint. `samplers list -o json` is
`{"samplers": [...]}` (LoopsSampler objects).
"""

from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state

app = typer.Typer(
    help="List, inspect, create and deactivate samplers (paired with a run, or standalone).",
    no_args_is_help=True,
)

SamplerArg = Annotated[
    str,
    typer.Argument(help="Sampler id (see `loops samplers list`).", autocompletion=_complete.complete_sampler, show_default=False),
]


def _serves(s: dict) -> str:
    if s.get("model_path"):
        return str(s["model_path"])
    return str(s.get("base_model") or "")


def sampler_columns(org: bool) -> list:
    from baseten_loops_cli.cli._resolve import status_name

    cols: list = [("ID", "id"), ("RUN", lambda s: s.get("run_id") or "standalone")]
    if org:
        cols.append(("OWNER", "user.email"))
    cols += [
        ("SERVES", _serves),
        ("STATUS", lambda s: status_name(s)),
        ("KIND", lambda s: "serverless" if not s.get("model_id") else "dedicated"),
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
    from baseten_loops_cli.cli._resolve import SAMPLER_TERMINAL, as_dict, status_name

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    samplers = as_dict(client.samplers.list(scope="org" if org else None)) or []
    if run_id:
        samplers = [s for s in samplers if s.get("run_id") == run_id]
    hidden = 0
    if not all_:
        shown = [s for s in samplers if status_name(s) not in SAMPLER_TERMINAL]
        hidden = len(samplers) - len(shown)
        samplers = shown
    samplers.sort(key=lambda s: s.get("created_at") or "", reverse=not reverse)
    out.emit(
        {"samplers": samplers},
        rows=samplers,
        columns=sampler_columns(org),
        empty="No Loops samplers found." if all_ else "No active Loops samplers found. Pass --all to include inactive ones.",
    )
    if out.human and samplers and hidden:
        out.hint(f"{hidden} inactive sampler{'s' if hidden != 1 else ''} hidden; pass --all to show {'them' if hidden != 1 else 'it'}.")


def _sampler_fields() -> list:
    from baseten_loops_cli.cli._resolve import status_name

    return [
        ("ID", "id"),
        ("Status", lambda s: status_name(s)),
        ("Run", lambda s: s.get("run_id") or "standalone"),
        ("Serves", _serves),
        ("Base Model", "base_model"),
        ("Kind", lambda s: "serverless (shared endpoint)" if not s.get("model_id") else "dedicated"),
        ("Model", "model_id"),
        ("Deployment", "deployment_id"),
        ("Instance", lambda s: (s.get("instance_type") or {}).get("name")),
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
    from baseten_loops_cli.cli._resolve import get_sampler

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
    from baseten_loops_cli.cli._resolve import as_dict, exactly_one, get_run, resolve_checkpoint, uri_of
    from baseten_loops_cli.errors import UsageError

    chosen = exactly_one(base_model=base_model, run_id=run_id, checkpoint=checkpoint)
    if chosen is None:
        raise UsageError("say what the sampler serves", hint="Pass one of --base-model, --run-id or --checkpoint.")
    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    body: dict = {"max_seq_length": max_seq_len, "num_replicas": replicas}
    if run_id:
        run = get_run(client, run_id)
        body["run_id"] = run["id"]
        body["session_id"] = run.get("session_id")
        what = f"run {run['id']}"
    elif checkpoint:
        cp = resolve_checkpoint(client, checkpoint, prefer="sampler")
        if cp.get("target") != "sampler":
            raise UsageError(
                f"{checkpoint} is trainer state; samplers serve sampler weights",
                hint=f"Pick a sampler checkpoint: loops checkpoints list --run-id {cp.get('run_id')} --target sampler",
            )
        body["model_path"] = uri_of(cp)
        what = str(body["model_path"])
    else:
        body["base_model"] = base_model
        what = str(base_model)
    if not body.get("session_id"):
        body["session_id"] = client.sessions.create().id
    sampler = as_dict(client.samplers.create({k: v for k, v in body.items() if v is not None}))
    _complete.invalidate("samplers")
    out.success(f"Sampler {sampler['id']} serves {what}.")
    out.emit(sampler, fields=_sampler_fields())


@app.command("deactivate")
def deactivate(
    ctx: typer.Context,
    sampler_ids: Annotated[
        list[str], typer.Argument(help="Sampler ids.", autocompletion=_complete.complete_sampler, show_default=False)
    ],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (needed without a terminal).")] = False,
) -> None:
    """Deactivate samplers: they stop serving. Checkpoints and runs are not touched.

    Examples:

      loops samplers deactivate smp1234 --yes
    """
    from baseten_loops_cli.cli._resolve import SAMPLER_TERMINAL, as_dict, confirm, get_sampler, status_name

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    samplers = [get_sampler(client, sid.strip()) for sid in dict.fromkeys(sampler_ids) if sid.strip()]
    todo = []
    for s in samplers:
        if status_name(s) in SAMPLER_TERMINAL:
            out.info(f"Sampler {s['id']} is already {status_name(s)}; skipping it.")
        else:
            todo.append(s)
    if not todo:
        if not out.human:
            out.emit([], rows=[], columns=[("ID", "id")])
        return
    paired = [s for s in todo if s.get("run_id")]
    names = ", ".join(f"{s['id']} ({_serves(s)})" for s in todo)
    question = f"Deactivate {'sampler' if len(todo) == 1 else f'{len(todo)} samplers'} {names}? It stops serving; checkpoints stay."
    if paired:
        question += f" Run {', '.join(s['run_id'] for s in paired)} keeps training; sampling from it needs a new sampler."
    confirm(out, question, yes=yes, action="deactivating " + (f"sampler {todo[0]['id']}" if len(todo) == 1 else f"{len(todo)} samplers"))
    results = []
    for s in todo:
        results.append(as_dict(client.samplers.deactivate(s["id"])) or {"id": s["id"]})
        out.success(f"Deactivated sampler {s['id']}.")
    _complete.invalidate("samplers")
    if not out.human:
        out.emit(results, rows=results, columns=[("ID", "id"), ("BASE MODEL", "base_model")])
