"""FSDP2 with torch.compile: the benchmark's smoke path and the exercise's bad input.
The page (book/fsdp_compile.md) runs every order on 2 ranks in one launch and asserts on
every build what they give (one graph per identical block with the checkpoint inside,
eager FSDP2's losses bit for bit with aot_eager, the other orders' outcomes) and that
the exercise's judge fails each wrong order on those runs."""

import json

import pytest

from distlab.exercises.fsdp_compile import check_parallelize
from distlab.infra.launch import run_ranks


def _smoke(out: str) -> dict:
    from distlab.bench.fsdp_compile import main

    return main(
        [
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--steps",
            "2",
            "--dtype",
            "fp32",
            "--backend",
            "aot_eager",
            "--out",
            out,
        ]
    )


def test_bench_smoke_path(tmp_path):
    """One process (a rank forked with torch and Dynamo imported already), FSDP2 on a
    group of one."""
    out = tmp_path / "bench.json"
    bench = run_ranks(_smoke, nprocs=1, args=(str(out),), timeout=240, quiet=True)[0]
    eager, compiled = bench["runs"]
    assert eager["unique_graphs"] == 0 and compiled["unique_graphs"] == 1
    assert bench["comparison"]["loss_max_abs_diff"] == 0.0  # aot_eager, fp32
    written = json.loads(out.read_text())
    assert written["provenance"]["command"].startswith(
        "python -m distlab.bench.fsdp_compile --device cpu"
    )


def test_the_checker_wants_a_function():
    with pytest.raises(ValueError, match="must be a function"):
        check_parallelize("apply_compile")


def _bench(ac: str, gpu: str) -> dict:
    run = {"variant": "eager", "median_step_s": 1.0}
    settings = {"preset": "tiny", "batch_size": 2, "ac": ac, "dtype": "bf16"}
    return {
        "provenance": {
            "settings": settings,
            "gpu_names": [gpu],
            "machine": gpu,
            "torch": "2.11.0+cu130",
        },
        "runs": [run, {**run, "variant": "compiled (inductor)"}],
        "comparison": {"speedup": 1.0},
    }


def test_compute_share_counts_the_recompute_and_knows_its_peaks():
    """The page reads results/fsdp_compile_bench_large.json when it exists: a run on a
    GPU without a datasheet row gives no MFU rather than a wrong one."""
    from distlab.data import token_data
    from distlab.figures.fsdp_compile_figures import compute_share
    from distlab.flops import flops_per_token
    from distlab.model import preset

    cfg = preset("tiny", vocab_size=token_data().vocab_size)
    plain = compute_share(_bench("none", "NVIDIA H100 80GB HBM3"))
    assert plain["step_flops"] == flops_per_token(cfg) * 2 * cfg.block_size
    assert plain["peak"] == ("H100 SXM", 989.5e12)
    assert (
        compute_share(_bench("full", "X"))["step_flops"] == plain["step_flops"] * 4 / 3
    )
    # MFU counts the model's FLOPs, not the recompute; HFU counts what ran
    full = compute_share(_bench("full", "NVIDIA H200"))
    assert full["peak"] == ("H200 SXM", 989.5e12) and full["card"] == "H200 SXM"
    assert full["runs"][0]["mfu"] == pytest.approx(plain["runs"][0]["mfu"])
    assert full["runs"][0]["hfu"] == pytest.approx(full["runs"][0]["mfu"] * 4 / 3)
    unknown = compute_share(_bench("full", "Some GPU"))
    assert unknown["peak"] is None and unknown["runs"][0]["mfu"] is None
