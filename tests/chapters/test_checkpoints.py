"""What book/checkpoints.md does not run: each rank's RNG state coming back, the
converter's command line and lab 1 evaluating what it wrote, a bad checkpoint stopping
every rank of a run, damage found before a tensor is loaded, --init-from's refusals,
--steps 0, `latest` skipping unfinished folders, and a folder per rank. The page asserts
the rest of its lab 4 run: the folders and what DCP wrote where, resuming on 2, 1 and 4
ranks, the conversion to model.pt, a truncated shard and another preset refused."""

import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distlab.bench.lab_scripts import load_lab
from distlab.checkpoint import (
    TrainingState,
    inspect_checkpoint,
    latest,
    load_plain_weights,
)
from distlab.checkpoint.__main__ import main as convert
from distlab.errors import UserError
from distlab.infra.experiment import gpt
from distlab.infra.launch import run_ranks, run_script
from distlab.infra.paths import LABS_DIR
from distlab.metrics import read_metrics, read_summary
from distlab.model import GPT, preset
from distlab.parallel import apply_fsdp
from support.labs import each_rank

ARGS = [
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--batch-size",
    "16",
    "--micro-batch-size",
    "4",
    "--eval-batches",
    "2",
    "--sample-chars",
    "0",
    "--no-progress",
]


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    """2 steps on 2 ranks, saving after the last (the page runs 20, and checks them)."""
    out = tmp_path_factory.mktemp("lab4_checkpointed")
    run_script(
        LABS_DIR / "lab4_fsdp2.py",
        [*ARGS, "--checkpoint-every", "2", "--out", out],
        nprocs=2,
        quiet=True,
    )
    return out


def _rng_round_trip(out: str) -> tuple[int, list[float], list[float]]:
    """On each rank: save, draw, scramble the RNG, resume, draw again."""
    from distlab.checkpoint import Checkpoints
    from distlab.checkpoint.checkpoints import CheckpointConfig as Config
    from distlab.parallel import apply_fsdp

    rank = torch.distributed.get_rank()
    model = apply_fsdp(gpt("tiny", seed=0))
    optimizer = torch.optim.AdamW(model.parameters())
    cfg = Config(out=out)
    torch.manual_seed(100 + rank)  # each rank its own stream
    folder = Checkpoints(cfg, model, optimizer).save(3)
    expected = torch.rand(4).tolist()
    torch.manual_seed(0)
    cfg.resume = str(folder)
    step = Checkpoints(cfg, model, optimizer).resume()
    return step, expected, torch.rand(4).tolist()


def test_each_rank_gets_its_own_rng_state_back(tmp_path):
    results = run_ranks(
        _rng_round_trip, nprocs=2, args=(str(tmp_path),), timeout=120, quiet=True
    )
    for step, expected, drawn in results:
        assert step == 3 and drawn == expected
    # the ranks' streams differ, and each got its own
    assert results[0][1] != results[1][1]


def test_the_command_line_converts_a_checkpoint_that_lab_1_evaluates(
    never_stopped, tmp_path, capsys
):
    """The page converts with to_plain and compares with lab 4's model.pt; here the
    command line the page shows, and lab 1 evaluating and sampling from its file without
    a step."""
    plain = tmp_path / "plain.pt"
    convert(
        ["to-plain", str(never_stopped / "checkpoints" / "step_000002"), str(plain)]
    )
    # the tied head counted twice
    assert f"wrote {plain}: 29 tensors" in capsys.readouterr().out
    converted = torch.load(plain, weights_only=True)
    # lab 4's own, at the end
    saved = torch.load(never_stopped / "model.pt", weights_only=True)
    assert converted.keys() == saved.keys()
    assert all(torch.equal(converted[k], saved[k]) for k in saved)
    # lab 1 evaluates and samples from it without a training step
    out = tmp_path / "lab1"
    lab1 = [
        "--init-from",
        plain,
        "--steps",
        "0",
        "--eval-batches",
        "2",
        "--sample-chars",
        "40",
        "--no-progress",
    ]
    run_script(LABS_DIR / "lab1_single.py", [*lab1, "--out", out], nprocs=1, quiet=True)
    assert read_metrics(out) == []
    summary = read_summary(out)
    assert summary["final_val_loss"] == pytest.approx(
        read_summary(never_stopped)["final_val_loss"], rel=1e-5
    )
    assert len(summary["sample"]) == 41  # the prompt's newline + 40 characters


