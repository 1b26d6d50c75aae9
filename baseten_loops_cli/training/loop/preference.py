"""What the preference kinds (``dpo``, ``kto``) share: the reference policy and its scores,
the config checks of a reference and of a loss's parameters, the rows a run uses, and their
part of the one training loop (:class:`PreferenceSteps`: the reference pass before step 1 and
the step-0 eval baseline).

Before step 1, every sequence the run uses (train rows some step trains, and the eval split) is
scored once by the reference policy, the way the SDK's ``helpers.datum.attach_reference_logprobs``
does it: a sampler's prompt logprobs, shifted onto the trainer's positions. The reference is
the policy as the run starts (``reference: base``; published to the run's sampler as
``dpo-reference`` before any optimizer step, the SDK's recipe) or a sampler checkpoint. The
scores go to ``reference_logprobs.jsonl`` in the run directory as they arrive, keyed by the
sequence's tokens, so a resumed run reuses them and trains on exactly the same numbers.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING, Any

from pydantic import ValidationInfo

from baseten_loops_cli.errors import ConfigError, LoopsError
from baseten_loops_cli.training.losses import preference_losses as pl
from baseten_loops_cli.training.config import ConfigT, config_error
from baseten_loops_cli.training.data.datums import batches_for_step, dpo_datum, reference_logprobs_field
from baseten_loops_cli.training.loop.core import Loop, StepHooks, total_steps
from baseten_loops_cli.training.session import StopRequested, TrainingSession

if TYPE_CHECKING:
    from baseten_loops_cli.training.kinds import Kind

REFERENCE_CHECKPOINT = "dpo-reference"
_SCORES_IN_FLIGHT = 32  # reference-scoring requests at once (a local sampler batches them)
_SCORES_PER_APPEND = 64  # and made durable in chunks of this many


def reference_value(value: str) -> str:
    """A config's ``reference``: ``base`` or a sampler checkpoint's URI (ValueError otherwise)."""
    if value == "base":
        return value
    from baseten_loops_cli.api.uri import CheckpointUri

    if not CheckpointUri.is_uri(value):
        raise ValueError(f"expected 'base' or bt://loops:<run_id>/sampler_weights/<name>, not {value!r}")
    uri = CheckpointUri.parse(value)
    if uri.target != "sampler":
        raise ValueError(
            f"{value} is trainer state; the reference is scored by a sampler, so name its sampler checkpoint "
            f"bt://loops:{uri.run_id}/sampler_weights/{uri.name}"
        )
    return value


def param_key(info: ValidationInfo) -> str:
    """The config key of the loss parameter a field validator checks (``lambda_`` is ``lambda``)."""
    name = info.field_name or ""  # always set in a field validator
    return "lambda" if name == "lambda_" else name


def param_error(loss: str, key: str, value: Any) -> Exception | None:
    """The config error for one loss parameter ``key: value`` under ``loss`` (a parameter of
    another loss, not a number, out of bounds), or None: ``preference_losses.param_problems``
    as a config model's validator raises it (the file:line of the key comes with it)."""
    problems = pl.param_problems(loss, {key: value})
    if not problems:
        return None
    message = problems[0].message
    for prefix in (f"{key}: ", f"{key} "):
        message = message.removeprefix(prefix)
    return config_error(message, problems[0].fix)


def rows_to_train(n_train: int, config: Any, start_step: int = 0) -> list[int]:
    """The train rows that steps ``start_step``.. of the run use, each once, in order of first
    use: what the reference pass scores. A run cut short by ``max_steps`` (or resumed near
    its end) scores its own batches only, not the whole split."""
    used: dict[int, None] = {}
    for step in range(start_step, total_steps(n_train, config.batch_size, config.epochs, config.max_steps)):
        used.update(dict.fromkeys(batches_for_step(n_train, config.batch_size, step, seed=config.seed,
                                                   shuffle=config.data.shuffle)))
    return list(used)


def sequence_key(tokens: list[int]) -> str:
    """What a reference score is filed under: the sequence's tokens, so edits to the data
    never pair a sequence with another one's logprobs."""
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:32]


def check_reference(client: Any, loaded: Any) -> None:
    """A checkpoint reference must exist and share the base model: checked before provisioning."""
    config = loaded.config
    if config.reference == "base" or not config.needs_reference:
        return
    found = [c for c in client.checkpoints.list(checkpoint_path=config.reference) if c.target in (None, "sampler")]
    where = loaded.where("reference")
    if not found:
        run_id = config.reference.split("bt://loops:", 1)[-1].split("/", 1)[0]
        raise ConfigError(
            f"{where}: reference: no checkpoint {config.reference}",
            hint=f"List that run's checkpoints with `loops checkpoints list --run-id {run_id}`, or use `reference: base`.",
        )
    if found[0].base_model and found[0].base_model != config.base_model:
        raise ConfigError(
            f"{where}: reference: {config.reference} was trained on {found[0].base_model}, not on base_model {config.base_model}"
        )


