"""Figures and excerpts for the multi-node page, drawn from a real run's facts.

``node_map`` draws the nodes of a torchrun job as the workers reported them (node rank,
local ranks, global ranks) with the two stores where they were hosted. ``script_lines``
shows the lines of a batch script that carry the launch, within the reading column.
"""

from __future__ import annotations

import shlex

import matplotlib.pyplot as plt

RANK0 = "#3b6ea5"  # the workers of node rank 0
OTHER = "#e39b4c"


def node_map(workers: list[dict], nodes: dict[str, dict], stores: list[dict]):
    """The job as its workers saw it: one box per node (left to right by node rank),
    one box per worker (``RANK`` and ``LOCAL_RANK``), and under each node the stores it
    hosts.

    ``workers``: the workers' reports, each with ``node`` (a name), ``RANK``,
    ``LOCAL_RANK`` and ``GROUP_RANK``. ``nodes``: per name, a ``note`` (one short
    line) and its ``addr``. ``stores``: each with ``node`` (its host's name), ``name``,
    ``at`` (host:port) and ``who`` (who meets there).
    """
    rank_of = {w["node"]: int(w["GROUP_RANK"]) for w in workers}
    order = sorted(nodes, key=rank_of.__getitem__)
    fig, ax = plt.subplots(figsize=(6.4, 4.9))
    width, gap = 3.8, 0.4
    for i, name in enumerate(order):
        x = i * (width + gap)
        mine = sorted(
            (w for w in workers if w["node"] == name),
            key=lambda w: int(w["LOCAL_RANK"]),
        )
        ax.add_patch(plt.Rectangle((x, 2.0), width, 2.6, fc="#f3f3f3", ec="#555"))
        ax.text(
            x + 0.15,
            4.3,
            f"node {name}: node rank {rank_of[name]}",
            fontsize=15,
            weight="bold",
            va="center",
        )
        ax.text(x + 0.15, 3.85, nodes[name]["note"], fontsize=13, va="center")
        ax.text(
            x + 0.15, 3.45, f"address {nodes[name]['addr']}", fontsize=13, va="center"
        )
        box = (width - 0.3 - 0.2 * (len(mine) - 1)) / max(len(mine), 1)
        for j, w in enumerate(mine):
            left = x + 0.15 + j * (box + 0.2)
            color = RANK0 if rank_of[name] == 0 else OTHER
            ax.add_patch(plt.Rectangle((left, 2.15), box, 1.0, fc=color, ec="none"))
            ax.text(
                left + box / 2,
                2.65,
                f"rank {w['RANK']}\nlocal {w['LOCAL_RANK']}",
                ha="center",
                va="center",
                color="white",
                fontsize=15,
                weight="bold",
            )
    for store in stores:
        x = order.index(store["node"]) * (width + gap)
        ax.add_patch(
            plt.Rectangle(
                (x + 0.2, 0.0), width - 0.4, 1.45, fc="white", ec="#555", ls="--"
            )
        )
        ax.text(
            x + width / 2,
            0.72,
            f"{store['name']}\n{store['at']}\n{store['who']}",
            ha="center",
            va="center",
            fontsize=13,
        )
        for i in range(len(order)):  # every node connects to every store
            top = i * (width + gap) + width / 2
            ax.plot([top, x + width / 2], [2.0, 1.45], color="#555", lw=1.2)
    ax.set_xlim(-0.05, len(order) * (width + gap) - gap + 0.05)
    ax.set_ylim(-0.05, 4.65)
    ax.axis("off")
    fig.tight_layout()
    return fig


def script_lines(text: str, width: int = 88) -> str:
    """The launch lines of a batch script: its ``#SBATCH`` lines, the rendezvous
    endpoint's assignments and the last ``srun`` command, without comments; a command
    wider than ``width`` is split between its words, outside quotes, with ``\\``."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("srun "))
    keep = [line for line in lines[:start] if line.startswith("#SBATCH ")]
    keep += [""] + [
        line
        for line in lines[:start]
        if line.startswith(("NODES=", "RDZV_HOST=", "RDZV_PORT="))
    ]
    keep += [""] + [line for line in lines[start:] if not line.lstrip().startswith("#")]
    return "\n".join(
        out for line in keep for out in (wrap_command(line, width).splitlines() or [""])
    )


def wrap_command(line: str, width: int = 88) -> str:
    """A shell command split between its words (outside quotes) into lines of at most
    ``width`` characters, joined by ``\\`` as a shell reads them."""
    if len(line) <= width:
        return line
    lead = line[: len(line) - len(line.lstrip())]
    words = shlex.split(line.rstrip(" \\"), posix=False)
    tail = " \\" if line.endswith("\\") else ""
    out, current = [], lead + words[0]
    for word in words[1:]:
        if len(current) + 1 + len(word) + 2 > width:
            out.append(current + " \\")
            current = lead + "    " + word
        else:
            current += " " + word
    return "\n".join([*out, current + tail])
