"""Deployments as the routes see them (``DeploymentRegistry``): a run's trainer deployment
(with its run and paired sampler), what ``/v1/models/{model_id}/deployments/{id}`` names (a
dedicated sampler or a checkpoint deployment), checkpoint deployments (created from sampler
checkpoints, served by ``deployments.py``), a deployment's logs and request metrics. Routes
call this, never the store; ``schemas`` renders what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.store import CheckpointRow, DeploymentRow, LogRow
from baseten_loops_cli.local.server.checkpoint_catalog import CheckpointCatalog
from baseten_loops_cli.local.server.errors import ApiError, bad_request, choices, not_found
from baseten_loops_cli.local.server.runs import RunManager
from baseten_loops_cli.local.server.samplers import Adapter, SamplerService

__all__ = ["DeploymentRegistry", "DeploymentRow", "ModelDeployment", "TrainerDeployment"]


@dataclass(frozen=True)
class TrainerDeployment:
    """A run's trainer deployment (``schemas.deployment_view``): its row, its run's and the
    run's paired sampler's (live or not)."""

    deployment: DeploymentRow
    run: st.RunRow | None
    sampler: st.SamplerRow | None


@dataclass(frozen=True)
class ModelDeployment:
    """What ``/v1/models/{model_id}/deployments/{deployment_id}`` names
    (``schemas.model_deployment_view``): a dedicated sampler, or a checkpoint deployment
    with the checkpoints it serves (those not deleted since)."""

    deployment_id: str
    sampler: st.SamplerRow | None = None
    inference: DeploymentRow | None = None
    checkpoints: tuple[CheckpointRow, ...] = ()


class DeploymentRegistry:
    def __init__(self, store: st.Store, runs: RunManager, samplers: SamplerService,
                 checkpoints: CheckpointCatalog) -> None:
        self.store = store
        self.runs = runs
        self.samplers = samplers
        self.checkpoints = checkpoints

    # ── trainer deployments ──

    def _describe_trainer(self, dep: DeploymentRow) -> TrainerDeployment:
        run = self.store.get_run(dep.run_id) if dep.run_id else None
        sampler = self.store.paired_sampler(run.id, live_only=False) if run else None
        return TrainerDeployment(dep, run, sampler)

    def trainer(self, deployment_id: str) -> TrainerDeployment:
        """A trainer deployment by id, or a 404."""
        dep = self.store.get_deployment(deployment_id)
        if dep is None or dep.kind != "trainer":
            raise not_found("deployment", deployment_id,
                            "List them with GET /v1/loops/deployments.")
        return self._describe_trainer(dep)

    def trainers(self) -> list[TrainerDeployment]:
        """Every trainer deployment, newest first."""
        return [self._describe_trainer(d) for d in self.store.list_deployments("trainer")]

    async def deactivate_trainer(self, trainer: TrainerDeployment) -> None:
        """Deactivating a trainer deployment deactivates its run."""
        if trainer.run is not None:
            await self.runs.deactivate(trainer.run)

    def logs(self, deployment_id: str, *, start_ns: int, end_ns: int, levels: Iterable[str],
             descending: bool, limit: int) -> list[LogRow]:
        return self.store.query_logs(deployment_id, start_ns=start_ns, end_ns=end_ns,
                                     levels=levels, descending=descending, limit=limit)

    def request_metrics(self, trainer: TrainerDeployment, start_ms: int, end_ms: int,
                        step_s: int) -> dict[str, Any]:
        """The trainer's requests (its run's ops) per ``step_s`` bucket of the window: volume,
        by status, latency, concurrency, in the hosted metrics' shapes."""
        run_id = trainer.deployment.run_id
        ops = self.store.list_operations(run_id=run_id, since=start_ms / 1000) if run_id else []
        buckets = range(start_ms // 1000, end_ms // 1000 + 1, step_s)
        volume, by_status, latency, concurrent = [], [], [], []
        for bucket in buckets:
            ts = st.iso(bucket)
            in_bucket = [o for o in ops if bucket <= o.submitted_at < bucket + step_s]
            finished = [o for o in in_bucket if o.finished_at and o.started_at]
            durations = sorted(o.finished_at - o.started_at for o in finished)  # type: ignore[operator]
            volume.append({"value": len(in_bucket), "timestamp": ts})
            by_status.append({"timestamp": ts, "value": {
                "2xx": sum(o.status in (st.OP_DONE, st.OP_EXPIRED) for o in in_bucket),
                "5xx": sum(o.status == st.OP_ERROR for o in in_bucket)}})
            latency.append({"timestamp": ts, "value": {
                "p50": durations[len(durations) // 2] if durations else None,
                "max": durations[-1] if durations else None}})
            concurrent.append({"value": sum(1 for o in ops if o.started_at and o.started_at
                                            < bucket + step_s and (o.finished_at or 1e18) >= bucket),
                               "timestamp": ts})
        return {"inference_volume": volume, "concurrent_requests": concurrent,
                "response_time_stats": latency, "inference_volume_by_status": by_status,
                "gpu_memory_usage_bytes": {}, "gpu_utilization": {}, "cpu_usage": [],
                "cpu_memory_usage_bytes": [], "ephemeral_storage": None, "per_node_metrics": []}

    # ── /v1/models/{model_id}/deployments/{deployment_id} ──

    def model_deployment(self, model_id: str, deployment_id: str) -> ModelDeployment:
        """The dedicated sampler or checkpoint deployment of that model, or a 404."""
        sampler = self.store.get_sampler_by_model(model_id, deployment_id)
        if sampler is not None:
            return ModelDeployment(sampler.deployment_id, sampler=sampler)
        dep = self.store.get_deployment(deployment_id)
        if dep is not None and dep.kind == "inference" and dep.model_id == model_id:
            return ModelDeployment(dep.id, inference=dep, checkpoints=tuple(
                cp for pk in dep.checkpoint_pks if (cp := self.store.get_checkpoint(pk))))
        raise ApiError(404, f"No deployment {deployment_id!r} of model {model_id!r}.",
                       "DeploymentNotFound")

    def deactivate_model_deployment(self, deployment: ModelDeployment) -> None:
        if deployment.sampler is not None:
            self.samplers.deactivate(self.samplers.get(deployment.sampler.id))
        else:
            self.store.set_deployment_status(deployment.deployment_id, st.SAMPLER_INACTIVE,
                                             "deactivated")
            self.store.append_log(deployment.deployment_id, "Deployment deactivated.")

    # ── checkpoint deployments ──

    def deploy(self, checkpoint_ids: list[str], model_name: str | None,
               base_url: str) -> DeploymentRow:
        """``POST /v1/loops/checkpoints/deploy``: one deployment serving these sampler
        checkpoints (one base model, unique names; requests pick one by name)."""
        cps = [self.checkpoints.get(pk) for pk in checkpoint_ids]
        trainer_targets = [cp.pk for cp in cps if cp.target != st.TARGET_SAMPLER]
        if trainer_targets:
            raise bad_request(f"Only sampler checkpoints can be deployed; "
                              f"{', '.join(trainer_targets)} hold trainer state. Save with "
                              "save_weights_for_sampler.", "WrongCheckpointTarget")
        models = {cp.base_model for cp in cps}
        if len(models) != 1:
            raise bad_request(f"All checkpoints of a deployment must share a base model; got "
                              f"{choices(models)}.", "BaseModelMismatch")
        names = [cp.name for cp in cps]
        if len(set(names)) != len(names):
            raise bad_request("Checkpoint names must be unique within a deployment (requests "
                              "pick one by name).", "InvalidRequest")
        dep = self.store.create_inference_deployment(
            name=model_name or f"loops-{cps[0].run_id}", base_model=models.pop(),
            checkpoint_pks=[cp.pk for cp in cps])
        served = ", ".join(cp.bt_path for cp in cps)
        self.store.append_log(dep.id, f"Deployed {served} on {dep.base_model}. Serve: "
                                      f"{base_url}/deployments/{dep.id}/v1/chat/completions "
                                      "with model=<checkpoint name>.")
        return dep

    def serving(self, deployment_id: str) -> DeploymentRow:
        """A checkpoint deployment that takes requests: 404 if there is none, 409 once
        deactivated."""
        dep = self.store.get_deployment(deployment_id)
        if dep is None or dep.kind != "inference":
            raise ApiError(404, f"No checkpoint deployment {deployment_id!r}. Create one with "
                                "POST /v1/loops/checkpoints/deploy.", "DeploymentNotFound")
        if dep.status != st.SAMPLER_ACTIVE:
            raise ApiError(409, f"Deployment {dep.id} is {dep.status}.", "DeploymentInactive")
        return dep

    def adapters(self, dep: DeploymentRow) -> dict[str, Adapter]:
        """The deployment's checkpoints (those not deleted since) by name, as the engine
        loads them."""
        out = {}
        for pk in dep.checkpoint_pks:
            cp = self.store.get_checkpoint(pk)
            if cp is not None:
                out[cp.name] = self.samplers.adapter(cp)
        return out

    def record_usage(self, dep: DeploymentRow, tokens_sampled: int, *,
                     checkpoint_pk: str | None = None) -> None:
        """A request to the deployment finished: count it for the deployment (and for the run
        whose checkpoint ``checkpoint_pk`` answered it)."""
        self.store.add_usage(dep.id, "deployment", tokens_sampled=tokens_sampled,
                             sample_requests=1, checkpoint_pk=checkpoint_pk)
