"""The memory calculator as a page: a static HTML form and an ipywidgets version.

    display(HTML(calculator_html()))  # works in the built book, no Python kernel needed
    display(calculator_widget())      # live notebook: Python computes each answer
    print(format_estimate(estimate("paper_7.5b", 64, "bf16_mixed", strategy="zero1")))

Presentation only: every number comes from ``distlab.tools.memory_calculator``. The HTML
form embeds ``calculator_data()`` as JSON, and its script
(``book/_assets/memory-calculator.js``, inlined) multiplies those coefficients; the
widget calls ``estimate()`` directly, and ``format_estimate`` prints what it returns.
"""

from __future__ import annotations

import json

from distlab.infra.paths import REPO_ROOT
from distlab.infra.tables import format_bytes
from distlab.tools.memory_calculator import (
    DTYPES,
    GB,
    MODELS,
    OPTIMIZERS,
    PARTS,
    STRATEGIES,
    calculator_data,
    estimate,
)

# the rows of the calculator: model state, then what a step holds for a while (FSDP2's
# gathered parameters and the activations, both at their peak)
SHOWN = (*PARTS, "gathered", "activations")


# The browser half of the calculator: a real .js file, inlined into the form (the page's
# HTML is a notebook output, which ships whole; nothing is fetched). Its only arithmetic
# is in perRankBytes.
CALCULATOR_JS = REPO_ROOT / "book" / "_assets" / "memory-calculator.js"


def calculator_html(uid: str = "distlab-memcalc") -> str:
    """A self-contained form (inline data and script, nothing fetched) for
    ``IPython.display.HTML``."""
    data = calculator_data()

    def options(d):
        return "".join(f'<option value="{k}">{v}</option>' for k, v in d.items())

    models = {k: v["label"] for k, v in data["models"].items()} | {
        "custom": "free: parameters (billions)"
    }
    strategies = {k: v["label"] for k, v in data["strategies"].items()}
    dtypes = {"fp32": "fp32", "bf16_mixed": "bf16 mixed precision, fp32 master weights"}
    optimizers = {"adamw": "AdamW", "sgd_momentum": "SGD with momentum", "sgd": "SGD"}
    field = 'style="display:flex;justify-content:space-between;gap:8px"'
    # nothing in the data may close the script tag
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    script = CALCULATOR_JS.read_text()
    if "</script" in script.lower():  # would end the inline script early
        raise ValueError(
            f"{CALCULATOR_JS} contains '</script': the form inlines it in a "
            "<script> element"
        )
    return f"""<div id="{uid}" style="font-family:sans-serif;font-size:14px;max-width:640px">
<script type="application/json" id="{uid}-data">{payload}</script>
<form onsubmit="return false" style="display:grid;grid-template-columns:1fr 1fr;gap:4px 16px">
<label {field}>model <select name="model">{options(models)}</select></label>
<label {field}>parameters, free (billions)
  <input name="custom" type="number" value="7.5" min="0" step="any" size="6"></label>
<label {field}>ranks N <input name="ranks" type="number" value="8" min="1" max="1024" step="1"></label>
<label {field}>group size g (hybrid) <input name="group" type="number" value="4" min="1" step="1"></label>
<label {field}>precision <select name="dtype">{options(dtypes)}</select></label>
<label {field}>optimizer <select name="optimizer">{options(optimizers)}</select></label>
<label {field}>strategy <select name="strategy">{options(strategies)}</select></label>
<label {field}>activation checkpointing <input name="ac" type="checkbox"></label>
<label {field}>micro-batch per rank <input name="batch" type="number" value="8" min="1" step="1"></label>
<label {field}>sequence length <input name="seq" type="number" value="64" min="1" step="1"></label>
</form>
<div class="out" style="margin-top:8px"></div>
<script>{script}distlabMemoryCalculator({json.dumps(uid)});</script>
</div>"""  # noqa: E501 (a data string: HTML or JavaScript)


def calculator_widget():
    """The same calculator with ipywidgets, for a live notebook (Python computes
    each answer)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    controls = {
        "model": w.Dropdown(
            description="model",
            options=[(v["label"], k) for k, v in MODELS.items()]
            + [("free parameter count", "free")],
        ),
        "free_billions": w.FloatText(7.5, description="free: billions"),
        "ranks": w.BoundedIntText(8, min=1, max=1024, description="ranks N"),
        "dtype": w.Dropdown(options=list(DTYPES), description="precision"),
        "optimizer": w.Dropdown(options=list(OPTIMIZERS), description="optimizer"),
        "strategy": w.Dropdown(
            description="strategy",
            options=[(v.label, k) for k, v in STRATEGIES.items()],
        ),
        "group_size": w.BoundedIntText(4, min=1, max=1024, description="group g"),
        "activation_checkpointing": w.Checkbox(
            False, description="activation checkpointing"
        ),
        "micro_batch": w.BoundedIntText(8, min=1, max=4096, description="micro-batch"),
        "seq_len": w.BoundedIntText(64, min=1, max=1024, description="seq length"),
    }

    def show(model, free_billions, **inputs):
        try:
            est = estimate(free_billions * 1e9 if model == "free" else model, **inputs)
        except ValueError as err:
            print(err)
            return
        print(format_estimate(est))
        fig, ax = plt.subplots(figsize=(7, 1.2))
        left = 0.0
        for part in SHOWN:
            if est[part]:
                ax.barh(0, est[part] / GB, left=left / GB, label=part)
                left += est[part]
        ax.set_yticks([])
        ax.set_xlabel("GB per rank")
        ax.legend(ncol=4, fontsize=8)
        plt.show()

    return w.VBox(
        [w.VBox(list(controls.values())), w.interactive_output(show, controls)]
    )


def format_estimate(est: dict) -> str:
    """The calculator's table as text: one line per part, then the total."""
    shown = {
        part: "n/a (no architecture)" if est[part] is None else format_bytes(est[part])
        for part in SHOWN
    }
    lines = [f"{part:12} {text:>22}" for part, text in shown.items()]
    return "\n".join(lines + [f"{'total':12} {format_bytes(est['total']):>22}"])
