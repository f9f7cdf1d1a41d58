"""Lab 6's FSDP2 on GPUs, where Accelerate's real FSDP2 mode is on (on CPU ranks the
Accelerate chapter can only switch it on by hand), and the ring all-reduce from scratch
on NCCL.

    pytest -m gpu  # every test of tests/gpu/; without CUDA each is skipped, saying why

Both need 2 or more GPUs (FSDP2 and a ring shard over ranks, one GPU each).
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from distlab.infra.launch import run_ranks
from distlab.metrics import read_summary
from distlab.scratch.collectives import ring_all_reduce
from support.gpu import ALL_GPUS, GPU_MODULE, MULTI_GPU, RTOL, lab_losses

pytestmark = [*GPU_MODULE, MULTI_GPU]


def lab6_fsdp_on_this_gpu() -> dict:
    """Lab 6's ``--fsdp --dtype bf16`` set-up, built as lab 6 builds it (checkpoint,
    shard, then ``prepare``), and one step of 2 micro-batches: what Accelerate kept and
    what FSDP2 reduced."""
    from distlab.accel import check_strategy, make_accelerator
    from distlab.model import GPT, preset
    from distlab.parallel import (
        FSDP_REDUCE_SCATTER,
        apply_activation_checkpointing,
        apply_fsdp,
    )
    from distlab.runtime import dist_env, pick_device

    device = pick_device("cuda", dist_env()[1])
    accelerator = make_accelerator(
        device, "bf16", accum_steps=2, sync_each_batch=False, timeout_s=60.0, fsdp=True
    )
    model = apply_activation_checkpointing(
        GPT(preset("tiny"), seed=0).to(device), "full"
    )
    model = apply_fsdp(model, param_dtype=torch.bfloat16)
    model, optimizer = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    reduced, losses = [[], []], []
    original = getattr(dist, FSDP_REDUCE_SCATTER)

    def counted(*args, **kwargs):  # FSDP2 reduce-scatters the gradients with this call
        # in the micro-batch under way
        tensor = kwargs["input"] if "input" in kwargs else args[1]
        reduced[len(losses)].append(tensor.dtype)
        return original(*args, **kwargs)

    gen = torch.Generator(device).manual_seed(dist.get_rank())
    with mock.patch.object(dist, FSDP_REDUCE_SCATTER, counted):
        # accumulate skips the reduce-scatter until the 2nd micro-batch
        for _ in range(2):
            x = torch.randint(
                0, model.config.vocab_size, (2, 32), device=device, generator=gen
            )
            with accelerator.accumulate(model):
                _, loss = model(x, x)
                accelerator.backward(loss)
            losses.append(loss)
    # the root's; every unit of apply_fsdp has the same
    policy = model._get_fsdp_state()._mp_policy
    return {
        "fsdp2 mode": accelerator.is_fsdp2,
        "strategy": check_strategy(model, accelerator, fsdp=True),
        "policy": (policy.param_dtype, policy.reduce_dtype, policy.output_dtype),
        "loss dtype": losses[0].dtype,
        "reduce-scatters per micro-batch": [len(r) for r in reduced],
        "reduce-scatter dtypes": {d for r in reduced for d in r},
    }


def test_lab_6_fsdp_on_gpus_keeps_lab_5s_precision_policy_in_accelerates_fsdp2_mode():
    ranks = run_ranks(
        lab6_fsdp_on_this_gpu, nprocs=ALL_GPUS, device="cuda", timeout=300, quiet=True
    )
    for got in ranks:
        # Accelerate's own FSDP2 mode, our units
        assert got["fsdp2 mode"] and got["strategy"] == "fsdp2"
        # bf16 compute, fp32 gradient reduction, outputs left as computed: not the bf16
        # everywhere that Accelerate's plugin builds from mixed_precision="bf16" (see
        # the Accelerate chapter)
        assert got["policy"] == (torch.bfloat16, torch.float32, None)
        assert (
            got["reduce-scatter dtypes"] == {torch.float32}
            and got["loss dtype"] == torch.float32
        )
        # root, 2 blocks; none between micro-batches
        assert got["reduce-scatters per micro-batch"] == [0, 3]


def test_lab_6_fsdp_on_every_gpu_trains_like_lab_1(tmp_path):
    lab1 = lab_losses("lab1_single", tmp_path / "lab1", 1, "--dtype", "bf16")
    lab6 = lab_losses(
        "lab6_accelerate", tmp_path / "lab6", ALL_GPUS, "--dtype", "bf16", "--fsdp"
    )
    assert lab6 == pytest.approx(lab1, rel=RTOL["bf16"])
    assert read_summary(tmp_path / "lab6")["strategy"].startswith("accelerate-fsdp2+")


def ring_against_nccl() -> list:
    """The ring from scratch against ``dist.all_reduce`` on this rank's GPU: the cases
    that differ."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    # different data on every rank
    gen = torch.Generator(device).manual_seed(1234 + rank)
    mismatches = []
    for numel in sorted({1, n - 1, n, 2 * n + 1, 1001, 1 << 20} - {0}):
        for dtype in (torch.float32, torch.int64):
            if dtype.is_floating_point:
                x = torch.randn(numel, device=device, generator=gen)
            else:
                x = torch.randint(-1000, 1000, (numel,), device=device, generator=gen)
            expected = x.clone()
            dist.all_reduce(expected)
            ring_all_reduce(x)
            # NCCL adds in an order of its own: float sums agree to rounding, integer
            # sums exactly
            same = (
                torch.allclose(x, expected, rtol=1e-5, atol=1e-5)
                if dtype.is_floating_point
                else x.equal(expected)
            )
            if not same:
                mismatches.append((numel, str(dtype)))
    # not contiguous
    strided = (torch.arange(12.0, device=device).reshape(3, 4) + rank).t()
    expected = strided.clone()
    dist.all_reduce(expected)
    if not ring_all_reduce(strided).equal(expected):
        mismatches.append("non-contiguous")
    return mismatches


@pytest.mark.parametrize(
    "nprocs", sorted({2, max(2, ALL_GPUS)}), ids=lambda n: f"{n}gpus"
)
def test_the_ring_all_reduce_from_scratch_equals_nccls_all_reduce(nprocs):
    """2 ranks is the case where a receive and a send posted apart to the same peer
    deadlock on NCCL: a process-group timeout turns a deadlock into a failure."""
    mismatches = run_ranks(
        ring_against_nccl,
        nprocs=nprocs,
        device="cuda",
        timeout=180,
        pg_timeout=60,
        quiet=True,
    )
    assert mismatches == [[]] * nprocs
