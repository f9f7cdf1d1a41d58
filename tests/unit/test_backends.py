"""Which backends a process group gets (``runtime.group_backend``), and Accelerate's
check of the backend it chose (``accel.check_processes``)."""

from types import SimpleNamespace

import pytest
import torch

from distlab.accel import check_processes
from distlab.errors import UserError
from distlab.runtime import backend_for, group_backend


def test_on_gpus_the_group_has_gloo_for_cpu_tensors_too():
    """FSDP2 with CPUOffloadPolicy keeps gradients on the CPU: clipping all-reduces a
    CPU norm, which an NCCL-only group cannot (review gpu.md #7)."""
    assert group_backend(torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert group_backend(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"


def accelerator(backend: str, device: str = "cuda"):
    return SimpleNamespace(
        num_processes=2,
        distributed_type="MULTI_GPU",
        device=torch.device(device),
        state=SimpleNamespace(backend=backend),
    )


def test_accelerates_per_device_backend_string_is_accepted(monkeypatch):
    """Accelerate picks "cuda:nccl,cpu:gloo" when FSDP offloads (review gpu.md #9):
    it names NCCL for the GPU, so it is not refused."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_processes(accelerator("nccl"))
    check_processes(accelerator("cuda:nccl,cpu:gloo"))
    with pytest.raises(UserError, match="Accelerate chose the gloo backend"):
        check_processes(accelerator("gloo"))
    check_processes(accelerator("gloo", "cpu"))


def test_srun_tasks_started_without_torchrun_are_refused(monkeypatch):
    """``srun -n8 python lab2...`` starts 8 runs of one that all write one --out
    (review gpu.md #23); under torchrun (RANK set) the same SLURM step is fine."""
    from distlab.runtime import dist_env

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    with pytest.raises(UserError, match="srun started 8 tasks of this script"):
        dist_env()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert dist_env()[0] == 3
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert dist_env()[0] == 0  # one task: no refusal
