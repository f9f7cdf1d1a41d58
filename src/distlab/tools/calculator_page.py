"""The memory calculator as a page: a static HTML form and an ipywidgets version.

    display(HTML(calculator_html()))   # works in the built book, no Python kernel needed
    display(calculator_widget())       # live notebook: Python computes each answer
    print(format_estimate(estimate("paper_7.5b", 64, "bf16_mixed", strategy="zero1")))

Presentation only: every number comes from ``distlab.tools.memory_calculator``. The HTML form
embeds ``calculator_data()`` as JSON and its inline script multiplies those coefficients;
the widget calls ``estimate()`` directly, and ``format_estimate`` prints what it returns.
"""

from __future__ import annotations

import json

from distlab.tools.memory_calculator import DTYPES, GB, MODELS, OPTIMIZERS, PARTS, STRATEGIES, calculator_data, estimate


def format_bytes(n: float) -> str:
    """Decimal units, as the ZeRO paper uses: 1 GB = 1e9 bytes."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            v = n / size
            return f"{v:.{0 if v >= 100 else 1 if v >= 10 else 2}f} {unit}"  # as the page's fmt()
    return f"{n:.0f} B"


# The browser half of the calculator. Its only arithmetic is in perRankBytes: the coefficients
# from calculator_data() times the inputs, divided by N (or g) for a sharded part.
_SCRIPT = """
(function () {
  const root = document.getElementById("%(uid)s");
  const data = JSON.parse(document.getElementById("%(uid)s-data").textContent);
  // --- begin formula ---
  function perRankBytes(data, inp) {
    const model = data.models[inp.model];
    const P = model ? model.params : inp.customParams;
    const s = data.strategies[inp.strategy];
    const coef = data.bytes_per_param[inp.dtype][inp.optimizer];
    const d = s.divisor === "group" ? inp.group : inp.ranks;
    const out = {};
    for (const part of data.parts) out[part] = coef[part] * P / (s.sharded[part] ? d : 1);
    out.total = out.params + out.grads + out.optimizer;
    out.activations = null;
    if (model && model.activations) {
      const a = model.activations[inp.ac ? "on" : "off"];
      out.activations = a.per_token * inp.batch * inp.seq + a.per_position * inp.seq + a.constant;
      out.total = out.total + out.activations;
    }
    return out;
  }
  // --- end formula ---
  const whole = (x, lo, hi) => Number.isInteger(x) && x >= lo && x <= hi;
  function problem(inp) {
    if (!whole(inp.ranks, 1, 1024)) return "ranks N must be a whole number from 1 to 1024";
    const hybrid = data.strategies[inp.strategy].divisor === "group";
    if (hybrid && !(whole(inp.group, 1, inp.ranks) && inp.ranks %% inp.group === 0))
      return "hybrid sharding needs a group size g that divides N";
    const model = data.models[inp.model];
    if (!model && !(inp.customParams > 0)) return "the number of parameters must be positive";
    if (model && model.activations && !(whole(inp.batch, 1, 1e6) && whole(inp.seq, 1, model.block_size)))
      return "micro-batch must be >= 1 and sequence length from 1 to " + model.block_size;
    return "";
  }
  function fmt(n) {
    for (const [unit, size] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]])
      if (n >= size) return (n / size).toFixed(n / size >= 100 ? 0 : n / size >= 10 ? 1 : 2) + " " + unit;
    return n.toFixed(0) + " B";
  }
  const colors = {params: "#3b6ea5", grads: "#6c9bd2", optimizer: "#a9c6ea", activations: "#e39b4c"};
  function render() {
    const f = root.querySelector("form").elements;
    const num = (name) => Number(f[name].value);
    const inp = {model: f.model.value, customParams: num("custom") * 1e9, ranks: num("ranks"),
                 group: num("group"), dtype: f.dtype.value, optimizer: f.optimizer.value,
                 strategy: f.strategy.value, ac: f.ac.checked, batch: num("batch"), seq: num("seq")};
    const out = root.querySelector(".out"), err = problem(inp);
    if (err) { out.textContent = err; return; }
    const r = perRankBytes(data, inp);
    const parts = [...data.parts, "activations"];
    const cell = "<td style='text-align:right'>";
    let rows = "", bar = "", legend = "";
    for (const p of parts) {
      const label = p === "activations" ? "activations (fp32, peak)" : p;
      const shown = r[p] === null ? "n/a (no architecture)" : fmt(r[p]);
      rows += "<tr><td>" + label + "</td>" + cell + shown + "</td></tr>";
      const width = 100 * r[p] / r.total;
      if (r[p]) bar += "<div title='" + p + "' style='background:" + colors[p] + ";width:" + width + "%%'></div>";
      legend += "<span style='color:" + colors[p] + "'>&#9632;</span> " + p + " &nbsp; ";
    }
    rows += "<tr><td><b>total per rank</b></td>" + cell + "<b>" + fmt(r.total) + "</b></td></tr>";
    const box = "<div style='display:flex;height:22px;width:100%%;border:1px solid #888'>";
    out.innerHTML = "<table>" + rows + "</table>" + box + bar + "</div>" + legend;
  }
  root.querySelector("form").addEventListener("input", render);
  render();
})();
"""


def calculator_html(uid: str = "distlab-memcalc") -> str:
    """A self-contained form (inline data and script, nothing fetched) for ``IPython.display.HTML``."""
    data = calculator_data()
    options = lambda d: "".join(f'<option value="{k}">{v}</option>' for k, v in d.items())  # noqa: E731
    models = {k: v["label"] for k, v in data["models"].items()} | {"custom": "free: parameters (billions)"}
    strategies = {k: v["label"] for k, v in data["strategies"].items()}
    dtypes = {"fp32": "fp32", "bf16_mixed": "bf16 mixed precision, fp32 master weights"}
    optimizers = {"adamw": "AdamW", "sgd_momentum": "SGD with momentum", "sgd": "SGD"}
    field = 'style="display:flex;justify-content:space-between;gap:8px"'
    # nothing in the data may close the script tag
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
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
<script>{_SCRIPT % {"uid": uid}}</script>
</div>"""


