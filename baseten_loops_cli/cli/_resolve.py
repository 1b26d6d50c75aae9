"""Turn what users type into the objects commands work on: runs, checkpoints, samplers.

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

Everything returned is plain JSON (dicts): the shapes of loops-protocol.md §2.3, whatever the
client's models are.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, NoReturn

from baseten_loops_cli.errors import LoopsError, UsageError

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient

TARGETS = ("sampler", "trainer")
_FOLDER_OF = {"trainer": "weights", "sampler": "sampler_weights"}
_TARGET_OF = {v: k for k, v in _FOLDER_OF.items()}

# Run statuses (§2.4)
RUN_ACTIVE = "ACTIVE"
# Trainer deployment statuses
TRAINER_LIVE = frozenset({"CREATED", "DEPLOYING", "RUNNING"})
TRAINER_TERMINAL = frozenset({"FAILED", "STOPPED", "PREEMPTED"})
TRAINER_FAILED = frozenset({"FAILED", "PREEMPTED"})
# Sampler (DeploymentStatusV1) statuses
SAMPLER_LIVE = frozenset({"ACTIVE", "BUILDING", "DEPLOYING", "LOADING_MODEL", "UPDATING", "WAKING_UP"})
SAMPLER_TERMINAL = frozenset(
    {"DEPLOY_FAILED", "UNHEALTHY", "BUILD_FAILED", "BUILD_STOPPED", "DEACTIVATING", "INACTIVE", "FAILED"}
)


class NotFound(LoopsError):
    """A run, checkpoint, sampler or deployment the user named does not exist."""


def as_dict(value: Any) -> Any:
    """Plain JSON of a client result (pydantic model, dict or list)."""
    from baseten_loops_cli.output.sink import to_jsonable

    return to_jsonable(value)


def status_name(obj: dict | None) -> str | None:
    """``status.name`` of a run/sampler/deployment (``status`` may also be a bare string)."""
    if not obj:
        return None
    status = obj.get("status")
    if isinstance(status, dict):
        return status.get("name")
    return status


def suggest(name: str, candidates: Iterable[str], *, n: int = 3) -> list[str]:
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


def _list_runs_quietly(client: "LoopsClient", **kwargs: Any) -> list[dict]:
    try:
        return as_dict(client.runs.list(**kwargs)) or []
    except LoopsError:
        return []


def run_not_found(client: "LoopsClient", run_id: str) -> NotFound:
    ids = [r.get("id") for r in _list_runs_quietly(client)]
    return NotFound(
        f"no run {run_id!r}",
        hint=f"{did_you_mean(suggest(run_id, ids))}List runs with `loops runs list --all`.",
    )


def get_run(client: "LoopsClient", run_id: str) -> dict:
    """The run (``LoopsRun`` JSON, with its paired sampler), or :class:`NotFound` with a
    suggestion."""
    from baseten_loops_cli.api.errors import NotFoundError

    run_id = run_id.strip()
    if not run_id:
        raise UsageError("a run id is empty")
    try:
        return as_dict(client.runs.get(run_id))
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

    @property
    def uri(self) -> str | None:
        if self.run_id and self.name and self.target:
            return checkpoint_uri(self.run_id, self.target, self.name)
        return None


def checkpoint_uri(run_id: str, target: str, name: str) -> str:
    return f"bt://loops:{run_id}/{_FOLDER_OF[target]}/{name}"


def uri_of(cp: dict) -> str | None:
    """The bt:// URI of a checkpoint JSON object."""
    if cp.get("path") and str(cp["path"]).startswith("bt://"):
        return cp["path"]
    if cp.get("run_id") and cp.get("checkpoint_id") and cp.get("target") in _FOLDER_OF:
        return checkpoint_uri(cp["run_id"], cp["target"], cp["checkpoint_id"])
    return None


def parse_target(target: str | None) -> str | None:
    if target is None:
        return None
    value = target.strip().lower()
    if value not in TARGETS:
        raise UsageError(f"--target must be 'sampler' or 'trainer', got {target!r}")
    return value


