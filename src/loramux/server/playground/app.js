// loramux playground: chat with an adapter stack, compare adapter sets side by side (fan-out), see the
// adapters the server holds and its live metrics. Vanilla JavaScript, no build step, nothing fetched from
// elsewhere. Model text is only ever shown through textContent: markup in an answer is text, never run.
// The keys live in this tab's memory (the two inputs): sent as headers, never put in a URL or stored.
"use strict";

const MAX_SETS = 8; // adapter sets in the compare view, besides the base column
const POLL_MS = 3000; // the server view's /metrics interval
const HISTORY = 60; // points kept per chart
const COLORS = ["#1f5fbf", "#c4512b", "#2f8a3b", "#8b3fb0", "#b08a1f", "#1f8f96", "#a3262a", "#555e69"];

const $ = (id) => document.getElementById(id);
const state = { base: null, adapters: [], chatAbort: null, cmpAbort: null, history: [], timer: null,
  prev: null, series: { tps: [], waiting: [], running: [], p50: [], p99: [], adapters: {} } };

function el(tag, props = {}, ...children) {
  // Builds an element; text only ever goes in through textContent (children strings become text nodes).
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "text") e.textContent = v;
    else if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v === true) e.setAttribute(k, "");
    else if (v !== false && v != null) e.setAttribute(k, String(v));
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function status(text, bad = false) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("bad", bad);
}

// ------------------------------------------------------------------------------------------ HTTP
function headers(admin = false) {
  const h = { "Content-Type": "application/json" };
  const key = admin ? $("admin-key").value.trim() : $("api-key").value.trim() || $("admin-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorText(r) {
  try {
    const j = await r.json();
    if (j && j.error) return `${r.status} ${j.error.code || ""}: ${j.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${r.status} ${r.statusText}`;
}

async function api(path, body, { admin = false, signal } = {}) {
  const opts = { method: body === undefined ? "GET" : "POST", headers: headers(admin), signal };
  if (body !== undefined) opts.body = JSON.stringify(body);
  const r = await fetch(path, opts);
  if (!r.ok) throw new Error(await errorText(r));
  return r;
}

async function* sse(r) {
  // The data objects of an SSE response, in order, until [DONE].
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(`${obj.error.code || "error"}: ${obj.error.message}`);
        yield obj;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------ tabs
const TABS = ["chat", "compare", "adapters", "server"];

function showTab(name, focus = false) {
  for (const t of TABS) {
    const on = t === name;
    $("tab-" + t).setAttribute("aria-selected", String(on));
    $("tab-" + t).tabIndex = on ? 0 : -1;
    $("view-" + t).hidden = !on;
  }
  if (focus) $("tab-" + name).focus();
  if (name === "adapters") refreshAdapters();
  if (name === "server") startPolling(); else stopPolling();
}

function setupTabs() {
  for (const t of TABS) {
    const tab = $("tab-" + t);
    tab.addEventListener("click", () => showTab(t));
    tab.addEventListener("keydown", (ev) => {
      const i = TABS.indexOf(t);
      const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: TABS.length - 1 }[ev.key];
      if (next === undefined) return;
      ev.preventDefault();
      showTab(TABS[(next + TABS.length) % TABS.length], true);
    });
  }
}

// ---------------------------------------------------------------------------------------- models
async function connect() {
  try {
    const j = await (await api("/v1/models")).json();
    state.base = j.data.find((m) => m.parent === null).id;
    state.adapters = j.data.filter((m) => m.parent !== null).map((m) => ({ name: m.id, scale: m.scale }));
    $("base-name").textContent = "· " + state.base;
    fillAdapterSelects();
    status(`connected: ${state.base} and ${state.adapters.length} adapter(s)`);
  } catch (e) {
    status(`cannot list the models (${e.message}); enter the API key and press Connect`, true);
  }
}

function adapterOptions(select, keep) {
  const old = keep ? select.value : null;
  select.replaceChildren(...state.adapters.map((a) => el("option", { value: a.name, text: a.name })));
  if (old && state.adapters.some((a) => a.name === old)) select.value = old;
}

function fillAdapterSelects() {
  adapterOptions($("chat-add"), true);
  for (const s of document.querySelectorAll("#cmp-sets select")) adapterOptions(s, true);
}

function defaultScale(name) {
  const a = state.adapters.find((x) => x.name === name);
  return a && a.scale ? a.scale : 1;
}

// a stack member: adapter name, a scale slider with its number, a remove button
function member(name, scale, onRemove, slider = true) {
  const value = el("output", { text: Number(scale).toFixed(2) });
  const input = el("input", { type: slider ? "range" : "number", min: -2, max: 2, step: 0.05, value: scale,
    "aria-label": `scale of ${name}` });
  input.addEventListener("input", () => { value.textContent = Number(input.value).toFixed(2); });
  const row = el("div", { class: "member", "data-name": name }, el("span", { text: name }), input);
  if (slider) row.append(value);
  row.append(el("button", { type: "button", text: "Remove", "aria-label": `remove ${name}`,
    onclick: () => { row.remove(); onRemove(); } }));
  return row;
}

function stackOf(container) {
  return [...container.querySelectorAll(".member")].map((m) => ({
    name: m.dataset.name, scale: Number(m.querySelector("input").value) }));
}

// ------------------------------------------------------------------------------------------- chat
function chatStackChanged() {
  $("chat-stack-empty").hidden = $("chat-stack").querySelector(".member") !== null;
}

function addToChatStack() {
  const name = $("chat-add").value;
  if (!name) return;
  if (stackOf($("chat-stack")).some((m) => m.name === name)) { status(`${name} is in the stack already`); return; }
  $("chat-stack").append(member(name, defaultScale(name), chatStackChanged));
  chatStackChanged();
}

function samplingFields(prefix) {
  const body = { temperature: Number($(prefix + "-temp").value), max_tokens: Number($(prefix + "-max").value) };
  if (prefix !== "chat") return body;
  const stops = $("chat-stop").value.split("\n").filter((s) => s.length);
  if (stops.length) body.stop = stops;
  const kind = $("chat-constraint").value, text = $("chat-grammar").value.trim();
  if (kind === "grammar" && text) body.grammar = text;
  if (kind === "schema" && text) {
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: JSON.parse(text) } };
  }
  return body;
}

