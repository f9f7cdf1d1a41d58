"""Collective communication from scratch: a ring all-reduce, its schedule (and its
pictures), its cost, and the deadlock that a naive ring of blocking sends walks into.

    # in place, SUM, same result as dist.all_reduce(t)
    ring_all_reduce(t)
    # the same algorithm on paper, step by step
    ring_schedule(4)
    # ... drawn: a grid per step; a slider over the steps
    ring_figure(4), stepper(ring_views(4), "step")
    # 2(N-1)/N of the tensor's bytes, whatever N is; rank 0 adding for all: N-1
    ring_bytes_sent_per_rank(n, 4, 4), rank0_bytes_sent(n, 4, 4), traffic_figure(n)
    # its time in the alpha-beta model
    model_time(alpha, B, n, nbytes)

Every function that talks runs inside a rank that has joined the default process group
(``distlab.infra.launch.run_ranks`` does that); ``ring_schedule`` and the cost model are
plain Python.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.costs.collectives import Link, collective_s, ring_bytes_sent


def _send_recv(
    send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int
) -> None:
    """Send to ``dst`` and receive from ``src`` at the same time."""
    # Post both before waiting on either. Every rank of the ring sends and receives in
    # the same step; a rank that finished its send before posting its receive would wait
    # for a neighbour that is waiting for it (see blocking_ring_send_first below). One
    # batch, not an irecv then an isend: PyTorch's NCCL backend queues unbatched sends
    # and receives to the same peer on one CUDA stream (all of them, when the group was
    # created with a device_id, as ours are), so with 2 ranks each rank's receive would
    # wait for a send queued behind its peer's receive. A batch is one NCCL group call,
    # whose sends and receives progress together. gloo cannot batch and posts the two
    # one by one, as before.
    batch = [
        dist.P2POp(dist.irecv, recv_buf, src),
        dist.P2POp(dist.isend, send_buf, dst),
    ]
    for request in dist.batch_isend_irecv(batch):
        request.wait()


# --- begin ring ---
def ring_all_reduce(tensor: torch.Tensor, max_steps: int | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, with point-to-point messages only.

    ``max_steps`` stops after that many of the 2(N-1) steps, so a test (or a reader) can
    look at the half-done state and compare it with ``ring_schedule``.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    # a non-contiguous tensor has no flat view: work on a flat copy, copy it back
    contiguous = tensor.is_contiguous()
    flat = tensor.view(-1) if contiguous else tensor.flatten()
    # N views into the flat tensor, sizes differing by at most one (some empty when
    # numel < N). Every rank splits alike, so sender and receiver agree on sizes.
    chunks = torch.tensor_split(flat, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    steps = 2 * (n - 1) if max_steps is None else max_steps

    # Reduce-scatter: in step s, rank r passes its partial sum of chunk (r - s) to
    # the right and adds the left neighbour's into chunk (r - s - 1). A chunk gains
    # one rank per hop: after N-1 hops rank r holds the full sum of chunk (r + 1).
    for step in range(min(n - 1, steps)):
        send_c, recv_c = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_c])
        _send_recv(chunks[send_c], right, incoming, left)
        chunks[recv_c].add_(incoming)

    # All-gather: the finished chunks travel round the same way, but the receiver
    # overwrites its stale chunk (copy, not add), so it receives in place.
    for step in range(min(n - 1, steps - (n - 1))):
        send_c, recv_c = (rank - step + 1) % n, (rank - step) % n
        _send_recv(chunks[send_c], right, chunks[recv_c], left)
    if not contiguous:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# --- end ring ---


def ring_schedule(n_ranks: int) -> list[dict]:
    """The ring all-reduce on paper: the state at the start and after each of its 2(N-1)
    steps.

    Entry k (k = 0 is the start) has
      ``phase``    "start", "reduce-scatter" or "all-gather";
      ``step``     the step within its phase, counted from 1 (0 at the start);
      ``sends``    ``sends[r]``: the chunk rank r sent to rank r+1 in this step (None
                   at the start);
      ``receives`` ``receives[r]``: the chunk rank r received from rank r-1 and updated;
      ``holds``    ``holds[r][c]``: the ranks whose contributions chunk c on rank r
                   now sums.
    """
    n = n_ranks
    # at the start each rank has only its own data
    holds = [[frozenset({r})] * n for r in range(n)]
    entries = [
        dict(
            phase="start",
            step=0,
            sends=[None] * n,
            receives=[None] * n,
            holds=[row[:] for row in holds],
        )
    ]
    for phase, offset in (("reduce-scatter", 0), ("all-gather", 1)):
        for step in range(n - 1):
            sends = [(r - step + offset) % n for r in range(n)]
            receives = [(r - step - 1 + offset) % n for r in range(n)]
            before = [row[:] for row in holds]
            for r in range(n):
                left, c = (r - 1) % n, receives[r]
                # what the left neighbour sends is what r receives
                assert sends[left] == c
                if phase == "reduce-scatter":  # add the incoming partial sum to our own
                    holds[r][c] = before[r][c] | before[left][c]
                else:  # all-gather: the incoming chunk is complete, and replaces ours
                    holds[r][c] = before[left][c]
            entries.append(
                dict(
                    phase=phase,
                    step=step + 1,
                    sends=sends,
                    receives=receives,
                    holds=[row[:] for row in holds],
                )
            )
    return entries


# ---------------------------------------- the ring's pictures, drawn from ring_schedule
def _cell(held: frozenset, n: int) -> tuple[str, tuple, str]:
    """A chunk's label, fill and text colour: darker blue the more ranks its
    sum holds."""
    import matplotlib.pyplot as plt

    label = "all" if len(held) == n else "+".join(map(str, sorted(held)))
    return (
        label,
        plt.get_cmap("Blues")(0.15 + 0.75 * len(held) / n),
        "white" if len(held) / n > 0.6 else "black",
    )


def _title(entry: dict, n: int) -> str:
    start = entry["phase"] == "start"
    return (
        "start: each rank has only its own data"
        if start
        else f"{entry['phase']} {entry['step']} of {n - 1}"
    )


def ring_figure(n: int = 4):
    """One grid per step (a row per rank, a column per chunk), each cell naming the
    ranks its data sums so far; red frames mark the chunk each rank received in
    that step."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    schedule = ring_schedule(n)
    fig, axes = plt.subplots(2, n, figsize=(3.0 * n, 6.4))
    # None: between phases
    for ax, entry in zip(axes.flat, [schedule[0], *schedule[1:n], None, *schedule[n:]]):
        if entry is None:
            ax.axis("off")
            note = (
                "after reduce-scatter,\nrank r holds the full\nsum of chunk "
                "r+1;\nall-gather passes\nthe full sums on"
            )
            ax.text(
                0.5,
                0.5,
                note,
                ha="center",
                va="center",
                fontsize=10,
                transform=ax.transAxes,
            )
            continue
        ax.set(xlim=(-0.5, n - 0.5), ylim=(n - 0.5, -0.5), aspect="equal")
        ax.set_xticks(range(n), [f"chunk {c}" for c in range(n)], fontsize=8)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
        ax.tick_params(length=0)
        ax.spines[:].set_visible(False)
        for r in range(n):
            for c in range(n):
                label, fill, text = _cell(entry["holds"][r][c], n)
                ax.add_patch(
                    Rectangle((c - 0.5, r - 0.5), 1, 1, fc=fill, ec="white", lw=1.5)
                )
                ax.text(c, r, label, ha="center", va="center", fontsize=8.5, color=text)
            # the chunk received in this step: a red frame
            if (got := entry["receives"][r]) is not None:
                ax.add_patch(
                    Rectangle(
                        (got - 0.46, r - 0.46),
                        0.92,
                        0.92,
                        fill=False,
                        ec="#d62728",
                        lw=2.2,
                    )
                )
        ax.set_title(_title(entry, n), fontsize=10)
    fig.suptitle(
        f"Ring all-reduce on {n} ranks: whose data each chunk sums (red: "
        "received in this step)",
        fontsize=12,
    )
    fig.tight_layout()
    return fig


