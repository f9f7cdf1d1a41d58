"""The overlap on a timeline, and compressing the gradients: the experiments of
book/ddp_overlap.md.

    # bucket timestamps, from-scratch and torch DDP
    timelines = run_ranks(timeline_demo, nprocs=2)
    overlap_figure(timelines)  # the page's key figure
    # bytes, seconds and losses per comm hook
    runs = run_ranks(compression_demo, nprocs=2)[0]
    bytes_figure(runs)

Both demos run on every rank of a ``run_ranks`` launch (2 gloo ranks on the page); the
figures and ``step_facts`` run in the notebook, on what the ranks returned.
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.data import token_data
from distlab.model import GPT, preset
from distlab.parallel import apply_ddp
from distlab.runtime import dist_env, pick_device, rank_world, synchronize
from distlab.scratch.ddp import BucketedDDP
from distlab.tools.comm_bytes import CountedAllReduce
from distlab.tools.comm_timeline import (
    Timeline,
    draw_timeline,
    step_times,
    timestamping_hook,
)

SEED = 1337


def _batch(step: int, rows_per_rank: int, tokens: int):
    rank, world_size = rank_world()
    return token_data().batch(
        "train", step, rows_per_rank * world_size, tokens, SEED, rank, world_size
    )


def _model(preset_name: str) -> GPT:
    # the same initial weights in every variant (DDP broadcasts rank 0's anyway)
    torch.manual_seed(0)
    return GPT(preset(preset_name, vocab_size=token_data().vocab_size))


# ------------------------------------------------------------ the overlap on a timeline
# --- begin scratch recorder ---
class _TimedWork:
    """Stands in for the all-reduce's Work object: records when the step waits on it and
    when it returns."""

    def __init__(self, work, timeline: Timeline, bucket: int):
        self.work, self.timeline, self.bucket = work, timeline, bucket
        # runs when gloo completes it
        work.get_future().then(lambda _: timeline.mark("done", bucket))

    def wait(self):
        self.timeline.mark("wait", self.bucket)
        result = self.work.wait()
        self.timeline.mark("waited", self.bucket)
        return result


class TimedBucketedDDP(BucketedDDP):
    """BucketedDDP, with every bucket's ready, launch, done and wait times recorded in
    ``timeline``."""

    def __init__(self, module: nn.Module, timeline: Timeline, **options):
        super().__init__(module, **options)
        self.timeline = timeline
        for i, bucket in enumerate(self.buckets):
            timeline.bucket_bytes[i] = (
                bucket.buffer.numel() * bucket.buffer.element_size()
            )

    def _into_bucket(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        bucket = self.bucket_of[p]
        if bucket.pending == 1:  # this gradient completes the bucket
            self.timeline.mark("ready", self.buckets.index(bucket))
        first_unlaunched = self.next_to_launch
        # launches every bucket that is now next in line and full
        super()._into_bucket(p, grad)
        for i in range(first_unlaunched, self.next_to_launch):
            self.timeline.mark("launch", i)
            self.buckets[i].work = _TimedWork(self.buckets[i].work, self.timeline, i)


# --- end scratch recorder ---


# --- begin timeline ---
def timeline_demo(
    preset_name: str = "shakespeare",
    bucket_cap_mb: float = 6.0,
    rows: int = 2,
    tokens: int = 64,
    steps: int = 2,
) -> dict:
    """On every rank: ``steps`` steps of the from-scratch BucketedDDP, then of torch's
    DDP, each step's events recorded (forward, backward, per-gradient ticks, per-bucket
    ready/launch/done/waited)."""
    out = {}
    for wrapper in ("from scratch", "torch"):
        timeline, module = Timeline(), _model(preset_name)
        if wrapper == "from scratch":
            model = TimedBucketedDDP(module, timeline, bucket_cap_mb=bucket_cap_mb)
        else:
            model = DDP(module, bucket_cap_mb=bucket_cap_mb)
            model.register_comm_hook(timeline, timestamping_hook)
        timeline.watch_gradients(module)
        recorded = []
        for step in range(steps):
            x, y = _batch(step, rows, tokens)
            timeline.clear()
            if wrapper == "torch":
                # the hook records them again: torch's buckets change after step 1
                timeline.bucket_bytes.clear()
            timeline.mark("forward")
            loss = model(x, y)[1]
            timeline.mark("backward")
            # torch's DDP waits for its buckets in here, before backward() returns
            loss.backward()
            timeline.mark("backward returned")
            if wrapper == "from scratch":
                model.finish_gradient_sync()  # ours waits here
            timeline.mark("synced")
            recorded.append(
                {
                    "events": list(timeline.events),
                    "bucket_bytes": dict(timeline.bucket_bytes),
                }
            )
        out[wrapper] = recorded
    return out


# --- end timeline ---

# (wrapper, step, title): the panels of the page's key figure
PANELS = (
    ("torch", 1, "torch DDP, step 2: rebuilt buckets, during backward"),
    ("torch", 0, "torch DDP, step 1: one bucket, after backward"),
    ("from scratch", 1, "BucketedDDP (from scratch), step 2"),
)


def overlap_figure(timelines: list[dict]):
    """The three panels of PANELS, one above the other on one time axis: what each
    rank's backward and each bucket's all-reduce did (``draw_timeline``)."""
    import matplotlib.pyplot as plt

    rows = [2 + len(timelines[0][w][s]["bucket_bytes"]) for w, s, _ in PANELS]
    fig, axes = plt.subplots(
        len(PANELS),
        1,
        figsize=(8, 1.4 + 0.3 * sum(rows)),
        sharex=True,
        gridspec_kw={"height_ratios": rows},
    )
    for ax, (wrapper, step, title) in zip(axes, PANELS):
        draw_timeline(ax, [r[wrapper][step] for r in timelines], title)
    axes[-1].set_xlabel("ms since rank 0 started backward", fontsize=11)
    fig.tight_layout()
    return fig


def step_facts(timelines: list[dict], wrapper: str, step: int) -> dict:
    """Order facts of one recorded step, on both ranks: the buckets, whether they were
    launched in bucket order, how many were launched before the rank's last gradient
    (the fewest over the ranks)."""
    origin = next(
        t for what, _, t in timelines[0][wrapper][step]["events"] if what == "backward"
    )
    ms = [step_times(r[wrapper][step]["events"], origin) for r in timelines]
    n = len(ms[0]["launch"])
    # the last gradient: ours marks the last bucket ready before its own gradient
    # tick, so take that
    last_grad = [m["ready"].get(n - 1, max(m["grads"])) for m in ms]
    return {
        "buckets": n,
        "launch order": all(
            sorted(m["launch"], key=m["launch"].get) == list(range(n)) for m in ms
        ),
        "launched before the last gradient": min(
            sum(m["launch"][b] < g for b in range(n)) for m, g in zip(ms, last_grad)
        ),
    }


# ---------------------------------------------------------------- communication hooks
def bf16_hook_by_another_name(process_group, bucket):
    """``bf16_compress_hook``, under a name DDP does not refuse on CPU (see
    the page)."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


