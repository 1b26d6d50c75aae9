"""The layer contracts of DEVELOPERS.md ("Layers"), checked with import-linter from the
contracts file at the repository root (.importlinter). Lazy imports inside functions count."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_layer_contracts_hold() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    command = [str(lint_imports)] if lint_imports.exists() else [shutil.which("lint-imports")]
    assert command[0], "import-linter is not installed (pip install -e '.[dev]')"
    result = subprocess.run([*command, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_every_route_module_is_kept_off_the_store() -> None:
    """The contract names its route modules one by one; a new module with routes() must join
    it, or its routes could reach the store unchecked."""
    import configparser

    contracts = configparser.ConfigParser()
    contracts.read(ROOT / ".importlinter")
    contract = contracts["importlinter:contract:routes-without-store"]
    listed = set(contract["source_modules"].split())
    server = ROOT / "baseten_loops_cli" / "local" / "server"
    route_modules = {f"baseten_loops_cli.local.server.{path.stem}"
                     for path in server.glob("*.py") if "\ndef routes(" in path.read_text()}
    assert route_modules, "no module of local/server defines routes()"
    assert route_modules <= listed, sorted(route_modules - listed)
    assert contract["forbidden_modules"].split() == ["baseten_loops_cli.local.store"]
