"""The landing page's figures (book/intro.md has no chapter module: CONTRIBUTING.md,
"Where code goes").

    lab_path_figure(lab_titles())  # the six labs, each the previous one plus a feature
    ranks_figure(nodes=2, per_node=2)  # RANK, LOCAL_RANK, WORLD_SIZE of each process
"""

from __future__ import annotations

import re

from distlab.infra.paths import REPO_ROOT

LABS = REPO_ROOT / "labs"


def lab_titles() -> list[tuple[str, str]]:
    """("lab 1", "training on a single device"), ... from the lab pages' titles."""
    labs = []
    for page in sorted(LABS.glob("lab[0-9]_*.md")):
        title = re.search(r"^# Lab (\d+): (.+)$", page.read_text(), flags=re.M)
        if title:
            labs.append((f"lab {title.group(1)}", title.group(2)))
    return labs


def lab_path_figure(labs: list[tuple[str, str]], per_row: int = 3):
    """The labs as boxes in reading order, ``per_row`` to a row, an arrow from each
    to the next: each lab is the previous one plus one feature."""
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    rows = -(-len(labs) // per_row)
    fig, ax = plt.subplots(figsize=(7, 1.7 * rows + 0.4))
    w, h, gap = 2.2, 1.2, 0.4

    def corner(i: int) -> tuple[float, float]:
        # a snake: odd rows run right to left, so each arrow is short and straight
        row, col = divmod(i, per_row)
        col = per_row - 1 - col if row % 2 else col
        return col * (w + gap), (rows - 1 - row) * (h + 0.5)

    for i, (name, feature) in enumerate(labs):
        x, y = corner(i)
        ax.add_patch(
            FancyBboxPatch(
                (x, y),
                w,
                h,
                boxstyle="round,pad=0.04",
                fc="#dbe9f6" if i == 0 else "#f3f3f3",
                ec="#3b6ea5",
            )
        )
        ax.text(x + w / 2, y + h - 0.28, name, ha="center", fontsize=15, weight="bold")
        ax.text(
            x + w / 2,
            y + 0.4,
            textwrap.fill(feature, 16, break_long_words=False),
            ha="center",
            va="center",
            fontsize=12,
            color="#3b6ea5",
        )
        if i + 1 < len(labs):
            nx, ny = corner(i + 1)
            if ny != y:  # down to the next row
                start, end = (x + w / 2, y - 0.04), (nx + w / 2, ny + h + 0.04)
            elif nx > x:
                start, end = (x + w + 0.04, y + h / 2), (nx - 0.04, ny + h / 2)
            else:
                start, end = (x - 0.04, y + h / 2), (nx + w + 0.04, ny + h / 2)
            ax.annotate(
                "",
                xy=end,
                xytext=start,
                arrowprops=dict(arrowstyle="->", color="#3b6ea5", lw=1.5),
            )
    ax.set_xlim(-0.1, per_row * (w + gap) - gap + 0.1)
    ax.set_ylim(-0.15, rows * (h + 0.5) - 0.35)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


def ranks_figure(nodes: int = 2, per_node: int = 2):
    """``nodes`` machines with ``per_node`` processes each, one per GPU, numbered as
    torchrun numbers them: ``RANK = node * per_node + LOCAL_RANK``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    world = nodes * per_node
    box, node_w = 1.9, per_node * 2.1 + 0.2
    fig, ax = plt.subplots(figsize=(7, 2.6))
    for node in range(nodes):
        x0 = node * (node_w + 0.5)
        ax.add_patch(
            FancyBboxPatch(
                (x0, 0),
                node_w,
                2.2,
                boxstyle="round,pad=0.05",
                fc="#fafafa",
                ec="#888",
            )
        )
        ax.text(x0 + node_w / 2, 1.9, f"node {node}", ha="center", fontsize=12)
        for local in range(per_node):
            rank = node * per_node + local
            x = x0 + 0.2 + local * 2.1
            ax.add_patch(
                FancyBboxPatch(
                    (x, 0.15),
                    box,
                    1.5,
                    boxstyle="round,pad=0.03",
                    fc="#dbe9f6",
                    ec="#3b6ea5",
                )
            )
            ax.text(x + box / 2, 1.3, f"RANK {rank}", ha="center", fontsize=13)
            ax.text(x + box / 2, 0.9, f"LOCAL_RANK {local}", ha="center", fontsize=10)
            ax.text(
                x + box / 2,
                0.35,
                f"cuda:{local}",
                ha="center",
                fontsize=11,
                color="#3b6ea5",
            )
        if node:
            ax.annotate(
                "",
                xy=(x0 - 0.05, 1.0),
                xytext=(x0 - 0.45, 1.0),
                arrowprops=dict(arrowstyle="<->"),
            )
            ax.text(x0 - 0.25, 1.15, "network", ha="center", fontsize=9, rotation=90)
    ax.set_title(f"WORLD_SIZE = {world}: one process per GPU", fontsize=12)
    ax.set_xlim(-0.1, nodes * (node_w + 0.5) - 0.4)
    ax.set_ylim(-0.1, 2.35)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig
