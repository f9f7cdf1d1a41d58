"""The fields ``distlab.checkpoint.Checkpoints`` reads from a lab's config, for tests
that save and resume without running a lab."""

from distlab.checkpoint.checkpoints import CheckpointConfig as Config

__all__ = ["Config"]
