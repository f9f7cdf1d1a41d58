"""The debugging chapter's failures and tools, on 2 gloo ranks, each ending within seconds.

Every launch has a wall-clock limit (observe's and run_ranks' ``timeout``) and a short
process-group timeout, so a regression fails a test instead of hanging the suite.
"""

import os
import re

import pytest
import torch
import torch.distributed as dist

from distlab.chapters.debugging import (
    dying_rank_demo,
    exit_demo,
    hung_job_demo,
    late_rank_demo,
    metrics_demo,
    recorded_job_demo,
    replicas_demo,
    shapes_demo,
)
from distlab.exercises import check_lockstep_broadcast
from distlab.infra.launch import RankFailed, run_ranks, run_script
from distlab.infra.observe import observe
from distlab.infra.paths import REPO_ROOT
from distlab.tools.debug import analyse_flight_recorder
from support.exercises import passes

T = 1.5  # the process-group timeout of these tests, in seconds
LIMIT = 60  # no launch may take longer than this


def test_a_rank_that_stops_answering_is_noticed_at_the_timeout_and_recorded(tmp_path, monkeypatch):
    # rank 1 skips the 4th all-reduce (stuck in wait_for_data); the flight recorder is on
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "200")
    outcome = observe(recorded_job_demo, T + 0.3, pg_timeout=T, timeout=LIMIT, folder=str(tmp_path))
    seen = outcome.results[0]
    assert f"Timed out waiting {T * 1000:.0f}ms" in seen["error"]
    assert 0.9 * T < seen["waited_s"] < 3 * T
    report = analyse_flight_recorder(str(tmp_path))
    assert "Not all ranks joining collective, sequence number: 4" in report
    assert "missing ranks: {1}" in report and "input sizes: [[4, 4]]" in report


def test_a_rank_that_dies_is_noticed_at_once_and_named_by_the_launcher():
    outcome = observe(dying_rank_demo, pg_timeout=T, timeout=LIMIT)
    seen = outcome.notes[0]
    assert re.search(r"Connection (closed|reset) by peer", seen["error"])
    assert seen["waited_s"] < T / 2  # not the timeout: the kernel closed the dead rank's sockets
    assert outcome.failed_rank == 1 and outcome.failure == "exit code -9 (SIGKILL)"


