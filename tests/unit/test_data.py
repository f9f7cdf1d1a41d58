"""The data: Tiny Shakespeare ships with the package and is verified on every read; a
reader's own UTF-8 file is taken as it is; no network, no cache, no copy outside the
package is ever needed."""

import hashlib
import os
import socket
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import pytest
import torch

from distlab import data
from distlab.data import (
    MIN_CHARS,
    PACKAGED_SOURCE,
    SHA256,
    Corpus,
    DataError,
    TokenData,
    load_corpus,
    token_data,
)
from distlab.infra.experiment import gpt
from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_summary
from distlab.model import GPT, PRESETS, count_parameters, preset
from support.labs import run_lab

# the workspace's own copy, which nothing may read any more
SHARED = REPO_ROOT.parent / "shared"
LAB1_QUICK = (
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--eval-batches",
    "1",
    "--sample-chars",
    "0",
    "--no-progress",
)


def refuse_network(*args, **kwargs):
    raise OSError("the network is blocked in this test")


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network, no $DISTLAB_DATA, an empty home and working directory."""
    monkeypatch.setattr(socket.socket, "connect", refuse_network)
    monkeypatch.setattr(socket, "create_connection", refuse_network)
    monkeypatch.delenv("DISTLAB_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def fresh_machine(monkeypatch, tmp_path):
    """Environment for a lab subprocess as on a fresh clone with no network: no
    $DISTLAB_DATA or $DISTLAB_CACHE, an empty $HOME, and a sitecustomize that blocks
    sockets and refuses to open anything in SHARED (so a hidden dependency on that copy
    fails the run)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, socket, sys\n"
        "def _refuse(*args, **kwargs):\n"
        "    raise OSError('the network is blocked in this test')\n"
        "socket.socket.connect = _refuse\n"
        "socket.create_connection = _refuse\n"
        "def _no_shared(event, args):\n"
        "    if event == 'open' and isinstance(args[0], (str, bytes, os.PathLike)):\n"
        "        if "
        f"os.path.abspath(os.fsdecode(args[0])).startswith({str(SHARED) + os.sep!r}):\n"
        "            raise PermissionError(f'this test forbids reading {args[0]}')\n"
        "sys.addaudithook(_no_shared)\n"
    )
    for name in ("DISTLAB_DATA", "DISTLAB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()


def write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- the packaged copy ---


def test_the_packaged_file_is_tiny_shakespeare():
    raw = (resources.files("distlab") / "corpus" / "tinyshakespeare.txt").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SHA256
    corpus = load_corpus()
    assert corpus.source == PACKAGED_SOURCE and len(corpus.text) == 1_115_394


def test_pyproject_declares_the_corpus_as_package_data():
    """So a non-editable install (a wheel) ships it too, not only a checkout."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["distlab"]
    assert any(fnmatch("corpus/tinyshakespeare.txt", pattern) for pattern in patterns)


def test_a_corrupt_packaged_copy_is_an_error_naming_the_file(monkeypatch, tmp_path):
    raw = data._packaged_file().read_bytes()
    corrupt = tmp_path / "tinyshakespeare.txt"
    corrupt.write_bytes(raw[:-10])
    monkeypatch.setattr(data, "_packaged_file", lambda: corrupt)
    with pytest.raises(DataError, match="corrupt") as error:
        load_corpus()
    assert str(corrupt) in str(error.value) and "\n" not in str(error.value)


def test_a_missing_packaged_copy_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "_packaged_file", lambda: tmp_path / "gone.txt")
    with pytest.raises(DataError, match="cannot be read"):
        load_corpus()


# --- offline, with nothing but the package ---


def test_the_books_data_path_works_offline(offline):
    assert socket.create_connection is refuse_network  # the block is in place
    corpus = load_corpus()
    assert corpus.source == PACKAGED_SOURCE
    # not the process-wide cached one: read again, offline
    fresh = token_data.__wrapped__()
    x, y = fresh.batch("train", step=0, global_batch=4, block_size=64, seed=0)
    assert x.shape == y.shape == (4, 64) and fresh.vocab_size == 65


def test_lab1_trains_offline_on_a_fresh_machine(fresh_machine, tmp_path):
    proc = run_lab("lab1_single.py", *LAB1_QUICK, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path / "out")
    assert summary["data"] == PACKAGED_SOURCE
    assert summary["parameters"] == count_parameters(gpt("tiny", seed=0))
    # nothing kept in $HOME: the peak is timed in every run
    assert not (tmp_path / "home" / ".cache").exists()


def test_a_readers_own_corpus_trains_with_its_own_vocabulary(fresh_machine, tmp_path):
    # UTF-8, beyond ASCII; MIN_CHARS or more
    text = "naïve café, déjà vu: ça va.\n" * 400
    own = write_text(tmp_path / "mine.txt", text)
    proc = run_lab(
        "lab1_single.py", *LAB1_QUICK, "--data", own, "--out", tmp_path / "out"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path / "out")
    vocab = len(set(text))
    assert summary["data"] == str(own) and vocab != 65
    assert summary["parameters"] == count_parameters(
        GPT(preset("tiny", vocab_size=vocab))
    )


# --- a reader's own file ---


def test_any_utf8_file_loads_as_it_is_with_no_checksum(tmp_path):
    text = "Ὦ ξεῖν', ἀγγέλλειν Λακεδαιμονίοις\n" * 400  # MIN_CHARS or more
    # the name alone makes no demand
    own = write_text(tmp_path / "tinyshakespeare.txt", text)
    corpus = load_corpus(own)
    assert corpus == Corpus(text, str(own))
    assert TokenData(corpus).vocab_size == len(set(text))


def test_a_file_of_min_chars_cuts_a_window_of_the_smallest_preset_and_names_what_a_longer_one_needs(  # noqa: E501
    tmp_path,
):
    smallest = min(cfg.block_size for cfg in PRESETS.values())
    d = TokenData(
        load_corpus(write_text(tmp_path / "short.txt", "ab" * (MIN_CHARS // 2)))
    )
    x, y = d.batch("val", 0, 2, smallest, seed=0)
    assert x.shape == (2, smallest)
    with pytest.raises(
        DataError,
        match="at least 10,250 characters, or a preset with a shorter context",
    ):
        d.batch("val", 0, 2, PRESETS["gpt2"].block_size, seed=0)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda tmp: tmp / "nope.txt", "does not exist"),
        (lambda tmp: tmp, "is not a file"),
        (
            lambda tmp: write_text(tmp / "short.txt", "x" * (MIN_CHARS - 1)),
            f"at least {MIN_CHARS:,}",
        ),
        (lambda tmp: tmp / "latin1.txt", "not UTF-8 text: byte 0xe9 at offset 3"),
    ],
    ids=["missing", "a directory", "too short", "not UTF-8"],
)
def test_a_bad_file_is_a_one_line_data_error(make, message, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1") * MIN_CHARS)
    with pytest.raises(DataError, match=message) as error:
        load_corpus(make(tmp_path))
    assert "\n" not in str(error.value)


# --- encoding and batches ---


def test_tokenizer_round_trips_and_has_65_characters():
    d = token_data()
    assert d.vocab_size == d.tokenizer.vocab_size == 65
    text = "First Citizen:\nBefore we proceed"
    assert d.tokenizer.decode(d.tokenizer.encode(text).tolist()) == text
    n = sum(len(v) for v in d.splits.values())
    assert n == 1_115_394 and len(d.splits["val"]) == n // 10


def test_targets_are_inputs_shifted_by_one():
    x, y = token_data().batch("train", step=5, global_batch=4, block_size=32, seed=0)
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_see_exactly_the_global_batch(world_size):
    d = token_data()
    full_x, full_y = d.batch("train", 7, 8, 16, seed=1)
    parts = [
        d.batch("train", 7, 8, 16, seed=1, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_y)


def test_batches_depend_on_step_and_seed():
    d = token_data()
    a = d.batch("train", 0, 4, 16, seed=0)[0]
    assert torch.equal(a, d.batch("train", 0, 4, 16, seed=0)[0])
    assert not torch.equal(a, d.batch("train", 1, 4, 16, seed=0)[0])
    assert not torch.equal(a, d.batch("train", 0, 4, 16, seed=1)[0])


def test_batches_agree_across_processes_with_different_hash_seeds():
    """Python salts str hashes per process; every rank must still draw the same batch.
    This process and one other, with another salt (one process started instead of two).
    """
    code = (
        "from distlab.data import token_data; "
        "print(hash('distlab'), token_data().batch('train', 3, 4, 8, "
        "seed=5)[0].sum().item())"
    )
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": seed},
    ).stdout.split()
    # the two processes salt their hashes differently
    assert int(other[0]) != hash("distlab")
    assert (
        float(other[1]) == token_data().batch("train", 3, 4, 8, seed=5)[0].sum().item()
    )


def test_a_batch_that_does_not_split_over_the_ranks_is_refused():
    d = TokenData(Corpus("abcdefgh" * 100, "test"))
    with pytest.raises(DataError, match="does not split"):
        d.batch("train", 0, 6, 4, seed=0, rank=0, world_size=4)
