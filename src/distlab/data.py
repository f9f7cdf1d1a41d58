"""Tiny Shakespeare, character level: reading the text, encoding it, cutting batches.

The text ships inside the package (``distlab/corpus/tinyshakespeare.txt``, declared as
package data) and is checked against ``SHA256`` whenever it is read: no download, no
cache, the same bytes on every machine, online or not. ``--data PATH`` on a lab's
command line trains on any UTF-8 text file instead, a reader's own corpus, taken as it
is. Either way the vocabulary is the set of characters of the text actually loaded (65
for Tiny Shakespeare), so code builds its model with
``vocab_size=token_data().vocab_size``, never a constant.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from distlab.errors import UserError
from distlab.model import PRESETS

SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
FILENAME = "tinyshakespeare.txt"
PACKAGED_SOURCE = "tinyshakespeare (package data)"
VAL_FRACTION = 0.1
# the validation split (VAL_FRACTION of the text) must hold one window of the smallest
# preset: block_size inputs plus the one target after them. A longer context needs more
# (gpt2: 10,250 characters); ``global_windows`` says so for the run that asks for it.
MIN_CHARS = round((min(cfg.block_size for cfg in PRESETS.values()) + 1) / VAL_FRACTION)


class DataError(UserError):
    """The text cannot be had as asked (missing or unreadable file, corrupt
    package data)."""


@dataclass(frozen=True)
class Corpus:
    text: str
    # where the text came from, for logs and summaries: a path or PACKAGED_SOURCE
    source: str


def _packaged_file():
    """The packaged copy, as importlib.resources finds it: in a wheel's install or a
    checkout. One name per ``/``: not every Traversable of Python 3.11 takes several
    names in joinpath."""
    return resources.files("distlab") / "corpus" / FILENAME


def _read_packaged() -> str:
    packaged = _packaged_file()
    try:
        raw = packaged.read_bytes()
    except OSError as error:
        raise DataError(
            f"the packaged Tiny Shakespeare {packaged} cannot be read "
            f"({error}): reinstall distlab"
        ) from error
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise DataError(
            f"the packaged Tiny Shakespeare {packaged} is corrupt: sha256 "
            f"{digest[:12]}..., "
            f"expected {SHA256[:12]}... (restore it from git, or reinstall distlab)"
        )
    return raw.decode("utf-8")


def _read_user_file(path: Path) -> str:
    """A reader's own corpus: any UTF-8 text long enough to cut windows from;
    no checksum."""
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if not path.is_file():
        raise DataError(f"data file {path} is not a file")
    try:
        raw = path.read_bytes()
    except OSError as error:  # no permission, a read error: still the user's to fix
        raise DataError(f"data file {path} cannot be read: {error.strerror}") from error
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"data file {path} is not UTF-8 text: byte 0x{raw[error.start]:02x} "
            f"at offset {error.start}"
        ) from error
    if len(text) < MIN_CHARS:
        raise DataError(
            f"data file {path} has {len(text):,} characters; at least "
            f"{MIN_CHARS:,} are needed "
            f"(the {VAL_FRACTION:.0%} validation split must hold one window of "
            "the smallest preset)"
        )
    return text


def load_corpus(path: str | os.PathLike | None = None) -> Corpus:
    """``path``: a UTF-8 text file of your own; None (or empty): the packaged Tiny
    Shakespeare."""
    if path:
        return Corpus(_read_user_file(Path(path)), str(path))
    return Corpus(_read_packaged(), PACKAGED_SOURCE)


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
    # hashlib, not hash(): Python salts str hashes per process, and every rank
    # must agree
    digest = hashlib.blake2b(f"{seed}/{split}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes 63 bits


def to_device(rows: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``rows`` on ``device``; to a GPU from pinned (page-locked) memory, so that the
    copy is queued and the host goes on queueing the step. From pageable memory an
    async copy "might be synchronous with respect to host": the driver may wait for
    the stream's queued kernels to stage it (CUDA runtime API, "API synchronization
    behavior"), which would undo the host's lead that --log-every gives."""
    if torch.device(device).type == "cuda":
        rows = rows.pin_memory()
    return rows.to(device, non_blocking=True)


class TokenData:
    """The encoded corpus, split 90/10 into train and validation, cut into windows.

    Batches are drawn per *global* step: step ``s`` of a run with global batch ``B``
    always draws the same ``B`` windows, and rank ``r`` of ``N`` takes rows
    ``[r*B/N, (r+1)*B/N)``. So N ranks together see exactly the batch one process sees,
    which is what lets every distributed lab be checked against lab 1, and a resumed run
    continue on the very batch it would have seen.
    """

    def __init__(self, corpus: Corpus, val_fraction: float = VAL_FRACTION):
        self.tokenizer = CharTokenizer(corpus.text)
        ids = self.tokenizer.encode(corpus.text)
        n_val = int(len(ids) * val_fraction)
        self.splits = {"train": ids[:-n_val], "val": ids[-n_val:]}

    @property
    def vocab_size(self) -> int:
        """Distinct characters of the loaded text: the model's embedding and
        output size."""
        return self.tokenizer.vocab_size

    def global_windows(
        self, split: str, step: int, global_batch: int, block_size: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch of ``step``: inputs and next-token targets, each (B, T)."""
        ids = self.splits[split]
        if len(ids) <= block_size:
            raise DataError(
                f"the {split} split has {len(ids):,} tokens, too few for one "
                f"window of {block_size + 1:,} "
                f"(block_size {block_size} + 1): use a text of at least "
                f"{round((block_size + 1) / VAL_FRACTION):,} "
                "characters, or a preset with a shorter context"
            )
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
        """This rank's rows of the global batch of ``step``, each (B/N, T),
        on ``device``."""
        if global_batch % world_size:
            raise DataError(
                f"global batch {global_batch} does not split over {world_size} ranks"
            )
        # --- begin rank rows ---
        x, y = self.global_windows(split, step, global_batch, block_size, seed)
        rows = slice(
            rank * global_batch // world_size, (rank + 1) * global_batch // world_size
        )
        return to_device(x[rows], device), to_device(y[rows], device)
        # --- end rank rows ---


@functools.cache
def token_data(path: str | None = None) -> TokenData:
    """The corpus at ``path`` (default: the packaged Tiny Shakespeare), read and encoded
    once per process: the one data object every chapter experiment and benchmark shares.
    """
    return TokenData(load_corpus(path))
