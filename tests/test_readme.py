"""The README is executable: its first command's training step and every command of the
five-minute tour run against the local backend, as a newcomer would type them. The reference in
docs/ is checked too: its deploy lines run after the tour, every YAML config in it validates
with `loops train validate`, its tables are whole, and the README's wall times are the measuring
script's.

The README stays the source: a small parser reads its fenced ``bash`` blocks, so a command
changed there is the command tested here. What is run:

- block 1 ("Set up, then run the main job"): its ``loops train run ...`` step (the venv set-up
  and the pytest line are this test's own environment);
- the block under "## A five-minute tour": every command, in order, through ``bash`` in a
  scratch directory that holds ``examples/`` (so globs such as ``runs/tiny-sft-*/`` expand as
  for a user), with ``RUN_ID`` replaced by the id of the tour's tiny-sft run.

- docs/deploy.md's first ``bash`` block, after the tour, as one script (its lines share
  ``eval`` and ``export``), with a second, newer deployment of another name made before its
  ``--jq`` line: the line must pick the deployment it names, not the newest.

Left out on purpose: the SmolLM2 section (a ~270 MB model download and minutes of training, not
for CI), the SDK section (a separate Python 3.12 venv; tests/test_local_sdk_compat.py), and the
Baseten/config sections (they need a real key). A command fails the test when it exits non-zero
or prints nothing where output is expected; the README's sample line must answer right.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import cli_env

pytest.importorskip("torch")
pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Commands whose report is on stderr by design (stdout is kept for data); all others must print
# something on stdout.
STDERR_ONLY = ("loops train run", "loops checkpoints download")


@dataclass
class Block:
    heading: str  # the nearest "## " or "### " heading above the block
    lines: list[str]


def bash_blocks(text: str, language: str = "bash") -> list[Block]:
    """The fenced ```bash (or ``language``) blocks of a Markdown text, with the heading each sits under."""
    blocks, heading, inside, current = [], "", False, []
    for line in text.splitlines():
        if not inside and line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        if line.strip() == f"```{language}" and not inside:
            inside, current = True, []
        elif line.strip() == "```" and inside:
            inside = False
            blocks.append(Block(heading, current))
        elif inside:
            current.append(line)
    return blocks


def commands(block: Block) -> list[str]:
    """The block's commands: comments and blank lines dropped, trailing "  # ..." comments cut."""
    out = []
    for line in block.lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cut = next((m.start() for m in re.finditer(r"\s+#\s", line) if _outside_quotes(line, m.start())), None)
        out.append(line[:cut].strip() if cut is not None else line.strip())
    return out


def _outside_quotes(line: str, index: int) -> bool:
    return line[:index].count('"') % 2 == 0 and line[:index].count("'") % 2 == 0


def test_parser_reads_the_readme_blocks():
    blocks = bash_blocks(README.read_text(encoding="utf-8"))
    tour = next(b for b in blocks if b.heading.startswith("A five-minute tour"))
    cmds = commands(tour)
    assert cmds[0] == "source .venv/bin/activate"
    assert "loops train run examples/tiny-sft.yaml --yes" in cmds
    assert all(not c.endswith("#") for c in cmds)
    setup = commands(blocks[0])[0]
    assert "loops train run examples/tiny-sft.yaml --yes" in setup


def test_the_tour_leaves_nothing_untracked_in_the_clone():
    """Every folder the tour writes with -O is under a gitignored path (runs/)."""
    blocks = bash_blocks(README.read_text(encoding="utf-8"))
    tour = next(b for b in blocks if b.heading.startswith("A five-minute tour"))
    targets = [m.group(1) for c in commands(tour) for m in re.finditer(r"\s-O\s+(\S+)", c)]
    assert targets, "the tour writes no folder with -O"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *targets], cwd=ROOT, capture_output=True, text=True)
    assert sorted(ignored.stdout.split()) == sorted(targets), (targets, ignored.stdout)


def test_the_smol_rl_description_matches_its_data():
    """README says one-digit additions; every prompt of examples/smol-rl.yaml's data is one."""
    text = README.read_text(encoding="utf-8")
    assert "smol-rl.yaml --yes     # PPO on one-digit additions" in text
    import json

    for name in ("smol_rl_prompts.jsonl", "smol_rl_eval.jsonl"):
        for line in (ROOT / "examples" / "data" / name).read_text().splitlines():
            a, b = re.findall(r"\d+", json.loads(line)["prompt"])[:2]
            assert len(a) == 1 and len(b) == 1, line


