"""The FSDP-from-scratch chapter's experiments: the from-scratch FSDP of
``distlab.scratch.fsdp`` trained beside torch's ``fully_shard`` and one process, on the
GPT and on a second model, and what its event trace and FSDP2's own state say about
which units are gathered when.

    # the GPT: each variant's losses, state bytes, trace
    run_ranks(compare, nprocs=2, args=(10,))
    # the one-process reference (distlab.infra.experiment)
    train("single", steps=10)
    # a conv net with its own block class, fp32 and bf16
    run_ranks(second_model, nprocs=2, args=(5,))
    # which units are gathered in each block's fwd and bwd
    run_ranks(gathered_units, nprocs=2)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.infra.experiment import WrapOptions, train
from distlab.model import GPT, Block, preset
from distlab.runtime import dist_env, pick_device
from distlab.scratch.fsdp import Event, ScratchFSDP, shard_model
from distlab.scratch.fsdp_units import unit_parameters

# from scratch, freeing each block after its forward (ZeRO-3) and keeping it; then FSDP2
VARIANTS = ("fsdp-scratch", "fsdp-scratch-no-reshard", "fsdp2")


def compare(
    steps: int = 10, global_batch: int = 16, seed: int = 1337
) -> dict[str, dict]:
    """On every rank: each of ``VARIANTS`` trained on the tiny GPT, the same batches
    from the same weights (``experiment.train``). Each result has the global mean loss
    of every step, this rank's state bytes after the first step and, from scratch, the
    last step's events."""
    runs = {}
    for strategy in VARIANTS:
        trace: list[Event] | None = [] if strategy.startswith("fsdp-scratch") else None
        result = train(
            strategy,
            "tiny",
            steps,
            global_batch,
            seed,
            options=WrapOptions(trace=trace),
        )
        runs[strategy] = {**result, "trace": trace}
    return runs


def gathered_bytes(trace: list[Event]) -> dict[str, int]:
    """Bytes of gathered (full) parameters when forward ends, at most during backward,
    at the end."""
    end_of_forward = next(e for e in trace if e.unit == "root" and e.what == "forward")
    backward = [e.gathered_bytes for e in trace if e.start >= end_of_forward.end]
    return {
        "end_of_forward": end_of_forward.gathered_bytes,
        "backward_max": max(backward),
        "after_backward": trace[-1].gathered_bytes,
    }