def test_detail_names_both_shapes_but_only_once_the_level_is_read_again(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    stale, reread = (
        observe(shapes_demo, T, again, pg_timeout=T, timeout=LIMIT, init_group=False).results for again in (False, True)
    )
    # set in this process after torch.distributed was imported: the forked ranks ignore it
    assert {seen["debug_level"] for seen in stale} == {"OFF"} and stale[0]["backend"] == "ProcessGroupGloo"
    assert "Timed out" in stale[0]["error"] and "TensorShape" not in stale[0]["error"]
    for rank, seen in enumerate(reread):
        assert seen["debug_level"] == "DETAIL" and seen["backend"] == "_ProcessGroupWrapper"
        assert "TensorShape=[8]" in seen["error"] and "TensorShape=[6]" in seen["error"]
        assert seen["waited_s"] < T / 2, rank


def sizes_differ(folder, sizes):
    # gloo's complaint goes to the C++ stderr of the rank that aborts: keep it in a file
    os.dup2(os.open(f"{folder}/stderr{dist.get_rank()}", os.O_WRONLY | os.O_CREAT), 2)
    dist.all_reduce(torch.ones(sizes[dist.get_rank()]))
    dist.barrier()


def test_without_detail_other_sizes_abort_a_rank_inside_gloo(tmp_path):
    with pytest.raises(RankFailed) as info:
        run_ranks(sizes_differ, args=(str(tmp_path), (1, 1000)), pg_timeout=T, timeout=LIMIT, quiet=True)
    assert info.value.rank == 0 and info.value.summary == "exit code -6 (SIGABRT)"
    stderr = (tmp_path / "stderr0").read_text()
    assert "gloo::EnforceNotMet" in stderr and "Received data size doesn't match expected size" in stderr


def test_same_shaped_collectives_pair_up_silently_even_under_detail(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    outcome = observe(metrics_demo, T, True, False, pg_timeout=T, timeout=LIMIT, init_group=False)
    assert outcome.failure is None
    assert [seen["debug_level"] for seen in outcome.results] == ["DETAIL", "DETAIL"]
    assert [seen["error"] for seen in outcome.results] == [None, None]
    # rank 0's "loss" is the mean of its loss (2.10) and rank 1's grad norm (0.92)
    assert outcome.results[0]["logged"] == (1.51, 1.49) and outcome.results[1]["logged"] == (1.49, 1.51)


def test_lockstep_names_each_ranks_call_and_passes_correct_code():
    outcome = observe(metrics_demo, T, False, True, pg_timeout=T, timeout=LIMIT, init_group=False)
    errors = [seen["error"] for seen in outcome.results]
    for error in errors:  # every rank raises, with every rank's call
        assert error.startswith("CollectiveMismatch: ranks are about to run different collectives")
        assert re.search(r"rank 0: #0 all_reduce\(float32\[\]\) at debugging.py:\d+ `all_reduce\(loss\)`", error)
        assert re.search(r"rank 1: #0 all_reduce\(float32\[\]\) at debugging.py:\d+ `all_reduce\(grad_norm\)`", error)
    # before that, 2 x 100 checked all-reduces of correct code ran without a complaint
    assert outcome.results[0]["seconds_per_all_reduce"]["lockstep"] > 0


def test_check_replicas_catches_hook_ddp_reducing_in_ready_order():
    outcome = observe(replicas_demo, "HookDDP", pg_timeout=T, timeout=LIMIT)
    for seen in outcome.results:
        assert seen["steps"] == 1 and seen["error"].startswith("ReplicasDiverged: rank 1's 'module.")


def test_torch_ddp_keeps_the_replicas_equal_on_the_same_model():
    outcome = observe(replicas_demo, "DDP", pg_timeout=T, timeout=LIMIT)
    assert outcome.results == [{"steps": 3, "error": None}] * 2


def test_monitored_barrier_names_the_late_rank_within_its_timeout():
    outcome = observe(late_rank_demo, 1.5, 0.5, pg_timeout=T, timeout=LIMIT)
    seen = outcome.results[0]
    assert "Rank 1 failed to pass monitoredBarrier in 500 ms" in seen["error"]
    assert 0.4 < seen["waited_s"] < 1.5


def test_faulthandler_dumps_show_where_each_rank_waits():
    def signal_both(report):
        import signal
        import time

        from distlab.infra.observe import wait_for_pids

        pids = wait_for_pids(report)
        time.sleep(0.8)  # the watchdog (0.5 s) has fired; rank 0 is still in its all-reduce
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.2)
        return [open(f"{report}/stacks{rank}.txt").read() for rank in (0, 1)]

    # a longer timeout here: rank 0 must still be waiting when the signal comes, even on a busy machine
    outcome = observe(hung_job_demo, 0.5, 2.8, pg_timeout=2.5, timeout=LIMIT, while_running=signal_both)
    rank0, rank1 = outcome.notes[-1]
    assert rank0.startswith("Timeout (0:00:00.500000)!")  # the watchdog's dump comes first
    assert rank0.count("in hung_job_demo") == 2  # the watchdog's and SIGUSR1's
    assert re.search(r"line \d+ in all_reduce\n.*\n.*line \d+ in hung_job_demo", rank0)
    assert re.search(r"line \d+ in stuck\n.*line \d+ in wait_for_data\n.*line \d+ in hung_job_demo", rank1)
    assert "Timed out" in outcome.results[0]["error"]


def test_a_ddp_model_freed_before_the_group_exits_and_after_it_deadlocks():
    # the debugging chapter's exit-order section; if a torch upgrade makes the second launch
    # finish, the deadlock is fixed upstream and the chapter (and the labs' comment) must change
    freed_first = observe(exit_demo, True, 1.0, init_group=False, timeout=LIMIT)
    assert freed_first.failure is None
    assert freed_first.results[0]["teardown_s"] > 0.5  # it waited for rank 1's all-reduce ...
    assert freed_first.results[0]["python_ticks_during_teardown"] >= 10  # ... with the GIL free
    destroyed_first = observe(exit_demo, False, 1.0, init_group=False, timeout=8)
    assert destroyed_first.failure == "2 rank(s) did not finish within 8 s; all were killed"


@pytest.mark.parametrize("lab", ["lab2_ddp", "lab3_grad_accum", "lab6_accelerate"])
def test_labs_free_their_ddp_model_before_they_destroy_the_group(lab, tmp_path):
    # tests/support/freed_before_destroy.py fails destroy_process_group while any DDP model is alive;
    # --track-memory too, since the tracker's helper holds the model as well
    args = [
        "--preset",
        "tiny",
        "--steps",
        "3",
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
def share_weights_from_one_line(broadcast):
    t = torch.arange(4.0) if dist.get_rank() == 0 else torch.empty(4)
    broadcast(t, src=0)
    return t


def share_weights_in_two_branches(broadcast):  # the program of the exercise
    if dist.get_rank() == 0:
        weights = torch.arange(4.0)
        broadcast(weights, src=0)
        return weights
    buffer = torch.empty(4)
    broadcast(buffer, src=0)
    return buffer


@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_lockstep_broadcast_checker(capsys):
    assert "on all 3 ranks" in passes(check_lockstep_broadcast, share_weights_from_one_line, capsys=capsys)
    with pytest.raises(AssertionError, match=r"Lockstep stopped your program on 3 ranks(.|\n)*rank 1: #0 broadcast"):
        check_lockstep_broadcast(share_weights_in_two_branches)