# ------------------------------------------------------------------ the reference's logprobs
def _reference_sampler(session: TrainingSession, reference: str) -> tuple[Any, str | None]:
    """The sampler client that scores ``reference`` ('base' or a checkpoint), and the checkpoint
    to pin on it."""
    config = session.config
    if reference != "base":
        return session.new_sampler_client(), reference
    if session.start_step == 0:
        # The SDK's recipe: snapshot the policy before any optimizer step (a fresh LoRA adds
        # exactly zero, so this is the base model) and score with the run's own sampler.
        saved = session.trainer.save_weights_for_sampler(
            REFERENCE_CHECKPOINT, ttl_seconds=config.checkpointing.ttl_seconds
        ).result()
        return session.new_sampler_client(), saved["path"]
    # Scores lost after training began (reference_logprobs.jsonl deleted): the base model.
    return session.new_base_sampler_client(), None


def reference_scores(session: TrainingSession, reference: str, sequences: list[Any], sink: Any,
                     stop: StopRequested | None = None) -> dict[str, list[float]]:
    """Every sequence's ``ref_logprobs`` by :func:`sequence_key` (``data.Example``s: DPO's chosen
    and rejected sides, KTO's examples and their KL sequences): those in the run directory, plus
    any missing ones, scored now and appended as they arrive (a Ctrl-C stops after the chunk in
    flight, keeping what was scored)."""
    rundir = session.rundir
    scores = {r["key"]: r["ref_logprobs"] for r in rundir.references()}
    todo: dict[str, list[int]] = {}
    for example in sequences:
        key = sequence_key(example.tokens)
        if key not in scores:
            todo.setdefault(key, example.tokens)
    if not todo:
        return scores
    sink.message(f"Scoring {len(todo)} sequences with the reference policy ({reference})...")
    started = time.monotonic()
    sampler, pin = _reference_sampler(session, reference)
    items = list(todo.items())

    async def score_all() -> None:
        gate = asyncio.Semaphore(_SCORES_IN_FLIGHT)

        async def score(tokens: list[int]) -> list[float]:
            async with gate:
                result = await sampler.asample(
                    tokens, n=1, max_tokens=1, temperature=0.0, prompt_logprobs=True, checkpoint_path=pin
                )  # the SDK's SamplingClient.compute_logprobs
            logprobs = result.prompt_logprobs or []
            if len(logprobs) != len(tokens):
                raise LoopsError(
                    f"the reference sampler returned {len(logprobs)} prompt logprobs for a {len(tokens)}-token sequence"
                )
            return reference_logprobs_field(logprobs)

        try:
            for start in range(0, len(items), _SCORES_PER_APPEND):
                if stop is not None and stop.requested:
                    return
                chunk = items[start : start + _SCORES_PER_APPEND]
                results = await asyncio.gather(*(score(tokens) for _, tokens in chunk))
                records = [{"key": key, "ref_logprobs": lps} for (key, _), lps in zip(chunk, results)]
                rundir.append_references(records)
                scores.update((r["key"], r["ref_logprobs"]) for r in records)
                if len(items) > _SCORES_PER_APPEND:
                    sink.message(f"Reference: {min(start + _SCORES_PER_APPEND, len(items))}/{len(items)} sequences scored")
        finally:
            await sampler.aclose()
            sampler.close()

    asyncio.run(score_all())
    sink.message(f"Scored the reference in {time.monotonic() - started:.1f}s.")
    return scores


def sequence_datum(example: Any, scores: dict[str, list[float]] | None) -> dict:
    """The SDK's DPO row of one sequence (``data.dpo_datum``), with its reference logprobs from
    ``scores`` or, for a reference-free loss (``scores`` None), without any."""
    if scores is None:
        datum = dpo_datum(example, [0.0] * len(example.tokens))
        del datum["loss_fn_inputs"]["ref_logprobs"]
        return datum
    return dpo_datum(example, scores[sequence_key(example.tokens)])


def preference_kind(**fields: Any) -> "Kind":
    """The registry entry of a preference kind (DPO, KTO): what both declare, plus ``fields``.
    Shared: the loss is the main metric, the held-out split is ``data.eval``, the reference is
    checked before provisioning (:func:`check_reference`) and served by a sampler (so the base
    model must be on the capabilities API's rl list), and there is no `loops eval` task (pairs
    and labelled completions are not rows it scores: no `eval:` block)."""
    from baseten_loops_cli.training.kinds import Kind

    shared: dict[str, Any] = dict(main_metric="loss", eval_data_key=("data", "eval"), eval_task=None,
                                  capabilities_use_case="rl", check=check_reference)
    return Kind(**{**shared, **fields})


class PreferenceSteps(StepHooks[ConfigT]):
    """The preference kinds' part of the loop: before step 1 the reference scores the sequences
    the run uses (:meth:`sequences` of a row; none for a reference-free loss), and the eval split
    is scored once before training (step 0, the "before" of the final line)."""

    baseline_eval = True
    scores: dict[str, list[float]] | None = None

    def sequences(self, row: Any) -> list[Any]:
        """The rendered sequences of one row the reference scores."""
        raise NotImplementedError

    def reference(self) -> str | None:
        """The reference policy ('base' or a sampler checkpoint); None for a reference-free loss."""
        raise NotImplementedError

    def begin(self, loop: Loop) -> None:
        reference = self.reference()
        if reference is None:
            return
        train, evals = self.data.train, self.data.eval or []
        used = [train[i] for i in rows_to_train(len(train), self.config, self.session.start_step)] + evals
        self.scores = reference_scores(self.session, reference, [s for row in used for s in self.sequences(row)],
                                       loop.sink, loop.stop)