def parse_checkpoint_ref(text: str, target: str | None = None) -> CheckpointRef:
    """Parse ``text`` (id | bt:// URI | RUN:NAME); ``target`` narrows a RUN:NAME and must agree
    with a URI's folder."""
    text = text.strip()
    target = parse_target(target)
    if not text:
        raise UsageError("empty checkpoint reference", hint="Name it by id, bt:// URI or RUN:NAME.")
    if text.startswith(("bt://", "abt://")):
        run_id, folder, name = _split_uri(text)
        uri_target = _TARGET_OF[folder]
        if target and target != uri_target:
            raise UsageError(
                f"--target {target} contradicts {text} (a {uri_target} checkpoint)",
                hint="Drop --target: the URI's folder already says which checkpoint it is.",
            )
        canonical = checkpoint_uri(run_id, uri_target, name)
        return CheckpointRef(canonical, "uri", run_id=run_id, name=name, target=uri_target)
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


def _split_uri(text: str) -> tuple[str, str, str]:
    """``bt://loops:<run>/<folder>/<name>`` -> (run, folder, name); a malformed URI is a usage
    error naming the expected form."""
    from baseten_loops_cli.api.uri import CheckpointUri

    parsed = CheckpointUri.parse(text)
    return parsed.run_id, parsed.directory, parsed.name




def list_checkpoints(client: "LoopsClient", **filters: Any) -> list[dict]:
    return as_dict(client.checkpoints.list(**filters)) or []


def checkpoints_of_run(client: "LoopsClient", run_id: str) -> list[dict]:
    """The run's checkpoints; an unknown run is :class:`NotFound` with a suggestion (the
    listing itself returns an empty list for it)."""
    cps = list_checkpoints(client, run_id=run_id)
    if not cps:
        get_run(client, run_id)  # raises NotFound for a typo
    return cps


def all_checkpoints(client: "LoopsClient", *, scope: str | None = None) -> list[dict]:
    """Every checkpoint of the caller's runs: one listing per base model (the API filters by
    exactly one of run, base model or URI)."""
    runs = as_dict(client.runs.list(scope=scope) if scope else client.runs.list()) or []
    models = sorted({r.get("base_model") for r in runs if r.get("base_model")})
    seen: dict[str, dict] = {}
    for model in models:
        for cp in list_checkpoints(client, base_model=model):
            seen.setdefault(cp.get("id"), cp)
    # Runs whose base model listing missed them (older backends scope by owner): by run.
    if not models:
        for r in runs:
            for cp in list_checkpoints(client, run_id=r["id"]):
                seen.setdefault(cp.get("id"), cp)
    return list(seen.values())


def resolve_checkpoint(client: "LoopsClient", text: str, target: str | None = None, *, prefer: str | None = None) -> dict:
    """The checkpoint JSON named by ``text``, or :class:`NotFound` / :class:`UsageError`.

    ``prefer`` (a target) settles a RUN:NAME shared by a trainer and a sampler checkpoint
    without --target (e.g. ``deploy`` and ``sample`` mean the sampler one)."""
    ref = parse_checkpoint_ref(text, target)
    if ref.kind == "uri":
        found = list_checkpoints_by_uri(client, ref.text)
        if found:
            return found
        _not_found_in_run(client, ref)
    if ref.kind == "name":
        return _by_name(client, ref, prefer)
    # an id
    cps = all_checkpoints(client)
    for cp in cps:
        if cp.get("id") == ref.id:
            if ref.target and cp.get("target") != ref.target:
                raise UsageError(f"checkpoint {ref.id} is a {cp.get('target')} checkpoint, not {ref.target}")
            return cp
    # An id the caller cannot list (another user's run in the org): try it as a run:name miss.
    ids = [c.get("id") for c in cps]
    hint = did_you_mean(suggest(ref.id or "", ids))
    raise NotFound(
        f"no checkpoint {ref.id!r}",
        hint=f"{hint}Name a checkpoint by id, bt:// URI or RUN:NAME; list them with `loops checkpoints list`.",
    )


def list_checkpoints_by_uri(client: "LoopsClient", uri: str) -> dict | None:
    from baseten_loops_cli.api.errors import NotFoundError

    try:
        found = list_checkpoints(client, checkpoint_path=uri)
    except NotFoundError:
        return None
    return found[0] if found else None


def _by_name(client: "LoopsClient", ref: CheckpointRef, prefer: str | None = None) -> dict:
    cps = checkpoints_of_run(client, ref.run_id or "")
    in_target = [c for c in cps if ref.target is None or c.get("target") == ref.target]
    matches = [c for c in in_target if c.get("checkpoint_id") == ref.name]
    if len(matches) > 1 and prefer:
        preferred = [c for c in matches if c.get("target") == prefer]
        matches = preferred or matches
    if len(matches) == 1:
        return matches[0]
    if matches:
        listed = ", ".join(f"{c.get('id')} ({c.get('target')})" for c in matches)
        raise UsageError(
            f"{len(matches)} checkpoints of run {ref.run_id} are named {ref.name!r}: {listed}",
            hint="Pick one with --target sampler|trainer, or name it by id.",
        )
    _not_found_in_run(client, ref, cps)


