"""The planner as a page: a static HTML form that predicts memory and step time with
no kernel.

    # in book/planner.md: works in the built book, offline
    display(HTML(planner_html()))

Presentation only: the numbers come from ``distlab.tools.planner``. ``planner_data()``
exports, from the Python objects themselves, every count and constant ``predict`` uses;
the form's script is the memory calculator's file
(``book/_assets/memory-calculator.js``, inlined, nothing fetched), whose
``distlabPredict`` ports ``predict`` term for term. tests/unit/test_planner_page.py runs
that script under node over a grid of plans and checks it against ``predict`` to 1e-9,
so a constant changed on one side and not the other fails there.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from distlab.tools.calculator_page import CALCULATOR_JS
from distlab.tools.hardware import GPUS, NETWORKS
from distlab.tools.memory_calculator import PARTS, bytes_per_param
from distlab.tools.memory_calculator import STRATEGIES as STATE_STRATEGIES
from distlab.tools.planner import (
    AC_MODES,
    FIT_FRACTION,
    OPTIMIZER_BYTES_PER_PARAM,
    PRECISIONS,
    STATES,
    STRATEGIES,
    Plan,
    gpu_cluster,
)
from distlab.tools.planner import (
    OPTIMIZER as STATE_OPTIMIZER,
)
from distlab.tools.planner import (
    ZERO_STAGE as STATE_STAGE,
)
from distlab.tools.planner_comm import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
from distlab.tools.shapes import SHAPES, ModelShape

# a control never wider than half its line: long option labels must not push the form
# past its box
CONTROL = "width:11em;max-width:50%"
STATE_LABELS = {
    "fp32": "fp32 (PyTorch's DDP and FSDP2)",
    "bf16_mixed": "bf16 + fp32 master (the ZeRO paper's)",
}
# the form's starting plan: Llama 3 8B on 8 nodes of 8 A100s, sharded, one 8192-token
# sequence per GPU
DEFAULTS = {
    "model": "llama3-8b",
    "gpu": "a100-80gb",
    "network": "ib-200g",
    "gpus": 64,
    "per_node": 8,
    "strategy": "fsdp2",
    "group": 8,
    "ac": "selective-op",
    "micro_batch": 1,
    "accum": 1,
    "seq_len": 8192,
    "precision": "bf16",
    "state": Plan().state,
}


def shape_data(s: ModelShape) -> dict:
    """The counts ``predict`` reads from a shape, each from the shape's own method."""
    return {
        "name": s.name,
        "label": s.label,
        "family": s.family,
        "gpt2": s.gpt2,
        "n_layer": s.n_layer,
        "d_model": s.d_model,
        "ffn_hidden": s.ffn_hidden,
        "vocab_size": s.vocab_size,
        "max_seq_len": s.max_seq_len,
        "n_params": s.n_params(),
        "block_params": s.block_params(),
        "root_params": s.root_params(),
        "block_matmul_params": s.block_matmul_params(),
        "saved_values_per_token": s.saved_values_per_token(),
        "saved_small_bytes_per_token": {
            p: s.saved_small_bytes_per_token(w) for p, w in PRECISIONS.items()
        },
        "elementwise_values_per_token": s.elementwise_values_per_token(),
        "loss_bytes_per_token": {
            p: s.loss_bytes_per_token(w) for p, w in PRECISIONS.items()
        },
        # flops_per_token(T) is affine in T (6 per matmul weight + 12*L*C*T): its
        # two coefficients
        "flops_per_token": {
            "constant": s.flops_per_token(0),
            "per_position": s.flops_per_token(1) - s.flops_per_token(0),
        },
    }


def link_data(link) -> dict:
    return {"label": link.name, "alpha": link.alpha, "bandwidth": link.busbw}


