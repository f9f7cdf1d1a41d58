"""The notebook launcher: results come back, failures raise, nothing hangs."""

import os
import threading
import time
from types import SimpleNamespace

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab.errors import UserError
from distlab.infra.launch import (
    LaunchTimeout,
    RankFailed,
    _rank_env,
    run_ranks,
    run_script,
)
from distlab.infra.launcher import _root_failure, pump, rank_entry
from distlab.runtime import pick_device


def rank_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_every_rank_returns_its_result(nprocs):
    results = run_ranks(rank_sum, nprocs=nprocs, quiet=True)
    total = nprocs * (nprocs + 1) / 2
    assert results == [(r, nprocs, total) for r in range(nprocs)]


def test_functions_defined_in_the_caller_travel_by_value():
    offset = 41  # captured from this scope, as a notebook cell would

    def add_offset():
        return dist.get_rank() + offset

    assert run_ranks(add_offset, nprocs=2, quiet=True) == [41, 42]


def test_a_failing_rank_raises_with_its_rank_and_error():
    def fail_on_rank_1():
        if dist.get_rank() == 1:
            raise ValueError("rank one is broken on purpose")
        return "fine"

    with pytest.raises(RankFailed) as info:
        run_ranks(fail_on_rank_1, nprocs=2, quiet=True)
    assert info.value.rank == 1
    assert "ValueError: rank one is broken on purpose" in str(info.value)


def test_a_hung_rank_is_killed_at_the_timeout(tmp_path):
    def hang_on_rank_0():
        (tmp_path / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
        if dist.get_rank() == 0:
            time.sleep(600)
        return "done"

    # the launcher's own timeout, not the test's: LaunchTimeout, naming the 15 s it
    # was given
    with pytest.raises(LaunchTimeout, match="did not finish within 15 s"):
        run_ranks(hang_on_rank_0, nprocs=2, timeout=15, quiet=True)
    for pid_file in tmp_path.glob("pid*"):
        with pytest.raises(ProcessLookupError):  # no rank outlives its launch
            os.kill(int(pid_file.read_text()), 0)


def test_a_skipped_collective_fails_at_the_process_group_timeout():
    def rank_1_skips_the_all_reduce():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        else:
            # never joins; rank 0 must give up after pg_timeout, not hang
            time.sleep(30)
        return "done"

    with pytest.raises(RankFailed) as info:
        run_ranks(
            rank_1_skips_the_all_reduce, nprocs=2, pg_timeout=5, timeout=60, quiet=True
        )
    # rank 0 failed in its all_reduce, by gloo's timeout of the 5 s given: the process
    # group's own error, not the launch's (that would be LaunchTimeout, at 60 s)
    assert info.value.rank == 0
    assert "Timed out waiting 5000ms" in str(info.value), str(info.value)[-2000:]


def test_two_launches_at_once_do_not_collide():
    results = {}

    def launch(key):
        results[key] = run_ranks(rank_sum, nprocs=2, quiet=True)

    threads = [threading.Thread(target=launch, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {k: [(0, 2, 3.0), (1, 2, 3.0)] for k in "ab"}


def test_a_failing_script_raises_with_its_one_line_error():
    with pytest.raises(RankFailed, match="unknown preset 'huge'"):
        run_script(
            "src/labs/lab1_single.py", ["--preset", "huge"], nprocs=1, quiet=True
        )


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="nprocs"):
        run_ranks(rank_sum, nprocs=0)
    with pytest.raises(FileNotFoundError):
        run_script("src/labs/no_such_lab.py")


def device_backend_and_environment():
    return (
        str(pick_device("auto")),
        dist.get_backend(),
        os.environ["CUDA_VISIBLE_DEVICES"],
        os.environ["DISTLAB_DEVICE"],
    )


def join_with_cuda_reported():
    """In a rank: torch now says it has 8 GPUs; then what every rank of run_ranks does
    (rank_entry), with device "auto" as a lab's default asks. Unpinned, it would take
    cuda:N and NCCL."""
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 8
    return rank_entry(
        cloudpickle.dumps(device_backend_and_environment), (), "auto", 30.0, True
    )


def test_ranks_pick_the_cpu_and_gloo_where_cuda_is_reported(monkeypatch):
    # the caller sees GPUs too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    # device="cpu": the default
    results = run_ranks(join_with_cuda_reported, nprocs=2, init_group=False, quiet=True)
    assert results == [("cpu", "gloo", "", "cpu")] * 2


def test_cpu_ranks_are_pinned_and_cuda_ranks_are_not(monkeypatch):
    # as in a pinned caller: make test, make book
    monkeypatch.setenv("DISTLAB_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = _rank_env(2, "cpu")
    assert (cpu["DISTLAB_DEVICE"], cpu["CUDA_VISIBLE_DEVICES"]) == ("cpu", "")
    # the ranks share the cores
    assert cpu["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    cuda = _rank_env(2, "cuda")
    assert "DISTLAB_DEVICE" not in cuda and "OMP_NUM_THREADS" not in cuda
    assert cuda["CUDA_VISIBLE_DEVICES"] == "0,1"  # the caller's choice of GPUs stands


def test_more_ranks_than_gpus_is_refused_in_one_line_before_anything_starts(
    monkeypatch,
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError) as info:
        run_ranks(rank_sum, nprocs=3, device="cuda")
    assert str(info.value) == (
        "3 ranks on device='cuda' need 3 GPUs, one per rank, and this process sees 2: "
        "start at most 2 ranks, or pass device='cpu'"
    )
    with pytest.raises(UserError, match="4 ranks on device='cuda' need 4 GPUs"):
        run_script(
            "src/labs/lab1_single.py", ["--device", "cuda"], nprocs=4, device="cuda"
        )
    with pytest.raises(
        ValueError, match="device must be 'auto', 'cpu' or 'cuda', got 'gpu'"
    ):
        run_ranks(rank_sum, device="gpu")


def test_the_reported_failure_is_the_root_cause_not_the_peer_that_lost_its_connection():
    """Elastic's timestamps are whole seconds: a rank's timeout and its peer's
    "Connection closed by peer" a moment later often tie, and the lower rank would
    be named."""
    lost = SimpleNamespace(
        message="RuntimeError: [pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:10150",
        timestamp=7,
    )
    timed_out = SimpleNamespace(
        message="RuntimeError: [unbound_buffer.cc:81] Timed out waiting 5000ms",
        timestamp=7,
    )
    assert _root_failure(SimpleNamespace(failures={0: lost, 1: timed_out})) == (
        1,
        timed_out,
    )
    later = SimpleNamespace(message="ValueError: bad input", timestamp=9)
    # else the earliest
    assert _root_failure(SimpleNamespace(failures={0: later, 1: timed_out})) == (
        1,
        timed_out,
    )


def fails_late_or_loses_its_peer():
    """Rank 1 fails with its own error a second in; rank 0 at once with a closed
    socket, as when its peer is still exiting."""
    if dist.get_rank() == 1:
        time.sleep(1.0)
        raise RuntimeError("rank 1's own error")
    raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5011")


def test_a_rank_that_lost_its_peer_waits_so_the_peers_own_failure_is_named():
    """Elastic records only the ranks that have exited when it sees the first
    failure: without the wait, rank 0's lost peer is named and rank 1 is killed
    unrecorded (the collectives page, under load)."""
    with pytest.raises(RankFailed) as failed:
        run_ranks(fails_late_or_loses_its_peer, nprocs=2, quiet=True, timeout=120)
    assert failed.value.rank == 1 and "rank 1's own error" in str(failed.value)


def test_a_failed_gloo_connect_is_not_echoed_into_the_callers_output(tmp_path, capsys):
    # the launch is repeated; a page must not show a 300-column line of the attempt
    log = tmp_path / "output.log"
    log.write_text(
        "[rank0] hello\n"
        "[rank1] [E1127 20:09:22.86 ProcessGroupGloo.cpp:67] Gloo connectFullMesh "
        "failed "
        "with ... Connection closed by peer\n"
    )
    output, done = [], threading.Event()
    done.set()
    pump(log, done, output, quiet=False, muted=threading.Event())
    assert capsys.readouterr().out == "[rank0] hello\n"
    assert len(output) == 2  # kept for RankFailed, should every attempt fail
