"""Lab 2 under torchrun: N ranks with B/N rows train like lab 1 with B rows."""

import socket

import pytest
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from distlab.exercises import check_loads_ddp_state
from distlab.infra.launch import RankFailed, run_script
from distlab.infra.ports import PortInUse
from distlab.metrics import read_metrics, read_summary
from distlab.model import GPT, preset
from support.exercises import passes
from support.labs import BASELINE, run_lab, torchrun


def test_two_ranks_match_lab_1(tmp_path):
    proc = torchrun("lab2_ddp.py", 2, *BASELINE["args"], "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert losses == pytest.approx(BASELINE["losses"], rel=1e-5)
    assert read_summary(tmp_path)["world_size"] == 2


def test_lab2_saves_weights_without_the_module_prefix(tmp_path):
    proc = torchrun("lab2_ddp.py", 2, "--steps", "2", "--no-progress", "--sample-chars", "0", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(tmp_path / "model.pt")
    assert not any(k.startswith("module.") for k in state)
    assert {t.device.type for t in state.values()} == {"cpu"}  # save_plain_weights: any machine loads it
    GPT(preset("tiny")).load_state_dict(state)  # loads into the plain model as it is


def test_lab2_without_torchrun_is_lab_1(tmp_path):
    proc = run_lab("lab2_ddp.py", *BASELINE["args"], "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [m["loss"] for m in read_metrics(tmp_path)] == pytest.approx(BASELINE["losses"], rel=1e-5)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch-size", "15"], "--batch-size 15 does not split over 2 ranks"),
        (["--batch-size", "1"], "--batch-size 1 does not split over 2 ranks"),  # more ranks than rows
    ],
)
def test_impossible_batches_are_refused_on_every_rank(args, message, tmp_path):
    proc = torchrun("lab2_ddp.py", 2, "--steps", "2", "--out", tmp_path, *args, timeout=120)
    assert proc.returncode != 0
    # both ranks write to one stderr, so their lines may interleave: count, don't split
    assert proc.stderr.count("lab2_ddp.py: error: ") == 2, proc.stderr[-2000:]
    assert proc.stderr.count(message) == 2, proc.stderr[-2000:]


def test_a_failing_rank_ends_the_run_with_its_error():
    with pytest.raises(RankFailed, match="does not exist"):
        run_script(
            "src/labs/lab2_ddp.py", ["--steps", "2", "--data", "/no/such/file.txt"], nprocs=2, timeout=120, quiet=True
        )


def test_a_taken_port_is_refused_before_anything_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is already in use"):
            run_script("src/labs/lab2_ddp.py", ["--steps", "2"], nprocs=2, port=port, quiet=True)


# ---------------------------------------------------------------- Lab 2, exercise 3
def load_stripping_the_prefix(model, state):
    consume_prefix_in_state_dict_if_present(state, "module.")
    model.load_state_dict(state)


def load_as_saved(model, state):
    model.load_state_dict(state)


def load_leniently(model, state):
    model.load_state_dict(state, strict=False)  # matches no key: loads nothing, says nothing


@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_loads_ddp_state_checker(capsys):
    assert "exactly" in passes(check_loads_ddp_state, load_stripping_the_prefix, capsys=capsys)
    with pytest.raises(AssertionError, match=r"your load raised RuntimeError: .*Missing key.*'module\."):
        check_loads_ddp_state(load_as_saved)
    with pytest.raises(AssertionError, match=r"wte.weight differs from the saved model's .*strict=False"):
        check_loads_ddp_state(load_leniently)
