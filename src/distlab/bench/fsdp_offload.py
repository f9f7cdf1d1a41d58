"""Benchmark FSDP2's CPUOffloadPolicy on a GPU: step time and peak GPU memory, with and
without it.

    # on a GPU: gpt2 preset, bf16 and fp32
    python -m distlab.bench.fsdp_offload
    # a smoke run, seconds
    python -m distlab.bench.fsdp_offload --device cpu --out /tmp/smoke.json

One process joins a process group of one (NCCL on a GPU, gloo on the CPU; an in-memory
store, no port: ``distlab.runtime.init_distributed``), without torchrun, and trains the
preset's GPT under ``fully_shard`` (``distlab.parallel.apply_fsdp``: each block, then
the root) for each dtype (``bf16``: ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``; ``fp32``), without offloading and with
``CPUOffloadPolicy(pin_memory=True)``, one variant at a time (pinning needs an
accelerator: the CPU smoke run uses ``pin_memory=False``). With one rank nothing is
sharded, so without offload the GPU holds the whole model state, and with it the GPU
holds only the gathered units and activations: the H2D copies of the shards before every
all-gather, the D2H copies of the gradients and AdamW on the CPU are what a step pays
for that. Each variant reports the median step time (after ``--warmup`` steps), the peak
GPU memory of the timed steps (``torch.cuda.max_memory_allocated``), the GPU memory held
between steps (after ``zero_grad(set_to_none=True)``: parameters and optimizer state, no
gradients), and its losses. Results go to ``--out`` (default on a GPU
``results/fsdp_offload_bench.json``; the CPU run writes only where ``--out`` says) with
their provenance; ``book/fsdp_prefetch_offload.md`` reads the GPU result."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from distlab.bench.provenance import finished, provenance, write_result
from distlab.data import token_data
from distlab.infra.paths import REPO_ROOT
from distlab.model import GPT, parameter_formula, preset
from distlab.parallel import apply_fsdp
from distlab.runtime import init_distributed, pick_device, synchronize

DTYPES = {"bf16": torch.bfloat16, "fp32": None}


def build(preset_name: str, dtype: str, offload: bool, device: torch.device):
    """The GPT sharded block by block, then the root, on a mesh of this one rank;
    its AdamW."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    # pinned host memory needs an accelerator to pin for
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else None
    # built on the CPU: with offload the shards stay there; without, fully_shard moves
    # them to the mesh's device
    model = GPT(preset(preset_name, vocab_size=token_data().vocab_size))
    model = apply_fsdp(
        model, param_dtype=DTYPES[dtype], device=device, offload_policy=policy
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def gpu_bytes(device: torch.device, peak: bool = False) -> int | None:
    if device.type != "cuda":
        return None
    return (
        torch.cuda.max_memory_allocated(device)
        if peak
        else torch.cuda.memory_allocated(device)
    )


def run(
    preset_name: str,
    dtypes: list[str],
    batch: int,
    steps: int,
    warmup: int,
    device: torch.device,
) -> list[dict]:
    """Each variant alone on the device, one after the other: ``max_memory_allocated``
    counts every tensor on the GPU, so a variant's peak must not include another
    variant's model state."""
    import gc

    cfg, rows = preset(preset_name), []
    batches = [
        token_data().batch("train", step, batch, cfg.block_size, 0, 0, 1, device)
        for step in range(warmup + steps)
    ]
    for dtype in dtypes:
        for offload in (False, True):
            model, optimizer = build(preset_name, dtype, offload, device)
            row = {
                "dtype": dtype,
                "offload": offload,
                "step_s": [],
                "losses": [],
                "peak_gpu_bytes": None,
            }
            for step, (x, y) in enumerate(batches):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                synchronize(device)
                start = time.perf_counter()
                loss = model(x, y)[1]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                synchronize(device)
                elapsed = time.perf_counter() - start
                row["losses"].append(loss.item())
                if step >= warmup:
                    row["step_s"].append(elapsed)
                    peak = gpu_bytes(device, peak=True)
                    row["peak_gpu_bytes"] = (
                        None if peak is None else max(row["peak_gpu_bytes"] or 0, peak)
                    )
            # read after zero_grad(set_to_none=True): no gradients are left, only
            # the fp32 parameters and AdamW's two moments (12 bytes a parameter)
            # when they live on the GPU
            row["gpu_bytes_between_steps"] = gpu_bytes(device)
            row["step_s_median"] = statistics.median(row["step_s"])
            rows.append(row)
            del model, optimizer, loss
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.bench.fsdp_offload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device", default="auto", help="auto, cuda or cpu (a smoke run)"
    )
    parser.add_argument(
        "--preset",
        default=None,
        help="model preset (default: gpt2 on a GPU, tiny on the CPU)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        choices=list(DTYPES),
        help="default: bf16 fp32 (fp32 on CPU)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per step (default: 8 on a GPU, 2 on CPU)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps (default: 10 on a GPU, 2 on CPU)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--out",
        default=None,
        help="result file (default on a GPU: results/fsdp_offload_bench.json)",
    )
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    gpu = device.type == "cuda"
    out = args.out or (
        REPO_ROOT / "results" / "fsdp_offload_bench.json" if gpu else None
    )
    prov = provenance("distlab.bench.fsdp_offload", argv, args.device)
    # a group of one, no torchrun: FSDP2 needs a group and a mesh
    init_distributed(device, timeout_s=300)
    try:
        settings = {
            "preset": args.preset or ("gpt2" if gpu else "tiny"),
            "dtypes": args.dtypes or (["bf16", "fp32"] if gpu else ["fp32"]),
            "batch_size": args.batch_size or (8 if gpu else 2),
            "steps": args.steps or (10 if gpu else 2),
            "warmup": args.warmup if gpu else min(args.warmup, 1),
        }
        settings["parameters"] = parameter_formula(
            preset(settings["preset"], vocab_size=token_data().vocab_size)
        )
        rows = run(
            settings["preset"],
            settings["dtypes"],
            settings["batch_size"],
            settings["steps"],
            settings["warmup"],
            device,
        )
    finally:
        dist.destroy_process_group()
    for row in rows:
        peak = (
            ""
            if row["peak_gpu_bytes"] is None
            else f"  peak GPU {row['peak_gpu_bytes'] / 2**30:6.2f} GiB"
        )
        print(
            f"{row['dtype']:5} offload={row['offload']!s:5}  step "
            f"{1e3 * row['step_s_median']:8.1f} ms{peak}"
        )
    result = {"settings": settings, "runs": rows, "provenance": finished(prov)}
    if out is not None:
        write_result(result, out)
    return result


if __name__ == "__main__":
    main()
