"""FSDP2 eager against FSDP2 with each block compiled (Inductor): step time, compile
time, peak memory and losses, in the checkpoint-compile-shard order of
book/fsdp_compile.md.

    # a GPU: shakespeare, bf16 autocast, 200 steps
    python -m distlab.bench.fsdp_compile
    python -m distlab.bench.fsdp_compile --device cpu --preset tiny --steps 3 \
        --dtype fp32 --backend aot_eager

One process, FSDP2 on a group of one (NCCL on a GPU, gloo on the CPU; a ``HashStore``
group needs no port, see ``distlab.runtime.init_distributed``). Both variants build the
same GPT (same seed), checkpoint every block (``--ac``), then the compiled one compiles
each block (``distlab.parallel.apply_compile``), then both are sharded (``apply_fsdp``)
and trained on the same batches with fused AdamW under autocast (``--dtype bf16``).
Compile time is the first step's seconds less the median step's: Dynamo traces and
Inductor generates code at the first call. Results go to ``--out`` (default
``results/fsdp_compile_bench.json``) with their provenance.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch
import torch.distributed as dist

from distlab.bench.provenance import finished, provenance, write_result
from distlab.data import token_data
from distlab.infra.paths import RESULTS_DIR
from distlab.model import GPT, preset
from distlab.parallel import apply_activation_checkpointing, apply_compile, apply_fsdp
from distlab.runtime import init_distributed, synchronize

# steps left out of the median: the first compiles, the next ones settle the allocator
WARMUP = 3


def train(compiled: bool, args, device: torch.device) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gc.collect()  # the previous variant's model and optimizer, before the peak is reset
    data = token_data()
    model = GPT(preset(args.preset, vocab_size=data.vocab_size), seed=1337).to(device)
    apply_activation_checkpointing(model, args.ac)
    if compiled:
        # after checkpointing, before sharding
        apply_compile(model, backend=args.backend)
    apply_fsdp(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.dtype == "bf16"
        else contextlib.nullcontext()
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    block, losses, step_s = model.config.block_size, [], []
    for step in range(args.steps):
        x, y = data.batch("train", step, args.batch_size, block, seed=0, device=device)
        synchronize(device)
        start = time.perf_counter()
        with autocast:
            loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % 50 == 0:
            print(
                f"{'compiled' if compiled else 'eager'} step {step} loss "
                f"{losses[-1]:.4f} {step_s[-1]:.3f} s",
                flush=True,
            )
    median = statistics.median(
        step_s[WARMUP:] if len(step_s) > WARMUP else step_s[1:] or step_s
    )
    return {
        "variant": f"compiled ({args.backend})" if compiled else "eager",
        "losses": losses,
        "first_step_s": step_s[0],
        "median_step_s": median,
        # eager's first step only warms up
        "compile_s": step_s[0] - median if compiled else None,
        "tokens_per_s": args.batch_size * block / median,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def compare(eager: dict, compiled: dict) -> dict:
    """How far the compiled run's losses are from eager's, and the speed and
    memory ratios."""
    diffs = [abs(a - b) for a, b in zip(eager["losses"], compiled["losses"])]
    peaks = eager["peak_allocated_bytes"], compiled["peak_allocated_bytes"]
    return {
        "loss_max_abs_diff": max(diffs),
        "final_loss_abs_diff": diffs[-1],
        "speedup": eager["median_step_s"] / compiled["median_step_s"],
        "peak_ratio": peaks[1] / peaks[0] if None not in peaks else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="shakespeare")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ac", default="full", choices=("none", "full", "selective"))
    # bf16: autocast
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=str(RESULTS_DIR / "fsdp_compile_bench.json"))
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(
            "--steps must be 2 or more: the first step compiles, the others are timed"
        )
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(
                "--device cuda needs a GPU; use --device cpu for the smoke run"
            )
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # a test's rank has joined a group already
        init_distributed(device)
    prov = provenance("distlab.bench.fsdp_compile", argv, device=args.device)
    prov["settings"] = vars(args)
    eager, compiled = train(False, args, device), train(True, args, device)
    result = {
        "provenance": finished(prov),
        "runs": [eager, compiled],
        "comparison": compare(eager, compiled),
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
