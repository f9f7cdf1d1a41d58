"""The landing page's "Run a lab" commands work as printed.

The CPU tab is run for real (fewer steps); the GPU tabs cannot run here, so each of
their command lines is parsed by torchrun's own argument parser and by the lab's, which
refuse an option that does not exist or a value of the wrong type."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from distlab.bench.lab_scripts import load_lab
from distlab.cli import parse_config
from distlab.infra.paths import REPO_ROOT
from distlab.tools.runs import main as runs_cli

INTRO = (REPO_ROOT / "book" / "intro.md").read_text()
pytestmark = pytest.mark.timeout(600)


def tab_commands(title: str) -> list[list[str]]:
    """The commands of the bash block in the tab `title` (continuation lines joined,
    comments and `source` dropped), each split as a shell would."""
    tab = re.search(
        r":::\{tab-item\} " + re.escape(title) + r"\n(.*?)\n:::", INTRO, re.S
    )
    assert tab, f"intro.md has no tab {title!r}"
    block = (
        re.search(r"```bash\n(.*?)```", tab.group(1), re.S)
        .group(1)
        .replace("\\\n", " ")
    )
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [c for c in commands if c and c[0] != "source"]


def split_torchrun(command: list[str]) -> tuple[list[str], str, list[str]]:
    """torchrun's own options, the script, the script's options."""
    script_at = next(i for i, a in enumerate(command) if a.endswith(".py"))
    return command[1:script_at], command[script_at], command[script_at + 1 :]


def test_the_cpu_commands_run(tmp_path, monkeypatch):
    """The two training commands run at once (each its own processes; the plot needs
    both), as printed but for fewer steps; then the plot command, through the same entry
    point that ``python -m distlab.tools.runs`` calls, in this process (a Python
    start-up fewer)."""
    commands = tab_commands("CPU (a laptop)")
    assert [c[0] for c in commands] == ["python", "torchrun", "python"]
    *training, plot = commands
    assert plot[:3] == ["python", "-m", "distlab.tools.runs"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    started = []
    for command in training:
        command = [
            "3" if prev == "--steps" else a for prev, a in zip([""] + command, command)
        ]
        command = [str(REPO_ROOT / a) if a.startswith("src/") else a for a in command]
        if command[0] == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
        else:
            command = [sys.executable, *command[1:]]
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append((command, proc))
    try:
        for command, proc in started:
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{shlex.join(command)}\n{stderr[-3000:]}"
    finally:
        for _, proc in started:
            # no-op for a process that exited; a timed-out one must not outlive the test
            proc.kill()
    assert (tmp_path / "runs" / "lab2" / "summary.json").is_file()
    monkeypatch.chdir(tmp_path)
    assert runs_cli(plot[3:]) in (0, None)
    assert (tmp_path / "loss.png").stat().st_size > 10_000


@pytest.mark.parametrize("title", ["GPUs (one machine)", "GPUs (several machines)"])
def test_the_gpu_commands_parse(title):
    commands = tab_commands(title)
    assert commands and all(c[0] == "torchrun" for c in commands)
    for command in commands:
        torchrun_args, script, lab_args = split_torchrun(command)
        # exits (SystemExit) on a bad option
        get_args_parser().parse_args([*torchrun_args, script])
        lab = load_lab(script.removeprefix("src/labs/").removesuffix(".py"))
        config = parse_config(lab.TrainConfig, lab_args)
        assert config.dtype == "bf16" and config.preset == "shakespeare"
        # the batch splits evenly on common machines, as the page says
        for gpus in (1, 2, 4, 8):
            micro = getattr(config, "micro_batch_size", config.batch_size // gpus)
            assert (
                config.batch_size % gpus == 0
                and (config.batch_size // gpus) % micro == 0
            )
