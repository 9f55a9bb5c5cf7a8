// docqa's page: manuals, questions streamed token by token, and what the cache saved per answer,
// all through the same REST API users call. No framework and no build step.

const $ = (id) => document.getElementById(id);
const KEY = "docqa.apiKey";
const state = {
  key: localStorage.getItem(KEY) || "",
  manual: null, // the selected manual {id, title, tokens}
  conversation: null, // the selected conversation's id
  running: null, // the streamed answer in flight: {requestId, controller}
  points: [], // recent answers' time to first token: {ttft, warm}
  poller: null,
};

class ApiError extends Error {
  constructor(status, error) {
    super(error.message || `the server answered ${status}`);
    this.status = status;
    this.code = error.code || "";
    this.limit = error.limit;
  }
}

function headers(extra = {}) {
  const h = { ...extra };
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

async function api(path, { method = "GET", json, form } = {}) {
  const init = { method, headers: headers() };
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (form !== undefined) {
    init.body = form;
  }
  const r = await fetch(path, init);
  if (!r.ok) throw await errorOf(r);
  return r.status === 204 ? null : r.json();
}

async function errorOf(r) {
  let error = {};
  try {
    error = (await r.json()).error || {};
  } catch {
    // not a JSON body: the status says enough
  }
  return new ApiError(r.status, error);
}

function describe(e) {
  if (!(e instanceof ApiError)) return String(e.message || e);
  const limit = e.limit === undefined || e.limit === null ? "" : ` (limit: ${fmt(e.limit)})`;
  return `${e.message}${limit}`;
}

const fmt = (n) => (typeof n === "number" ? n.toLocaleString("en-US") : String(n));
const ms = (n) => `${fmt(Math.round(n))} ms`;
// the selected manual's routes: behind a load balancer that hashes on the manual's id, its
// questions reach the replica holding its cache (README, "Scaling out")
const manualPath = () => `/v1/manuals/${encodeURIComponent(state.manual.id)}`;
const seconds = (n) => (n >= 10000 ? `${fmt(Math.round(n / 1000))} s` : `${(n / 1000).toFixed(1)} s`);
// how an answer's ttft_saved_ms was obtained (docs/interfaces.md)
const SAVED_BASIS = { estimate: "estimated", cold_run: "capped by a measured cold run", none: "nothing cached" };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c);
  return node;
}

function notice(text) {
  const n = $("notice");
  n.textContent = text || "";
  n.hidden = !text;
}

// -- API key -------------------------------------------------------------------------------------
function askForKey(message) {
  $("key-form").hidden = false;
  $("key-status").textContent = message;
  $("key-status").className = message ? "error" : "";
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("api-key").value.trim();
  localStorage.setItem(KEY, state.key);
  start();
});

// -- manuals -------------------------------------------------------------------------------------
async function loadManuals() {
  const { items } = await api("/v1/manuals?limit=1000");
  const list = $("manual-list");
  list.replaceChildren();
  for (const m of items) {
    const g = m.ledger;
    const li = el(
      "li",
      { "data-manual-id": m.id, class: state.manual?.id === m.id ? "selected" : "" },
      el("span", { class: "title", title: m.title, textContent: m.title }),
      el("span", {
        class: "tokens",
        textContent: `${fmt(m.tokens)} tokens` + (m.parts.length > 1 ? ` in ${m.parts.length} parts` : ""),
      }),
      el("button", { type: "button", class: "delete", textContent: "Delete" }),
      el("div", {
        class: "ledger",
        title: "every answer about this manual: prompt tokens reused from the cache, and the TTFT that saved",
        textContent:
          `${fmt(g.answers)} answers · ${fmt(g.cached_tokens)} of ${fmt(g.prompt_tokens)} ` +
          `prompt tokens reused · saved ${seconds(g.ttft_saved_ms)}`,
      }),
    );
    if (m.parts.length > 1) {
      // longer than the model's window: each question is answered from the part that ranks first
      li.append(
        el(
          "details",
          { class: "parts" },
          el("summary", { textContent: `${m.parts.length} parts, each its own cached prefix` }),
          el(
            "ol",
            { start: 1 },
            ...m.parts.map((p) =>
              el("li", { "data-part": p.index, textContent: `${p.title} (${fmt(p.tokens)} tokens)` }),
            ),
          ),
        ),
      );
    }
    li.querySelector(".title").addEventListener("click", () => selectManual(m));
    li.querySelector(".delete").addEventListener("click", () => deleteManual(m));
    list.append(li);
  }
  if (state.manual && !items.some((m) => m.id === state.manual.id)) selectManual(null);
}