def step_html(entry: dict, n: int) -> str:
    """One step of the ring as an HTML table, with a sentence saying what moved."""
    from matplotlib.colors import to_hex

    rows = []
    for r in range(n):
        cells = ""
        for c in range(n):
            label, fill, text = _cell(entry["holds"][r][c], n)
            border = "#d62728" if entry["receives"][r] == c else "white"
            style = (
                f"background:{to_hex(fill)};color:{text};border:3px solid "
                f"{border};width:5.5em;height:2.2em"
            )
            cells += (
                "<td "
                f'style="{style};text-align:center;font-family:monospace">{label}</td>'
            )
        rows.append(
            '<tr><th style="padding-right:0.6em;text-align:right">rank '
            f"{r}</th>{cells}</tr>"
        )
    what = f"Each rank holds only its own tensor, cut into {n} chunks."
    if entry["phase"] != "start":
        verb = (
            "adds it into its own"
            if entry["phase"] == "reduce-scatter"
            else "overwrites its own copy"
        )
        sends = ", ".join(f"rank {r} → chunk {entry['sends'][r]}" for r in range(n))
        what = (
            f"Every rank sends one chunk to its right neighbour ({sends}); each "
            f"receiver {verb} (red frame)."
        )
    header = (
        "<tr><th></th>" + "".join(f"<th>chunk {c}</th>" for c in range(n)) + "</tr>"
    )
    table = f"<table style='border-collapse:collapse'>{header}{''.join(rows)}</table>"
    return (
        "<div "
        f"style='font-size:0.95em'><b>{_title(entry, n)}</b><p>{what}</p>{table}</div>"
    )


