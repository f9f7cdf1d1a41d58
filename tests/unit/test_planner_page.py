"""The planner's static form (``distlab.planner.form``): every cell it ships is the
planner's own answer, its script only looks cells up and writes them out, and the page
fetches nothing. One node process runs the script on a stand-in for the browser."""

import json
import subprocess

import pytest

from distlab.planner.calibrate import predict_range
from distlab.planner.form import (
    CHOICES,
    DEFAULTS,
    LOOKUP_JS,
    answer,
    form_data,
    planner_html,
)
from distlab.planner.predict import Plan, gpu_cluster
from distlab.planner.shapes import SHAPES

# the form's elements, its output; the script renders each of FORMS in turn
FAKE_PAGE = """
const [forms, payload] = %s;
const elements = {}, out = {innerHTML: "", textContent: ""};
const form = {elements, addEventListener() {}};
const root = {querySelector: (sel) => (sel === "form" ? form : out)};
global.document = {getElementById: (id) => (id.endsWith("-data")
  ? {textContent: payload} : root)};
%s
const rendered = forms.map((values) => {
  for (const [k, v] of Object.entries(values)) elements[k] = {value: v};
  out.innerHTML = out.textContent = ""; distlabPlanner("distlab-planner");
  return out.textContent || out.innerHTML;
});
console.log(JSON.stringify(rendered));
"""

FITS = dict(DEFAULTS)
TOO_BIG = DEFAULTS | {"model": "llama3-70b", "strategy": "ddp", "cluster": "8"}
BAD = DEFAULTS | {"model": "gpt2-xl"}  # 8192 positions: more than GPT-2 has


@pytest.fixture(scope="module")
def data():
    return form_data()


@pytest.fixture(scope="module")
def rendered(data):
    payload = json.dumps(data)
    script = FAKE_PAGE % (json.dumps([[FITS, TOO_BIG, BAD], payload]), LOOKUP_JS)
    # bigger than one command-line argument may be: node reads it from stdin
    done = subprocess.run(
        ["node", "-"], input=script, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def key(values: dict) -> str:
    return "|".join(values[c] for c in CHOICES)


def test_every_cell_is_the_planners_answer(data):
    assert len(data["cells"]) == len(
        [1 for _ in __import__("itertools").product(*CHOICES.values())]
    )
    cell = data["cells"][key(FITS)]
    gpus, _, net = FITS["cluster"].partition("/")
    cluster = gpu_cluster(FITS["gpu"], int(gpus), 8, net)
    plan = Plan("fsdp2", 2, 8192, ac="selective-op")
    r = predict_range(SHAPES[FITS["model"]], cluster, plan)
    assert cell[:3] == [round(x / 2**30, 1) for x in r["memory"]]
    assert cell[3] == 1 and cell[4:] == [round(x) for x in r["tokens_per_s_per_gpu"]]
    assert cell[4] <= cell[5] <= cell[6]
    assert data["cells"][key(TOO_BIG)][3:] == [0, None, None, None]
    assert (
        data["cells"][key(BAD)]
        == "seq_len 8192 is longer than gpt2-xl's 1024 positions"
    )
    assert answer(FITS) == cell


def test_the_script_writes_out_the_cell_it_looks_up(rendered, data):
    fits, too_big, bad = rendered
    lo, mid, hi, _, tlo, tmid, thi = data["cells"][key(FITS)]
    assert f"<b>fits</b>: <b>{mid:g} GiB</b> per GPU ({lo:g} to {hi:g})" in fits
    assert f"<b>{tmid:,}</b> ({tlo:,} to {thi:,})" in fits
    assert "does not fit" in too_big and "not timed" in too_big
    assert bad == data["cells"][key(BAD)]


def test_the_page_fetches_nothing_and_starts_at_the_defaults():
    html = planner_html()
    for fetching in ("http", " src=", "<link", "fetch(", "XMLHttpRequest", "import("):
        assert fetching not in html, fetching
    for name, value in DEFAULTS.items():
        assert f'name="{name}"' in html and f'value="{value}" selected' in html
