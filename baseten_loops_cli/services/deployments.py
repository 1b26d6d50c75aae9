"""Serve sampler checkpoints behind an OpenAI-compatible endpoint; list, describe and stop them.

Requests pick a deployed checkpoint by its name in the ``model`` field (as on Baseten); the local
backend also serves the deployment's model name (``--model-name``) as its first checkpoint.

Listing: no Loops route lists checkpoint deployments (and Baseten's model list holds every model
of the workspace), so :func:`list_deployments` returns the deployments this machine created
(recorded in the state dir by :func:`deploy`), each with its live status from the backend;
:func:`find_deployment` also takes any ``MODEL_ID/DEPLOYMENT_ID``.

Use from Python::

    plan = plan_deployment(backend, ["abc1234:final"], model_name="my-adapter")
    info = deploy(backend, plan)
    print(info.url)
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, Field

from baseten_loops_cli.api.models import LoopsCheckpoint, ModelDeployment
from baseten_loops_cli.api.polling import Clock, Poll, Sleep
from baseten_loops_cli.errors import LoopsError, UsageError
from baseten_loops_cli.services.resolve import NotFound, did_you_mean, display_name, resolve_checkpoint, suggest, uri_of

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.services import Connected as Backend

RECORDS_FILE = "deployments.json"
# Deployment (DeploymentStatusV1) statuses that end a wait.
FAILED_STATUSES = frozenset({"DEPLOY_FAILED", "BUILD_FAILED", "BUILD_STOPPED", "FAILED", "UNHEALTHY", "INACTIVE"})
STOPPED_STATUSES = frozenset({"INACTIVE", "DELETED"})
# How long `deploy --wait` waits for ACTIVE: a Baseten deployment builds and loads its model
# (minutes, more for a large base model); the local one is served at once.
WAIT_ACTIVE_TIMEOUT_S = 3600.0


class DeployedCheckpoint(BaseModel):
    id: str
    name: str | None = None
    run_id: str | None = None
    uri: str | None = None


class DeploymentRequest(BaseModel):
    checkpoint_ids: list[str]
    model_name: str
    instance_type_id: str
    hf_secret_name: str | None = None


class DeploymentPlan(BaseModel):
    """What :func:`deploy` will create (``--dry-run`` prints it)."""

    request: DeploymentRequest
    checkpoints: list[LoopsCheckpoint]
    base_model: str

    @property
    def listed(self) -> str:
        return ", ".join(display_name(c) for c in self.checkpoints)

    @property
    def names(self) -> list[str]:
        return [c.checkpoint_id for c in self.checkpoints]


class DryRun(BaseModel):
    """``loops deploy --dry-run -o json``."""

    dry_run: bool = True
    request: dict[str, Any]
    checkpoints: list[dict[str, Any]]


class DeploymentRow(BaseModel):
    """A checkpoint deployment as listed: what was deployed, its live status and endpoint.
    ``checkpoints`` are as recorded (``{id, name, run_id, uri}``) or as the backend reports them."""

    model_id: str
    deployment_id: str
    model_name: str | None = None
    base_model: str | None = None
    checkpoints: list[dict[str, Any]] = Field(default_factory=list)
    created_at: str | None = None
    status: str | None = None
    url: str

    @property
    def checkpoint_names(self) -> list[str]:
        names = (c.get("checkpoint_id") or c.get("name") for c in self.checkpoints if isinstance(c, dict))
        return [str(n) for n in names if n]


class DeploymentInfo(DeploymentRow):
    """A checkpoint deployment with a ready curl line (create, describe)."""

    curl: str


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


def _backend_key(backend: "Backend") -> str:
    """What a record names its backend by. A local server by its stable id (``/health``'s
    ``backend_id``, kept in its state dir): its port, and so its URL, may change across a
    restart (issue 43). A remote service by profile and URL, which do not change."""
    if backend.capabilities.local_server:
        try:
            health = backend.client.http.request_json("GET", "/health")
        except Exception:  # noqa: BLE001 - an older server, or none: the URL key below
            health = None
        backend_id = health.get("backend_id") if isinstance(health, dict) else None
        if isinstance(backend_id, str) and backend_id:
            return f"local:{backend_id}"
    return _url_key(backend)


def _url_key(backend: "Backend") -> str:
    """The key records had before local servers had an id (still found on the same URL)."""
    return f"{backend.profile_name}|{backend.base_url}"


# ── endpoint URL and curl line ────────────────────────────────────────────────────────────


def endpoint_url(backend: "Backend", model_id: str, deployment_id: str, status: ModelDeployment | None = None) -> str:
    """The OpenAI-compatible base URL (ending in ``/v1``) of a deployment."""
    from urllib.parse import urlsplit

    if status is not None and status.base_url:
        return f"{status.base_url.rstrip('/')}/v1"
    if backend.capabilities.deployments_under_base_url:
        return f"{backend.base_url}/deployments/{deployment_id}/v1"
    host = urlsplit(backend.base_url).hostname or "api.baseten.co"
    return f"https://model-{model_id}.{host}/deployment/{deployment_id}/sync/v1"


def _key_expr(backend: "Backend") -> str:
    """How a shell gets the key, never the key itself."""
    if backend.key_source == "local-server":
        from baseten_loops_cli.settings.local_server import state_file

        return f"$(cat {state_file('token')})"
    return "$BASETEN_API_KEY"


def curl_line(backend: "Backend", url: str, model: str) -> str:
    # temperature 0: the same answer every time (the README's examples hold word for word)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64, "temperature": 0})
    return (
        f"curl -s {url}/chat/completions -H \"Authorization: Api-Key {_key_expr(backend)}\" "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


# ── create ────────────────────────────────────────────────────────────────────────────────


def _default_name(cp: LoopsCheckpoint) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"loops-{cp.run_id}-{cp.checkpoint_id}")[:255]


def plan_deployment(
    backend: "Backend",
    refs: list[str],
    *,
    model_name: str | None = None,
    instance_type: str | None = None,
    hf_secret: str | None = None,
    dry_run: bool = False,
) -> DeploymentPlan:
    """Resolve and check the checkpoints (sampler weights, one base model, distinct names) and
    settle the model name and instance type."""
    refs = list(dict.fromkeys(r.strip() for r in refs if r.strip()))
    if not refs:
        raise UsageError("name at least one sampler checkpoint to deploy")
    cps: list[LoopsCheckpoint] = []
    for ref in refs:
        cp = resolve_checkpoint(backend.client, ref, prefer="sampler")
        if cp.target != "sampler":
            raise UsageError(
                f"{ref} is a trainer checkpoint (training state, with optimizer) and cannot be served",
                hint="Deploy sampler weights instead (saved with save_weights_for_sampler): "
                f"loops checkpoints list --run-id {cp.run_id} --target sampler",
            )
        if all(c.id != cp.id for c in cps):  # the same checkpoint named twice is one
            cps.append(cp)
    models = sorted({str(c.base_model) for c in cps})
    if len(models) > 1:
        raise UsageError(
            f"the checkpoints were trained on different base models ({', '.join(models)})",
            hint="A deployment serves one base model; deploy them separately.",
        )
    names = [c.checkpoint_id for c in cps]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UsageError(
            f"two of the checkpoints are named {dupes[0]!r} (from different runs); requests pick one by name",
            hint="Deploy them separately.",
        )
    default_instance = backend.capabilities.default_instance_type
    if default_instance:
        instance = instance_type or default_instance
    elif not instance_type and not dry_run:
        raise UsageError(
            "--instance-type is required on a Baseten profile",
            hint="Pass the id of the instance type to serve on, e.g. --instance-type H100.",
        )
    else:
        instance = instance_type or ""
    request = DeploymentRequest(
        checkpoint_ids=[c.id for c in cps],
        model_name=model_name or _default_name(cps[0]),
        instance_type_id=instance,
        hf_secret_name=hf_secret,
    )
    return DeploymentPlan(request=request, checkpoints=cps, base_model=models[0])


def dry_run(plan: DeploymentPlan) -> DryRun:
    return DryRun(
        request=plan.request.model_dump(exclude_none=True),
        checkpoints=[{**c.model_dump(mode="json"), "uri": uri_of(c)} for c in plan.checkpoints],
    )


def deployment_status(client: "LoopsClient", model_id: str, deployment_id: str) -> ModelDeployment:
    return client.models.deployment(model_id, deployment_id)


def deploy(backend: "Backend", plan: DeploymentPlan) -> DeploymentInfo:
    """Create the deployment, record it (so listing finds it even if a later wait is
    interrupted), and return it with its current status."""
    client = backend.client
    req = plan.request
    resp = client.checkpoints.deploy(
        req.checkpoint_ids, model_name=req.model_name, instance_type_id=req.instance_type_id, hf_secret_name=req.hf_secret_name
    )
    checkpoints = [DeployedCheckpoint(id=c.id, name=c.checkpoint_id, run_id=c.run_id, uri=uri_of(c)) for c in plan.checkpoints]
    record = {
        "backend": _backend_key(backend),
        "model_id": resp.model_id,
        "deployment_id": resp.deployment_id,
        "model_name": req.model_name,
        "base_model": plan.base_model,
        "checkpoints": [c.model_dump() for c in checkpoints],
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _save_record(record)
    status: ModelDeployment | None
    try:
        status = deployment_status(client, resp.model_id, resp.deployment_id)
    except Exception:  # noqa: BLE001 - the deployment exists; its status is a nicety
        status = None
    url = endpoint_url(backend, resp.model_id, resp.deployment_id, status)
    return DeploymentInfo(
        **{k: v for k, v in record.items() if k != "backend"},
        status=(status.status_name or None) if status is not None else None,
        url=url,
        curl=curl_line(backend, url, plan.checkpoints[0].checkpoint_id),
    )


def wait_active(
    backend: "Backend",
    info: DeploymentInfo,
    *,
    on_status: Callable[[str], None] = lambda _s: None,
    interval: float = 2.0,
    timeout: float = WAIT_ACTIVE_TIMEOUT_S,
    sleep: Sleep = time.sleep,
    clock: Clock = time.monotonic,
) -> DeploymentInfo:
    """Poll until the deployment is ACTIVE (``LoopsError`` if it fails first, or is not ACTIVE
    after ``timeout`` seconds); ``on_status`` hears each new status. Returns ``info`` with the
    final status and URL."""
    client, model_id, deployment_id = backend.client, info.model_id, info.deployment_id
    last = None
    for _ in Poll(interval=interval, timeout=timeout, sleep=sleep, clock=clock):
        body = deployment_status(client, model_id, deployment_id)
        status = body.status_name or None
        if status != last:
            on_status(f"Deployment {deployment_id}: {status}")
            last = status
        if status == "ACTIVE":
            url = endpoint_url(backend, model_id, deployment_id, body)
            first = info.checkpoint_names[0] if info.checkpoint_names else info.base_model or ""
            return info.model_copy(update={"status": status, "url": url, "curl": curl_line(backend, url, first)})
        if status in FAILED_STATUSES:
            raise LoopsError(f"deployment {deployment_id} is {status}", hint=f"See `loops deploy describe {model_id}/{deployment_id}`.")
    raise LoopsError(
        f"deployment {deployment_id} is still {last or 'starting'} after {timeout:g}s",
        hint=f"It keeps coming up in the background; check it with `loops deploy describe {model_id}/{deployment_id}`.",
    )


# ── list / describe / stop ────────────────────────────────────────────────────────────────


def list_deployments(backend: "Backend") -> list[DeploymentRow]:
    """Checkpoint deployments made from this machine with ``loops deploy``, newest first, each
    with its live status from the backend (DELETED when the backend no longer knows it)."""
    from baseten_loops_cli.api.errors import NotFoundError

    rows: list[DeploymentRow] = []
    keys = {_backend_key(backend), _url_key(backend)}
    for rec in _load_records():
        if rec.get("backend") not in keys:
            continue
        body: ModelDeployment | None
        try:
            body = deployment_status(backend.client, rec["model_id"], rec["deployment_id"])
            status = body.status_name or None
        except NotFoundError:
            body, status = None, "DELETED"
        fields = {k: v for k, v in rec.items() if k != "backend"}
        rows.append(DeploymentRow(**fields, status=status, url=endpoint_url(backend, rec["model_id"], rec["deployment_id"], body)))
    rows.sort(key=lambda r: r.created_at or "", reverse=True)
    return rows


def find_deployment(backend: "Backend", ref: str) -> tuple[str, str, DeploymentRow | None]:
    """(model_id, deployment_id, the recorded deployment) for ``DEPLOYMENT`` or
    ``MODEL/DEPLOYMENT``."""
    ref = ref.strip()
    if "/" in ref:
        model_id, _, deployment_id = ref.partition("/")
        return model_id, deployment_id, None
    rows = list_deployments(backend)
    for row in rows:
        if ref in (row.deployment_id, row.model_id):
            return row.model_id, row.deployment_id, row
    raise NotFound(
        f"no checkpoint deployment {ref!r}",
        hint=f"{did_you_mean(suggest(ref, [r.deployment_id for r in rows]))}List them with `loops deploy list --all`, "
        "or name one as MODEL_ID/DEPLOYMENT_ID.",
    )


def describe_deployment(backend: "Backend", ref: str) -> DeploymentInfo:
    from baseten_loops_cli.api.errors import NotFoundError

    model_id, deployment_id, row = find_deployment(backend, ref)
    try:
        body = deployment_status(backend.client, model_id, deployment_id)
    except NotFoundError:
        raise NotFound(f"no deployment {deployment_id!r} of model {model_id!r}", hint="List them with `loops deploy list --all`.") from None
    url = endpoint_url(backend, model_id, deployment_id, body)
    listed = DeploymentRow(
        deployment_id=deployment_id,
        model_id=model_id,
        model_name=body.name or (row.model_name if row else None),
        status=body.status_name or None,
        base_model=body.base_model or (row.base_model if row else None),
        checkpoints=body.checkpoints or (row.checkpoints if row else []),
        created_at=body.created_at or (row.created_at if row else None),
        url=url,
    )
    first = next(iter(listed.checkpoint_names), None)
    return DeploymentInfo(**listed.model_dump(), curl=curl_line(backend, url, str(first or listed.base_model or "")))


def stop_deployments(client: "LoopsClient", targets: list[tuple[str, str]], on_stopped: Callable[[str], None] = lambda _d: None) -> list[dict]:
    """Deactivate each (model_id, deployment_id); the checkpoints stay."""
    results = []
    for model_id, deployment_id in targets:
        client.models.deactivate(model_id, deployment_id)
        results.append({"model_id": model_id, "deployment_id": deployment_id, "stopped": True})
        on_stopped(deployment_id)
    return results