def _not_found_in_run(client: "LoopsClient", ref: CheckpointRef, cps: list[dict] | None = None) -> NoReturn:
    if cps is None:
        cps = checkpoints_of_run(client, ref.run_id or "")
    in_target = [c for c in cps if ref.target is None or c.get("target") == ref.target]
    names = [c.get("checkpoint_id") for c in in_target]
    scope = f" {ref.target}" if ref.target else ""
    other = [c for c in cps if c.get("checkpoint_id") == ref.name and c not in in_target]
    suffixed = _suffixed_saves(ref.name or "", in_target)
    if other:
        hint = f"There is a {other[0].get('target')} checkpoint of that name (--target {other[0].get('target')}). "
    elif suffixed:
        hint = f"Serverless saves get a unique suffix; newest under that name: {', '.join(suffixed)}. "
    else:
        hint = did_you_mean(suggest(ref.name or "", names))
    raise NotFound(
        f"no{scope} checkpoint named {ref.name!r} in run {ref.run_id}",
        hint=f"{hint}List them with `loops checkpoints list --run-id {ref.run_id}`.",
    )


def _suffixed_saves(name: str, cps: list[dict], limit: int = 3) -> list[str]:
    """Names ``{name}-<32 hex>`` (serverless publishes), newest first."""
    import re

    pattern = re.compile(r"(?:-[0-9a-f]{32})+")
    saves = [
        c for c in cps
        if str(c.get("checkpoint_id", "")).startswith(name)
        and pattern.fullmatch(str(c.get("checkpoint_id"))[len(name):])
    ]
    saves.sort(key=lambda c: c.get("created_at") or "", reverse=True)
    return [f"{c.get('run_id')}:{c.get('checkpoint_id')}" for c in saves[:limit]]


def checkpoint_id_of(client: "LoopsClient", text: str, target: str | None = None) -> tuple[str, dict | None]:
    """The id of the checkpoint ``text`` names, and its JSON when it had to be looked up (an id
    is used as is: the files route reports an unknown one)."""
    ref = parse_checkpoint_ref(text, target)
    if ref.kind == "id":
        return ref.id or "", None
    cp = resolve_checkpoint(client, text, target)
    return cp["id"], cp


def display_name(cp: dict) -> str:
    """``RUN:NAME`` of a checkpoint JSON (what people type back)."""
    return f"{cp.get('run_id')}:{cp.get('checkpoint_id')}"


# ── samplers ─────────────────────────────────────────────────────────────────────────────


def get_sampler(client: "LoopsClient", sampler_id: str) -> dict:
    from baseten_loops_cli.api.errors import NotFoundError

    try:
        return as_dict(client.samplers.get(sampler_id))
    except NotFoundError:
        try:
            ids = [s.get("id") for s in as_dict(client.samplers.list()) or []]
        except LoopsError:
            ids = []
        raise NotFound(
            f"no sampler {sampler_id!r}",
            hint=f"{did_you_mean(suggest(sampler_id, ids))}List samplers with `loops samplers list --all`.",
        ) from None


# ── small shared checks ──────────────────────────────────────────────────────────────────


def exactly_one(**options: Any) -> tuple[str, Any] | None:
    """The one option given among ``options`` (None when none is); two or more is a usage
    error naming them."""
    given = [(k, v) for k, v in options.items() if v not in (None, False, "")]
    if len(given) > 1:
        names = " and ".join("--" + k.replace("_", "-") for k, _ in given)
        raise UsageError(
            f"{names} cannot be used together",
            hint=f"Pass one of {', '.join('--' + k.replace('_', '-') for k in options)}.",
        )
    return given[0] if given else None


def confirm(out: Any, question: str, *, yes: bool, action: str) -> None:
    """Ask ``question`` unless ``yes``. Without a terminal to ask on, cancel (exit 3) with a
    short message naming ``action`` ("deactivating run abc1234") and the flag to pass."""
    from baseten_loops_cli.errors import CancelledError

    if yes:
        return
    if not out.streams.stdin_tty:
        raise CancelledError(
            f"not {action} without confirmation (stdin is not a terminal)",
            hint="Pass --yes to confirm non-interactively.",
        )
    out.confirm(question, yes=False)
