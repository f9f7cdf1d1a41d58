r"""Lab 5: lab 4 + activation checkpointing. Blocks keep less for backward and recompute
the rest.

With --ac full each checkpointed block keeps only its input from the forward pass and
runs its forward again during backward; --ac selective also keeps the matmul and
attention outputs and recomputes only the cheap pointwise ops. Gradients are the same as
without checkpointing.

Launch (GPU ranks talk over NCCL, CPU ranks over gloo; --device cpu|cuda forces one):
    torchrun --standalone --nproc-per-node=2 src/labs/lab5_activation_ckpt.py \
        --preset tiny --ac full
    torchrun --standalone --nproc-per-node=8 src/labs/lab5_activation_ckpt.py \
        --preset gpt2 --batch-size 512 --micro-batch-size 64 --dtype bf16 \
        --ac selective
    # two nodes: run this same line on each (c10d numbers the nodes), HOST reachable
    # from both
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29500 --rdzv-id=lab5 src/labs/lab5_activation_ckpt.py \
        --preset shakespeare
    # without torchrun it is one process that accumulates B /
    # micro_batch_size micro-batches
    python src/labs/lab5_activation_ckpt.py --preset tiny --micro-batch-size 4 \
        --ac-every 2

It writes OUT/metrics.jsonl (one line per logged step), OUT/summary.json and the trained
weights, OUT/model.pt; with --checkpoint-every, OUT/checkpoints/step_NNNNNN.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from distlab.checkpoint import (
    Checkpoints,
    Preemption,
    load_plain_weights,
    save_plain_weights,
)
from distlab.cli import parse_config, require_positive, run
from distlab.data import TokenData, load_corpus
from distlab.errors import UserError
from distlab.flops import (
    FLOPS_FORMULA,
    describe_mfu,
    device_name,
    flops_per_token,
    utilisation,
)
from distlab.memory import StepMemory, device_memory_peaks, state_bytes
from distlab.metrics import LogWindow, RunLog
from distlab.model import GPT, PRESETS, count_parameters, preset
from distlab.parallel import (
    AC_MODES,
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    full_state_dict,
    no_gradient_sync,
)
from distlab.runtime import DTYPES, dist_env, init_distributed, pick_device, use_tf32


@dataclass
class TrainConfig:
    """Every field is a --flag (batch_size: --batch-size) and its comment is the
    --help text.

    Suggested for a GPU benchmark (not measured here): --device cuda --preset gpt2
    --dtype bf16 --compile --log-every 10, 32 to 64 sequences per GPU (--batch-size:
    that x the ranks; labs 3-6: the same --micro-batch-size, one forward per step).
    """

    # model size: tiny (seconds on a CPU), shakespeare (10.77M params) or gpt2
    # (85.89M, GPUs)
    preset: str = "tiny"
    steps: int = 200  # optimizer steps
    # global batch: sequences per optimizer step, all ranks together
    batch_size: int = 16
    # sequences per forward/backward on one rank (what memory allows)
    micro_batch_size: int = 4
    # reduce-scatter after every micro-batch (to measure no_gradient_sync)
    sync_every_micro_batch: bool = False
    lr: float = 1e-3  # peak learning rate, reached after warm-up
    min_lr: float = 1e-4  # the cosine decay ends here
    warmup_steps: int = 20  # linear warm-up from 0 to lr
    weight_decay: float = 0.1  # AdamW decoupled weight decay, on matrices only
    # clip the global gradient norm to this (0 turns clipping off)
    grad_clip: float = 1.0
    eval_every: int = 100  # validation loss every N steps, and always at the end
    eval_batches: int = 8  # batches averaged into one validation loss
    # log (and sync with the host) every N steps; between logs the loss stays on
    # the device
    log_every: int = 1
    dtype: str = "fp32"  # fp32, or bf16 compute by FSDP2's policy (no autocast)
    # let fp32 matmuls on CUDA use TF32 tensor cores (10-bit mantissa); no effect on CPU
    tf32: bool = False
    device: str = "auto"  # auto (CUDA when present, else CPU), cpu or cuda
    # torch.compile each transformer block; the first steps compile (slow)
    compile: bool = False
    seed: int = 1337  # model initialisation and the order of batches
    # a UTF-8 text file to train on; empty: the Tiny Shakespeare shipped with distlab
    data: str = ""
    # start from these weights: a plain model.pt (lab outputs, or a
    # converted checkpoint)
    init_from: str = ""
    out: str = "runs/lab5"  # directory for metrics.jsonl, summary.json and model.pt
    # save model, optimizer, step and RNG to OUT/checkpoints every N steps (0: never)
    checkpoint_every: int = 0
    # keep the newest N checkpoints, delete older ones (0: keep all)
    keep_checkpoints: int = 3
    # go on from a checkpoint: its step_NNNNNN folder, latest, or auto (latest if any,
    # else step 0)
    resume: str = ""
    # activation checkpointing: none, full (keep block inputs) or selective (and
    # matmul outputs)
    ac: str = "full"
    ac_every: int = 1  # checkpoint every k-th block (1: all of them)
    sample_chars: int = 200  # characters to sample from the trained model (0: none)
    # a collective that waits longer than this fails instead of hanging
    timeout_s: float = 120.0
    progress: bool = True  # a progress bar on the main rank
    # peak bytes by kind in the 2nd step (PyTorch's MemTracker; slows that step)
    track_memory: bool = False

    def __post_init__(self):
        require_positive(self, "batch_size", "eval_every", "eval_batches", "log_every")
        require_positive(self, "micro_batch_size", "ac_every")
        # 0 is allowed: evaluate and sample the initial (or --init-from) weights
        if self.steps < 0:
            raise UserError(f"--steps must be 0 or more, got {self.steps}")
        if self.preset not in PRESETS:
            raise UserError(
                f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}"
            )
        if self.dtype not in DTYPES:
            raise UserError(
                f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}"
            )
        if self.ac not in AC_MODES:
            raise UserError(
                f"unknown --ac {self.ac!r}; choose one of {', '.join(AC_MODES)}"
            )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr over the remaining steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (
        1 + math.cos(math.pi * min(progress, 1.0))
    )


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # decay the matrices; leave biases and LayerNorm gains alone (as GPT-2 and
    # nanoGPT do)
    params = list(model.parameters())
    groups = [
        {
            "params": [p for p in params if p.dim() >= 2],
            "weight_decay": cfg.weight_decay,
        },
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel for the whole update instead of the default (a loop over the
    # tensors on a CPU, foreach kernels on a GPU); the single-device chapter counts the
    # operators of both
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)


@torch.no_grad()
def evaluate(model, data, cfg, block_size, rank, world_size, device) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    # micro-batches as in training: B/N rows at once hold (B/N, T, vocab) logits
    m = cfg.micro_batch_size
    for i in range(cfg.eval_batches):  # the same validation batches every time
        x, y = data.batch(
            "val", i, cfg.batch_size, block_size, cfg.seed, rank, world_size, device
        )
        for xm, ym in zip(x.split(m), y.split(m)):
            # with --dtype bf16, FSDP2 computes in bf16 (its MixedPrecisionPolicy)
            _, loss = model(xm, ym)
            total += loss.float() * len(xm) / len(x)  # the mean over the B/N rows
    # SUM then divide, on any backend and dtype: every rank logs the same mean
    dist.all_reduce(total)
    mean = total / (cfg.eval_batches * world_size)
    model.train()
    return mean.item()


def main() -> None:
    cfg = parse_config(TrainConfig, description=__doc__)
    rank, local_rank, world_size = dist_env()  # from torchrun; (0, 0, 1) without it
    is_main = rank == 0
    # before any collective: all ranks stop
    if cfg.batch_size % (world_size * cfg.micro_batch_size):
        raise UserError(
            f"--batch-size {cfg.batch_size} is not a multiple of {world_size} ranks x "
            f"--micro-batch-size {cfg.micro_batch_size}"
        )
    accum_steps = cfg.batch_size // (world_size * cfg.micro_batch_size)
    device = pick_device(cfg.device, local_rank)
    use_tf32(cfg.tf32)  # fp32 matmuls on CUDA: TF32 or full fp32
    init_distributed(device, cfg.timeout_s)

    corpus = load_corpus(cfg.data or None)
    data = TokenData(corpus)
    model_cfg = preset(cfg.preset, vocab_size=data.tokenizer.vocab_size)
    T = model_cfg.block_size
    model = GPT(model_cfg, seed=cfg.seed).to(device)
    # before any wrapper, while the keys and shapes are the plain model's
    if cfg.init_from:
        load_plain_weights(model, cfg.init_from)
    # checkpoint first, then shard: each FSDP unit is then a checkpointed block (see
    # the chapter)
    model = apply_activation_checkpointing(model, cfg.ac, cfg.ac_every)
    # after checkpointing, before DDP or sharding; in place: the names stay the
    # plain model's
    if cfg.compile:
        apply_compile(model)
    # apply_fsdp first checks that every rank built the same weights: fully_shard
    # neither broadcasts nor checks
    model = apply_fsdp(
        model, param_dtype=None if cfg.dtype == "fp32" else DTYPES[cfg.dtype]
    )
    # the optimizer comes after: fully_shard replaced each parameter by a new one
    # holding a DTensor shard
    optimizer = make_optimizer(model, cfg)
    checkpoints = Checkpoints(cfg, model, optimizer)
    # with --resume: model, optimizer, RNG loaded, else 0
    start_step = checkpoints.resume()
    preemption = Preemption()  # SIGTERM, SIGUSR1: save after the step, then stop
    if is_main:
        print(f"config: {asdict(cfg)}")
        print(
            f"model: {count_parameters(model):,} parameters, data: "
            f"{corpus.source}, device: {device}"
        )

    log = RunLog(cfg.out, enabled=is_main)
    tokens_per_step = cfg.batch_size * T
    # steps between logs
    window = LogWindow.for_run(cfg, device, tokens_per_step, start_step)
    train_loss = val_loss = float("nan")  # stay nan if no step runs (--steps 0)
    # bytes of parameters, gradients and optimizer state, after the first step
    state = {}
    # peak bytes by kind, if asked
    memory = StepMemory(model, optimizer, enabled=cfg.track_memory)
    # into a pipe or a log (not a terminal), redraw rarely: every redraw becomes a
    # line there
    bar = tqdm(
        range(start_step, cfg.steps),
        disable=not (is_main and cfg.progress),
        desc="train",
        mininterval=0.1 if sys.stderr.isatty() else 10,
    )
    for step in bar:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        window.open(step)  # after a log point: wait for queued work, start the clock

        memory.begin()
        # --- begin train step ---
        x, y = data.batch(
            "train", step, cfg.batch_size, T, cfg.seed, rank, world_size, device
        )
        loss = torch.zeros((), device=device)
        for micro, (xm, ym) in enumerate(
            zip(x.split(cfg.micro_batch_size), y.split(cfg.micro_batch_size))
        ):
            last = micro == accum_steps - 1
            # no sync: gradients accumulate unsharded on each rank; the last backward
            # reduce-scatters their sum
            with (
                contextlib.nullcontext()
                if last or cfg.sync_every_micro_batch
                else no_gradient_sync(model)
            ):
                # no autocast: the loss is fp32 (from logits.float())
                _, micro_loss = model(xm, ym)
                # the mean over micro-batches, as one batch
                (micro_loss / accum_steps).backward()
            loss += micro_loss.detach() / accum_steps
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), cfg.grad_clip or math.inf
        )
        optimizer.step()
        # every gradient and AdamW buffer exists now, and their sizes are fixed
        if not state:
            state = state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        # --- end train step ---
        memory.end()

        evaluating = (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1
        # in between, the loss stays on the device: no wait
        if window.is_log_point(step, evaluating):
            mean_loss = loss.clone()
            # this rank's loss is on its B/N rows; log the global mean
            dist.all_reduce(mean_loss)
            train_loss = mean_loss.item() / world_size  # waits for the step to finish
            # ends a diverged run
            record = window.close(step, train_loss, lr=lr, grad_norm=grad_norm.item())
            if evaluating:
                val_loss = evaluate(model, data, cfg, T, rank, world_size, device)
                record["val_loss"] = val_loss
            log.log(**record)
            bar.set_postfix(
                loss=f"{train_loss:.3f}", val=f"{val_loss:.3f}", refresh=False
            )
        stop = preemption.requested()  # True on all ranks if any got a signal
        # every --checkpoint-every steps; each rank writes its own shards
        checkpoints.maybe_save(step, now=stop)
        if stop:
            break

    if preemption.stopped:  # saved: the same command with --resume auto goes on
        log.close()
        return

    # no step ran (--steps 0): evaluate the weights we started from
    if math.isnan(val_loss):
        val_loss = evaluate(model, data, cfg, T, rank, world_size, device)
    tokens_per_s = window.tokens_per_s  # of the steps after warm-up; nan if no step ran
    flops = flops_per_token(model_cfg) * tokens_per_s / world_size  # per device
    # training's peaks: the matmul timed next allocates its own
    cuda_peaks = device_memory_peaks(device)
    # of the matmul peak timed now, all ranks at once
    mfu = utilisation(flops, device, DTYPES[cfg.dtype])
    sample = ""
    # every rank takes part; rank 0 gets the whole model, on the CPU
    weights = full_state_dict(model)
    if is_main and cfg.sample_chars:
        prompt = data.tokenizer.encode("\n").view(1, 1).to(device)
        gen = torch.Generator(device).manual_seed(cfg.seed)
        plain = GPT(model_cfg).to(device)
        # sampling runs on rank 0 alone: a sharded model cannot
        plain.load_state_dict(weights)
        out = plain.generate(prompt, cfg.sample_chars, generator=gen)
        sample = data.tokenizer.decode(out[0].tolist())
        print(f"sample:\n{sample}")
    summary = {
        "lab": Path(__file__).stem,
        "strategy": f"fsdp2+accumulation+ac-{cfg.ac}",
        "preset": cfg.preset,
        "dtype": cfg.dtype,
        "device": str(device),
        "device_name": device_name(device),
        "world_size": world_size,
        "accum_steps": accum_steps,
        "steps": cfg.steps,
        "global_batch": cfg.batch_size,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "parameters": count_parameters(model),
        "state_bytes_per_rank": state,
        "peak_bytes_by_kind": memory.peak,
        **cuda_peaks,  # CUDA's peak allocated and reserved bytes, this rank ({} on CPU)
        "flops_per_token": flops_per_token(model_cfg),
        "flops_formula": FLOPS_FORMULA,
        "achieved_flops_per_s": flops,
        # peak_flops_per_s, mfu (None above 1: that peak was no peak), the datasheet MFU
        # on GPUs
        **mfu,
        "data": corpus.source,
        "torch": torch.__version__,
        "config": asdict(cfg),
        "sample": sample,
    }
    log.summary(**summary)
    log.close()
    if is_main:
        # plain keys and tensors: lab 1 loads it
        save_plain_weights(weights, Path(cfg.out) / "model.pt")
        print(
            f"tokens/s {tokens_per_s:,.0f}  {describe_mfu(mfu)}  final loss "
            f"{train_loss:.4f}  val {val_loss:.4f}"
        )
    # the model holds the group: freed after the group is destroyed, gloo can hang
    # (book: Debugging)
    del model, checkpoints, memory  # each of them holds the model
    dist.destroy_process_group()  # the last reference, dropped here


if __name__ == "__main__":
    run(main, Path(__file__).name)
