"""Profiles, precedence and credentials: every level, every keyring situation."""

from __future__ import annotations

import pytest

from baseten_loops_cli.errors import ConfigError, UsageError
from baseten_loops_cli.settings import credentials, paths
from baseten_loops_cli.settings.profiles import ConfigFile, Profile, resolve_profile
from tests.support import file_mode, isolate, make_memory_keyring


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    credentials._warned_fallback = False
    yield


def _write_config(active="prod"):
    config = ConfigFile.load()
    config.profiles["prod"] = Profile("prod", "baseten", base_url="https://prod.example")
    config.profiles["staging"] = Profile("staging", "baseten", base_url="https://staging.example")
    config.active = active
    config.save()


def test_no_configuration_defaults_to_local():
    resolved = resolve_profile()
    assert (resolved.name, resolved.kind, resolved.profile_source) == ("local", "local", "default")
    assert resolved.base_url is None and resolved.base_url_source == "local-server"


def test_bare_api_key_without_config_means_baseten(monkeypatch):
    monkeypatch.setenv("BASETEN_API_KEY", "k")
    resolved = resolve_profile()
    assert resolved.name == "baseten"
    assert resolved.base_url == "https://api.baseten.co"


def test_profile_precedence_flag_env_active_default(monkeypatch):
    _write_config(active="prod")
    assert resolve_profile().name == "prod"
    assert resolve_profile().profile_source == "active"
    monkeypatch.setenv("LOOPS_PROFILE", "staging")
    assert resolve_profile().name == "staging"
    assert resolve_profile().profile_source == "env"
    assert resolve_profile("local").name == "local"
    assert resolve_profile("local").profile_source == "flag"


def test_base_url_precedence_flag_env_profile_default(monkeypatch):
    _write_config(active="prod")
    assert resolve_profile().base_url == "https://prod.example"
    monkeypatch.setenv("LOOPS_BASE_URL", "http://127.0.0.1:9/")
    assert resolve_profile().base_url == "http://127.0.0.1:9"
    assert resolve_profile(base_url_flag="http://flag.example").base_url == "http://flag.example"
    monkeypatch.delenv("LOOPS_BASE_URL")
    assert resolve_profile("baseten").base_url == "https://api.baseten.co"
    assert resolve_profile("baseten").base_url_source == "default"


def test_unknown_profile_is_a_usage_error_with_suggestion():
    _write_config()
    with pytest.raises(UsageError) as info:
        resolve_profile("prdo")
    assert "'prod'" in info.value.message
    assert "loops auth login" in info.value.hint


def test_malformed_config_names_file_and_line():
    path = paths.config_file()
    path.parent.mkdir(parents=True)
    path.write_text('active = "prod"\n[profiles.prod\nkind = "baseten"\n')
    with pytest.raises(ConfigError) as info:
        ConfigFile.load()
    assert str(path) in info.value.message
    assert "line 2" in info.value.message


def test_unknown_profile_key_is_rejected():
    path = paths.config_file()
    path.parent.mkdir(parents=True)
    path.write_text('[profiles.prod]\nkind = "baseten"\nbase_ulr = "x"\n')
    with pytest.raises(ConfigError, match="base_ulr"):
        ConfigFile.load()


def test_config_file_is_private_and_round_trips():
    _write_config()
    assert file_mode(paths.config_file()) == 0o600
    again = ConfigFile.load()
    assert again.active == "prod"
    assert again.profiles["staging"].base_url == "https://staging.example"


def test_env_key_wins_over_every_store(monkeypatch):
    import keyring

    ring = make_memory_keyring()
    monkeypatch.setattr(keyring, "get_keyring", lambda: ring)
    credentials.store_key("prod", "from-keyring")
    monkeypatch.setenv("BASETEN_API_KEY", "from-env")
    stored = credentials.get_key("prod")
    assert (stored.key, stored.source) == ("from-env", "env")


def test_keyring_present_stores_there_and_not_on_disk(monkeypatch):
    import keyring

    ring = make_memory_keyring()
    monkeypatch.setattr(keyring, "get_keyring", lambda: ring)
    assert credentials.store_key("prod", "secret-1") == "keyring"
    assert ring.store[("baseten-loops", "prod")] == "secret-1"
    assert not paths.credentials_file().exists()
    assert credentials.get_key("prod").source == "keyring"
    assert credentials.delete_key("prod") == ["keyring"]
    assert credentials.get_key("prod").key is None


def test_failing_keyring_falls_back_to_private_file_with_one_warning(monkeypatch, capsys):
    import keyring
    import keyring.backends.fail

    monkeypatch.setattr(keyring, "get_keyring", lambda: keyring.backends.fail.Keyring())
    assert credentials.store_key("prod", "secret-2") == "file"
    assert credentials.store_key("staging", "secret-3") == "file"
    err = capsys.readouterr().err
    assert err.count("Warning:") == 1 and "no usable keyring" in err
    assert "secret-2" not in err
    assert file_mode(paths.credentials_file()) == 0o600
    stored = credentials.get_key("prod")
    assert (stored.key, stored.source) == ("secret-2", "file")


def test_write_refusing_keyring_falls_back_to_file(monkeypatch):
    import keyring

    ring = make_memory_keyring()

    def refuse(*_args):
        raise keyring.errors.PasswordSetError("locked")

    ring.set_password = refuse
    monkeypatch.setattr(keyring, "get_keyring", lambda: ring)
    assert credentials.store_key("prod", "secret-4") == "file"
    assert credentials.get_key("prod").key == "secret-4"


def test_disabled_keyring_is_never_touched(monkeypatch):
    import keyring

    def explode():
        raise AssertionError("keyring must not be used when disabled")

    monkeypatch.setattr(keyring, "get_keyring", explode)
    monkeypatch.setenv("LOOPS_KEYRING_DISABLED", "1")
    assert credentials.store_key("prod", "secret-5") == "file"
    assert credentials.get_key("prod").source == "file"


def test_local_profile_key_is_the_server_token():
    token = paths.state_dir() / "token"
    paths.write_private_file(token, "tok-123\n")
    stored = credentials.get_key("local", kind="local")
    assert (stored.key, stored.source) == ("tok-123", "local-server")
