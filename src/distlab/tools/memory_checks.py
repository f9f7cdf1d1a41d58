"""What the memory calculator is checked against: the ZeRO paper's own formulas and its
Table 1, transcribed, and the exact tensor-by-tensor layout of DDP's and FSDP2's state.

    paper_table_1()                         # every cell: ours, printed, agreement
    zero_paper_bytes(7.5e9, 64, stage=3)    # Figure 1's 1.88 GB
    agrees_with_print(1.875, "1.88")        # "rounded"
    # to the byte, from the shapes
    exact_adamw_state_bytes(shapes, ranks=4, rank=3, fsdp2=True)
    allocated_state_bytes(model, optimizer)  # the storages behind the tensors

The calculator (``distlab.tools.memory_calculator``) counts bytes per parameter; these
count what the paper printed and what the ranks really hold, so the ZeRO chapter can
compare them.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from distlab.tools.memory_calculator import GB, per_rank_bytes


def zero_paper_bytes(psi: float, n_d: int, stage: int, k: int = 12) -> float:
    """The paper's own formulas (its Figure 1): baseline (2+2+K)Ψ, P_os 4Ψ + KΨ/N_d,
    P_os+g 2Ψ + (2+K)Ψ/N_d, P_os+g+p (4+K)Ψ/N_d."""
    return [
        (4 + k) * psi,
        4 * psi + k * psi / n_d,
        2 * psi + (2 + k) * psi / n_d,
        (4 + k) * psi / n_d,
    ][stage]


# Table 1 of the paper (arXiv 1910.02054, Section 5.2), per-device GB, printed as
# strings because the printed digits are part of the check: {model: {stage: [N_d=1, 4,
# 16, 64, 256, 1024]}} Figure 1 of the paper (arXiv 1910.02054 v3): 7.5B parameters, N_d
# = 64, K = 12, baseline and stages 1 to 3, printed to fewer digits than Table 1 (its
# last bar says 1.9 GB, Table 1 1.88)
PAPER_FIGURE_1 = ("120", "31.4", "16.6", "1.9")
PAPER_DP = (1, 4, 16, 64, 256, 1024)
PAPER_TABLE_1 = {
    7.5e9: {
        1: "120 52.5 35.6 31.4 30.4 30.1",
        2: "120 41.3 21.6 16.6 15.4 15.1",
        3: "120 30 7.5 1.88 0.47 0.12",
    },
    128e9: {
        1: "2048 896 608 536 518 513",
        2: "2048 704 368 284 263 257",
        3: "2048 512 128 32 8 2",
    },
    1e12: {
        1: "16000 7000 4750 4187 4046 4011",
        2: "16000 5500 2875 2218 2054 2013",
        3: "16000 4000 1000 250 62.5 15.6",
    },
}


def agrees_with_print(value: float, printed: str) -> str | None:
    """'rounded' or 'truncated' if ``value`` printed to ``printed``'s decimals gives it,
    else None."""
    decimals = len(printed.partition(".")[2])
    scale = 10**decimals
    if math.floor(value * scale + 0.5 + 1e-9) / scale == float(printed):
        return "rounded"
    if math.floor(value * scale + 1e-9) / scale == float(printed):
        return "truncated"
    return None


def fsdp2_local_rows(rows: int, ranks: int, rank: int) -> int:
    """Rows of a dim-0-sharded tensor on ``rank``: chunks of ceil(rows/N); the last
    ranks may hold fewer, or none."""
    chunk = -(-rows // ranks)
    return max(0, min(rows, (rank + 1) * chunk) - rank * chunk)


def exact_adamw_state_bytes(
    shapes: list[tuple[int, ...]],
    ranks: int,
    rank: int,
    fsdp2: bool,
    storage: bool = False,
) -> dict[str, int]:
    """fp32 AdamW state on one rank, tensor by tensor, as DDP or FSDP2 lays it out.

    Under FSDP2 each tensor is split along dim 0. ``storage=False`` counts what
    ``to_local()`` shows (``distlab.memory.state_bytes``); ``storage=True`` counts the
    memory allocated: FSDP2 pads parameters and gradients to ceil(rows/N) rows on every
    rank, while AdamW's moments (``zeros_like`` of the local shard) are not padded.
    AdamW also keeps a 4-byte ``step`` tensor per parameter tensor.
    """
    local = padded = 0
    for shape in shapes:
        rows, per_row = shape[0], math.prod(shape[1:])
        local += per_row * (fsdp2_local_rows(rows, ranks, rank) if fsdp2 else rows)
        padded += per_row * (-(-rows // ranks) if fsdp2 else rows)
    weights = 4 * (padded if storage else local)
    out = {
        "params": weights,
        "grads": weights,
        "optimizer": 2 * 4 * local + 4 * len(shapes),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


_STAGES = ("ddp", "zero1", "zero2", "fsdp2")  # the paper's stage -> our strategy


def paper_table_1() -> list[dict]:
    """Each cell of the paper's Table 1 (bf16 mixed precision, AdamW) as the calculator
    computes it, next to the printed value and how the two agree ("rounded", "truncated"
    or None)."""
    rows = []
    for psi, stages in PAPER_TABLE_1.items():
        for stage, printed in stages.items():
            for n, cell in zip(PAPER_DP, printed.split()):
                ours = (
                    per_rank_bytes(psi, n, "bf16_mixed", "adamw", _STAGES[stage])[
                        "total"
                    ]
                    / GB
                )
                rows.append(
                    {
                        "psi": psi,
                        "stage": stage,
                        "ranks": n,
                        "ours_gb": ours,
                        "printed": cell,
                        "agrees": agrees_with_print(ours, cell),
                    }
                )
    return rows


def allocated_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, int]:
    """Like ``state_bytes``, but the bytes of the storages behind the tensors, each
    counted once."""

    def storage_bytes(tensors) -> int:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        return sum(
            {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in local
            }.values()
        )

    params = list(model.parameters())
    out = {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": storage_bytes(
            v
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        ),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
