"""Record the DataParallel chapter's comparison: five ways to spend the same cores on
the same batches of the `shakespeare` GPT, with each step's loss and time and one
step's phases.

    python -m distlab.bench.dp                      # writes results/dp_bench.json
    python -m distlab.bench.dp --steps 8 --out /tmp/dp.json

The variants, by their names in ``distlab.infra.experiment``: ``single`` (the model
alone); ``dp-scratch`` (``ScratchDataParallel``, 2 replicas in 2 threads);
``dp-scratch-1-intra-op`` (the same with 1 intra-op thread); ``dp-scratch-no-threads``
(the same replicas one after the other); ``ddp`` (torch DDP on 2 ranks). Steps of the
10.8M-parameter model take seconds on a small CPU, so the chapter reads this recording
(with its provenance) instead of timing them on every build; it still trains every
variant live on the `tiny` model and checks the losses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distlab.bench.provenance import provenance, write_result
from distlab.chapters.data_parallel import train_steps
from distlab.chapters.ddp_internals import train_steps as ddp_train_steps
from distlab.infra.experiment import WARMUP_STEPS
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT
from distlab.scratch.data_parallel import Span

DEFAULT_OUT = REPO_ROOT / "results" / "dp_bench.json"
# ranks of the ddp run; the launcher shares the cores out among them (lab 2's set-up)
DDP_RANKS = 2


def compare(preset_name: str, steps: int, global_batch: int) -> dict[str, dict]:
    """Each variant's losses, step seconds and the spans of its last step."""
    workload = dict(preset_name=preset_name, steps=steps, global_batch=global_batch)
    runs = {
        strategy: train_steps(strategy, **workload)
        for strategy in (
            "single",
            "dp-scratch",
            "dp-scratch-1-intra-op",
            "dp-scratch-no-threads",
        )
    }
    ddp = run_ranks(
        ddp_train_steps,
        nprocs=DDP_RANKS,
        timeout=1800,
        quiet=True,
        args=("ddp", preset_name, steps, global_batch),
    )
    runs["ddp"] = {
        "losses": ddp[0]["losses"],
        "spans": [],
        "step_s": [max(s) for s in zip(*(r["step_s"] for r in ddp))],
    }  # the slower rank
    return {
        name: {
            "losses": r["losses"],
            "step_s": r["step_s"],
            "spans": [[s.lane, s.phase, s.start, s.end] for s in r["spans"]],
        }
        for name, r in runs.items()
    }


def load(path=DEFAULT_OUT) -> tuple[dict, dict, dict[str, dict]]:
    """(provenance, workload, runs) of a recording; each run's spans as
    ``Span`` objects."""
    result = json.loads(Path(path).read_text())
    runs = {
        name: {**r, "spans": [Span(*s) for s in r["spans"]]}
        for name, r in result["runs"].items()
    }
    return result["provenance"], result["workload"], runs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.bench.dp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset", default="shakespeare", help="model preset (default: shakespeare)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=8,
        help=f"steps per variant; the first {WARMUP_STEPS} are not timed (default: 8)",
    )
    parser.add_argument(
        "--global-batch", type=int, default=8, help="sequences per step (default: 8)"
    )
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="result file (default: results/dp_bench.json)",
    )
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(
            f"--steps must be more than the {WARMUP_STEPS} untimed warm-up steps"
        )
    if args.global_batch < 2 or args.global_batch % 2:
        parser.error("--global-batch must be even: 2 replicas and 2 ranks split it")
    result = {
        "provenance": provenance("distlab.bench.dp", argv),
        "workload": {
            "preset": args.preset,
            "steps": args.steps,
            "global_batch": args.global_batch,
            "warmup_steps": WARMUP_STEPS,
        },
        "runs": compare(args.preset, args.steps, args.global_batch),
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