def planner_data() -> dict:
    """Everything the browser's ``distlabPredict`` needs, as JSON: shapes, GPUs, links,
    constants. GPUs and links are read off ``gpu_cluster``, so the form builds the
    clusters Python builds (NVLink inside a node; the chosen network between nodes). No
    source strings: the page stays free of URLs."""
    gpus = {}
    for name, gpu in GPUS.items():
        cluster = gpu_cluster(name, 1)
        device = {k: v for k, v in asdict(cluster.device).items() if k != "source"}
        gpus[name] = {
            "label": gpu.label,
            "device": device,
            "node_link": link_data(cluster.intra),
        }
        gpus[name]["overlap"] = cluster.overlap
    networks = {
        name: link_data(gpu_cluster(next(iter(GPUS)), 2, 1, name).inter)
        for name in NETWORKS
    }
    # each a memory_calculator dtype
    coef = {state: bytes_per_param(state, STATE_OPTIMIZER) for state in STATES}
    strategies = {}
    for strategy, stage in STATE_STAGE.items():
        spec = STATE_STRATEGIES[stage]
        sharded = {part: part in spec["sharded"] for part in PARTS}
        strategies[strategy] = {
            "label": spec["label"],
            "divisor": spec["divisor"],
            "sharded": sharded,
        }
    return {
        "shapes": {name: shape_data(s) for name, s in SHAPES.items()},
        "gpus": gpus,
        "networks": networks,
        "strategies": list(STRATEGIES),
        "ac_modes": list(AC_MODES),
        "precisions": dict(PRECISIONS),
        "parts": list(PARTS),
        "states": list(STATES),
        "state_bytes_per_param": coef,
        "state_strategies": strategies,
        "fit_fraction": FIT_FRACTION,
        "optimizer_bytes_per_param": OPTIMIZER_BYTES_PER_PARAM,
        "ddp_bucket_bytes": DDP_BUCKET_BYTES,
        "ddp_first_bucket_bytes": DDP_FIRST_BUCKET_BYTES,
        # the Plan fields the form leaves at their defaults (the script reads them by
        # these names)
        "plan_defaults": {
            k: getattr(Plan(), k)
            for k in ("ac_every", "reduce_bytes", "sync_every_micro_batch", "state")
        },
    }


def _select(name: str, options: dict[str, str]) -> str:
    chosen = lambda k: " selected" if k == DEFAULTS[name] else ""  # noqa: E731
    items = "".join(
        f'<option value="{k}"{chosen(k)}>{label}</option>'
        for k, label in options.items()
    )
    return f'<select name="{name}" style="{CONTROL}">{items}</select>'


def _number(name: str) -> str:
    return (
        f'<input name="{name}" type="number" value="{DEFAULTS[name]}" min="1" '
        f'step="1" style="{CONTROL}">'
    )


def planner_html(uid: str = "distlab-planner") -> str:
    """A self-contained form (inline data and script, nothing fetched) for
    ``IPython.display.HTML``."""
    data = planner_data()
    # nothing in the data may close the tag
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    script = CALCULATOR_JS.read_text()
    if "</script" in script.lower():  # would end the inline script early
        raise ValueError(
            f"{CALCULATOR_JS} contains '</script': the form inlines it in a "
            "<script> element"
        )
    networks = {"": "none: one node"} | {
        k: v["label"] for k, v in data["networks"].items()
    }
    field = (
        'style="display:flex;justify-content:space-between;align-items:center;'
        'gap:8px;min-width:0"'
    )
    rows = [
        ("model", _select("model", {k: v["label"] for k, v in data["shapes"].items()})),
        ("GPU", _select("gpu", {k: v["label"] for k, v in data["gpus"].items()})),
        ("GPUs in all", _number("gpus")),
        ("GPUs per node (NVLink inside)", _number("per_node")),
        ("network between nodes", _select("network", networks)),
        (
            "strategy",
            _select(
                "strategy",
                {k: f"{k}: {v['label']}" for k, v in data["state_strategies"].items()},
            ),
        ),
        ("group size (hsdp: shard within it)", _number("group")),
        ("activation checkpointing", _select("ac", {k: k for k in data["ac_modes"]})),
        ("micro-batch per GPU", _number("micro_batch")),
        ("micro-batches per step", _number("accum")),
        ("sequence length", _number("seq_len")),
        (
            "precision of the compute",
            _select("precision", {k: k for k in data["precisions"]}),
        ),
        (
            "model state kept in",
            _select("state", {k: STATE_LABELS.get(k, k) for k in data["states"]}),
        ),
    ]
    labels = "\n".join(
        f"<label {field}>{text} {control}</label>" for text, control in rows
    )
    return f"""<div id="{uid}" style="font-family:sans-serif;font-size:14px;max-width:720px">
<script type="application/json" id="{uid}-data">{payload}</script>
<form onsubmit="return false" style="display:grid;grid-template-columns:repeat(auto-fit,minmax(260px,1fr));gap:4px">
{labels}
</form>
<div class="out" style="margin-top:8px"></div>
<script>{script}distlabPlanner({json.dumps(uid)});</script>
</div>"""  # noqa: E501 (a data string: HTML or JavaScript)
