"""`loops deploy`: serve sampler checkpoints behind an OpenAI-compatible endpoint.

``loops deploy CKPT... --model-name NAME`` is ``loops deploy create``: ``cli.main`` inserts
``create`` when the word after ``deploy`` is not one of :data:`SUBCOMMANDS`. Requests pick a
deployed checkpoint by its name in the ``model`` field (as on Baseten).

Listing: no Loops route lists checkpoint deployments (and Baseten's model list holds every model
of the workspace), so ``deploy list`` shows the deployments this machine created with
``loops deploy`` (recorded in the state dir), each with its live status from the backend;
``describe`` and ``stop`` also take any ``MODEL_ID/DEPLOYMENT_ID``.
"""

import json
import os
import time
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state

SUBCOMMANDS = ("create", "list", "describe", "stop")
RECORDS_FILE = "deployments.json"
# Deployment (DeploymentStatusV1) statuses that end a --wait.
FAILED_STATUSES = frozenset({"DEPLOY_FAILED", "BUILD_FAILED", "BUILD_STOPPED", "FAILED", "UNHEALTHY", "INACTIVE"})
LOCAL_INSTANCE_TYPE = "local-cpu"

app = typer.Typer(
    help="Deploy sampler checkpoints as an OpenAI-compatible endpoint; list, describe and stop deployments.\n\n"
    "`loops deploy CKPT... --model-name NAME` is short for `loops deploy create CKPT... --model-name NAME`.",
    no_args_is_help=True,
)

DeploymentArg = Annotated[
    str, typer.Argument(help="Deployment id, or MODEL_ID/DEPLOYMENT_ID.", show_default=False)
]


# ── records of what this machine deployed (backends without a listing route) ──────────────


def _records_path():
    from baseten_loops_cli.settings.paths import state_dir

    return state_dir() / RECORDS_FILE


def _load_records() -> list[dict]:
    try:
        data = json.loads(_records_path().read_text(encoding="utf-8"))
        return data if isinstance(data, list) else []
    except (OSError, ValueError):
        return []


