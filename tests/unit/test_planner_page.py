"""The planner's static form: its script (book/_assets/memory-calculator.js,
``distlabPredict``) gives the numbers ``distlab.tools.planner.predict`` gives, over a
grid of plans, and the same one-line errors; the page fetches nothing. One node process
runs the whole grid (the fake page below)."""

import itertools
import json
import math
import re
import subprocess
from dataclasses import replace

import pytest

from distlab.tools.calculator_page import format_bytes
from distlab.tools.hardware import GPUS, NETWORKS
from distlab.tools.planner import (
    AC_MODES,
    PRECISIONS,
    STATES,
    STRATEGIES,
    Plan,
    gpu_cluster,
    predict,
)
from distlab.tools.planner_page import DEFAULTS, planner_data, planner_html
from distlab.tools.shapes import shape

# A stand-in for the browser: the form's elements, its output, and the two script
# elements; the page's script runs as the page runs it (it renders the default form),
# then renders each of FORMS and runs distlabPredict on every input of the grid,
# printing all of it as JSON.
FAKE_PAGE = """
const [grid, forms, NO_OVERLAP] = %s;
const elements = {};
const out = {innerHTML: "", textContent: ""};
const root = {querySelector: (sel) => (sel === "form" ? {elements, addEventListener() {}} : out)};
const setForm = (values) => { for (const [k, v] of Object.entries(values)) elements[k] = {value: String(v)}; };
setForm(forms[0]);
global.document = {getElementById: (id) => (id.endsWith("-data") ? {textContent: %s} : root)};
%s
const rendered = forms.map((values) => {
  setForm(values); out.innerHTML = out.textContent = ""; distlabPlanner("distlab-planner");
  return out.textContent || out.innerHTML;
});
const data = JSON.parse(document.getElementById("distlab-planner-data").textContent);
// a GPU whose communication cannot overlap its compute, as on this machine's CPU ranks (Cluster.overlap)
const more = JSON.parse(document.getElementById("distlab-planner-data").textContent);
more.gpus[NO_OVERLAP] = Object.assign({}, data.gpus["a100-80gb"], {overlap: false});
const results = grid.map((inp) => distlabPredict(inp.gpu === NO_OVERLAP ? more : data, inp));
console.log(JSON.stringify({rendered, results}));
"""  # noqa: E501 (a data string: HTML or JavaScript)

MODELS = ("llama3-8b", "llama3-70b", "gpt2-small", "shakespeare")
SEQ_LENS = {
    "llama3-8b": (8192, 2048),
    "llama3-70b": (8192, 4096),
    "gpt2-small": (1024, 512),
    "shakespeare": (256, 64),
}
# (GPUs, GPUs per node, network): one node, a node that is not full, several nodes
CLUSTERS = ((8, 8, None), (4, 8, None), (32, 8, "ib-200g"))


