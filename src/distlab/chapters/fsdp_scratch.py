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


def parameter_names(fsdp: ScratchFSDP) -> list[list[str]]:
    """Per unit, its parameters' names in the unwrapped model (a tied parameter: its
    first name, as ``named_parameters`` gives it)."""
    module_name = {m: name for name, m in fsdp.model.named_modules()}
    return [
        [f"{module_name[m]}.{attr}".lstrip(".") for m, attr in (o[0] for o in u.owners)]
        for u in fsdp.units
    ]


def shard_grad(unit) -> torch.Tensor:
    """This rank's flat gradient of a unit, (padded / N,) fp32: its pieces' gradients
    in place, zeros where a piece has none."""
    flat = torch.zeros_like(unit.shard)
    for piece, where in zip(unit.pieces, unit.slices):
        if piece.grad is not None:
            flat[where] = piece.grad
    return flat


def whole(fsdp: ScratchFSDP, grads: bool = True) -> dict[str, torch.Tensor | None]:
    """Every parameter of the unwrapped model by name, all-gathered from the shards
    (fp32): its gradient (None where its pieces got none: unused or frozen) or, with
    ``grads=False``, its value. Ignored parameters as this rank holds them."""
    n, group = dist.get_world_size(fsdp.group), fsdp.group
    pieces = {id(p) for unit in fsdp.units for p in unit.pieces}
    out = {
        name: p.grad if grads else p.detach()
        for name, p in fsdp.model.named_parameters()
        if id(p) not in pieces
    }
    for unit, names in zip(fsdp.units, parameter_names(fsdp)):
        flat = shard_grad(unit) if grads else unit.shard.detach()
        full = torch.empty(flat.numel() * n, device=flat.device)
        dist.all_gather_single(full, flat.float().contiguous(), group=group)
        values = torch.split(full, unit.numels + [unit.padding])
        for piece, value, shape, name in zip(unit.pieces, values, unit.shapes, names):
            missing = grads and piece.grad is None
            out[name] = None if missing else value.view(shape)
    return out


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
        fsdp2 = variant.startswith("fully_shard")
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
                first_grads = (
                    whole(fsdp)
                    if fsdp
                    else {
                        name: p.grad.full_tensor() if fsdp2 else p.grad
                        for name, p in model.named_parameters()
                    }
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            if variant != "one process":
                # SUM of the ranks' means over N: the global batch's mean
                dist.all_reduce(total)
                total /= n
            losses.append(total.item())
        out[variant] = {"losses": losses, "grads": first_grads}
    want = out["one process"]["grads"]
    for result in out.values():
        grads = result.pop("grads")
        result["grad_rel_diff"] = max(
            ((grads[k].float() - w).norm() / w.norm()).item() for k, w in want.items()
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


def shard_gradients_vs_one_process() -> dict[str, dict[str, float]]:
    """Per unit, the largest difference between this rank's shard gradient and its
    slice of the one-process gradient of the same batch, averaged (ours) and summed
    (forgot to divide), and the largest value of that slice."""
    from distlab.data import token_data
    from distlab.infra.experiment import gpt

    data, rank, n = token_data(), dist.get_rank(), dist.get_world_size()
    reference, model = gpt("tiny", 1337), gpt("tiny", 1337)
    reference(*data.batch("train", 0, 16, 64, 1337))[1].backward()  # all 16 rows
    fsdp = shard_model(model, {Block})
    model(*data.batch("train", 0, 16, 64, 1337, rank, n))[1].backward()  # its 8
    units = {}
    for unit, (name, _, params) in zip(fsdp.units, unit_parameters(reference, {Block})):
        flat = [p.grad.reshape(-1) for p in params] + [torch.zeros(unit.padding)]
        expected, ours = torch.cat(flat).chunk(n)[rank], shard_grad(unit)
        units[name] = {
            "averaged": (ours - expected).abs().max().item(),
            "summed": (n * ours - expected).abs().max().item(),
            "largest": expected.abs().max().item(),
        }
    return units


def gloo_reduce_scatter() -> dict:
    """What a gloo reduce-scatter runs underneath, and whether it honours AVG."""
    n, rank = dist.get_world_size(), dist.get_rank()
    # rank r sends r + 1
    grad, shard = torch.full((4 * n,), float(rank + 1)), torch.empty(4)
    with torch.profiler.profile() as prof:
        dist.reduce_scatter_single(shard, grad, op=dist.ReduceOp.AVG)
    names = {e.name for e in prof.events()}
    ops = sorted(name for name in names if name.startswith(("gloo:", "c10d::")))
    return {"ops": ops, "avg": shard[0].item(), "expected_avg": (n + 1) / 2}


def parameters_after_wrapping() -> dict[str, list[tuple]]:
    """(name, type, global shape, this rank's shape) of the parameters each wrapper
    leaves on the tiny GPT."""
    from distlab.infra.experiment import gpt
    from distlab.parallel import apply_fsdp

    fsdp2, scratch = apply_fsdp(gpt("tiny", 1337)), gpt("tiny", 1337)
    shard_model(scratch, {Block})
    return {
        "fully_shard": [
            (name, type(p).__name__, tuple(p.shape), tuple(p.to_local().shape))
            for name, p in fsdp2.named_parameters()
        ],
        "from scratch": [
            (name, type(p).__name__, tuple(p.shape), tuple(p.shape))
            for name, p in scratch.named_parameters()
        ],
    }


def page_run(steps: int) -> dict:
    """On every rank, everything the page shows, in one launch."""
    return {
        **compare(steps),  # losses, state bytes and (from scratch) last step's events
        "grads": shard_gradients_vs_one_process(),
        "gloo": gloo_reduce_scatter(),
        "parameters": parameters_after_wrapping(),
        "second": second_model(steps),  # a conv net: fp32 and bf16, ours and FSDP2's
        "gathered": gathered_units(),  # which units are whole in each fwd and bwd
    }
