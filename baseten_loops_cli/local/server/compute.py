"""The bridge between the async server and the torch engine (``local/engine``).

Model compute never runs on the event loop: a forward/backward on CPU takes seconds, and
the loop must keep answering long-polls, listings and health checks meanwhile. Instead
each base model gets one :class:`ModelWorker`, which owns everything touching that model's
weights: a compute thread for the loaded base and every run's LoRA trainer on it (jobs
strictly in submission order: runs on the same base share its module, and PEFT swaps
adapters in place, so two threads on it would race), and a sample thread for its sampler
engine, which works on the base's twin (same weights, modules of its own).

This is the only server module that imports the engine, and it does so lazily: the
server starts (and answers ``/health``) before torch is even imported.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

log = logging.getLogger("loops.server.compute")

T = TypeVar("T")


@dataclass(frozen=True)
class ModelSpec:
    """What the server needs to know about a model before loading it."""

    name: str
    max_seq_len: int
    vocab_size: int | None
    supports_vision_language: bool
    description: str


class Engine:
    """Lazy facade over ``baseten_loops_cli.local.engine`` (imports torch on first use).

    Everything the server asks of the engine goes through here, so the rest of the server
    depends on this small surface rather than on the engine's module layout.
    """

    def __init__(self, dtype: str = "float32", device: str = "cpu",
                 activation_checkpointing: str = "auto") -> None:
        self._modules: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._specs: dict[str, ModelSpec] | None = None
        # The requested policy (engine/precision.py), resolved when the engine loads.
        self.requested_dtype = dtype
        self.requested_device = device
        self._precision: Any = None
        # trainer.configure_checkpointing's mode: auto|on|off (ServerConfig).
        self.activation_checkpointing = activation_checkpointing

    def _load(self) -> dict[str, Any]:
        with self._lock:
            if self._modules is None:
                from baseten_loops_cli.local.engine import (
                    allocator,
                    datums,
                    errors,
                    losses,
                    model_zoo,
                    precision,
                    registry,
                    sampler,
                    trainer,
                )

                # Before any tensor: large blocks in mappings of their own, so a long row's
                # freed activations go back to the system (engine/allocator.py's profile).
                allocator.configure_allocator()
                # Before any model loads: the policy decides where its weights go.
                self._precision = precision.configure(self.requested_dtype,
                                                      self.requested_device)
                log.info("compute: %s on %s (%s)", self._precision.dtype,
                         self._precision.device, self._precision.reason)
                trainer.configure_checkpointing(self.activation_checkpointing)

                self._modules = {"errors": errors, "registry": registry, "sampler": sampler,
                                 "trainer": trainer, "losses": losses, "datums": datums,
                                 "model_zoo": model_zoo}
            return self._modules

    @property
    def loaded(self) -> bool:
        return self._modules is not None

    def precision_status(self) -> dict[str, Any]:
        """What ``/v1/local/status`` reports: the requested policy, and what it resolved to
        once the engine loaded (``dtype``/``device`` None until then)."""
        chosen = self._precision
        return {"requested_dtype": self.requested_dtype,
                "requested_device": self.requested_device,
                "dtype": chosen.dtype if chosen else None,
                "device": chosen.device if chosen else None,
                "reason": chosen.reason if chosen else "the engine has not loaded yet",
                "activation_checkpointing": self.activation_checkpointing}

    def preload(self) -> None:
        """Import torch and the engine (call from a background thread at startup)."""
        try:
            self._load()
            self.models()
        except Exception:  # reported again, with context, by the first request that needs it
            log.exception("preloading the engine failed")

    @property
    def input_error(self) -> type[Exception]:
        return self._load()["errors"].EngineInputError

    def is_input_error(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the engine's "bad input" error (False if the engine never
        loaded, so this is safe in error handlers)."""
        return self._modules is not None and isinstance(
            exc, self._modules["errors"].EngineInputError)

    # ── models ──

    def models(self) -> dict[str, ModelSpec]:
        """The models the engine offers by name (capabilities)."""
        if self._specs is None:
            infos = self._load()["registry"].available_models()
            self._specs = {info.name: _spec(info) for info in infos}
        return self._specs

    def spec(self, name: str) -> ModelSpec | None:
        """A named model, or a local Hugging Face model directory; None if neither."""
        known = self.models().get(name)
        if known is not None:
            return known
        try:
            return _spec(self._load()["model_zoo"].model_info(name))
        except LookupError:  # UnknownModelError
            return None

    def model_files(self, name: str) -> Any:
        """The folder holding ``name``'s weights on this machine (a Path), or None (built in
        code, or not fetched yet). Looks only: converts nothing."""
        from baseten_loops_cli.settings.model_files import find_model_dir

        return find_model_dir(name)

    def needs_files(self, name: str) -> bool:
        """Whether ``name`` loads from files (every model but the one built in code)."""
        return name != self._load()["model_zoo"].TINY

    def pull(self, name: str, progress: Any = None) -> Any:
        """Fetch and convert ``name`` into the cache (``loops server pull-model``); each step
        is reported to ``progress``. On a worker thread."""
        return self._load()["model_zoo"].pull_model(name, progress)

    def load_base(self, name: str) -> Any:
        return self._load()["registry"].load_base(name)

    # ── training ──

    def new_trainer(self, base: Any, adapter_name: str, lora_rank: int, seed: int | None) -> Any:
        return self._load()["trainer"].LoraTrainer(base, adapter_name, lora_rank, seed=seed)

    def parse_forward(self, data: Any, loss_fn: str, loss_fn_config: dict | None,
                      vocab_size: int, max_seq_len: int) -> list[Any]:
        """Parse a forward/forward_backward request's datums exactly as the engine reads them
        (raises EngineInputError): the ``ParsedDatum``s the trainer then takes as they are, so
        a datum is parsed once, at submit time. Thread-safe."""
        m = self._load()
        definition = m["losses"].loss_def(loss_fn)
        m["losses"].resolve_config(loss_fn, loss_fn_config)
        return m["datums"].parse_data(data, loss_fn, definition, vocab_size, max_seq_len)

    # ── sampling ──

    def new_sampler(self, base: Any) -> Any:
        return self._load()["sampler"].SamplerEngine(base)

    def sample(self, sampler: Any, requests: list[Any]) -> list[Any]:
        """Run ``SampleRequest``s through ``SamplerEngine.sample``; returns one
        ``SampleResult`` or exception per request. On a compute thread.

        The engine validates a whole batch before generating, so one bad request (say,
        an adapter whose files are corrupt) would fail every request it was batched with;
        when a batch fails, each request is retried alone so only the bad one errors.
        """
        try:
            results: list[Any] = sampler.sample(requests)
        except self.input_error:
            if len(requests) == 1:
                raise
            results = []
            for request in requests:
                # A streamed request may have sent tokens from the failed batch already; the
                # rerun only delivers its final result (the stream ends with that).
                request.on_token = None
                try:
                    results.append(sampler.sample([request])[0])
                except Exception as exc:  # delivered to that request's caller only
                    results.append(exc)

        def with_token_text(request: Any, result: Any) -> Any:
            if isinstance(result, BaseException) or result.prompt_logprobs is None:
                return result
            ids = set(request.prompt) | {t for entry in result.prompt_logprobs if entry
                                     for t, _ in entry.top}
            result.token_text = {t: sampler.tokenizer.decode([t]) for t in ids}
            return result

        return [with_token_text(r, result) for r, result in zip(requests, results)]


