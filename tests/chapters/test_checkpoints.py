"""Lab 4's sharded checkpoints: resuming gives the losses of never stopping, on the same number
of ranks and on others; a checkpoint converts to the plain file lab 1 loads; bad checkpoints
stop every rank with one line before anything is loaded."""

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from distlab.bench.labs import load_lab
from distlab.checkpoint import TrainingState, inspect_checkpoint, latest, load_plain_weights
from distlab.errors import UserError
from distlab.infra.experiment import gpt
from distlab.infra.launch import run_ranks
from distlab.metrics import read_metrics, read_summary
from distlab.model import GPT, preset
from distlab.parallel import apply_fsdp
from support.labs import run_lab
from support.labs import torchrun as torchrun_lab

ARGS = [
    "--preset",
    "tiny",
    "--steps",
    "10",
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


def torchrun(nprocs: int, *args, timeout: float = 180) -> subprocess.CompletedProcess:
    """Lab 4 under `torchrun --standalone` (port 0: the OS picks a free one)."""
    return torchrun_lab("lab4_fsdp2.py", nprocs, *args, timeout=timeout)


def losses(out) -> list[float]:
    return [m["loss"] for m in read_metrics(out)]


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    """10 steps on 2 ranks without a break, saving after steps 5 and 10."""
    out = tmp_path_factory.mktemp("lab4_checkpointed")
    proc = torchrun(2, *ARGS, "--checkpoint-every", "5", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_checkpoints_are_finished_folders_with_their_step(never_stopped):
    folder = never_stopped / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_000005", "step_000010"]  # no .partial
    step5 = folder / "step_000005"
    assert {p.name for p in step5.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.json"}
    state = json.loads((step5 / "train_state.json").read_text())
    assert (state["step"], state["world_size"], state["data"]["next_step"]) == (5, 2, 5)
    assert state["lr_schedule"]["last_lr"] == read_metrics(never_stopped)[4]["lr"]  # step 4's LR
    keys = FileSystemReader(step5).read_metadata().state_dict_metadata
    assert {"app.rng.rank0.cpu", "app.rng.rank1.cpu", "app.optim.state.wte.weight.exp_avg"} <= keys.keys()
    assert len(keys["app.model.wte.weight"].chunks) == 2  # one piece per rank: nothing gathered
    assert latest(folder) == folder / "step_000010"


@pytest.mark.parametrize("nprocs,rel", [(2, 1e-6), (1, 1e-5), (4, 1e-5)])
def test_resuming_gives_the_losses_of_never_stopping(never_stopped, nprocs, rel, tmp_path):
    """The global batch is fixed, so 1 or 4 ranks do the same math as 2 (summed in another order)."""
    out = tmp_path / "out"
    resume = ["--resume", never_stopped / "checkpoints" / "step_000005", "--out", out]
    if nprocs == 1:  # and `--resume latest` in the interrupted run's own folder, which keeps its log
        shutil.copytree(never_stopped / "checkpoints" / "step_000005", out / "checkpoints" / "step_000005")
        shutil.copy(never_stopped / "metrics.jsonl", out)
        resume = ["--resume", "latest", "--out", out]
    proc = run_lab("lab4_fsdp2.py", *ARGS, *resume) if nprocs == 1 else torchrun(nprocs, *ARGS, *resume)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at step 5 (saved by 2 ranks, now {nprocs})" in proc.stdout
    assert ("RNG reseeded" in proc.stdout) == (nprocs != 2)  # RNG states come back to the same ranks only
    assert [m["step"] for m in read_metrics(out)] == list(range(5, 10))
    assert losses(out) == pytest.approx(losses(never_stopped)[5:], rel=rel)
    assert read_summary(out)["final_val_loss"] == pytest.approx(read_summary(never_stopped)["final_val_loss"], rel=rel)
    if nprocs == 1:
        kept = out / "metrics.before_step_000005.jsonl"
        assert kept.read_text() == (never_stopped / "metrics.jsonl").read_text()


def _rng_round_trip(out: str) -> tuple[int, list[float], list[float]]:
    """On each rank: save, draw, scramble the RNG, resume, draw again."""
    from distlab.checkpoint import Checkpoints
    from distlab.parallel import apply_fsdp

    @dataclass
    class Config:  # the fields Checkpoints reads
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
    results = run_ranks(_rng_round_trip, nprocs=2, args=(str(tmp_path),), timeout=120, quiet=True)
    for step, expected, drawn in results:
        assert step == 3 and drawn == expected
    assert results[0][1] != results[1][1]  # the ranks' streams differ, and each got its own


def test_a_checkpoint_converts_to_the_weights_lab_1_loads(never_stopped, tmp_path):
    plain = tmp_path / "plain.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distlab.checkpoint",
            "to-plain",
            str(never_stopped / "checkpoints" / "step_000010"),
            str(plain),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    converted = torch.load(plain, weights_only=True)
    saved = torch.load(never_stopped / "model.pt", weights_only=True)  # lab 4's own, at the end
    assert converted.keys() == saved.keys()
    assert all(torch.equal(converted[k], saved[k]) for k in saved)
    gpt("tiny", seed=0).load_state_dict(converted)
    # lab 1 evaluates and samples from it without a training step
    out = tmp_path / "lab1"
    proc = run_lab(
        "lab1_single.py",
        "--init-from",
        plain,
        "--steps",
        "0",
        "--eval-batches",
        "2",
        "--sample-chars",
        "40",
        "--no-progress",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    assert read_metrics(out) == []
    summary = read_summary(out)
    assert summary["final_val_loss"] == pytest.approx(read_summary(never_stopped)["final_val_loss"], rel=1e-5)
    assert len(summary["sample"]) == 41  # the prompt's newline + 40 characters


@pytest.mark.parametrize(
    "kind,nprocs,message",
    [
        ("truncated shard", 2, "__1_0.distcp is truncated: "),
        ("other preset", 1, "--preset is 'tiny' there, 'shakespeare' here"),
    ],
)
def test_a_bad_checkpoint_stops_every_rank_before_training(never_stopped, kind, nprocs, message, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(never_stopped / "checkpoints" / "step_000005", checkpoint)
    if kind == "truncated shard":
        shard = checkpoint / "__1_0.distcp"
        os.truncate(shard, shard.stat().st_size // 2)
    args = [*ARGS, "--resume", checkpoint, "--out", tmp_path / "out"]
    if kind == "other preset":
        args += ["--preset", "shakespeare"]
    run = run_lab("lab4_fsdp2.py", *args) if nprocs == 1 else torchrun(nprocs, *args, timeout=120)
    assert run.returncode != 0
    # ranks share one stderr and their lines may interleave: count, don't split
    assert run.stderr.count("lab4_fsdp2.py: error: ") == nprocs, run.stderr[-2000:]
    assert run.stderr.count(message) == nprocs, run.stderr[-2000:]
    # refused before training began: nothing printed or logged yet
    assert "config:" not in run.stdout and not (tmp_path / "out" / "metrics.jsonl").exists()
    if nprocs == 1:
        assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda ckpt: shutil.rmtree(ckpt), "(no such folder)"),
        (lambda ckpt: (ckpt / ".metadata").unlink(), ".metadata is missing: "),  # a save killed midway
        (lambda ckpt: os.truncate(ckpt / ".metadata", 100), ".metadata is unreadable (UnpicklingError"),
        (lambda ckpt: (ckpt / "__0_0.distcp").unlink(), "__0_0.distcp is missing: "),
    ],
)
def test_damage_is_found_before_a_tensor_is_loaded(never_stopped, damage, message, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(never_stopped / "checkpoints" / "step_000005", checkpoint)
    damage(checkpoint)
    with pytest.raises(UserError, match=re.escape(message)) as refused:
        inspect_checkpoint(checkpoint)
    assert str(checkpoint) in str(refused.value)  # the message names the file


class _RunsCode:
    def __reduce__(self):  # what a malicious pickle does: call anything at load time
        return (print, ("this ran inside torch.load",))


def test_init_from_loads_tensors_only_and_names_the_mismatch(tmp_path):
    model = gpt("tiny", seed=0)
    evil, small, fine = tmp_path / "evil.pt", tmp_path / "vocab70.pt", tmp_path / "fine.pt"
    torch.save({"wte.weight": _RunsCode()}, evil)
    torch.save(GPT(preset("tiny", vocab_size=70)).state_dict(), small)
    torch.save(gpt("tiny", seed=7).state_dict(), fine)
    with pytest.raises(UserError, match=r"evil.pt is not a weights file \(UnpicklingError"):
        load_plain_weights(model, evil)
    with pytest.raises(UserError, match=r"wte.weight is \[70, 64\] in the file, \[65, 64\] in the model"):
        load_plain_weights(model, small)
    with pytest.raises(UserError, match="no such file"):
        load_plain_weights(model, tmp_path / "nothing.pt")
    with pytest.raises(UserError, match="is a folder; a sharded checkpoint"):
        load_plain_weights(model, tmp_path)
    load_plain_weights(model, fine)
    assert torch.equal(model.wte.weight, gpt("tiny", seed=7).wte.weight)
    with pytest.raises(pickle.UnpicklingError):  # torch's own default refuses it too (torch >= 2.6)
        torch.load(evil)


@pytest.mark.parametrize("lab", ["lab1_single", "lab2_ddp", "lab3_grad_accum", "lab4_fsdp2"])
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


def test_the_chapter_reads_what_dcp_wrote_and_where(never_stopped):
    from distlab.chapters.checkpoints import checkpoint_groups, piece_table

    step5, model = never_stopped / "checkpoints" / "step_000005", gpt("tiny")
    pieces = piece_table(step5, "app.model.wte.weight")  # 65 rows in dim-0 chunks of ceil(65/2)
    assert [(p["rows"], p["file"]) for p in pieces] == [("0-32", "__0_0.distcp"), ("33-64", "__1_0.distcp")]
    groups, state, params = checkpoint_groups(step5), model.state_dict(), list(model.parameters())
    assert groups["model"] == (len(state), sum(4 * t.numel() for t in state.values()))  # the tied head too
    assert groups["optim.state"] == (3 * len(params), 8 * sum(p.numel() for p in params) + 4 * len(params))


def _save_into_a_folder_per_rank(root: str) -> list[str]:
    """Lab 4's state saved by DCP with a folder per rank (as local disks would be): what each rank wrote."""
    model, rank = apply_fsdp(gpt("tiny", seed=0)), torch.distributed.get_rank()
    folder = Path(root) / f"rank{rank}"
    dcp.save({"app": TrainingState(model, torch.optim.AdamW(model.parameters()), rank)}, checkpoint_id=folder)
    return sorted(p.name for p in folder.iterdir())


def test_every_rank_writes_its_own_shard_file_and_rank_0_also_the_index(tmp_path):
    files = run_ranks(_save_into_a_folder_per_rank, nprocs=2, args=(str(tmp_path),), quiet=True)
    assert files == [[".metadata", "__0_0.distcp"], ["__1_0.distcp"]]  # rank 0 writes a shard too
