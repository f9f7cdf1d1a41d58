"""When a GPU's backward completes each gradient of GPT-2 small, which the step model
of book/ddp_scaling.md estimates from FLOPs (``step_model.backward_done``).

    python -m distlab.bench.backward_ready --batch-size 8 --repeats 5

A hook on each parameter records a CUDA event when its gradient is complete: its time
from backward's start over the time to the last one is the fraction of backward."""

from __future__ import annotations

import argparse
import hashlib
import statistics
from pathlib import Path

import torch

from distlab.bench.provenance import finished, provenance, write_result
from distlab.errors import UserError
from distlab.infra.paths import RESULTS_DIR
from distlab.model import GPT, preset


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ready_times(model: GPT, tokens: torch.Tensor, repeats: int) -> list[dict]:
    """Per backward (2 warm up), ms from its start to each gradient."""
    events = {}

    def hook(name: str):
        def record(_):
            events[name] = torch.cuda.Event(enable_timing=True)
            events[name].record()

        return record

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(hook(name))
    runs, start = [], torch.cuda.Event(enable_timing=True)
    for _ in range(2 + repeats):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(tokens, tokens)[1]
        start.record()
        loss.backward()
        torch.cuda.synchronize()
        runs.append({n: start.elapsed_time(e) for n, e in events.items()})
    return runs[2:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)  # sequences of 1,024
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=RESULTS_DIR / "backward_ready_bench.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise UserError("backward_ready needs a CUDA GPU")
    prov = provenance("distlab.bench.backward_ready", argv, device="cuda")
    cfg = preset("gpt2", vocab_size=50257)
    shape = (args.batch_size, cfg.block_size)
    tokens = torch.randint(0, cfg.vocab_size, shape, device="cuda")
    runs = ready_times(GPT(cfg).cuda(), tokens, args.repeats)
    totals = [max(run.values()) for run in runs]
    result = {
        "workload": {"vocab_size": 50257, "batch": shape, "repeats": args.repeats},
        "backward_ms": {"repeats": totals, **spread(totals)},
        # parameter -> the fraction of backward done when its gradient is complete
        "ready_fraction": {
            n: spread([run[n] / t for run, t in zip(runs, totals)]) for n in runs[0]
        },
        "script_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    write_result({**result, "provenance": finished(prov)}, args.out)


if __name__ == "__main__":
    main()
