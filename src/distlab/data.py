"""Tiny Shakespeare, character level: finding the text, encoding it, cutting batches.

Where the text comes from, first match wins:
1. an explicit path: ``--data PATH`` on a lab's command line, or ``$DISTLAB_DATA``;
2. the local cache, ``$DISTLAB_CACHE`` or ``~/.cache/distlab``, ``tinyshakespeare.txt``;
3. a download from the canonical URL into that cache, checked against ``SHA256``;
4. offline with no copy: a one-line notice, then the text of ``pydoc_data.topics``
   (Python's own help pages, shipped with every Python) so the labs still run.

Tiny Shakespeare from any of 1-3 must match ``SHA256``: a wrong file is an error, never a
silent fallback.
"""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.error
import urllib.request
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from distlab.errors import UserError

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
FILENAME = "tinyshakespeare.txt"
FALLBACK_NAME = "pydoc_data.topics (offline fallback)"


class DataError(UserError):
    """The text cannot be had as asked (missing path, wrong checksum)."""


@dataclass(frozen=True)
class Corpus:
    text: str
    source: str  # where the text came from, for logs and summaries

    @property
    def is_tinyshakespeare(self) -> bool:
        return self.source != FALLBACK_NAME


def cache_dir() -> Path:
    return Path(os.environ.get("DISTLAB_CACHE", Path.home() / ".cache" / "distlab"))


def _read_verified(path: Path) -> str:
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise DataError(
            f"data file {path} is corrupt or not Tiny Shakespeare: sha256 {digest[:12]}..., expected {SHA256[:12]}..."
        )
    return raw.decode("utf-8")


def _download(dest: Path, timeout: float) -> str | None:
    """Download, verify, then rename into place; None when the network is unreachable."""
    try:
        with urllib.request.urlopen(URL, timeout=timeout) as response:
            raw = response.read()
    except (urllib.error.URLError, OSError):
        return None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise DataError(f"download from {URL} has sha256 {digest[:12]}..., expected {SHA256[:12]}...")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(f".part{os.getpid()}")
    partial.write_bytes(raw)
    partial.replace(dest)  # atomic: a reader never sees half a file
    return raw.decode("utf-8")


def _fallback_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_corpus(path: str | os.PathLike | None = None, download_timeout: float = 20.0) -> Corpus:
    explicit = path or os.environ.get("DISTLAB_DATA")
    if explicit:
        return Corpus(_read_verified(Path(explicit)), str(explicit))
    cached = cache_dir() / FILENAME
    if cached.exists():
        return Corpus(_read_verified(cached), str(cached))
    text = _download(cached, download_timeout)
    if text is not None:
        return Corpus(text, str(cached))
    print(
        f"notice: Tiny Shakespeare not found locally and {URL} is unreachable; "
        f"training on {FALLBACK_NAME} instead (pass --data PATH to use a local copy)",
        file=sys.stderr,
    )
    return Corpus(_fallback_text(), FALLBACK_NAME)


class CharTokenizer:
    """One token per distinct character of the corpus (65 for Tiny Shakespeare)."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def _stream_seed(seed: int, split: str, step: int) -> int:
    # hashlib, not hash(): Python salts str hashes per process, and every rank must agree
    digest = hashlib.blake2b(f"{seed}/{split}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes 63 bits


class TokenData:
    """The encoded corpus, split 90/10 into train and validation, cut into windows.

    Batches are drawn per *global* step: step ``s`` of a run with global batch ``B``
    always draws the same ``B`` windows, and rank ``r`` of ``N`` takes rows
    ``[r*B/N, (r+1)*B/N)``. So N ranks together see exactly the batch one process sees,
    which is what lets every distributed lab be checked against lab 1, and a resumed run
    continue on the very batch it would have seen.
    """

    def __init__(self, corpus: Corpus, val_fraction: float = 0.1):
        self.tokenizer = CharTokenizer(corpus.text)
        ids = self.tokenizer.encode(corpus.text)
        n_val = int(len(ids) * val_fraction)
        self.splits = {"train": ids[:-n_val], "val": ids[-n_val:]}

    def global_windows(
        self, split: str, step: int, global_batch: int, block_size: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch of ``step``: inputs and next-token targets, each (B, T)."""
        ids = self.splits[split]
        if len(ids) <= block_size:
            raise DataError(f"{split} split has {len(ids)} tokens, fewer than block_size+1")
        # a generator per (seed, split, step): no state to carry, so resuming is trivial
        gen = torch.Generator().manual_seed(_stream_seed(seed, split, step))
        starts = torch.randint(len(ids) - block_size, (global_batch,), generator=gen)
        offsets = torch.arange(block_size)
        x = ids[starts[:, None] + offsets]  # (B, T)
        y = ids[starts[:, None] + offsets + 1]  # (B, T), shifted by one
        return x, y

    def batch(
        self,
        split: str,
        step: int,
        global_batch: int,
        block_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch of ``step``, each (B/N, T), on ``device``."""
        if global_batch % world_size:
            raise DataError(f"global batch {global_batch} does not split over {world_size} ranks")
        x, y = self.global_windows(split, step, global_batch, block_size, seed)
        rows = slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)
        return x[rows].to(device, non_blocking=True), y[rows].to(device, non_blocking=True)


@functools.cache
def token_data(path: str | None = None) -> TokenData:
    """The corpus at ``path`` (default: the labs' own), read, verified and encoded once per
    process: the one data object every chapter experiment and benchmark shares."""
    return TokenData(load_corpus(path))
