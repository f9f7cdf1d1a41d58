"""The GPU-busy benchmark's arithmetic and guard, on any machine: kernels that overlap
count once, host events not at all, and without a GPU it says why. The run itself is a
recorded GPU benchmark (results/gpu_busy_*.json)."""

from types import SimpleNamespace
from unittest import mock

import pytest
from torch.autograd import DeviceType

from distlab.bench.gpu_busy import busy_us, main


def event(start, end, device=DeviceType.CUDA):
    return SimpleNamespace(
        device_type=device, time_range=SimpleNamespace(start=start, end=end)
    )


def test_overlapping_kernels_count_once_and_host_events_not_at_all():
    events = [event(0, 10), event(5, 15), event(20, 30), event(22, 25)]
    events.append(event(0, 100, DeviceType.CPU))  # the step's Python: not GPU time
    assert busy_us(events) == 25.0
    assert busy_us([]) == 0.0


def test_without_a_gpu_it_refuses_in_one_line(capsys):
    with mock.patch("torch.cuda.is_available", return_value=False):
        with pytest.raises(SystemExit):
            main(["--steps", "1"])
    assert "needs a GPU" in capsys.readouterr().err
