"""A checkpoint whose train_state.json a power cut left empty or cut short: resume
falls back to the previous one. One process, no process group (as lab 1)."""

from __future__ import annotations

import pytest
import torch

from distlab.checkpoint import Checkpoints, inspect_checkpoint, latest
from distlab.checkpoint.checkpoints import CheckpointConfig as Config
from distlab.errors import UserError
from distlab.infra.experiment import gpt


@pytest.fixture
def two_saves(tmp_path):
    """Steps 2 and 4 saved, then step 4's train_state.json cut to 10 bytes."""
    model = gpt("tiny", seed=0)
    cfg = Config(out=str(tmp_path))
    saver = Checkpoints(cfg, model, torch.optim.AdamW(model.parameters()))
    older, newer = saver.save(2), saver.save(4)
    assert not list(newer.glob("*.tmp"))  # the temporary file was renamed
    state = newer / "train_state.json"
    state.write_bytes(state.read_bytes()[:10])
    return cfg, model, older, newer


def test_the_old_rule_picks_the_damaged_one(two_saves):
    # before: `latest` (is_file only) chose step 4 and the resume stopped on its JSON
    _, _, _, newer = two_saves
    assert latest(newer.parent) == newer
    with pytest.raises(UserError, match="unreadable"):
        inspect_checkpoint(newer)


def test_resume_falls_back_to_the_newest_readable(two_saves, capsys):
    cfg, model, older, newer = two_saves
    cfg.resume = "auto"
    step = Checkpoints(cfg, model, torch.optim.AdamW(model.parameters())).resume()
    assert step == 2
    out = capsys.readouterr().out
    assert f"skipping unreadable checkpoint {newer.name}" in out
    assert f"resumed from {older}" in out


def test_a_missing_index_is_skipped_too(two_saves):
    cfg, model, older, newer = two_saves
    (older / ".metadata").unlink()  # not finished; step 4 unreadable
    cfg.resume = "latest"
    saver = Checkpoints(cfg, model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(UserError, match="no readable checkpoint among the 1"):
        saver.resume()
