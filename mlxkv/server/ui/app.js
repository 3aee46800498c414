// mlxkv's built-in page: a chat playground over /v1/chat/completions and a live view of the KV cache
// (/v1/cache/stats, /v1/cache/blocks, /metrics), polled once a second. Everything goes through the public API with
// the key the user types (kept in this tab's sessionStorage only).
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const HISTORY_S = 300;
const state = {
  key: sessionStorage.getItem("mlxkv-key") || "",
  model: null,
  several: false,      // the server serves several models: every cache and metrics read names state.model
  chat: [],            // [{role, content}] of this conversation
  abort: null,         // AbortController of the request streaming now
  history: [],         // [{t, stats, ttft}] samples, oldest first
  lastTtft: null,      // [sum, count] of the TTFT histogram at the previous sample
  blocks: null,        // the last /v1/cache/blocks answer
  blockAt: null,       // (x, y) on the pool map -> block index
};

// ---- HTTP ----------------------------------------------------------------------------------------------------
function headers(extra = {}) {
  const h = { ...extra };
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (response.status === 401) {
    needKey();
    throw new Error((await errorText(response)) || "this server needs an API key");
  }
  if (!response.ok) throw new Error(await errorText(response));
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error && body.error.message ? body.error.message : `HTTP ${response.status}`;
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

function needKey() {
  $("key-form").hidden = false;
  setStatus(state.key ? "invalid API key" : "this server needs an API key", true);
}

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem("mlxkv-key", state.key);
  $("key-form").hidden = true;
  loadModel();
});

async function loadModel() {
  try {
    const models = (await (await api("/v1/models")).json()).data;
    state.several = models.length > 1;
    if (!state.model || !models.some((m) => m.id === state.model)) state.model = models[0].id;
    $("model").textContent = state.model;
    $("model").hidden = state.several;
    const pick = $("model-pick");
    pick.hidden = !state.several;
    if (state.several) {
      // each model with its state (one not loaded loads at its first chat request); options updated in place, so
      // a list the user has open stays open
      const label = (m) => (m.state === "loaded" ? m.id : `${m.id} (${m.state})`);
      if (pick.options.length !== models.length) {
        pick.replaceChildren(...models.map((m) => new Option(label(m), m.id, false, m.id === state.model)));
      } else {
        models.forEach((m, i) => { pick.options[i].text = label(m); });
      }
    }
    setStatus("connected");
  } catch (e) {
    if ($("key-form").hidden) setStatus(e.message, true);
  }
}

$("model-pick").addEventListener("change", () => {
  state.model = $("model-pick").value;
  state.history = [];  // the plots follow one model's engine
  state.lastTtft = null;
});

// `path` with the model picked when the server serves several (its cache and metrics routes name one)
function forModel(path, params = {}) {
  const query = new URLSearchParams(params);
  if (state.several && state.model) query.set("model", state.model);
  const text = query.toString();
  return text ? `${path}?${text}` : path;
}

// ---- chat ----------------------------------------------------------------------------------------------------
function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.chat);
  const body = { model: state.model || "default", messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  if (isFinite(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (isFinite(maxTokens)) body.max_tokens = maxTokens;
  const salt = $("cache-salt").value;
  if (salt) body.cache_salt = salt;
  if ($("use-schema").checked) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parsed("schema", "JSON schema") } };
  }
  if ($("use-tools").checked) {
    body.tools = parsed("tools", "tools");
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

// The JSON in the text box `id` (an Error naming `what` when it does not parse).
function parsed(id, what) {
  try {
    return JSON.parse($(id).value);
  } catch (e) {
    throw new Error(`${what}: ${e.message}`);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  div.appendChild(content);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function send(text) {
  state.chat.push({ role: "user", content: text });
  addMessage("user", text);
  let body;
  try {
    body = requestBody();
  } catch (e) {
    state.chat.pop();
    addMessage("error", e.message);
    return;
  }
  const answer = addMessage("assistant", "");
  const content = answer.querySelector(".content");
  const meta = document.createElement("div");
  meta.className = "meta";
  answer.appendChild(meta);
  state.abort = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const start = performance.now();
  let first = null, usage = null, text_ = "";
  const calls = [];  // streamed tool calls: {id, name, arguments} by index
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: state.abort.signal,
      headers: { "Content-Type": "application/json" },
    });
    for await (const event of sseEvents(response)) {
      if (event.error) throw new Error(event.error.message || "error");
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const piece = choice.delta && choice.delta.content;
        for (const call of (choice.delta && choice.delta.tool_calls) || []) {
          if (first === null) first = performance.now();
          const c = calls[call.index] || (calls[call.index] = { id: call.id, name: "", arguments: "" });
          c.name += (call.function && call.function.name) || "";
          c.arguments += (call.function && call.function.arguments) || "";
        }
        if (piece) {
          if (first === null) first = performance.now();
          text_ += piece;
        }
        if (piece || calls.length) {
          content.textContent = text_ + calls.map((c) => `${text_ ? "\n" : ""}→ ${c.name}(${c.arguments})`).join("\n");
          $("messages").scrollTop = $("messages").scrollHeight;
        }
      }
    }
    const message = { role: "assistant", content: text_ };
    if (calls.length) {
      message.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
    }
    state.chat.push(message);
    answer.dataset.done = "true";
  } catch (e) {
    if (e.name === "AbortError") {
      state.chat.push({ role: "assistant", content: text_ });
      answer.dataset.done = "stopped";
    } else {
      answer.classList.add("error");
      content.textContent = `${text_}${text_ ? "\n" : ""}error: ${e.message}`;
      state.chat.pop();
      answer.dataset.done = "error";
    }
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
    state.abort = null;
  }
  meta.textContent = answerFigures(start, first, performance.now(), usage);
}

