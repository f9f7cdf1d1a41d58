"""``Preemption``: SIGTERM (or SIGUSR1) asks a run to save a checkpoint at the end of
the step it is in and stop; the same command with ``--resume auto`` then goes on.

A cluster warns before it takes the machines back. SLURM sends a signal before the time
limit when the job asks for one (``#SBATCH --signal=TERM@120``), Kubernetes sends
SIGTERM and waits ``terminationGracePeriodSeconds`` (30 s by default), a cloud spot VM
gets SIGTERM at shutdown. ``torchrun`` passes a SIGTERM it receives on to every worker
and waits 30 s before SIGKILL (``PContext.close(death_sig, timeout=30)`` in torch 2.13).

In the labs (every lab has these lines):

    preemption = Preemption()               # before the loop, on every rank
    for step in range(start_step, cfg.steps):
        ...                                 # one optimizer step
        stop = preemption.requested()       # every rank: did any rank get a signal?
        checkpoints.maybe_save(step, now=stop)
        if stop:
            break

The handler only notes the signal. Saving is a collective: every rank must enter it
together, at the same step, and the signal may reach one rank in the middle of a step
and another one not at all. So at the end of each step the ranks take the maximum of
their flags, one all-reduce of one number on a gloo (CPU) group: no GPU is synchronised.
A rank that the signal finds blocked inside a collective (a dead peer) runs no Python
until the collective returns; the launcher's SIGKILL ends it. A second signal ends the
process at once, as if no handler were installed.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# --- begin preemption ---
class Preemption:
    """Notes SIGTERM and SIGUSR1; ``requested()`` tells every rank whether any
    rank got one."""

    def __init__(self, signals=SIGNALS):
        self.signal: int | None = None  # the first signal received, if any
        self.stopped = False  # requested() said yes
        # gloo's all-reduce takes a CPU tensor: under NCCL, a gloo group of its own
        self._group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")
        for sig in signals:
            signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        if self.signal is not None:  # asked twice: stop now, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal = signum
        # os.write, not print: the handler may interrupt a print in progress
        name = signal.Signals(signum).name
        os.write(
            2, f"{name}: a checkpoint at the end of this step, then stop\n".encode()
        )

    def requested(self) -> bool:
        """At the end of every step, on every rank: True on every rank as soon as
        one rank has received a signal."""
        flag = torch.tensor([0 if self.signal is None else 1])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self.stopped = bool(flag.item())
        return self.stopped


# --- end preemption ---
