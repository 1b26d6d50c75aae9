"""The README is executable: its first command's training step and every command of the
five-minute tour run against the local backend, as a newcomer would type them.

The README stays the source: a small parser reads its fenced ``bash`` blocks, so a command
changed there is the command tested here. What is run:

- block 1 ("Set up, then run the main job"): its ``loops train run ...`` step (the venv set-up
  and the pytest line are this test's own environment);
- the block under "## A five-minute tour": every command, in order, through ``bash`` in a
  scratch directory that holds ``examples/`` (so globs such as ``runs/tiny-sft-*/`` expand as
  for a user), with ``RUN_ID`` replaced by the id of the tour's tiny-sft run.

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

pytest.importorskip("torch")
pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# Commands whose report is on stderr by design (stdout is kept for data); all others must print
# something on stdout.
STDERR_ONLY = ("loops train run", "loops checkpoints download")


@dataclass
class Block:
    heading: str  # the nearest "## " or "### " heading above the block
    lines: list[str]


def bash_blocks(text: str) -> list[Block]:
    """The fenced ```bash blocks of a Markdown text, with the heading each sits under."""
    blocks, heading, inside, current = [], "", False, []
    for line in text.splitlines():
        if not inside and line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```bash" and not inside:
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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPS_", "BASETEN_", "WANDB_"))}
    env.update(server.env, LOOPS_NO_AUTOSTART="1", NO_COLOR="1", COLUMNS="120", PYTHONPATH=str(ROOT),
               PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}")
    return env


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
