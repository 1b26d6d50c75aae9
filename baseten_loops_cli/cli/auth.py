"""`loops auth`: store, inspect and remove the API key of a profile (never printing it)."""

import sys
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli._state import get_state

app = typer.Typer(
    help="Log in to Baseten, check where the key comes from, log out.",
    no_args_is_help=True,
)


@app.command("login")
def login(
    ctx: typer.Context,
    with_key: Annotated[
        bool, typer.Option("--with-key", help="Read the API key from stdin (for scripts and CI).")
    ] = False,
    base_url: Annotated[
        Optional[str], typer.Option("--base-url", help="Control-plane URL for this profile.")
    ] = None,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Check the key against the backend first.")
    ] = True,
) -> None:
    """Store an API key for a profile (default profile: baseten) and make it active.

    Examples:

      loops auth login

      echo "$KEY" | loops auth login --with-key --profile prod

      loops auth login --profile staging --base-url https://api.staging.example
    """
    from baseten_loops_cli.errors import AuthError, UsageError
    from baseten_loops_cli.settings import credentials
    from baseten_loops_cli.settings.connection import capabilities_of
    from baseten_loops_cli.settings.profiles import (
        BASETEN_DEFAULT_URL,
        ConfigFile,
        Profile,
        validate_profile_name,
    )

    state = get_state(ctx)
    out = state.output
    name = validate_profile_name(state.profile or "baseten")
    config = ConfigFile.load()
    profile = config.profiles.get(name)
    if profile is not None and capabilities_of(profile.kind).local_server:
        raise UsageError(
            f"profile {name!r} is a local profile: it uses the local server's token",
            hint="Log in to a Baseten profile instead, e.g. `loops auth login --profile baseten`.",
        )
    if with_key:
        key = sys.stdin.readline().strip()
    else:
        key = out.ask_secret("Baseten API key", what="key",
                             hint="Pipe it in: `echo \"$BASETEN_API_KEY\" | loops auth login --with-key`.")
    if not key:
        raise AuthError("empty API key", hint="Create one at https://app.baseten.co/settings/api_keys.")
    credentials.check_key(key, "stdin" if with_key else "the prompt")
    if profile is None:
        profile = Profile(name=name, kind="baseten")
    if base_url:
        profile.base_url = base_url.rstrip("/")
    url = profile.base_url or BASETEN_DEFAULT_URL
    if verify:
        from baseten_loops_cli.cli._backend import open_client

        client = open_client(url, key)
        try:
            client.get_user_config()  # cheap, authenticated, side-effect free
        finally:
            client.close()
    config.profiles[name] = profile
    config.active = name
    config.save()
    where = credentials.store_key(name, key)
    out.success(f"Logged in: profile {name!r} ({url}); key stored in the {where}. Active profile: {name}.")


@app.command("status")
def status(ctx: typer.Context) -> None:
    """Show the selected profile, its URL and where its key comes from (never the key).

    Exits 4 when no key is available, or when the key cannot be sent (whitespace, a control or a
    non-ASCII character inside it: every command refuses it).

    Examples:

      loops auth status

      loops auth status --profile prod -o json
    """
    from baseten_loops_cli.errors import AuthError, ExitCode
    from baseten_loops_cli.settings import credentials
    from baseten_loops_cli.settings.connection import capabilities_of, key_origin
    from baseten_loops_cli.settings.local_server import read_info
    from baseten_loops_cli.settings.profiles import resolve_profile

    state = get_state(ctx)
    resolved = resolve_profile(state.profile)
    base_url = resolved.base_url
    local_server = capabilities_of(resolved.kind).local_server
    if base_url is None and local_server:
        info = read_info()
        base_url = info.get("url") if info else None
    stored = credentials.get_key(resolved.name, kind=resolved.kind)
    unusable: AuthError | None = None
    if stored.key:
        try:  # the check every command makes before sending the key
            credentials.check_key(stored.key, key_origin(stored.source, resolved.name))
        except AuthError as exc:
            unusable = exc
    record = {
        "profile": resolved.name,
        "profile_source": resolved.profile_source,
        "kind": resolved.kind,
        "base_url": base_url,
        "base_url_source": resolved.base_url_source,
        "key_present": stored.found,
        "key_source": stored.source,
        "key_usable": stored.found and unusable is None,
        "keyring_disabled": credentials.keyring_disabled(),
    }
    state.output.emit(
        record,
        id_key="profile",
        fields=[
            ("Profile", lambda r: f"{r['profile']} (from {r['profile_source']})"),
            ("Kind", "kind"),
            ("Base URL", lambda r: r["base_url"] or "(local server not running)"),
            ("Key", _describe_key),
        ],
    )
    if unusable is not None:
        state.output.warn(f"{unusable.message}; every command refuses it.")
        state.output.hint(
            f"Store it again: `loops auth login --profile {resolved.name}`."
            if stored.source in ("keyring", "file") else unusable.hint or ""
        )
        raise typer.Exit(int(ExitCode.AUTH))
    if not stored.found:
        state.output.hint(
            "Start it with `loops server start`."
            if local_server
            else f"Run `loops auth login --profile {resolved.name}` or export BASETEN_API_KEY."
        )
        raise typer.Exit(int(ExitCode.AUTH))


def _describe_key(record: dict) -> str:
    if not record["key_present"]:
        return "missing"
    state = "present" if record["key_usable"] else "unusable"
    return f"{state} (from {record['key_source']})"


@app.command("logout")
def logout(ctx: typer.Context) -> None:
    """Remove the stored key of the selected profile (keyring and fallback file).

    Examples:

      loops auth logout --profile prod
    """
    from baseten_loops_cli.settings import credentials
    from baseten_loops_cli.settings.profiles import resolve_profile

    state = get_state(ctx)
    resolved = resolve_profile(state.profile)
    removed = credentials.delete_key(resolved.name)
    if removed:
        state.output.success(f"Removed the key of profile {resolved.name!r} from the {' and '.join(removed)}.")
    else:
        state.output.info(f"No stored key for profile {resolved.name!r}.")
    import os

    if os.environ.get("BASETEN_API_KEY"):
        state.output.hint("BASETEN_API_KEY is still exported in this shell and takes precedence.")
