"""Find the slow rank: each rank times its own work, and every ``every`` steps the times
are all-gathered and compared with the median.

Time only the rank's own work (forward, backward, data), not the whole step: the
gradient all-reduce waits for the slowest rank, so after it every rank's step takes as
long as the straggler's and whole-step times name nobody.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


# --- begin detector ---
class StragglerDetector:
    """``record(seconds)`` after each step's own work; ``check()`` is a collective
    (every rank calls it on the same steps) and returns every rank's mean time since the
    last check."""

    def __init__(
        self, every: int, threshold: float = 1.5, device: torch.device | str = "cpu"
    ):
        if every < 1 or threshold <= 1:
            raise ValueError(
                f"need every >= 1 and threshold > 1, got every={every}, "
                f"threshold={threshold}"
            )
        self.every, self.threshold, self.times = every, threshold, []
        # NCCL all-gathers GPU tensors only: pass the rank's GPU there
        self.device = device

    def record(self, seconds: float) -> None:
        self.times.append(seconds)

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def check(self) -> dict:
        mine = torch.tensor(
            [sum(self.times) / max(len(self.times), 1)],
            dtype=torch.float64,
            device=self.device,
        )
        self.times = []
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        # one float per rank: cheap enough for every k steps
        dist.all_gather(gathered, mine)
        per_rank = [t.item() for t in gathered]
        median = statistics.median(per_rank)
        return {
            "per_rank_s": per_rank,
            "max_over_median": max(per_rank) / median,
            "slow_ranks": [
                r for r, s in enumerate(per_rank) if s > self.threshold * median
            ],
        }


# --- end detector ---
