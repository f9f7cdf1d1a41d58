"""Labs 1-6 on CUDA GPUs, held to lab 1: on one GPU and on every GPU of the machine, in
fp32 and bf16; their weights load anywhere; a GPU checkpoint resumes on the CPU and on
another world size.

    # every test of tests/gpu/; without CUDA each is skipped, saying why
    pytest -m gpu

A plain ``pytest`` (``make test``) leaves these out (``-m 'not gpu'`` in
pyproject.toml). The tolerances, and why a GPU needs wider ones than the CPU tests, are
in tests/support/gpu.py.
"""

import pytest
import torch

from distlab.flops import datasheet_entry
from distlab.metrics import read_summary
from support.compare import computed_in_low_precision, mismatches
from support.gpu import (
    ALL_GPUS,
    FP32_RTOL,
    GPU_MODULE,
    MULTI_GPU,
    RTOL,
    WARMUP,
    lab_losses,
    lab_records,
)
from support.labs import BASELINE, BASELINE_LOSSES

pytestmark = GPU_MODULE

DISTRIBUTED = (
    "lab2_ddp",
    "lab3_grad_accum",
    "lab4_fsdp2",
    "lab5_activation_ckpt",
    "lab6_accelerate",
)


def case(lab: str, gpus: str, dtype: str):
    """One lab run: on "1" GPU or on "all" of them (skipped with fewer than 2),
    in ``dtype``."""
    where = "1gpu" if gpus == "1" else "all-gpus"
    return pytest.param(
        lab,
        gpus,
        dtype,
        id=f"{lab}-{where}-{dtype}",
        marks=MULTI_GPU if gpus == "all" else (),
    )


# fp32 on one GPU and on all; bf16 once, on all of them where there are 2 or more
CASES = [case(lab, gpus, "fp32") for lab in DISTRIBUTED for gpus in ("1", "all")]
CASES += [case(lab, "all" if ALL_GPUS >= 2 else "1", "bf16") for lab in DISTRIBUTED]


@pytest.fixture(scope="module")
def lab1(tmp_path_factory) -> dict[str, list[dict]]:
    """Lab 1 on one GPU, in fp32 and in bf16: what every lab on GPUs is held to (its
    records: loss and gradient norm, step by step)."""
    out = tmp_path_factory.mktemp("lab1")
    return {
        dtype: lab_records("lab1_single", out / dtype, 1, "--dtype", dtype)
        for dtype in ("fp32", "bf16")
    }


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def test_lab_1_on_a_gpu_trains_like_lab_1_on_the_cpu(lab1, tmp_path):
    # the CPU's baseline, the gradient norms too past the warm-up
    assert losses(lab1["fp32"]) == pytest.approx(BASELINE_LOSSES, rel=FP32_RTOL)
    assert not mismatches(lab1["fp32"], BASELINE["records"], FP32_RTOL, after=WARMUP)
    # bf16: close to fp32 ...
    assert losses(lab1["bf16"]) == pytest.approx(losses(lab1["fp32"]), rel=RTOL["bf16"])
    # ... and not fp32: the run computed in bf16 (beyond fp32's own noise)
    assert computed_in_low_precision(lab1["bf16"], lab1["fp32"], at_least=FP32_RTOL)
    # torch.compile fuses: other roundings
    compiled = lab_records("lab1_single", tmp_path, 1, "--compile")
    assert not mismatches(compiled, lab1["fp32"], FP32_RTOL)


@pytest.mark.parametrize("lab,gpus,dtype", CASES)
def test_every_lab_on_gpus_trains_like_lab_1(lab1, lab, gpus, dtype, tmp_path):
    nprocs = 1 if gpus == "1" else ALL_GPUS
    records = lab_records(lab, tmp_path, nprocs, "--dtype", dtype)
    assert losses(records) == pytest.approx(losses(lab1[dtype]), rel=RTOL[dtype])
    # the gradient norms too, past the warm-up: a gradient N times too large (a sum
    # over ranks, accumulation not divided) leaves the losses alone
    assert not mismatches(records, lab1[dtype], RTOL[dtype], after=WARMUP)
    if dtype == "bf16":  # a dropped bf16 policy would equal fp32
        assert computed_in_low_precision(records, lab1["fp32"], at_least=FP32_RTOL)
    summary = read_summary(tmp_path)
    # rank 0's GPU
    assert summary["world_size"] == nprocs and summary["device"] == "cuda:0"
    # MFU of the measured peak, and of the datasheet's where the table lists this GPU
    assert 0 < summary["mfu"] <= 1  # timing-ok: a fraction was recorded, no speed
    sheet = datasheet_entry(torch.cuda.get_device_name(0))
    if sheet is None:
        assert summary["datasheet_peak"] is None
    else:
        assert summary["datasheet_peak"]["of"].startswith(sheet[0])
        assert 0 < summary["mfu_of_datasheet_peak"] <= 1
    # model.pt holds CPU tensors whatever trained it: any machine loads any lab's output
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert {t.device.type for t in weights.values()} == {"cpu"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Lab 4 (FSDP2, sharded DCP checkpoints) on one GPU, 6 steps, saving after step 3:
    its losses and the checkpoint to resume from."""
    out = tmp_path_factory.mktemp("straight")
    losses = lab_losses("lab4_fsdp2", out, 1, "--checkpoint-every", 3, steps=6)
    return losses, out / "checkpoints" / "step_000003"


@pytest.mark.parametrize(
    "device,ranks",
    [
        pytest.param("cpu", 2, id="on-2-cpu-ranks"),
        pytest.param("cuda", "all", id="on-all-gpus", marks=MULTI_GPU),
    ],
)
def test_a_gpu_checkpoint_resumes_on_the_cpu_and_on_another_world_size(
    straight, device, ranks, tmp_path
):
    losses, checkpoint = straight
    nprocs = ALL_GPUS if ranks == "all" else ranks
    resumed = lab_losses(
        "lab4_fsdp2", tmp_path, nprocs, "--resume", checkpoint, device=device, steps=6
    )
    # steps 3-5: the run went on where it stopped
    assert resumed == pytest.approx(losses[3:], rel=FP32_RTOL)
    assert read_summary(tmp_path)["world_size"] == nprocs