function answerFigures(start, first, end, usage) {
  const parts = [];
  if (usage) {
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    parts.push(`prompt ${usage.prompt_tokens} tokens: ${cached} cached, ${usage.prompt_tokens - cached} prefilled`);
    parts.push(`${usage.completion_tokens} generated`);
  }
  if (first !== null) {
    parts.push(`TTFT ${Math.round(first - start)} ms`);
    if (usage && usage.completion_tokens > 1 && end > first) {
      parts.push(`${((usage.completion_tokens - 1) / ((end - first) / 1000)).toFixed(1)} tok/s`);
    }
  }
  return parts.join(" · ");
}

// The server-sent events of a streaming response, parsed as JSON ("[DONE]" ends them).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;  // a keep-alive comment
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function curlCommand() {
  const body = requestBody();
  const pending = $("chat-input").value.trim();
  if (pending) body.messages.push({ role: "user", content: pending });
  const auth = state.key ? ` \\\n  -H "Authorization: Bearer $MLXKV_API_KEY"` : "";
  const json = JSON.stringify(body).replace(/'/g, "'\\''");
  return `curl -N ${location.origin}/v1/chat/completions \\\n  -H "Content-Type: application/json"${auth} \\\n  -d '${json}'`;
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || state.abort) return;
  $("chat-input").value = "";
  send(text);
});
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("clear").addEventListener("click", () => { state.chat = []; $("messages").textContent = ""; });
$("use-schema").addEventListener("change", () => { $("schema").hidden = !$("use-schema").checked; });
$("use-tools").addEventListener("change", () => {
  $("tools").hidden = $("tool-choice").hidden = !$("use-tools").checked;
});
$("copy-curl").addEventListener("click", async () => {
  let command;
  try { command = curlCommand(); } catch (e) { command = e.message; }
  $("curl").textContent = command;
  $("curl").hidden = false;
  try { await navigator.clipboard.writeText(command); } catch (e) { /* shown below the form either way */ }
});

// ---- live KV view --------------------------------------------------------------------------------------------
const COLOURS = { f: "#e8e8ed", u: "#e0a040" };
const TENANT_HUES = [140, 210, 280, 20, 330, 60, 180, 250];

function tenantColour(tenant, index, priority, held) {
  if (!tenant || tenant.label === "others") return held ? "rgb(120,120,130)" : "rgba(120,120,130,0.45)";
  const hue = TENANT_HUES[index % TENANT_HUES.length];
  // stronger for blocks a sequence holds; among idle cached blocks, paler for lower retention priority
  const alpha = held ? 1 : 0.3 + 0.5 * ((priority === null ? 35 : priority) / 100);
  return `hsla(${hue}, 50%, 45%, ${alpha.toFixed(2)})`;
}

