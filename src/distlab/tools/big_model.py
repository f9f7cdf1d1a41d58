"""Accelerate's big-model loading, for inference: a model built on ``meta``, placed
module by module on the devices a memory budget allows (``device_map``), the rest
offloaded to disk and streamed in at each forward.

    model, placed = dispatched(preset("tiny", n_layer=6), cpu_bytes=7e5, folder=tmp)
    draw_device_map(placed)   # one bar per module, coloured by where it lives
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

DEVICE_COLOURS = {"cpu": "#2e86c1", "disk": "#b3b6b7"}


def dispatched(cfg, cpu_bytes: float, folder: str | Path, seed: int = 0):
    """A GPT of config ``cfg`` saved to ``folder/model.pt``, then loaded as Accelerate's
    big-model inference does: ``init_empty_weights`` (nothing allocated), a
    ``device_map`` inferred from a budget of ``cpu_bytes`` (blocks are never split),
    ``load_checkpoint_and_dispatch`` (what does not fit goes to ``folder/offload``).
    Returns the dispatched model and, per placed module, (name, bytes, device)."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from accelerate.utils import infer_auto_device_map

    from distlab.model import GPT

    folder = Path(folder)
    torch.save(GPT(cfg, seed=seed).state_dict(), folder / "model.pt")
    with init_empty_weights():  # parameters on meta: no bytes, no init
        empty = GPT(cfg, seed=seed)
    # its "parameters on the meta device" warning is what offloading means: quiet
    logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)
    # --- begin dispatch ---
    device_map = infer_auto_device_map(
        empty, max_memory={"cpu": int(cpu_bytes)}, no_split_module_classes=["Block"]
    )
    model = load_checkpoint_and_dispatch(
        empty,
        str(folder / "model.pt"),
        device_map=device_map,
        offload_folder=str(folder / "offload"),
        no_split_module_classes=["Block"],
    )
    # --- end dispatch ---
    modules = dict(empty.named_modules())
    placed = [
        (
            name,
            sum(p.numel() * p.element_size() for p in modules[name].parameters()),
            device,
        )
        for name, device in device_map.items()
    ]
    return model, placed


def draw_device_map(placed: list[tuple]):
    """One horizontal bar per placed module, its length the module's bytes, its colour
    the device it was given."""
    import matplotlib.pyplot as plt

    shown = [(n, b, d) for n, b, d in placed if b > 0]
    fig, ax = plt.subplots(figsize=(5.4, 0.42 * len(shown) + 1.4))
    widest = max(size for _, size, _ in shown) / 1e6
    for i, (_, size, device) in enumerate(reversed(shown)):
        ax.barh(i, size / 1e6, color=DEVICE_COLOURS.get(device, "#e67e22"))
        ax.text(size / 1e6 + 0.02 * widest, i, device, va="center", fontsize=12)
    ax.set_yticks(range(len(shown)), [n for n, _, _ in reversed(shown)], fontsize=12)
    ax.set_xlim(0, 1.2 * widest)
    ax.set_xlabel("MB of parameters", fontsize=13)
    ax.tick_params(axis="x", labelsize=12)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig
