"""What book/fault_tolerance.md does not run: exact resume for lab 3 (the page resumes
lab 2, book/checkpoints.md lab 4), a save killed at its second moment (before .metadata;
the page kills it before the rename), the rules of pruning and of --resume, and the
exercise checker catching wrong answers, the store probe's reports read from
interleaved output. The page asserts the rest: the steps of a real save in their order
and what `latest` picks after each, the lab 2 checkpoint's contents and the newest 3
kept, exact resume, a save killed before its rename, resume skipping a truncated newest
checkpoint, torchrun restarting a group that lost a rank."""

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from distlab.chapters.fault_tolerance import kill_when_stalled, probe_reports
from distlab.checkpoint import inspect_checkpoint, latest, prune, resume_point
from distlab.errors import UserError
from distlab.exercises import check_kill_during_shard_writes
from distlab.infra.launch import RankFailed, run_script
from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_metrics, read_summary

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
# lab 2: the page; lab 4: checkpoints.md
LABS = {"lab3_grad_accum.py": ["--micro-batch-size", "4"]}


def lab(name: str) -> str:
    return str(REPO_ROOT / "src" / "labs" / name)


def losses(out) -> list[float]:
    return [m["loss"] for m in read_metrics(out)]


@pytest.mark.parametrize("name", LABS)
def test_resuming_reproduces_the_run_bit_for_bit(name, tmp_path):
    """6 steps straight (saving after 3 and 6) vs a new process that resumes at
    step 3."""
    args = [*FAST, *LABS[name], "--steps", "6", "--checkpoint-every", "3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_script(lab(name), [*args, "--out", straight], nprocs=2, timeout=120, quiet=True)
    step3 = straight / "checkpoints" / "step_000003"
    run_script(
        lab(name),
        [*args, "--resume", step3, "--out", resumed],
        nprocs=2,
        timeout=120,
        quiet=True,
    )

    assert [m["step"] for m in read_metrics(resumed)] == [3, 4, 5]
    # exactly: same bits, not a tolerance
    assert losses(resumed) == losses(straight)[3:]
    assert (
        read_summary(resumed)["final_val_loss"]
        == read_summary(straight)["final_val_loss"]
    )

    # the global part, in words
    state = json.loads((step3 / "train_state.json").read_text())
    assert (state["step"], state["world_size"], state["data"]["next_step"]) == (3, 2, 3)
    keys = FileSystemReader(step3).read_metadata().state_dict_metadata
    assert {"app.rng.rank0.cpu", "app.rng.rank1.cpu"} <= keys.keys()  # per rank
    assert (
        "app.model.wte.weight" in keys and "app.optim.state.wte.weight.exp_avg" in keys
    )
    # DDP's wrapper prefix is not in the checkpoint
    assert not any(".module." in k for k in keys)


def test_prune_and_resume_point_rules(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / "done").write_text("")
    # unfinished: never counted, never pruned here
    (tmp_path / "step_000004.partial").mkdir()
    assert resume_point("auto", tmp_path, holds=("done",)) == tmp_path / "step_000003"
    assert prune(tmp_path, 0, holds=("done",)) == []
    assert [p.name for p in prune(tmp_path, 1, holds=("done",))] == [
        "step_000001",
        "step_000002",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000003",
        "step_000004.partial",
    ]
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


def test_a_save_killed_before_its_metadata_leaves_the_previous_checkpoint(tmp_path):
    """Kill rank 0 inside the second save (step 4) once every shard is written, before
    DCP's .metadata: step 2 must still load, and resuming from it must redo steps 2 and
    3 as the killed run took them. (The page kills a save at its other moment, before
    the rename.)"""
    args = [*FAST, "--steps", "6", "--checkpoint-every", "2"]
    out, marker = tmp_path / "out", tmp_path / "stalled"
    stall = ["--stall", "before-metadata", "--save", "2", "--marker", marker]
    failure = run_until_killed(
        [*stall, lab("lab2_ddp.py"), *args, "--out", out], marker
    )
    assert failure.rank == 0 and (
        "-9" in failure.summary or "SIGKILL" in failure.summary
    ), failure

    folder = out / "checkpoints"
    half = folder / "step_000004.partial"
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_000002",
        "step_000004.partial",
    ]
    assert not (half / ".metadata").exists()  # where it was killed
    assert not (half / "train_state.json").exists()
    assert latest(folder) == folder / "step_000002"
    # complete: every file, every byte its index names
    inspect_checkpoint(folder / "step_000002")

    run_script(
        lab("lab2_ddp.py"),
        [*args, "--resume", "latest", "--out", out],
        nprocs=2,
        timeout=120,
        quiet=True,
    )
    # the killed run's log: steps 0-3, then the kill
    kept = out / "metrics.before_step_000002.jsonl"
    killed_run = {
        m["step"]: m["loss"] for m in map(json.loads, kept.read_text().splitlines())
    }
    assert [m["step"] for m in read_metrics(out)] == [2, 3, 4, 5]
    # exactly: the steps both runs took
    assert losses(out)[:2] == [killed_run[2], killed_run[3]]
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_000002",
        "step_000004",
        "step_000006",
    ]


# ----------------------------------------------- Resume and fault tolerance, exercise 4
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


def stall_before_shard_write(save_number, marker):
    # an empty file: nothing written yet
    _stall_in_write_data(save_number, marker, lambda items: [])


def stall_in_finish(save_number, marker):
    from torch.distributed.checkpoint import FileSystemWriter

    def patched(self, *args, **kwargs):
        marker.write_text(f"{os.getpid()}\n")
        while True:
            time.sleep(1)

    # finish writes .metadata on the coordinator, rank 0: in rank 1 this patch
    # never runs
    FileSystemWriter.finish = patched


@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_kill_during_shard_writes_checker_catches_wrong_answers():
    # the right answer passes on every build of book/fault_tolerance.md (its exercise
    # 4 cell)
    with pytest.raises(
        AssertionError,
        match="rank 1's __1_0.distcp is empty: the kill landed before its writes",
    ):
        check_kill_during_shard_writes(stall_before_shard_write)
    with pytest.raises(
        AssertionError, match="lab 2 finished: your stall never made rank 1 wait"
    ):
        check_kill_during_shard_writes(stall_in_finish)


def test_probe_reports_are_cut_apart_when_two_ranks_share_a_line():
    # two ranks printing at once can put both reports on one line of torchrun's output
    text = (
        "attempt 0, rank 1: 3 keys in the store after joiningattempt 0, rank 0: 3 keys"
        " in the store after joining\nnoise\nattempt 1, rank 0: 5 keys before joining\n"
    )
    assert probe_reports(text) == [
        "attempt 0, rank 0: 3 keys in the store after joining",
        "attempt 0, rank 1: 3 keys in the store after joining",
        "attempt 1, rank 0: 5 keys before joining",
    ]
