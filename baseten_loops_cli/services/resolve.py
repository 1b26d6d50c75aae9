"""Turn what users type into the models commands work on: runs, checkpoints, samplers.

A **run** is named by its id. An unknown id fails with one line and, when a known id is close
(a typo, a prefix), a "did you mean" hint.

A **checkpoint** is named in one of three ways:

- its id (the database key of ``GET /v1/loops/checkpoints``: ``vL3pQrS8``);
- its URI, ``bt://loops:<run>/weights/<name>`` (trainer state) or
  ``bt://loops:<run>/sampler_weights/<name>`` (sampler weights);
- ``RUN:NAME``, the name it was saved under in that run. When a trainer and a sampler
  checkpoint share the name, ``--target trainer|sampler`` picks one.

The API has no "get checkpoint by id" route: an id is looked up among the checkpoints of the
caller's runs, one listing per base model. Commands that only need the id (``files``,
``download``) skip that lookup.

Everything returned is a model of ``api.models`` (``LoopsRun``, ``LoopsCheckpoint``,
``LoopsSampler``); the output sink serialises them.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn

from baseten_loops_cli.errors import LoopsError, UsageError

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.api.models import LoopsCheckpoint, LoopsRun, LoopsSampler

TARGETS = ("sampler", "trainer")
_FOLDER_OF = {"trainer": "weights", "sampler": "sampler_weights"}
_TARGET_OF = {v: k for k, v in _FOLDER_OF.items()}

# Trainer deployment statuses that end a trainer, and those of them that are failures (the
# live/terminal sets of api.models, plus the failure subset commands exit 5 on).
TRAINER_TERMINAL = frozenset({"FAILED", "STOPPED", "PREEMPTED"})
TRAINER_FAILED = frozenset({"FAILED", "PREEMPTED"})


class NotFound(LoopsError):
    """A run, checkpoint, sampler or deployment the user named does not exist."""


def extra(model: Any, key: str, default: Any = None) -> Any:
    """A field the backend sent that the protocol's model does not declare (the local backend
    adds ``policy_version``, ``lora_rank``, ``path``, ...); ``default`` when absent."""
    value = (getattr(model, "model_extra", None) or {}).get(key)
    return default if value is None else value


def sampler_is_terminal(sampler: "LoopsSampler | None") -> bool:
    from baseten_loops_cli.api.models import SamplerDeploymentStatus

    return sampler is None or SamplerDeploymentStatus.is_terminal(sampler.status_name)


def suggest(name: str, candidates: Iterable[str | None], *, n: int = 3) -> list[str]:
    """Close matches for ``name``: ids that start with it first, then difflib's."""
    pool = sorted({c for c in candidates if c})
    prefixed = [c for c in pool if c.startswith(name) or name.startswith(c)]
    # One differing character in a short name ("t2" vs "t1") scores 0.5.
    close = difflib.get_close_matches(name, pool, n=n, cutoff=0.5 if len(name) <= 4 else 0.6)
    out: list[str] = []
    for c in prefixed + close:
        if c not in out and c != name:
            out.append(c)
    return out[:n]


def did_you_mean(matches: list[str]) -> str:
    if not matches:
        return ""
    if len(matches) == 1:
        return f"Did you mean {matches[0]}? "
    return f"Did you mean one of {', '.join(matches)}? "


# ── runs ──────────────────────────────────────────────────────────────────────────────────


def not_found(what: str, wanted: str, listing: Callable[[], Iterable[Any]]) -> NotFound:
    """``no WHAT 'wanted'``, with the closest ids of ``listing()`` (when it can be fetched)
    and the `loops WHATs list --all` command."""
    try:
        ids = [item.id for item in listing()]
    except LoopsError:
        ids = []
    return NotFound(
        f"no {what} {wanted!r}",
        hint=f"{did_you_mean(suggest(wanted, ids))}List {what}s with `loops {what}s list --all`.",
    )


def run_not_found(client: "LoopsClient", run_id: str) -> NotFound:
    return not_found("run", run_id, client.runs.list)


def get_run(client: "LoopsClient", run_id: str) -> "LoopsRun":
    """The run (with its paired sampler), or :class:`NotFound` with a suggestion."""
    from baseten_loops_cli.api.errors import NotFoundError

    run_id = run_id.strip()
    if not run_id:
        raise UsageError("a run id is empty")
    try:
        return client.runs.get(run_id)
    except NotFoundError:
        raise run_not_found(client, run_id) from None


# ── checkpoints ──────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class CheckpointRef:
    """A parsed checkpoint reference. ``kind``: ``id`` | ``uri`` | ``name`` (RUN:NAME)."""

    text: str
    kind: str
    id: str | None = None
    run_id: str | None = None
    name: str | None = None
    target: str | None = None


