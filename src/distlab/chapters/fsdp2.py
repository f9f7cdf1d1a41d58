"""Look inside FSDP2 on our GPT, per rank (``book/fsdp2.md``, ``distlab.bench.fsdp``).

Each function runs on every rank of a group (``run_ranks(f, nprocs=2)``) and returns
plain data: shard shapes, FSDP2's profiler ranges, units kept whole and collectives
counted, op dtypes, the stitched-weights pitfall, eval and sampling, and training
(losses, bytes per rank, tokens/s) under ``STRATEGIES``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from distlab.data import token_data
from distlab.errors import UserError
from distlab.infra import experiment
from distlab.infra.experiment import build, gpt
from distlab.memory import memory_tracker, tracker_snapshot
from distlab.model import GPT
from distlab.parallel import apply_fsdp, check_same_weights
from distlab.runtime import dist_env, pick_device, rank_world
from distlab.tools.collective_bytes import CollectiveBytes
from distlab.tools.dtypes import OpDtypes

STRATEGIES = ("single", "ddp", "fsdp2", "fsdp2-no-reshard", "fsdp2-bf16", "hsdp")


def shard_table(preset_name: str = "tiny", strategy: str = "fsdp2") -> list[dict]:
    """Each parameter's name, global and local (this rank's) shape, placements."""
    model = build(strategy, preset_name).model
    return [
        {
            "name": name,
            "global": tuple(p.shape),
            "local": tuple(p.to_local().shape),
            "placements": str(p.placements),
        }
        for name, p in model.named_parameters()
    ]


def train(
    strategy: str,
    preset_name: str = "tiny",
    steps: int = 5,
    global_batch: int = 16,
    seed: int = 1337,
    lr: float = 1e-3,
    track_peak: bool = False,
) -> dict:
    """``experiment.train`` (losses, step times, ``state_bytes`` per rank) and, with
    ``track_peak``, the ``peak`` bytes by kind of the last step (else None)."""
    peak: dict[str, int] = {}

    def track_the_last_step(exp, step):
        if track_peak and step == steps - 1:
            return _peak_bytes(exp.model, exp.optimizer, peak)
        return contextlib.nullcontext()

    result = experiment.train(
        strategy,
        preset_name,
        steps,
        global_batch,
        seed,
        lr,
        around_step=track_the_last_step,
    )
    return {**result, "peak": peak or None}


@contextlib.contextmanager
def _peak_bytes(model, optimizer, into: dict):
    """Peak bytes by kind during the block, from PyTorch's (private, CPU-capable)
    memory trackers (``FSDPMemTracker`` for an FSDP2 model: ``memory_tracker``)."""
    tracker = memory_tracker(model, optimizer)
    with tracker:
        yield
    # not the CPU's, on a GPU
    peak = tracker_snapshot(tracker, "peak", next(model.parameters()).device)
    into.update({str(kind): int(n) for kind, n in peak.items()})


def _batch(model: GPT, rows_per_rank: int, device: torch.device, step: int = 0):
    """This rank's ``rows_per_rank`` rows of the global batch of ``step``."""
    rank, world_size = rank_world()
    T = model.config.block_size
    return token_data().batch(
        "train", step, rows_per_rank * world_size, T, 0, rank, world_size, device
    )


# c10d's names
COLLECTIVES = {
    "all-gathers": "_allgather_base_",
    "reduce-scatters": "_reduce_scatter_base_",
}


def resharding(
    blocks: bool | str = True, root: bool | None = False, preset_name: str = "tiny"
) -> dict:
    """``fully_shard`` with ``reshard_after_forward=blocks`` on each block ("all but
    last": the last block False) and ``root`` on the root (None: left unset). Returns
    which units hold whole parameters right after forward, their bytes, and the
    all-gathers and reduce-scatters of one step's forward and backward, counted by
    torch's ``CommDebugMode`` (the step after a warm-up step)."""
    import warnings

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    device = pick_device("auto", dist_env()[1])
    model = gpt(preset_name).to(device)
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        # "all but last": torchtitan's default, the last block kept whole
        keep = blocks == "all but last" and i == last
        fully_shard(block, reshard_after_forward=bool(blocks) and not keep)
    fully_shard(model, **({} if root is None else {"reshard_after_forward": root}))
    x, y = _batch(model, 2, device)
    # warm-up: FSDP2 decides which unit is the root on the first forward
    model(x, y)[1].backward()
    with warnings.catch_warnings():
        # CommDebugMode's module hooks warn that token ids need no gradient
        warnings.simplefilter("ignore")
        with CommDebugMode() as forward:
            loss = model(x, y)[1]
        # a unit kept whole shows plain tensors now, not DTensor shards
        whole = {}
        for name, p in model.named_parameters():
            unit = (
                ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
            )
            whole[unit] = whole.get(unit, 0) + (
                0 if hasattr(p, "to_local") else p.numel() * p.element_size()
            )
        with CommDebugMode() as backward:
            loss.backward()
    counts = {}
    for phase, comm in (("forward", forward), ("backward", backward)):
        seen = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        counts.update(
            {f"{phase} {kind}": seen.get(op, 0) for kind, op in COLLECTIVES.items()}
        )
    return {"whole_after_forward": whole, **counts}


