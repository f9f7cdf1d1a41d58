// The browser half of the memory calculator on the zero_memory page. distlab.tools.calculator_page
// inlines this file into the form it returns and calls distlabMemoryCalculator with the form's id;
// it is not one of the files _config.yml loads on every page. The numbers come from the JSON that
// calculator_data() exports, embedded next to the form. Its only arithmetic is in perRankBytes,
// those coefficients times the inputs, divided by N (or g) for a sharded part. (The planner's form,
// distlab.planner.form, ships every answer precomputed and only looks them up.)

// Function declarations, not consts: two forms on one page each inline this file, and a second
// top-level const of the same name would stop the second script.
// distlabFormatBytes is calculator_page.format_bytes: decimal units, 1 GB = 1e9 bytes.
function distlabFormatBytes(n) {
  for (const [unit, size] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]])
    if (n >= size) return (n / size).toFixed(n / size >= 100 ? 0 : n / size >= 10 ? 1 : 2) + " " + unit;
  return n.toFixed(0) + " B";
}
function distlabWhole(x, lo, hi) { return Number.isInteger(x) && x >= lo && x <= hi; }

function distlabMemoryCalculator(uid) {
  const root = document.getElementById(uid);
  const data = JSON.parse(document.getElementById(uid + "-data").textContent);
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
    // whole parameters FSDP2 holds on top of its shards, in the compute dtype (as many bytes as
    // the params coefficient): every unit, or the root and two blocks (known from the architecture)
    const whole = s.gathered === "model" ? P : s.gathered === "units" ? (model ? model.gathered_units : null) : 0;
    out.gathered = whole === null ? null : coef.params * whole;
    out.activations = null;
    if (model && model.activations) {
      // the peak is the larger of two moments of backward, each affine in (B*T, T, 1)
      const moments = model.activations[inp.dtype][inp.ac ? "on" : "off"];
      out.activations = Math.max(...moments.map(
        (a) => a.per_token * inp.batch * inp.seq + a.per_position * inp.seq + a.constant));
    }
    out.total = out.total + (out.gathered || 0) + (out.activations || 0);
    return out;
  }
  // --- end formula ---
  const whole = distlabWhole, fmt = distlabFormatBytes;
  function problem(inp) {
    if (!whole(inp.ranks, 1, 1024)) return "ranks N must be a whole number from 1 to 1024";
    const hybrid = data.strategies[inp.strategy].divisor === "group";
    if (hybrid && !(whole(inp.group, 1, inp.ranks) && inp.ranks % inp.group === 0))
      return "hybrid sharding needs a group size g that divides N";
    const model = data.models[inp.model];
    if (!model && !(inp.customParams > 0)) return "the number of parameters must be positive";
    if (model && model.activations && !(whole(inp.batch, 1, 1e6) && whole(inp.seq, 1, model.block_size)))
      return "micro-batch must be >= 1 and sequence length from 1 to " + model.block_size;
    return "";
  }
  const colors = {params: "#3b6ea5", grads: "#6c9bd2", optimizer: "#a9c6ea", gathered: "#7a9e5a",
                  activations: "#e39b4c"};
  const labels = {gathered: "gathered parameters (FSDP2)", activations: "activations (peak)"};
  function render() {
    const f = root.querySelector("form").elements;
    const num = (name) => Number(f[name].value);
    const inp = {model: f.model.value, customParams: num("custom") * 1e9, ranks: num("ranks"),
                 group: num("group"), dtype: f.dtype.value, optimizer: f.optimizer.value,
                 strategy: f.strategy.value, ac: f.ac.checked, batch: num("batch"), seq: num("seq")};
    const out = root.querySelector(".out"), err = problem(inp);
    if (err) { out.textContent = err; return; }
    const r = perRankBytes(data, inp);
    const parts = [...data.parts, "gathered", "activations"];
    const cell = "<td style='text-align:right'>";
    let rows = "", bar = "", legend = "";
    for (const p of parts) {
      const label = labels[p] || p;
      const shown = r[p] === null ? "n/a (no architecture)" : fmt(r[p]);
      rows += "<tr><td>" + label + "</td>" + cell + shown + "</td></tr>";
      const width = 100 * r[p] / r.total;
      if (r[p]) bar += "<div title='" + p + "' style='background:" + colors[p] + ";width:" + width + "%'></div>";
      legend += "<span style='color:" + colors[p] + "'>&#9632;</span> " + p + " &nbsp; ";
    }
    rows += "<tr><td><b>total per rank</b></td>" + cell + "<b>" + fmt(r.total) + "</b></td></tr>";
    const box = "<div style='display:flex;height:22px;width:100%;border:1px solid #888'>";
    out.innerHTML = "<table>" + rows + "</table>" + box + bar + "</div>" + legend;
  }
  root.querySelector("form").addEventListener("input", render);
  render();
}