def _spec(info: Any) -> ModelSpec:
    return ModelSpec(
        name=info.name,
        max_seq_len=int(info.max_seq_len),
        vocab_size=getattr(info, "vocab_size", None),
        supports_vision_language=bool(getattr(info, "supports_vision_language", False)),
        description=str(getattr(info, "description", "") or ""),
    )


_RETIRE = object()  # a lane's queue item: a thread holding an OpenMP pool hands over and exits
_lanes: "set[_Lane]" = set()  # every lane in the process (OpenMP pools are per process)
_lanes_lock = threading.Lock()


class _Lane:
    """One thread running its jobs in submission order.

    The thread is replaced by a fresh one (same queue, same name) whenever it holds an OpenMP
    pool that another lane's work would run beside. GNU OpenMP (torch's) keeps a pool of worker
    threads for every thread that ran a multi-threaded region, until that thread exits, and
    once the pools' threads outnumber the CPUs it throttles every pool's spin-wait (about 100
    spins instead of 300,000), so each parallel region wakes its workers from a futex. On the
    2-core machine a server that had sampled and trained with two threads each then trained
    SmolLM2 SFT 1.2x slower than a fresh one (issue 33; bench/after_rl.py), its compute thread
    waiting in libgomp a third of the time. So at most one lane thread holds a pool: a lane
    about to run alone with several threads retires the other idle lanes' pooled threads, and a
    pooled lane that finishes a job while another lane is busy retires its own.
    """

    def __init__(self, worker: "ModelWorker", name: str) -> None:
        self.worker = worker
        self.name = name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_seconds = 0.0
        self.jobs_done = 0
        self.current_job: str | None = None
        self.pooled = False  # this thread ran a job with more than one torch thread
        self.threads = 0  # the torch threads of the job running now
        self.thread = self._new_thread()
        with _lanes_lock:
            _lanes.add(self)

    def _new_thread(self) -> threading.Thread:
        self.pooled = False
        thread = threading.Thread(target=self._loop, daemon=True,
                                  name=f"loops-{self.name}[{self.worker.model_name}]")
        thread.start()  # before it is published: stop() may join self.thread at any time
        self.thread = thread
        return thread

    @property
    def busy(self) -> bool:
        return self.current_job is not None

    def uses_threads(self, count: int) -> None:
        """Called on this lane's thread before a job runs with ``count`` torch threads."""
        with _lanes_lock:
            others = [lane for lane in _lanes if lane is not self]
        if count <= 1:
            if not self.pooled and any(lane.pooled and lane.busy for lane in others):
                self._throttle_while_oversubscribed()
            return
        self.pooled = True
        for lane in others:
            if lane.pooled and not lane.busy:
                lane.jobs.put(_RETIRE)  # taken after anything already queued there

    def _throttle_while_oversubscribed(self) -> None:
        """This job runs beside a busy lane that started alone with every thread, so the
        cores are oversubscribed until one of them ends: a second pool (of two threads, here)
        makes OpenMP throttle the busy lane's spin-waits, which would otherwise take the CPU
        this job needs (tiny RL with sampling and training overlapped: 8.2 s without, 7.6 s
        with, as before pools were retired). This lane retires it when its job ends beside the
        busy one, or when a lane next starts alone."""
        import torch

        torch.set_num_threads(2)
        torch.ones(1 << 16).add_(1)  # a parallel region: the pool starts
        self.pooled = True

    def close(self) -> None:
        with _lanes_lock:
            _lanes.discard(self)
        self.jobs.put(None)

    def _others_busy(self) -> bool:
        with _lanes_lock:
            return any(lane.busy for lane in _lanes if lane is not self)

    def _loop(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            if item is _RETIRE:
                if self.pooled:
                    self._new_thread()
                    return  # this thread's OpenMP pool goes with it
                continue
            future, label, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            self.current_job = label
            started = time.monotonic()
            try:
                self.worker.set_thread_budget(self)
                if self.worker.before_job is not None:
                    self.worker.before_job(label)
                with self.worker.redeciding(self):
                    future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
            finally:
                self.worker.restore_thread_budget()
                self.busy_seconds += time.monotonic() - started
                self.jobs_done += 1
                self.current_job = None
            if self.pooled and self._others_busy():
                self._new_thread()
                return


TRAIN = "compute"
SAMPLE = "sample"

_process_threads: int | None = None
_process_threads_lock = threading.Lock()


def _torch_imported() -> bool:
    import sys

    return "torch" in sys.modules


def process_threads() -> int:
    """The process's torch intra-op budget (OMP_NUM_THREADS or the core count), read once,
    before any lane changes it, and shared by every model worker."""
    global _process_threads
    with _process_threads_lock:
        if _process_threads is None:
            import torch

            _process_threads = torch.get_num_threads()
        return _process_threads


class ModelWorker:
    """Two threads on one base model: the *compute* lane (every run's LoRA trainer, checkpoints,
    residency) and the *sample* lane (the sampler engine). Each runs its jobs in submission
    order.

    The lanes run at once - async RL samples the next batch while the trainer steps - because
    the sampler works on the base's twin (registry.BaseModel.twin: the same weight tensors,
    its own modules and adapters), never on the module the trainers' adapters live on. Jobs
    may use ``self.base()`` and ``self.trainers`` (run id -> LoraTrainer) on the compute
    lane, ``self.sampler()`` on the sample lane; each is touched by one thread only.

    Torch threads: a lane working alone gets the process's whole intra-op budget; while the
    other lane is busy too, each takes half (at least one), so the two never oversubscribe
    the cores (multi-threaded OpenMP on an oversubscribed CPU makes small ops many times
    slower). The budget is set on the lane's own thread (it is per thread in torch) when a job
    starts, and decided again at the engine's checkpoints inside the job (between decoder
    layers, engine/thread_budget.py), so a job that started alone halves once the other lane
    starts and takes every thread again when it ends.
    """

    def __init__(self, engine: Engine, model_name: str,
                 before_job: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        # Test hook (fault injection): runs on the worker thread before each job.
        self.before_job = before_job
        self.model_name = model_name
        self.trainers: dict[str, Any] = {}
        self._base: Any = None
        self._base_lock = threading.Lock()
        self._sampler: Any = None
        self._lanes = {TRAIN: _Lane(self, TRAIN), SAMPLE: _Lane(self, SAMPLE)}

    # ── on a lane's thread ──

    def base(self) -> Any:
        with self._base_lock:
            if self._base is None:
                started = time.monotonic()
                self._base = self.engine.load_base(self.model_name)
                log.info("loaded base model %s in %.1fs", self.model_name, time.monotonic() - started)
            return self._base

    @property
    def base_loaded(self) -> bool:
        return self._base is not None

    def sampler(self) -> Any:
        if self._sampler is None:
            self._sampler = self.engine.new_sampler(self.base().twin)
        return self._sampler

    def sampler_adapters(self) -> list[str]:
        """Keys of the adapters the sampler engine holds (read racily, for display)."""
        return list(self._sampler.loaded_adapters) if self._sampler is not None else []

    def unload_sampler_adapter(self, key: str) -> None:
        """Drop an adapter from the sampler engine's cache (no-op if it is not loaded)."""
        if self._sampler is not None:
            self._sampler.unload_adapter(key)

    def _share(self, lane: _Lane) -> int:
        """The torch threads ``lane`` may use now: all of them alone, half beside the other."""
        total = _process_threads or process_threads()
        others_busy = any(other.busy for other in self._lanes.values() if other is not lane)
        return max(1, total // 2) if others_busy else total

    def set_thread_budget(self, lane: _Lane) -> None:
        import torch

        want = self._share(lane)
        lane.uses_threads(want)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        lane.threads = want

    def redeciding(self, lane: _Lane) -> Any:
        """A context for ``lane``'s job: its share decided again at each of the engine's
        checkpoints (engine/thread_budget.py). Async RL submits a step's forward_backward a
        few milliseconds before the next batch's sample request, so the training job started
        alone with both cores and kept them beside the sampler. In one pair of async runs of the
        tiny RL example, its forward_backward beside the sampler took 273 ms on average without
        the re-decision and 209 ms with it (about 115 ms alone)."""
        from baseten_loops_cli.local.engine import thread_budget

        def decide() -> None:
            if self._share(lane) != lane.threads:
                self.set_thread_budget(lane)

        return thread_budget.deciding(decide)

    def restore_thread_budget(self) -> None:
        """After a job: set the full budget again. ``torch.set_num_threads`` also stores a
        process-wide value that every thread's *first* torch call adopts (ATen's lazy
        per-thread init), so a lane left at half would hand half to every thread that starts
        later: another model's lanes (which then took half as their whole budget, for good),
        request threads, the next server-side helper (issue 33's slowdown after sampling)."""
        if not _torch_imported():
            return
        import torch

        total = process_threads()
        if torch.get_num_threads() != total:
            torch.set_num_threads(total)

    @property
    def threads_total(self) -> int:
        return process_threads()

    # ── from any thread ──

    @property
    def busy_seconds(self) -> float:
        return sum(lane.busy_seconds for lane in self._lanes.values())

    @property
    def jobs_done(self) -> int:
        return sum(lane.jobs_done for lane in self._lanes.values())

    @property
    def current_jobs(self) -> list[str]:
        return [job for job in (lane.current_job for lane in self._lanes.values()) if job]

    def submit(self, label: str, fn: Callable[[], T], lane: str = TRAIN) -> "concurrent.futures.Future[T]":
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._lanes[lane].jobs.put((future, label, fn))
        return future

    async def run(self, label: str, fn: Callable[[], T], lane: str = TRAIN) -> T:
        """Run ``fn`` on a lane and await its result without blocking the loop."""
        return await asyncio.wrap_future(self.submit(label, fn, lane))

    def stop(self, timeout: float | None = None) -> None:
        for lane in self._lanes.values():
            lane.close()
        for lane in self._lanes.values():
            lane.thread.join(timeout)


class ComputePool:
    """The model workers, created on first use."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.before_job: Callable[[str], None] | None = None
        # Test hook (fault injection): runs on a worker thread after each streamed token.
        self.after_token: Callable[[], None] | None = None
        self._workers: dict[str, ModelWorker] = {}
        self._lock = threading.Lock()

    def worker(self, model_name: str) -> ModelWorker:
        with self._lock:
            worker = self._workers.get(model_name)
            if worker is None:
                worker = self._workers[model_name] = ModelWorker(self.engine, model_name,
                                                                 self.before_job)
            return worker

    def workers(self) -> list[ModelWorker]:
        with self._lock:
            return list(self._workers.values())

    def status(self) -> list[dict[str, Any]]:
        """What ``/v1/local/status`` reports per model (read racily, for display only)."""
        return [_worker_status(w) for w in self.workers()]

    def stop(self, timeout: float = 30.0) -> None:
        for worker in self.workers():
            worker.stop(timeout)


def _worker_status(w: ModelWorker) -> dict[str, Any]:
    jobs = w.current_jobs  # read once, so current_job is always one of current_jobs
    return {
        "model": w.model_name,
        "base_loaded": w.base_loaded,
        "trainers_in_memory": sorted(w.trainers),
        "sampler_adapters_in_memory": w.sampler_adapters(),
        # What each lane is running now (compute first); current_job: the first of them.
        "current_jobs": jobs,
        "current_job": jobs[0] if jobs else None,
        "jobs_done": w.jobs_done,
        "busy_seconds": round(w.busy_seconds, 3),
    }