# --- begin register ---
def _register(ddp: DDP, variant: str, start_powersgd_iter: int):
    """Register the comm hook of ``variant`` on ``ddp``; returns the PowerSGD state,
    or None."""
    if variant == "fp32":
        # what DDP does without a hook
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif variant == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif variant == "bf16":
        ddp.register_comm_hook(None, bf16_hook_by_another_name)
    elif variant.startswith("powersgd-"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(variant.split("-")[1]),
            # plain all-reduce before this step
            start_powerSGD_iter=start_powersgd_iter,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    else:
        raise ValueError(
            f"unknown variant {variant!r}: fp32, fp16, bf16 or powersgd-<rank>"
        )
    return None


# --- end register ---


def bf16_refusal() -> str:
    """What ``register_comm_hook(None, bf16_compress_hook)`` says on a CPU build:
    one line."""
    ddp = DDP(_model("tiny"))
    try:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except TypeError as err:
        return f"TypeError: {err}"
    return "registered"


# --- begin compression ---
def train_with_hook(
    variant: str,
    steps: int = 30,
    rows: int = 4,
    tokens: int = 64,
    lr: float = 3e-3,
    start_powersgd_iter: int = 2,
    preset_name: str = "tiny",
    bucket_cap_mb: float | None = None,
) -> dict:
    """``steps`` AdamW steps under DDP with the comm hook ``variant``: per step the
    global mean loss, the all-reduces this rank issued (elements, dtype, bytes) and the
    seconds of forward + backward."""
    # the CPU on the page's ranks; a GPU each with device="cuda"
    device = pick_device("auto", dist_env()[1])
    cap = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    # tiny: 0.41 MiB of gradients, one bucket
    ddp = apply_ddp(_model(preset_name).to(device), device, **cap)
    _register(ddp, variant, start_powersgd_iter)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    losses, sent, seconds = [], [], []
    for step in range(steps):
        x, y = (t.to(device) for t in _batch(step, rows, tokens))
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with CountedAllReduce() as counted:
            loss = ddp(x, y)[1]
            # the hook's all-reduces, all finished when backward returns
            loss.backward()
            synchronize(device)
        seconds.append(time.perf_counter() - start)
        sent.append(counted.calls)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # for the record: the global mean loss of this step
        losses.append(mean.item() / dist.get_world_size())
    return {
        "losses": losses,
        "calls": sent,
        "seconds": seconds,
        "val_loss": val_loss(ddp.module, tokens),
    }


def val_loss(model: GPT, tokens: int = 64, rows: int = 32) -> float:
    """The loss on one fixed validation batch (the same on every rank, whose weights
    are equal)."""
    x, y = token_data().batch(
        "val", 0, rows, tokens, SEED, device=next(model.parameters()).device
    )
    with torch.no_grad():
        return model(x, y)[1].item()


# --- end compression ---


def compression_demo(
    variants=("fp32", "fp16", "bf16", "powersgd-1", "powersgd-2", "powersgd-4"),
    **kwargs,
) -> dict:
    """Every variant on this rank, plus the bf16 refusal and the parameter shapes for
    the formula."""
    out = {variant: train_with_hook(variant, **kwargs) for variant in variants}
    out["bf16 refusal"] = bf16_refusal()
    out["shapes"] = [tuple(p.shape) for p in _model("tiny").parameters()]
    return out


def powersgd_many_buckets(
    bucket_cap_mb: float = 0.05, steps: int = 5, rank: int = 2
) -> int:
    """PowerSGD on gloo with several buckets: aborts or hangs (book/ddp_overlap.md says
    why). Not run by the book: ``run_ranks(powersgd_many_buckets, nprocs=2,
    timeout=60)`` reproduces it. Returns the number of buckets if it survives."""
    ddp = DDP(_model("tiny"), bucket_cap_mb=bucket_cap_mb)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2
    )
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for step in range(steps):
        x, y = _batch(step, 2, 64)
        ddp(x, y)[1].backward()
    return len(ddp.reducer._get_zeros_like_grad_buckets())


