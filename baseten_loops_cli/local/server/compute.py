"""The bridge between the async server and the torch engine (``local/engine``).

Model compute never runs on the event loop: a forward/backward on CPU takes seconds, and
the loop must keep answering long-polls, listings and health checks meanwhile. Instead
each base model gets one :class:`ModelWorker`, a thread that owns everything touching
that model's weights — the loaded base, every run's LoRA trainer on it, and its sampler
engine — and runs jobs strictly in submission order. One thread per base model (not per
run) because runs on the same base share its weights and PEFT swaps adapters in place;
two threads mutating one module would race.

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

    def __init__(self) -> None:
        self._modules: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._specs: dict[str, ModelSpec] | None = None

    def _load(self) -> dict[str, Any]:
        with self._lock:
            if self._modules is None:
                from baseten_loops_cli.local.engine import (
                    datums,
                    errors,
                    losses,
                    model_zoo,
                    registry,
                    sampler,
                    trainer,
                )

                self._modules = {"errors": errors, "registry": registry, "sampler": sampler,
                                 "trainer": trainer, "losses": losses, "datums": datums,
                                 "model_zoo": model_zoo}
            return self._modules

    @property
    def loaded(self) -> bool:
        return self._modules is not None

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


class ModelWorker:
    """One thread, one base model, jobs in submission order.

    Jobs are plain callables run on the worker thread; they may use ``self.base()``,
    ``self.trainers`` (run id -> LoraTrainer) and ``self.sampler()``. Only the worker
    thread touches those, so they need no locks.
    """

    def __init__(self, engine: Engine, model_name: str,
                 before_job: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        # Test hook (fault injection): runs on the worker thread before each job.
        self.before_job = before_job
        self.model_name = model_name
        self.trainers: dict[str, Any] = {}
        self._base: Any = None
        self._sampler: Any = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_seconds = 0.0
        self.jobs_done = 0
        self.current_job: str | None = None
        self._thread = threading.Thread(
            target=self._loop, name=f"loops-compute[{model_name}]", daemon=True
        )
        self._thread.start()

    # ── on the worker thread ──

    def base(self) -> Any:
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
            self._sampler = self.engine.new_sampler(self.base())
        return self._sampler

    def sampler_adapters(self) -> list[str]:
        """Keys of the adapters the sampler engine holds (read racily, for display)."""
        return list(self._sampler.loaded_adapters) if self._sampler is not None else []

    def unload_sampler_adapter(self, key: str) -> None:
        """Drop an adapter from the sampler engine's cache (no-op if it is not loaded)."""
        if self._sampler is not None:
            self._sampler.unload_adapter(key)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            future, label, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            self.current_job = label
            started = time.monotonic()
            try:
                if self.before_job is not None:
                    self.before_job(label)
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
            finally:
                self.busy_seconds += time.monotonic() - started
                self.jobs_done += 1
                self.current_job = None

    # ── from any thread ──

    def submit(self, label: str, fn: Callable[[], T]) -> "concurrent.futures.Future[T]":
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((future, label, fn))
        return future

    async def run(self, label: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this worker and await its result without blocking the loop."""
        return await asyncio.wrap_future(self.submit(label, fn))

    def stop(self, timeout: float | None = None) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


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
        return [
            {
                "model": w.model_name,
                "base_loaded": w.base_loaded,
                "trainers_in_memory": sorted(w.trainers),
                "sampler_adapters_in_memory": w.sampler_adapters(),
                "current_job": w.current_job,
                "jobs_done": w.jobs_done,
                "busy_seconds": round(w.busy_seconds, 3),
            }
            for w in self.workers()
        ]

    def stop(self, timeout: float = 30.0) -> None:
        for worker in self.workers():
            worker.stop(timeout)