def calculator_widget():
    """The same calculator with ipywidgets, for a live notebook (Python computes each answer)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    controls = {
        "model": w.Dropdown(
            description="model",
            options=[(v["label"], k) for k, v in MODELS.items()] + [("free parameter count", "free")],
        ),
        "free_billions": w.FloatText(7.5, description="free: billions"),
        "ranks": w.BoundedIntText(8, min=1, max=1024, description="ranks N"),
        "dtype": w.Dropdown(options=list(DTYPES), description="precision"),
        "optimizer": w.Dropdown(options=list(OPTIMIZERS), description="optimizer"),
        "strategy": w.Dropdown(description="strategy", options=[(v["label"], k) for k, v in STRATEGIES.items()]),
        "group_size": w.BoundedIntText(4, min=1, max=1024, description="group g"),
        "activation_checkpointing": w.Checkbox(False, description="activation checkpointing"),
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
        for part in (*PARTS, "activations"):
            if est[part]:
                ax.barh(0, est[part] / GB, left=left / GB, label=part)
                left += est[part]
        ax.set_yticks([])
        ax.set_xlabel("GB per rank")
        ax.legend(ncol=4, fontsize=8)
        plt.show()

    return w.VBox([w.VBox(list(controls.values())), w.interactive_output(show, controls)])


def format_estimate(est: dict) -> str:
    """The calculator's table as text: one line per part, then the total."""
    shown = {
        part: "n/a (no architecture)" if est[part] is None else format_bytes(est[part])
        for part in (*PARTS, "activations")
    }
    lines = [f"{part:12} {text:>22}" for part, text in shown.items()]
    return "\n".join(lines + [f"{'total':12} {format_bytes(est['total']):>22}"])
