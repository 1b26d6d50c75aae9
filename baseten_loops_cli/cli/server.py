"""`loops server`: the embedded local backend (start, stop, status, logs, env, models,
pull-model).

Imports stay inside the commands: `loops --help` must not pull in httpx or torch.
"""

from enum import Enum
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from baseten_loops_cli.cli._state import get_state

if TYPE_CHECKING:
    from baseten_loops_cli.output.sink import Column

app = typer.Typer(
    help="Run the local backend: a Loops-compatible server on 127.0.0.1 for offline training.",
    no_args_is_help=True,
)

_INFO_FIELDS: "list[Column]" = [
    ("URL", "url"),
    ("PID", "pid"),
    ("Version", "version"),
    ("Started", "started_at"),
    ("Uptime (s)", "uptime_s"),
    ("Healthy", "healthy"),
    ("Models loaded", lambda r: ", ".join(m["model"] for m in r.get("models") or []) or "-"),
    ("Runs in memory", lambda r: ", ".join(r.get("runs_in_memory") or []) or "-"),
    ("Compute", lambda r: _compute_text(r.get("compute") or {})),
    ("Data dir", "data_dir"),
    ("State dir", "state_dir"),
]


def _compute_text(compute: dict) -> str:
    if not compute:
        return "-"
    if compute.get("dtype"):
        return f"{compute['dtype']} on {compute['device']} ({compute.get('reason')})"
    return (f"{compute.get('requested_dtype')} on {compute.get('requested_device')} "
            "(resolved when the engine loads)")


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@app.command()
def start(
    ctx: typer.Context,
    port: Annotated[Optional[int], typer.Option("--port", "-p", help="Port on 127.0.0.1 (default 8717, or any free one).")] = None,
    foreground: Annotated[bool, typer.Option("--foreground", help="Serve in this terminal until Ctrl-C.")] = False,
    dtype: Annotated[Optional[Dtype], typer.Option("--dtype", help="Compute dtype: auto (bfloat16 where the CPU has AMX/AVX512-BF16 or the GPU has bf16, else float32), float32 or bfloat16. LoRA weights and optimizer state stay float32. Default: $LOOPS_DTYPE, else auto.")] = None,
    device: Annotated[Optional[Device], typer.Option("--device", help="Compute device: auto (CUDA when torch sees one), cpu or cuda. Default: $LOOPS_DEVICE, else auto.")] = None,
) -> None:
    """Start the local server in the background (no-op if it is running).

    --dtype and --device apply to a server this starts; one already running keeps its own
    (`loops server status` shows it: stop it first to change them).
    """
    from baseten_loops_cli.local import daemon
    from baseten_loops_cli.settings import paths

    out = get_state(ctx).output
    dtype_ = dtype.value if dtype is not None else None
    device_ = device.value if device is not None else None
    if foreground:
        daemon.check_compute(dtype_, device_)
        port_ = port if port is not None else (daemon.DEFAULT_PORT if daemon.port_free(daemon.DEFAULT_PORT) else 0)
        out.info("Serving in the foreground; Ctrl-C stops the server.")
        options = {k: v for k, v in (("dtype", dtype_), ("device", device_)) if v is not None}
        daemon.run_foreground(port=port_, state_dir=paths.state_dir(), data_dir=paths.data_dir(),
                              options=options)
        return
    already = daemon.status()
    info = already or daemon.start(port, dtype=dtype_, device=device_)
    if already is not None:
        out.info(f"The local server is already running at {info.url} (pid {info.pid}).")
    else:
        out.success(f"Local server running at {info.url} (pid {info.pid}).")
        out.hint("Point the official SDK at it with: eval \"$(loops server env)\"")
    if already is not None and (dtype_ or device_):
        out.hint("--dtype/--device apply to a server being started; this one keeps its own "
                 "(`loops server stop` first to change them).")
    out.emit(info.to_dict(), fields=_INFO_FIELDS[:4])


@app.command()
def stop(ctx: typer.Context) -> None:
    """Stop the local server (saving every loaded trainer first)."""
    from baseten_loops_cli.local import daemon

    out = get_state(ctx).output
    if daemon.stop():
        out.success("Local server stopped.")
    else:
        out.info("The local server is not running.")


