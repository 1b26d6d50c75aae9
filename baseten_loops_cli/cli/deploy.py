"""`loops deploy`: serve sampler checkpoints behind an OpenAI-compatible endpoint.

``loops deploy CKPT... --model-name NAME`` is ``loops deploy create``: ``cli.main`` inserts
``create`` when the word after ``deploy`` is not one of :data:`SUBCOMMANDS`. Requests pick a
deployed checkpoint by its name in the ``model`` field (as on Baseten).

Listing: no Loops route lists checkpoint deployments (and Baseten's model list holds every model
of the workspace), so ``deploy list`` shows the deployments this machine created with
``loops deploy`` (recorded in the state dir), each with its live status from the backend;
``describe`` and ``stop`` also take any ``MODEL_ID/DEPLOYMENT_ID``.
"""

from typing import Annotated, Optional

import click
import typer
from click.shell_completion import CompletionItem
from typer.core import TyperGroup

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._args import YesOpt
from baseten_loops_cli.cli._state import get_state

SUBCOMMANDS = ("create", "list", "describe", "stop")


class _DeployGroup(TyperGroup):
    """``loops deploy <TAB>`` offers checkpoint references (``RUN:NAME``) beside the subcommands:
    ``loops deploy CKPT`` is ``loops deploy create CKPT``, so a checkpoint may come next."""

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        results = super().shell_complete(ctx, incomplete)
        if not incomplete.startswith("-"):
            results += [CompletionItem(value, help=help_) for value, help_ in _complete.complete_checkpoint(ctx, incomplete)]
        return results


app = typer.Typer(
    cls=_DeployGroup,
    help="Deploy sampler checkpoints as an OpenAI-compatible endpoint; list, describe and stop deployments.\n\n"
    "`loops deploy CKPT... --model-name NAME` is short for `loops deploy create CKPT... --model-name NAME`.",
    no_args_is_help=True,
)

DeploymentArg = Annotated[
    str, typer.Argument(help="Deployment id, or MODEL_ID/DEPLOYMENT_ID.", show_default=False)
]


# ── create ────────────────────────────────────────────────────────────────────────────────


