"""The figure on the first screen of the checkpoints page: which rank wrote which file
of a real DCP save, and how many bytes each file holds."""

from __future__ import annotations

from pathlib import Path

# DCP names rank r's shard file __r_<n>.distcp; its coordinator (rank 0) writes
# .metadata, and the lab's rank 0 adds train_state.json
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def writer(name: str) -> int:
    """The rank that wrote file ``name`` of a checkpoint folder."""
    if name.startswith("__") and name.endswith(".distcp"):
        return int(name[2:].split("_")[0])
    return 0


def files_figure(folder: str | Path):
    """Horizontal bars, one per file of the checkpoint ``folder``: its bytes, coloured
    by the rank that wrote it."""
    import matplotlib.pyplot as plt

    folder = Path(folder)
    files = sorted(
        (f for f in folder.iterdir()),
        key=lambda f: (writer(f.name), not f.name.startswith("__"), f.name),
    )
    sizes = [f.stat().st_size for f in files]
    fig, ax = plt.subplots(figsize=(7, 1 + 0.9 * len(files)))
    for y, (f, size) in enumerate(zip(files, sizes)):
        rank = writer(f.name)
        ax.barh(y, size, color=COLOURS[rank % len(COLOURS)])
        ax.text(
            max(sizes) * 0.02 + size,
            y,
            f"{size / 1e3:,.1f} kB, rank {rank}",
            va="center",
            fontsize=16,
        )
    ax.set_yticks(range(len(files)), [f.name for f in files], fontsize=16)
    ax.invert_yaxis()
    ax.set_xlim(0, max(sizes) * 1.9)
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{folder.name}.partial/ → {folder.name}/ once complete", fontsize=16)
    fig.tight_layout()
    return fig
