#!/usr/bin/env python
"""Write the shell completion scripts shipped in completions/.

Each script is what `loops completion show SHELL` prints, produced by running that command of
this checkout (so the files always match the live app and Typer's completion machinery):

    completions/loops.bash   bash   (source it, or install as bash-completion's `loops`)
    completions/_loops       zsh    (starts with `#compdef loops`: put it in a $fpath directory)
    completions/loops.fish   fish   (~/.config/fish/completions/ or vendor_completions.d/)
    completions/loops.ps1    PowerShell (dot-source it from $PROFILE)

    python scripts/gen_completions.py                 # writes completions/
    python scripts/gen_completions.py --out-dir DIR   # writes DIR (the drift test uses this)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FILES = {
    "bash": "loops.bash",
    "zsh": "_loops",
    "fish": "loops.fish",
    "powershell": "loops.ps1",
}


def script_for(shell: str) -> str:
    """`loops completion show SHELL`, run from this checkout in a clean environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("_LOOPS_", "_TYPER_", "LOOPS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["LOOPS_NO_AUTOSTART"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "baseten_loops_cli", "completion", "show", shell],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0 or not result.stdout.strip():
        raise SystemExit(f"`loops completion show {shell}` failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for shell, name in FILES.items():
        text = script_for(shell)
        if shell == "zsh" and not text.startswith("#compdef loops\n"):
            raise SystemExit("the zsh script must start with `#compdef loops`")
        target = out_dir / name
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "completions")
    args = parser.parse_args(argv)
    files = generate(args.out_dir)
    print(f"wrote {', '.join(f.name for f in files)} to {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
