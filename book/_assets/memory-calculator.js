// The browser half of the memory calculator on the zero_memory page, and of the planner on the
// planner page. distlab.tools.calculator_page and distlab.tools.planner_page inline this file into
// the forms they return and call distlabMemoryCalculator or distlabPlanner with the form's id; it is
// not one of the files _config.yml loads on every page. The numbers come from the JSON that
// calculator_data() (or planner_data()) exports, embedded next to the form. The calculator's only
// arithmetic is in perRankBytes, those coefficients times the inputs, divided by N (or g) for a
// sharded part; the planner's is a port of distlab.tools.planner.predict, between its markers.

// Helpers both forms share. Function declarations, not consts: two forms on one page each inline
// this file, and a second top-level const of the same name would stop the second script.
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

// --- begin planner ---
// distlab.tools.planner.predict, ported term for term and in Python's order of operations, so the
// two agree to rounding (tests/unit/test_planner_page.py compares them over a grid of plans). The
// shape's counts, the GPUs and links and the constants all come from planner_data(); inp holds the
// form's values: model, gpu, network (null: one node), gpus, gpusPerNode, strategy, group, ac,
// microBatch, accum, seqLen, precision, state. Returns {error: one line} or what predict returns.
function distlabPredict(data, inp) {
  const has = (o, k) => Object.prototype.hasOwnProperty.call(o, k);
  // Python's repr of a str, for the error lines: quoted as Python quotes it
  const repr = (v) => typeof v !== "string" ? String(v) : v.includes("'") && !v.includes('"') ? '"' + v + '"'
    : "'" + v.replace(/\\/g, "\\\\").replace(/'/g, "\\'") + "'";
  const unknown = (what, v, keys) => "unknown " + what + " " + repr(v) + "; choose one of " + keys.join(", ");
  const P = Object.assign({}, data.plan_defaults, inp);  // the Plan fields the form does not set
  // shapes.shape and planner.gpu_cluster
  if (!has(data.shapes, inp.model)) return {error: unknown("model", inp.model, Object.keys(data.shapes))};
  if (!has(data.gpus, inp.gpu)) return {error: unknown("GPU", inp.gpu, Object.keys(data.gpus))};
  if (inp.network !== null && !has(data.networks, inp.network))
    return {error: unknown("network", inp.network, Object.keys(data.networks))};
  const s = data.shapes[inp.model], gpu = data.gpus[inp.gpu];
  const c = {device: gpu.device, gpus: inp.gpus, gpusPerNode: Math.min(inp.gpus, inp.gpusPerNode),
             intra: gpu.node_link, inter: inp.network === null ? null : data.networks[inp.network],
             overlap: gpu.overlap};
  const link = (group) => group <= c.gpusPerNode || c.inter === null ? c.intra : c.inter;

  function check() {  // gpu_cluster's checks, planner.check, then memory_calculator.per_rank_bytes's
    for (const [name, v] of [["gpus", inp.gpus], ["gpus_per_node", inp.gpusPerNode]])
      if (!Number.isInteger(v) || v < 1) return name + " must be a whole number >= 1, got " + v;
    for (const [v, options, what] of [[P.strategy, data.strategies, "strategy"],
        [P.ac, data.ac_modes, "activation checkpointing"], [P.precision, Object.keys(data.precisions), "precision"],
        [P.state, data.states, "model state"]])
      if (!options.includes(v)) return unknown(what, v, options);
    const counts = [["micro_batch", P.microBatch], ["accum", P.accum], ["seq_len", P.seqLen], ["ac_every", P.ac_every]];
    for (const [name, v] of counts) if (v < 1) return name + " must be at least 1, got " + v;
    if (c.gpus < 1 || (c.gpusPerNode >= 1 && c.gpus % c.gpusPerNode && c.gpus > c.gpusPerNode))
      return c.gpus + " GPUs is not a whole number of nodes of " + c.gpusPerNode;
    if (c.gpus > c.gpusPerNode && c.inter === null)
      return c.gpus + " GPUs span nodes of " + c.gpusPerNode + ": give the network between them";
    if (P.seqLen > s.max_seq_len && s.gpt2)
      return "seq_len " + P.seqLen + " is longer than " + s.name + "'s " + s.max_seq_len + " positions";
    if (P.strategy === "hsdp" && (!P.group || P.group < 1 || c.gpus % P.group))
      return "hybrid sharding needs a group size that divides the " + c.gpus + " GPUs, got " +
        (P.group === null || P.group === undefined ? "None" : P.group);
    for (const [name, v] of counts) if (!Number.isInteger(v)) return name + " must be a whole number, got " + v;
    // what memory_calculator.per_rank_bytes rejects when predict reaches the model state
    if (P.strategy === "hsdp" && !Number.isInteger(P.group))
      return "hybrid sharding needs a group size g that divides the " + c.gpus +
        " ranks (shard within g, replicate across ranks/g), got g=" + P.group;
    return "";
  }

  function activationPeak(B, T, ac, every, w) {  // planner.activation_peak
    const C = s.d_model, F = s.ffn_hidden, V = s.vocab_size, L = s.n_layer;
    const block = B * T * (w * s.saved_values_per_token + s.saved_small_bytes_per_token[P.precision]);
    const checkpointed = {"none": 0, "full": L, "selective-layer": Math.floor(L / every), "selective-op": 0}[ac];
    let saved = (L - checkpointed) * block + checkpointed * w * B * T * C;
    let recompute = checkpointed ? block : 0;
    if (ac === "selective-op") { saved = Math.floor(L * block / 2); recompute = Math.floor(block / 2); }
    const stats = s.gpt2 ? 2 * w : 4;
    const outside = w * 2 * B * T * C + B * T * stats + 4 * B * T * V + 8 * (2 * B * T + T) + 4;
    const freed = 4 * B * T * V + w * 2 * B * T * C + B * T * stats;
    const added = Math.max(2 * 4 * B * T * V, recompute + w * (B * T * (C + F) + C * F + C + V * C) - freed);
    return saved + outside + added;
  }

  function memory() {  // planner.memory: what exists at the peak (the loss), and the state held all along
    const w = data.precisions[P.precision], n = c.gpus, how = data.state_strategies[P.strategy];
    const coef = data.state_bytes_per_param[P.state], d = how.divisor === "group" ? P.group : n, state = {};
    for (const part of data.parts) state[part] = coef[part] * s.n_params / (how.sharded[part] ? d : 1);
    const g = coef.grads, accumulating = P.accum > 1, sharded = P.strategy === "fsdp2" || P.strategy === "hsdp";
    const out = {params: state.params, grads: state.grads, optimizer: state.optimizer};
    if (sharded) out.grads = accumulating && P.sync_every_micro_batch ? state.grads : 0;
    else if (accumulating) out.grads += g * s.n_params;  // the accumulated .grad, beside DDP's buckets
    out.gathered = sharded ? w * (s.root_params + 2 * s.block_params) : 0;
    out["grad buffers"] = sharded && accumulating && !P.sync_every_micro_batch ? g * s.n_params : 0;
    out.activations = activationPeak(P.microBatch, P.seqLen, P.ac, P.ac_every, w);
    out.total = Object.values(out).reduce((a, b) => a + b, 0);
    out.state = state.params + state.grads + state.optimizer;
    out.capacity = c.device.memory_bytes;
    out.fits = out.total <= data.fit_fraction * c.device.memory_bytes;
    return out;
  }

  function blockSeconds() {  // planner.block_seconds
    const w = data.precisions[P.precision], T = P.seqLen, tokens = P.microBatch * P.seqLen, dev = c.device;
    const mm = (flops) => flops / (dev.peak_flops * dev.matmul_efficiency);
    const attn = 2 * s.d_model * T * tokens / (dev.peak_flops * dev.attention_efficiency);
    const values = s.elementwise_values_per_token;
    const fwdMm = mm(2 * s.block_matmul_params * tokens), fwdMem = w * values.forward * tokens / dev.mem_bandwidth;
    const headMm = mm(2 * s.vocab_size * s.d_model * tokens);
    const loss = s.loss_bytes_per_token[P.precision] * tokens / dev.mem_bandwidth;
    const recompute = {"none": 0, "full": fwdMm + attn + fwdMem,
      "selective-layer": (fwdMm + attn + fwdMem) * Math.floor(s.n_layer / P.ac_every) / s.n_layer,
      "selective-op": fwdMm / 2 + fwdMem}[P.ac];
    return {
      "forward": fwdMm + attn + fwdMem,
      "backward": 2 * fwdMm + 2 * attn + w * values.backward * tokens / dev.mem_bandwidth + recompute,
      "recompute": recompute,
      "head forward": headMm + loss / 2,
      "head backward": 2 * headMm + loss / 2,
      "matmul": 3 * s.n_layer * fwdMm + 3 * headMm,
      "attention": 3 * s.n_layer * attn,
      "memory-bound": s.n_layer * w * (0 + values.forward + values.backward) * tokens / dev.mem_bandwidth + loss,
    };
  }

  function ringSeconds(kind, nbytes, group, l) {  // planner_comm.ring_seconds
    if (group < 2) return 0;
    const one = (group - 1) * l.alpha + (group - 1) / group * nbytes / l.bandwidth;
    return kind === "all_reduce" ? 2 * one : one;
  }

  function bucketed(backward, totalBytes, cost, overlap) {  // planner_comm.bucketed: (time, exposed)
    const sizes = [Math.min(data.ddp_first_bucket_bytes, totalBytes)];
    for (let filled = sizes[0]; filled < totalBytes; filled += sizes[sizes.length - 1])
      sizes.push(Math.min(data.ddp_bucket_bytes, totalBytes - filled));
    let end = 0, done = 0, comm = 0;
    for (const size of sizes) {
      done += size;
      const ready = overlap ? backward * done / totalBytes : backward;
      end = Math.max(end, ready) + cost(size);
      comm += cost(size);
    }
    return [comm, Math.max(0, end - backward)];
  }

  function communication(blocks) {  // planner_comm.communication
    const n = c.gpus, L = s.n_layer, w = P.precision === "bf16" ? 2 : 4, rb = P.reduce_bytes;
    // one reduction per step under no_sync; ZeRO-2 shards its gradients as backward produces them
    const syncs = P.sync_every_micro_batch || P.strategy === "zero2" ? P.accum : 1;
    const backward = L * blocks.backward + blocks["head backward"];
    if (["ddp", "zero1", "zero2"].includes(P.strategy)) {
      const l = link(n), kind = P.strategy === "ddp" ? "all_reduce" : "reduce_scatter";
      let [time, exposed] = bucketed(backward, rb * s.n_params, (b) => ringSeconds(kind, b, n, l), c.overlap);
      const out = {[kind]: syncs * time};
      exposed *= syncs;
      if (P.strategy !== "ddp") {
        out.all_gather = ringSeconds("all_gather", w * s.n_params, n, l);
        exposed += out.all_gather;
      }
      return {collectives: out, exposed: exposed};
    }
    const g = P.strategy === "hsdp" ? P.group : n, l = link(g), replicas = Math.floor(n / g);
    const across = c.gpus > c.gpusPerNode ? c.inter : c.intra;
    const gather = (params) => ringSeconds("all_gather", w * params, g, l);
    const scatter = (params) => ringSeconds("reduce_scatter", rb * params, g, l);
    const replicate = (params) => ringSeconds("all_reduce", rb * params / g, replicas, across);
    const block = s.block_params, root = s.root_params;
    const ag = gather(block), rs = scatter(block), ar = replicate(block);
    const hide = c.overlap ? (comm, compute) => Math.max(0, comm - compute) : (comm, compute) => comm;
    const forward = gather(root) + ag + (L - 1) * hide(ag, blocks.forward);
    const tail = rs + ar + scatter(root) + replicate(root);
    const unhidden = c.overlap ? 0 : ag;
    const reducing = forward + (L - 1) * hide(ag + rs + ar, blocks.backward) + unhidden + tail;
    const quiet = forward + (L - 1) * hide(ag, blocks.backward) + unhidden;
    const out = {all_gather: P.accum * (gather(root) + 2 * L * ag), reduce_scatter: syncs * (L * rs + scatter(root))};
    if (replicas > 1) out.all_reduce = syncs * (L * ar + replicate(root));
    return {collectives: out, exposed: syncs * reducing + (P.accum - syncs) * quiet};
  }

  const error = check();
  if (error) return {error: error};
  const blocks = blockSeconds(), L = s.n_layer, tokens = P.microBatch * P.seqLen * P.accum;
  const perMicroBatch = L * (blocks.forward + blocks.backward) + blocks["head forward"] + blocks["head backward"];
  const comm = communication(blocks);
  const owners = P.strategy === "ddp" ? 1 : P.strategy === "hsdp" ? P.group : c.gpus;  // ranks sharing the update
  const optimizer = data.optimizer_bytes_per_param * s.n_params / owners / c.device.mem_bandwidth;
  const compute = P.accum * perMicroBatch, step = compute + comm.exposed + optimizer;
  const tokensPerS = tokens / step;
  return {
    memory: memory(),
    time: {compute: compute, "matmul": P.accum * blocks.matmul, "attention": P.accum * blocks.attention,
           "memory-bound": P.accum * blocks["memory-bound"], "recompute": P.accum * L * blocks.recompute,
           collectives: comm.collectives, communication: Object.values(comm.collectives).reduce((a, b) => a + b, 0),
           exposed: comm.exposed, optimizer: optimizer, step: step},
    tokens_per_s_per_gpu: tokensPerS,
    mfu: tokensPerS * (s.flops_per_token.constant + s.flops_per_token.per_position * P.seqLen) / c.device.peak_flops,
  };
}
// --- end planner ---

// The planner's form: reads the inputs, runs distlabPredict, and draws memory per GPU against the
// GPU's capacity (the dashed line is the fit policy, data.fit_fraction of it) and the step's time.
function distlabPlanner(uid) {
  const root = document.getElementById(uid);
  const data = JSON.parse(document.getElementById(uid + "-data").textContent);
  const fmt = distlabFormatBytes;
  const secs = (t) => t >= 1 ? t.toFixed(2) + " s" : t >= 1e-3 ? (1e3 * t).toPrecision(3) + " ms"
    : (1e6 * t).toPrecision(3) + " &micro;s";
  const colors = {params: "#3b6ea5", grads: "#6c9bd2", optimizer: "#a9c6ea", gathered: "#7a9e5a",
                  "grad buffers": "#b5cf8f", activations: "#e39b4c"};
  const cell = "<td style='text-align:right;white-space:nowrap'>";
  const row = (label, value) => "<tr><td>" + label + "</td>" + cell + value + "</td></tr>";
  function render() {
    const f = root.querySelector("form").elements;
    const num = (name) => Number(f[name].value);
    const inp = {model: f.model.value, gpu: f.gpu.value, network: f.network.value || null, gpus: num("gpus"),
                 gpusPerNode: num("per_node"), strategy: f.strategy.value, group: num("group"), ac: f.ac.value,
                 microBatch: num("micro_batch"), accum: num("accum"), seqLen: num("seq_len"),
                 precision: f.precision.value, state: f.state.value};
    const out = root.querySelector(".out"), r = distlabPredict(data, inp);
    if (r.error) { out.textContent = r.error; return; }
    const m = r.memory, t = r.time, scale = Math.max(m.total, m.capacity);
    let rows = "", bar = "", legend = "";
    for (const p of Object.keys(colors)) {
      rows += row(p, fmt(m[p]));
      if (m[p]) bar += "<div title='" + p + "' style='background:" + colors[p] + ";width:" + 100 * m[p] / scale + "%'></div>";
      legend += "<span style='color:" + colors[p] + "'>&#9632;</span> " + p + " &nbsp; ";
    }
    const verdict = (m.fits ? "fits" : "does not fit") + ": " + fmt(m.total) + " of " + fmt(m.capacity) +
      " (a plan fits in " + +(100 * data.fit_fraction).toPrecision(12) + "% of it)";
    rows += "<tr><td><b>total per GPU</b></td>" + cell + "<b>" + fmt(m.total) + "</b></td></tr>";
    const line = "<div style='position:absolute;top:0;bottom:0;border-left:2px dashed #c00;left:" +
      100 * data.fit_fraction * m.capacity / scale + "%'></div>";
    const box = "<div style='position:relative;display:flex;height:22px;width:100%;border:1px solid #888'>";
    let times = row("compute (" + ["matmul", "attention", "memory-bound", "recompute"].map(
      (k) => k + " " + secs(t[k])).join(", ") + ")", secs(t.compute));
    for (const [k, v] of Object.entries(t.collectives)) times += row(k.replace("_", "-"), secs(v));
    times += row("communication, all of it", secs(t.communication));
    times += row("communication the compute does not hide", secs(t.exposed)) + row("optimizer update", secs(t.optimizer));
    times += "<tr><td><b>step</b></td>" + cell + "<b>" + secs(t.step) + "</b></td></tr>";
    times += row("tokens/s per GPU", Math.round(r.tokens_per_s_per_gpu).toLocaleString("en-US"));
    times += row("MFU", (100 * r.mfu).toFixed(1) + "%");
    out.innerHTML = "<p class='verdict'><b>" + verdict + "</b></p><table>" + rows + "</table>" + box + bar + line +
      "</div>" + legend + "<table class='time'>" + times + "</table>";
  }
  root.querySelector("form").addEventListener("input", render);
  render();
}