def _env(server, workdir: Path) -> dict[str, str]:
    bindir = workdir / ".bin"
    bindir.mkdir(exist_ok=True)
    shim = bindir / "loops"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m baseten_loops_cli "$@"\n')
    shim.chmod(0o755)
    return cli_env(server, COLUMNS="120", PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")


def _run(command: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=env, cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.mark.timeout(1800)  # two tiny SFT and two tiny RL runs: ~4 min on two idle cores
def test_readme_first_command_and_tour_run_as_written(local_server, tmp_path):
    blocks = bash_blocks(README.read_text(encoding="utf-8"))
    workdir = tmp_path / "clone"
    workdir.mkdir()
    (workdir / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    env = _env(local_server, workdir)

    # Block 1: the main job, as `loops` (the venv's entry point) would run it.
    setup = commands(blocks[0])[0]
    main_job = re.search(r"\S*loops (train run \S+ --yes)", setup)
    assert main_job, setup
    first = _run(f"loops {main_job.group(1)}", env, workdir)
    assert first.returncode == 0, first.stderr
    assert "Done: run" in first.stderr

    tour = next(b for b in blocks if b.heading.startswith("A five-minute tour"))
    run_id = None
    for command in commands(tour):
        if command.startswith("source "):
            continue  # the venv: this test's interpreter stands in for it
        if "RUN_ID" in command:
            assert run_id, "the tour uses RUN_ID before any tiny-sft run was made"
            command = command.replace("RUN_ID", run_id)
        result = _run(command, env, workdir)
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr, (command, result.stderr)
        if command.startswith(STDERR_ONLY):
            assert result.stderr.strip(), command
        else:
            assert result.stdout.strip(), (command, "printed nothing on stdout", result.stderr)
        if command.startswith("loops train run examples/tiny-sft.yaml"):
            run_id = re.search(r"Done: run (\S+),", result.stderr).group(1)
        if command.startswith("loops sample") and "What is 2+3?" in command:
            assert result.stdout.strip() == "ANSWER: 5", (command, result.stdout)  # what the README says
        if command.startswith("loops train plot"):
            assert result.stdout.count("tiny-sft-") >= 2  # both tiny-sft runs overlaid

    # docs/deploy.md: deploy, then select the URL by name and ask it. A deployment of another name
    # made between them is the newest: `.deployments[0]` would pick it, and it has no "my-adapter".
    deploy = bash_blocks((DOCS / "deploy.md").read_text(encoding="utf-8"))[0]
    lines = [line.replace("RUN_ID", run_id) for line in deploy.lines]
    assert lines[0].startswith("loops deploy ") and "--model-name my-adapter" in lines[0], lines[0]
    script = "\n".join(["set -e", lines[0], f"loops deploy {run_id}:final --model-name decoy --yes >/dev/null", *lines[1:]])
    result = _run(script, env, workdir)
    assert result.returncode == 0, (script, result.stdout, result.stderr)
    assert "ANSWER: 5" in result.stdout, (script, result.stdout, result.stderr)  # what the page says


# ── docs/: YAML configs, tables, and the README's figures ─────────────────────────────────────

FRAGMENT = "# fragment"  # the first line of a YAML snippet that is part of a config, not a whole one


def test_every_yaml_config_in_docs_validates(tmp_path):
    """Each ```yaml block of docs/ is a whole config that `loops train validate --offline`
    accepts (its data paths relative to a folder holding examples/data and examples/envs), or is
    marked as a fragment on its first line and is at least valid YAML."""
    import yaml

    full, fragments = [], []
    for page in sorted(DOCS.glob("*.md")):
        for n, block in enumerate(bash_blocks(page.read_text(encoding="utf-8"), "yaml")):
            text = "\n".join(block.lines) + "\n"
            if block.lines and block.lines[0].startswith(FRAGMENT):
                assert yaml.safe_load(text) is not None, (page.name, block.heading)
                fragments.append(page.name)
                continue
            folder = tmp_path / f"{page.stem}-{n}"
            folder.mkdir()
            for sub in ("data", "envs"):
                (folder / sub).symlink_to(ROOT / "examples" / sub, target_is_directory=True)
            (folder / "config.yaml").write_text(text)
            result = subprocess.run([sys.executable, "-m", "baseten_loops_cli", "train", "validate", "config.yaml", "--offline"],
                                    cwd=folder, capture_output=True, text=True, timeout=300,
                                    env={**os.environ, "LOOPS_NO_AUTOSTART": "1", "NO_COLOR": "1"})
            assert result.returncode == 0, (page.name, block.heading, text, result.stderr)
            full.append(page.name)
    # The configs pages are meant to hold: a whole one in the reference and one per environment page.
    assert {"training-config.md", "environments.md"} <= set(full), (full, fragments)


def _tables(text: str) -> list[list[str]]:
    """The Markdown tables of ``text`` (runs of lines that start with ``|``, outside code)."""
    tables, current, inside = [], [], False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            inside = not inside
        if not inside and line.startswith("|"):
            current.append(line)
            continue
        if current:
            tables.append(current)
            current = []
    return tables


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in DOCS.glob("*.md"))])
def test_tables_are_whole(page):
    """Every table has its header separator (a table split by a blank line shows its second part
    as raw pipes), and no key is listed twice in one table (the RL rows were repeated)."""
    text = (README if page == "README.md" else DOCS / page).read_text(encoding="utf-8")
    for table in _tables(text):
        assert len(table) >= 2 and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", table[1].strip()), (page, table[:2])
        keys = [tuple(cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:3]) for row in table[2:]]  # the first two columns
        assert len(keys) == len(set(keys)), (page, [k for k in keys if keys.count(k) > 1])


