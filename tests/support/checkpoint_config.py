"""The fields ``distlab.checkpoint.Checkpoints`` reads from a lab's config, for tests
that save and resume without running a lab."""

from dataclasses import dataclass


@dataclass
class Config:
    out: str
    preset: str = "tiny"
    batch_size: int = 16
    seed: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    steps: int = 10
    weight_decay: float = 0.1
    data: str = ""
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: str = ""
    init_from: str = ""