def _note(into: dict, key: str, pick: Callable) -> Callable:
    """A module hook that notes ``pick(*hook arguments)`` under ``key`` once and
    returns None (a returned value would replace the module's inputs or output)."""

    def hook(*args) -> None:
        into.setdefault(key, pick(*args))

    return hook


def mixed_precision_dtypes(preset_name: str = "tiny") -> dict[str, str]:
    """The dtype of each kind of tensor in one training step under
    ``apply_fsdp(param_dtype=bf16)``."""
    exp = build("fsdp2-bf16", preset_name)
    qkv, seen = exp.model.blocks[0].attn.qkv, {}
    qkv.register_forward_pre_hook(
        _note(seen, "parameter inside forward", lambda m, inputs: m.weight.dtype)
    )
    x, y = _batch(exp.model, exp.global_batch // exp.world_size, exp.device)
    logits, loss = exp.model(x, y)
    loss.backward()
    exp.optimizer.step()
    p = qkv.weight
    seen.update(
        {
            "sharded parameter (the master weight)": p.dtype,
            "gradient of the shard": p.grad.dtype,
            "AdamW moments": exp.optimizer.state[p]["exp_avg"].dtype,
            "logits": logits.dtype,
            "loss": loss.dtype,
        }
    )
    return {k: str(v).removeprefix("torch.") for k, v in seen.items()}


def op_dtypes(mechanism: str = "policy", preset_name: str = "tiny") -> list[dict]:
    """Which dtype each operator of one training step ran in (``distlab.tools.dtypes``).

    ``policy``: labs 4-5, ``apply_fsdp(param_dtype=bf16)`` (on every rank of a group);
    ``autocast``: labs 1-3, bf16 autocast around the forward of the plain model."""
    if mechanism not in ("policy", "autocast"):
        raise ValueError(f"unknown mechanism {mechanism!r}; choose policy or autocast")
    exp = build("fsdp2-bf16" if mechanism == "policy" else "single", preset_name)

    def autocast():
        enabled = mechanism == "autocast"
        return torch.autocast(exp.device.type, torch.bfloat16, enabled=enabled)

    # the first builds FSDP2's lazy state and AdamW's moments; record the second
    for step in (0, 1):
        ops = OpDtypes() if step else contextlib.nullcontext()
        with ops:
            with autocast():
                loss = exp.loss(step)
            exp.backward(loss)
            if step:
                ops.phase = "optimizer"
            exp.optimizer.step()
        exp.optimizer.zero_grad(set_to_none=True)
    return ops.rows()


# (label, the blocks' and the root's MixedPrecisionPolicy fields beyond
# param_dtype=bf16, reduce_dtype=fp32)
POLICY_VARIANTS = [
    ("the labs' policy", {}, {}),
    (
        "cast_forward_inputs=False",
        {"cast_forward_inputs": False},
        {"cast_forward_inputs": False},
    ),
    ("output_dtype=fp32 on the root", {}, {"output_dtype": torch.float32}),
    (
        "output_dtype=fp32 on every unit",
        {"output_dtype": torch.float32},
        {"output_dtype": torch.float32},
    ),
]


def policy_variants(preset_name: str = "tiny") -> list[dict]:
    """What ``output_dtype`` and ``cast_forward_inputs`` change (``POLICY_VARIANTS``):
    the dtypes that cross the unit boundaries in one forward, or the error the forward
    stops with."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = pick_device("auto", dist_env()[1])
    rows = []
    for label, for_blocks, for_root in POLICY_VARIANTS:
        model = gpt(preset_name).to(device)
        for block in model.blocks:
            fully_shard(
                block,
                mp_policy=MixedPrecisionPolicy(
                    torch.bfloat16, torch.float32, **for_blocks
                ),
            )
        fully_shard(
            model,
            mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32, **for_root),
        )
        row = {"policy": label}
        # FSDP2's own hooks run first (its pre-hook is prepended): these see the dtypes
        # after its casts
        model.blocks[0].register_forward_hook(
            _note(row, "block 0 returns", lambda m, inputs, out: out.dtype)
        )
        model.blocks[1].ln1.register_forward_pre_hook(
            _note(row, "block 1 computes on", lambda m, inputs: inputs[0].dtype)
        )
        x, y = _batch(model, 2, device)
        try:
            logits, loss = model(x, y)
            row.update({"logits": logits.dtype, "loss": loss.dtype})
        except RuntimeError as error:  # two dtypes meet inside a unit
            row["error"] = str(error).splitlines()[0]
        rows.append(
            {
                k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
                for k, v in row.items()
            }
        )
    return rows


def meta_init_equals_plain(preset_name: str = "tiny", seed: int = 7) -> float:
    """Build on the meta device (no memory), shard, allocate only the shards, then
    initialise: the largest difference from a plainly built model's weights."""
    from torch.distributed.tensor.experimental import implicit_replication

    device = pick_device("auto", dist_env()[1])
    # the reference, built and initialised plainly
    plain = gpt(preset_name, seed).to(device)
    with torch.device("meta"):
        # the same config, shapes only: nothing is allocated
        model = GPT(plain.config, seed)
    # meta parameters have no device yet: say where the shards will live
    apply_fsdp(model, device=device)
    model.to_empty(device=device)  # allocates this rank's shards, uninitialised
    # a full-size tensor copied into a DTensor keeps this rank's slice
    with implicit_replication():
        model.init_weights(seed)
    return max(
        (a.full_tensor() - b).abs().max().item()
        for a, b in zip(model.parameters(), plain.parameters())
    )


def gradient_check(preset_name: str = "tiny", global_batch: int = 16) -> float:
    """Largest |FSDP2 gradient - single-process gradient|: a sum over ranks instead of
    the average would make it as large as the gradients themselves."""
    plain = build("single", preset_name, global_batch)
    plain.backward(plain.loss(0))  # the whole batch in this process
    sharded = build("fsdp2", preset_name, global_batch)
    sharded.backward(sharded.loss(0))  # this rank's rows
    worst = 0.0
    for p, ref in zip(sharded.model.parameters(), plain.model.parameters()):
        # reassemble the shards to compare with the whole gradient
        full = p.grad.full_tensor()
        worst = max(worst, (full - ref.grad).abs().max().item())
    return worst


def different_seeds(preset_name: str = "tiny", steps: int = 3) -> dict:
    """The pitfall: each rank builds the GPT from its own seed and shards it unchecked.

    Returns the rows of the whole token embedding that equal each rank's own build, the
    losses of ``steps`` AdamW steps (they train, without an error), and what
    ``check_same_weights`` says about the same models before sharding."""
    rank, world_size = rank_world()
    device = pick_device("auto", dist_env()[1])
    # every rank's build
    built = [
        gpt(preset_name, seed=100 + r).wte.weight.detach() for r in range(world_size)
    ]
    model = gpt(preset_name, seed=100 + rank).to(device)  # the mistake: a seed per rank
    try:
        check_same_weights(model)
        caught = None
    except UserError as error:
        caught = str(error)
    # what fully_shard does on its own: no broadcast, no check
    apply_fsdp(model, check_weights=False)
    whole = model.wte.weight.full_tensor().cpu()
    rows_from = {r: int((whole == w).all(dim=1).sum()) for r, w in enumerate(built)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = _batch(model, 8, device, step)
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "rows": whole.shape[0],
        "rows_from": rows_from,
        "losses": losses,
        "caught": caught,
    }


def outside_training(preset_name: str = "tiny", new_tokens: int = 4) -> dict:
    """Eval and sampling on the sharded model, run by every rank: is the root whole
    after a no-grad forward and after ``reshard()``; the all-gathers of ``generate``;
    are its tokens the plain model's."""
    device = pick_device("auto", dist_env()[1])
    plain, model = gpt(preset_name).to(device), gpt(preset_name).to(device)
    apply_fsdp(model)
    x, y = _batch(model, 2, device)

    def root_whole() -> bool:  # whole: a plain tensor, not a DTensor shard
        return not hasattr(model.wte.weight, "to_local")

    with torch.no_grad():
        model(x, y)  # an evaluation step
        seen = {"root whole after eval": root_whole()}
        model.reshard()  # frees the root's whole parameters (not recursive)
        seen["after reshard()"] = root_whole()
        prompt, tokens = x[:1, :4], {}
        for name, m in (("sharded", model), ("plain", plain)):
            gen = torch.Generator(device).manual_seed(0)
            with CollectiveBytes() as comm:
                tokens[name] = m.generate(prompt, new_tokens, 0.01, gen)
            if name == "sharded":
                seen["generate all-gathers"] = comm.counts().get("all-gather", 0)
    seen["same tokens"] = torch.equal(tokens["sharded"], tokens["plain"])
    return seen