@app.command("create")
def create(
    ctx: typer.Context,
    checkpoints: Annotated[
        list[str],
        typer.Argument(
            help="Sampler checkpoints to serve (ids, bt:// URIs or RUN:NAME), all of one base model.",
            autocompletion=_complete.complete_checkpoint,
            show_default=False,
        ),
    ],
    model_name: Annotated[
        Optional[str], typer.Option("--model-name", help="Name of the deployed model (default: loops-RUN-NAME).")
    ] = None,
    instance_type: Annotated[
        Optional[str], typer.Option("--instance-type", help="Instance type id to serve on (required on Baseten).")
    ] = None,
    hf_secret: Annotated[
        Optional[str], typer.Option("--hf-secret", help="Name of the workspace secret holding a Hugging Face token (gated base models).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the checkpoints and print the request; deploy nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (a Baseten deployment is billable).")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the deployment is ACTIVE.")] = False,
) -> None:
    """Deploy sampler checkpoints as one OpenAI-compatible model.

    Requests choose a checkpoint by its name in the `model` field (or the base model by its name).
    Trainer checkpoints (trainer state) cannot be served and are refused. Prints the endpoint
    URL and a ready curl line. On Baseten a deployment is billable: you are asked first (pass
    --yes in scripts). On the local backend it is served by the local server at once.

    Examples:

      loops deploy abc1234:final --model-name my-assistant

      loops deploy abc1234:step-100 abc1234:step-200 --model-name sweep --instance-type H100 --yes --wait

      loops deploy bt://loops:abc1234/sampler_weights/final --dry-run
    """
    import json

    from baseten_loops_cli.services import deployments

    state = get_state(ctx)
    out = state.output
    backend = state.backend()
    plan = deployments.plan_deployment(
        backend, checkpoints, model_name=model_name, instance_type=instance_type, hf_secret=hf_secret, dry_run=dry_run
    )
    name, instance, listed = plan.request.model_name, plan.request.instance_type_id, plan.listed
    if dry_run:
        doc = deployments.dry_run(plan)
        out.emit(
            doc,
            id_key="dry_run",
            note=f"Would deploy {listed} ({plan.base_model}) as model {name!r} on {instance or '(no instance type)'}; "
            "nothing was created (--dry-run).",
            text=json.dumps(doc.request, indent=2).splitlines(),
        )
        return
    if backend.capabilities.billable:
        out.confirm(f"Deploy {listed} as model {name!r} on {instance}? This creates a billable deployment.", yes=yes, action=f"deploying {listed}")
    out.info(f"Deploying {listed} as model {name!r}...")
    info = deployments.deploy(backend, plan)
    if wait:
        try:
            info = deployments.wait_active(backend, info, on_status=out.info)
        except KeyboardInterrupt:
            out.info(f"Stopped waiting. Deployment {info.deployment_id} keeps coming up; check it with "
                     f"`loops deploy describe {info.deployment_id}`.")
            raise typer.Exit(130) from None
    out.success(f"Deployed {listed} as model {name!r}: model {info.model_id}, deployment {info.deployment_id}"
                + (f" ({info.status})." if info.status else "."))
    out.emit(
        info,
        id_key="deployment_id",
        text=[f"URL:  {info.url}", f"Try:  {info.curl}"],
        hint=f"Set \"model\" to a checkpoint name ({', '.join(plan.names)}) or to {plan.base_model} for the base model.",
    )


# ── list / describe / stop ────────────────────────────────────────────────────────────────


@app.command("list")
def list_deployments(
    ctx: typer.Context,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include stopped deployments.")] = False,
) -> None:
    """List checkpoint deployments with their status and endpoint.

    Examples:

      loops deploy list

      loops deploy list -o json --jq '.deployments[].url'
    """
    from baseten_loops_cli.services.deployments import STOPPED_STATUSES, list_deployments

    state = get_state(ctx)
    out = state.output
    rows = list_deployments(state.backend())
    shown = rows if all_ else [r for r in rows if r.status not in STOPPED_STATUSES]
    hidden = len(rows) - len(shown)
    out.emit(
        {"deployments": shown},
        rows=shown,
        columns=[
            ("DEPLOYMENT", "deployment_id"),
            ("MODEL", "model_id"),
            ("NAME", "model_name"),
            ("STATUS", "status"),
            ("CHECKPOINTS", lambda r: ", ".join(r.checkpoint_names) or None),
            ("CREATED", "created_at"),
        ],
        id_key="deployment_id",
        empty="No checkpoint deployments found." + ("" if all_ else " Pass --all to include stopped ones."),
        empty_hint="Deploy one with `loops deploy RUN:NAME --model-name NAME`.",
        hint="These are the checkpoint deployments made from this machine with `loops deploy`.",
    )
    if shown and hidden:
        out.hint(f"{hidden} stopped deployment{'s' if hidden != 1 else ''} hidden; pass --all to show {'them' if hidden != 1 else 'it'}.")


@app.command("describe")
def describe(ctx: typer.Context, deployment: DeploymentArg) -> None:
    """Show a checkpoint deployment: status, checkpoints, endpoint URL and a curl line.

    Examples:

      loops deploy describe qrpg2r0

      loops deploy describe wnpkzp03/qrpg2r0 -o json
    """
    from baseten_loops_cli.services.deployments import describe_deployment

    state = get_state(ctx)
    doc = describe_deployment(state.backend(), deployment)
    state.output.emit(
        doc,
        id_key="deployment_id",
        fields=[
            ("Deployment", "deployment_id"),
            ("Model", "model_id"),
            ("Name", "model_name"),
            ("Status", "status"),
            ("Base Model", "base_model"),
            ("Checkpoints", lambda d: ", ".join(doc.checkpoint_names) or None),
            ("Created", "created_at"),
            ("URL", "url"),
            ("Try", "curl"),
        ],
    )


@app.command("stop")
def stop(
    ctx: typer.Context,
    deployments: Annotated[list[str], typer.Argument(help="Deployment ids (or MODEL_ID/DEPLOYMENT_ID).", show_default=False)],
    yes: YesOpt = False,
) -> None:
    """Stop checkpoint deployments: they stop serving. The checkpoints stay.

    Examples:

      loops deploy stop qrpg2r0 --yes
    """
    from baseten_loops_cli.services.deployments import find_deployment, stop_deployments

    state = get_state(ctx)
    out = state.output
    backend = state.backend()
    targets = [find_deployment(backend, d) for d in dict.fromkeys(deployments)]
    listed = ", ".join(d + (f" ({row.model_name})" if row and row.model_name else "") for _, d, row in targets)
    out.confirm(f"Stop deployment{'s' if len(targets) > 1 else ''} {listed}? It stops serving; the checkpoints stay.",
                yes=yes, action=f"stopping {listed}")
    results = stop_deployments(backend.client, [(m, d) for m, d, _ in targets],
                               on_stopped=lambda d: out.success(f"Stopped deployment {d}."))
    out.emit(results, rows=results, id_key="deployment_id", text=[])
