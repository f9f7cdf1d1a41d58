"""A model bigger than one rank, exercise: a sharding-independent init with one
generator per block of rows."""

from __future__ import annotations

from collections.abc import Callable

import torch

from distlab.exercises._common import passed, require_callable

ROWS, COLS, BLOCK, STD = 130, 3, 16, 0.02
# how the 130 rows are cut over "ranks": 1 rank, 2 even, uneven cuts that start and
# end mid-block
SPLITS = ((130,), (65, 65), (5, 60, 65), (16, 16, 98), (1, 127, 2))


def _fill(fill_blocks_: Callable, sizes: tuple[int, ...], key: int) -> torch.Tensor:
    whole, first = torch.full((ROWS, COLS), float("nan")), 0
    for n in sizes:
        local = torch.full((n, COLS), float("nan"))  # what to_local() gives one rank
        fill_blocks_(local, first, key, STD, BLOCK)
        whole[first : first + n] = local
        first += n
    return whole


def check_fill_blocks(fill_blocks_: Callable) -> None:
    """``fill_blocks_(local, first_row, key, std, rows_per_block)`` fills ``local`` (the
    rows ``first_row ...`` of a parameter) in place with N(0, std^2) values that depend
    on ``key`` and the global row only, seeding one generator per block of
    ``rows_per_block`` rows."""
    require_callable(
        fill_blocks_,
        "fill_blocks_",
        "def fill_blocks_(local, first_row, key, std, rows_per_block): ...",
    )
    one = _fill(fill_blocks_, SPLITS[0], key=1)
    if one.isnan().any():
        raise AssertionError(
            "some rows were left unfilled: fill every row of `local` in place"
        )
    for sizes in SPLITS[1:]:
        got = _fill(fill_blocks_, sizes, key=1)
        if not torch.equal(got, one):
            row = int((got != one).any(dim=1).nonzero()[0])
            raise AssertionError(
                f"cut into rows {sizes}, row {row} differs from the one-rank "
                "fill: a shard that starts "
                "mid-block must draw the whole block from the block's start and "
                "keep its own rows"
            )
    if torch.equal(_fill(fill_blocks_, SPLITS[0], key=2), one):
        raise AssertionError(
            "key 1 and key 2 gave the same values: seed each block from the key too"
        )
    blocks = one.view(-1, COLS)[: ROWS // BLOCK * BLOCK].reshape(
        ROWS // BLOCK, BLOCK * COLS
    )
    if any(torch.equal(blocks[0], b) for b in blocks[1:]):
        raise AssertionError(
            "two blocks hold the same values: seed each block from its index too"
        )
    if not 0.5 * STD < one.std().item() < 1.5 * STD:
        raise AssertionError(
            f"the values' standard deviation is {one.std().item():.3g}, not "
            f"about std={STD}"
        )
    passed(
        f"{len(SPLITS)} ways of cutting {ROWS} rows give the same values; keys "
        "and blocks differ"
    )
