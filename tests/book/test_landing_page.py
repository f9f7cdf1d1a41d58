"""The landing page's "Run a lab" commands work as printed.

The CPU tab is run for real (fewer steps); the GPU tabs cannot run here, so each of their
command lines is parsed by torchrun's own argument parser and by the lab's, which refuse an
option that does not exist or a value of the wrong type."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from distlab.bench.labs import load_lab
from distlab.cli import parse_config
from distlab.infra.paths import REPO_ROOT

INTRO = (REPO_ROOT / "book" / "intro.md").read_text()
pytestmark = pytest.mark.timeout(600)


def tab_commands(title: str) -> list[list[str]]:
    """The commands of the bash block in the tab `title` (continuation lines joined, comments
    and `source` dropped), each split as a shell would."""
    tab = re.search(r":::\{tab-item\} " + re.escape(title) + r"\n(.*?)\n:::", INTRO, re.S)
    assert tab, f"intro.md has no tab {title!r}"
    block = re.search(r"```bash\n(.*?)```", tab.group(1), re.S).group(1).replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [c for c in commands if c and c[0] != "source"]


def split_torchrun(command: list[str]) -> tuple[list[str], str, list[str]]:
    """torchrun's own options, the script, the script's options."""
    script_at = next(i for i, a in enumerate(command) if a.endswith(".py"))
    return command[1:script_at], command[script_at], command[script_at + 1 :]


def test_the_cpu_commands_run(tmp_path):
    commands = tab_commands("CPU (a laptop)")
    assert [c[0] for c in commands] == ["python", "torchrun", "python"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    for command in commands:
        command = ["3" if prev == "--steps" else a for prev, a in zip([""] + command, command)]
        command = [str(REPO_ROOT / a) if a.startswith("src/") else a for a in command]
        if command[0] == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
        else:
            command = [sys.executable, *command[1:]]
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{shlex.join(command)}\n{proc.stderr[-3000:]}"
    assert (tmp_path / "runs" / "lab2" / "summary.json").is_file()
    assert (tmp_path / "loss.png").stat().st_size > 10_000


@pytest.mark.parametrize("title", ["GPUs (one machine)", "GPUs (several machines)"])
def test_the_gpu_commands_parse(title):
    commands = tab_commands(title)
    assert commands and all(c[0] == "torchrun" for c in commands)
    for command in commands:
        torchrun_args, script, lab_args = split_torchrun(command)
        get_args_parser().parse_args([*torchrun_args, script])  # exits (SystemExit) on a bad option
        lab = load_lab(script.removeprefix("src/labs/").removesuffix(".py"))
        config = parse_config(lab.TrainConfig, lab_args)
        assert config.dtype == "bf16" and config.preset == "shakespeare"
        for gpus in (1, 2, 4, 8):  # the batch splits evenly on common machines, as the page says
            micro = getattr(config, "micro_batch_size", config.batch_size // gpus)
            assert config.batch_size % gpus == 0 and (config.batch_size // gpus) % micro == 0