def ring_views(n: int = 4) -> list[str]:
    """The ring's steps, one HTML view each (``distlab.infra.stepper`` steps through
    them)."""
    return [step_html(e, n) for e in ring_schedule(n)]


def ring_bytes_sent_per_rank(numel: int, n_ranks: int, element_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce: 2(N-1)/N of the tensor.

    N-1 steps of reduce-scatter and N-1 of all-gather, each sending one chunk of 1/N of
    the tensor (exact when N divides numel; otherwise chunk sizes differ by
    one element).
    """
    return ring_bytes_sent("all-reduce", numel * element_size, n_ranks)


def rank0_bytes_sent(numel: int, n_ranks: int, element_size: int) -> float:
    """Bytes rank 0 sends when it gathers every gradient, adds them and sends the sum
    back: N-1 copies of the tensor (and it receives as many)."""
    return (n_ranks - 1) * numel * element_size


def traffic_figure(numel: int, element_size: int = 4, ranks=(2, 8, 64, 512)):
    """Bytes the busiest rank sends to all-reduce ``numel`` elements, against N:
    through rank 0, and around a ring."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    star = [rank0_bytes_sent(numel, n, element_size) / 1e6 for n in ranks]
    ring = [ring_bytes_sent_per_rank(numel, n, element_size) / 1e6 for n in ranks]
    ax.plot(ranks, star, "o-", color="#d62728", lw=3, label="via rank 0")
    ax.plot(ranks, ring, "o-", color="#3b6ea5", lw=3, label="ring")
    # the gap at the largest N, as an arrow with its ratio
    ax.annotate(
        "",
        (ranks[-1], star[-1]),
        (ranks[-1], ring[-1]),
        arrowprops={"arrowstyle": "<->", "color": "#555", "lw": 1.5},
    )
    ax.text(
        ranks[-1] / 1.15,
        (star[-1] * ring[-1]) ** 0.5,
        f"{star[-1] / ring[-1]:.0f}x",
        fontsize=16,
        ha="right",
        va="center",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ranks, [str(n) for n in ranks], fontsize=14)
    ax.tick_params(axis="y", labelsize=14)
    ax.minorticks_off()
    ax.set_xlabel("ranks N", fontsize=15)
    ax.set_ylabel("MB the busiest\nrank sends", fontsize=15)
    ax.legend(fontsize=15, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def model_time(alpha: float, bandwidth: float, n: int, nbytes: int) -> float:
    """The ring's alpha-beta model: 2(N-1) latencies plus 2(N-1)/N of the bytes at
    ``bandwidth``."""
    return collective_s("all-reduce", nbytes, n, Link("ring", alpha, bandwidth, ""))


def blocking_ring_send_first(tensor: torch.Tensor) -> torch.Tensor:
    """Pass ``tensor`` one hop to the right with blocking calls, sending first.
    Deadlocks on gloo."""
    rank, n = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    # gloo's blocking send returns once the right neighbour has posted its receive,
    # at any size; but that neighbour is in its own send, and so on round the ring.
    dist.send(tensor, (rank + 1) % n)
    dist.recv(received, (rank - 1) % n)
    return received


def parity_ring_exchange(tensor: torch.Tensor) -> torch.Tensor:
    """The same exchange with blocking calls that cannot deadlock: odd ranks
    receive first."""
    rank, n = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    if n == 1:
        return received.copy_(tensor)
    # Rank 1 receives first, so rank 0's send completes, so rank 0 can receive, and so
    # on: the cycle of waits is broken. With N odd, ranks N-1 and 0 are both even and
    # both send first, but rank 0's send still completes because rank 1 is odd.
    if rank % 2 == 0:
        dist.send(tensor, (rank + 1) % n)
        dist.recv(received, (rank - 1) % n)
    else:
        dist.recv(received, (rank - 1) % n)
        dist.send(tensor, (rank + 1) % n)
    return received