def grid() -> list[dict]:
    """Every model x strategy x AC mode x precision x accumulation x cluster; the GPU,
    network, micro-batch, sequence length and hybrid group turn over with the index, so
    each value appears."""
    inputs = []
    combos = itertools.product(
        MODELS, STRATEGIES, AC_MODES, PRECISIONS, (1, 4), CLUSTERS
    )
    for i, (
        model,
        strategy,
        ac,
        precision,
        accum,
        (gpus, per_node, network),
    ) in enumerate(combos):
        multi = gpus > per_node
        inputs.append(
            {
                "model": model,
                "gpu": list(GPUS)[i % len(GPUS)],
                "network": list(NETWORKS)[i // 3 % len(NETWORKS)] if multi else network,
                "gpus": gpus,
                "gpusPerNode": per_node,
                "strategy": strategy,
                "group": ((16, 8) if multi else (2, 4))[i // 7 % 2],
                "ac": ac,
                "microBatch": 1 + i // 3 % 2,
                "accum": accum,
                "seqLen": SEQ_LENS[model][i // 5 % 2],
                "precision": precision,
                "state": STATES[i // 11 % len(STATES)],
            }
        )
    return inputs


NO_OVERLAP = "a100-80gb, no overlap"
# the path gpu_cluster never takes (it overlaps): every strategy, with and without
# accumulation, one node and two
GOOD = grid() + [
    inp | {"gpu": NO_OVERLAP}
    for inp in grid()
    if inp["model"] in ("llama3-8b", "shakespeare") and inp["ac"] == "full"
]
BASE = {
    "model": "gpt2-small",
    "gpu": "a100-80gb",
    "network": None,
    "gpus": 8,
    "gpusPerNode": 8,
    "strategy": "hsdp",
}
BASE |= {
    "group": 4,
    "ac": "full",
    "microBatch": 2,
    "accum": 1,
    "seqLen": 1024,
    "precision": "bf16",
    "state": "fp32",
}
# each changes one input of BASE into one that Python's shape, gpu_cluster or
# check rejects
BAD = [
    {"model": "llama9"},
    {"model": "it's"},  # Python's repr quotes it with double quotes
    {"gpu": "v100"},
    {"network": "ethernet"},
    {"strategy": "zero3"},
    {"ac": "some"},
    {"precision": "fp16"},
    {"microBatch": 0},
    {"accum": -1},
    {"seqLen": 0},
    {"ac_every": 0},
    {"gpus": 0},
    {"gpus": 12},
    {"gpus": 16},
    {"seqLen": 1025},
    {"group": 3},
    {"group": 0},
    {"gpus": 16, "network": "ib-400g", "group": 5},
    # memory_calculator.per_rank_bytes rejects it, late
    {"gpus": 4.5, "strategy": "fsdp2"},
    {"group": 0.5},
    {"state": "fp8"},
]
BAD_INPUTS = [BASE | change for change in BAD]
# what Python does not reject but the form must: a node of 0 GPUs (Python divides by it)
# and fractions
FORM_ONLY = [
    ({"gpusPerNode": 0}, "gpus_per_node must be a whole number >= 1, got 0"),
    ({"microBatch": 1.5}, "micro_batch must be a whole number, got 1.5"),
    ({"seqLen": 64.5}, "seq_len must be a whole number, got 64.5"),
]


def python_answer(inp: dict) -> dict:
    """What the page should show for ``inp``: predict's dict, or the error's
    one line."""
    try:
        gpu = "a100-80gb" if inp["gpu"] == NO_OVERLAP else inp["gpu"]
        cluster = gpu_cluster(gpu, inp["gpus"], inp["gpusPerNode"], inp["network"])
        cluster = (
            replace(cluster, overlap=False) if inp["gpu"] == NO_OVERLAP else cluster
        )
        # the form leaves it at Plan's default
        every = {"ac_every": inp["ac_every"]} if "ac_every" in inp else {}
        plan = Plan(
            inp["strategy"],
            inp["microBatch"],
            inp["seqLen"],
            inp["accum"],
            inp["ac"],
            **every,
            precision=inp["precision"],
            group=inp["group"],
            state=inp["state"],
        )
        return predict(shape(inp["model"]), cluster, plan)
    except ValueError as err:
        return {"error": str(err)}


def form_values(inp: dict) -> dict:
    """The form's element values (names as planner_html writes them) for a
    grid input."""
    names = {
        "gpusPerNode": "per_node",
        "microBatch": "micro_batch",
        "seqLen": "seq_len",
    }
    return {
        names.get(k, k): "" if v is None else v
        for k, v in inp.items()
        if k != "ac_every"
    }


FORMS = [
    form_values(BASE | {"model": "llama3-70b", "strategy": "ddp"}),
    form_values(BASE | {"group": 3}),
]


@pytest.fixture(scope="module")
def page():
    html = planner_html()
    payload = re.search(
        r'<script type="application/json" id="distlab-planner-data">(.*?)</script>',
        html,
        re.S,
    )
    script = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
    inputs = GOOD + BAD_INPUTS + [BASE | change for change, _ in FORM_ONLY]
    program = FAKE_PAGE % (
        json.dumps([inputs, FORMS, NO_OVERLAP]),
        json.dumps(payload.group(1)),
        script,
    )
    # the program is bigger than one command-line argument may be: node reads it
    # from stdin
    node = subprocess.run(
        ["node", "-"], input=program, capture_output=True, text=True, timeout=120
    )
    assert node.returncode == 0, node.stderr
    got = json.loads(node.stdout)
    return {
        "html": html,
        "payload": payload.group(1),
        "rendered": got["rendered"],
        "results": got["results"],
    }


def differences(js, py, where: str = "") -> list[str]:
    """Where the two answers part: a key on one side only, or a number off by more than
    1e-9 relative."""
    if isinstance(py, dict):
        if not isinstance(js, dict) or set(js) != set(py):
            return [
                f"{where}: keys {sorted(js) if isinstance(js, dict) else js} != "
                f"{sorted(py)}"
            ]
        return [d for k in py for d in differences(js[k], py[k], f"{where}.{k}")]
    if isinstance(py, bool) or isinstance(py, str):
        return [] if js == py else [f"{where}: {js!r} != {py!r}"]
    return (
        []
        if math.isclose(js, py, rel_tol=1e-9, abs_tol=0.0)
        else [f"{where}: {js!r} != {py!r}"]
    )


def test_the_script_predicts_what_python_predicts_over_the_grid(page):
    results = page["results"][: len(GOOD)]
    assert len(GOOD) == 4 * 5 * 4 * 2 * 2 * 3 + 2 * 5 * 2 * 2 * 3 and len(
        results
    ) == len(GOOD)
    seen = {
        k: {inp[k] for inp in GOOD} for k in ("gpu", "network", "microBatch", "state")
    }
    assert (
        seen["gpu"] == {*GPUS, NO_OVERLAP}
        and seen["network"] == {None, *NETWORKS}
        and seen["microBatch"] == {1, 2}
    )
    assert seen["state"] == set(STATES)
    fits = set()
    for inp, js in zip(GOOD, results):
        py = python_answer(inp)
        assert "error" not in py, (inp, py)
        assert not differences(js, py), (inp, differences(js, py)[:5])
        fits.add(py["memory"]["fits"])
    assert fits == {True, False}  # the verdict is checked both ways


def test_bad_inputs_give_pythons_one_line_errors(page):
    results = page["results"][len(GOOD) : len(GOOD) + len(BAD_INPUTS)]
    for inp, js in zip(BAD_INPUTS, results):
        py = python_answer(inp)
        assert "error" in py, (inp, py)  # each one is bad for Python too
        assert js == py and "\n" not in js["error"], (inp, js, py)
    assert results[1]["error"].startswith(
        'unknown model "it\'s"; choose one of tiny, shakespeare'
    )


def test_empty_nodes_and_fractions_are_rejected_with_pythons_words(page):
    for (change, message), js in zip(
        FORM_ONLY, page["results"][len(GOOD) + len(BAD_INPUTS) :]
    ):
        assert js == {"error": message} == python_answer(BASE | change)


def test_the_form_renders_pythons_total_and_verdict_or_the_error(page):
    first, bad = page["rendered"]
    expected = python_answer(BASE | {"model": "llama3-70b", "strategy": "ddp"})[
        "memory"
    ]
    assert f"<b>{format_bytes(expected['total'])}</b>" in first
    assert (
        ("does not fit" in first) == (not expected["fits"])
        and "MFU" in first
        and "all-reduce" in first
    )
    assert bad == python_answer(BASE | {"group": 3})["error"]


def test_the_page_fetches_nothing_and_carries_planner_data(page):
    html = page["html"]
    for fetching in (
        "http",
        " src=",
        "<link",
        "fetch(",
        "XMLHttpRequest",
        "import(",
        "@import",
    ):
        assert fetching not in html, fetching
    assert json.loads(page["payload"]) == json.loads(json.dumps(planner_data()))
    for name, value in DEFAULTS.items():  # the form starts at the stated defaults
        assert f'name="{name}"' in html and (
            f'value="{value}" selected' in html or f'value="{value}" min' in html
        )
