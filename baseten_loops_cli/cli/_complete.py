"""Dynamic tab completion: run ids, checkpoint references, model names and profile names.

A TAB must never wait on the network for more than a moment, so answers come from a small cache
file (``$LOOPS_CACHE_DIR/completion.json``, entries fresh for :data:`TTL_S` seconds, keyed by
profile and backend URL). When an entry is missing or stale it is refreshed in a thread for at
most :data:`REFRESH_BUDGET_S`; if that is not enough, the TAB is answered from the stale entry (or
not at all) and a detached ``python -m baseten_loops_cli.cli._complete`` process finishes the
refresh, so the next TAB has it.

Served from cache, this module imports nothing beyond the standard library and the light
``settings`` modules: no httpx, pydantic, keyring or rich. The local server is never started by a
TAB (completion uses the server only if it is already running).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

TTL_S = 30.0
# Older entries are not shown at all (a run list from yesterday misleads more than it helps).
MAX_STALE_S = 24 * 3600.0
REFRESH_BUDGET_S = 0.3
# A background refresher started less than this long ago is not started again.
REFRESHER_COOLDOWN_S = 10.0
NETWORK_TIMEOUT_S = 5.0
CACHE_FILE = "completion.json"
MAX_ITEMS = 500

Item = tuple[str, str]  # (value, help)


# ── cache ──────────────────────────────────────────────────────────────────────────────────


def _cache_path() -> Path:
    from baseten_loops_cli.settings.paths import cache_dir

    return cache_dir() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(_cache_path().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_entry(key: str, items: list[Item]) -> None:
    path = _cache_path()
    data = _read_cache()
    now = time.time()
    data = {k: v for k, v in data.items() if isinstance(v, dict) and now - v.get("at", 0) < MAX_STALE_S}
    data[key] = {"at": now, "items": [list(i) for i in items[:MAX_ITEMS]]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def invalidate(kind_prefix: str = "") -> None:
    """Drop cached entries (all, or those whose kind starts with ``kind_prefix``): called by
    commands that change what completes (``runs create``, ``runs deactivate``...)."""
    data = _read_cache()
    if not data:
        return
    kept = {k: v for k, v in data.items() if kind_prefix and not k.split("|", 2)[-1].startswith(kind_prefix)}
    try:
        path = _cache_path()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


# ── which backend ──────────────────────────────────────────────────────────────────────────


def _profile_flag(ctx: Any) -> str | None:
    try:
        root = ctx.find_root()
        value = root.params.get("profile")
        if value:
            return value
    except AttributeError:
        pass
    return None


def _backend_key(profile_flag: str | None) -> str | None:
    """``<profile>|<base url>`` without touching keyring or the network; None when there is no
    backend to ask (e.g. the local server is not running)."""
    try:
        from baseten_loops_cli.settings.profiles import resolve_profile

        resolved = resolve_profile(profile_flag)
    except Exception:  # noqa: BLE001 - a broken config must not break TAB
        return None
    url = resolved.base_url
    if url is None:
        from baseten_loops_cli.settings.local_server import read_info

        info = read_info()
        url = info.get("url") if info else None
    if not url:
        return None
    return f"{resolved.name}|{url.rstrip('/')}"


# ── fetchers (network; run in a thread or in the background refresher) ───────────────────


def _get_json(profile_flag: str | None, path: str, params: dict[str, str] | None = None) -> Any:
    """One GET through the API layer's HTTP client (no retries, a short timeout, no pydantic)."""
    from baseten_loops_cli.api.http import HttpClient
    from baseten_loops_cli.settings.connection import resolve_connection

    conn = resolve_connection(profile_flag)  # never starts the local server
    with HttpClient(conn.base_url, conn.api_key, timeout=NETWORK_TIMEOUT_S, max_retries=0) as http:
        return http.request_json("GET", path, params=params)


def _fetch_runs(profile_flag: str | None, _arg: str) -> list[Item]:
    runs = _get_json(profile_flag, "/v1/loops/runs").get("runs") or []
    runs.sort(key=lambda r: r.get("created_at") or "", reverse=True)
    items = []
    for r in runs:
        status = (r.get("status") or {}).get("name") or ""
        bits = [r.get("base_model") or "", status]
        if r.get("name") and r.get("name") != r.get("base_model"):
            bits.insert(0, r["name"])
        items.append((str(r["id"]), " · ".join(b for b in bits if b)))
    return items


def _fetch_checkpoints(profile_flag: str | None, run_id: str) -> list[Item]:
    cps = _get_json(profile_flag, "/v1/loops/checkpoints", {"run_id": run_id}).get("checkpoints") or []
    cps.sort(key=lambda c: c.get("created_at") or "", reverse=True)
    # A trainer and a sampler checkpoint saved under one name (``final``) are one RUN:NAME to
    # type: offer the name once, saying what it names.
    by_name: dict[str, list[dict]] = {}
    for c in cps:
        by_name.setdefault(str(c["checkpoint_id"]), []).append(c)
    return [
        (name, " + ".join(f"{c.get('target', '')} {c.get('id', '')}" for c in group))
        if len(group) > 1 else (name, f"{group[0].get('target', '')} · {group[0].get('id', '')}")
        for name, group in by_name.items()
    ]


def _fetch_samplers(profile_flag: str | None, _arg: str) -> list[Item]:
    samplers = _get_json(profile_flag, "/v1/loops/samplers").get("samplers") or []
    return [
        (str(s["id"]), " · ".join(x for x in [s.get("base_model") or "", (s.get("status") or {}).get("name") or ""] if x))
        for s in samplers
    ]


