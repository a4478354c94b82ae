// Lifeline's live view: reads /debug/steps and /debug/requests once, then /dashboard/events
// (server-sent events, read with fetch so that the admin key can travel as a header).
"use strict";
(() => {
  const STAGES = ["gateway", "template", "tokenize", "queue", "prefill", "decode", "detokenize",
    "stream"];
  const STATE_STAGE = { queued: "queue", prefill: "prefill", decode: "decode" };
  const ROWS_KEPT = 200, ROWS_SHOWN = 60, STEPS_KEPT = 4000, SERIES_KEPT = 120;
  const STEP_WINDOW_S = 10;
  const SVG = "http://www.w3.org/2000/svg";

  const state = {
    key: null, backend: null, backends: null, config: null, steps: [], stepIds: new Set(), lastStep: null,
    rows: new Map(), series: [], histograms: null, skew: 0, events: 0,
    selected: null, detailSig: null, hoverStep: null, pinnedStep: null, diagnoses: new Map(),
  };

  // ---- small DOM helpers -------------------------------------------------------------------
  function el(tag, attrs = {}, ...children) {
    const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
      : document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value == null || value === false) continue;
      if (name === "text") node.textContent = value;
      else if (name === "style") node.style.cssText = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value);
    }
    for (const child of children.flat()) {
      if (child != null) node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }
  const svg = (tag, attrs, ...children) => el("svg:" + tag, attrs, ...children);
  const colour = (stage) => `var(--${stage})`;
  const $ = (selector) => document.querySelector(selector);

  function fmtMs(ms) {
    if (ms == null || !Number.isFinite(ms)) return "–";
    if (ms >= 10000) return (ms / 1000).toFixed(1) + " s";
    if (ms >= 1000) return (ms / 1000).toFixed(2) + " s";
    return (ms >= 10 ? Math.round(ms) : ms.toFixed(1)) + " ms";
  }
  const fmtInt = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));
  const pct = (x) => (x == null || !Number.isFinite(x) ? "–" : (100 * x).toFixed(x < 0.1 ? 1 : 0) + "%");
  const shortId = (id) => (id.length > 18 ? id.slice(0, 15) + "…" : id);
  const serverNow = () => Date.now() / 1000 + state.skew;

  // ---- talking to the server ---------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, message, code) { super(message); this.status = status; this.code = code; }
  }

  function headers() {
    return state.key ? { Authorization: "Bearer " + state.key } : {};
  }

  async function failure(response) {
    let message = `${response.status} ${response.statusText}`, code = null;
    try {
      const body = await response.json();
      if (body && body.error) { message = body.error.message || message; code = body.error.code; }
    } catch (_) { /* not JSON: keep the status line */ }
    return new ApiError(response.status, message, code);
  }

  // Behind the gateway of `lifeline serve --config`, every path names the backend shown.
  function withBackend(path) {
    if (!state.backend) return path;
    return path + (path.includes("?") ? "&" : "?") + "backend=" + encodeURIComponent(state.backend);
  }

  async function api(path) {
    const response = await fetch(withBackend(path), { headers: headers(), cache: "no-store" });
    if (!response.ok) throw await failure(response);
    return response.json();
  }

  const listOf = (body) => (Array.isArray(body) ? body : body.data || []);

  async function backfill() {
    const since = state.lastStep == null ? "" : `&since=${state.lastStep}`;
    try {
      const steps = await api(`/debug/steps?limit=1000${since}`);
      state.config = steps.config || state.config;
      addSteps(listOf(steps));
    } catch (error) {
      if (error.code !== "step_log_disabled") throw error;
    }
    upsertRows(listOf(await api("/debug/requests?limit=200")));
    if (state.backends == null) await listBackends();
  }

  // A gateway lists its in-process backends at /debug/backends; a single server has none.
  async function listBackends() {
    try {
      state.backends = listOf(await api("/debug/backends")).filter((b) => b.local);
    } catch (error) {
      if (error.status !== 404) throw error;
      state.backends = [];
    }
    const select = $("#backend");
    if (state.backends.length < 2) return;
    const shown = state.backend ?? state.backends.find((b) => b.default)?.name;
    select.replaceChildren(...state.backends.map((b) => el("option", {
      value: b.name, selected: b.name === shown, text: `${b.name} · ${b.model}` })));
    select.addEventListener("change", () => {
      location.search = "?backend=" + encodeURIComponent(select.value);
    });
    $("#backendform").hidden = false;
  }

  function parseEvents(buffer, onData) {
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, cut).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      buffer = buffer.slice(cut + 2);
      if (data) onData(JSON.parse(data));
    }
    return buffer;
  }

  async function stream() {
    const response = await fetch(withBackend("/dashboard/events"),
      { headers: headers(), cache: "no-store" });
    if (!response.ok) throw await failure(response);
    setConn("live", "live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer = (buffer + value).replace(/\r\n/g, "\n").replace(/\r(?!$)/g, "\n");
      buffer = parseEvents(buffer, onEvent);
    }
  }

  async function connect() {
    for (let delay = 500; ; delay = Math.min(delay * 2, 8000)) {
      try {
        await backfill();
        render();
        await stream();
        delay = 250;
        setConn("connecting", "reconnecting…");
      } catch (error) {
        if (error.status === 401 || error.status === 403) { askKey(error); return; }
        setConn("error", `disconnected (${error.message}); retrying`);
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }

  function setConn(kind, text) {
    const node = $("#conn");
    node.dataset.state = kind;
    node.textContent = text;
  }

  function askKey(error) {
    setConn("error", "this view needs the server's admin key");
    $("#keyform").hidden = false;
    $("#keyerror").textContent = error.message;
  }

  function readKey() {
    const query = new URLSearchParams(location.search);
    state.backend = query.get("backend");
    const given = query.get("admin_key") ?? new URLSearchParams(location.hash.slice(1)).get("key");
    if (given != null) {
      sessionStorage.setItem("lifeline.adminKey", given);
      history.replaceState(null, "", withBackend(location.pathname));
    }
    state.key = sessionStorage.getItem("lifeline.adminKey");
    $("#keyform").addEventListener("submit", (event) => {
      event.preventDefault();
      state.key = $("#key").value;
      sessionStorage.setItem("lifeline.adminKey", state.key);
      $("#keyform").hidden = true;
      setConn("connecting", "connecting…");
      connect();
    });
  }

  // ---- the data kept -----------------------------------------------------------------------
  function addSteps(steps) {
    for (const step of steps) {
      if (state.stepIds.has(step.step)) continue;
      state.stepIds.add(step.step);
      state.steps.push(step);
      state.lastStep = Math.max(state.lastStep ?? step.step, step.step);
    }
    if (state.steps.length > STEPS_KEPT) {
      for (const old of state.steps.splice(0, state.steps.length - STEPS_KEPT)) {
        state.stepIds.delete(old.step);
      }
    }
  }

  const inFlight = (row) => row.state in STATE_STAGE;

  function upsertRows(rows) {
    for (const row of rows) {
      const before = state.rows.get(row.id);
      state.rows.set(row.id, row);
      if (before && inFlight(before) && !inFlight(row) && row.id === state.selected) {
        state.diagnoses.delete(row.id);
        loadDiagnosis(row.id);
      }
    }
    if (state.rows.size > ROWS_KEPT) {
      const finished = [...state.rows.values()].filter((r) => !inFlight(r))
        .sort((a, b) => a.arrival - b.arrival);
      for (const row of finished.slice(0, state.rows.size - ROWS_KEPT)) {
        if (row.id !== state.selected) state.rows.delete(row.id);
      }
    }
  }

  function onEvent(event) {
    state.events += 1;
    document.body.dataset.events = state.events;
    if (event.now) state.skew = event.now - Date.now() / 1000;
    const steps = event.steps || [];
    addSteps(steps);
    const rows = event.requests || [];
    const sent = new Set(rows.map((r) => r.id));
    for (const [id, row] of state.rows) if (inFlight(row) && !sent.has(id) && id !== state.selected) state.rows.delete(id);
    upsertRows(rows);
    if (event.histograms) state.histograms = event.histograms;
    if (event.engine) {
      const mean = steps.length ? steps.reduce((a, s) => a + s.duration_ms, 0) / steps.length : null;
      state.series.push({ ...event.engine, step_ms: mean, limit: steps.length ? steps[steps.length - 1].limit : null });
      if (state.series.length > SERIES_KEPT) state.series.shift();
    }
    scheduleRender();
  }

  // ---- tiles -------------------------------------------------------------------------------
  function spark(node, values, max) {
    const points = values.map((v, i) => [i, v]).filter(([, v]) => v != null);
    node.replaceChildren();
    node.setAttribute("viewBox", `0 0 ${SERIES_KEPT - 1} 34`);
    node.setAttribute("preserveAspectRatio", "none");
    if (points.length < 2) return;
    const top = Math.max(max ?? Math.max(...points.map(([, v]) => v)), 1e-9);
    const x0 = SERIES_KEPT - values.length;
    const xy = points.map(([i, v]) => `${x0 + i},${(32 - (30 * Math.min(v, top)) / top).toFixed(2)}`);
    node.append(
      svg("polygon", { points: `${x0 + points[0][0]},33 ${xy.join(" ")} ${x0 + points.at(-1)[0]},33`, fill: "#2f6fd61a" }),
      svg("polyline", { points: xy.join(" "), fill: "none", stroke: "var(--accent)", "stroke-width": 1.5, "vector-effect": "non-scaling-stroke" }));
  }

  function tile(id, value, sub, values, max) {
    const node = document.getElementById(id);
    node.querySelector(".value").textContent = value;
    node.querySelector(".sub").textContent = sub;
    spark(node.querySelector(".spark"), values, max);
  }

  function renderTiles() {
    const series = state.series, now = series.at(-1);
    if (!now) return;
    const config = state.config || {};
    const seqs = now.max_num_seqs ?? config.max_num_seqs;
    tile("tile-batch", fmtInt(now.batch_size), `running ${fmtInt(now.running)}${seqs ? " of max_num_seqs " + seqs : ""}`,
      series.map((s) => s.batch_size), seqs);
    const limit = [...series].reverse().find((s) => s.waiting > 0)?.limit;
    tile("tile-queue", fmtInt(now.waiting), now.waiting > 0 ? `waiting${limit ? ", held by " + limit : ""}` : "none waiting",
      series.map((s) => s.waiting));
    const kv = now.kv_blocks_total ? now.kv_blocks_used / now.kv_blocks_total : null;
    tile("tile-kv", pct(kv), `${fmtInt(now.kv_blocks_used)} of ${fmtInt(now.kv_blocks_total)} blocks`,
      series.map((s) => (s.kv_blocks_total ? s.kv_blocks_used / s.kv_blocks_total : null)), 1);
    tile("tile-prefix", pct(now.prefix_hit_rate), "prompt tokens served from the cache",
      series.map((s) => s.prefix_hit_rate), 1);
    const recent = state.steps.filter((s) => s.start > serverNow() - 2);
    const durations = recent.map((s) => s.duration_ms).sort((a, b) => a - b);
    tile("tile-step", fmtMs(durations[Math.floor(durations.length / 2)]),
      `median · ${(recent.length / 2).toFixed(1)} steps/s`, series.map((s) => s.step_ms));
  }

  // ---- the step timeline -------------------------------------------------------------------
  function legend(node, entries) {
    node.replaceChildren(...entries.map(([name, fill]) => el("span", {}, el("i", { style: `background:${fill}` }), name)));
  }

  function renderSteps() {
    const node = $("#steps");
    const width = node.clientWidth || 900, height = node.clientHeight || 170;
    const left = 48, right = 8, top = 16, laneH = 26, bottom = 18;
    const chartBottom = height - bottom - laneH - 6;
    const now = serverNow(), from = now - STEP_WINDOW_S;
    const shown = state.steps.filter((s) => s.start + s.duration_ms / 1000 >= from);
    const maxMs = niceCeil(Math.max(1, ...shown.map((s) => s.duration_ms)));
    const maxSeqs = Math.max(1, state.config?.max_num_seqs ?? 0, ...shown.map((s) => s.requests.length));
    const sx = (t) => left + ((t - from) / STEP_WINDOW_S) * (width - left - right);
    const sy = (ms) => chartBottom - (ms / maxMs) * (chartBottom - top);
    const parts = [
      svg("line", { class: "axis", x1: left, x2: width - right, y1: chartBottom, y2: chartBottom }),
      svg("line", { class: "axis", x1: left, x2: width - right, y1: sy(maxMs / 2), y2: sy(maxMs / 2), "stroke-dasharray": "2 3" }),
      svg("text", { x: left - 6, y: sy(maxMs) + 4, "text-anchor": "end", text: fmtMs(maxMs) }),
      svg("text", { x: left - 6, y: sy(maxMs / 2) + 4, "text-anchor": "end", text: fmtMs(maxMs / 2) }),
      svg("text", { x: left - 6, y: chartBottom - laneH / 2 + laneH + 9, "text-anchor": "end", text: "batch" }),
    ];
    for (const t of [10, 8, 6, 4, 2, 0]) {
      parts.push(svg("text", { x: sx(now - t), y: height - 4, "text-anchor": t === 0 ? "end" : "middle", text: t ? `−${t} s` : "now" }));
    }
    const laneTop = chartBottom + 6;
    for (const step of shown) {
      const x = Math.max(sx(step.start), left), w = Math.max(1.2, sx(step.start + step.duration_ms / 1000) - x);
      const tokens = step.prefill_tokens + step.decode_tokens;
      const prefillShare = tokens ? step.prefill_tokens / tokens : 0;
      const y = sy(step.duration_ms), h = chartBottom - y;
      const g = svg("g", { "data-step": step.step },
        svg("title", { text: stepSummary(step) }),
        svg("rect", { x, y: y + h * prefillShare, width: w, height: h * (1 - prefillShare), fill: colour("decode") }),
        svg("rect", { x, y, width: w, height: h * prefillShare, fill: colour("prefill") }),
        svg("rect", { x, y: laneTop + laneH * (1 - step.requests.length / maxSeqs), width: w, height: laneH * step.requests.length / maxSeqs, fill: "#9aa1ad" }));
      if (step.limit) g.append(svg("rect", { x, y: chartBottom + 1, width: w, height: 3, fill: colour("queue") }));
      if (step.preempted?.length) g.append(svg("path", { d: `M${x} ${top} l4 -6 h-8 z`, fill: "var(--warn)" }));
      const marked = step.step === (state.pinnedStep ?? state.hoverStep);
      const carries = state.selected && step.requests.some((r) => r.id === state.selected || r.parent === state.selected);
      if (marked || carries) g.append(svg("rect", { x: x - 0.5, y: top - 6, width: w + 1, height: 4, fill: marked ? "var(--ink)" : "var(--accent)" }));
      parts.push(g);
    }
    node.replaceChildren(...parts);
    node.onpointermove = (event) => hoverStep(event, shown, sx);
    node.onpointerleave = () => { state.hoverStep = null; renderStepDetail(); };
    node.onclick = (event) => {
      const step = stepAt(event, shown, sx);
      state.pinnedStep = step && step.step !== state.pinnedStep ? step.step : null;
      renderStepDetail();
      renderSteps();
    };
  }

  function niceCeil(value) {
    const power = 10 ** Math.floor(Math.log10(value));
    return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= value);
  }

  function stepSummary(step) {
    const limit = step.limit ? ` · ${step.waiting} waiting, held by ${step.limit}` : "";
    return `step ${step.step} · ${fmtMs(step.duration_ms)} · ${fmtInt(step.prefill_tokens)} prefill + ` +
      `${fmtInt(step.decode_tokens)} decode tokens · ${step.requests.length} requests${limit}`;
  }

  function stepAt(event, shown, sx) {
    const x = event.clientX - event.currentTarget.getBoundingClientRect().left;
    let best = null, distance = 6;
    for (const step of shown) {
      const a = sx(step.start), b = Math.max(a + 1.2, sx(step.start + step.duration_ms / 1000));
      const d = x < a ? a - x : x > b ? x - b : 0;
      if (d < distance) { best = step; distance = d; }
    }
    return best;
  }

  function hoverStep(event, shown, sx) {
    const step = stepAt(event, shown, sx);
    if ((step?.step ?? null) === state.hoverStep) return;
    state.hoverStep = step?.step ?? null;
    renderStepDetail();
  }

  function renderStepDetail() {
    const id = state.pinnedStep ?? state.hoverStep;
    const step = state.steps.find((s) => s.step === id);
    const node = $("#step-detail");
    document.querySelectorAll(".row.in-step").forEach((r) => r.classList.remove("in-step"));
    if (!step) {
      node.textContent = "Hover or click a step to see the requests it carried.";
      return;
    }
    const carried = step.requests.map((r) => `${shortId(r.id)} ${r.kind} ${fmtInt(r.tokens)} tok @ ${fmtInt(r.context)}`);
    node.replaceChildren(el("b", { text: stepSummary(step) }), el("br"),
      carried.length ? carried.join(" · ") : "no requests");
    for (const r of step.requests) document.querySelector(`.row[data-request-id="${CSS.escape(r.id)}"]`)?.classList.add("in-step");
  }

  // ---- requests ----------------------------------------------------------------------------
  function segments(row, now) {
    const t = row.timings || {}, out = [];
    let at = 0;
    for (const stage of STAGES) {
      const ms = t[stage + "_ms"];
      if (ms == null) continue;
      out.push({ stage, start: at, ms: Math.max(ms, 0) });
      at += Math.max(ms, 0);
    }
    if (inFlight(row) && row.arrival) {
      const elapsed = Math.max((now - row.arrival) * 1000, row.elapsed_ms ?? 0);
      const first = row.ttft_ms ?? t.ttft_ms;
      if (row.state === "decode" && first != null && first > at) {
        out.push({ stage: "prefill", start: at, ms: first - at, live: true, label: "arrival to first token" });
        at = first;
      }
      if (elapsed > at) out.push({ stage: STATE_STAGE[row.state], start: at, ms: elapsed - at, live: true });
    }
    return out;
  }

  const rowEnd = (segs) => segs.reduce((end, s) => Math.max(end, s.start + s.ms), 0);

  function chunkCuts(row, seg) {
    const chunks = row.timings?.steps?.prefill || [];
    const total = chunks.reduce((a, c) => a + c[5], 0);
    if (chunks.length < 2 || !total) return [];
    let at = 0;
    return chunks.slice(0, -1).map((c) => { at += c[5]; return seg.start + (seg.ms * at) / total; });
  }

  function stageBar(row, segs, scale) {
    const bar = svg("svg", { class: "bar", viewBox: "0 0 1000 14", preserveAspectRatio: "none" });
    for (const seg of segs) {
      bar.append(svg("rect", { x: (seg.start / scale) * 1000, y: 1, width: Math.max((seg.ms / scale) * 1000, 0.8), height: 12,
        fill: colour(seg.stage), opacity: seg.live ? 0.55 : 1 }, svg("title", { text: `${seg.label ?? seg.stage}: ${fmtMs(seg.ms)}` })));
      if (seg.stage === "prefill") {
        for (const cut of chunkCuts(row, seg)) {
          bar.append(svg("line", { x1: (cut / scale) * 1000, x2: (cut / scale) * 1000, y1: 1, y2: 13, stroke: "#fff", "vector-effect": "non-scaling-stroke" }));
        }
      }
    }
    return bar;
  }

  function statusBadge(row) {
    if (inFlight(row)) return el("span", { class: `state ${row.state}`, text: row.state });
    if (row.status != null && row.status >= 400) return el("span", { class: "state error", text: String(row.status) });
    return el("span", { class: "state", text: row.timings?.finish_reason ?? row.finish_reason ?? "done" });
  }

  function tokens(row) {
    const t = row.timings || {};
    const prompt = t.prompt_tokens ?? row.prompt_tokens, out = t.completion_tokens ?? row.completion_tokens;
    return `${fmtInt(prompt)} → ${fmtInt(out)}`;
  }

  function renderRequests() {
    const node = $("#requests");
    const now = serverNow();
    const rows = [...state.rows.values()].sort((a, b) => b.arrival - a.arrival).slice(0, ROWS_SHOWN);
    if (!rows.length) return;
    const segs = new Map(rows.map((r) => [r.id, segments(r, now)]));
    const scale = Math.max(1, ...[...segs.values()].map(rowEnd));
    const head = ["request", "state", "tokens", "TTFT", "E2E", `stages · 0 to ${fmtMs(scale)}`]
      .map((name, i) => el("div", { class: `head${i >= 3 && i <= 4 ? " num" : ""}`, text: name }));
    const body = rows.map((row) => {
      const t = row.timings || {};
      const e2e = inFlight(row) ? rowEnd(segs.get(row.id)) : t.e2e_ms;
      return el("div", { class: `row${row.id === state.selected ? " selected" : ""}`, "data-request-id": row.id,
        "data-state": inFlight(row) ? row.state : "finished", onclick: () => select(row.id) },
      el("span", { class: "id", title: row.id, text: shortId(row.id) }),
      el("span", {}, statusBadge(row)),
      el("span", { class: "num", text: tokens(row) }),
      el("span", { class: "num", text: fmtMs(t.ttft_ms ?? row.ttft_ms) }),
      el("span", { class: "num", text: (inFlight(row) ? "≥ " : "") + fmtMs(e2e) }),
      el("span", {}, stageBar(row, segs.get(row.id), scale)));
    });
    const scroll = node.scrollTop;
    node.replaceChildren(...head, ...body);
    node.scrollTop = scroll;
    renderStepDetail();
  }

  // ---- the selected request ----------------------------------------------------------------
  function select(id) {
    state.selected = id === state.selected ? null : id;
    if (state.selected && !state.diagnoses.has(id)) loadDiagnosis(id);
    render();
  }

  async function loadDiagnosis(id) {
    const row = state.rows.get(id);
    if (!row || inFlight(row)) return;
    state.diagnoses.set(id, { loading: true });
    try {
      state.diagnoses.set(id, { data: await api(`/debug/requests/${encodeURIComponent(id)}/diagnosis`) });
    } catch (error) {
      state.diagnoses.set(id, { error });
    }
    if (state.selected === id) renderDetail();
  }

  function renderDetail() {
    const node = $("#detail");
    const row = state.selected && state.rows.get(state.selected);
    const entry = row && state.diagnoses.get(row.id);
    const sig = row ? [row.id, row.state, inFlight(row) ? serverNow() : "", entry?.data ? "d" : entry?.error ? "e" : "", node.clientWidth].join("|") : "";
    if (sig === state.detailSig) return;
    state.detailSig = sig;
    if (!row) {
      node.replaceChildren(el("h2", { text: "Request" }), el("p", { class: "empty", text: "Click a request to see its stages and its diagnosis." }));
      return;
    }
    const t = row.timings || {};
    const n = t.completion_tokens ?? row.completion_tokens;
    const tpot = n > 1 && t.e2e_ms != null && t.ttft_ms != null ? (t.e2e_ms - t.ttft_ms) / (n - 1) : null;
    const facts = [["state", inFlight(row) ? row.state : `${row.status ?? ""} ${t.finish_reason ?? ""}`.trim() || "done"],
      ["prompt tokens", `${fmtInt(t.prompt_tokens ?? row.prompt_tokens)}${t.cached_tokens ? ` (${fmtInt(t.cached_tokens)} cached)` : ""}`],
      ["output tokens", fmtInt(n)], ["TTFT", fmtMs(t.ttft_ms ?? row.ttft_ms)], ["TPOT", fmtMs(tpot)], ["E2E", fmtMs(t.e2e_ms)]];
    node.replaceChildren(
      el("h2", { text: "Request" }), el("p", { class: "rid", text: row.id }),
      el("div", { class: "facts" }, facts.map(([k, v]) => el("div", {}, k, el("b", { text: v })))),
      detailWaterfall(row), stageNotes(t),
      el("h3", { text: "Diagnosis" }), el("div", { id: "diagnosis" }, diagnosisView(row)));
  }

  function detailWaterfall(row) {
    const segs = segments(row, serverNow());
    const width = Math.max(($("#detail").clientWidth || 532) - 32, 300), labelW = 78, msW = 62, laneH = 17;
    const scale = Math.max(rowEnd(segs), 1e-3), span = width - labelW - msW;
    const sx = (ms) => labelW + (ms / scale) * span;
    const parts = [];
    segs.forEach((seg, i) => {
      const y = i * laneH;
      parts.push(svg("text", { x: 0, y: y + 12, text: seg.label ? "to 1st token" : seg.stage }),
        svg("rect", { x: sx(seg.start), y: y + 2, width: Math.max((seg.ms / scale) * span, 1), height: laneH - 5, fill: colour(seg.stage), opacity: seg.live ? 0.55 : 1 }),
        svg("text", { x: width, y: y + 12, "text-anchor": "end", text: fmtMs(seg.ms) + (seg.live ? "…" : "") }));
      if (seg.stage === "prefill") {
        for (const cut of chunkCuts(row, seg)) parts.push(svg("line", { x1: sx(cut), x2: sx(cut), y1: y + 2, y2: y + laneH - 3, stroke: "#fff", "stroke-width": 1.5 }));
      }
    });
    return svg("svg", { class: "chart", width, height: segs.length * laneH + 2, "data-detail-waterfall": "" }, parts);
  }

  function stageNotes(t) {
    const notes = [], q = t.queue, steps = t.steps;
    if (q) {
      notes.push(`Queue: waited ${fmtInt(q.steps_waited)} steps behind ${fmtInt(q.ahead_prefill_tokens)} prefill tokens` +
        (q.limit ? `; held by ${q.limit} (${fmtInt(q.running_at_arrival)} running of ${fmtInt(q.max_num_seqs)})` : ""));
    }
    for (const [i, c] of (steps?.prefill || []).entries()) {
      notes.push(`Prefill chunk ${i + 1}: ${fmtInt(c[1])} tokens at context ${fmtInt(c[2])}, in a step of ${c[3]} requests / ${fmtInt(c[4])} tokens, ${fmtMs(c[5])}`);
    }
    if (steps?.decode_batch) {
      const b = steps.decode_batch, ctx = steps.decode_context || {}, ms = steps.decode_step_ms || {};
      notes.push(`Decode: ${b.mean.toFixed(1)} requests per step (${b.min}–${b.max}), context ${fmtInt(ctx.first)} → ${fmtInt(ctx.last)}, ` +
        `step ${fmtMs(ms.mean)} mean`);
      if (steps.decode_steps_with_prefill) {
        notes.push(`${fmtInt(steps.decode_steps_with_prefill)} decode steps also carried ${fmtInt(steps.others_prefill_tokens)} prefill tokens of other requests`);
      }
    }
    const im = t.images;
    if (im) {
      const before = [im.fetch_ms ? `fetch ${fmtMs(im.fetch_ms)}` : "", `decode ${fmtMs(im.decode_ms)}`,
        `preprocess ${fmtMs(im.preprocess_ms)}`].filter(Boolean).join(", ");
      notes.push(`Images: ${fmtInt(im.count)} (${fmtInt(im.frames)} frames, ${fmtInt(im.tokens)} image tokens): ${before} in template; ` +
        `encoder ${fmtMs(im.encode_ms)}, projector ${fmtMs(im.project_ms)}, splice ${fmtMs(im.splice_ms)} in prefill` +
        (im.encoder_cache_hits ? `; ${fmtInt(im.encoder_cache_hits)} from the encoder cache` : "") +
        (im.prefix_cached ? `; ${fmtInt(im.prefix_cached)} wholly in the prefix cache` : ""));
    }
    if (t.kv_bytes_read_per_token) notes.push(`KV read per output token: ${(t.kv_bytes_read_per_token / 1e6).toFixed(2)} MB`);
    if (t.preemptions) notes.push(`Preempted ${t.preemptions}×, ${fmtInt(t.recomputed_tokens)} tokens recomputed`);
    return notes.length ? el("ul", { class: "stage-notes" }, notes.map((text) => el("li", { text }))) : "";
  }

  function diagnosisView(row) {
    if (inFlight(row)) return el("p", { class: "empty", text: "The diagnosis comes once the request has finished." });
    const entry = state.diagnoses.get(row.id);
    if (!entry || entry.loading) return el("p", { class: "empty", text: "Loading the diagnosis…" });
    if (entry.error) return el("p", { class: "empty", text: `No diagnosis: ${entry.error.message}` });
    const d = entry.data;
    return [section("Time to first token", d.ttft, d.ttft?.ms_p50 ?? d.ttft?.ms, "TTFT"),
      section("Output", d.output, d.output?.tpot_ms_p50 ?? d.output?.tpot_ms, "TPOT"),
      section("Answer (after the reasoning)", d.answer, d.answer?.ms, "TTFAT − TTFT"),
      (d.missing || []).length ? el("ul", { class: "missing" }, d.missing.map((m) => el("li", { text: m }))) : ""];
  }

  function section(title, part, ms, label) {
    if (!part || !(part.findings || []).length) return "";
    return el("div", { class: "diagnosis-part" },
      el("h3", { text: ms != null ? `${title} · ${label} ${fmtMs(ms)}` : title }),
      part.findings.map((f) => el("div", { class: "finding", "data-cause": f.cause },
        el("div", { class: "share" }, pct(f.share), el("i", { style: `width:${Math.min(100, 100 * (f.share || 0))}%` })),
        el("div", { class: "title", text: f.title }),
        f.evidence ? el("div", { class: "evidence", text: f.evidence }) : "",
        f.fix ? el("div", { class: "fix", text: f.fix }) : "")));
  }

  // ---- histograms --------------------------------------------------------------------------
  function renderHistogram(node, buckets) {
    const width = node.clientWidth || 500, height = node.clientHeight || 170;
    if (!buckets?.length) {
      node.replaceChildren(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle", text: "no requests yet" }));
      return;
    }
    const counts = buckets.map(([, c]) => c);
    const first = Math.max(0, counts.findIndex((c) => c > 0) - 1);
    const last = Math.min(counts.length - 1, counts.length - 1 - [...counts].reverse().findIndex((c) => c > 0) + 1);
    const shown = counts.some((c) => c > 0) ? buckets.slice(first, last + 1) : buckets;
    const total = counts.reduce((a, c) => a + c, 0), max = Math.max(1, ...shown.map(([, c]) => c));
    const left = 8, bottom = 22, top = 18, w = (width - left * 2) / shown.length;
    const parts = [svg("line", { class: "axis", x1: left, x2: width - left, y1: height - bottom, y2: height - bottom })];
    shown.forEach(([le, count], i) => {
      const h = ((height - bottom - top) * count) / max, x = left + i * w;
      const name = le == null || le === "+Inf" || le === Infinity ? "more" : `≤${fmtMs(le).replace(" ms", "")}`;
      parts.push(svg("rect", { x: x + 1, y: height - bottom - h, width: Math.max(w - 2, 1), height: h, fill: "var(--accent)", rx: 2 },
        svg("title", { text: `${name} ms: ${count}` })),
      svg("text", { x: x + w / 2, y: height - 6, "text-anchor": "middle", text: name }));
      if (count) parts.push(svg("text", { x: x + w / 2, y: height - bottom - h - 4, "text-anchor": "middle", text: count }));
    });
    parts.push(svg("text", { x: width - left, y: 12, "text-anchor": "end", text: `${total} requests` }));
    node.replaceChildren(...parts);
  }

  // ---- drawing -----------------------------------------------------------------------------
  let pending = false;
  function scheduleRender() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; render(); });
  }

  function render() {
    renderTiles();
    renderSteps();
    renderRequests();
    renderDetail();
    renderHistogram($("#hist-ttft"), state.histograms?.ttft_ms);
    renderHistogram($("#hist-tpot"), state.histograms?.tpot_ms);
  }

  function start() {
    legend($("#stage-legend"), STAGES.map((s) => [s, colour(s)]));
    legend($("#step-legend"), [["prefill tokens' share", colour("prefill")], ["decodes' share", colour("decode")],
      ["requests in the step", "#9aa1ad"], ["requests waited (a limit held them)", colour("queue")],
      ["preemption", "var(--warn)"], ["carries the selected request", "var(--accent)"]]);
    readKey();
    connect();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
