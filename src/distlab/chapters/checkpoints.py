"""The Distributed checkpoints chapter's experiments: lab 4 saving sharded checkpoints,
what DCP wrote (which rank's file holds which rows of a tensor, what the checkpoint
holds by group), resuming on the same and on other numbers of ranks, and a damaged or
mismatched checkpoint.

    never_stopped = train_lab4(runs / "never_stopped", "--checkpoint-every", "10")
    piece_table(never_stopped / "checkpoints" / "step_000010", "app.model.wte.weight")
    resumed, said = resume_losses(step10, runs / "resumed_on_4", nprocs=4)
    # lab 2 on two emulated nodes, each --out on its own "disk"
    save_on_local_disks(runs / "disks")

Lab 4 runs as a script on local ranks (``distlab.infra.launch.run_script``), as torchrun
would start it; everything else reads the files it wrote.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

from distlab.infra.launch import RankFailed, run_script
from distlab.infra.paths import LABS_DIR, REPO_ROOT
from distlab.metrics import read_metrics
from distlab.model import GPT, preset

# --- begin lab4 run ---
LAB4 = "src/labs/lab4_fsdp2.py"
# 20 steps of the tiny model, global batch 16 in micro-batches of 4: on 1, 2 or 4 ranks
# the math of every step is the same, so a checkpoint can be resumed on any of them
ARGS = (
    "--preset tiny --steps 20 --batch-size 16 --micro-batch-size 4 --warmup-steps 5 "
    "--eval-every 10 --eval-batches 2 --sample-chars 0 --no-progress"
).split()


def train_lab4(out: str | Path, *extra: str, nprocs: int = 2) -> Path:
    """Lab 4 with ``ARGS`` plus ``extra`` on ``nprocs`` ranks, writing into ``out``."""
    run_script(LAB4, [*ARGS, *extra, "--out", out], nprocs=nprocs, quiet=True)
    return Path(out)


# --- end lab4 run ---


def losses(out: str | Path) -> list[float]:
    """The training loss of every step a run logged."""
    return [m["loss"] for m in read_metrics(out)]


def resume_losses(
    checkpoint: str | Path, out: str | Path, nprocs: int
) -> tuple[list[float], str]:
    """Lab 4 resumed from ``checkpoint`` on ``nprocs`` ranks: the losses of the steps it
    ran, and the line it printed on resuming ("resumed from ... at step 10 (saved by 2
    ranks, now 4)...")."""
    printed = io.StringIO()
    # the launcher prints the ranks' lines as they come
    with contextlib.redirect_stdout(printed):
        run_script(
            LAB4, [*ARGS, "--resume", str(checkpoint), "--out", out], nprocs=nprocs
        )
    said = [line for line in printed.getvalue().splitlines() if "resumed from" in line]
    return losses(out), said[0].split("] ", 1)[-1] if said else ""


def largest_difference(
    resumed: list[float], reference: list[float], relative: bool = False
) -> float:
    """The largest (relative) difference between the resumed losses and the reference's
    last ones."""
    if not resumed or len(resumed) > len(reference):
        raise ValueError(
            f"{len(resumed)} resumed losses cannot be the end of "
            f"{len(reference)} reference losses"
        )
    tail = reference[len(reference) - len(resumed) :]
    return max(
        abs(a - b) / (abs(b) if relative else 1.0) for a, b in zip(resumed, tail)
    )


def file_sizes(folder: str | Path) -> list[tuple[str, int]]:
    """(name, bytes) of every file in a checkpoint folder, by name."""
    return [(f.name, f.stat().st_size) for f in sorted(Path(folder).iterdir())]


