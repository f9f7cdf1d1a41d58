"""Is a restarted torchrun attempt given a clean key-value store? This counts the keys.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 \\
        src/examples/store_probe.py

Attempt 0 joins a gloo group the default way (which writes each rank's address into the
store torchrun gives the job), counts the store's keys, and then rank 1 dies. torchrun
restarts both ranks: attempt 1 counts the keys before anything else. If the dead
attempt's keys are still there, a new rank can read a dead rank's address.
"""

import os
from datetime import timedelta

import torch.distributed as dist

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
store = dist.TCPStore(
    os.environ["MASTER_ADDR"],
    int(os.environ["MASTER_PORT"]),
    is_master=False,
    timeout=timedelta(seconds=30),
)
if attempt == 0:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    dist.barrier()  # every rank has written its address
    print(
        f"attempt 0, rank {rank}: {store.num_keys()} keys in the store after joining",
        flush=True,
    )
    dist.barrier()
    if rank == 1:
        os._exit(1)  # die: torchrun stops rank 0 and restarts the group
    dist.barrier()  # rank 0 waits here until torchrun stops it
else:
    print(
        f"attempt {attempt}, rank {rank}: {store.num_keys()} keys in the store "
        "before joining",
        flush=True,
    )
