"""What each trainer op does to a run's LoRA trainer. Runs on the model's compute thread.

Everything here is synchronous and touches only the engine and the checkpoint folders;
it never reads or writes the database. The caller (``runs.RunExecutor``) gathers what a
job needs beforehand (a :class:`TrainerJob`) and applies the returned :class:`OpOutcome`
(new policy version, checkpoint to record, token counts) on the event loop afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baseten_loops_cli.local.server.checkpoints import CheckpointFiles, CheckpointRef
from baseten_loops_cli.local.server.compute import ModelWorker

# How an op leaves the run's accumulated gradients.
GRADS_ADDED = "added"
GRADS_CLEARED = "cleared"


@dataclass(frozen=True)
class TrainerIdentity:
    run_id: str
    lora_rank: int
    seed: int | None


@dataclass(frozen=True)
class TrainerJob:
    """One op, fully resolved on the event loop."""

    op: str
    trainer: TrainerIdentity
    params: dict[str, Any] = field(default_factory=dict)
    # save ops: where to publish; load ops: the folder to read
    checkpoint: CheckpointRef | None = None
    source_dir: Path | None = None


@dataclass
class SavedCheckpoint:
    ref: CheckpointRef
    storage_dir: str
    size_bytes: int
    policy_version: int
    manifest: dict[str, str]


@dataclass
class OpOutcome:
    result: dict[str, Any]
    step: int
    lora_rank: int
    grads: str | None = None
    checkpoint: SavedCheckpoint | None = None
    tokens_trained: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def load_trainer(worker: ModelWorker, who: TrainerIdentity, restore_dir: Path | None,
                 with_optimizer: bool) -> int:
    """Put the run's trainer in memory (no-op if it is); return its step."""
    trainer = worker.trainers.get(who.run_id)
    if trainer is None:
        trainer = worker.engine.new_trainer(worker.base(), who.run_id, who.lora_rank, who.seed)
        worker.trainers[who.run_id] = trainer
        if restore_dir is not None:
            try:
                trainer.load_state(str(restore_dir), with_optimizer=with_optimizer)
            except BaseException:
                release_trainer(worker, who.run_id)
                raise
    return int(trainer.step)


def release_trainer(worker: ModelWorker, run_id: str) -> None:
    trainer = worker.trainers.pop(run_id, None)
    if trainer is not None:
        trainer.release()


def save_live_state(worker: ModelWorker, run_id: str, live_dir: Path) -> int:
    """Write the run's full state (adapter, optimizer, step) to its live folder; the
    engine's save is atomic, so a crash mid-save leaves the previous snapshot intact."""
    trainer = worker.trainers[run_id]
    live_dir.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_state(str(live_dir))
    return int(trainer.step)


def hibernate(worker: ModelWorker, run_id: str, live_dir: Path) -> int:
    """Scale to zero: save the live state, then free the adapter."""
    step = save_live_state(worker, run_id, live_dir)
    release_trainer(worker, run_id)
    return step


def execute(worker: ModelWorker, job: TrainerJob, files: CheckpointFiles) -> OpOutcome:
    trainer = worker.trainers[job.trainer.run_id]
    op, params = job.op, job.params
    rank = job.trainer.lora_rank

    if op in ("forward", "forward_backward"):
        method = trainer.forward if op == "forward" else trainer.forward_backward
        result = method(params["data"], params["loss_fn"],
                        loss_fn_config=params["loss_fn_config"],
                        top_k_logprobs=params["top_k_logprobs"], parsed=params.get("parsed"))
        return OpOutcome(result=result, step=int(trainer.step), lora_rank=rank,
                         grads=GRADS_ADDED if op == "forward_backward" else None,
                         tokens_trained=params["token_count"] if op == "forward_backward" else 0)

    if op == "optim_step":
        result = trainer.optim_step(params["adam_params"])
        return OpOutcome(result=result, step=int(trainer.step), lora_rank=rank,
                         grads=GRADS_CLEARED, metrics=dict(result.get("metrics") or {}))

    if op in ("save_state", "save_weights_for_sampler"):
        assert job.checkpoint is not None
        save = trainer.save_state if op == "save_state" else trainer.save_sampler_weights
        storage_dir, size, manifest = files.publish(job.checkpoint, lambda d: save(str(d)))
        step = int(trainer.step)
        saved = SavedCheckpoint(job.checkpoint, storage_dir, size, step, manifest)
        if op == "save_state":
            result = {"mode": "trainer", "path": job.checkpoint.uri}
        else:
            result = {"version": step, "path": job.checkpoint.uri}
        return OpOutcome(result=result, step=step, lora_rank=rank, checkpoint=saved)

    if op in ("load_state", "load_state_with_optimizer"):
        assert job.source_dir is not None
        with_optimizer = op == "load_state_with_optimizer"
        step = int(trainer.load_state(str(job.source_dir), with_optimizer=with_optimizer))
        return OpOutcome(result={"step": step}, step=step, lora_rank=rank, grads=GRADS_CLEARED)

    if op == "init_trainer_server":
        new_rank = int(params["lora_rank"])
        # A fresh adapter at the requested rank. The SDK calls this from every
        # TrainingClient constructor, so a brand-new trainer at the same rank is reused.
        if int(trainer.step) != 0 or new_rank != rank or params.get("was_trained"):
            release_trainer(worker, job.trainer.run_id)
            who = TrainerIdentity(job.trainer.run_id, new_rank, job.trainer.seed)
            load_trainer(worker, who, None, with_optimizer=False)
        return OpOutcome(result={"step": 0, "lora_rank": new_rank}, step=0, lora_rank=new_rank,
                         grads=GRADS_CLEARED)

    raise ValueError(f"unknown trainer op {op!r}")  # routes only accept known ops
