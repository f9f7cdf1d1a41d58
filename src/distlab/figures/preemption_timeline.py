"""A preemption on a time line, per rank, from a real run's events: each step, the
moment the signal reached a rank, the step after which every rank stopped, and the save.

    events = run_ranks(preemption_events, 2, args=(folder,))   # one dict per rank
    draw_preemption(events)
"""

from __future__ import annotations

import os
import signal
import time

STEP = ("#d6e4f0", "#aac7e0")  # steps alternate two blues
SAVE = "#27ae60"
SIGNAL = "#c0392b"


def preemption_events(folder: str, steps: int = 8, signal_step: int = 3) -> dict:
    """On every rank: the labs' DDP step on the tiny GPT with the labs' ``Preemption``.
    Rank 1 sends itself SIGTERM between the forward and the backward of step
    ``signal_step``; rank 0 is never signalled. Returns when each step, the signal,
    the save and the end happened (seconds since a shared start) and the step after
    which the rank stopped."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from distlab.checkpoint import Preemption
    from distlab.data import token_data
    from distlab.infra.experiment import gpt
    from distlab.parallel import apply_ddp
    from distlab.runtime import rank_world

    rank, world_size = rank_world()
    model = apply_ddp(gpt("tiny", seed=0), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, T = token_data(), model.module.config.block_size
    events = {"rank": rank, "steps": [], "signal": None}

    class Noted(Preemption):  # the labs' handler, with the moment it ran
        def _note(self, signum, frame):
            events["signal"] = time.perf_counter() - start
            super()._note(signum, frame)

    preemption = Noted()
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        began = time.perf_counter() - start
        x, y = data.batch("train", step, 8, T, 0, rank, world_size, "cpu")
        _, loss = model(x, y)
        if rank == 1 and step == signal_step:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, mid-step
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        events["steps"].append((began, time.perf_counter() - start))
        stop = preemption.requested()
        if stop:
            saved = time.perf_counter() - start
            dcp.save({"model": model.module.state_dict()}, checkpoint_id=folder)
            events["save"] = (saved, time.perf_counter() - start)
            events["stopped_after"] = step + 1
            break
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return events


def draw_preemption(events: list[dict]):
    """One lane per rank: its steps (alternating blues, numbered), the signal (a red
    mark on the rank it reached), the save (green). Times in ms from a shared start."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 1.2 * len(events) + 1.6))
    for lane, rank in enumerate(events):
        y = len(events) - 1 - lane
        for i, (began, ended) in enumerate(rank["steps"]):
            ms = 1000 * began, 1000 * (ended - began)
            ax.barh(y, ms[1], left=ms[0], height=0.5, color=STEP[i % 2])
            ax.text(ms[0] + ms[1] / 2, y, str(i), ha="center", va="center", fontsize=11)
        began, ended = rank["save"]
        ax.barh(y, 1000 * (ended - began), left=1000 * began, height=0.5, color=SAVE)
        if rank["signal"] is not None:
            ax.plot(1000 * rank["signal"], y + 0.42, "v", color=SIGNAL, markersize=13)
    ax.set_yticks(
        range(len(events)), [f"rank {r['rank']}" for r in reversed(events)], fontsize=13
    )
    ax.tick_params(axis="x", labelsize=12)
    ax.set_xlabel("ms (numbered boxes: steps; green: save)", fontsize=12)
    agreed = 1000 * max(rank["steps"][-1][1] for rank in events)
    ax.axvline(
        agreed, color="#555555", ls="--", lw=1.5, label="flags all-reduced: stop"
    )
    ax.plot([], [], "v", color=SIGNAL, markersize=11, label="SIGTERM arrives")
    ax.legend(fontsize=12, loc="upper left", frameon=False, bbox_to_anchor=(0, 1.35))
    ax.set_ylim(-0.6, len(events) - 0.1)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig
