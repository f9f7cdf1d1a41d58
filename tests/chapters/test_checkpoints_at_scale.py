"""Checkpoints at scale: async_save returns before its save completes and snapshots the weights
at the call, StateDictOptions' rank-by-rank contents, PyTorch's converters equal the book's byte
for byte, the straggler detector names the slowed rank, and the elastic timer kills a hung
worker. One launch of 2 ranks serves every claim but the timer's."""

import math

import pytest

from distlab.chapters.checkpoints_at_scale import checkpoint_experiments, kill_hung_worker, young_interval
from distlab.infra.launch import run_ranks
from distlab.tools.stragglers import StragglerDetector


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(checkpoint_experiments, 2, args=(str(tmp_path_factory.mktemp("ckpt")),), quiet=True, timeout=120)


def test_async_save_blocks_less_than_it_takes(ranks):
    for r in ranks:
        saves = r["saves"]
        # an ordering fact, not a race: the future completes after the call returned
        assert 0 < saves["async_blocked"] < saves["async_total"]
        # the weights changed right after the call; the checkpoint kept the ones at the call
        assert saves["snapshot_kept"]


def test_state_dict_options_per_rank(ranks):
    r0, r1 = ranks
    full_bytes = r0["convert"]["bytes"]
    for r in ranks:
        views = r["views"]
        assert views["default"]["type"] == views["cpu_offload"]["type"] == "DTensor"
        assert views["default"]["bytes"] + 4096 > full_bytes / 2  # a shard: half, up to an uneven row
        assert views["full_state_dict"]["type"] == "Tensor" and views["full_state_dict"]["bytes"] == full_bytes
    assert r0["views"]["default"]["bytes"] + r1["views"]["default"]["bytes"] == full_bytes
    # with cpu_offload the full gather stays on rank 0 only
    assert r0["views"]["full_state_dict + cpu_offload"]["bytes"] == full_bytes
    assert r1["views"]["full_state_dict + cpu_offload"]["keys"] == 0


def test_converters_give_equal_bytes(ranks):
    convert = ranks[0]["convert"]
    assert convert["equal"] and convert["round_trip_equal"]
    assert convert["bytes"] > 40e6  # the shakespeare preset: 43.2 MB (10.8 M fp32 weights)


def test_straggler_is_named(ranks):
    for r in ranks:
        assert r["straggler"]["slow_ranks"] == [1]  # the rank that sleeps
        assert r["straggler"]["max_over_median"] > 1.5


def test_young_interval_and_errors():
    tau, waste = young_interval(60, 86400)  # the fault-tolerance chapter's example: about 54 minutes
    assert tau == pytest.approx(math.sqrt(2 * 60 * 86400)) and 53 * 60 < tau < 55 * 60
    assert waste == pytest.approx(math.sqrt(2 * 60 / 86400))
    with pytest.raises(ValueError, match="positive"):
        young_interval(0, 86400)
    with pytest.raises(ValueError, match="threshold"):
        StragglerDetector(every=5, threshold=1.0)


def test_timer_kills_the_hung_worker():
    hung = kill_hung_worker(hang_at=1, limit_s=0.5, timeout_s=20)
    assert hung["exitcode"] == -9  # SIGKILL from the timer server, not the demo's own timeout
    assert hung["steps_started"] == 2
    assert 0.5 <= hung["killed_after_s"] < 10  # the limit, plus watchdog ticks on a busy machine