def checkpoint_uri(run_id: str, target: str, name: str) -> str:
    return f"bt://loops:{run_id}/{_FOLDER_OF[target]}/{name}"


def uri_of(cp: "LoopsCheckpoint") -> str | None:
    """The bt:// URI of a checkpoint (the backend's ``path`` when it sends one)."""
    path = extra(cp, "path")
    if path and str(path).startswith("bt://"):
        return str(path)
    if cp.run_id and cp.checkpoint_id and cp.target in _FOLDER_OF:
        return checkpoint_uri(cp.run_id, cp.target, cp.checkpoint_id)
    return None


def display_name(cp: "LoopsCheckpoint") -> str:
    """``RUN:NAME`` of a checkpoint (what people type back)."""
    return f"{cp.run_id}:{cp.checkpoint_id}"


def parse_target(target: str | None) -> str | None:
    if target is None:
        return None
    value = target.strip().lower()
    if value not in TARGETS:
        raise UsageError(f"--target must be 'sampler' or 'trainer', got {target!r}",
                         hint="sampler: weights to sample or deploy; trainer: training state to resume.")
    return value


def parse_checkpoint_ref(text: str, target: str | None = None) -> CheckpointRef:
    """Parse ``text`` (id | bt:// URI | RUN:NAME); ``target`` narrows a RUN:NAME and must agree
    with a URI's folder."""
    text = text.strip()
    target = parse_target(target)
    if not text:
        raise UsageError("empty checkpoint reference", hint="Name it by id, bt:// URI or RUN:NAME.")
    if text.startswith(("bt://", "abt://")):
        from baseten_loops_cli.api.uri import CheckpointUri

        parsed = CheckpointUri.parse(text)
        uri_target = _TARGET_OF[parsed.directory]
        if target and target != uri_target:
            raise UsageError(
                f"--target {target} contradicts {text} (a {uri_target} checkpoint)",
                hint="Drop --target: the URI's folder already says which checkpoint it is.",
            )
        canonical = checkpoint_uri(parsed.run_id, uri_target, parsed.name)
        return CheckpointRef(canonical, "uri", run_id=parsed.run_id, name=parsed.name, target=uri_target)
    if "://" in text:
        raise UsageError(
            f"unsupported checkpoint URI {text!r}",
            hint="Use bt://loops:<run>/weights/<name> or bt://loops:<run>/sampler_weights/<name>, RUN:NAME, or an id.",
        )
    if ":" in text:
        run_id, _, name = text.partition(":")
        if not run_id or not name:
            raise UsageError(f"malformed checkpoint reference {text!r}", hint="Write it as RUN:NAME, e.g. abc1234:step-100.")
        return CheckpointRef(text, "name", run_id=run_id, name=name, target=target)
    if "/" in text:
        raise UsageError(
            f"malformed checkpoint reference {text!r}",
            hint="Name a checkpoint by id, bt:// URI or RUN:NAME.",
        )
    return CheckpointRef(text, "id", id=text, target=target)


def checkpoints_of_run(client: "LoopsClient", run_id: str) -> "list[LoopsCheckpoint]":
    """The run's checkpoints; an unknown run is :class:`NotFound` with a suggestion (the
    listing itself returns an empty list for it)."""
    cps = client.checkpoints.list(run_id=run_id)
    if not cps:
        get_run(client, run_id)  # raises NotFound for a typo
    return cps


def all_checkpoints(client: "LoopsClient", *, scope: str | None = None) -> "list[LoopsCheckpoint]":
    """Every checkpoint of the caller's runs: one listing per base model (the API filters by
    exactly one of run, base model or URI)."""
    runs = client.runs.list(scope=scope) if scope else client.runs.list()
    models = sorted({r.base_model for r in runs if r.base_model})
    seen: dict[str, LoopsCheckpoint] = {}
    for model in models:
        for cp in client.checkpoints.list(base_model=model):
            seen.setdefault(cp.id, cp)
    # Runs whose base model listing missed them (older backends scope by owner): by run.
    if not models:
        for r in runs:
            for cp in client.checkpoints.list(run_id=r.id):
                seen.setdefault(cp.id, cp)
    return list(seen.values())


def checkpoint_by_uri(client: "LoopsClient", uri: str) -> "LoopsCheckpoint | None":
    from baseten_loops_cli.api.errors import NotFoundError

    try:
        found = client.checkpoints.list(checkpoint_path=uri)
    except NotFoundError:
        return None
    return found[0] if found else None


