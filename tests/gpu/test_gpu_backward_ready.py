"""When a GPU's backward completes each gradient (``python -m
distlab.bench.backward_ready``, short): the tied embedding's gradient is the last.

    pytest -m gpu tests/gpu/test_gpu_backward_ready.py
"""

import json

import pytest
import torch

from distlab.bench import backward_ready
from support.gpu import GPU_MODULE

pytestmark = [
    *GPU_MODULE,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_tied_embedding_is_the_last_gradient_backward_completes(tmp_path):
    out = tmp_path / "r.json"
    backward_ready.main(["--batch-size", "1", "--repeats", "2", "--out", str(out)])
    fractions = json.loads(out.read_text())["ready_fraction"]
    medians = {name: f["median"] for name, f in fractions.items()}
    assert max(medians, key=medians.get) == "wte.weight"
    assert min(medians, key=medians.get).startswith("ln_f")
    assert all(0 < m <= 1 for m in medians.values())
