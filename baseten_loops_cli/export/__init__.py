"""Export a sampler checkpoint (a LoRA adapter) for use outside Loops.

Formats (``loops checkpoints export``):

- ``peft``: the adapter, with ``adapter_config.json``'s ``base_model_name_or_path`` pointing at
  something plain peft can load: the hub id for hub models, and for ``loops-local/tiny`` (built
  in code, so no hub has it) a real HF folder written next to the adapter, ``DIR/base``.
- ``hf``: base + adapter merged into a standalone transformers folder (safetensors, config,
  generation config, the base's tokenizer files): no adapter step to load or serve it.
- ``gguf``: the merged model as one GGUF file (llama architecture), for llama.cpp readers.

Everything is written into a staging folder beside ``DIR`` and renamed into place at the end,
so a failure (a full disk, Ctrl-C) leaves no partial output. The result is reloaded and a
forward pass compared with base + adapter; the max abs difference is reported.

This package needs the ``[local]`` extra (torch, transformers, peft, gguf), imported lazily.

Use from Python::

    result = export_checkpoint(client, "abc1234:final", Path("out"), fmt="hf")
    result = export_adapter(Path("adapter"), "HuggingFaceTB/SmolLM2-135M-Instruct", Path("out"), fmt="hf")
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baseten_loops_cli.errors import LoopsError, UsageError

if TYPE_CHECKING:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.api.download import Progress

FORMATS = ("peft", "hf", "gguf")
DTYPES = ("float32", "float16", "bfloat16")
LOCAL_EXTRA_HINT = "pip install 'baseten-loops-cli[local]'"


@dataclass
class ExportResult:
    format: str
    path: str  # the folder (peft, hf) or the .gguf file
    dtype: str
    base_model: str
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    max_abs_diff: float = 0.0  # reloaded output vs base + adapter (forward pass logits)
    checkpoint: str | None = None  # RUN:NAME when exported from a backend checkpoint
    # peft: the base's folder on this machine (load the adapter offline from it), and what
    # adapter_config.json names as the base (--base-path, when given).
    base_path: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def require_local_extra() -> None:
    """One clear error when torch/transformers/peft/gguf are missing."""
    missing = []
    for name in ("torch", "transformers", "peft", "gguf", "safetensors"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise LoopsError(f"exporting needs {', '.join(missing)} (the [local] extra)", hint=f"Install it: {LOCAL_EXTRA_HINT}")


def check_options(fmt: str, dtype: str) -> None:
    """A known format and dtype, or a UsageError."""
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def prepare_target(dest: Path, force: bool) -> None:
    """Refuse an -O that would lose something (an existing folder without --force, a file even
    with it: export writes a folder) or that cannot be written, before anything is downloaded."""
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest} is a file, not a folder (export writes a folder)", hint="Pick another -O DIR.")
    if dest.exists() or dest.is_symlink():
        if not force:
            raise UsageError(f"{dest} already exists", hint="Pick another -O, or pass --force to replace it.")
    # The folder that would hold it: its nearest existing ancestor must be a writable folder
    # (nothing is created yet, so a failure later leaves nothing behind).
    parent = probe = dest.expanduser().absolute().parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise _write_error(dest.parent, "it is a file" if probe == parent else f"{probe} is a file")
    if not os.access(probe, os.W_OK):
        raise _write_error(probe, "permission denied")


def _write_error(folder: Path, reason: str) -> LoopsError:
    return LoopsError(f"cannot write to {folder}: {reason}", hint="Choose a folder you can write to with -O DIR.")


def export_checkpoint(
    client: "LoopsClient",
    ref: str,
    dest: Path,
    *,
    fmt: str = "peft",
    dtype: str = "float32",
    force: bool = False,
    target: str | None = None,
    progress: "Progress | None" = None,
    command: str | None = None,
    base_path: str | None = None,
) -> ExportResult:
    """Resolve ``ref`` (id, bt:// URI or RUN:NAME), download its files, export them."""
    from baseten_loops_cli.services import checkpoints as service
    from baseten_loops_cli.services.resolve import display_name, resolve_checkpoint

    check_options(fmt, dtype)
    require_local_extra()
    prepare_target(dest, force)
    cp = resolve_checkpoint(client, ref, target, prefer="sampler")
    label = display_name(cp)
    if cp.target == "trainer":
        raise UsageError(
            f"{label} is a trainer checkpoint (optimizer state for resuming); export needs a sampler checkpoint",
            hint=f"Save one with save_weights_for_sampler, or pick one from `loops checkpoints list --run-id {cp.run_id} --target sampler`"
                 f" (for a shared name: `{label} --target sampler`).",
        )
    base = cp.base_model
    if not base:
        base = (cp.lora_adapter_config or {}).get("base_model_name_or_path") or ""
    card = {"checkpoint": label, "uri": cp.uri, "run_id": cp.run_id, "base_model": base,
            "lora_rank": cp.lora_rank, "created_at": str(cp.created_at or ""), "command": command}
    try:
        from baseten_loops_cli.services.resolve import get_run

        run = get_run(client, cp.run_id)
        card["run_name"] = run.name
    except LoopsError:
        pass
    with tempfile.TemporaryDirectory(prefix="loops-export-") as tmp:
        plan = service.plan_download(client, cp.id, Path(tmp) / "adapter", None)
        service.download(client, plan, force=True, progress=progress)
        if not base:
            import json

            base = json.loads((plan.dest / "adapter_config.json").read_text()).get("base_model_name_or_path", "")
        result = export_adapter(plan.dest, base, dest, fmt=fmt, dtype=dtype, force=force, card=card, progress=progress,
                                base_path=base_path)
    result.checkpoint = label
    return result


def export_adapter(
    adapter_dir: Path,
    base_model: str,
    dest: Path,
    *,
    fmt: str = "peft",
    dtype: str = "float32",
    force: bool = False,
    card: dict[str, Any] | None = None,
    progress: "Progress | None" = None,
    base_path: str | None = None,
) -> ExportResult:
    """Export a PEFT adapter folder trained on ``base_model`` into ``dest``. ``base_path``
    (peft only): the base folder to name in ``adapter_config.json`` (loads offline)."""
    check_options(fmt, dtype)
    require_local_extra()
    prepare_target(dest, force)
    from baseten_loops_cli.export import writers

    dest = dest.expanduser().absolute()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    except OSError as exc:
        raise _write_error(dest.parent, (exc.strerror or type(exc).__name__).lower()) from None
    try:
        result = writers.write(adapter_dir, base_model, staging, dest, fmt=fmt, dtype=dtype,
                               card=card or {"base_model": base_model}, progress=progress, base_path=base_path)
        _follow_umask(staging)
        if dest.exists() or dest.is_symlink():
            _remove(dest)
        os.replace(staging, dest)
    except BaseException as exc:
        _remove(staging)
        if _disk_full(exc):
            raise LoopsError(f"the disk holding {dest.parent} filled up while exporting; nothing was left behind",
                             hint="Free some space (or pick another -O) and run it again.") from None
        raise
    return result


def _follow_umask(root: Path) -> None:
    """An export is meant to be shared: give it the modes a plain ``mkdir``/``open`` would (the
    staging folder is made 0700 by mkdtemp, and some writers make their files 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(root, 0o777 & ~mask)
    for path in root.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def _disk_full(exc: BaseException) -> bool:
    # safetensors (Rust) reports ENOSPC as a SafetensorError whose text carries "os error 28".
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return f"(os error {errno.ENOSPC})" in str(exc) or "No space left on device" in str(exc)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
