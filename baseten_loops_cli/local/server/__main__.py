"""``python -m baseten_loops_cli.local.server``: run the local backend.

    python -m baseten_loops_cli.local.server --port P --data-dir D --state-dir S [--foreground]

Without ``--foreground`` it starts the server in the background (as ``loops server
start`` does), waits until it answers, prints its URL and exits. ``--option KEY=VALUE``
overrides a server setting (a ``ServerConfig`` field; VALUE is JSON, e.g.
``--option op_poll_hold_s=2``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from baseten_loops_cli.errors import LoopsError


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    from baseten_loops_cli.local.server.config import ServerConfig

    allowed = {f.name for f in dataclasses.fields(ServerConfig)} - {"data_dir", "token",
                                                                   "enable_fault_hooks"}
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in allowed:
            raise SystemExit("--option expects KEY=VALUE with KEY one of: "
                             f"{', '.join(sorted(allowed))}")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    return options


def main(argv: list[str] | None = None) -> int:
    from baseten_loops_cli.local import daemon
    from baseten_loops_cli.settings import paths

    parser = argparse.ArgumentParser(prog="python -m baseten_loops_cli.local.server",
                                     description="The loops local backend (127.0.0.1 only).")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port to listen on (default {daemon.DEFAULT_PORT}, or any free one)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="database and checkpoints (default: LOOPS_DATA_DIR / platform dir)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="server.json, pid, log and token (default: LOOPS_STATE_DIR)")
    parser.add_argument("--foreground", action="store_true",
                        help="serve in this process instead of starting a background server")
    parser.add_argument("--enable-fault-hooks", action="store_true",
                        help="expose POST /v1/local/faults (tests only)")
    parser.add_argument("--owner-pid", type=int, default=None,
                        help="shut down when this process exits (for test fixtures)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="override a server setting, e.g. op_poll_hold_s=2")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    state_dir = args.state_dir or paths.state_dir()
    data_dir = args.data_dir or paths.data_dir()
    options = _parse_options(args.option)
    try:
        if args.foreground:
            port = args.port if args.port is not None else (
                daemon.DEFAULT_PORT if daemon.port_free(daemon.DEFAULT_PORT) else 0)
            daemon.run_foreground(port=port, state_dir=state_dir, data_dir=data_dir,
                                  enable_fault_hooks=args.enable_fault_hooks, options=options,
                                  log_level=args.log_level, owner_pid=args.owner_pid)
        else:
            info = daemon.start(args.port, state_dir=state_dir, data_dir=data_dir,
                                options=options, enable_fault_hooks=args.enable_fault_hooks,
                                owner_pid=args.owner_pid)
            print(f"loops local server running at {info.url} (pid {info.pid})")
    except LoopsError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"Hint: {exc.hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
