"""Exact resume for labs 2-4, saves that survive a kill, and torchrun restarting a group
that lost a rank. Every comparison is with a run that was never interrupted (fp32, CPU)."""

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from distlab.chapters.fault_tolerance import kill_when_stalled, torchrun_killing_a_rank
from distlab.checkpoint import inspect_checkpoint, latest, prune, resume_point
from distlab.errors import UserError
from distlab.exercises import check_kill_during_shard_writes
from distlab.infra.launch import RankFailed, run_script
from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_metrics, read_summary
from support.exercises import passes

FAST = [
    "--preset",
    "tiny",
    "--batch-size",
    "16",
    "--eval-every",
    "1000",
    "--eval-batches",
    "2",
    "--sample-chars",
    "0",
    "--no-progress",
]
LABS = {
    "lab2_ddp.py": [],
    "lab3_grad_accum.py": ["--micro-batch-size", "4"],
    "lab4_fsdp2.py": ["--micro-batch-size", "4"],
}


def lab(name: str) -> str:
    return str(REPO_ROOT / "src" / "labs" / name)


def losses(out) -> list[float]:
    return [m["loss"] for m in read_metrics(out)]


@pytest.mark.parametrize("name", LABS)
def test_resuming_reproduces_the_run_bit_for_bit(name, tmp_path):
    """6 steps straight (saving after 3 and 6) vs a new process that resumes at step 3."""
    args = [*FAST, *LABS[name], "--steps", "6", "--checkpoint-every", "3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_script(lab(name), [*args, "--out", straight], nprocs=2, timeout=120, quiet=True)
    step3 = straight / "checkpoints" / "step_000003"
    run_script(lab(name), [*args, "--resume", step3, "--out", resumed], nprocs=2, timeout=120, quiet=True)

    assert [m["step"] for m in read_metrics(resumed)] == [3, 4, 5]
    assert losses(resumed) == losses(straight)[3:]  # exactly: same bits, not a tolerance
    assert read_summary(resumed)["final_val_loss"] == read_summary(straight)["final_val_loss"]

    state = json.loads((step3 / "train_state.json").read_text())  # the global part, in words
    assert (state["step"], state["world_size"], state["data"]["next_step"]) == (3, 2, 3)
    keys = FileSystemReader(step3).read_metadata().state_dict_metadata
    assert {"app.rng.rank0.cpu", "app.rng.rank1.cpu"} <= keys.keys()  # per rank
    assert "app.model.wte.weight" in keys and "app.optim.state.wte.weight.exp_avg" in keys
    assert not any(".module." in k for k in keys)  # DDP's wrapper prefix is not in the checkpoint


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    out = tmp_path / "out"
    run_script(
        lab("lab2_ddp.py"),
        [*FAST, "--steps", "5", "--checkpoint-every", "1", "--keep-checkpoints", "2", "--out", out],
        nprocs=2,
        timeout=120,
        quiet=True,
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000004", "step_000005"]


def test_prune_and_resume_point_rules(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / "done").write_text("")
    (tmp_path / "step_000004.partial").mkdir()  # unfinished: never counted, never pruned here
    assert resume_point("auto", tmp_path, holds=("done",)) == tmp_path / "step_000003"
    assert prune(tmp_path, 0, holds=("done",)) == []
    assert [p.name for p in prune(tmp_path, 1, holds=("done",))] == ["step_000001", "step_000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004.partial"]
    empty = tmp_path / "empty"
    assert resume_point("auto", empty) is None and resume_point("", empty) is None
    with pytest.raises(UserError, match="--resume auto starts from step 0"):
        resume_point("latest", empty)


def run_until_killed(args: list, marker: Path, timeout: float = 120) -> RankFailed:
    """Run the stalled lab on 2 ranks; SIGKILL rank 0 once it waits inside the save."""
    killer = kill_when_stalled(marker, timeout)
    with pytest.raises(RankFailed) as failed:
        run_script(
            REPO_ROOT / "src" / "examples" / "stall_save.py",
            args,
            nprocs=2,
            timeout=timeout,
            quiet=True,
        )
    killer.join()
    return failed.value


@pytest.mark.parametrize("stall", ["before-metadata", "before-rename"])
def test_a_save_killed_half_way_leaves_the_previous_checkpoint(stall, tmp_path):
    """Kill rank 0 inside the second save (step 4): step 2 must still load, and resuming
    from it must give the losses of a run that was never killed."""
    args = [*FAST, "--steps", "6", "--checkpoint-every", "2"]
    out, never_killed, marker = tmp_path / "out", tmp_path / "never_killed", tmp_path / "stalled"
    failure = run_until_killed(
        ["--stall", stall, "--save", "2", "--marker", marker, lab("lab2_ddp.py"), *args, "--out", out], marker
    )
    assert failure.rank == 0 and ("-9" in failure.summary or "SIGKILL" in failure.summary), failure

    folder = out / "checkpoints"
    half = folder / "step_000004.partial"
    assert sorted(p.name for p in folder.iterdir()) == ["step_000002", "step_000004.partial"]
    assert (half / ".metadata").exists() == (stall == "before-rename")  # where it was killed
    assert not (half / "train_state.json").exists()
    assert latest(folder) == folder / "step_000002"
    inspect_checkpoint(folder / "step_000002")  # complete: every file, every byte its index names

    run_script(lab("lab2_ddp.py"), [*args, "--resume", "latest", "--out", out], nprocs=2, timeout=120, quiet=True)
    run_script(lab("lab2_ddp.py"), [*args, "--out", never_killed], nprocs=2, timeout=120, quiet=True)
    assert losses(out) == losses(never_killed)[2:]
    assert sorted(p.name for p in folder.iterdir()) == ["step_000002", "step_000004", "step_000006"]


def test_torchrun_restarts_the_group_after_a_rank_is_killed(tmp_path):
    """torchrun --max-restarts=1; SIGKILL rank 1 after the first checkpoint; the restarted
    group resumes (--resume auto) and ends with the losses of an uninterrupted run."""
    args = [*FAST, "--steps", "40", "--checkpoint-every", "10", "--resume", "auto"]
    out, never_killed = tmp_path / "out", tmp_path / "never_killed"
    code, lines = torchrun_killing_a_rank(
        lab("lab2_ddp.py"), [*args, "--out", out], after=out / "checkpoints" / "step_000010", rank=1
    )
    output = "\n".join(line for _, line in lines)
    assert code == 0, output[-3000:]
    assert "KILLED rank 1" in output and "exitcode: -9" in output, output[-3000:]
    assert "torchrun restart 1" in output and "resumed from" in output, output[-3000:]
    resumed_at = read_metrics(out)[0]["step"]
    assert resumed_at in (10, 20, 30), resumed_at  # a checkpoint boundary, before the end

    run_script(lab("lab2_ddp.py"), [*args, "--out", never_killed], nprocs=2, timeout=120, quiet=True)
    assert losses(out) == losses(never_killed)[resumed_at:]
    assert read_summary(out)["final_val_loss"] == read_summary(never_killed)["final_val_loss"]
    kept = out / f"metrics.before_step_{resumed_at:06d}.jsonl"  # the killed attempt's log, kept aside
    before = [json.loads(line) for line in kept.read_text().splitlines()]
    assert before[0]["step"] == 0 and before[-1]["step"] >= resumed_at - 1


# ---------------------------------------------------------------- Resume and fault tolerance, exercise 4
def _stall_in_write_data(save_number, marker, items_written):
    from torch.distributed.checkpoint import FileSystemWriter

    original, calls = FileSystemWriter.write_data, [0]

    def patched(self, plan, planner):
        calls[0] += 1
        if calls[0] == save_number:
            kept = dataclasses.replace(plan, items=items_written(plan.items))
            original(self, kept, planner)  # writes these items, then closes the file
            marker.write_text(f"{os.getpid()}\n")
            while True:  # until killed
                time.sleep(1)
        return original(self, plan, planner)

    FileSystemWriter.write_data = patched


def stall_mid_shard_write(save_number, marker):
    _stall_in_write_data(save_number, marker, lambda items: items[: len(items) // 2])


def stall_before_shard_write(save_number, marker):
    _stall_in_write_data(save_number, marker, lambda items: [])  # an empty file: nothing written yet


def stall_in_finish(save_number, marker):
    from torch.distributed.checkpoint import FileSystemWriter

    def patched(self, *args, **kwargs):
        marker.write_text(f"{os.getpid()}\n")
        while True:
            time.sleep(1)

    # finish writes .metadata on the coordinator, rank 0: in rank 1 this patch never runs
    FileSystemWriter.finish = patched


@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_kill_during_shard_writes_checker(capsys):
    assert "a partial __1_0.distcp" in passes(check_kill_during_shard_writes, stall_mid_shard_write, capsys=capsys)
    with pytest.raises(AssertionError, match="rank 1's __1_0.distcp is empty: the kill landed before its writes"):
        check_kill_during_shard_writes(stall_before_shard_write)
    with pytest.raises(AssertionError, match="lab 2 finished: your stall never made rank 1 wait"):
        check_kill_during_shard_writes(stall_in_finish)