def resolve_checkpoint(
    client: "LoopsClient", text: str, target: str | None = None, *, prefer: str | None = None
) -> "LoopsCheckpoint":
    """The checkpoint named by ``text``, or :class:`NotFound` / :class:`UsageError`.

    ``prefer`` (a target) settles a RUN:NAME shared by a trainer and a sampler checkpoint
    without --target (e.g. ``deploy`` and ``sample`` mean the sampler one)."""
    ref = parse_checkpoint_ref(text, target)
    if ref.kind == "uri":
        found = checkpoint_by_uri(client, ref.text)
        if found:
            return found
        _not_found_in_run(client, ref)
    if ref.kind == "name":
        return _by_name(client, ref, prefer)
    cps = all_checkpoints(client)
    for cp in cps:
        if cp.id == ref.id:
            if ref.target and cp.target != ref.target:
                raise UsageError(f"checkpoint {ref.id} is a {cp.target} checkpoint, not {ref.target}")
            return cp
    hint = did_you_mean(suggest(ref.id or "", [c.id for c in cps]))
    raise NotFound(
        f"no checkpoint {ref.id!r}",
        hint=f"{hint}Name a checkpoint by id, bt:// URI or RUN:NAME; list them with `loops checkpoints list`.",
    )


def _by_name(client: "LoopsClient", ref: CheckpointRef, prefer: str | None = None) -> "LoopsCheckpoint":
    cps = checkpoints_of_run(client, ref.run_id or "")
    in_target = [c for c in cps if ref.target is None or c.target == ref.target]
    matches = [c for c in in_target if c.checkpoint_id == ref.name]
    if len(matches) > 1 and prefer:
        matches = [c for c in matches if c.target == prefer] or matches
    if len(matches) == 1:
        return matches[0]
    if matches:
        listed = ", ".join(f"{c.id} ({c.target})" for c in matches)
        raise UsageError(
            f"{len(matches)} checkpoints of run {ref.run_id} are named {ref.name!r}: {listed}",
            hint="Pick one with --target sampler|trainer, or name it by id.",
        )
    _not_found_in_run(client, ref, cps)


def _not_found_in_run(client: "LoopsClient", ref: CheckpointRef, cps: "list[LoopsCheckpoint] | None" = None) -> NoReturn:
    if cps is None:
        cps = checkpoints_of_run(client, ref.run_id or "")
    in_target = [c for c in cps if ref.target is None or c.target == ref.target]
    scope = f" {ref.target}" if ref.target else ""
    other = [c for c in cps if c.checkpoint_id == ref.name and c not in in_target]
    suffixed = _suffixed_saves(ref.name or "", in_target)
    if other:
        hint = f"There is a {other[0].target} checkpoint of that name (--target {other[0].target}). "
    elif suffixed:
        hint = f"Serverless saves get a unique suffix; newest under that name: {', '.join(suffixed)}. "
    else:
        hint = did_you_mean(suggest(ref.name or "", [c.checkpoint_id for c in in_target]))
    raise NotFound(
        f"no{scope} checkpoint named {ref.name!r} in run {ref.run_id}",
        hint=f"{hint}List them with `loops checkpoints list --run-id {ref.run_id}`.",
    )


def _suffixed_saves(name: str, cps: "list[LoopsCheckpoint]", limit: int = 3) -> list[str]:
    """Names ``{name}-<32 hex>`` (serverless publishes), newest first."""
    pattern = re.compile(r"(?:-[0-9a-f]{32})+")
    saves = [c for c in cps if c.checkpoint_id.startswith(name) and pattern.fullmatch(c.checkpoint_id[len(name):])]
    saves.sort(key=created_key, reverse=True)
    return [display_name(c) for c in saves[:limit]]


def checkpoint_id_of(client: "LoopsClient", text: str, target: str | None = None) -> "tuple[str, LoopsCheckpoint | None]":
    """The id of the checkpoint ``text`` names, and the checkpoint when it had to be looked up
    (an id is used as is: the files route reports an unknown one)."""
    ref = parse_checkpoint_ref(text, target)
    if ref.kind == "id":
        return ref.id or "", None
    cp = resolve_checkpoint(client, text, target)
    return cp.id, cp


def created_key(model: Any) -> float:
    """Sort key: ``created_at`` as epoch seconds; a model without it counts as the oldest."""
    created = getattr(model, "created_at", None)
    return created.timestamp() if created is not None else float("-inf")


# ── samplers ─────────────────────────────────────────────────────────────────────────────


def get_sampler(client: "LoopsClient", sampler_id: str) -> "LoopsSampler":
    from baseten_loops_cli.api.errors import NotFoundError

    try:
        return client.samplers.get(sampler_id)
    except NotFoundError:
        raise not_found("sampler", sampler_id, client.samplers.list) from None