def piece_table(checkpoint: str | Path, key: str) -> list[dict]:
    """Where DCP stored each piece of the tensor ``key``: its rows, shape, file and byte
    range, read from the checkpoint's ``.metadata`` index (nothing is loaded)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    if key not in metadata.state_dict_metadata:
        raise KeyError(
            f"{key!r} is not in {checkpoint}; it has "
            f"{len(metadata.state_dict_metadata)} other entries"
        )
    where = {
        index.offset: info
        for index, info in metadata.storage_data.items()
        if index.fqn == key
    }
    rows = []
    for chunk in metadata.state_dict_metadata[key].chunks:
        info, first = where[chunk.offsets], chunk.offsets[0]
        rows.append(
            {
                "rows": f"{first}-{first + chunk.sizes[0] - 1}",
                "piece shape": list(chunk.sizes),
                "file": info.relative_path,
                "byte offset": f"{info.offset:,}",
                "bytes": f"{info.length:,}",
            }
        )
    return rows


def checkpoint_groups(checkpoint: str | Path) -> dict[str, tuple[int, int]]:
    """Entries and tensor bytes by group of keys: ``model``, ``optim.state``,
    ``optim.param_groups`` and one ``rng.rankN`` per rank (the keys read
    "app.model.wte.weight", "app.optim.state.wte.weight.exp_avg", ...)."""
    from torch.distributed.checkpoint import FileSystemReader

    groups: dict[str, tuple[int, int]] = {}
    for key, meta in (
        FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items()
    ):
        parts = key.split(".")
        group = ".".join(parts[1:3]) if parts[1] in ("optim", "rng") else parts[1]
        n, size = groups.get(group, (0, 0))
        # a tensor; the rest (hyper-parameters) are pickled values
        if hasattr(meta, "size"):
            size += meta.size.numel() * meta.properties.dtype.itemsize
        groups[group] = (n + 1, size)
    return groups


def checkpoint_lines(script: str = LAB4) -> list[str]:
    """The lines of a lab script that deal with checkpoints, numbered, comments
    left out."""
    about = re.compile(r"Checkpoints|checkpoints\.|checkpoint_every|resume|start_step")
    lines = (REPO_ROOT / script).read_text().splitlines()
    return [
        f"{i + 1:4d}  {line}"
        for i, line in enumerate(lines)
        if about.search(line)
        and not line.lstrip().startswith(("#", "torchrun", "python"))
    ]


def truncated_copy(
    checkpoint: str | Path, out: str | Path, shard: str = "__1_0.distcp"
) -> Path:
    """A copy of ``checkpoint`` with ``shard`` cut to half its length, as a crashed disk
    might leave it."""
    shutil.copytree(checkpoint, out)
    path = Path(out) / shard
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    return Path(out)


def failed_resume(
    checkpoint: str | Path, out: str | Path, *extra: str, nprocs: int = 1
) -> tuple[str, str]:
    """Resume lab 4 with options that do not fit the checkpoint: the one line the rank
    stops with, and all it wrote to its stderr."""
    try:
        train_lab4(out, *extra, "--resume", str(checkpoint), nprocs=nprocs)
    except RankFailed as failed:
        return failed.summary, failed.details
    raise RuntimeError(
        f"lab 4 resumed from {checkpoint} with {extra}, which it should have refused"
    )


def overhead_at_scale(
    file_bytes: int, tensor_bytes: int, vocab_size: int, big: str = "shakespeare"
) -> dict:
    """The per-piece overhead of this (tiny) checkpoint, scaled to the ``big`` preset:
    pieces grow with the number of tensors, tensor bytes with the number of parameters.
    """
    small_model, big_model = (
        GPT(preset(name, vocab_size=vocab_size)) for name in ("tiny", big)
    )
    tensor_ratio = len(big_model.state_dict()) / len(small_model.state_dict())
    param_ratio = sum(p.numel() for p in big_model.parameters()) / sum(
        p.numel() for p in small_model.parameters()
    )
    overhead = (file_bytes - tensor_bytes) * tensor_ratio / (tensor_bytes * param_ratio)
    return {
        "tensor_ratio": tensor_ratio,
        "param_ratio": param_ratio,
        "overhead": overhead,
    }


# --- begin local disks ---
def save_on_local_disks(root: str | Path, timeout: float = 180) -> dict[str, dict]:
    """Lab 2 on two emulated nodes, one worker each, saving a checkpoint after its 2nd
    step, each node with its own ``--out`` under ``root``: the same path on two
    machines' local disks.

    Returns, by node folder name: the rank of its worker, its exit status, and the
    checkpoint files its "disk" holds (path under its ``--out``, bytes). Every file
    there was written by that node's one rank."""
    from distlab.chapters.multi_node import run_nodes, torchrun_command
    from distlab.infra.ports import free_port

    args = (
        "--preset tiny --steps 2 --batch-size 16 --eval-every 1000 --eval-batches 1 "
        "--sample-chars 0"
    )
    args = [*args.split(), "--no-progress", "--checkpoint-every", "2"]
    outs = {name: Path(root) / name for name in ("node_a", "node_b")}
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [
        torchrun_command(
            [LABS_DIR / "lab2_ddp.py", *args, "--out", out],
            nnodes=2,
            nproc_per_node=1,
            endpoint=endpoint,
            run_id="local-disks",
            # each node forks its worker, which then starts with torch imported (the
            # node itself is forked from a process that imported it:
            # distlab.infra.forked_torchrun)
            extra=["--start-method=fork", "--run-path"],
        )
        for out in outs.values()
    ]
    # 2 workers, 2 cores
    nodes = run_nodes(commands, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
    saved = {}
    for (name, out), node in zip(outs.items(), nodes):
        files = sorted(p for p in (out / "checkpoints").rglob("*") if p.is_file())
        saved[name] = {
            # lab 2 prints that line on rank 0 only
            "rank": 0 if "checkpoint: " in node.stdout else 1,
            "returncode": node.returncode,
            "stderr": node.stderr[-2000:],
            "files": [(str(f.relative_to(out)), f.stat().st_size) for f in files],
            "out": out,
        }
    return saved


# --- end local disks ---


def resume_figure(reference: list[float], resumed: list[float], ranks: int):
    """The uninterrupted run's losses as a thick line, the resumed run's as dots on top
    of it."""
    import matplotlib.pyplot as plt

    start = len(reference) - len(resumed)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(
        range(len(reference)),
        reference,
        lw=4,
        alpha=0.4,
        label=f"never stopped ({ranks} ranks)",
    )
    ax.plot(
        range(start, len(reference)),
        resumed,
        "o",
        ms=4,
        label=f"stopped after step {start}, resumed ({ranks} ranks)",
    )
    ax.axvline(start - 0.5, color="gray", ls=":", lw=1)
    ax.set(xlabel="step", ylabel="training loss")
    ax.legend()
    fig.tight_layout()
    return fig
