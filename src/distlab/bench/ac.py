"""Benchmark activation checkpointing: bytes kept for backward, peak, and step time,
per policy.

    python -m distlab.bench.ac --preset shakespeare --batch-size 16 --steps 5 --nprocs 2
    # on a GPU: models, data and lab 5 there
    python -m distlab.bench.ac --device cuda --nprocs 1

One process trains the same batch under each policy (none, full on every 3rd and every
2nd block, full, selective); each gets its saved-activation bytes and peak from
PyTorch's memory tracker and the median seconds of a training step (forward, backward,
AdamW), the policies timed in turns so that drift in the machine's speed hits all of
them alike. Their gradients are compared with the uncheckpointed model's. Then lab 5
(FSDP2) runs on ``--nprocs`` ranks with ``--ac none``, ``full`` and ``selective`` for
tokens/s and losses. Results go to ``--out`` (default ``results/ac_bench.json``) with
their provenance; the activation checkpointing chapter reads that file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from distlab.bench.provenance import finished, provenance, write_result
from distlab.chapters.activation_checkpointing import (
    activation_memory,
    build,
    gradients,
)
from distlab.infra.experiment import WARMUP_STEPS
from distlab.infra.launch import run_script
from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_metrics, read_summary
from distlab.model import preset as model_preset
from distlab.runtime import pick_device, synchronize

# (label, mode, every): the points of the memory/time curve
POLICIES = [
    ("none", "none", 1),
    ("full, every 3rd block", "full", 3),
    ("full, every 2nd block", "full", 2),
    ("full", "full", 1),
    ("selective", "selective", 1),
]


def single_process(
    preset: str,
    batch: int,
    steps: int,
    warmup: int = WARMUP_STEPS,
    device: torch.device | str = "cpu",
) -> list[dict]:
    device = torch.device(device)
    cfg = model_preset(preset)  # the config only: no model needs building for it
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(
        0, cfg.vocab_size, (2, batch, cfg.block_size), generator=gen
    ).to(device)
    # gradients compared on 2 sequences: the same code path, less time
    small = idx[:2], targets[:2]
    reference = gradients(build(preset).to(device), *small)
    runs, models, optimizers = [], [], []
    for label, mode, every in POLICIES:
        model = build(preset, mode, every).to(device)
        grads = gradients(model, *small)
        diff = max((g - r).abs().max().item() for g, r in zip(grads, reference))
        runs.append(
            {
                "policy": label,
                "mode": mode,
                "every": every,
                "grad_max_abs_diff": diff,
                **activation_memory(model, idx, targets),
                "step_s": [],
            }
        )
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
        print(
            f"{label:24} saved {runs[-1]['saved'] / 1e6:8.1f} MB  peak "
            f"{runs[-1]['peak'] / 1e6:8.1f} MB  "
            f"gradient difference {diff:.1e}",
            flush=True,
        )
    for step in range(warmup + steps):  # in turns: one step of each policy per round
        for run, model, optimizer in zip(runs, models, optimizers):
            start = time.perf_counter()
            model(idx, targets)[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)  # on a GPU, until the step is done, not just queued
            if step >= warmup:
                run["step_s"].append(time.perf_counter() - start)
    none = runs[0]
    for run in runs:
        run["median_step_s"] = statistics.median(run["step_s"])
        run["saved_vs_none"] = run["saved"] / none["saved"]
        run["peak_vs_none"] = run["peak"] / none["peak"]
        run["time_vs_none"] = run["median_step_s"] / statistics.median(none["step_s"])
        print(
            f"{run['policy']:24} {run['median_step_s']:6.2f} s/step  saved "
            f"{run['saved_vs_none']:.3f}x  "
            f"time {run['time_vs_none']:.3f}x",
            flush=True,
        )
    return runs


def with_fsdp2(
    preset: str, batch: int, steps: int, nprocs: int, device: str = "cpu"
) -> list[dict]:
    runs = []
    for mode in ("none", "full", "selective"):
        out = Path(tempfile.mkdtemp(prefix=f"bench-ac-{mode}-"))
        run_script(
            "src/labs/lab5_activation_ckpt.py",
            [
                "--preset",
                preset,
                "--steps",
                steps,
                "--batch-size",
                batch,
                "--micro-batch-size",
                batch // nprocs,
                "--ac",
                mode,
                "--eval-batches",
                1,
                "--sample-chars",
                0,
                "--no-progress",
                "--device",
                device,
                "--out",
                out,
            ],
            nprocs=nprocs,
            timeout=3600,
            device=device,
            quiet=True,
        )
        metrics, summary = read_metrics(out), read_summary(out)
        # the lab's own step timing, warm-up left out
        step_s = [m["step_s"] for m in metrics][WARMUP_STEPS:]
        runs.append(
            {
                "mode": mode,
                "world_size": nprocs,
                "step_s": step_s,
                "losses": [m["loss"] for m in metrics],
                "tokens_per_s": summary["tokens_per_step"] / statistics.median(step_s),
            }
        )
        print(
            f"lab 5, FSDP2 on {nprocs} ranks, --ac {mode:9} "
            f"{runs[-1]['tokens_per_s']:8,.0f} tokens/s "
            f"(median of {len(step_s)} steps)",
            flush=True,
        )
    return runs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", default="shakespeare", help="model preset (default: shakespeare)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences per step (default: 16)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=5,
        help=f"timed steps per policy, after {WARMUP_STEPS} untimed (default: 5)",
    )
    parser.add_argument(
        "--fsdp2-steps",
        type=int,
        default=10,
        help=f"timed steps of each lab 5 run, after {WARMUP_STEPS} untimed",
    )
    parser.add_argument(
        "--nprocs",
        type=int,
        default=2,
        help="ranks for the FSDP2 runs of lab 5 (0: skip them)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where models and lab 5 run (default: cpu)",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "ac_bench.json"))
    args = parser.parse_args(argv)
    if min(args.steps, args.fsdp2_steps, args.batch_size) < 1:
        parser.error("--steps, --fsdp2-steps and --batch-size must be positive")
    if args.nprocs and args.batch_size % args.nprocs:
        parser.error(
            f"--batch-size {args.batch_size} must be a multiple of --nprocs "
            f"{args.nprocs}"
        )

    result = {
        # before the first run: the code that runs
        "provenance": provenance("distlab.bench.ac", argv),
        "workload": {
            "preset": args.preset,
            "batch": args.batch_size,
            "steps": args.steps,
        },
        "single_process": single_process(
            args.preset, args.batch_size, args.steps, device=pick_device(args.device)
        ),
    }
    if args.nprocs:
        steps = args.fsdp2_steps + WARMUP_STEPS
        result["fsdp2"] = with_fsdp2(
            args.preset, args.batch_size, steps, args.nprocs, args.device
        )
    finished(result["provenance"])  # the end time and the load average then
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