function drawPool(blocks) {
  const canvas = $("pool-map");
  if (!blocks.paged) {
    $("pool-summary").textContent = "dense KV backend: no block pool (serve with --kv-backend paged)";
    return;
  }
  const s = blocks.states;
  canvas.dataset.states = s;
  state.blockAt = Plots.blocks(canvas, s.length, (i) => {
    const c = s[i];
    if (c === "f" || c === "u") return COLOURS[c];
    const owner = blocks.owners[i];
    return tenantColour(blocks.tenants[owner], owner, blocks.priorities[i], c === "s");
  });
  const count = (c) => s.split(c).length - 1;
  $("pool-summary").textContent = `${s.length} blocks of ${blocks.block_size} tokens: ${count("f")} free, ` +
    `${count("c")} cached, ${count("u")} in use, ${count("s")} in use and shared` +
    (blocks.view === "tenant" ? " (your blocks in colour)" : "");
  const legend = $("legend");
  legend.textContent = "";
  const item = (colour, text) => {
    const span = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = colour;
    span.append(swatch, text);
    legend.appendChild(span);
  };
  item(COLOURS.f, "free");
  item(COLOURS.u, "in use");
  blocks.tenants.forEach((t, i) => item(tenantColour(t, i, 100, true), `${t.label}${t.own ? " (you)" : ""}`));
}

const STATE_NAMES = { f: "free", c: "cached", u: "in use", s: "in use, cached" };

$("pool-map").addEventListener("mousemove", (e) => {
  const b = state.blocks;
  const i = b && b.paged && state.blockAt ? state.blockAt(e.offsetX, e.offsetY) : -1;
  if (i < 0) { e.target.title = ""; return; }
  const owner = b.tenants[b.owners[i]];
  const node = b.tree.nodes.find((n) => n.block === i + 1);
  e.target.title = `block ${i + 1}: ${STATE_NAMES[b.states[i]]}` + (owner ? `, ${owner.label}` : "") +
    (b.priorities[i] !== null ? `, priority ${b.priorities[i]}` : "") +
    (node ? `, ${node.hits} hits\n${node.text}` : "");
});

function drawTree(blocks) {
  const list = $("tree");
  list.textContent = "";
  if (!blocks.paged) return;
  const nodes = blocks.tree.nodes;
  const hits = nodes.reduce((a, n) => a + n.hits, 0);
  $("tree-summary").textContent = `${nodes.length} cached blocks shown, ${hits} hits` +
    (blocks.tree.truncated ? `, ${blocks.tree.truncated} more not shown` : "");
  // a chain without branches stays at one indent: a level is added where a block has several children
  const children = {}, indent = {};
  for (const n of nodes) if (n.parent !== null) children[n.parent] = (children[n.parent] || 0) + 1;
  for (const n of nodes) {
    indent[n.block] = n.parent === null ? 0 : indent[n.parent] + (children[n.parent] > 1 ? 1 : 0);
    const li = document.createElement("li");
    li.dataset.block = n.block;
    li.dataset.hits = n.hits;
    li.title = n.text;
    const label = blocks.tenants[n.owner] ? blocks.tenants[n.owner].label : "";
    const hitSpan = document.createElement("span");
    hitSpan.className = "hits";
    hitSpan.textContent = `${n.hits} hits`;
    li.append(`${"  ".repeat(indent[n.block])}${n.parent !== null ? "└ " : ""}#${n.block} ${n.tokens} tok ${n.held ? "held " : ""}`,
      hitSpan, ` ${label} ${JSON.stringify(n.text.slice(0, 60))}`);
    list.appendChild(li);
  }
}

function tiles(stats, rates) {
  $("t-running").textContent = `${stats.running} (+${stats.prefilling} prefilling)`;
  $("t-waiting").textContent = `${stats.waiting}${stats.preempted ? ` (${stats.preempted} preempted)` : ""}`;
  const p = stats.prefix_cache || {};
  $("t-hit").textContent = p.enabled === false ? "off" : `${(100 * (p.hit_rate || 0)).toFixed(1)}%`;
  const b = stats.kv_blocks || {};
  $("t-pool").textContent = b.paged ? `${b.used}/${b.total} (${b.cached} cached)` : "dense";
  $("t-tps").textContent = rates.tps === null ? "–" : rates.tps.toFixed(1);
  const tier = stats.tier || {};
  const sec = tier.secondary;
  $("t-tier").textContent = tier.enabled && sec ? `${sec.blocks ?? 0} blocks, ${sec.hits} hits` : "none";
  const parts = [`evictions ${stats.evictions}`, `preemptions ${stats.preemptions}`,
    `requests ${stats.requests_total ?? 0}`, `generated ${stats.generation_tokens_total ?? 0} tokens`];
  if (b.overflow_dropped || b.overflow_restored) {
    parts.push(`overflow: ${b.overflow_dropped} blocks dropped, ${b.overflow_restored} restored`);
  }
  const snaps = stats.state_snapshots;
  if (snaps && snaps.enabled) parts.push(`state snapshots ${snaps.count} (${snaps.hits} hits)`);
  $("extra").textContent = parts.join(" · ");
}

