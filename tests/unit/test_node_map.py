"""The multi-node page's excerpt of its batch script, and its wrapped commands: within
the reading column, and still the same shell words."""

import shlex
import subprocess

from distlab.chapters.multi_node import SBATCH_SCRIPT
from distlab.figures.node_map import script_lines, wrap_command


def test_the_script_excerpt_fits_the_column_and_still_parses():
    excerpt = script_lines(SBATCH_SCRIPT.read_text())
    assert max(map(len, excerpt.splitlines())) <= 88
    assert "--rdzv-endpoint=" in excerpt and "#SBATCH --nodes=2" in excerpt
    proc = subprocess.run(
        ["bash", "-n"], input=excerpt, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr


def test_a_wrapped_command_keeps_its_words():
    command = "torchrun " + " ".join(f"--option-{i}=value-{i}" for i in range(12))
    wrapped = wrap_command(command, 40)
    assert max(map(len, wrapped.splitlines())) <= 40
    assert shlex.split(wrapped.replace("\\\n", " ")) == shlex.split(command)
    assert wrap_command("short", 40) == "short"
