"""The overlap on a timeline (bucket order facts on both wrappers) and the comm hooks (bytes counted
against the formula, losses against fp32), on 2 gloo ranks."""

import math

import torch
import torch.distributed as dist

from distlab.chapters.ddp_overlap import compression_demo, powersgd_elements, timeline_demo
from distlab.exercises.ddp_overlap import check_fp16_hook
from distlab.infra.launch import run_ranks
from distlab.tools.comm_timeline import step_times


def test_buckets_launch_in_order_during_backward_and_complete_after_both_ranks_launched():
    ranks = run_ranks(timeline_demo, nprocs=2, args=("tiny", 0.05, 2, 32, 2), quiet=True, timeout=120)
    for wrapper, step in (("from scratch", 1), ("torch", 1)):
        steps = [step_times(r[wrapper][step]["events"], 0.0) for r in ranks]
        n = len(steps[0]["launch"])
        assert n >= 4, wrapper
        for ms in steps:
            assert sorted(ms["launch"], key=ms["launch"].get) == list(range(n)), wrapper  # launch order = bucket order
            assert all(ms["launch"][b] <= ms["backward returned"] for b in range(n)), wrapper
            if wrapper == "from scratch":
                assert sorted(ms["ready"], key=ms["ready"].get) == list(range(n))  # ready order = launch order
                assert all(ms["launch"][b] < ms["ready"][n - 1] for b in range(n - 1))  # all but the last overlap
                assert all(ms["waited"][b] >= ms["backward returned"] for b in range(n))  # one wait, after backward
        # an all-reduce completes on a rank only after the other rank started it (one clock for both)
        started = "ready" if wrapper == "from scratch" else "launch"
        for me, other in ((0, 1), (1, 0)):
            assert all(steps[me]["done"][b] >= steps[other][started][b] for b in range(n)), wrapper
    first = [step_times(r["torch"][0]["events"], 0.0) for r in ranks]
    for ms in first:  # torch's first iteration: one bucket, launched when the last gradient is there
        assert list(ms["launch"]) == [0] and ms["launch"][0] >= max(ms["grads"]) - 1.0


def test_half_precision_hooks_halve_the_bytes_and_powersgd_sends_what_the_formula_says():
    ranks = run_ranks(_compression_short, nprocs=2, quiet=True, timeout=180)
    runs = ranks[0]
    fp32 = 4 * sum(math.prod(s) for s in runs["shapes"])
    for step_calls in runs["fp32"]["calls"]:
        assert sum(b for *_, b in step_calls) == fp32
    for variant, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for step_calls in runs[variant]["calls"]:
            assert [(b, d) for _, d, b in step_calls] == [(fp32 // 2, dtype)], variant  # exactly half
        assert abs(runs[variant]["val_loss"] / runs["fp32"]["val_loss"] - 1) < 1e-3, variant
    for rank in (1, 2, 4):
        calls = runs[f"powersgd-{rank}"]["calls"]
        assert [sum(b for *_, b in c) for c in calls[:2]] == [fp32, fp32]  # plain all-reduce before start_powerSGD_iter
        want = powersgd_elements(runs["shapes"], rank)
        for c in calls[2:]:
            assert [n for n, *_ in c] == [want["uncompressed"], want["P"], want["Q"]]
        assert abs(runs[f"powersgd-{rank}"]["val_loss"] / runs["fp32"]["val_loss"] - 1) < 0.1
    assert runs["bf16 refusal"].startswith("TypeError: BF16 all reduce communication hook required")
    assert ranks[0]["fp32"]["losses"] == ranks[1]["fp32"]["losses"]  # global means: the same on both ranks


def _compression_short():
    return compression_demo(steps=6)


def test_the_powersgd_formula_compresses_only_where_it_pays():
    # a vector (n x 1) is never compressed; a 4096 x 4096 matrix at rank 4 sends (4096 + 4096) x 4
    assert powersgd_elements([(384,)], 4) == {"uncompressed": 384, "P": 0, "Q": 0}
    assert powersgd_elements([(4096, 4096)], 4) == {"uncompressed": 0, "P": 16384, "Q": 16384}
    # (8 + 8) x 4 x 2 = 128 >= 64: not worth it at min_compression_rate 2, sent whole
    assert powersgd_elements([(8, 8)], 4) == {"uncompressed": 64, "P": 0, "Q": 0}
    assert powersgd_elements([(8, 2, 4)], 4) == {"uncompressed": 64, "P": 0, "Q": 0}  # viewed as 8 x 8
    assert powersgd_elements([(8, 2, 4)], 1) == {"uncompressed": 0, "P": 8, "Q": 8}  # 16 x 2 < 64: compressed


def fp16_by_hand(process_group, bucket):
    buffer = bucket.buffer()
    half = buffer.to(torch.float16).div_(dist.get_world_size())

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(half, async_op=True).get_future().then(decompress)


def test_the_checker_passes_a_hand_written_fp16_hook(capsys):
    check_fp16_hook(fp16_by_hand)
    assert capsys.readouterr().out.startswith("passed:")