async function upload(file) {
  const status = $("upload-status");
  status.className = "";
  status.textContent = `Uploading ${file.name}…`;
  const form = new FormData();
  form.append("file", file, file.name);
  try {
    const m = await api("/v1/manuals", { method: "POST", form });
    status.textContent = `${m.title}: ${fmt(m.tokens)} tokens`;
    await loadManuals();
    await selectManual(m);
  } catch (e) {
    status.className = "error";
    const message = describe(e);
    status.textContent = message.includes(file.name) ? message : `${file.name}: ${message}`;
  }
}

async function deleteManual(m) {
  try {
    await api(`/v1/manuals/${m.id}`, { method: "DELETE" });
    if (state.manual?.id === m.id) selectManual(null);
    await loadManuals();
  } catch (e) {
    notice(describe(e));
  }
}

$("file").addEventListener("change", (ev) => {
  const file = ev.target.files[0];
  ev.target.value = "";
  if (file) upload(file);
});
const drop = $("drop");
drop.addEventListener("dragover", (ev) => {
  ev.preventDefault();
  drop.classList.add("over");
});
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (ev) => {
  ev.preventDefault();
  drop.classList.remove("over");
  for (const file of ev.dataTransfer.files) upload(file);
});

// -- conversations -------------------------------------------------------------------------------
async function selectManual(m) {
  state.manual = m;
  state.conversation = null;
  for (const li of $("manual-list").children) {
    li.classList.toggle("selected", li.dataset.manualId === m?.id);
  }
  $("chat-title").textContent = m ? `Ask about ${m.title}` : "Pick a manual";
  $("conversation-bar").hidden = !m;
  $("ask-form").hidden = !m;
  $("messages").replaceChildren();
  if (!m) return;
  const { items } = await api(`/v1/conversations?manual_id=${encodeURIComponent(m.id)}&limit=1000`);
  const select = $("conversation-select");
  select.replaceChildren(el("option", { value: "", textContent: "a new conversation" }));
  for (const c of items.slice().reverse()) {
    const when = new Date(c.created_at).toLocaleString();
    select.append(el("option", { value: c.id, textContent: `${when} (${c.message_count / 2} turns)` }));
  }
  if (items.length) {
    select.value = items[items.length - 1].id;
    await openConversation(select.value);
  }
}

async function openConversation(id) {
  state.conversation = id || null;
  $("messages").replaceChildren();
  if (!id) return;
  const conv = await api(`/v1/conversations/${id}`);
  let question = "";
  for (const msg of conv.messages) {
    if (msg.role === "user") {
      question = msg.content;
      $("messages").append(el("li", { class: "question", textContent: msg.content }));
    } else {
      const li = answerItem(msg.id, question);
      li.querySelector(".text").textContent = msg.content;
      if (msg.usage && msg.timings) showMetrics(li, { ...msg, answer: msg.content, question }, false);
      $("messages").append(li);
    }
  }
}

$("conversation-select").addEventListener("change", (ev) => openConversation(ev.target.value));
$("new-conversation").addEventListener("click", () => {
  $("conversation-select").value = "";
  openConversation("");
});

// -- asking --------------------------------------------------------------------------------------
function answerItem(id, question) {
  return el(
    "li",
    { class: "answer", "data-request-id": id || "", "data-question": question },
    el("div", { class: "text" }),
    el("div", { class: "meta" }),
  );
}

