"""Peak memory on the device a model lives on: the CUDA allocator's peaks, and the
memory tracker's breakdown read for the model's device, never for whichever device
came first."""

import contextlib

import pytest
import torch

from distlab.memory import StepMemory, device_memory_peaks, tracker_snapshot
from distlab.model import GPT, preset

CPU, GPU = torch.device("cpu"), torch.device("cuda", 1)


class FakeTracker(contextlib.nullcontext):
    """What StepMemory and tracker_snapshot use of a memory tracker, with a
    chosen snapshot."""

    memory_tracking: dict = {}

    def __init__(self, snapshot: dict):
        super().__init__()
        self.snapshot = snapshot

    def get_tracker_snapshot(self, when: str = "current") -> dict:
        return self.snapshot

    def reset_mod_stats(self) -> None:
        pass


def test_off_cuda_there_are_no_allocator_peaks():
    assert device_memory_peaks(CPU) == {} == device_memory_peaks("cpu")


def test_on_cuda_both_allocator_peaks_are_read_for_that_device(monkeypatch):
    asked = []

    def fake(value):
        return lambda device=None: asked.append(device) or value

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake(3_000))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", fake(4_096))
    assert device_memory_peaks(GPU) == {
        "cuda_max_memory_allocated": 3_000,
        "cuda_max_memory_reserved": 4_096,
    }
    assert device_memory_peaks("cuda:1") == device_memory_peaks(GPU)
    assert asked == [GPU] * 6  # this rank's GPU, not the current one


def test_the_snapshot_is_read_for_the_device_asked_not_the_first():
    # on a GPU, AdamW's step counters are CPU tensors: the tracker files a CPU entry too
    tracker = FakeTracker({CPU: {"Total": 4}, GPU: {"Total": 1_000}})
    assert tracker_snapshot(tracker, "peak", GPU) == {"Total": 1_000}
    assert tracker_snapshot(tracker, "peak", "cpu") == {"Total": 4}
    with pytest.raises(
        ValueError, match=r"no tensors on cuda:0 \(devices it saw: cpu, cuda:1\)"
    ):
        tracker_snapshot(tracker, "peak", torch.device("cuda", 0))


def test_step_memory_reports_the_models_device(monkeypatch):
    model = GPT(preset("tiny"))
    decoy = {"_MemRefType.PARAM": 1, "Total": 1}
    mine = {"_MemRefType.PARAM": 2, "_MemRefType.ACT": 3, "Total": 5}
    monkeypatch.setattr(
        "distlab.memory.memory_tracker",
        lambda model, optimizer: FakeTracker({GPU: decoy, CPU: mine}),
    )
    memory = StepMemory(model, torch.optim.AdamW(model.parameters()))
    for _ in range(2):  # the second step is the one watched
        memory.begin()
        memory.end()
    assert memory.peak == {"params": 2, "activations": 3, "total": 5}


def test_step_memory_measures_a_real_step_on_the_cpu():
    model = GPT(preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    idx = torch.zeros(2, 16, dtype=torch.long)
    memory = StepMemory(model, optimizer)
    for _ in range(2):
        memory.begin()
        model(idx, idx)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        memory.end()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # + grads + AdamW's moments
    assert memory.peak["params"] == params and memory.peak["total"] > 3 * params
    assert not any(key.startswith("cuda") for key in memory.peak)
