"""`loops config`: list, read, change and switch profiles in config.toml."""

from typing import Annotated

import typer

from baseten_loops_cli.cli._state import get_state

app = typer.Typer(help="Profiles and settings (config.toml).", no_args_is_help=True)

KEYS_HELP = "kind (local|baseten), base_url, team, output"


@app.command("list")
def list_profiles(ctx: typer.Context) -> None:
    """List profiles, which one is active, and where each key comes from.

    Examples:

      loops config list

      loops config list -o json
    """
    from baseten_loops_cli.settings import credentials, paths
    from baseten_loops_cli.settings.connection import capabilities_of
    from baseten_loops_cli.settings.profiles import BASETEN_DEFAULT_URL, ConfigFile, select_profile_name

    state = get_state(ctx)
    config = ConfigFile.load()
    selected, _ = select_profile_name(state.profile, config)
    rows = []
    for name in sorted(config.profiles):
        profile = config.profiles[name]
        stored = credentials.get_key(name, kind=profile.kind, use_env=False)
        rows.append(
            {
                "name": name,
                "kind": profile.kind,
                "base_url": profile.base_url,
                "team": profile.team,
                "active": name == selected,
                "key_source": stored.source,
            }
        )
    state.output.emit(
        {"config_file": str(paths.config_file()), "profiles": rows},
        rows=rows,
        id_key="name",
        columns=[
            ("", lambda r: "*" if r["active"] else " "),
            ("NAME", "name"),
            ("KIND", "kind"),
            ("BASE URL", lambda r: r["base_url"] or ("(local server)" if capabilities_of(r["kind"]).local_server else BASETEN_DEFAULT_URL)),
            ("KEY", "key_source"),
        ],
    )


@app.command("get")
def get(ctx: typer.Context, key: Annotated[str, typer.Argument(help=KEYS_HELP + ", or active")]) -> None:
    """Print one setting of the selected profile.

    Examples:

      loops config get base_url --profile prod

      loops config get active
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.settings.profiles import PROFILE_KEYS, ConfigFile, resolve_profile

    state = get_state(ctx)
    config = ConfigFile.load()
    value: str | None
    if key == "active":
        value = resolve_profile(state.profile, config=config).name
    elif key in PROFILE_KEYS:
        resolved = resolve_profile(state.profile, config=config)
        value = resolved.base_url if key == "base_url" else getattr(resolved.profile, key)
    else:
        raise UsageError(f"unknown setting {key!r}", hint=f"Settings: {KEYS_HELP}, active.")
    # the table view is the bare value, like `git config --get`
    state.output.emit({"key": key, "value": value}, id_key="value", text=["" if value is None else str(value)])


@app.command("set")
def set_(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help=KEYS_HELP)],
    value: Annotated[str, typer.Argument(help="New value.")],
) -> None:
    """Change a setting of the selected profile (the profile is created if it does not exist).

    Examples:

      loops config set base_url https://api.baseten.co --profile prod

      loops config set output json
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.output.sink import FORMATS
    from baseten_loops_cli.settings.profiles import (
        PROFILE_KEYS,
        PROFILE_KINDS,
        ConfigFile,
        Profile,
        select_profile_name,
        validate_profile_name,
    )

    state = get_state(ctx)
    if key not in PROFILE_KEYS:
        import difflib

        close = difflib.get_close_matches(key, sorted(PROFILE_KEYS), n=1)
        raise UsageError(
            f"unknown setting {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""),
            hint=f"Settings: {KEYS_HELP}.",
        )
    if key == "kind" and value not in PROFILE_KINDS:
        raise UsageError(f"kind must be one of {', '.join(PROFILE_KINDS)}, not {value!r}")
    if key == "output" and value not in FORMATS:
        raise UsageError(f"output must be one of {', '.join(FORMATS)}, not {value!r}")
    if key == "base_url" and not value.startswith(("http://", "https://")):
        raise UsageError(f"base_url must start with http:// or https://, not {value!r}")
    config = ConfigFile.load()
    name, _ = select_profile_name(state.profile, config)
    validate_profile_name(name)
    profile = config.profiles.get(name) or Profile(name=name, kind="baseten")
    setattr(profile, key, value.rstrip("/") if key == "base_url" else value)
    config.profiles[name] = profile
    config.save()
    state.output.success(f"Set {key} = {value} on profile {name!r}.")


@app.command("use")
def use(ctx: typer.Context, name: Annotated[str, typer.Argument(help="Profile to make active.")]) -> None:
    """Make a profile the active one.

    Examples:

      loops config use prod

      loops config use local
    """
    from baseten_loops_cli.settings.profiles import ConfigFile

    state = get_state(ctx)
    config = ConfigFile.load()
    config.get(name)  # raises a usage error naming the known profiles
    config.active = name
    config.save()
    state.output.success(f"Active profile: {name}.")
