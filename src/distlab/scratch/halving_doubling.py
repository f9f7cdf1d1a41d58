"""Recursive halving-doubling all-reduce (Rabenseifner's), from point-to-point messages.

    halving_doubling_all_reduce(t)   # in place, SUM, same result as dist.all_reduce(t)

The ring of ``distlab.scratch.collectives`` takes 2(N-1) steps; this takes 2 log2(N),
and each rank still sends 2(N-1)/N of the tensor: the same bytes in fewer, larger
messages. That is what wins for small messages, where each message's latency dominates.
It needs a power-of-two number of ranks (MPI libraries pair the extra ranks off first;
not done here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.errors import UserError


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    """Send to and receive from ``peer`` at once (one batch: NCCL needs it, see
    collectives.py)."""
    ops = [
        dist.P2POp(dist.irecv, recv, peer),
        dist.P2POp(dist.isend, send.contiguous(), peer),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


# --- begin halving_doubling ---
def halving_doubling_all_reduce(
    tensor: torch.Tensor, sent: list | None = None
) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place. ``sent`` (a list) gets the element count
    of every message this rank sends, so a test can count messages and bytes."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if n & (n - 1):
        raise UserError(
            f"halving-doubling needs a power-of-two number of ranks, got {n}: "
            "use 2, 4 or 8"
        )
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.flatten()
    bounds = [
        0,
        *torch.tensor([c.numel() for c in torch.tensor_split(flat, n)])
        .cumsum(0)
        .tolist(),
    ]
    lo, hi = 0, n  # the chunks [lo, hi) this rank is still responsible for

    # Reduce-scatter by recursive halving: at distance d, partners split their range in
    # two; each keeps one half, sends the other, and adds the partner's copy of the half
    # it keeps.
    distance = n // 2
    while distance:
        peer, mid = rank ^ distance, (lo + hi) // 2
        keep, give = (
            ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        )
        mine = flat[bounds[keep[0]] : bounds[keep[1]]]
        incoming = torch.empty_like(mine)
        _exchange(flat[bounds[give[0]] : bounds[give[1]]], incoming, peer)
        mine.add_(incoming)
        if sent is not None:
            sent.append(bounds[give[1]] - bounds[give[0]])
        lo, hi = keep
        distance //= 2
    # now chunk lo (= rank's own bit pattern) is complete here

    # All-gather by recursive doubling: the same partners in reverse order swap what
    # they hold.
    distance = 1
    while distance < n:
        peer = rank ^ distance
        width = hi - lo
        # the partner's range is next to ours
        peer_lo = lo - width if rank & distance else hi
        _exchange(
            flat[bounds[lo] : bounds[hi]],
            flat[bounds[peer_lo] : bounds[peer_lo + width]],
            peer,
        )
        if sent is not None:
            sent.append(bounds[hi] - bounds[lo])
        lo, hi = min(lo, peer_lo), max(hi, peer_lo + width)
        distance *= 2
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# --- end halving_doubling ---
