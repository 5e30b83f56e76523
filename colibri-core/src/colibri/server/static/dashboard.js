// colibri's dashboard: a chat over the server's own streaming API, and what the engine is doing while it answers.
// Everything comes from this server (GET /health, /profile, /experts; POST /v1/chat/completions), with the API key
// the page asks for sent as a bearer token. No framework, no external request (the server's CSP forbids them).
"use strict";

const POLL_MS = 1000;
const KEY_STORE = "colibri-api-key";
const $ = (id) => document.getElementById(id);

const state = {
  messages: [],          // the conversation as the API takes it (answers only; reasoning is not sent back)
  controller: null,      // aborts the reply being streamed
  live: null,            // {started, chunks} while a reply streams
  lastSeq: 0,
  needKey: false,
};

// ---- formatting ----------------------------------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(v)) + " " + units[i];
}
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
const rate = (x) => (x ? Number(x).toFixed(1) : "–");

// ---- the API -------------------------------------------------------------------------------------------------

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = $("key").value.trim();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

async function getJSON(path) {
  const response = await fetch(path, {headers: authHeaders(), cache: "no-store"});
  if (response.status === 401) {
    state.needKey = true;
    throw new Error("this server needs its API key: enter it above");
  }
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

function notice(text) { $("notice").textContent = text || ""; }

// ---- chat ----------------------------------------------------------------------------------------------------

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "you" : role === "assistant" ? "model" : role;
  box.appendChild(who);
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.open = true;
  reasoning.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "reasoning";
  const thought = document.createElement("div");
  thought.className = "thought";
  reasoning.append(summary, thought);
  const answer = document.createElement("div");
  answer.className = "answer";
  answer.textContent = text || "";
  box.append(reasoning, answer);
  $("transcript").appendChild(box);
  box.scrollIntoView({block: "end"});
  return {box, thought, reasoning, answer};
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("reset").disabled = busy;
}

// Server-sent events from a fetch body: yields each "data:" payload (comments such as keep-alives are skipped).
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

async function send(text) {
  state.messages.push({role: "user", content: text});
  addMessage("user", text);
  const view = addMessage("assistant", "");
  const request = {model: "colibri", messages: state.messages, stream: true, stream_options: {include_usage: true}};
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) request.max_tokens = maxTokens;
  const temperature = $("temperature").value.trim();
  if (temperature !== "") request.temperature = parseFloat(temperature);
  state.controller = new AbortController();
  state.live = {started: 0, chunks: 0};
  setBusy(true);
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(request), signal: state.controller.signal,
      headers: authHeaders({"Content-Type": "application/json"}),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      if (response.status === 401) state.needKey = true;
      throw new Error((body.error && body.error.message) || response.statusText);
    }
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      if (delta.reasoning_content) {
        view.reasoning.hidden = false;
        view.thought.textContent += delta.reasoning_content;
      }
      if (delta.content) {
        answer += delta.content;
        view.answer.textContent = answer;
      }
      if (delta.content || delta.reasoning_content) {
        if (!state.live.started) state.live.started = performance.now();
        state.live.chunks += 1;
        showLive();
        view.box.scrollIntoView({block: "end"});
      }
    }
    view.box.dataset.done = "1";
  } catch (error) {
    if (error.name === "AbortError") {
      view.box.dataset.done = "stopped";
    } else {
      view.box.classList.add("error");
      view.answer.textContent = answer + (answer ? "\n" : "") + "error: " + error.message;
      view.box.dataset.done = "error";
    }
  } finally {
    state.messages.push({role: "assistant", content: answer});
    state.controller = null;
    state.live = null;
    setBusy(false);
    refresh();
  }
}

function showLive() {
  const live = state.live;
  if (!live || !live.started || live.chunks < 2) return;
  const seconds = (performance.now() - live.started) / 1000;
  // one chunk is one token's text, except where text is held back (a possible stop sequence) and sent together
  $("stat-live").textContent = rate((live.chunks - 1) / Math.max(seconds, 1e-3));
}

// ---- observing -----------------------------------------------------------------------------------------------

function showHealth(health) {
  const badge = $("engine");
  badge.textContent = health.status;
  badge.className = "badge " + health.status;
  $("model").textContent = health.model || "";
}

function showProfile(profile) {
  const slots = $("slots");
  slots.replaceChildren();
  for (let i = 0; i < profile.slots; i++) {
    const cell = document.createElement("i");
    const busy = profile.busy_slots.includes(i);
    cell.className = busy ? "busy" : "";
    cell.title = "slot " + i + (busy ? ": running" : ": free");
    slots.appendChild(cell);
  }
  $("queue").textContent = profile.queued + " / " + profile.max_queue;
  const totals = profile.totals;
  const last = profile.requests[profile.requests.length - 1];
  const disk = profile.disk;
  if (last) {
    $("stat-decode").textContent = rate(last.decode_tps) + " tok/s";
    $("stat-prefill").textContent = "prefill " + rate(last.prefill_tps) + " tok/s, avg decode " +
      rate(totals.decode_tps_average);
    $("stat-io-wait").textContent = "I/O wait " + pct(last.io_wait_share) + " of the last request";
    $("stat-share").textContent = last.share_of_disk_bound === null ? "–" : pct(last.share_of_disk_bound);
  }
  if (!disk.bandwidth_bytes_per_s) {
    $("stat-bound").textContent = "disk bandwidth " + disk.source;
  } else if (last && last.disk_bound_tps === null) {
    $("stat-bound").textContent = "no expert read from disk while decoding: no disk bound";
  } else {
    $("stat-bound").textContent = "bound " + rate(last ? last.disk_bound_tps : disk.cold_tokens_per_s) +
      " tok/s at " + bytes(disk.bandwidth_bytes_per_s) + "/s (" + disk.source + ")";
  }
  $("stat-tokens").textContent = totals.generated_tokens + " generated, " + totals.prefilled_tokens +
    " prefilled, " + (totals.prompt_tokens - totals.prefilled_tokens) + " reused";
  if (!state.live) $("stat-live").textContent = "–";
  showRequests(profile.requests);
}

function showRequests(requests) {
  const body = $("profile").tBodies[0];
  const newest = requests.length ? requests[requests.length - 1].seq : 0;
  if (newest === state.lastSeq) return;
  state.lastSeq = newest;
  body.replaceChildren();
  for (const r of requests.slice().reverse()) {
    const row = body.insertRow();
    for (const value of [r.seq, r.route, r.prompt_tokens, r.cached_tokens, r.generated_tokens, rate(r.prefill_tps),
      rate(r.decode_tps), pct(r.hit_rate), bytes(r.bytes_read), pct(r.io_wait_share), pct(r.share_of_disk_bound)]) {
      row.insertCell().textContent = value;
    }
  }
}

function showExperts(experts) {
  $("stat-hit-rate").textContent = pct(experts.hit_rate);
  $("stat-lookups").textContent = (experts.expert_hits || 0) + " hits, " + (experts.expert_misses || 0) + " misses";
  $("stat-bytes").textContent = bytes(experts.expert_bytes_read);
  $("stat-rss").textContent = bytes(experts.rss_bytes);
  drawHeatmap(experts.layers);
}

function cellColour(uses, most, where) {
  const v = uses > 0 && most > 0 ? Math.log1p(uses) / Math.log1p(most) : 0;
  const light = 10 + 55 * v;
  if (where === 2) return "hsl(140, 65%, " + light + "%)";
  if (where === 1) return "hsl(28, 90%, " + (light + 8) + "%)";
  return uses > 0 ? "hsl(210, 45%, " + light + "%)" : "hsl(210, 10%, 16%)";
}

function drawHeatmap(layers) {
  const canvas = $("heatmap");
  const usable = layers.filter((l) => Array.isArray(l.uses));
  const columns = Math.max(1, ...usable.map((l) => l.uses.length));
  const room = canvas.parentElement.clientWidth - 12;   // the wrapper scrolls when 2 px per expert do not fit
  const cell = Math.max(2, Math.min(24, Math.floor(room / columns) || 8));
  const rowHeight = Math.max(4, Math.min(18, Math.floor(360 / Math.max(1, usable.length))));
  canvas.width = columns * cell;
  canvas.height = Math.max(1, usable.length) * rowHeight;
  canvas.style.height = canvas.height + "px";
  canvas.style.width = canvas.width + "px";
  const g = canvas.getContext("2d");
  g.fillStyle = "#1a1f25";
  g.fillRect(0, 0, canvas.width, canvas.height);
  let total = 0;
  let resident = 0;
  usable.forEach((layer, row) => {
    const most = Math.max(0, ...layer.uses);
    layer.uses.forEach((uses, e) => {
      const where = layer.resident ? layer.resident[e] : 0;
      total += uses;
      if (where) resident += 1;
      g.fillStyle = cellColour(uses, most, where);
      g.fillRect(e * cell, row * rowHeight, Math.max(1, cell - 1), Math.max(1, rowHeight - 1));
    });
  });
  canvas.dataset.totalUses = String(total);
  canvas.dataset.resident = String(resident);
  canvas.dataset.layers = String(usable.length);
  canvas.layout = {usable, cell, rowHeight};
  if (!usable.length) $("heat-tip").textContent = "this engine reports no per-expert counts";
}

function heatTip(event) {
  const canvas = $("heatmap");
  const layout = canvas.layout;
  if (!layout) return;
  const box = canvas.getBoundingClientRect();
  const e = Math.floor((event.clientX - box.left) / layout.cell);
  const row = Math.floor((event.clientY - box.top) / layout.rowHeight);
  const layer = layout.usable[row];
  if (!layer || e < 0 || e >= layer.uses.length) return;
  const where = ["on disk", "in the cache", "in the cache, pinned"][layer.resident ? layer.resident[e] : 0];
  $("heat-tip").textContent = "layer " + layer.layer + ", expert " + e + ": " + layer.uses[e] + " uses, " + where +
    " · layer hit rate " + pct(layer.hit_rate) + ", " + layer.cache_slots + " of " + layer.experts + " cached";
}

let polling = false;
async function refresh() {
  if (polling) return;
  polling = true;
  try {
    const health = await (await fetch("/health", {cache: "no-store"})).json();
    showHealth(health);
    showProfile(await getJSON("/profile?n=12"));
    if (health.status === "ok") showExperts(await getJSON("/experts"));
    state.needKey = false;
    notice("");
  } catch (error) {
    notice(error.message);
    if (error instanceof TypeError) showHealth({status: "down"});
  } finally {
    polling = false;
  }
}

// ---- wiring --------------------------------------------------------------------------------------------------

function start() {
  const key = $("key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, key.value.trim());
    refresh();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("message").value;
    if (!text.trim() || state.controller) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("reset").addEventListener("click", () => {
    state.messages = [];
    $("transcript").replaceChildren();
  });
  $("heatmap").addEventListener("mousemove", heatTip);
  refresh();
  setInterval(() => { refresh(); showLive(); }, POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