def step_bytes(run: dict, step: int = -1) -> int:
    """Bytes this rank handed to ``dist.all_reduce`` in one step of a
    ``train_with_hook`` run."""
    return sum(b for *_, b in run["calls"][step])


def bytes_figure(runs: dict, variants: list[str]):
    """Bytes all-reduced per step by each hook (its last step, PowerSGD compressing),
    on a log axis, each bar labelled with its cut against fp32."""
    import matplotlib.pyplot as plt

    fp32 = step_bytes(runs["fp32"])
    sent = [step_bytes(runs[v]) for v in variants]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(variants)))
    colours = ["0.55" if v == "fp32" else "tab:blue" for v in variants]
    ax.barh(range(len(variants)), sent, color=colours)
    for i, b in enumerate(sent):
        label = "fp32: the whole bucket" if b == fp32 else f"1/{fp32 / b:.0f} of fp32"
        ax.text(b * 1.15, i, label, va="center", fontsize=11)
    ax.set_yticks(range(len(variants)), variants, fontsize=11)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(min(sent) / 2, fp32 * 40)
    ax.set_xlabel("bytes all-reduced per step, counted (log scale)", fontsize=11)
    ax.tick_params(axis="x", labelsize=10)
    fig.tight_layout()
    return fig


# --- begin formula ---
def powersgd_elements(
    shapes, rank: int, min_compression_rate: float = 2
) -> dict[str, int]:
    """What PowerSGD all-reduces per step for gradients of these shapes (torch's
    powerSGD_hook): each gradient viewed as an n x m matrix (m = 1 for a vector) is
    compressed to P (n x r) and Q (m x r), r = min(n, m, rank), when (n + m) r
    min_compression_rate < n m; else sent whole."""
    out = {"uncompressed": 0, "P": 0, "Q": 0}
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            out["P"] += n * r
            out["Q"] += m * r
        else:
            out["uncompressed"] += n * m
    return out


# --- end formula ---
