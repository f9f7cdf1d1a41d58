"""FSDP2 with CPU offload on 2+ GPUs: the gradients are CPU DTensors, so the labs'
clipping all-reduces a CPU norm. The process group ``runtime.init_distributed`` builds
on GPUs has gloo for CPU tensors beside NCCL (``runtime.group_backend``), so it runs;
an NCCL-only group stops with "No backend type associated with device type cpu"
(review gpu.md #7)."""

import math

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from distlab.infra.launch import run_ranks
from support.gpu import ALL_GPUS, GPU_MODULE, MULTI_GPU

pytestmark = [*GPU_MODULE, MULTI_GPU]


def offloaded_step_norm() -> float:
    from distlab.model import GPT, preset
    from distlab.parallel import apply_fsdp
    from distlab.runtime import dist_env, pick_device

    device = pick_device("cuda", dist_env()[1])
    torch.manual_seed(0)
    model = GPT(preset("tiny")).to(device)
    model = apply_fsdp(model, device=device, offload_policy=CPUOffloadPolicy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, preset("tiny").vocab_size, (2, 32), device=device)
    _, loss = model(x, x)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def test_clipping_cpu_offloaded_gradients_runs_on_every_gpu():
    norms = run_ranks(
        offloaded_step_norm, nprocs=ALL_GPUS, device="cuda", timeout=300, quiet=True
    )
    assert all(math.isfinite(n) and n > 0 for n in norms)
    assert max(norms) - min(norms) <= 1e-6 * max(norms)  # one norm, every rank
