"""Run a lab script with a check in ``torch.distributed.destroy_process_group``: when it
is called, no DistributedDataParallel model may be alive any more.

    python tests/support/freed_before_destroy.py src/labs/lab2_ddp.py --preset tiny ...

A DDP model that outlives the group destroys it later, from its reducer, with the GIL
held: gloo can deadlock there (the debugging chapter, "exit order"). The check finds
every live DDP module with the garbage collector and names what still refers to it.
"""

import gc
import runpy
import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

destroy = dist.destroy_process_group


def checked_destroy(*args, **kwargs):
    gc.collect()
    alive = [
        obj for obj in gc.get_objects() if isinstance(obj, DistributedDataParallel)
    ]
    if alive:
        holders = {
            type(ref).__name__ for ref in gc.get_referrers(alive[0]) if ref is not alive
        }
        raise RuntimeError(
            f"a DDP model is still alive when the process group is destroyed "
            f"(referred to by: {', '.join(sorted(holders))})"
        )
    return destroy(*args, **kwargs)


if __name__ == "__main__":
    dist.destroy_process_group = checked_destroy
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
