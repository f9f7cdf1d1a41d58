import hashlib
import io
import os
import subprocess
import sys

import pytest
import torch

from distlab import data
from distlab.data import Corpus, DataError, TokenData, load_corpus


@pytest.fixture(scope="module")
def raw() -> bytes:
    """Tiny Shakespeare's bytes, read before any test hides $DISTLAB_DATA."""
    corpus = load_corpus()
    if not corpus.is_tinyshakespeare:
        pytest.fail("these tests need Tiny Shakespeare: set DISTLAB_DATA, or be online")
    return corpus.text.encode()


@pytest.fixture
def no_explicit_path(raw, monkeypatch, tmp_path):
    """No $DISTLAB_DATA, an empty cache: the download and fallback paths are reachable."""
    monkeypatch.delenv("DISTLAB_DATA", raising=False)
    monkeypatch.setenv("DISTLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / data.FILENAME


def test_the_shared_copy_verifies():
    corpus = load_corpus()
    assert corpus.is_tinyshakespeare and len(corpus.text) == 1_115_394
    assert hashlib.sha256(corpus.text.encode()).hexdigest() == data.SHA256


def test_explicit_path_wins_over_the_environment(raw, tmp_path, monkeypatch):
    copy = tmp_path / "copy.txt"
    copy.write_bytes(raw)
    monkeypatch.setenv("DISTLAB_DATA", str(tmp_path / "elsewhere.txt"))
    assert load_corpus(copy).source == str(copy)


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(tmp_path / "nope.txt")


def test_corrupt_file_is_an_error_not_a_fallback(raw, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(raw[:-10])
    with pytest.raises(DataError, match="corrupt"):
        load_corpus(bad)


def test_the_cache_is_used_before_any_download(raw, no_explicit_path, monkeypatch):
    no_explicit_path.parent.mkdir(parents=True)
    no_explicit_path.write_bytes(raw)
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda *a, **k: pytest.fail("downloaded"))
    assert load_corpus().source == str(no_explicit_path)


class FakeResponse(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_download_is_verified_then_cached(raw, no_explicit_path, monkeypatch):
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: FakeResponse(raw))
    corpus = load_corpus()
    assert corpus.is_tinyshakespeare and no_explicit_path.exists()


def test_a_download_with_the_wrong_checksum_is_an_error(no_explicit_path, monkeypatch):
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: FakeResponse(b"not shakespeare"))
    with pytest.raises(DataError, match="sha256"):
        load_corpus()
    assert not no_explicit_path.exists()


def test_offline_without_a_copy_falls_back_with_a_one_line_notice(no_explicit_path, monkeypatch, capsys):
    def offline(url, timeout):
        raise data.urllib.error.URLError("no network")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    corpus = load_corpus()
    assert corpus.source == data.FALLBACK_NAME and not corpus.is_tinyshakespeare
    assert len(corpus.text) > 100_000  # enough text for the labs to train on
    notice = capsys.readouterr().err.strip()
    assert notice.startswith("notice:") and "\n" not in notice


def test_tokenizer_round_trips_and_has_65_characters():
    d = TokenData(load_corpus())
    assert d.tokenizer.vocab_size == 65
    text = "First Citizen:\nBefore we proceed"
    assert d.tokenizer.decode(d.tokenizer.encode(text).tolist()) == text
    n = sum(len(v) for v in d.splits.values())
    assert n == 1_115_394 and len(d.splits["val"]) == n // 10


def test_targets_are_inputs_shifted_by_one():
    d = TokenData(load_corpus())
    x, y = d.batch("train", step=5, global_batch=4, block_size=32, seed=0)
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_see_exactly_the_global_batch(world_size):
    d = TokenData(load_corpus())
    full_x, full_y = d.batch("train", 7, 8, 16, seed=1)
    parts = [d.batch("train", 7, 8, 16, seed=1, rank=r, world_size=world_size) for r in range(world_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_y)


def test_batches_depend_on_step_and_seed():
    d = TokenData(load_corpus())
    a = d.batch("train", 0, 4, 16, seed=0)[0]
    assert torch.equal(a, d.batch("train", 0, 4, 16, seed=0)[0])
    assert not torch.equal(a, d.batch("train", 1, 4, 16, seed=0)[0])
    assert not torch.equal(a, d.batch("train", 0, 4, 16, seed=1)[0])


def test_batches_agree_across_processes_with_different_hash_seeds():
    """Python salts str hashes per process; every rank must still draw the same batch."""
    code = (
        "from distlab.data import *; d = TokenData(load_corpus()); "
        "print(d.batch('train', 3, 4, 8, seed=5)[0].sum().item())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(s)},
        ).stdout
        for s in (1, 2)
    }
    assert len(outs) == 1


def test_a_batch_that_does_not_split_over_the_ranks_is_refused():
    d = TokenData(Corpus("abcdefgh" * 100, "test"))
    with pytest.raises(DataError, match="does not split"):
        d.batch("train", 0, 6, 4, seed=0, rank=0, world_size=4)