function chatMessage(role, text) {
  const content = el("span", { class: "content", text });
  const m = el("div", { class: "msg " + role }, el("span", { class: "role", text: role }), content);
  $("chat-log").append(m);
  return content;
}

function chatBody() {
  const lora = stackOf($("chat-stack"));
  return { model: state.base, messages: state.history.slice(), lora, ...samplingFields("chat") };
}

async function sendChat() {
  const text = $("chat-input").value;
  if (!text.trim() || state.chatAbort) return;
  let body;
  try { state.history.push({ role: "user", content: text }); body = chatBody(); } catch (e) {
    state.history.pop(); status(`the JSON schema does not parse: ${e.message}`, true); return;
  }
  chatMessage("user", text);
  $("chat-input").value = "";
  const out = chatMessage("assistant", "");
  const ctl = new AbortController();
  state.chatAbort = ctl;
  $("chat-abort").disabled = false;
  $("chat-send").disabled = true;
  try {
    const r = await api("/v1/chat/completions", { ...body, stream: true }, { signal: ctl.signal });
    for await (const chunk of sse(r)) {
      const c = chunk.choices[0];
      if (c && c.delta && c.delta.content) { out.textContent += c.delta.content; $("chat-log").scrollTop = 1e9; }
    }
    state.history.push({ role: "assistant", content: out.textContent });
    status("done");
  } catch (e) {
    if (e.name !== "AbortError") { out.parentNode.classList.add("error"); out.textContent += ` [${e.message}]`; }
    state.history.pop();
  } finally {
    state.chatAbort = null;
    $("chat-abort").disabled = true;
    $("chat-send").disabled = false;
  }
}

