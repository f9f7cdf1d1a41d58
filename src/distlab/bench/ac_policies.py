"""Benchmark checkpointing policies, activation offload and the compiler's memory budget
on a GPU.

    python -m distlab.bench.ac_policies --device cuda --preset gpt2 --batch-size 8 \\
        --budgets 1.0 0.5 0.0
    # CPU, tiny model, 2 steps: what the tests run
    python -m distlab.bench.ac_policies --smoke

One process trains the same batch under each configuration: no checkpointing, full,
saving all matrix products, saving every other one (``chapters.ac_policies``),
``save_on_cpu(pin_memory=True)`` and ``tools.offload.HostOffload`` (the parameters kept
on the GPU). Each gets the bytes still allocated on the device after the forward pass
(activations kept for backward; what offload moves off the GPU is not counted), the peak
allocated during forward and backward (above what was allocated before; gradients
included, optimizer state not), and the median seconds of a training step (forward,
backward, AdamW), the configurations timed in turns. Gradients are compared with no
checkpointing's. With ``--budgets``, the blocks are also compiled (``apply_compile``,
Inductor) once per ``activation_memory_budget`` and timed the same way. Results go to
``--out`` (default ``results/ac_policies_bench.json``) with their provenance; the page
``book/ac_policies.md`` shows them when the file is there. On the CPU the byte columns
are left empty (``torch.cuda`` memory statistics only exist on GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from distlab.bench.provenance import finished, provenance, write_result
from distlab.chapters.ac_policies import checkpointed
from distlab.infra.paths import REPO_ROOT
from distlab.model import preset as model_preset
from distlab.parallel import apply_compile
from distlab.runtime import pick_device, synchronize
from distlab.tools.offload import HostOffload

EAGER = (
    "none",
    "full",
    "save all matmuls",
    "every other matmul",
    "save_on_cpu(pin_memory=True)",
    "HostOffload",
)


def _hooks(name: str, model) -> contextlib.AbstractContextManager:
    if name == "save_on_cpu(pin_memory=True)":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if name == "HostOffload":
        return HostOffload(keep=model.parameters())
    return contextlib.nullcontext()


def budget_backend(budget: float):
    """Inductor with ``activation_memory_budget`` set while it compiles, a backend of
    its own per budget. Dynamo guards each compiled frame on its backend, so each
    budget's blocks get their own graph; with one backend for all and the budget patched
    around the steps, every budget reused the first one's graph (an H100 run kept the
    same bytes at 1.0, 0.5 and 0.0)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(graph, example_inputs):
        # the partitioner reads it now
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(graph, example_inputs)

    return backend


class Config:
    """One model under one configuration, with its optimizer and what was measured
    of it."""

    def __init__(
        self, name: str, preset: str, device: torch.device, budget: float | None = None
    ):
        self.name, self.budget = name, budget
        policy = name if name in EAGER[:4] else "none"
        self.model = checkpointed(preset, policy).to(device)
        if budget is not None:
            # compiled at the first step
            apply_compile(self.model, backend=budget_backend(budget))
        self.initial = {
            k: v.detach().clone() for k, v in self.model.state_dict().items()
        }
        self.restart()
        self.result = {
            "config": name,
            "budget": budget,
            "step_s": [],
            "kept_after_forward": None,
            "peak": None,
        }

    def restart(self) -> None:
        """Back to the initial weights and a fresh optimizer (compiled code is kept: the
        parameters are updated in place, and compiled blocks read them as inputs)."""
        self.model.load_state_dict(self.initial)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, foreach=True
        )

    def step(self, idx, targets, device, measure: bool = False) -> float:
        synchronize(device)
        start = time.perf_counter()
        if measure and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        with _hooks(self.name, self.model):
            loss = self.model(idx, targets)[1]
        if measure and device.type == "cuda":
            self.result["kept_after_forward"] = (
                torch.cuda.memory_allocated(device) - before
            )
        loss.backward()
        if measure:
            if device.type == "cuda":  # before AdamW's first step allocates its state
                self.result["peak"] = torch.cuda.max_memory_allocated(device) - before
            self.result["grads"] = [
                p.grad.detach().clone() for p in self.model.parameters()
            ]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - start


def run(
    preset: str, batch: int, steps: int, warmup: int, device: torch.device, budgets=()
) -> list[dict]:
    cfg = model_preset(preset)
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(
        0, cfg.vocab_size, (2, batch, cfg.block_size), generator=gen
    ).to(device)
    configs = [Config(name, preset, device) for name in EAGER]
    configs += [
        Config(f"compiled, budget {b}", preset, device, budget=b) for b in budgets
    ]
    # first step of each on the same weights: memory and gradients
    for config in configs:
        if config.budget is not None:
            # compiles, so that the measured step does not
            config.step(idx, targets, device)
            config.restart()
        config.step(idx, targets, device, measure=True)
        print(f"{config.name:32} measured", flush=True)
    reference = configs[0].result.pop("grads")
    for config in configs[1:]:
        grads = config.result.pop("grads")
        config.result["grad_max_abs_diff"] = max(
            (g - r).abs().max().item() for g, r in zip(grads, reference)
        )
    # in turns, so that drift in the machine's speed hits all alike
    for step in range(warmup + steps):
        for config in configs:
            seconds = config.step(idx, targets, device)
            if step >= warmup:
                config.result["step_s"].append(seconds)
    configs[0].result["grad_max_abs_diff"] = 0.0
    none_median = statistics.median(configs[0].result["step_s"])
    for config in configs:
        r = config.result
        r["median_step_s"] = statistics.median(r["step_s"])
        r["time_vs_none"] = r["median_step_s"] / none_median
        print(
            f"{r['config']:32} {r['median_step_s']:.4f} s/step "
            f"({r['time_vs_none']:.2f}x)",
            flush=True,
        )
    return [config.result for config in configs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="gpt2", help="model preset (default: gpt2)")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="sequences per step (default: 8)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=10,
        help="timed steps per configuration (default: 10)",
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (default: 3)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda", help="default: cuda"
    )
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=(),
        help="compile and time at these budgets",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny model, 2 steps, no budgets: a quick check",
    )
    parser.add_argument(
        "--out", default=str(REPO_ROOT / "results" / "ac_policies_bench.json")
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.batch_size, args.steps, args.warmup, args.device = (
            "tiny",
            2,
            2,
            0,
            "cpu",
        )
    if min(args.steps, args.batch_size) < 1 or args.warmup < 0:
        parser.error("--steps and --batch-size must be positive, --warmup not negative")
    if any(not 0 <= b <= 1 for b in args.budgets):
        parser.error(f"budgets must lie in [0, 1], got {args.budgets}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda, but torch sees no GPU (use --smoke or --device cpu)"
        )
    device = pick_device(args.device)
    result = {
        "provenance": provenance("distlab.bench.ac_policies", argv, device=args.device),
        "workload": {
            "preset": args.preset,
            "batch": args.batch_size,
            "steps": args.steps,
            "dtype": "float32",
        },
        "runs": run(
            args.preset, args.batch_size, args.steps, args.warmup, device, args.budgets
        ),
    }
    finished(result["provenance"])
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