function showMetrics(li, a, live = true) {
  const u = a.usage;
  const t = a.timings;
  const tiers = u.cached_tokens_by_tier || { device: u.cached_tokens, redis: 0 };
  const computed = u.prompt_tokens - u.cached_tokens;
  li.dataset.requestId = a.id;
  li.dataset.finishReason = a.finish_reason;
  li.dataset.promptTokens = u.prompt_tokens;
  li.dataset.cachedTokens = u.cached_tokens;
  const pct = (n) => `${(100 * n) / Math.max(u.prompt_tokens, 1)}%`;
  const bar = el(
    "div",
    { class: "bar", title: "prompt tokens: from the device cache, from Redis, computed" },
    el("span", { class: "device", style: `width:${pct(tiers.device)}` }),
    el("span", { class: "redis", style: `width:${pct(tiers.redis)}` }),
    el("span", { class: "computed", style: `width:${pct(computed)}` }),
  );
  const share = Math.round((100 * u.cached_tokens) / Math.max(u.prompt_tokens, 1));
  const spec = u.completion_tokens_details || { accepted_prediction_tokens: 0 };
  const accepted = spec.accepted_prediction_tokens || 0;
  li.dataset.acceptedTokens = accepted;
  const acceptedShare = Math.round((100 * accepted) / Math.max(u.completion_tokens, 1));
  const usage = el("div", {
    class: "usage",
    textContent:
      `${fmt(u.prompt_tokens)} prompt tokens: ${fmt(u.cached_tokens)} cached (${share}%; ` +
      `device ${fmt(tiers.device)}, Redis ${fmt(tiers.redis)}), ${fmt(computed)} computed · ` +
      `${fmt(u.completion_tokens)} answered, ${fmt(accepted)} of them drafted from the ` +
      `prompt (${acceptedShare}%)`,
  });
  const timing = el("div", {
    class: "timings",
    textContent:
      `TTFT ${ms(t.ttft_ms)} · the cache saved ${ms(t.ttft_saved_ms)}` +
      (t.ttft_saved_basis ? ` (${SAVED_BASIS[t.ttft_saved_basis] || t.ttft_saved_basis})` : "") +
      ` · TPOT ${t.tpot_ms.toFixed(1)} ms`,
  });
  const meta = li.querySelector(".meta");
  meta.replaceChildren(bar, usage, timing);
  const part = partLine(a);
  if (part) meta.prepend(part);
  if (a.finish_reason === "cancelled") {
    li.querySelector(".text").append(el("span", { class: "badge status", textContent: "cancelled" }));
  }
  const compare = el("button", { type: "button", class: "compare-button", textContent: "Compare with a cold run" });
  compare.addEventListener("click", () => compareCold(li, a, compare));
  meta.append(compare);
  if (live) addPoint(t.ttft_ms, u.cached_tokens > 0);
}

// the part of a manual stored as parts an answer came from (a live answer names it and the
// runner-up parts' scores; a stored turn has its index)
function partLine(a) {
  const parts = state.manual?.parts || [];
  if (a.part === null || a.part === undefined || parts.length < 2) return null;
  const index = typeof a.part === "number" ? a.part : a.part.index;
  const title = typeof a.part === "number" ? parts[index]?.title || "" : a.part.title;
  const scores = a.part_scores || [];
  const chosen = scores.find((s) => s.index === index);
  const line = el("div", {
    class: "part",
    "data-part": index,
    textContent:
      `from part ${index + 1} of ${parts.length}: ${title}` +
      (chosen ? ` · score ${chosen.score.toFixed(1)}` : ""),
  });
  // the runner-up parts: one click asks the same question from that part
  const others = scores.filter((s) => s.index !== index);
  if (others.length) line.append(" · also ranked ");
  others.forEach((s, i) => {
    const b = el("button", {
      type: "button",
      class: "link ask-part",
      "data-part": s.index,
      title: `ask again from part ${s.index + 1}: ${s.title}`,
      textContent: `part ${s.index + 1} (${s.score.toFixed(1)})`,
    });
    const question = a.question || "";
    b.addEventListener("click", () => question && !state.running && ask(question, s.index));
    line.append(i ? ", " : "", b);
  });
  return line;
}