async function renderedPrompt() {
  // What the chat template makes of the conversation so far (and the message being typed): /tokenize the
  // messages with the generation prompt and decode the tokens' bytes (special tokens included).
  const messages = state.history.slice();
  if ($("chat-input").value.trim()) messages.push({ role: "user", content: $("chat-input").value });
  if (!messages.length) { status("type a message first"); return; }
  try {
    const t = await (await api("/tokenize", { model: state.base, messages, add_generation_prompt: true,
      with_pieces: true })).json();
    const enc = new TextEncoder(), bytes = [];
    for (const { piece } of t.tokens) bytes.push(...(typeof piece === "string" ? enc.encode(piece) : piece));
    const pre = $("chat-prompt");
    pre.textContent = `${t.count} tokens:\n${new TextDecoder().decode(new Uint8Array(bytes))}`;
    pre.hidden = false;
  } catch (e) { status(`cannot render the prompt: ${e.message}`, true); }
}

function setupChat() {
  $("chat-add-btn").addEventListener("click", addToChatStack);
  $("chat-send").addEventListener("click", sendChat);
  $("chat-abort").addEventListener("click", () => state.chatAbort && state.chatAbort.abort());
  $("chat-clear").addEventListener("click", () => {
    state.history = []; $("chat-log").replaceChildren(); $("chat-prompt").hidden = true;
  });
  $("chat-prompt-btn").addEventListener("click", renderedPrompt);
  $("chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); sendChat(); }
  });
}

// ---------------------------------------------------------------------------------------- compare
function addSet(names) {
  const box = $("cmp-sets");
  if (box.children.length >= MAX_SETS) { status(`at most ${MAX_SETS} sets (and the base)`); return; }
  const members = el("span", { class: "members" });
  const pick = el("select", { "aria-label": "adapter to add to this set" });
  adapterOptions(pick, false);
  const set = el("div", { class: "set" }, el("strong", { text: `set ${box.children.length + 1}` }), members, pick,
    el("button", { type: "button", text: "Add adapter", onclick: () => {
      if (pick.value && !stackOf(members).some((m) => m.name === pick.value)) {
        members.append(member(pick.value, defaultScale(pick.value), () => {}, false));
      }
    } }),
    el("button", { type: "button", text: "Remove set", onclick: () => { set.remove(); renumberSets(); } }));
  for (const n of names || []) members.append(member(n, defaultScale(n), () => {}, false));
  box.append(set);
}

function renumberSets() {
  [...$("cmp-sets").children].forEach((s, i) => { s.querySelector("strong").textContent = `set ${i + 1}`; });
}

function compareSets() {
  const sets = [];
  if ($("cmp-base").checked) sets.push({ name: state.base + " (base)", lora: [] });
  for (const s of $("cmp-sets").children) {
    const lora = stackOf(s.querySelector(".members"));
    if (!lora.length) continue;
    sets.push({ name: lora.map((m) => `${m.name}:${m.scale}`).join("+"), lora });
  }
  const seen = new Set();
  return sets.filter((s) => (seen.has(s.name) ? false : seen.add(s.name)));
}

function column(set, isBase) {
  const out = el("div", { class: "out", "aria-live": "off" });
  const stats = el("p", { class: "stats", text: "waiting…" });
  const node = el("div", { class: "col", "data-set": set.name }, el("h3", { text: set.name }), stats, out);
  return { set, isBase, node, out, stats, pieces: [], spans: [], tokens: 0, first: null, last: null, done: false,
    departed: null };
}

function shade(span, entries) {
  // Lighter background for less likely tokens: exp(mean logprob) of the chunk's tokens.
  if (!entries || !entries.length) return;
  const p = Math.exp(entries.reduce((s, e) => s + e.logprob, 0) / entries.length);
  span.title = `p = ${p.toFixed(3)}`;
  span.style.backgroundColor = `rgba(31, 95, 191, ${(0.45 * (1 - p)).toFixed(3)})`;
}

