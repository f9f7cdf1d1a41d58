"""float8 training and FSDP2's float8 all-gather (torchao, as torchtitan uses them)
against bf16: the bytes each all-gather moves, the precision of one matmul, losses, step
time and peak memory.

    # a GPU of compute capability 8.9+
    python -m distlab.bench.float8 --preset gpt2 --batch-size 8 --steps 300

GPU only: float8 matmuls (``torch._scaled_mm``) need compute capability 8.9 or newer
(Ada, Hopper, Blackwell; ``PLATFORM_SUPPORTS_FP8`` in torch's ``common_cuda.py`` is
``SM90OrLater or == (8, 9)``), and torchao (not a dependency of the book: install it
beside your torch). One process, FSDP2 on a group of one. Both runs are the labs'
FSDP2 recipe (``apply_compile``, then ``apply_fsdp`` with bf16 parameters and fp32
reduction); the float8 run first swaps every ``nn.Linear`` whose two dims divide by 16
for torchao's ``Float8Linear`` (tensorwise scaling), with
``enable_fsdp_float8_all_gather`` and, after each optimizer step,
``precompute_float8_dynamic_scale_for_fsdp``.

The bytes: with one rank FSDP2 skips the collective itself (``world_size == 1`` in
``_fsdp_param_group.py``), so they are read where FSDP2 builds each all-gather's input,
``FSDPParam.all_gather_inputs``: the tensors every rank contributes, whatever the world
size (per rank, N ranks send (N-1)/N of N times this on a ring). Results go to ``--out``
(default ``results/float8_bench.json``) with their provenance.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from distlab.bench.provenance import finished, provenance, write_result
from distlab.data import token_data
from distlab.errors import UserError
from distlab.infra.paths import RESULTS_DIR
from distlab.model import GPT, preset
from distlab.parallel import apply_compile, apply_fsdp
from distlab.runtime import init_distributed, synchronize

WARMUP = 10  # steps left out of the timing: compilation happens in the first


def require_float8_gpu() -> None:
    if not torch.cuda.is_available():
        raise UserError(
            "float8 training needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    if (capability := torch.cuda.get_device_capability()) < (8, 9):
        raise UserError(
            f"float8 matmuls need compute capability 8.9+; this GPU has {capability}"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise UserError(
            f"float8 training here uses torchao: pip install torchao ({error})"
        ) from error


def float8_able(module: nn.Module, fqn: str) -> bool:
    """torchao's float8 matmul needs both dims divisible by 16: the 65-character head
    is not."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def build(
    variant: str, model_preset: str, vocab_size: int, device: torch.device
) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = GPT(preset(model_preset, vocab_size=vocab_size)).to(device)
    if variant == "float8":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, module_filter_fn=float8_able, config=config)
    return model


def all_gather_input_bytes(model: nn.Module) -> dict[str, int]:
    """The bytes of each all-gather input FSDP2 builds, by dtype, summed over
    every unit."""
    by_dtype: dict[str, int] = {}
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        for param in group.fsdp_params if group else ():
            for t in param.all_gather_inputs:
                key = str(t.dtype).removeprefix("torch.")
                by_dtype[key] = by_dtype.get(key, 0) + t.numel() * t.element_size()
    return by_dtype


def train(variant: str, args, device: torch.device) -> dict:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    data = token_data()
    model = build(variant, args.preset, data.vocab_size, device)
    float8_linears = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if args.compile:
        apply_compile(model)
    apply_fsdp(model, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=True
    )
    block = model.config.block_size
    torch.cuda.reset_peak_memory_stats(device)
    losses, step_s = [], []
    for step in range(WARMUP + args.steps):
        x, y = data.batch("train", step, args.batch_size, block, seed=0, device=device)
        synchronize(device)
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if variant == "float8":
            # one all-reduce of every weight's amax
            precompute_float8_dynamic_scale_for_fsdp(model)
        synchronize(device)
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
        # FSDP2 sets each parameter's dtypes at the first forward; after backward all
        # are sharded
        if step == 0:
            gathered = all_gather_input_bytes(model)
        if step % 50 == 0:
            print(
                f"{variant} step {step} loss {losses[-1]:.4f} "
                f"{1000 * step_s[-1]:.1f} ms",
                flush=True,
            )
    model.eval()
    with torch.no_grad():
        val = [
            model(*data.batch("val", s, args.batch_size, block, seed=1, device=device))[
                1
            ].item()
            for s in range(20)
        ]
    return {
        "variant": variant,
        "float8_linears": float8_linears,
        "losses": losses,
        "val_loss": statistics.mean(val),
        "step_ms_median": 1000 * statistics.median(step_s[WARMUP:]),
        "tokens_per_s": args.batch_size * block / statistics.median(step_s[WARMUP:]),
        "first_step_s": step_s[0],
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "all_gather_input_bytes": gathered,
        "all_gather_input_total": sum(gathered.values()),
    }


def matmul_error(
    device: torch.device, m: int = 8192, k: int = 768, n: int = 3072
) -> dict:
    """Relative error of one linear's output, float8 and bf16, against the
    fp32 product."""
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False, device=device)
    x = torch.randn(m, k, device=device)
    reference = x @ linear.weight.T

    def rel(out):
        return ((out.float() - reference).norm() / reference.norm()).item()

    with torch.no_grad():
        bf16 = rel(x.bfloat16() @ linear.weight.bfloat16().T)
        wrapped = convert_to_float8_training(nn.Sequential(linear))
        float8 = rel(wrapped(x.bfloat16()))
    return {"shape": [m, k, n], "bf16_rel_error": bf16, "float8_rel_error": float8}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out", default=str(RESULTS_DIR / "float8_bench.json"))
    args = parser.parse_args(argv)
    require_float8_gpu()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_distributed(device)
    prov = provenance("distlab.bench.float8", argv, device="cuda")
    import torchao

    prov["torchao"] = torchao.__version__
    result = {"provenance": prov, "matmul": matmul_error(device)}
    result["runs"] = [train(variant, args, device) for variant in ("bf16", "float8")]
    result["provenance"] = finished(prov)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
