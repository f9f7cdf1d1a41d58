"""The planner page's figures: one FSDP2 step per block on a timeline, drawn from the
planner's own lanes (``distlab.planner.comm.fsdp_timeline``), and the published runs
against their left-out predictions."""

from __future__ import annotations


def timeline_figure(t: dict, zoom: int = 3):
    """Three views of one step on two lanes: the whole micro-batch, the start of its
    forward, the end of its backward (``zoom`` blocks each). The compute lane's waits,
    the communication not hidden, are hatched red."""
    import matplotlib.pyplot as plt

    blue, green, orange, red = "#3b6ea5", "#7a9e5a", "#e39b4c", "#c0504d"
    colors = {"forward": blue, "backward": "#6b8fc2", "head": "#2d4f75"}
    colors.update(gather=green, regather=green, reduce=orange)
    spans, step = t["spans"], t["step"]
    first = next(s for s in spans if s[1] == f"forward {zoom - 1}")[3]
    last = next(s for s in spans if s[1] == f"backward {zoom - 1}")[2]
    views = [
        ("one step (all blocks)", 0.0, step),
        ("zoom: the start of forward", 0.0, first),
        ("zoom: the end of backward", last, step),
    ]
    text = {"ha": "center", "va": "center", "color": "white", "clip_on": True}
    bar = {"height": 0.7, "edgecolor": "white", "lw": 0.3}
    hatch = {"height": 0.7, "color": "none", "edgecolor": red, "hatch": "////"}
    fig, axes = plt.subplots(3, 1, figsize=(4.8, 6.4))
    for ax, (title, a, b) in zip(axes, views):
        for lane, label, s, e in spans:
            y, kind = (1 if lane == "compute" else 0), label.split()[0]
            if e >= a and s <= b:
                ax.barh(y, e - s, left=s, color=colors[kind], **bar)
            if b - a < step / 2 and a <= s and e <= b and e - s > (b - a) / 12:
                ax.text((s + e) / 2, y, label, fontsize=9, **text)
        for s, e in t["waits"]:
            ax.barh(1, e - s, left=s, **hatch)
        if b - a == step:  # the whole step: name its three phases
            for kind in ("forward", "head", "backward"):
                ends = [x for _, k, *x in spans if k.split()[0] == kind]
                mid = (min(x[0] for x in ends) + max(x[1] for x in ends)) / 2
                ax.text(mid, 1, kind, fontsize=10, **text)
        ax.set_xlim(a, b)
        ax.set_yticks([0, 1], ["comm", "compute"], fontsize=10)
        ax.set_title(title, fontsize=11, loc="left")
        ax.tick_params(axis="x", labelsize=9)
    axes[-1].set_xlabel("seconds from the start of the step", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (blue, green, orange)]
    handles.append(plt.Rectangle((0, 0), 1, 1, fc="none", ec=red, hatch="////"))
    names = ["compute", "all-gather", "reduce-scatter", "exposed"]
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def validation_figure(v: dict):
    """Published against predicted tokens/s per GPU, the range as a bar: one point
    per run, by GPU kind."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 5.0))
    colors = ["#3b6ea5", "#c0504d", "#7a9e5a", "#8064a2", "#e39b4c"]
    gpus = sorted({r["gpu"] for r in v["timed"]})
    for gpu, color in zip(gpus, colors):
        rows = [r for r in v["timed"] if r["gpu"] == gpu]
        x = [r["published"] for r in rows]
        lo, mid, hi = zip(*(r["predicted"] for r in rows))
        err = [[m - a for a, m in zip(lo, mid)], [b - m for b, m in zip(hi, mid)]]
        ax.errorbar(x, mid, yerr=err, fmt="o", color=color, ms=4, lw=1, label=gpu)
    xs = [r["published"] for r in v["timed"]]
    a, b = min(xs) / 2, max(xs) * 2
    ax.plot([a, b], [a, b], color="#333", lw=1)
    ax.fill_between(
        [a, b],
        [a * 0.85, b * 0.85],
        [a * 1.15, b * 1.15],
        color="#999",
        alpha=0.2,
        label="within 15%",
    )
    ax.set(xscale="log", yscale="log", xlim=(a, b), ylim=(a, b))
    ax.set_xlabel("published tokens/s per GPU", fontsize=10)
    ax.set_ylabel("predicted, left out (range)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
