"""Device, backend and dtype choices: the one place that knows about CPU vs GPU.

Labs never name ``cpu``, ``cuda``, ``gloo`` or ``nccl`` themselves; they ask here, so
the same script runs on a laptop's CPU ranks and on a GPU node unchanged.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from distlab.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# The switch that pins ``auto`` to the CPU: `make test` (tests/conftest.py) and `make
# book` (Makefile) set it, and so do ``run_ranks``/``run_script`` for their ranks, so
# that the book and the CPU suite give the same results on a machine with GPUs as on
# one without.
CPU_PIN = "DISTLAB_DEVICE"


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """The device this rank runs on: ``cpu``, ``cuda`` (GPU ``local_rank``) or ``auto``.

    ``auto`` means this rank's GPU when torch can use one, else the CPU, except that the
    environment variable ``DISTLAB_DEVICE=cpu`` makes it the CPU whatever CUDA says:
    that is the switch `make test` and `make book` use (with ``CUDA_VISIBLE_DEVICES=``
    beside it, so that no process even sees a GPU). When ``auto`` falls back to the CPU
    on a machine that has an NVIDIA GPU this torch cannot use, it warns (once per
    process); ``cuda`` makes that an error. ``cuda`` takes one GPU per process, numbered
    by ``local_rank``, and refuses in one line a local rank that has no GPU of its own.
    """
    if requested == "auto":
        if cpu_pinned():
            return torch.device("cpu")
        if torch.cuda.is_available():
            requested = "cuda"
        else:
            _warn_if_gpu_unusable(local_rank)
            return torch.device("cpu")
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                "--device cuda was asked for, but torch cannot use a GPU here: "
                f"{_why_no_cuda()}"
            )
        count = torch.cuda.device_count()
        # before set_device: a local rank past the last GPU is otherwise a raw "invalid
        # device ordinal"
        if not 0 <= local_rank < count:
            raise UserError(
                f"LOCAL_RANK {local_rank} but this process sees {count} "
                f"GPU{'s' if count != 1 else ''}: start at most "
                f"{count} process{'es' if count != 1 else ''} per node "
                f"(--nproc-per-node {count}), or, under SLURM, "
                "let every process see all of the node's GPUs (one task per "
                "node running torchrun, or srun "
                "--gpu-bind=none) so that LOCAL_RANK picks among them"
            )
        # one process per GPU: LOCAL_RANK picks this process's card
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if requested == "cpu":
        return torch.device("cpu")
    raise UserError(f"unknown device {requested!r}; choose auto, cpu or cuda")


def cpu_pinned() -> bool:
    """Whether ``DISTLAB_DEVICE=cpu`` pins ``auto`` to the CPU in this process."""
    value = os.environ.get(CPU_PIN, "")
    if value not in ("", "cpu"):
        raise UserError(
            f"{CPU_PIN}={value!r}: the only value it takes is 'cpu' (or unset)"
        )
    return value == "cpu"


def nvidia_gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU, whatever torch makes of it: the driver's
    device files (/dev/nvidia0, ...) or its ``nvidia-smi``."""
    return (
        bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None
    )


def _why_no_cuda() -> str:
    """Why ``torch.cuda.is_available()`` is False, as far as this process can tell."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return (
            "CUDA_VISIBLE_DEVICES is empty, which hides every GPU (make test and "
            "make book set it so)"
        )
    if not nvidia_gpu_present():
        return "this machine shows no NVIDIA GPU (no /dev/nvidia*, no nvidia-smi)"
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU-only build "
            "(torch.version.cuda is None): "
            "install a CUDA build of torch"
        )
    return (
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but "
        "cannot start it "
        "(torch.cuda.is_available() is False): for example an NVIDIA driver too "
        "old for that CUDA version "
        "(nvidia-smi shows the newest CUDA the driver supports)"
    )


_warned_gpu_unusable = False


def _warn_if_gpu_unusable(local_rank: int) -> None:
    """``auto`` is about to fall back to the CPU: say so loudly if a GPU is there
    and unusable.

    A CPU-only wheel or a driver too old for the wheel's CUDA otherwise turns a GPU run
    into a CPU run, many times slower, without a word. Once per process, and only on
    local rank 0 (every rank of the node would say the same). An empty
    ``CUDA_VISIBLE_DEVICES`` hides the GPUs on purpose, so it says nothing then.
    """
    global _warned_gpu_unusable
    if (
        _warned_gpu_unusable
        or local_rank != 0
        or os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    ):
        return
    if not nvidia_gpu_present():
        return
    _warned_gpu_unusable = True
    warnings.warn(
        f"an NVIDIA GPU is present, but {_why_no_cuda()}. --device auto runs on "
        "the CPU instead; "
        "--device cuda would make this an error",
        RuntimeWarning,
        stacklevel=3,
    )


def use_tf32(enabled: bool) -> None:
    """Let float32 matmuls and convolutions on CUDA use TF32 tensor cores, or forbid it.
    No effect on CPU.

    TF32 keeps fp32's range with a 10-bit mantissa, and an fp32 matmul then runs at the
    tensor cores' TF32 rate (156 against 19.5 TFLOP/s on an A100, datasheet;
    ``distlab.flops`` keeps the table). torch 2.13 keeps two views of the setting: the
    older one (``allow_tf32``, ``torch.get_float32_matmul_precision()``) and the
    per-backend ``fp32_precision`` attributes. Setting only
    ``torch.backends.cuda.matmul.fp32_precision`` leaves the older view disagreeing, and
    reading it then raises "mix of the legacy and new APIs" (measured), which Inductor's
    matmul autotuning does under ``torch.compile``
    (torch/_inductor/select_algorithm.py). ``torch.set_float32_matmul_precision`` keeps
    both in step but also sets oneDNN's CPU matmul precision
    (``torch.backends.mkldnn.matmul.fp32_precision``) to TF32. The two ``allow_tf32``
    setters set both views, leave the CPU alone, and warn of nothing in torch 2.13
    (all measured).
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled  # cuBLAS: matmuls, linear layers
    # cuDNN: convolutions (on by default in torch)
    torch.backends.cudnn.allow_tf32 = enabled


