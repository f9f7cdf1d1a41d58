"""A gloo job that trains, finishes, and never exits: the order of the last two lines.

    observe(exit_demo, True, init_group=False)   # frees the DDP model first: exits
    observe(exit_demo, False, init_group=False)  # the order of PyTorch's DDP tutorial: hangs

``dist.destroy_process_group()`` forgets the group, but a DDP model still holds it (through
its C++ reducer), so the group is really destroyed later, when the model is freed. Freed
from there, torch 2.13 destroys a gloo group while holding Python's GIL; the destructor waits
for gloo's worker threads, and a worker that is releasing the last reference to a tensor made
in Python needs the GIL to do so. Each waits for the other: a deadlock. Destroyed from Python
(``destroy_process_group`` dropping the last reference), the GIL is released while it waits.
The labs therefore free the model before they destroy the group.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.chapters.debugging import note, stuck


def exit_demo(report: str, free_model_first: bool, peer_delay_s: float = 2.0) -> dict:
    """Rank 0 destroys its group while a gloo worker still owns a Python tensor.

    The all-reduce's tensor is a temporary: only the gloo worker thread holds it once the
    call has been made. Rank 1 joins the all-reduce ``peer_delay_s`` late, so rank 0 is
    certainly destroying its group while the worker still has the tensor. In a real run it is
    a race that a loaded machine loses now and then: before the labs freed their model first,
    8 of 133 short lab 2 launches (two at a time on 2 cores) were caught in it.
    Returns how long the teardown took and whether Python threads ran meanwhile.
    """
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    note(report, pid=os.getpid())  # so that the chapter can point py-spy at a hung rank
    model = DDP(nn.Linear(4, 4))  # its reducer holds a reference to the group
    if rank == 1:
        stuck(peer_delay_s)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    if rank == 1:
        work.wait()
        del model
        dist.destroy_process_group()
        return {}
    del work  # from here on only gloo's worker thread holds the tensor

    ticks = 0  # a Python thread that counts while the GIL is free
    done = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not done.wait(0.01):
            ticks += 1

    threading.Thread(target=count, daemon=True).start()

    start = time.perf_counter()
    # --- begin exit order ---
    if free_model_first:
        del model  # the reducer lets go; the group is still registered, so nothing is destroyed yet
        dist.destroy_process_group()  # the last reference, dropped from Python: GIL released
    else:
        dist.destroy_process_group()  # the tutorial order: the group lives on in the reducer ...
        del model  # ... and is destroyed here, GIL held: hangs
    # --- end exit order ---
    seconds = time.perf_counter() - start
    done.set()
    return {"teardown_s": seconds, "python_ticks_during_teardown": ticks}
