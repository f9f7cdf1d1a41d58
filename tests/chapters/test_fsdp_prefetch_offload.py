"""FSDP2 prefetching and CPU offload, on 2 gloo ranks (one launch): by default FSDP2 holds the root and
two blocks' worth of gathered bytes and prefetches one unit ahead in backward only; explicit prefetch
of k blocks issues all-gathers k units early for k blocks more; unshard(async_op=True) issues the
root's before forward; no setting changes the loss. CPUOffloadPolicy on CPU ranks changes only its
flag; pinning needs an accelerator. The offload benchmark's CPU smoke run; the exercise's verdict."""

import json
import os
import subprocess
import sys

import pytest

from distlab.chapters.fsdp_prefetch_offload import N_LAYER, SETTINGS, measure
from distlab.exercises.fsdp_prefetch_offload import verdict
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT

BLOCKS = [f"blocks.{i}" for i in range(N_LAYER)]


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(measure, nprocs=2, timeout=240, quiet=True)


def leads(timeline: dict, phase: str) -> list[tuple[str, str, int]]:
    return [(g["unit"], g["issued by"], g["lead"]) for g in timeline["gathers"] if g["phase"] == phase]


def test_by_default_the_root_and_two_blocks_are_held_and_only_backward_prefetches(ranks):
    for rank in ranks:
        t = rank["prefetch"]["implicit (default)"]
        assert t["peak"]["bytes"] == t["root_bytes"] + 2 * t["block_bytes"]  # exact, in both directions
        # on gloo nothing is issued ahead in forward: the implicit prefetch needs CUDA streams
        assert leads(t, "forward") == [(u, "own pre-forward", 0) for u in ["root", *BLOCKS]]
        # backward: the root prefetches the last block, each block the one below it
        assert leads(t, "backward") == [(u, "backward prefetch", 1) for u in reversed(BLOCKS)]


def test_kept_gathered_the_whole_model_is_held_and_backward_gathers_nothing(ranks):
    for rank in ranks:
        kept = rank["prefetch"]["implicit, reshard_after_forward=False"]
        assert kept["peak"]["bytes"] == kept["root_bytes"] + (N_LAYER + 1) * kept["block_bytes"]
        assert kept["peak"]["held"] == ["root", *BLOCKS] and leads(kept, "backward") == []
        both = rank["prefetch"]["explicit, 2 ahead, reshard_after_forward=False"]
        assert both["peak"]["bytes"] == kept["peak"]["bytes"]  # prefetching adds nothing to the whole model


@pytest.mark.parametrize("ahead", [1, 2])
def test_explicit_prefetch_issues_k_units_early_for_k_blocks_more(ranks, ahead):
    for rank in ranks:
        default, t = rank["prefetch"]["implicit (default)"], rank["prefetch"][f"explicit, {ahead} ahead"]
        assert t["peak"]["bytes"] == default["peak"]["bytes"] + ahead * t["block_bytes"]
        forward = [lead for unit, _, lead in leads(t, "forward")]
        assert forward == [0, 0] + [min(i, ahead) for i in range(1, N_LAYER)]  # root, block 0: their own
        backward = [lead for unit, _, lead in leads(t, "backward")]
        assert backward == [1] + [min(i, ahead) for i in range(1, N_LAYER)]  # the root keeps its default


def test_async_unshard_issues_the_roots_all_gather_before_forward_at_no_cost(ranks):
    t, default = (
        ranks[0]["prefetch"]["implicit + root.unshard(async_op=True)"],
        ranks[0]["prefetch"]["implicit (default)"],
    )
    first = t["gathers"][0]
    assert (first["unit"], first["issued by"]) == ("root", "unshard()")
    assert first["index"] < default["gathers"][0]["index"]  # before the forward's own pre-forward would issue it
    assert t["peak"]["bytes"] == default["peak"]["bytes"]


def test_prefetching_never_changes_the_loss(ranks):
    for rank in ranks:
        assert len({rank["prefetch"][name]["loss"] for name in SETTINGS}) == 1


def test_cpu_offload_on_cpu_ranks_changes_only_the_flag(ranks):
    for rank in ranks:
        off = rank["offload"]
        plain, offloaded = off["no offload"], off["CPUOffloadPolicy(pin_memory=False)"]
        assert offloaded["where"]["offload_to_cpu"] == "True" and plain["where"]["offload_to_cpu"] == "False"
        same = {k: v for k, v in plain["where"].items() if k != "offload_to_cpu"}
        assert same == {k: v for k, v in offloaded["where"].items() if k != "offload_to_cpu"}
        assert all("cpu" in v and "pinned" not in v for v in same.values())
        for key in ("ops", "copies", "gathered_bytes", "reduced_bytes", "losses"):
            assert plain[key] == offloaded[key], key  # the same work, bit for bit
        assert off["pinned"].startswith("RuntimeError")  # CPUOffloadPolicy() pins: needs an accelerator


def test_verdict_rejects_a_block_left_to_its_own_pre_forward_or_gathered_too_early(ranks):
    gathers = ranks[0]["prefetch"]["explicit, 2 ahead"]["gathers"]
    with pytest.raises(AssertionError, match="blocks.0's forward all-gather was issued by own pre-forward"):
        verdict(gathers, 2, N_LAYER)
    every_block_ahead = [dict(g, lead=1) if g["unit"] == "blocks.0" else g for g in gathers]
    verdict(every_block_ahead, 2, N_LAYER)  # passes
    with pytest.raises(AssertionError, match="more than 1 blocks in flight"):
        verdict(every_block_ahead, 1, N_LAYER)
    with pytest.raises(AssertionError, match="every block once"):
        verdict([g for g in every_block_ahead if g["unit"] != "blocks.3"], 2, N_LAYER)


def test_offload_benchmark_smoke_run_on_the_cpu(tmp_path):
    out = tmp_path / "offload.json"
    env = dict(os.environ, DISTLAB_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
    subprocess.run(
        [sys.executable, "-m", "distlab.bench.fsdp_offload", "--device", "cpu", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        check=True,
        timeout=120,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["dtype"], r["offload"]) for r in runs] == [("fp32", False), ("fp32", True)]
    assert runs[0]["losses"] == runs[1]["losses"]  # the same steps with the shards offloaded
    assert all(r["peak_gpu_bytes"] is None and len(r["step_s"]) == result["settings"]["steps"] for r in runs)
    assert result["provenance"]["command"].startswith("python -m distlab.bench.fsdp_offload --device cpu")