function markDeparture(col, base) {
  // The first chunk where this column's tokens depart from the base's (once the base has that many, or ended).
  if (!base || col.isBase || col.departed !== null) return;
  for (let k = 0; k < col.pieces.length; k++) {
    if (k >= base.pieces.length && !base.done) return;
    if (col.pieces[k] !== base.pieces[k]) {
      col.departed = k;
      col.spans[k].classList.add("first-departure");
      for (const s of col.spans.slice(k)) s.classList.add("departed");
      return;
    }
  }
}

function statsLine(col) {
  const ttft = col.first === null ? "–" : `${Math.round(col.first - col.t0)} ms`;
  const dt = col.last !== null && col.first !== null ? (col.last - col.first) / 1000 : 0;
  // tokens that arrive in one read (a fast server, a short answer) have no spread between the first and
  // the last: the rate then counts from the request's start
  const whole = col.last !== null ? (col.last - col.t0) / 1000 : 0;
  const rate = dt > 0 && col.tokens > 1 ? ((col.tokens - 1) / dt).toFixed(1)
    : whole > 0 && col.tokens > 0 ? (col.tokens / whole).toFixed(1) : "–";
  const dep = col.isBase || !$("cmp-diff").checked ? "" :
    col.departed === null ? (col.done ? " · same as base" : "") : ` · departs at token ${col.departed + 1}`;
  col.stats.textContent = `TTFT ${ttft} · ${rate} tok/s · ${col.tokens} tokens${dep}${col.done ? "" : " …"}`;
}

async function runCompare() {
  const prompt = $("cmp-prompt").value;
  const sets = compareSets();
  if (!prompt.trim() || !sets.length || state.cmpAbort) { status("a prompt and at least one set are needed"); return; }
  const shading = $("cmp-shade").checked, diff = $("cmp-diff").checked;
  const cols = sets.map((s, i) => column(s, i === 0 && $("cmp-base").checked));
  const base = diff ? cols.find((c) => c.isBase) : null;
  $("cmp-cols").replaceChildren(...cols.map((c) => c.node));
  const ctl = new AbortController();
  state.cmpAbort = ctl;
  $("cmp-abort").disabled = false;
  $("cmp-run").disabled = true;
  const t0 = performance.now();
  cols.forEach((c) => { c.t0 = t0; });
  const body = { model: state.base, messages: [{ role: "user", content: prompt }], adapter_sets: sets,
    stream: true, ...samplingFields("cmp") };
  if (shading) body.logprobs = true;
  try {
    const r = await api("/v1/chat/completions", body, { signal: ctl.signal });
    for await (const chunk of sse(r)) {
      const c = chunk.choices[0];
      if (!c) continue;
      const col = cols[c.index];
      if (c.finish_reason) { col.done = true; }
      const text = c.delta && c.delta.content;
      if (text) {
        const now = performance.now();
        if (col.first === null) col.first = now;
        col.last = now;
        const entries = c.logprobs && c.logprobs.content;
        col.tokens += entries && entries.length ? entries.length : 1;
        const span = el("span", { text });
        if (shading) shade(span, entries);
        col.out.append(span);
        col.pieces.push(text);
        col.spans.push(span);
      }
      if (base) { markDeparture(col, base); if (col === base) cols.forEach((x) => markDeparture(x, base)); }
      statsLine(col);
    }
    cols.forEach((c) => { c.done = true; if (base) markDeparture(c, base); statsLine(c); });
    status(`compared ${cols.length} sets`);
  } catch (e) {
    if (e.name !== "AbortError") status(`compare failed: ${e.message}`, true);
  } finally {
    state.cmpAbort = null;
    $("cmp-abort").disabled = true;
    $("cmp-run").disabled = false;
  }
}

