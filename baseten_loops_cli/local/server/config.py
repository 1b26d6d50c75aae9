"""The local server's knobs (``ServerConfig``): one record, built by ``app.create_app`` and
handed to the services that read it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ServerConfig:
    """Knobs of the local server. Defaults follow the hosted platform; tests shrink the
    time-based ones (e.g. ``op_poll_hold_s``) to keep runs fast."""

    data_dir: Path
    token: str
    # GET /operations/{id} holds this long before answering 408 (hosted: 30 s).
    op_poll_hold_s: float = 30.0
    # Finished op results are kept this long, then polls answer 404 (hosted: ~1 h).
    op_result_ttl_s: float = 3600.0
    # ...and retried submits are deduplicated this long.
    idempotency_window_s: float = 24 * 3600.0
    # GET <trainer>/health waits up to this long for a deploying trainer to come up
    # (under the SDK's 10 s probe timeout), sparing it a 10 s sleep between probes.
    health_hold_s: float = 8.0
    # Presigned file links expire after this long.
    link_ttl_s: int = 3600
    # /sample requests arriving less than this apart are batched into one engine call
    # (samplers.SampleBatcher).
    sample_batch_window_s: float = 0.01
    max_sample_batch: int = 32
    # /sample with X-Min-Policy-Version holds this long for the adapter to catch up
    # before answering 408 (the SDK then retries).
    min_version_hold_s: float = 10.0
    # Snapshot a run's live state after an optim_step at most this often, so a crash
    # loses at most this much training (a clean stop always snapshots).
    snapshot_interval_s: float = 60.0
    # How often idle runs/samplers are scaled to zero and expired data is cleaned up.
    janitor_interval_s: float = 0.5
    # A sampler stays up at least this long after a /wake or a request, whatever its
    # scale_down_delay_seconds: the official SDK wakes a sampler once and then polls its
    # status every 10 s, so one scaled down between two polls was never seen ready.
    sampler_min_awake_s: float = 30.0
    enable_fault_hooks: bool = False
    # The backend's stable id (daemon.BACKEND_FILE in the state dir), on /health: clients key
    # their records of this backend by it, since a restart may change the port.
    backend_id: str = ""
    # The largest body a deployment's OpenAI route reads (413 before reading the rest):
    # well above the longest context, as text or token ids, batched.
    max_openai_body_bytes: int = 32 * 2**20
    # The compute policy (local/engine/precision.py): auto|float32|bfloat16 and auto|cpu|cuda;
    # the defaults follow LOOPS_DTYPE / LOOPS_DEVICE, else auto: bfloat16 where the hardware
    # has it (on an AVX512-BF16 CPU a SmolLM2 SFT step took 0.52x float32's, sampling
    # 0.53-0.63x; precision.py), float32 elsewhere.
    dtype: str = field(default_factory=lambda: os.environ.get("LOOPS_DTYPE") or "auto")
    device: str = field(default_factory=lambda: os.environ.get("LOOPS_DEVICE") or "auto")
    # Per-layer activation checkpointing in the trainer (local/engine/trainer.py,
    # ACTIVATION_BUDGET_BYTES): auto (recompute decoder layers only where a datum's
    # activations pass the budget: long rows), on (always) or off (never); default
    # LOOPS_ACTIVATION_CHECKPOINTING, else auto. An 8k-token SmolLM2 row peaked at 10.95 GiB
    # without it.
    activation_checkpointing: str = field(
        default_factory=lambda: os.environ.get("LOOPS_ACTIVATION_CHECKPOINTING") or "auto")
    # Import torch in the background at startup so the first op doesn't pay for it.
    preload_engine: bool = True

    def __post_init__(self) -> None:
        # Checked here, torch-free, so a bad value stops the server at start with one line.
        from baseten_loops_cli.memory_estimate import CHECKPOINTING_MODES as modes

        if self.activation_checkpointing not in modes:
            raise ValueError(f"activation_checkpointing must be one of {', '.join(modes)}, "
                             f"got {self.activation_checkpointing!r} "
                             "(LOOPS_ACTIVATION_CHECKPOINTING or the server option).")
