"""The teacher of on-policy distillation: who scores the student's tokens, and how.

A teacher is a Loops sampler checkpoint (``RUN:NAME`` or a ``bt://`` URI), a base model served
by a sampler of the run's backend, or an OpenAI-compatible endpoint that returns prompt
logprobs (``/completions`` with ``echo`` + ``logprobs``: vLLM, a ``loops deploy`` URL). Every
form answers the same question: the teacher's logprob of each token of prompt + completion
(and, for the agreement metric, its top-1 choice at each position). Only the protocol's
sampler routes or the endpoint's public API are used, so a teacher works on every backend.

The teacher must tokenize as the student does (its logprobs are of the student's token ids):
:func:`check_same_tokenizer` compares them before anything is provisioned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from baseten_loops_cli.errors import ConfigError

# Texts both tokenizers must encode alike: ASCII, digits, whitespace runs, punctuation, accents,
# CJK and an emoji (byte-level fallbacks differ first on these).
_PROBES = (
    "What is 37 + 45? ANSWER: 82",
    "  Hello,\tworld!\n\nThe quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # 0123456789",
    "Ünïcödé naïve café — “quotes” 東京 🙂",
)


def is_checkpoint_ref(text: str) -> bool:
    """``RUN:NAME`` or a ``bt://`` URI (base model names never contain a colon)."""
    return text.startswith("bt://") or ":" in text


def check_same_tokenizer(student: Any, teacher: Any, *, student_name: str, teacher_name: str, where: str) -> None:
    """Raise when the teacher's tokenizer is not the student's: same vocabulary size, same end
    token, and the same ids for every probe text."""
    problems = []
    if getattr(student, "vocab_size", None) != getattr(teacher, "vocab_size", None):
        problems.append(f"vocabulary {getattr(teacher, 'vocab_size', '?')} tokens, not {getattr(student, 'vocab_size', '?')}")
    elif any(student.encode(text) != teacher.encode(text) for text in _PROBES):
        problems.append("the same text encodes to other token ids")
    if problems:
        raise TeacherError(
            f"{where}: the teacher {teacher_name} has another tokenizer than the student {student_name} ({problems[0]})",
            hint="Distillation scores the student's own token ids: pick a teacher of the same model family "
                 "(the same tokenizer), e.g. a checkpoint trained on the student's base model.",
        )


class TeacherError(ConfigError):
    """The teacher cannot score the student's tokens (another tokenizer, no prompt logprobs,
    an endpoint that does not answer)."""


@dataclass
class TeacherScores:
    """The teacher's view of one sequence's completion: a logprob per completion token, and
    whether each token was the teacher's top-1 choice (None when the teacher did not say)."""

    logprobs: list[float]
    agrees: list[bool] | None