def tf32_enabled() -> bool:
    """Whether a float32 matmul on CUDA may use TF32 now (``use_tf32``, or the user's
    own setting).

    Reads the per-backend view, which is set whichever API set TF32 and, unlike
    ``torch.backends.cuda.matmul.allow_tf32``, never raises when the two APIs
    were mixed.
    """
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def backend_for(device: torch.device) -> str:
    """NCCL moves GPU tensors between GPUs; gloo moves CPU tensors over TCP."""
    return "nccl" if device.type == "cuda" else "gloo"


def group_backend(device: torch.device) -> str:
    """The process group's backends: on GPUs NCCL for CUDA tensors and gloo for CPU
    ones, so a collective on a CPU tensor (the gradient norm of FSDP2 with
    ``CPUOffloadPolicy``, whose gradients live on the CPU) has a backend, as
    Accelerate's group does when FSDP offloads; gloo alone on CPU ranks."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def autocast(device: torch.device, dtype: str):
    """bf16 autocast for the forward pass, or nothing for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def dist_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1)
    without torchrun. Several SLURM tasks without torchrun (``srun -n8 python lab2...``)
    are refused: each would train alone, and all would write the same ``--out``."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", 1))
    if tasks > 1 and "RANK" not in os.environ:
        raise UserError(
            f"srun started {tasks} tasks of this script without torchrun: each would "
            "train alone and all would write the same --out. Run one torchrun per "
            "node under srun (src/slurm/lab2_multinode.sbatch)"
        )
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def rank_world() -> tuple[int, int]:
    """(rank, world_size) of this process: the process group's when one is initialized,
    else torchrun's environment, else (0, 1). The one answer to "which rank am I"
    outside the labs (which lock their names in lab 1 and read ``dist_env``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, _, world_size = dist_env()
    return rank, world_size


def init_distributed(device: torch.device, timeout_s: float = 120.0) -> None:
    """Join the process group that torchrun (or our launcher) described in
    the environment.

    The timeout turns a rank that never arrives, or that skips a collective, into an
    error after ``timeout_s`` seconds instead of a hang.
    """
    options = {}
    if "RANK" not in os.environ:  # started without torchrun: a group of one, no network
        options = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, _, world_size = dist_env()
        if rank == 0 and (warning := multi_node_restart_warning(os.environ)):
            print(warning, file=sys.stderr, flush=True)
        options = {
            "store": _store_of_this_attempt(world_size, timeout_s),
            "rank": rank,
            "world_size": world_size,
        }
    dist.init_process_group(
        group_backend(device),
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        **options,
    )


def multi_node_restart_warning(env) -> str:
    """A warning when torchrun may restart a group spread over several nodes (agents)
    that share the agent's store: the per-attempt prefix is then unsafe. Else ""."""
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    if nodes > 1 and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        return (
            f"warning: torchrun may restart this group on {nodes} nodes, whose agents "
            "count restarts separately (pytorch#135712); set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so each attempt gets a new store"
        )
    return ""


def _store_of_this_attempt(world_size: int, timeout_s: float) -> dist.Store:
    """torchrun's key-value store, seen through a prefix that names this
    restart attempt.

    torchrun (torch 2.13) keeps one store for the whole job, and after
    ``--max-restarts`` restarts a group, the keys the dead attempt wrote are still in
    it, among them the addresses gloo's ranks listen on. A new rank can read a dead
    rank's address and fail with "Connection refused" (measured: 3 restarts out of 3
    failed so; see the fault tolerance chapter). Keys under a prefix per attempt cannot
    be stale, on one node. Agents on several nodes count their restarts separately (a
    replaced node starts at 0: pytorch#135712), so their prefixes can differ and the
    group waits until the timeout: ``multi_node_restart_warning`` says so, and
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids the shared store altogether.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(
        f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
    )


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
