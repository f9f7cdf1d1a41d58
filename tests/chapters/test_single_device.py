"""The single-device baseline chapter's experiments (distlab.chapters.single_device).
The page checks its own measurements on every build (parameter counts, model-state and
activation bytes, FLOPs per token and their parts, the attention kernel, AdamW's
operators, the recorded lab 1 runs' MFU); these tests check what it does not run: bad
inputs, and its figures on made-up numbers.
"""

import json
import math

import matplotlib.pyplot as plt
import pytest

from distlab.chapters import single_device
from distlab.chapters.single_device import (
    FLOP_PARTS,
    mfu_figure,
    recorded_lab1,
    step_cost_figure,
)


def test_an_mfu_that_was_not_recorded_shows_as_such_not_as_zero():
    results = {"fp32": {"mfu": None, "tokens_per_s": 1000.0}}
    fig = mfu_figure(results, "t")
    assert [bar.get_width() for bar in fig.axes[0].patches] == [0.0]
    assert "MFU not recorded" in fig.axes[0].texts[0].get_text()
    plt.close(fig)


def test_step_cost_figure_stacks_each_bar_end_to_end_and_names_every_part():
    state = {"params": 4e6, "grads": 4e6, "optimizer": 8e6}
    flops = dict(zip(FLOP_PARTS, [40e6, 15e6, 5e6, 7e6, 0.1e6]))
    fig = step_cost_figure(state, activations=20e6, batch=16, flops=flops)
    memory, work = fig.axes
    assert [b.get_width() for b in memory.patches] == [4.0, 4.0, 8.0, 20.0]  # MB
    for ax in (memory, work):
        bars = ax.patches
        assert all(
            math.isclose(b.get_x(), sum(w.get_width() for w in bars[:i]))
            for i, b in enumerate(bars)
        )
    assert memory.get_title(loc="left") == "bytes held, batch 16: 36 MB"
    legend = [t.get_text() for t in work.get_legend().get_texts()]
    assert legend[0] == "MLP 40" and legend[-1] == "head 0.1"
    plt.close(fig)


def test_recorded_lab1_reads_lab_1s_run_skips_a_missing_recording_and_refuses_an_unknown_dtype(  # noqa: E501
    tmp_path, monkeypatch
):
    runs = [
        {"lab": "lab2_ddp", "world_size": 1},
        {"lab": "lab1_single", "world_size": 1, "mfu": 0.5},
    ]
    recording = tmp_path / "bench" / "cpu_shakespeare_fp32.json"
    recording.parent.mkdir()
    recording.write_text(json.dumps({"provenance": {"machine": "m"}, "runs": runs}))
    monkeypatch.setattr(single_device, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(
        single_device,
        "RECORDED_LAB1",
        {"fp32": recording, "bf16": tmp_path / "none.json"},
    )
    results = recorded_lab1()
    assert list(results) == ["fp32"]  # no bf16 recording: no bf16 entry
    assert results["fp32"] == {
        **runs[1],
        "provenance": {"machine": "m"},
        "file": f"{tmp_path.name}/bench/cpu_shakespeare_fp32.json",
    }
    with pytest.raises(ValueError, match="unknown dtype 'fp16'"):
        recorded_lab1(("fp16",))
