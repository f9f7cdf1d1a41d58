r"""Start the ranks yourself with torch.multiprocessing.spawn: the way before torchrun.

Launch:
    # 2 CPU ranks over gloo
    python src/examples/spawn_example.py --nprocs 2 --steps 5 --device cpu
    # on a machine with 8 GPUs: 8 processes, one per GPU, over NCCL (--device cuda: an
    # error, not a silent CPU run, if this torch cannot use the GPUs)
    python src/examples/spawn_example.py --nprocs 8 --device cuda
    # the same train() under torchrun, which starts the processes and sets RANK etc.
    torchrun --standalone --nproc-per-node=2 src/examples/spawn_example.py --device cpu
    # several machines: only torchrun (run on every node; HOST is node 0's address)
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29500 src/examples/spawn_example.py --device cuda
    # --device auto (the default) takes a GPU per rank when torch can use one, else
    # the CPU

mp.spawn starts ``nprocs`` fresh Python processes on this machine and calls
``train(rank, *args)`` in each. It does nothing else: the port, the process group, the
threads per process and the clean-up are this script's job.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.data import TokenData, load_corpus
from distlab.model import GPT, preset
from distlab.runtime import backend_for, pick_device

GLOBAL_BATCH = 16  # sequences per step, all ranks together
SEED = 1337


def free_port() -> int:
    """A port the OS says is free now. Another process could take it before rank 0 binds
    it; torchrun --standalone has no such race (its store binds port 0 itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- begin setup ---
def setup(
    rank: int, world_size: int, port: int | None, device: str = "auto"
) -> torch.device:
    # spawn: one machine, so local rank == rank; torchrun says it in LOCAL_RANK
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = pick_device(device, local_rank)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # torchrun sets OMP_NUM_THREADS=1; spawn does not, and N ranks each using every
        # core fight over them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        backend_for(device),
        # spawn: rank 0 hosts the store on our port; torchrun: its env vars say where
        init_method=f"tcp://127.0.0.1:{port}" if port else "env://",
        rank=rank,
        world_size=world_size,
        # a missing rank or collective errors, never hangs
        timeout=timedelta(seconds=60),
    )
    return device


# --- end setup ---


def cleanup() -> None:
    dist.destroy_process_group()


def report(folder: str | None, rank: int, env: dict, losses: list[float]) -> None:
    """With ``--report DIR``: what this rank got from its launcher (its process ids,
    the environment it started with, its threads) and its losses, one file per rank.
    The book draws its launch figure from these files."""
    if folder:
        info = {"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "env": env}
        info |= {"threads": torch.get_num_threads(), "losses": losses}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(info))


def train(
    rank: int,
    world_size: int,
    port: int | None,
    steps: int = 5,
    device_request: str = "auto",
    report_dir: str | None = None,
) -> None:
    env = dict(os.environ)  # as the launcher left it (torch adds to it later)
    device = setup(rank, world_size, port, device_request)
    try:
        data = TokenData(load_corpus())
        cfg = preset("tiny", vocab_size=data.tokenizer.vocab_size)
        model = DDP(
            GPT(cfg, seed=SEED).to(device),  # wrap after moving to the device
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            # rows [rank*B/N, (rank+1)*B/N) of the global batch of this step
            x, y = data.batch(
                "train",
                step,
                GLOBAL_BATCH,
                cfg.block_size,
                SEED,
                rank,
                world_size,
                device,
            )
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            losses.append(loss.item())
        # one write per line (end included), so the ranks' lines never interleave
        print(
            f"rank {rank}/{world_size} ({dist.get_backend()}, {device}): "
            f"{steps} steps on "
            f"{x.shape[0]} of {GLOBAL_BATCH} rows each, "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}\n",
            end="",
            flush=True,
        )
        report(report_dir, rank, env, losses)
    finally:
        # free DDP before its group: destroyed from DDP's side, gloo can hang
        # (debugging chapter)
        model = None
        cleanup()


# --- begin main ---
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_nprocs = torch.cuda.device_count() or 2
    parser.add_argument(
        "--nprocs", type=int, default=default_nprocs, help="ranks to start"
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument(
        "--device", default="auto", help="auto (a GPU per rank if any), cpu or cuda"
    )
    parser.add_argument("--report", help="a folder: each rank writes what it got there")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # torchrun started this process and set the env vars
        train(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            None,
            args.steps,
            args.device,
            args.report,
        )
        return
    port = free_port()
    # train must be importable by name: spawn pickles a reference to it, not its code
    mp.spawn(
        train,
        args=(args.nprocs, port, args.steps, args.device, args.report),
        nprocs=args.nprocs,
        join=True,
    )


# --- end main ---


if __name__ == "__main__":
    main()