def test_readme_wall_times_come_from_the_measuring_script():
    """The README's wall times are the block scripts/measure_readme.py wrote (with its date,
    machine and load), and the first command's figure is that block's figure for it."""
    text = README.read_text(encoding="utf-8")
    start, end = text.index("<!-- scripts/measure_readme.py: start -->"), text.index("<!-- scripts/measure_readme.py: end -->")
    block = text[start:end]
    assert re.search(r"Measured \d{4}-\d\d-\d\d \d\d:\d\d UTC by `python scripts/measure_readme.py", block), block
    assert "load average" in block and "cores" in block
    rows = {m.group(1): [c.strip() for c in m.group(2).split("|")]
            for m in re.finditer(r"^\| `loops ([^`]+)` \| [^|]+ \|(.+)\|$", block, re.M)}
    first = rows.get("train run examples/tiny-sft.yaml --yes")
    assert first, block
    wall, load, idle = first
    setup = bash_blocks(text)[0].lines[0]
    assert f"{wall} on" in setup and idle in setup and f"load {load}" in setup, (setup, first)
    outside = text[:start] + text[end:]
    # A range as the script writes one ("12 s - 13 s") is one figure; then every other time.
    ranges = re.findall(r"\b\d+(?:\.\d+)? (?:s|min) - \d+(?:\.\d+)? (?:s|min)\b", outside)
    for figure in ranges:
        outside = outside.replace(figure, " ", 1)
    times = ranges + re.findall(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:s|min|seconds|minutes)\b(?![-\w])", outside)
    assert sorted(times) == sorted([wall, idle]), times  # only the first command's, checked above


def test_measuring_script_block_is_what_the_readme_test_reads(tmp_path):
    """scripts/measure_readme.py's block carries date, machine and load, one row per command, and
    --readme replaces what lies between the README's markers and nothing else."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import measure_readme
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    sft = measure_readme.Case("tiny SFT", ["train", "run", "examples/tiny-sft.yaml", "--yes"], cold=True,
                              seconds=[40.2, 95.0], loads=[9.5, 12.25, 11.0, 10.0])
    rl = measure_readme.Case("tiny RL", ["train", "run", "examples/tiny-rl.yaml", "--yes"], seconds=[150.0, 150.2], loads=[8.0, 9.0])
    block = measure_readme.markdown([sft, rl], 2, "2026-12-06 01:30 UTC", ["--repeat", "2"])
    assert block.startswith("Measured 2026-12-06 01:30 UTC by `python scripts/measure_readme.py --repeat 2` at ")
    assert "load average 8.0-12.2 during the runs" in block and "fastest and slowest of 2 runs" in block
    cores = os.cpu_count() or 1
    idle = measure_readme.duration(150.1 * cores / (cores + 8.5))
    assert "| `loops train run examples/tiny-sft.yaml --yes` | tiny SFT | 40 s - 95 s | 10.7 |" in block
    assert f"| `loops train run examples/tiny-rl.yaml --yes` | tiny RL | 2.5 min | 8.5 | {idle} |" in block
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{measure_readme.START}\nold\n{measure_readme.END}\nafter\n")
    measure_readme.write_readme(block, readme)
    body = readme.read_text()
    assert "old" not in body and block in body and body.startswith("# x\nbefore\n") and body.endswith("after\n")