function setupCompare() {
  $("cmp-add-set").addEventListener("click", () => addSet());
  $("cmp-run").addEventListener("click", runCompare);
  $("cmp-abort").addEventListener("click", () => state.cmpAbort && state.cmpAbort.abort());
}

// --------------------------------------------------------------------------------------- adapters
function size(n) {
  if (n == null) return "–";
  return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${(n / 1024).toFixed(1)} KiB`;
}

function adapterRow(a, all) {
  const scale = el("input", { type: "number", step: 0.05, value: a.global_scale, "aria-label": `global scale of ${a.name}` });
  const targets = a.targets ? el("td", { class: "num", title: a.targets.join("\n"), text: a.targets.length }) :
    el("td", { text: "–" });
  return el("tr", { "data-name": a.name },
    el("td", { text: a.name }), el("td", { text: a.source }), el("td", { class: "num", text: a.rank ?? "–" }), targets,
    el("td", { class: "num", text: size(a.size) }),
    el("td", {}, el("code", { title: a.sha256 || "", text: a.sha256 ? a.sha256.slice(0, 12) : "–" })),
    el("td", { text: a.residency }), el("td", { text: a.pinned ? "yes" : "no" }),
    el("td", { class: "num", text: a.requests }), el("td", { class: "num", text: a.tokens }),
    el("td", {}, scale, el("button", { type: "button", text: "Set", "aria-label": `set the global scale of ${a.name}`,
      onclick: () => rescale(all, a, Number(scale.value)) })),
    el("td", {}, el("button", { type: "button", text: "Unload", "aria-label": `unload ${a.name}`,
      onclick: () => unload(a) })));
}

async function refreshAdapters() {
  try {
    const list = await (await api("/playground/api/adapters")).json();
    $("ad-table").tBodies[0].replaceChildren(...list.map((a) => adapterRow(a, list)));
  } catch (e) { adminMessage(`cannot list the adapters: ${e.message}`, true); }
}

function adminMessage(text, bad = false) {
  $("ad-msg").textContent = text;
  $("ad-msg").classList.toggle("bad", bad);
}

async function adminCall(path, body, done) {
  // The admin plane: refused here without the admin key, and by the server with a wrong one.
  if (!$("admin-key").value.trim()) {
    adminMessage("refused: this needs the admin key (enter it above; it stays in this tab's memory only)", true);
    return;
  }
  try {
    const j = await (await api(path, body, { admin: true })).json();
    adminMessage(done(j));
    await connect();
    await refreshAdapters();
  } catch (e) { adminMessage(`refused by the server: ${e.message}`, true); }
}

function unload(a) {
  adminCall("/v1/unload_lora_adapter", { lora_name: a.name, lora_int_id: a.id }, () => `unloaded ${a.name}`);
}

function rescale(all, a, scale) {
  const pairs = all.map((x) => ({ id: x.id, scale: x.id === a.id ? scale : x.global_scale }));
  adminCall("/lora-adapters", pairs, () => `global scale of ${a.name}: ${scale}`);
}

function setupAdapters() {
  $("ad-refresh").addEventListener("click", refreshAdapters);
  $("ad-load").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const name = $("ad-name").value.trim(), source = $("ad-source").value.trim();
    if (!name || !source) { adminMessage("a name and a source are needed", true); return; }
    adminCall("/v1/load_lora_adapter", { lora_name: name, lora_path: source, scale: Number($("ad-scale").value),
      pinned: $("ad-pinned").checked }, (j) => `loaded ${j.name} (id ${j.id})`);
  });
}

// ----------------------------------------------------------------------------------------- server
function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([A-Za-z_:][\w:]*)(\{.*\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const p of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[p[1]] = p[2];
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return out;
}

function metricSum(samples, name) {
  return samples.filter((s) => s.name === name).reduce((a, s) => a + s.value, 0);
}

function push(arr, v) { arr.push(v); if (arr.length > HISTORY) arr.shift(); }

function chart(canvas, lines) {
  // lines: [{values, color}] drawn on one scale from 0 to the largest value seen.
  const g = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  g.clearRect(0, 0, w, h);
  const max = Math.max(1e-9, ...lines.flatMap((l) => l.values));
  g.strokeStyle = "#d6dadf"; g.beginPath(); g.moveTo(0, h - 1); g.lineTo(w, h - 1); g.stroke();
  g.fillStyle = "#5d6875"; g.font = "11px sans-serif"; g.fillText(max > 1e-6 ? max.toPrecision(3) : "0", 2, 11);
  for (const l of lines) {
    g.strokeStyle = l.color; g.lineWidth = 2; g.beginPath();
    l.values.forEach((v, i) => {
      const x = (i / (HISTORY - 1)) * w, y = h - 2 - (v / max) * (h - 16);
      if (i) g.lineTo(x, y); else g.moveTo(x, y);
    });
    g.stroke();
  }
}

async function poll() {
  let samples;
  try { samples = parseMetrics(await (await api("/metrics")).text()); } catch (e) {
    status(`cannot read /metrics: ${e.message}`, true); return;
  }
  const now = performance.now(), s = state.series;
  const tokens = metricSum(samples, "loramux_generation_tokens_total");
  const perAdapter = {};
  for (const x of samples.filter((x) => x.name === "loramux_adapter_requests_total")) perAdapter[x.labels.adapter] = x.value;
  if (state.prev) {
    const dt = (now - state.prev.t) / 1000;
    push(s.tps, Math.max(0, (tokens - state.prev.tokens) / dt));
    for (const [name, v] of Object.entries(perAdapter)) {
      s.adapters[name] = s.adapters[name] || [];
      push(s.adapters[name], Math.max(0, (v - (state.prev.perAdapter[name] || 0)) / dt));
    }
  }
  state.prev = { t: now, tokens, perAdapter };
  push(s.waiting, metricSum(samples, "loramux_num_requests_waiting"));
  push(s.running, metricSum(samples, "loramux_num_requests_running"));
  push(s.p50, 1000 * metricSum(samples, "loramux_slot_wait_p50_seconds"));
  push(s.p99, 1000 * metricSum(samples, "loramux_slot_wait_p99_seconds"));
  drawServer();
}

function drawServer() {
  const s = state.series, last = (a) => (a.length ? a[a.length - 1] : 0);
  chart($("ch-tps"), [{ values: s.tps, color: COLORS[0] }]);
  $("v-tps").textContent = last(s.tps).toFixed(1);
  chart($("ch-queue"), [{ values: s.waiting, color: COLORS[1] }, { values: s.running, color: COLORS[0] }]);
  $("v-queue").textContent = `${last(s.waiting)} / ${last(s.running)}`;
  chart($("ch-wait"), [{ values: s.p50, color: COLORS[2] }, { values: s.p99, color: COLORS[1] }]);
  $("v-wait").textContent = `${last(s.p50).toFixed(1)} / ${last(s.p99).toFixed(1)}`;
  const names = Object.keys(s.adapters).sort().slice(0, COLORS.length);
  chart($("ch-adapters"), names.map((n, i) => ({ values: s.adapters[n], color: COLORS[i] })));
  $("v-adapters").textContent = names.map((n) => `${n} ${last(s.adapters[n]).toFixed(2)}`).join(", ") || "none yet";
}

function startPolling() {
  if (state.timer) return;
  poll();
  state.timer = setInterval(poll, POLL_MS);
}

function stopPolling() {
  if (state.timer) clearInterval(state.timer);
  state.timer = null;
}

// ------------------------------------------------------------------------------------------ start
document.addEventListener("DOMContentLoaded", () => {
  setupTabs();
  setupChat();
  setupCompare();
  setupAdapters();
  $("connect").addEventListener("click", connect);
  $("api-key").addEventListener("keydown", (ev) => { if (ev.key === "Enter") connect(); });
  connect().then(() => { addSet(state.adapters.slice(0, 1).map((a) => a.name)); });
});