def _save_record(record: dict) -> None:
    from baseten_loops_cli.settings.paths import ensure_private_dir

    records = [r for r in _load_records() if r.get("deployment_id") != record.get("deployment_id")]
    records.append(record)
    path = _records_path()
    try:
        ensure_private_dir(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(records, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # listing falls back to what the backend lists; nothing else depends on it


def _backend_key(backend) -> str:
    return f"{backend.profile_name}|{backend.base_url}"


# ── endpoint URL and curl line ────────────────────────────────────────────────────────────


def endpoint_url(backend, model_id: str, deployment_id: str, status_body: dict | None = None) -> str:
    """The OpenAI-compatible base URL (ending in ``/v1``) of a deployment."""
    from urllib.parse import urlsplit

    if status_body and status_body.get("base_url"):
        return f"{str(status_body['base_url']).rstrip('/')}/v1"
    if backend.kind == "local":
        return f"{backend.base_url}/deployments/{deployment_id}/v1"
    host = urlsplit(backend.base_url).hostname or "api.baseten.co"
    return f"https://model-{model_id}.{host}/deployment/{deployment_id}/sync/v1"


def _key_expr(backend) -> str:
    """How a shell gets the key, never the key itself."""
    if backend.key_source == "local-server":
        from baseten_loops_cli.settings.local_server import state_file

        return f"$(cat {state_file('token')})"
    return "$BASETEN_API_KEY"


def curl_line(backend, url: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64})
    return (
        f"curl -s {url}/chat/completions -H \"Authorization: Api-Key {_key_expr(backend)}\" "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


def _status_body(client, model_id: str, deployment_id: str) -> dict:
    from baseten_loops_cli.cli._resolve import as_dict

    return as_dict(client.models.deployment(model_id, deployment_id)) or {}


def _status_of(body: dict) -> str | None:
    status = body.get("status")
    if isinstance(status, dict):
        return status.get("name")
    return status


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
    from baseten_loops_cli.cli._resolve import confirm, display_name, resolve_checkpoint, uri_of
    from baseten_loops_cli.errors import UsageError

    state = get_state(ctx)
    out = state.output
    backend = state.backend()
    client = backend.client
    refs = list(dict.fromkeys(c.strip() for c in checkpoints if c.strip()))
    if not refs:
        raise UsageError("name at least one sampler checkpoint to deploy")
    cps = []
    for ref in refs:
        cp = resolve_checkpoint(client, ref, prefer="sampler")
        if cp.get("target") != "sampler":
            raise UsageError(
                f"{ref} is a trainer checkpoint (training state, with optimizer) and cannot be served",
                hint="Deploy sampler weights instead (saved with save_weights_for_sampler): "
                f"loops checkpoints list --run-id {cp.get('run_id')} --target sampler",
            )
        if all(c["id"] != cp["id"] for c in cps):  # the same checkpoint named twice is one
            cps.append(cp)
    models = sorted({str(c.get("base_model")) for c in cps})
    if len(models) > 1:
        raise UsageError(f"the checkpoints were trained on different base models ({', '.join(models)})", hint="A deployment serves one base model; deploy them separately.")
    names = [c.get("checkpoint_id") for c in cps]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UsageError(
            f"two of the checkpoints are named {dupes[0]!r} (from different runs); requests pick one by name",
            hint="Deploy them separately.",
        )
    if backend.kind == "local":
        instance = instance_type or LOCAL_INSTANCE_TYPE
    elif not instance_type and not dry_run:
        raise UsageError("--instance-type is required on a Baseten profile", hint="Pass the id of the instance type to serve on, e.g. --instance-type H100.")
    else:
        instance = instance_type or ""
    name = model_name or _default_name(cps[0])
    request = {
        "checkpoint_ids": [c["id"] for c in cps],
        "model_name": name,
        "instance_type_id": instance,
        "hf_secret_name": hf_secret,
    }
    listed = ", ".join(display_name(c) for c in cps)
    if dry_run:
        doc = {"dry_run": True, "request": {k: v for k, v in request.items() if v is not None}, "checkpoints": [{**c, "uri": uri_of(c)} for c in cps]}
        if out.human:
            out.info(f"Would deploy {listed} ({models[0]}) as model {name!r} on {instance or '(no instance type)'}; nothing was created (--dry-run).")
            out.streams.stdout.write(json.dumps(doc["request"], indent=2) + "\n")
            out.streams.stdout.flush()
        else:
            out.emit(doc, id_key="dry_run")
        return
    if backend.kind != "local":
        confirm(out, f"Deploy {listed} as model {name!r} on {instance}? This creates a billable deployment.", yes=yes, action=f"deploying {listed}")
    out.info(f"Deploying {listed} as model {name!r}...")
    resp = client.checkpoints.deploy(request["checkpoint_ids"], model_name=name, instance_type_id=instance, hf_secret_name=hf_secret)
    model_id, deployment_id = resp.model_id, resp.deployment_id
    record = {
        "backend": _backend_key(backend),
        "model_id": model_id,
        "deployment_id": deployment_id,
        "model_name": name,
        "base_model": models[0],
        "checkpoints": [{"id": c["id"], "name": c.get("checkpoint_id"), "run_id": c.get("run_id"), "uri": uri_of(c)} for c in cps],
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _save_record(record)  # first: `deploy list` knows it even if the wait below is interrupted
    status_body: dict = {}
    try:
        status_body = _status_body(client, model_id, deployment_id)
    except Exception:  # noqa: BLE001 - the deployment exists; its status is a nicety
        status_body = {}
    status = _status_of(status_body)
    if wait:
        try:
            status_body = _wait_active(out, client, model_id, deployment_id)
        except KeyboardInterrupt:
            out.info(f"Stopped waiting. Deployment {deployment_id} keeps coming up; check it with "
                     f"`loops deploy describe {deployment_id}`.")
            raise typer.Exit(130) from None
        status = _status_of(status_body)
    url = endpoint_url(backend, model_id, deployment_id, status_body)
    doc = {**{k: v for k, v in record.items() if k != "backend"}, "status": status, "url": url,
           "curl": curl_line(backend, url, str(cps[0].get("checkpoint_id")))}
    out.success(f"Deployed {listed} as model {name!r}: model {model_id}, deployment {deployment_id}" + (f" ({status})." if status else "."))
    if out.human:
        out.streams.stdout.write(f"URL:  {url}\n")
        out.streams.stdout.write(f"Try:  {doc['curl']}\n")
        out.streams.stdout.flush()
        out.hint(f"Set \"model\" to a checkpoint name ({', '.join(str(n) for n in names)}) or to {models[0]} for the base model.")
    else:
        out.emit(doc, id_key="deployment_id")


def _default_name(cp: dict) -> str:
    import re

    raw = f"loops-{cp.get('run_id')}-{cp.get('checkpoint_id')}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw)[:255]


def _wait_active(out, client, model_id: str, deployment_id: str, interval: float = 2.0) -> dict:
    from baseten_loops_cli.errors import LoopsError

    last = None
    while True:
        body = _status_body(client, model_id, deployment_id)
        status = _status_of(body)
        if status != last:
            out.info(f"Deployment {deployment_id}: {status}")
            last = status
        if status == "ACTIVE":
            return body
        if status in FAILED_STATUSES:
            raise LoopsError(f"deployment {deployment_id} is {status}", hint=f"See `loops deploy describe {model_id}/{deployment_id}`.")
        time.sleep(interval)


# ── list / describe / stop ────────────────────────────────────────────────────────────────


def _listed(state) -> list[dict]:
    """Checkpoint deployments made from this machine with ``loops deploy`` (no Loops route lists
    them; Baseten's model list holds every model of the workspace), each with its live status
    from the backend."""
    from baseten_loops_cli.api.errors import NotFoundError

    backend = state.backend()
    rows: list[dict] = []
    for rec in _load_records():
        if rec.get("backend") != _backend_key(backend):
            continue
        try:
            body = _status_body(backend.client, rec["model_id"], rec["deployment_id"])
            status = _status_of(body)
        except NotFoundError:
            body, status = {}, "DELETED"
        row = {k: v for k, v in rec.items() if k != "backend"}
        row.update(status=status, url=endpoint_url(backend, rec["model_id"], rec["deployment_id"], body))
        rows.append(row)
    rows.sort(key=lambda r: r.get("created_at") or "", reverse=True)
    return rows


def _checkpoint_names(row: dict) -> str | None:
    cps = row.get("checkpoints") or []
    names = [c.get("name") or c.get("checkpoint_id") for c in cps if isinstance(c, dict)]
    return ", ".join(str(n) for n in names if n) or None


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
    state = get_state(ctx)
    out = state.output
    rows = _listed(state)
    hidden = 0
    if not all_:
        shown = [r for r in rows if r.get("status") not in ("INACTIVE", "DELETED")]
        hidden = len(rows) - len(shown)
        rows = shown
    out.emit(
        {"deployments": rows},
        rows=rows,
        columns=[
            ("DEPLOYMENT", "deployment_id"),
            ("MODEL", "model_id"),
            ("NAME", "model_name"),
            ("STATUS", "status"),
            ("CHECKPOINTS", _checkpoint_names),
            ("CREATED", "created_at"),
        ],
        id_key="deployment_id",
        empty="No checkpoint deployments found." + ("" if all_ else " Pass --all to include stopped ones."),
        empty_hint="Deploy one with `loops deploy RUN:NAME --model-name NAME`.",
    )
    if out.human and rows and hidden:
        out.hint(f"{hidden} stopped deployment{'s' if hidden != 1 else ''} hidden; pass --all to show {'them' if hidden != 1 else 'it'}.")
    if out.human and rows:
        out.hint("These are the checkpoint deployments made from this machine with `loops deploy`.")


def _find(state, ref: str) -> tuple[str, str, dict | None]:
    """(model_id, deployment_id, known row) for ``DEPLOYMENT`` or ``MODEL/DEPLOYMENT``."""
    from baseten_loops_cli.cli._resolve import NotFound, did_you_mean, suggest

    ref = ref.strip()
    if "/" in ref:
        model_id, _, deployment_id = ref.partition("/")
        return model_id, deployment_id, None
    rows = _listed(state)
    for row in rows:
        if row.get("deployment_id") == ref or row.get("model_id") == ref:
            return row["model_id"], row["deployment_id"], row
    ids = [r.get("deployment_id") for r in rows]
    raise NotFound(
        f"no checkpoint deployment {ref!r}",
        hint=f"{did_you_mean(suggest(ref, ids))}List them with `loops deploy list --all`, or name one as MODEL_ID/DEPLOYMENT_ID.",
    )


@app.command("describe")
def describe(ctx: typer.Context, deployment: DeploymentArg) -> None:
    """Show a checkpoint deployment: status, checkpoints, endpoint URL and a curl line.

    Examples:

      loops deploy describe qrpg2r0

      loops deploy describe wnpkzp03/qrpg2r0 -o json
    """
    from baseten_loops_cli.api.errors import NotFoundError
    from baseten_loops_cli.cli._resolve import NotFound

    state = get_state(ctx)
    backend = state.backend()
    model_id, deployment_id, row = _find(state, deployment)
    try:
        body = _status_body(backend.client, model_id, deployment_id)
    except NotFoundError:
        raise NotFound(f"no deployment {deployment_id!r} of model {model_id!r}", hint="List them with `loops deploy list --all`.") from None
    url = endpoint_url(backend, model_id, deployment_id, body)
    checkpoints = body.get("checkpoints") or (row or {}).get("checkpoints") or []
    first = next((c.get("checkpoint_id") or c.get("name") for c in checkpoints if isinstance(c, dict)), None)
    doc = {
        "deployment_id": deployment_id,
        "model_id": model_id,
        "model_name": body.get("name") or (row or {}).get("model_name"),
        "status": _status_of(body),
        "base_model": body.get("base_model") or (row or {}).get("base_model"),
        "checkpoints": checkpoints,
        "created_at": body.get("created_at") or (row or {}).get("created_at"),
        "url": url,
        "curl": curl_line(backend, url, str(first or body.get("base_model") or "")),
    }
    state.output.emit(
        doc,
        id_key="deployment_id",
        fields=[
            ("Deployment", "deployment_id"),
            ("Model", "model_id"),
            ("Name", "model_name"),
            ("Status", "status"),
            ("Base Model", "base_model"),
            ("Checkpoints", lambda d: ", ".join(str(c.get("checkpoint_id") or c.get("name")) for c in d["checkpoints"] if isinstance(c, dict)) or None),
            ("Created", "created_at"),
            ("URL", "url"),
            ("Try", "curl"),
        ],
    )


@app.command("stop")
def stop(
    ctx: typer.Context,
    deployments: Annotated[list[str], typer.Argument(help="Deployment ids (or MODEL_ID/DEPLOYMENT_ID).", show_default=False)],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (needed without a terminal).")] = False,
) -> None:
    """Stop checkpoint deployments: they stop serving. The checkpoints stay.

    Examples:

      loops deploy stop qrpg2r0 --yes
    """
    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    targets = [_find(state, d) for d in dict.fromkeys(deployments)]
    listed = ", ".join(f"{d}" + (f" ({row.get('model_name')})" if row and row.get("model_name") else "") for _, d, row in targets)
    from baseten_loops_cli.cli._resolve import confirm

    confirm(out, f"Stop deployment{'s' if len(targets) > 1 else ''} {listed}? It stops serving; the checkpoints stay.", yes=yes, action=f"stopping {listed}")
    results = []
    for model_id, deployment_id, _ in targets:
        client.models.deactivate(model_id, deployment_id)
        results.append({"model_id": model_id, "deployment_id": deployment_id, "stopped": True})
        out.success(f"Stopped deployment {deployment_id}.")
    if not out.human:
        out.emit(results, rows=results, columns=[("DEPLOYMENT", "deployment_id"), ("MODEL", "model_id")], id_key="deployment_id")
