"""Helpers shared by the bench scripts: a private local server and the `loops` command."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compile_like_an_install() -> None:
    """Measure what a user runs: bytecode compiled, as ``pip install`` leaves it.

    With PYTHONDONTWRITEBYTECODE set (any non-empty value, "0" included), a checkout's modules
    are compiled from source by every process: ~0.13 s more before `loops train run` sends its
    first request on the 2-core machine, which the start-up and overhead benches once counted.
    The package is compiled here, and every process a bench starts may write its own caches."""
    import compileall

    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    compileall.compile_dir(str(ROOT / "baseten_loops_cli"), quiet=1)


compile_like_an_install()


@contextlib.contextmanager
def private_server(**options) -> Iterator[dict]:
    """Start a local server with every loops dir in a temp folder; yield the env for `loops`."""
    from tests.conftest import LocalServer

    with tempfile.TemporaryDirectory(prefix="loops-bench-") as tmp:
        server = LocalServer(Path(tmp), options).start()
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_"))}
            env.update(server.env)
            yield {"env": env, "server": server, "tmp": Path(tmp)}
        finally:
            server.stop()


def loops(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "baseten_loops_cli", *args], env=env,
                            capture_output=True, text=True, cwd=ROOT)
    if check and result.returncode != 0:
        raise SystemExit(f"loops {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def print_ratio(name: str, ratio: float, target: str, detail: str) -> None:
    print(f"{name}: ratio {ratio:.3f} (target {target}); {detail}")


def print_rows(rows: list[dict], *, as_json: bool, target: Callable[[dict], str]) -> None:
    """A bench's result rows: one JSON document (what run_all.py reads with --json), or one
    :func:`print_ratio` line each, ``target(row)`` naming its target (``>= 1.3``)."""
    if as_json:
        print(json.dumps({"results": rows}))
        return
    for row in rows:
        print_ratio(row["case"], row["ratio"], target(row), row["detail"])