# --- begin second model ---
class ConvBlock(nn.Module):
    """A residual convolution block: (B, C, H, W) -> (B, C, H, W)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        # no running statistics: nothing for ranks to disagree on
        self.norm = nn.GroupNorm(4, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.gelu(self.norm(self.conv1(x))))


class ConvNet(nn.Module):
    """A stem, residual blocks and a linear classifier: nothing like the GPT."""

    def __init__(
        self, channels: int = 16, n_blocks: int = 3, classes: int = 10, seed: int = 0
    ):
        super().__init__()
        # the same weights on every rank, the global RNG untouched
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.stem = nn.Conv2d(3, channels, 3, padding=1)
            self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(n_blocks)))
            self.head = nn.Linear(channels, classes)

    # (B, 3, H, W) -> (B, classes)
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)).mean(dim=(2, 3)))


# --- end second model ---


def reassembled_gradients(fsdp: ScratchFSDP) -> list[torch.Tensor]:
    """Every parameter's whole gradient, all-gathered from the shards (fp32), in the
    order of ``unit_parameters``: for comparing with one process or with FSDP2."""
    n, grads = dist.get_world_size(fsdp.group), []
    for unit in fsdp.units:
        full = torch.empty(unit.shard.numel() * n, device=unit.shard.device)
        dist.all_gather_single(full, unit.shard.grad.detach().float(), group=fsdp.group)
        pieces = torch.split(full, unit.numels + [unit.padding])
        grads += [g.view(shape) for g, shape in zip(pieces, unit.shapes)]
    return grads


def _conv_batches(steps: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(steps, global_batch, 3, 8, 8, generator=gen), torch.randint(
        0, 10, (steps, global_batch), generator=gen
    )


def _fully_shard_conv(model: ConvNet, dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype
        else MixedPrecisionPolicy()
    )
    for module in model.modules():
        if isinstance(module, ConvBlock):
            fully_shard(module, mp_policy=mp)
    fully_shard(model, mp_policy=mp)  # the root: the stem and the head


def second_model(steps: int = 5, global_batch: int = 16, lr: float = 1e-2) -> dict:
    """On every rank: ``ConvNet`` trained ``steps`` AdamW steps four ways, from scratch
    with the policy ``{ConvBlock}`` and with ``fully_shard`` on every ``ConvBlock``,
    each in fp32 and computing in bf16, beside one process in fp32. Per variant: the
    global mean loss of each step, and the largest difference of the first step's
    gradients from one process's."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = pick_device("auto", dist_env()[1])  # the rank's: a GPU's under NCCL
    images, labels = (t.to(device) for t in _conv_batches(steps, global_batch))
    mine = slice(rank * global_batch // n, (rank + 1) * global_batch // n)
    out = {}
    for variant in (
        "one process",
        "scratch",
        "scratch bf16",
        "fully_shard",
        "fully_shard bf16",
    ):
        model, fsdp, dtype = (
            ConvNet().to(device),
            None,
            torch.bfloat16 if variant.endswith("bf16") else None,
        )
        if variant.startswith("scratch"):
            fsdp = shard_model(model, {ConvBlock}, compute_dtype=dtype)
        elif variant.startswith("fully_shard"):
            _fully_shard_conv(model, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, first_grads = [], None
        for x, y in zip(images, labels):
            rows = slice(None) if variant == "one process" else mine
            # a mean over this rank's rows
            loss = F.cross_entropy(model(x[rows]).float(), y[rows])
            loss.backward()
            if first_grads is None:
                grads = (
                    reassembled_gradients(fsdp)
                    if fsdp
                    else [
                        p.grad.full_tensor()
                        if hasattr(p.grad, "full_tensor")
                        else p.grad
                        for p in model.parameters()
                    ]
                )
                first_grads = [g.detach().float().clone() for g in grads]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            if variant != "one process":
                # SUM of the ranks' means over N: the global batch's mean
                dist.all_reduce(total)
                total /= n
            losses.append(total.item())
        out[variant] = {"losses": losses, "grads": first_grads}
    # the one-process model's parameter order, and unit_parameters' order, line up
    # the gradients
    reference = ConvNet()
    order = [
        p for _, _, slots in unit_parameters(reference, {ConvBlock}) for p in slots
    ]
    position = {p: i for i, p in enumerate(reference.parameters())}
    want = [out["one process"]["grads"][position[p]] for p in order]
    for variant, result in out.items():
        grads = result.pop("grads")
        # one process and FSDP2: the module's own order
        if not variant.startswith("scratch"):
            grads = [grads[position[p]] for p in order]
        result["grad_rel_diff"] = max(
            ((g - w).norm() / w.norm()).item() for g, w in zip(grads, want)
        )
    return out


def gathered_units(n_layer: int = 4) -> dict[str, list[tuple[str, dict[str, str]]]]:
    """On every rank: a GPT of ``n_layer`` tiny blocks, sharded from scratch and by
    FSDP2. In the middle of each block's forward and of its backward, the state of every
    unit: "gathered" (its full parameters exist), "all-gathered, waiting" (FSDP2 holds
    the all-gather's result, not yet copied out into the parameters: a prefetch)
    or "sharded"."""
    from distlab.data import token_data
    from distlab.parallel import apply_fsdp

    cfg = preset("tiny", n_layer=n_layer, vocab_size=token_data().vocab_size)
    device = pick_device("auto", dist_env()[1])
    idx = torch.randint(
        0,
        cfg.vocab_size,
        (2, 2, cfg.block_size),
        generator=torch.Generator().manual_seed(0),
    )
    idx = idx.to(device)
    out = {}
    for wrapper in ("from scratch", "fully_shard"):
        model = GPT(cfg, seed=0).to(device)
        units = {f"blocks.{i}": block for i, block in enumerate(model.blocks)} | {
            "root": model
        }
        if wrapper == "fully_shard":
            apply_fsdp(model)

            def state(name, units=units):
                group = units[name]._get_fsdp_state()._fsdp_param_groups[0]
                pending = (
                    group._all_gather_result is not None and not group.is_unsharded
                )
                return (
                    "gathered"
                    if group.is_unsharded
                    else "all-gathered, waiting"
                    if pending
                    else "sharded"
                )
        else:
            # the same names
            fsdp_units = {unit.name: unit for unit in shard_model(model, {Block}).units}

            def state(name, fsdp_units=fsdp_units):
                return (
                    "gathered"
                    if fsdp_units[name].full.untyped_storage().nbytes()
                    else "sharded"
                )

        log: list[tuple[str, dict[str, str]]] = []

        def snapshot(where, units=units, log=log, state=state):
            log.append((where, {name: state(name) for name in units}))

        # the MLP runs in the middle of its block, both ways
        for i, block in enumerate(model.blocks):

            def probe(module, args, output, i=i, snapshot=snapshot):
                snapshot(f"forward of blocks.{i}")
                output.register_hook(lambda grad: snapshot(f"backward of blocks.{i}"))

            block.mlp.register_forward_hook(probe)
        model(*idx)[1].backward()
        out[wrapper] = log
    return out
