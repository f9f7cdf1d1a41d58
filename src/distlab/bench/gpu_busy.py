"""How much of a training step the GPU spends running kernels: the union of the
kernels' time intervals in a profiled window of steps, over the same steps' time
measured without the profiler.

    python -m distlab.bench.gpu_busy                     # shakespeare, 10 steps
    python -m distlab.bench.gpu_busy --preset gpt2 --batch-size 16

A step whose GPU is busy a small share of the time is bound by the host (Python, kernel
launches, hooks, the optimizer's loop), not by its matrix products: making the kernels
faster (torch.compile's fusion, a faster GPU) cannot shorten it much. The step is the
one of ``distlab.bench.fsdp_compile`` (the GPT, every block checkpointed, FSDP2 on a
group of one, fused AdamW, bf16 autocast), eager and with each block compiled. It
counts the step's FLOP (``distlab.flops``: 6 per parameter and token, 8 with full
checkpointing) to give the achieved TFLOP/s beside the busy share. Results go to
``--out`` (default ``results/gpu_busy.json``) with their provenance.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from distlab.bench.provenance import finished, provenance, write_result
from distlab.data import token_data
from distlab.infra.paths import RESULTS_DIR
from distlab.model import GPT, preset
from distlab.parallel import apply_activation_checkpointing, apply_compile, apply_fsdp
from distlab.runtime import init_distributed, synchronize

WARMUP = 5  # the first compiles; the next settle the allocator


def busy_us(events) -> float:
    """Microseconds during which at least one GPU kernel ran (overlaps counted once)."""
    return union_us(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA
    )


def union_us(spans) -> float:
    """The length of the union of (start, end) spans: overlaps counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(s for s in spans if s[1] > s[0]):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def measure(compiled: bool, args, device: torch.device) -> dict:
    torch._dynamo.reset()
    data = token_data()
    model = GPT(preset(args.preset, vocab_size=data.vocab_size), seed=1337).to(device)
    apply_activation_checkpointing(model, args.ac)
    if compiled:
        apply_compile(model)
    apply_fsdp(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    block = model.config.block_size

    def step(i: int) -> None:
        x, y = data.batch("train", i, args.batch_size, block, seed=0, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(WARMUP):
        step(i)
    # the step's time unprofiled (the profiler's CPU-side bookkeeping slows the host),
    # the kernels' time profiled (a kernel runs as long either way)
    synchronize(device)
    start = time.perf_counter()
    for i in range(WARMUP, WARMUP + args.steps):
        step(i)
    synchronize(device)
    wall_s = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(WARMUP, WARMUP + args.steps):
            step(i)
        synchronize(device)
    busy_s = busy_us(prof.events()) / 1e6
    params = sum(p.numel() for p in model.parameters())
    flop_per_token = (8 if args.ac == "full" else 6) * params
    tokens = args.steps * args.batch_size * block
    return {
        "variant": "compiled (inductor)" if compiled else "eager",
        "params": params,
        "step_s": wall_s / args.steps,
        "gpu_busy_s_per_step": busy_s / args.steps,
        "gpu_busy_share": busy_s / wall_s,
        "achieved_tflops": flop_per_token * tokens / wall_s / 1e12,
        "flop_per_token": flop_per_token,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="shakespeare")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps")
    parser.add_argument("--ac", default="full", choices=("none", "full", "selective"))
    parser.add_argument("--out", default=str(RESULTS_DIR / "gpu_busy.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU: it measures the GPU's busy share of a step")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        init_distributed(device)
    prov = provenance("distlab.bench.gpu_busy", argv, device="cuda")
    prov["settings"] = vars(args)
    runs = [measure(False, args, device), measure(True, args, device)]
    for run in runs:
        print(
            f"{args.preset} {run['variant']:20s} {run['step_s'] * 1e3:7.1f} ms/step "
            f"GPU busy {run['gpu_busy_share']:.0%} "
            f"{run['achieved_tflops']:.1f} TFLOP/s",
            flush=True,
        )
    result = {"provenance": finished(prov), "runs": runs}
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
