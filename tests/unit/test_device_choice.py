"""Which device a run gets: the CPU pin of the book and the tests, one GPU per local
rank, a loud fallback when a GPU is there but unusable, and the TF32 switch. CUDA is
faked: what is checked is the decision, which depends only on what torch reports."""

import os
import warnings

import pytest
import torch

from distlab import runtime
from distlab.errors import UserError
from distlab.runtime import pick_device, tf32_enabled, use_tf32


@pytest.fixture
def cuda_reported(monkeypatch):
    """torch says it has 8 GPUs; set_device records its argument instead of
    touching one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


@pytest.fixture
def unpinned(monkeypatch):
    """As on a reader's GPU machine: no pin, GPUs not hidden, no warning given yet."""
    monkeypatch.delenv("DISTLAB_DEVICE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(runtime, "_warned_gpu_unusable", False)


def test_the_suite_runs_pinned_to_the_cpu():
    # tests/conftest.py, for every run that does not select `-m gpu`
    assert (os.environ["DISTLAB_DEVICE"], os.environ["CUDA_VISIBLE_DEVICES"]) == (
        "cpu",
        "",
    )


def test_the_pin_makes_auto_the_cpu_where_cuda_is_reported(cuda_reported, monkeypatch):
    monkeypatch.setenv("DISTLAB_DEVICE", "cpu")
    assert pick_device("auto", 3) == torch.device("cpu")
    assert cuda_reported == []  # no GPU was selected


def test_without_the_pin_auto_takes_the_gpu_of_its_local_rank(cuda_reported, unpinned):
    assert pick_device("auto", 3) == torch.device("cuda", 3)
    assert cuda_reported == [3]


def test_the_pin_takes_only_cpu(monkeypatch):
    monkeypatch.setenv("DISTLAB_DEVICE", "gpu")
    with pytest.raises(
        UserError, match="DISTLAB_DEVICE='gpu': the only value it takes is 'cpu'"
    ):
        pick_device("auto")


def test_a_local_rank_without_a_gpu_is_refused_in_one_line_before_set_device(
    cuda_reported, monkeypatch
):
    # SLURM's one GPU per task: all see cuda:0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError) as info:
        pick_device("cuda", 1)
    message = str(info.value)
    assert message.startswith(
        "LOCAL_RANK 1 but this process sees 1 GPU: start at most 1 process per node"
    )
    assert (
        "--nproc-per-node 1" in message and "SLURM" in message and "\n" not in message
    )
    # set_device(1) would have been the raw "invalid device ordinal"
    assert cuda_reported == []


def test_cuda_asked_for_where_the_gpus_are_hidden_names_the_hiding(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(
        UserError, match="CUDA_VISIBLE_DEVICES is empty, which hides every GPU"
    ):
        pick_device("cuda")


@pytest.mark.parametrize(
    "cuda_build,cause",
    [
        (None, r"is a CPU-only build \(torch.version.cuda is None\)"),
        (
            "12.8",
            r"is built for CUDA 12.8 but cannot start it "
            r"\(torch.cuda.is_available\(\) is False\)",
        ),
    ],
)
def test_auto_falling_back_from_a_present_gpu_warns_once(
    monkeypatch, unpinned, cuda_build, cause
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    monkeypatch.setattr(runtime, "nvidia_gpu_present", lambda: True)
    with pytest.warns(
        RuntimeWarning, match=f"an NVIDIA GPU is present, but .*{cause}"
    ) as caught:
        assert pick_device("auto") == torch.device("cpu")
    assert "--device cuda would make this an error" in str(caught[0].message)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        pick_device("auto")
    assert again == []  # once per process
    # and --device cuda is the error it promised
    with pytest.raises(UserError, match=cause):
        pick_device("cuda")


def test_no_warning_where_no_gpu_is_present_or_the_cpu_is_chosen(monkeypatch, unpinned):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    present = [False]
    monkeypatch.setattr(runtime, "nvidia_gpu_present", lambda: present[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        pick_device("auto")  # a machine without a GPU
        present[0] = True
        pick_device("auto", local_rank=1)  # local rank 0 speaks for the node
        monkeypatch.setenv("DISTLAB_DEVICE", "cpu")
        pick_device("auto")  # the pin chose the CPU on purpose
        monkeypatch.delenv("DISTLAB_DEVICE")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        pick_device("auto")  # and so does an empty CUDA_VISIBLE_DEVICES


@pytest.fixture
def tf32_restored():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_use_tf32_switches_cuda_matmuls_and_convolutions_and_leaves_the_cpu_alone(
    tf32_restored,
):
    a, b = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).chunk(2)
    cpu_precision = torch.backends.mkldnn.matmul.fp32_precision
    reference = a @ b.T
    for enabled in (True, False, True, False):
        use_tf32(enabled)
        assert tf32_enabled() is enabled
        # both of torch 2.13's views agree, so the legacy readers (Inductor's among
        # them) do not raise
        assert torch.backends.cuda.matmul.allow_tf32 is enabled
        assert torch.get_float32_matmul_precision() == (
            "high" if enabled else "highest"
        )
        assert torch.backends.cudnn.allow_tf32 is enabled
        # oneDNN's CPU matmuls untouched
        assert torch.backends.mkldnn.matmul.fp32_precision == cpu_precision
        assert torch.equal(a @ b.T, reference)