// The TTFT histogram's [sum, count] from the Prometheus text (null when /metrics is not readable).
function ttftTotals(text) {
  const get = (name) => {
    const m = text.match(new RegExp(`^${name} ([0-9.e+-]+)$`, "m"));
    return m ? parseFloat(m[1]) : null;
  };
  const sum = get("mlxkv_time_to_first_token_seconds_sum"), count = get("mlxkv_time_to_first_token_seconds_count");
  return sum === null || count === null ? null : [sum, count];
}

const PLOTS = [
  ["ttft", "TTFT (ms, mean per interval)", "ms", 0],
  ["tps", "tok/s", "", 1],
  ["hit", "prefix hit rate (interval, %)", "%", 0],
  ["pool", "pool use (%)", "%", 0],
  ["evictions", "evictions / s", "", 1],
  ["preemptions", "preemptions / s", "", 1],
];

function setupPlots() {
  for (const [key, caption] of PLOTS) {
    const figure = document.createElement("figure");
    const canvas = document.createElement("canvas");
    canvas.id = `plot-${key}`;
    canvas.height = 60;
    const cap = document.createElement("figcaption");
    cap.textContent = caption;
    figure.append(canvas, cap);
    $("plots").appendChild(figure);
  }
}

function rate(prev, cur, key, dt) {
  return prev && cur[key] !== undefined ? Math.max(0, (cur[key] - prev[key]) / dt) : null;
}

function sample(stats, ttft) {
  const t = Date.now() / 1000;
  const prev = state.history.length ? state.history[state.history.length - 1] : null;
  const dt = prev ? Math.max(1e-3, t - prev.t) : 1;
  const rates = { tps: rate(prev && prev.stats, stats, "generation_tokens_total", dt) };
  const point = { t, stats, ttft, values: {} };
  const v = point.values;
  v.tps = rates.tps;
  const p = stats.prefix_cache || {}, pp = prev && prev.stats.prefix_cache;
  v.hit = pp && p.queries > pp.queries ? 100 * (p.hits - pp.hits) / (p.queries - pp.queries) : null;
  const b = stats.kv_blocks || {};
  v.pool = b.total ? 100 * b.used / b.total : null;
  v.evictions = rate(prev && prev.stats, stats, "evictions", dt);
  v.preemptions = rate(prev && prev.stats, stats, "preemptions", dt);
  v.ttft = prev && prev.ttft && ttft && ttft[1] > prev.ttft[1] ? 1000 * (ttft[0] - prev.ttft[0]) / (ttft[1] - prev.ttft[1]) : null;
  state.history.push(point);
  while (state.history.length && state.history[0].t < t - HISTORY_S) state.history.shift();
  return rates;
}

function drawPlots() {
  for (const [key, , unit, digits] of PLOTS) {
    Plots.series($(`plot-${key}`), state.history.map((p) => [p.t, p.values[key]]), { span: HISTORY_S, unit, digits });
  }
}

async function poll() {
  try {
    const salt = $("cache-salt").value;
    if (state.several) await loadModel();  // the models' states change as they load and unload
    const [stats, blocks] = await Promise.all([
      api(forModel("/v1/cache/stats")).then((r) => r.json()),
      api(forModel("/v1/cache/blocks", salt ? { cache_salt: salt } : {})).then((r) => r.json()),
    ]);
    let ttft = null;
    try {
      const r = await fetch(forModel("/metrics"), { headers: headers() });
      if (r.ok) ttft = ttftTotals(await r.text());
    } catch (e) { /* TTFT plot stays empty */ }
    tiles(stats, sample(stats, ttft));
    state.blocks = blocks;
    drawPool(blocks);
    drawTree(blocks);
    drawPlots();
    if (!state.model) await loadModel();
    else setStatus(`connected · ${new Date().toLocaleTimeString()}`);
  } catch (e) {
    if ($("key-form").hidden) setStatus(`no data: ${e.message}`, true);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

setupPlots();
loadModel();
poll();
