"""The debugging chapter: what book/debugging.md does not run. The page provokes each
failure (a skipped collective, a dead rank, mismatched shapes under DETAIL, collectives
that pair up silently, Lockstep, replicas that drift apart, a NaN on one rank, the
monitored barrier's shared budget, stack dumps of a hung rank, the exit-order deadlock)
and asserts what each rank saw on every build. Here: gloo's abort on other sizes,
torch's DDP keeping replicas equal, the labs freeing their DDP model before destroying
the group, and the exercise checker failing the exercise's own program.

Every launch has a wall-clock limit (run_ranks' ``timeout``) and a short process-group
timeout, so a regression fails a test instead of hanging the suite.
"""

import os

import pytest
import torch
import torch.distributed as dist

from distlab.chapters.debugging import replicas_demo
from distlab.exercises import check_lockstep_broadcast
from distlab.infra.launch import RankFailed, run_ranks, run_script
from distlab.infra.observe import observe
from distlab.infra.paths import REPO_ROOT

T = 1.5  # the process-group timeout of these tests, in seconds
LIMIT = 60  # no launch may take longer than this


def sizes_differ(folder, sizes):
    # gloo's complaint goes to the C++ stderr of the rank that aborts: keep it in a file
    os.dup2(os.open(f"{folder}/stderr{dist.get_rank()}", os.O_WRONLY | os.O_CREAT), 2)
    dist.all_reduce(torch.ones(sizes[dist.get_rank()]))
    dist.barrier()


def test_without_detail_other_sizes_abort_a_rank_inside_gloo(tmp_path):
    with pytest.raises(RankFailed) as info:
        run_ranks(
            sizes_differ,
            args=(str(tmp_path), (1, 1000)),
            pg_timeout=T,
            timeout=LIMIT,
            quiet=True,
        )
    assert info.value.rank == 0 and info.value.summary == "exit code -6 (SIGABRT)"
    stderr = (tmp_path / "stderr0").read_text()
    assert (
        "gloo::EnforceNotMet" in stderr
        and "Received data size doesn't match expected size" in stderr
    )


def test_torch_ddp_keeps_the_replicas_equal_on_the_same_model():
    outcome = observe(replicas_demo, "DDP", pg_timeout=T, timeout=LIMIT)
    assert outcome.results == [{"steps": 3, "error": None}] * 2


@pytest.mark.parametrize("lab", ["lab2_ddp", "lab3_grad_accum", "lab6_accelerate"])
def test_labs_free_their_ddp_model_before_they_destroy_the_group(lab, tmp_path):
    # tests/support/freed_before_destroy.py fails destroy_process_group while any DDP
    # model is alive; --track-memory too, since the tracker's helper holds the model
    # as well
    args = [
        "--preset",
        "tiny",
        "--steps",
        # the memory tracker (and its helper, which holds the model) starts at the 2nd
        "2",
        "--batch-size",
        "8",
        "--sample-chars",
        "0",
        "--no-progress",
        "--eval-batches",
        "1",
        "--track-memory",
        "--out",
        str(tmp_path),
    ]
    run_script(
        REPO_ROOT / "tests" / "support" / "freed_before_destroy.py",
        [str(REPO_ROOT / "src" / "labs" / f"{lab}.py"), *args],
        nprocs=2,
        timeout=LIMIT,
        quiet=True,
    )
    assert (tmp_path / "summary.json").exists()


# ---------------------------------------------------------------- Debugging, exercise 3
def share_weights_in_two_branches(broadcast):  # the program of the exercise
    if dist.get_rank() == 0:
        weights = torch.arange(4.0)
        broadcast(weights, src=0)
        return weights
    buffer = torch.empty(4)
    broadcast(buffer, src=0)
    return buffer


@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_lockstep_broadcast_checker_fails_the_exercises_program():
    # the page runs the checker on its solution, which passes, on every build
    with pytest.raises(
        AssertionError,
        match=r"Lockstep stopped your program on 3 ranks(.|\n)*rank 1: #0 broadcast",
    ):
        check_lockstep_broadcast(share_weights_in_two_branches)