async function compareCold(li, a, button) {
  button.disabled = true;
  const out = el("div", { class: "compare", textContent: "Computing the same question cold…" });
  li.querySelector(".meta").append(out);
  try {
    const cold = await api(`${manualPath()}/ask`, {
      method: "POST",
      json: {
        question: li.dataset.question,
        max_tokens: Math.max(1, a.usage.completion_tokens),
        cache: "bypass",
      },
    });
    out.textContent =
      `TTFT ${ms(a.timings.ttft_ms)} as answered · ${ms(cold.timings.ttft_ms)} ` +
      `computed cold (${fmt(cold.usage.prompt_tokens)} prompt tokens, cache bypassed)`;
    out.dataset.coldTtft = cold.timings.ttft_ms;
    addPoint(cold.timings.ttft_ms, false);
  } catch (e) {
    out.className = "compare error";
    out.textContent = describe(e);
  } finally {
    button.disabled = false;
  }
}

async function ask(question, part = null) {
  if (!state.conversation) {
    const conv = await api(`${manualPath()}/conversations`, { method: "POST" });
    state.conversation = conv.id;
    const select = $("conversation-select");
    select.insertBefore(el("option", { value: conv.id, textContent: "this conversation" }), select.children[1] || null);
    select.value = conv.id;
  }
  $("messages").append(el("li", { class: "question", textContent: question }));
  const li = answerItem("", question);
  li.classList.add("streaming");
  $("messages").append(li);
  const controller = new AbortController();
  state.running = { requestId: null, controller, manualPath: manualPath() };
  setBusy(true);
  try {
    const r = await fetch(`${manualPath()}/conversations/${state.conversation}/messages`, {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({
        content: question,
        max_tokens: Number($("max-tokens").value) || undefined,
        stream: true,
        ...(part === null ? {} : { part }),
      }),
      signal: controller.signal,
    });
    if (!r.ok) throw await errorOf(r);
    state.running.requestId = r.headers.get("X-Request-Id");
    li.dataset.requestId = state.running.requestId || "";
    await readEvents(r, {
      token: (data) => li.querySelector(".text").append(data.text),
      answer: (data) => {
        li.querySelector(".text").textContent = data.answer;
        showMetrics(li, { ...data, question });
        loadManuals(); // the manual's ledger now holds this answer
      },
      error: (data) => {
        li.querySelector(".meta").append(el("div", { class: "error", textContent: data.error.message }));
      },
    });
  } catch (e) {
    li.querySelector(".meta").append(el("div", { class: "error", textContent: describe(e) }));
  } finally {
    li.classList.remove("streaming");
    state.running = null;
    setBusy(false);
  }
}

async function readEvents(response, handlers) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      let data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (handlers[event] && data) handlers[event](JSON.parse(data));
    }
  }
}

function setBusy(busy) {
  $("ask").disabled = busy;
  $("stop").disabled = !busy;
}

$("ask-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const question = $("question").value.trim();
  if (!question || state.running) return;
  $("question").value = "";
  ask(question);
});

$("stop").addEventListener("click", async () => {
  const running = state.running;
  if (!running?.requestId) return;
  $("stop").disabled = true;
  try {
    await api(`${running.manualPath}/requests/${running.requestId}/cancel`, { method: "POST" });
  } catch (e) {
    if (e.status !== 404) notice(describe(e)); // 404: it finished meanwhile
  }
});

// -- engine panel --------------------------------------------------------------------------------
function addPoint(ttft, warm) {
  state.points.push({ ttft, warm });
  state.points = state.points.slice(-30);
  drawChart();
}