# ------------------------------------------------------------------ an OpenAI-compatible endpoint
@dataclass
class Endpoint:
    """``teacher.url`` (+ ``model`` and the key's environment variable): the key is read from
    the environment when a request is made and never stored."""

    url: str
    model: str | None
    api_key_env: str | None
    where: str = "teacher.url"

    def _client(self) -> Any:
        from baseten_loops_cli.api.http import HttpClient

        headers = {}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise TeacherError(
                    f"{self.where}: the environment variable {self.api_key_env} (teacher.api_key_env) is not set",
                    hint=f"export {self.api_key_env}=... before running, or remove teacher.api_key_env for an endpoint without a key.",
                )
            headers["Authorization"] = f"Bearer {key}"
        return HttpClient(self.url, None, headers=headers, timeout=120.0, max_retries=3)

    def body(self, tokens: list[int], model: str) -> dict:
        # max_tokens 1 (not 0): every OpenAI-compatible server accepts it; the token is ignored.
        return {"model": model, "prompt": list(tokens), "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}

    def _failure(self, exc: Exception) -> TeacherError:
        from baseten_loops_cli.api.errors import AuthenticationError, NotFoundError

        if isinstance(exc, AuthenticationError):
            return TeacherError(
                f"{self.where}: {self.url} refused the key (401/403)",
                hint="Name the environment variable holding the endpoint's key in teacher.api_key_env and export it.",
            )
        if isinstance(exc, NotFoundError):
            return TeacherError(
                f"{self.where}: {self.url} has no OpenAI /completions route (404)",
                hint="Give the endpoint's OpenAI base URL, ending in /v1 (a `loops deploy` URL does).",
            )
        return TeacherError(
            f"{self.where}: {self.url} does not answer ({type(exc).__name__})",
            hint="Check the URL and that the server is up (curl URL/models).",
        )

    def model_name(self, client: Any) -> str:
        if self.model:
            return self.model
        models = client.send("GET", "/models").json().get("data") or []
        if not models:
            raise TeacherError(f"{self.where}: {self.url}/models lists no model", hint="Name it in teacher.model.")
        return str(models[0]["id"])

    def parse(self, payload: Any, n_tokens: int) -> tuple[list[float | None], list[str], list[str | None]]:
        """(logprob, token text, top-1 token text) per prompt position, from an echo answer."""
        try:
            logprobs = payload["choices"][0]["logprobs"]
            values = logprobs["token_logprobs"]
            texts = logprobs.get("tokens") or []
            tops = logprobs.get("top_logprobs") or []
        except (KeyError, IndexError, TypeError):
            values = None
        if not values or len(values) < n_tokens:
            raise TeacherError(
                f"{self.where}: {self.url} returned no prompt logprobs (asked with echo: true, logprobs: 1)",
                hint="The teacher endpoint must score the prompt (vLLM and `loops deploy` do); use a checkpoint "
                     "or base model teacher otherwise.",
            )
        top1 = [max(t, key=t.__getitem__) if isinstance(t, dict) and t else None for t in tops[:n_tokens]]
        return list(values[:n_tokens]), [str(t) for t in texts[:n_tokens]], top1

    def check(self, student: Any, student_name: str) -> None:
        """Before provisioning: the endpoint answers, scores prompts, and tokenizes as the student."""
        from baseten_loops_cli.errors import LoopsError

        client = self._client()
        try:
            probe = _PROBES[0]
            tokens = student.encode(probe)
            try:
                model = self.model_name(client)
                payload = client.send("POST", "/completions", json=self.body(tokens, model), repeatable=True).json()
            except TeacherError:
                raise
            except (LoopsError, ValueError) as exc:
                raise self._failure(exc) from None
            _, texts, _ = self.parse(payload, len(tokens))
            if len(texts) != len(tokens) or "".join(texts) != probe:
                raise TeacherError(
                    f"{self.where}: the teacher at {self.url} has another tokenizer than the student {student_name} "
                    f"(it split a {len(tokens)}-token probe differently)",
                    hint="Distillation scores the student's own token ids: serve a teacher of the student's model family.",
                )
        finally:
            client.close()

    async def ascore(self, client: Any, model: str, tokens: list[int], prompt_len: int) -> TeacherScores:
        from baseten_loops_cli.errors import LoopsError

        try:
            resp = await client.asend("POST", "/completions", json=self.body(tokens, model), repeatable=True)
        except LoopsError as exc:
            raise self._failure(exc) from None
        values, texts, top1 = self.parse(resp.json(), len(tokens))
        tail = slice(prompt_len, len(tokens))
        logprobs = [float(v) if v is not None else 0.0 for v in values[tail]]
        tops = top1[tail]
        agrees = [t == s for t, s in zip(tops, texts[tail])] if all(t is not None for t in tops) else None
        return TeacherScores(logprobs, agrees)


# ------------------------------------------------------------------ a sampler (checkpoint or base model)
class ServedModel:
    """A model served by a sampler of the run's backend, for one run: a sampler checkpoint
    (``RUN:NAME``, ``bt://``; its run's live sampler pinned to it, or a standalone sampler
    started for it and deactivated by :meth:`close`) or a base model (a standalone sampler in the
    run's session, deactivated with the session). Only the SDK's sampling route is used, so it
    serves the same way on every backend. The distillation teacher and the judge share it."""

    def __init__(self, session: Any, model: str):
        self.session = session
        self.model = model
        self._source = None
        if is_checkpoint_ref(model):
            from baseten_loops_cli.services.sampling import resolve_source

            self._source = resolve_source(session.client, model)

    @property
    def base_model(self) -> str:
        """The base model whose tokenizer and chat template the served model uses."""
        return self._source.base_model if self._source is not None else self.model

    def client(self) -> tuple[Any, str | None]:
        """(a new SamplerClient, the checkpoint path to pin each request to, or None)."""
        if self._source is not None:
            from baseten_loops_cli.workers.sampler import TRAINING_SAMPLE_TIMEOUT_S, SamplerClient

            source = self._source
            # the wait of every training sampler client, not the client's 300 s
            client = SamplerClient(source.sampler.base_url, api_key=self.session.api_key, run_id=source.run_header,
                                   sampler_id=None if source.run_header else source.sampler.id,
                                   timeout=TRAINING_SAMPLE_TIMEOUT_S)  # fmt: skip
            return client, source.pin
        return self.session.new_model_sampler_client(self.model), None

    def close(self) -> None:
        if self._source is not None and self._source.started_sampler:
            from baseten_loops_cli.errors import LoopsError

            try:
                self.session.client.samplers.deactivate(self._source.sampler.id)
            except LoopsError:
                pass


async def ascore_with_sampler(sampler: Any, tokens: list[int], prompt_len: int, pin: str | None) -> TeacherScores:
    """Prompt logprobs (with the top-1 alternative) of prompt + completion from a sampler."""
    result = await sampler.asample(
        tokens, n=1, max_tokens=1, temperature=1.0, prompt_logprobs=True, topk_prompt_logprobs=1, checkpoint_path=pin
    )
    scored = result.prompt_logprobs or []
    if len(scored) < len(tokens):
        raise TeacherError(
            f"teacher: the sampler returned {len(scored)} prompt logprobs for a {len(tokens)}-token sequence",
            hint="The teacher's sampler must support prompt_logprobs (every Loops sampler does).",
        )
    logprobs = [float(x) if x is not None else 0.0 for x in scored[prompt_len : len(tokens)]]
    topk = result.topk_prompt_logprobs
    agrees = None
    if topk is not None and len(topk) >= len(tokens):
        # each position's entry holds the actual token and the top-1: the argmax is the teacher's choice
        agrees = [bool(alts) and max(alts, key=lambda a: a[1])[0] == tok for alts, tok in zip(topk[prompt_len : len(tokens)], tokens[prompt_len:])]
    return TeacherScores(logprobs, agrees)