@app.command()
def status(ctx: typer.Context) -> None:
    """Show whether the local server runs, and what it has loaded. Exit 1 if not running."""
    from baseten_loops_cli.local import daemon

    out = get_state(ctx).output
    info = daemon.status()
    if info is None:
        out.emit({"running": False}, fields=[("Running", "running")])
        out.hint("Start it with `loops server start`.")
        raise typer.Exit(1)
    out.emit({"running": True, **info.to_dict()}, fields=_INFO_FIELDS)


@app.command()
def logs(
    ctx: typer.Context,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")] = False,
    lines: Annotated[int, typer.Option("-n", "--lines", min=0, help="How many of the last lines to show.")] = 50,
) -> None:
    """Print the local server's log (server.log in the state dir).

    -o json / jsonl print one {"line": ...} object per line. Ctrl-C ends --follow (exit 130).
    """
    from collections import deque

    from baseten_loops_cli.api.polling import Poll
    from baseten_loops_cli.errors import LoopsError
    from baseten_loops_cli.settings.local_server import LOG_FILE, state_file

    out = get_state(ctx).output
    path = state_file(LOG_FILE)
    if not path.exists():
        raise LoopsError(f"No server log at {path}.", hint="Start the server with `loops server start`.")

    def show(line: str) -> None:
        line = line.rstrip("\n")
        out.stream({"line": line}, text=line, quiet_text=line)

    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in deque(fh, maxlen=lines) if lines else ():
            show(line)
        if not follow:
            return
        fh.seek(0, 2)
        poll = Poll(interval=0.25)  # a new line is read at once; the end of the file, a quarter second later
        try:
            for _ in poll:
                line = fh.readline()
                if line:
                    show(line)
                    poll.again()
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


@app.command()
def env(ctx: typer.Context) -> None:
    """Print shell exports that point the official SDK at the local server.

    Usage: eval "$(loops server env)"
    """
    from baseten_loops_cli.local import daemon

    out = get_state(ctx).output
    exports = daemon.env_lines()
    # The table view and -q are the export lines themselves (what `eval` reads).
    out.emit(dict(line.removeprefix("export ").split("=", 1) for line in exports),
             text=exports, id_key=lambda _doc: "\n".join(exports))


@app.command()
def models(ctx: typer.Context) -> None:
    """List the models the local server can train on: the built-in ones, those pulled, and the
    local model folders runs have used, with max_seq_len and where their files are (the
    server is started if needed)."""
    from baseten_loops_cli.api.local_server import local_models
    from baseten_loops_cli.cli._backend import local_server_connection

    out = get_state(ctx).output
    url, token = local_server_connection(announce=out.info)
    rows = local_models(url, token)
    out.emit(rows, rows=rows, id_key="name", columns=[
        ("Name", "name"), ("Max seq len", "max_seq_len"), ("Source", "source"),
        ("Ready", "ready"),
        ("Files", lambda r: r.get("files") or ("built in code" if r.get("ready") else "-")),
    ], hint="`loops server pull-model NAME` fetches a model that is not ready yet.")


@app.command("pull-model")
def pull_model(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Model name, e.g. HuggingFaceTB/SmolLM2-135M-Instruct (see GET /v1/loops/capabilities).")],
) -> None:
    """Prepare a model for the local backend ahead of use: the local server downloads and
    converts it into its cache (started if needed), showing each step as it happens."""
    from baseten_loops_cli.api.local_server import pull_model_events
    from baseten_loops_cli.cli._backend import local_server_connection

    out = get_state(ctx).output
    url, token = local_server_connection(announce=out.info)
    out.info(f"Asking the local server to prepare {name}...")
    step = "Preparing"
    path = None
    with out.status(f"{step} {name}") as status:
        for event in pull_model_events(url, token, name):
            kind = event.get("event")
            elapsed = f" ({event.get('elapsed_s', 0):.0f}s)"
            if kind == "download":
                step = f"Downloading {event.get('package')}"
                out.info(f"{step} (the weights of {name})...")
            elif kind == "convert":
                step = "Converting"
                out.info(f"Converting {event.get('source')} into the model cache...")
            elif kind == "log":
                out.info(f"  {event.get('message')}")
            elif kind == "done":
                path = event.get("path")
            status.update(event, f"{step} {name}{elapsed}")
    out.success(f"{name} is ready.")
    out.emit({"model": name, "ready": True, "path": path},
             fields=[("Model", "model"), ("Ready", "ready"), ("Path", "path")])
