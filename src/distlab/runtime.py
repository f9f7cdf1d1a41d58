"""Device, backend and dtype choices: the one place that knows about CPU vs GPU.

Labs never name ``cpu``, ``cuda``, ``gloo`` or ``nccl`` themselves; they ask here, so the
same script runs on a laptop's CPU ranks and on a GPU node unchanged.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from distlab.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` means this rank's GPU when there is one, else the CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for, but no CUDA GPU is visible")
        # one process per GPU: LOCAL_RANK picks this process's card
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if requested == "cpu":
        return torch.device("cpu")
    raise UserError(f"unknown device {requested!r}; choose auto, cpu or cuda")


def backend_for(device: torch.device) -> str:
    """NCCL moves GPU tensors between GPUs; gloo moves CPU tensors over TCP."""
    return "nccl" if device.type == "cuda" else "gloo"


def autocast(device: torch.device, dtype: str):
    """bf16 autocast for the forward pass, or nothing for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def dist_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) without torchrun."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


def rank_world() -> tuple[int, int]:
    """(rank, world_size) of this process: the process group's when one is initialized, else
    torchrun's environment, else (0, 1). The one answer to "which rank am I" outside the labs
    (which lock their names in lab 1 and read ``dist_env``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, _, world_size = dist_env()
    return rank, world_size


def init_distributed(device: torch.device, timeout_s: float = 120.0) -> None:
    """Join the process group that torchrun (or our launcher) described in the environment.

    The timeout turns a rank that never arrives, or that skips a collective, into an
    error after ``timeout_s`` seconds instead of a hang.
    """
    options = {}
    if "RANK" not in os.environ:  # started without torchrun: a group of one, no network
        options = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, _, world_size = dist_env()
        options = {"store": _store_of_this_attempt(world_size, timeout_s), "rank": rank, "world_size": world_size}
    dist.init_process_group(
        backend_for(device),
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        **options,
    )


def _store_of_this_attempt(world_size: int, timeout_s: float) -> dist.Store:
    """torchrun's key-value store, seen through a prefix that names this restart attempt.

    torchrun (torch 2.13) keeps one store for the whole job, and after ``--max-restarts``
    restarts a group, the keys the dead attempt wrote are still in it, among them the
    addresses gloo's ranks listen on. A new rank can read a dead rank's address and fail
    with "Connection refused" (measured: 3 restarts out of 3 failed so; see the fault
    tolerance chapter). Keys under a prefix per attempt cannot be stale.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