def test_a_bad_checkpoint_stops_every_rank_before_training(never_stopped, tmp_path):
    """A truncated shard of rank 1's: rank 0 finds it and tells every rank, and each
    stops with the same one line. Each rank's own output, read after all exited (under
    torchrun the first rank to fail gets the others stopped, maybe before they print: a
    race). The page refuses another preset on one rank."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(never_stopped / "checkpoints" / "step_000002", checkpoint)
    shard = checkpoint / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    ranks = each_rank(
        "lab4_fsdp2.py", 2, *ARGS, "--resume", checkpoint, "--out", tmp_path / "out"
    )
    for rank, run in enumerate(ranks):
        assert run.returncode == 1, (rank, run.stderr[-2000:])
        error = run.stderr.strip()
        assert error.startswith("lab4_fsdp2.py: error: ") and "\n" not in error, (
            rank,
            run.stderr[-2000:],
        )
        assert "__1_0.distcp is truncated: " in error, (rank, error)
        # refused before training began: nothing printed ...
        assert "config:" not in run.stdout
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # ... or logged yet


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda ckpt: shutil.rmtree(ckpt), "(no such folder)"),
        # a save killed midway
        (lambda ckpt: (ckpt / ".metadata").unlink(), ".metadata is missing: "),
        (
            lambda ckpt: os.truncate(ckpt / ".metadata", 100),
            ".metadata is unreadable (UnpicklingError",
        ),
        (lambda ckpt: (ckpt / "__0_0.distcp").unlink(), "__0_0.distcp is missing: "),
    ],
)
def test_damage_is_found_before_a_tensor_is_loaded(
    never_stopped, damage, message, tmp_path
):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(never_stopped / "checkpoints" / "step_000002", checkpoint)
    damage(checkpoint)
    with pytest.raises(UserError, match=re.escape(message)) as refused:
        inspect_checkpoint(checkpoint)
    assert str(checkpoint) in str(refused.value)  # the message names the file


class _RunsCode:
    def __reduce__(self):  # what a malicious pickle does: call anything at load time
        return (print, ("this ran inside torch.load",))


def test_init_from_loads_tensors_only_and_names_the_mismatch(tmp_path):
    model = gpt("tiny", seed=0)
    evil, small, fine = (
        tmp_path / "evil.pt",
        tmp_path / "vocab70.pt",
        tmp_path / "fine.pt",
    )
    torch.save({"wte.weight": _RunsCode()}, evil)
    torch.save(GPT(preset("tiny", vocab_size=70)).state_dict(), small)
    torch.save(gpt("tiny", seed=7).state_dict(), fine)
    with pytest.raises(
        UserError, match=r"evil.pt is not a weights file \(UnpicklingError"
    ):
        load_plain_weights(model, evil)
    with pytest.raises(
        UserError,
        match=r"wte.weight is \[70, 64\] in the file, \[65, 64\] in the model",
    ):
        load_plain_weights(model, small)
    with pytest.raises(UserError, match="no such file"):
        load_plain_weights(model, tmp_path / "nothing.pt")
    with pytest.raises(UserError, match="is a folder; a sharded checkpoint"):
        load_plain_weights(model, tmp_path)
    load_plain_weights(model, fine)
    assert torch.equal(model.wte.weight, gpt("tiny", seed=7).wte.weight)
    # torch's own default refuses it too (torch >= 2.6)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(evil)


@pytest.mark.parametrize(
    "lab", ["lab1_single", "lab2_ddp", "lab3_grad_accum", "lab4_fsdp2"]
)
def test_every_lab_takes_zero_steps_but_not_fewer(lab):
    module = load_lab(lab)
    assert module.TrainConfig(steps=0).steps == 0
    with pytest.raises(UserError, match="--steps must be 0 or more, got -1"):
        module.TrainConfig(steps=-1)
    assert module.TrainConfig().init_from == ""


def test_latest_skips_unfinished_folders(tmp_path):
    for name, files in [
        ("step_000005", [".metadata", "train_state.json"]),
        ("step_000009", ["train_state.json"]),  # DCP never wrote its .metadata
        ("step_000010.partial", [".metadata", "train_state.json"]),
    ]:
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("")
    assert latest(tmp_path) == tmp_path / "step_000005"
    assert latest(tmp_path / "nothing_here") is None


def _save_into_a_folder_per_rank(root: str) -> list[str]:
    """Lab 4's state saved by DCP with a folder per rank (as local disks would be): what
    each rank wrote."""
    model, rank = apply_fsdp(gpt("tiny", seed=0)), torch.distributed.get_rank()
    folder = Path(root) / f"rank{rank}"
    dcp.save(
        {"app": TrainingState(model, torch.optim.AdamW(model.parameters()), rank)},
        checkpoint_id=folder,
    )
    return sorted(p.name for p in folder.iterdir())


def test_every_rank_writes_its_own_shard_file_and_rank_0_also_the_index(tmp_path):
    files = run_ranks(
        _save_into_a_folder_per_rank, nprocs=2, args=(str(tmp_path),), quiet=True
    )
    # rank 0 writes a shard too
    assert files == [[".metadata", "__0_0.distcp"], ["__1_0.distcp"]]
