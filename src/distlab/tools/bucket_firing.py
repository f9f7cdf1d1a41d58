"""DDP's buckets firing during backward, drawn from recorded backwards: the order in
which the gradients became ready and the moments DDP launched each bucket's all-reduce,
against the bucket layout DDP used.

``recorded`` is what ``distlab.chapters.ddp_internals.bucket_layouts`` returns:
``recorded["backwards"]``, one dict per backward with its ``events`` in the order they
happened on one rank (``("grad", name)`` when a parameter's gradient was complete,
``("launch", b)`` when DDP handed bucket ``b`` to its all-reduce; recorded by
``distlab.tools.comm_timeline``: ``Timeline.watch_gradients`` and the comm hook
``timestamping_hook``) and its ``buckets``, ``[(bytes, [names])]`` in launch order; and
``recorded["bytes"]`` per parameter. The x axis is that order, each gradient as wide as
its bytes, not a clock: the picture is the same on every machine and every run.

    figure(recorded, ["Step 1", "Steps 2+"])  # a strip per backward, every bucket fired
    widget(recorded, ["Step 1", "Steps 2+"])  # the same, stepped through: no kernel
"""

from __future__ import annotations

from distlab.infra.stepper import figure_html, stepper

FONT = 15
BUCKET_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
ONE_BUCKET = "#7f7f7f"  # a layout of one bucket: grey, so it is not read as bucket 0


def launches(events: list) -> dict[int, int]:
    """Bucket -> how many gradients were ready when DDP launched it."""
    ready, out = 0, {}
    for what, item in events:
        if what == "grad":
            ready += 1
        elif what == "launch":
            out[item] = ready
    return out


def ready_order(events: list) -> list[str]:
    return [item for what, item in events if what == "grad"]


def _group(name: str) -> str:
    """The part of the model a parameter belongs to: ``blocks.3``, ``ln_f``,
    ``embeddings``."""
    parts = name.split(".")
    if parts[0] == "blocks":
        return ".".join(parts[:2])
    return "embeddings" if parts[0] in ("wte", "wpe") else parts[0]


def stops(recorded: dict) -> list[int]:
    """Where the stepping stops (as gradients ready): after each part of the model,
    and at each launch."""
    order = ready_order(recorded["backwards"][-1]["events"])
    at = {0, len(order)}
    at |= {i for i in range(1, len(order)) if _group(order[i]) != _group(order[i - 1])}
    for b in recorded["backwards"]:
        at |= set(launches(b["events"]).values())
    return sorted(at)


def _draw(ax, recorded: dict, names: list[str], ready: int) -> None:
    """Each backward a strip of its gradients in the order they became ready, each as
    wide as its bytes (a rough clock: a layer's backward takes time in proportion to
    its weights), coloured by bucket, faint until ready; a marker at each launch."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    backwards = recorded["backwards"]
    order = ready_order(backwards[-1]["events"])
    edges = [0.0]
    for name in order:
        edges.append(edges[-1] + recorded["bytes"][name] / 2**20)
    for row, (b, name) in enumerate(zip(backwards, names)):
        y, one = len(backwards) - 1 - row, len(b["buckets"]) == 1
        bucket_of = {n: i for i, (_, ns) in enumerate(b["buckets"]) for n in ns}
        for x, param in enumerate(order):
            colour = ONE_BUCKET if one else BUCKET_COLOURS[bucket_of[param] % 6]
            if x >= ready:  # not ready yet: the colour faded (opaque: no seams)
                colour = tuple(0.85 + 0.15 * c for c in to_rgb(colour))
            width = edges[x + 1] - edges[x]
            ax.add_patch(Rectangle((edges[x], y), width, 0.5, color=colour, lw=0))
        for bucket, at in launches(b["events"]).items():
            if at <= ready:
                colour = ONE_BUCKET if one else BUCKET_COLOURS[bucket % 6]
                ax.plot(edges[at], y + 0.62, "v", color=colour, ms=12, clip_on=False)
                tag = {"boxstyle": "round,pad=0.1", "facecolor": "white", "lw": 0}
                ax.text(
                    edges[at],
                    y + 0.8,
                    f"b{bucket}",
                    ha="center",
                    fontsize=FONT,
                    bbox=tag,
                    zorder=5,
                )
        label = f"{name}: {len(b['buckets'])} bucket{'s' * (not one)}"
        box = {
            "boxstyle": "round,pad=0.2",
            "facecolor": "white",
            "alpha": 0.85,
            "lw": 0,
        }
        ax.text(
            0.08 * edges[-1],
            y + 0.25,
            label,
            va="center",
            fontsize=FONT,
            bbox=box,
            zorder=5,
        )
    starts = [
        i for i in range(1, len(order)) if _group(order[i]) != _group(order[i - 1])
    ]
    ax.vlines([edges[i] for i in starts], -0.05, len(backwards), color="white", lw=1.5)
    if 0 < ready < len(order):
        ax.axvline(edges[ready], color="black", lw=1.5, ls=":")
    blocks = [i for i in [0, *starts] if order[i].startswith("blocks.")]
    ax.set_xticks([edges[i] for i in blocks], [_group(order[i])[7:] for i in blocks])
    ax.tick_params(axis="x", labelsize=FONT - 1)
    ax.set_xlim(0, edges[-1])
    ax.set_ylim(-0.1, len(backwards) + 0.05)
    ax.set_yticks([])
    ax.set_xlabel("gradients as they became ready (block 5 to 0)", fontsize=FONT - 1)
    ax.spines[["top", "right", "left"]].set_visible(False)


def frame(recorded: dict, names: list[str], ready: int):
    """The strips when ``ready`` gradients are in."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.4, 0.8 + 1.1 * len(recorded["backwards"])))
    # a fixed layout, so that stepping does not shift the strips
    fig.subplots_adjust(left=0.03, right=0.95, top=0.97, bottom=0.27)
    _draw(ax, recorded, names, ready)
    return fig


def figure(recorded: dict, names: list[str]):
    """Every recorded backward as a strip of its gradients, coloured by bucket, with a
    marker where each bucket was launched."""
    return frame(recorded, names, len(recorded["backwards"][-1]["events"]))


def caption(recorded: dict, names: list[str], ready: int) -> str:
    """What happened by the time ``ready`` gradients were in, in a sentence or two."""
    order = ready_order(recorded["backwards"][-1]["events"])
    if ready == 0:
        return "Backward starts at the loss: no gradient is ready, no bucket has left."
    last = order[ready - 1]
    said = [f"{ready} of {len(order)} gradients ready (the last: <code>{last}</code>)."]
    for b, name in zip(recorded["backwards"], names):
        for k, at in launches(b["events"]).items():
            if at == ready:
                size = b["buckets"][k][0] / 2**20
                who = "its only bucket" if len(b["buckets"]) == 1 else f"bucket {k}"
                said.append(
                    f"{name}: {who} ({size:.1f} MiB) is full, its all-reduce starts."
                )
    if ready == len(order):
        said.append("<code>backward()</code> returns once every bucket has arrived.")
    elif len(said) == 1:
        said.append("Backward goes on; launched buckets travel meanwhile.")
    return " ".join(said)


def widget(recorded: dict, names: list[str]):
    """The strips stepped through backward: a slider and a play button over views
    rendered in advance, so it works in the built page with no kernel (as the ring
    widget of book/collectives.md). It opens on the last step: every bucket fired."""
    at = stops(recorded)
    views = [
        f"<p style='min-height:3.2em'>{caption(recorded, names, r)}</p>"
        + figure_html(frame(recorded, names, r))
        for r in at
    ]
    return stepper(views, "backward", start=len(views) - 1)