function drawChart() {
  const svg = $("ttft-chart");
  const ns = "http://www.w3.org/2000/svg";
  const W = 300;
  const H = 160;
  const left = 44;
  const bottom = 18;
  const top = 8;
  svg.replaceChildren();
  const max = Math.max(10, ...state.points.map((p) => p.ttft));
  const y = (v) => top + (H - top - bottom) * (1 - v / max);
  const add = (name, attrs, text) => {
    const node = document.createElementNS(ns, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  add("line", { x1: left, y1: y(0), x2: W - 4, y2: y(0), stroke: "#ccc" });
  add("line", { x1: left, y1: top, x2: left, y2: y(0), stroke: "#ccc" });
  add("text", { x: left - 4, y: y(max) + 4, "text-anchor": "end", "font-size": 9, fill: "#6a6f78" }, ms(max));
  add("text", { x: left - 4, y: y(0) + 3, "text-anchor": "end", "font-size": 9, fill: "#6a6f78" }, "0");
  add("text", { x: W - 4, y: H - 4, "text-anchor": "end", "font-size": 9, fill: "#6a6f78" }, "answers, oldest first");
  const step = (W - left - 12) / Math.max(1, 29);
  state.points.forEach((p, i) => {
    const circle = add("circle", {
      cx: left + 6 + i * step,
      cy: y(p.ttft),
      r: 3.5,
      fill: p.warm ? "#2e9d5b" : "#e08a2c",
      class: p.warm ? "point warm" : "point cold",
    });
    const title = document.createElementNS(ns, "title");
    title.textContent = `${ms(p.ttft)}${p.warm ? " (from the cache)" : " (cold)"}`;
    circle.append(title);
  });
}

function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$/);
    if (m && !m[2]) out[m[1]] = Number(m[3]);
  }
  return out;
}

async function refreshEngine() {
  try {
    const [e, text] = await Promise.all([
      api("/v1/engine"),
      fetch("/metrics").then((r) => (r.ok ? r.text() : "")),
    ]);
    const m = parseMetrics(text);
    const weights = e.weights === "random" ? " (random weights: answers are noise)" : "";
    $("model").textContent = `${e.model}${weights} · ${e.dtype} on ${e.device} · ${e.attention_backend} attention`;
    const rows = [
      ["KV capacity", `${fmt(e.kv_capacity_tokens)} tokens`],
      ["KV per token", `${fmt(e.kv_bytes_per_token)} bytes`],
      [`Concurrency at ${fmt(e.max_model_len)} tokens`, `${e.max_concurrency.toFixed(2)}x`],
      ["Blocks in use", `${fmt(e.blocks_in_use)} of ${fmt(e.kv_capacity_blocks)}`],
      ["Blocks cached", fmt(e.blocks_cached)],
      ["Cache hit rate", `${(100 * e.prefix_cache_hit_rate).toFixed(1)}%`],
      ["Running / waiting", `${e.requests_running} / ${e.requests_waiting}`],
    ];
    const served = m["docqa:time_to_first_token_seconds_count"];
    if (served) {
      rows.push(["Answers served", fmt(served)]);
      rows.push(["Mean TTFT", ms((1000 * m["docqa:time_to_first_token_seconds_sum"]) / served)]);
    }
    const dl = $("engine-stats");
    dl.replaceChildren();
    for (const [k, v] of rows) dl.append(el("dt", { textContent: k }), el("dd", { textContent: v }));
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) askForKey(e.message);
  }
}

// -- start ---------------------------------------------------------------------------------------
async function start() {
  notice("");
  try {
    await api("/v1/engine");
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) {
      askForKey(state.key ? e.message : "This server needs an API key.");
      return;
    }
    if (e instanceof ApiError && e.status === 503) {
      notice(`${describe(e)}; retrying`);
      setTimeout(start, 3000);
      return;
    }
    notice(describe(e));
    return;
  }
  if (state.key) {
    $("key-form").hidden = false;
    $("key-status").className = "";
    $("key-status").textContent = "key accepted";
  }
  await loadManuals();
  await refreshEngine();
  clearInterval(state.poller);
  state.poller = setInterval(refreshEngine, 3000);
}

drawChart();
start();