def _fetch_models(profile_flag: str | None, _arg: str) -> list[Item]:
    """The backend's catalog (``GET /v1/loops/capabilities``, both use cases) with each model's
    max sequence length and use cases (what ``loops models`` lists)."""
    found: dict[str, tuple[Any, list[str]]] = {}
    for case in ("sft", "rl"):
        for m in _get_json(profile_flag, "/v1/loops/capabilities", {"use_case": case}).get("supported_models") or []:
            name = str(m.get("model_name") or "")
            if name:
                found.setdefault(name, (m.get("max_seq_len") or m.get("max_context_length"), []))[1].append(case)
    return [(name, " · ".join(x for x in [f"{limit:,} tokens" if isinstance(limit, int) else "", ", ".join(cases)] if x))
            for name, (limit, cases) in found.items()]


FETCHERS: dict[str, Callable[[str | None, str], list[Item]]] = {
    "models": _fetch_models,
    "runs": _fetch_runs,
    "checkpoints": _fetch_checkpoints,
    "samplers": _fetch_samplers,
}


# ── the lookup ─────────────────────────────────────────────────────────────────────────────


def cached_items(
    profile_flag: str | None,
    kind: str,
    arg: str = "",
    *,
    budget_s: float = REFRESH_BUDGET_S,
    spawn: bool = True,
) -> list[Item]:
    """Items of ``kind`` (``runs``, ``checkpoints`` of run ``arg``, ``samplers``, ``models``): fresh from the
    cache, else refreshed within ``budget_s``, else stale (and refreshed in the background)."""
    backend = _backend_key(profile_flag)
    if backend is None:
        return []
    key = f"{backend}|{kind}:{arg}"
    entry = _read_cache().get(key)
    now = time.time()
    if isinstance(entry, dict) and now - entry.get("at", 0) < TTL_S:
        return [tuple(i) for i in entry.get("items", [])]

    result: dict[str, list[Item]] = {}

    def refresh() -> None:
        try:
            items = FETCHERS[kind](profile_flag, arg)
        except Exception:  # noqa: BLE001 - no backend, no key, timeout: nothing to offer
            return
        _write_entry(key, items)
        result["items"] = items

    thread = threading.Thread(target=refresh, daemon=True, name="loops-complete")
    thread.start()
    thread.join(budget_s)
    if "items" in result:
        return result["items"]
    if thread.is_alive() and spawn:
        _spawn_refresher(profile_flag, kind, arg)
    if isinstance(entry, dict) and now - entry.get("at", 0) < MAX_STALE_S:
        return [tuple(i) for i in entry.get("items", [])]
    return []


def _spawn_refresher(profile_flag: str | None, kind: str, arg: str) -> None:
    """Finish the refresh in a detached process (the TAB's own process exits right away)."""
    stamp = _cache_path().with_name(f".refresh-{kind}")
    try:
        if time.time() - stamp.stat().st_mtime < REFRESHER_COOLDOWN_S:
            return
    except OSError:
        pass
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
        cmd = [sys.executable, "-m", "baseten_loops_cli.cli._complete", kind, arg, profile_flag or ""]
        env = {k: v for k, v in os.environ.items() if not k.endswith("_COMPLETE")}
        subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
    except OSError:
        pass


def _filter(items: list[Item], incomplete: str) -> list[Item]:
    return [i for i in items if i[0].startswith(incomplete)]


# ── Typer autocompletion callbacks ─────────────────────────────────────────────────────────


def complete_run(ctx: Any, incomplete: str) -> list[Item]:
    """Run ids (newest first) with their name, base model and status."""
    return _filter(cached_items(_profile_flag(ctx), "runs"), incomplete)


def complete_sampler(ctx: Any, incomplete: str) -> list[Item]:
    return _filter(cached_items(_profile_flag(ctx), "samplers"), incomplete)


def complete_model(ctx: Any, incomplete: str) -> list[Item]:
    """Model names of the backend's catalog with their max sequence length and use cases."""
    return _filter(cached_items(_profile_flag(ctx), "models"), incomplete)


def complete_checkpoint(ctx: Any, incomplete: str) -> list[Item]:
    """``RUN:NAME`` references: run ids (``RUN:``) until one run is chosen, then its
    checkpoint names. Ids and ``bt://`` URIs are accepted but not offered."""
    flag = _profile_flag(ctx)
    if incomplete.startswith("bt://"):
        return []
    if ":" in incomplete:
        run_id, _, name = incomplete.partition(":")
        return [(f"{run_id}:{n}", h) for n, h in cached_items(flag, "checkpoints", run_id) if n.startswith(name)]
    runs = _filter(cached_items(flag, "runs"), incomplete)
    if len(runs) == 1:
        run_id = runs[0][0]
        names = cached_items(flag, "checkpoints", run_id)
        if names:
            return [(f"{run_id}:{n}", h) for n, h in names]
    return [(f"{r}:", h) for r, h in runs]


def complete_profile(incomplete: str) -> list[Item]:
    """Profile names from config.toml (no network)."""
    try:
        from baseten_loops_cli.settings.profiles import ConfigFile

        config = ConfigFile.load()
    except Exception:  # noqa: BLE001
        return []
    return [(name, p.kind) for name, p in sorted(config.profiles.items()) if name.startswith(incomplete)]


def _main(argv: list[str]) -> int:
    """``python -m baseten_loops_cli.cli._complete KIND ARG PROFILE``: refresh one entry."""
    kind, arg, profile = (argv + ["", "", ""])[:3]
    if kind not in FETCHERS:
        return 2
    cached_items(profile or None, kind, arg, budget_s=NETWORK_TIMEOUT_S + 1, spawn=False)
    return 0


if __name__ == "__main__":  # pragma: no cover - the detached refresher
    raise SystemExit(_main(sys.argv[1:]))
