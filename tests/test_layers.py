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
