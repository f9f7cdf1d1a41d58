"""The planner's form for the page: every plan of a small grid predicted by Python and
shipped with the page, so the browser only looks answers up (no formula is written
twice: the page runs nothing but a lookup).

    display(HTML(planner_html()))

Each answer is ``distlab.planner.calibrate.predict_range``'s: tokens/s per GPU as a
range over the GEMM efficiencies the published runs of that GPU kind imply, and memory
per GPU with the fit against the GPU's capacity.
"""

from __future__ import annotations

import itertools
import json

from distlab.planner.calibrate import predict_range
from distlab.planner.hardware import GPUS, NETWORKS
from distlab.planner.predict import FIT_FRACTION, Plan, check, gpu_cluster
from distlab.planner.shapes import SHAPES

# the grid: what a reader chooses among (kept small: every cell is computed at build)
CHOICES = {
    "model": ("gpt2-xl", "llama3-8b", "llama3-70b"),
    "gpu": ("a100-80gb", "h100-sxm", "h100-96gb-500w"),
    # (GPUs, network between nodes)
    "cluster": ("8", "64/ib-200g", "64/ib-400g", "512/ib-400g"),
    "strategy": ("ddp", "zero1", "zero2", "fsdp2", "hsdp"),
    "ac": ("none", "selective-op", "full"),
    "micro_batch": ("1", "2", "4"),
    "seq_len": ("2048", "8192"),
}
HSDP_GROUP, GPUS_PER_NODE = 8, 8
DEFAULTS = {
    "model": "llama3-8b",
    "gpu": "h100-sxm",
    "cluster": "64/ib-400g",
    "strategy": "fsdp2",
    "ac": "selective-op",
    "micro_batch": "2",
    "seq_len": "8192",
}
# a control never wider than half its line
CONTROL = "width:11em;max-width:50%"


def _label(kind: str, value: str) -> str:
    if kind == "model":
        return SHAPES[value].label
    if kind == "gpu":
        return GPUS[value].label
    if kind == "cluster":
        gpus, _, net = value.partition("/")
        return f"{gpus} GPUs" + (f", {NETWORKS[net].label}" if net else ", one node")
    if kind == "strategy" and value == "hsdp":
        return f"hsdp (shard in groups of {HSDP_GROUP})"
    return value


def answer(key: dict[str, str]) -> list | str:
    """One cell: [GiB low, middle, high, fits, tokens/s low, middle, high] or the
    planner's error."""
    gpus, _, net = key["cluster"].partition("/")
    cluster = gpu_cluster(key["gpu"], int(gpus), GPUS_PER_NODE, net or None)
    plan = Plan(
        key["strategy"],
        int(key["micro_batch"]),
        int(key["seq_len"]),
        ac=key["ac"],
        group=HSDP_GROUP if key["strategy"] == "hsdp" else None,
    )
    try:
        check(SHAPES[key["model"]], cluster, plan)
    except ValueError as err:
        return str(err)
    # the memory range first: a plan that cannot fit is not timed
    r = predict_range(SHAPES[key["model"]], cluster, plan, timed=False)
    fits = r["memory"][1] <= FIT_FRACTION * cluster.device.memory_bytes
    mem = [round(x / 2**30, 1) for x in r["memory"]]
    if not fits:
        return mem + [0, None, None, None]
    r = predict_range(SHAPES[key["model"]], cluster, plan)
    return mem + [1] + [round(x) for x in r["tokens_per_s_per_gpu"]]


def form_data() -> dict:
    """Every cell of the grid, keyed by its choices joined with '|'."""
    cells = {}
    for values in itertools.product(*CHOICES.values()):
        key = dict(zip(CHOICES, values))
        cells["|".join(values)] = answer(key)
    return {"choices": list(CHOICES), "cells": cells, "fit_fraction": FIT_FRACTION}


def _select(name: str) -> str:
    items = "".join(
        f'<option value="{v}"{" selected" if v == DEFAULTS[name] else ""}>'
        f"{_label(name, v)}</option>"
        for v in CHOICES[name]
    )
    return f'<select name="{name}" style="{CONTROL}">{items}</select>'


# the browser's half: look the cell up and write it out
LOOKUP_JS = """
function distlabPlanner(uid) {
  const root = document.getElementById(uid);
  const data = JSON.parse(document.getElementById(uid + "-data").textContent);
  const f = root.querySelector("form");
  function render() {
    const key = data.choices.map((c) => f.elements[c].value).join("|");
    const cell = data.cells[key], out = root.querySelector(".out");
    if (typeof cell === "string") { out.textContent = cell; return; }
    const [mlo, mmid, mhi, fits, tlo, tmid, thi] = cell;
    const n = (x) => x.toLocaleString("en-US");
    const speed = fits ? "tokens/s per GPU: <b>" + n(tmid) + "</b> (" + n(tlo) +
      " to " + n(thi) + ")" : "not timed: the plan does not fit";
    out.innerHTML = "<p class='verdict'><b>" + (fits ? "fits" : "does not fit") +
      "</b>: <b>" + mmid + " GiB</b> per GPU (" + mlo + " to " + mhi + ")</p>" +
      "<p class='speed'>" + speed + "</p>";
  }
  f.addEventListener("input", render);
  render();
}
"""


def planner_html(uid: str = "distlab-planner") -> str:
    """A self-contained form (inline data and script, nothing fetched) for
    ``IPython.display.HTML``."""
    payload = json.dumps(form_data(), separators=(",", ":")).replace("</", "<\\/")
    field = (
        'style="display:flex;justify-content:space-between;align-items:center;'
        'gap:8px;min-width:0"'
    )
    names = {
        "model": "model",
        "gpu": "GPU",
        "cluster": "cluster",
        "strategy": "strategy",
        "ac": "activation checkpointing",
        "micro_batch": "micro-batch per GPU",
        "seq_len": "sequence length",
    }
    labels = "\n".join(
        f"<label {field}>{names[c]} {_select(c)}</label>" for c in CHOICES
    )
    grid = "display:grid;grid-template-columns:repeat(auto-fit,minmax(260px,1fr))"
    return (
        f'<div id="{uid}" style="font-family:sans-serif;font-size:14px;'
        f'max-width:720px">\n'
        f'<script type="application/json" id="{uid}-data">{payload}</script>\n'
        f'<form onsubmit="return false" style="{grid};gap:4px">\n{labels}\n</form>\n'
        f'<div class="out" style="margin-top:8px"></div>\n'
        f"<script>{LOOKUP_JS}distlabPlanner({json.dumps(uid)});</script>\n</div>"
    )
