// lockgate dashboard: plain JS, no dependencies, no build step.
//
// Data: GET /dashboard/events, a text/event-stream of `snapshot` events (one JSON object each, see
// lockgate/dashboard/snapshot.py), read with fetch() so that the admin key can be sent as
// `Authorization: Bearer` (EventSource cannot send headers). The key is typed once into the field in the
// top bar and kept in sessionStorage (this tab only). Cancel buttons call DELETE /admin/requests/{id}.
"use strict";

(() => {
  const KEY_STORAGE = "lockgate.adminKey";
  const WINDOW_S = 300;             // what the plots show
  const RATE_S = 5;                 // the rates in the top row are means over this many seconds
  const KEEP_S = 3600;              // history rows kept in the page (the gateway's ring is the real bound)
  const MAX_EVENT_BYTES = 8 << 20;  // a stream that sends more than this without an event boundary is dropped
  const SVG = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);
  const state = { rows: [], fields: [], backoff: 1000, controller: null, generation: 0, retryTimer: null, snapshots: 0, lastAt: 0 };

  // --- admin key ------------------------------------------------------------------------------------------------
  function adminKey() {
    try { return sessionStorage.getItem(KEY_STORAGE) || ""; } catch (e) { return ""; }
  }
  function authHeaders() {
    const key = adminKey();
    return key ? { Authorization: "Bearer " + key } : {};
  }
  function setupKeyForm() {
    const input = $("adminkey");
    input.placeholder = adminKey() ? "saved for this tab" : "not set";
    $("keyform").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = input.value.trim();
      try { if (value) sessionStorage.setItem(KEY_STORAGE, value); } catch (e) { /* storage disabled */ }
      input.value = "";
      input.placeholder = adminKey() ? "saved for this tab" : "not set";
      reconnect();
    });
    $("keyclear").addEventListener("click", () => {
      try { sessionStorage.removeItem(KEY_STORAGE); } catch (e) { /* storage disabled */ }
      input.placeholder = "not set";
      reconnect();
    });
  }

  // --- the stream -----------------------------------------------------------------------------------------------
  function setConnection(kind, text) {
    const el = $("conn");
    el.className = "pill pill-" + kind;
    el.textContent = text;
    document.body.dataset.state = text.split(" ")[0];
  }

  // One stream at a time: each connect() takes a new generation; an older one that ends does nothing more.
  function reconnect() {
    state.backoff = 1000;
    connect();
  }

  async function connect() {
    const generation = ++state.generation;
    clearTimeout(state.retryTimer);
    if (state.controller) state.controller.abort();
    const controller = new AbortController();
    state.controller = controller;
    const current = () => generation === state.generation;
    setConnection("wait", "connecting");
    let retry = true;
    try {
      const response = await fetch("/dashboard/events", {
        headers: { Accept: "text/event-stream", ...authHeaders() },
        cache: "no-store",
        signal: controller.signal,
      });
      if (response.status === 401 || response.status === 403) {
        retry = false;  // until a key is entered (reconnect)
        setConnection("bad", "admin key required");
        $("adminkey").focus();
        return;
      }
      if (!response.ok || !response.body) {
        let code = "";
        try { code = (await response.json()).error.code; } catch (err) { /* not the gateway's error envelope */ }
        if (code === "too_many_dashboards") {
          // Not the gateway down: every dashboard slot is taken (`dashboard.max_clients`); retried with backoff.
          setConnection("warn", "too many dashboards open");
          return;
        }
        throw new Error("HTTP " + response.status);
      }
      setConnection("ok", "live");
      // Let in without a key typed: the gateway asks none, or the browser sent its login (HTTP Basic).
      if (!adminKey()) $("adminkey").placeholder = "not needed here";
      state.backoff = 1000;
      let revoked = false;
      let stopping = false;
      await readEvents(response.body.getReader(), (name, data) => {
        if (!current()) return;
        if (name === "snapshot") renderSafely(JSON.parse(data));
        else if (name === "end") {
          let reason = "";
          try { reason = JSON.parse(data).reason; } catch (err) { /* an end without a reason */ }
          revoked = reason === "unauthorized";
          stopping = !revoked;
          if (stopping) setConnection("warn", "gateway stopping");
        }
      });
      if (revoked && current()) {
        retry = false;  // the key was revoked (a reload): until a key is entered (reconnect)
        setConnection("bad", "admin key no longer valid");
        $("adminkey").focus();
        return;
      }
      // (A gateway that said it stops is not just "disconnected": an outside run saw the word replaced at once.)
      if (current()) setConnection("warn", stopping ? "gateway stopped" : "disconnected");
    } catch (err) {
      if (current()) setConnection("warn", "reconnecting");
    } finally {
      if (current()) {
        state.controller = null;
        if (retry) {
          const delay = state.backoff;
          state.backoff = Math.min(state.backoff * 2, 10000);
          state.retryTimer = setTimeout(connect, delay);
        }
      }
    }
  }

  // A snapshot the page cannot render is logged and the stream goes on (no reconnect loop over it).
  function renderSafely(snapshot) {
    try {
      render(snapshot);
    } catch (err) {
      console.error("lockgate dashboard: cannot render a snapshot", err);
      setConnection("warn", "render error");
    }
  }

  async function readEvents(reader, onEvent) {
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(name, data.join("\n"));
      }
      if (buffer.length > MAX_EVENT_BYTES) throw new Error("event too large");
    }
  }

  // --- formatting -----------------------------------------------------------------------------------------------
  function fmtSeconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 60) return s.toFixed(s < 10 ? 2 : 1) + " s";
    return (s / 60).toFixed(1) + " min";
  }
  function fmtNum(n, digits) {
    if (n === null || n === undefined) return "–";
    if (digits !== undefined) return n.toFixed(digits);
    return Math.round(n).toLocaleString("en-US");
  }
  function fmtPct(x) {
    if (x === null || x === undefined) return "–";
    if (x > 0 && x < 0.001) return "<0.1%";
    return (x * 100).toFixed(x >= 0.995 || x === 0 ? 0 : 1) + "%";
  }
  function fmtAge(s) {
    if (s === null || s === undefined) return "–";
    return s < 1 ? Math.round(s * 1000) + " ms" : s < 120 ? s.toFixed(1) + " s" : Math.round(s / 60) + " min";
  }
  function fmtUptime(s) {
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
    return h ? `${h}h ${m}m` : m ? `${m}m ${sec}s` : `${sec}s`;
  }
  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function badge(kind, text) { return el("span", "badge badge-" + kind, text || kind); }
  function bar(fraction, label) {
    const wrap = el("span");
    const b = el("span", "bar" + (fraction >= 0.9 ? " bad" : fraction >= 0.75 ? " warn" : ""));
    const fill = el("span");
    fill.style.width = Math.max(0, Math.min(1, fraction || 0)) * 100 + "%";
    b.appendChild(fill);
    wrap.append(b, el("span", "bar-label", label));
    return wrap;
  }
  function setText(id, text) { const node = $(id); if (node.textContent !== text) node.textContent = text; }

  // Keyed rows: existing rows are updated in place (a button being clicked is never replaced).
  function syncRows(tbody, items, key, build) {
    const existing = new Map();
    for (const tr of Array.from(tbody.children)) existing.set(tr.dataset.key, tr);
    let previous = null;
    for (const item of items) {
      const k = String(key(item));
      let tr = existing.get(k);
      if (tr) existing.delete(k);
      else { tr = document.createElement("tr"); tr.dataset.key = k; }
      build(tr, item);
      const want = previous ? previous.nextSibling : tbody.firstChild;
      if (want !== tr) tbody.insertBefore(tr, want);
      previous = tr;
    }
    for (const tr of existing.values()) tr.remove();
  }
  function cells(tr, count) {
    while (tr.children.length < count) tr.appendChild(document.createElement("td"));
    return Array.from(tr.children);
  }
  function fill(td, content, cls) {
    if (cls !== undefined) td.className = cls;
    if (typeof content === "string") { if (td.textContent !== content || td.children.length) td.textContent = content; }
    else td.replaceChildren(content);
  }

  // --- rendering --------------------------------------------------------------------------------------------------
  function render(snap) {
    state.snapshots += 1;
    state.lastAt = snap.at;
    document.body.dataset.snapshots = String(state.snapshots);
    mergeHistory(snap.history);
    $("draining").hidden = !snap.draining;
    setText("updated", "up " + fmtUptime(snap.uptime_s) + " · " + new Date(snap.at * 1000).toLocaleTimeString());
    renderKpis(snap);
    renderCharts();
    renderFleet(snap.instances);
    renderQueues(snap.pools);
    renderRequests(snap.requests);
    renderCounters("dedup", dedupCounters(snap.dedup));
    renderCounters("cancellations", cancellationCounters(snap.cancellations));
    renderSlo(snap.slo, snap.slo_error);
  }

  function mergeHistory(history) {
    state.fields = history.fields;
    if (history.full) state.rows = history.rows.slice();
    else {
      const last = state.rows.length ? state.rows[state.rows.length - 1][0] : -Infinity;
      for (const row of history.rows) if (row[0] > last) state.rows.push(row);
    }
    const horizon = (state.rows.length ? state.rows[state.rows.length - 1][0] : 0) - KEEP_S;
    while (state.rows.length && state.rows[0][0] < horizon) state.rows.shift();
  }
  function column(name) { return state.fields.indexOf(name); }
  function latest(name) {
    const i = column(name);
    for (let r = state.rows.length - 1; r >= Math.max(0, state.rows.length - 5); r--) {
      if (state.rows[r][i] !== null) return state.rows[r][i];
    }
    return null;
  }
  // The mean of a rate over the newest `seconds` of samples (a steadier figure than one sample).
  function windowMean(name, seconds) {
    const i = column(name), since = state.lastAt - seconds;
    let sum = 0, n = 0;
    for (let r = state.rows.length - 1; r >= 0 && state.rows[r][0] > since; r--) { sum += state.rows[r][i]; n++; }
    return n ? sum / n : 0;
  }
  function windowMax(name, seconds) {
    const i = column(name), since = state.lastAt - seconds;
    let best = null;
    for (const row of state.rows) if (row[0] >= since && row[i] !== null) best = best === null ? row[i] : Math.max(best, row[i]);
    return best;
  }

  function renderKpis(snap) {
    const total = snap.requests.total;
    setText("kpi-inflight", fmtNum(total));
    const queued = snap.pools.reduce((n, p) => n + p.queued, 0);
    setText("kpi-inflight-note", queued ? queued + " queued" : "none queued");
    const last = state.rows.length ? state.rows[state.rows.length - 1] : null;
    setText("kpi-rps", last ? fmtNum(windowMean("rps", RATE_S), 1) : "–");
    const finished = Object.values(snap.finished).reduce((a, b) => a + b, 0);
    setText("kpi-finished", fmtNum(finished) + " finished");
    setText("kpi-errors", last ? fmtNum(windowMean("errors_ps", RATE_S), 2) : "–");
    // Every refusal (a limit, a bad request, a missing key: status "rejected"), not only the queues' (their panel).
    setText("kpi-rejected", last ? fmtNum(windowMean("rejected_ps", RATE_S), 2) + " refused/s" : "");
    // The worst second of the last few, not the newest one alone (it swung 5 ms-990 ms under steady load, and read
    // "–" whenever that second finished nothing).
    setText("kpi-lat", fmtSeconds(windowMax("latency_p99", RATE_S)));
    setText("kpi-lat-note", "p50 " + fmtSeconds(latest("latency_p50")) + " · peak " + fmtSeconds(windowMax("latency_p99", WINDOW_S)));
    setText("kpi-ttft", fmtSeconds(windowMax("ttft_p99", RATE_S)));
    setText("kpi-ttft-note", "p50 " + fmtSeconds(latest("ttft_p50")) + " · peak " + fmtSeconds(windowMax("ttft_p99", WINDOW_S)));
    setText("kpi-dedup", fmtPct(snap.dedup.hit_ratio));
    setText("kpi-dedup-note", fmtNum(snap.dedup.flights_in_flight) + " shared calls in flight");
  }

  function renderCharts() {
    lineChart($("chart-latency"), [
      { name: "latency_p50", label: "p50", color: "var(--p50)" },
      { name: "latency_p95", label: "p95", color: "var(--p95)" },
      { name: "latency_p99", label: "p99", color: "var(--p99)" },
    ], fmtSeconds);
    lineChart($("chart-ttft"), [
      { name: "ttft_p50", label: "p50", color: "var(--p50)" },
      { name: "ttft_p95", label: "p95", color: "var(--p95)" },
      { name: "ttft_p99", label: "p99", color: "var(--p99)" },
    ], fmtSeconds);
    lineChart($("chart-rate"), [
      { name: "rps", label: "finished", color: "var(--accent)", area: true },
      { name: "errors_ps", label: "errors", color: "var(--bad)" },
      { name: "rejected_ps", label: "refused (4xx)", color: "var(--warn)" },
    ], (v) => (v === 0 ? "0" : fmtNum(v, v < 10 ? 1 : 0)), true);
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // A "nice" step (1, 2 or 5 times a power of ten) so that four steps cover v.
  function niceStep(v) {
    const raw = v > 0 ? v / 4 : 0.25;
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 5, 10]) if (raw <= m * p) return m * p;
    return 10 * p;
  }

  function lineChart(container, series, fmt, zeroForMissing) {
    const width = Math.max(container.clientWidth, 200), height = Math.max(container.clientHeight, 120);
    const left = 54, right = 10, top = 22, bottom = 20;
    const w = width - left - right, h = height - top - bottom;
    const end = state.lastAt || Date.now() / 1000, start = end - WINDOW_S;
    const rows = state.rows.filter((r) => r[0] >= start);
    let max = 0;
    for (const s of series) {
      const i = column(s.name);
      for (const r of rows) if (r[i] !== null && r[i] > max) max = r[i];
    }
    const step = niceStep(max), ticks = Math.max(1, Math.ceil(max / step - 1e-9)), top_ = step * ticks;
    const x = (t) => left + ((t - start) / WINDOW_S) * w;
    const y = (v) => top + h - (v / top_) * h;
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img" });
    for (let k = 0; k <= ticks; k++) {
      const v = step * k, yy = y(v);
      root.appendChild(svg("line", { class: "grid", x1: left, x2: width - right, y1: yy, y2: yy }));
      root.appendChild(svg("text", { class: "axis", x: left - 6, y: yy + 3.5, "text-anchor": "end" }, fmt(v)));
    }
    for (const mark of [300, 240, 180, 120, 60, 0]) {
      const t = end - mark;
      root.appendChild(svg("text", { class: "axis", x: x(t), y: height - 4, "text-anchor": mark === 0 ? "end" : mark === 300 ? "start" : "middle" },
        mark === 0 ? "now" : "-" + mark / 60 + "m"));
    }
    let drawn = false;
    series.forEach((s, index) => {
      const i = column(s.name);
      let d = "", run = [], first = null, lastX = null;
      const dots = [];
      const endRun = () => { if (run.length === 1) dots.push(run[0]); run = []; };
      for (const r of rows) {
        let v = r[i];
        if (v === null && zeroForMissing) v = 0;
        if (v === null) { endRun(); continue; }
        const px = x(r[0]).toFixed(1), py = y(v).toFixed(1);
        d += (run.length ? "L" : "M") + px + " " + py;
        run.push([px, py]);
        if (first === null) first = px;
        lastX = px;
        drawn = true;
      }
      endRun();
      // A value with no neighbour (one busy second between idle ones) is a dot, not an invisible segment.
      for (const [px, py] of dots) root.appendChild(svg("circle", { cx: px, cy: py, r: 2.2, fill: s.color }));
      if (s.area && d && first !== null) {
        root.appendChild(svg("path", { class: "area", d: d + `L${lastX} ${top + h}L${first} ${top + h}Z`, fill: s.color, "fill-opacity": "0.12" }));
      }
      if (d) root.appendChild(svg("path", { class: "line", d, stroke: s.color }));
      const lx = left + 4 + index * 70;
      root.appendChild(svg("rect", { x: lx, y: 2, width: 10, height: 3, rx: 1.5, fill: s.color }));
      root.appendChild(svg("text", { class: "legend", x: lx + 14, y: 7 }, s.label));
    });
    if (!drawn) root.appendChild(svg("text", { class: "nodata", x: left + w / 2, y: top + h / 2, "text-anchor": "middle" }, "no requests yet"));
    container.replaceChildren(root);
  }

  function renderFleet(instances) {
    const healthy = instances.filter((i) => i.status === "healthy").length;
    setText("fleet-note", `${healthy} of ${instances.length} healthy`);
    syncRows($("fleet-body"), instances, (i) => i.name, (tr, i) => {
      tr.dataset.testid = "instance";
      tr.dataset.name = i.name;
      tr.dataset.status = i.status;
      tr.dataset.inFlight = String(i.in_flight);
      const c = cells(tr, 10);
      const name = el("div");
      name.append(el("div", "mono", i.name), el("div", "sub", i.engine + (i.url !== i.name ? " · " + i.url : "")));
      fill(c[0], name);
      fill(c[1], badge(i.status));
      fill(c[2], i.models.join(", "));
      fill(c[3], `${i.in_flight} / ${i.max_concurrency}`, "num");
      fill(c[4], fmtNum(i.waiting), "num");
      fill(c[5], fmtNum(i.running), "num");
      fill(c[6], i.kv_usage === null ? "–" : bar(i.kv_usage, fmtPct(i.kv_usage)));
      const hits = i.prefix_queries ? `${fmtPct(i.prefix_hit_rate)}` : "–";
      fill(c[7], hits, "num");
      c[7].title = i.prefix_queries ? `${fmtNum(i.prefix_hits)} of ${fmtNum(i.prefix_queries)} prompt tokens` : "";
      fill(c[8], i.ejected ? `ejected · back in ${fmtAge(i.returns_in_s)}` : i.last_error && !i.healthy ? i.last_error : "–");
      fill(c[9], i.stale ? "stale · " + fmtAge(i.metric_age_s) : fmtAge(i.metric_age_s), "num");
    });
  }

  function renderQueues(pools) {
    const root = $("queues");
    root.replaceChildren();
    if (!pools.length) { root.appendChild(el("div", "empty", "No model pools.")); return; }
    for (const pool of pools) {
      const box = el("div", "pool");
      const head = el("div", "pool-head");
      head.append(el("span", "pool-name", pool.model), el("span", "muted", `${pool.running} running of ${pool.capacity} slots · ${pool.queued} queued · ${pool.policy || ""}`));
      const classes = el("div", "classes");
      for (const k of pool.classes) {
        const box2 = el("div", "class");
        box2.dataset.testid = "class";
        const nums = el("div", "class-nums");
        for (const [label, value] of [["queued", k.queued], ["running", k.running], ["rejected", k.rejected]]) {
          const span = el("span");
          span.append(el("b", "", fmtNum(value)), label);
          nums.appendChild(span);
        }
        box2.append(el("div", "class-name", k.name), nums);
        classes.appendChild(box2);
      }
      box.append(head, classes);
      root.appendChild(box);
    }
  }

  function renderRequests(requests) {
    const shown = requests.shown;
    setText("requests-note", requests.total > shown.length ? `${shown.length} longest-running of ${requests.total}` : `${requests.total}`);
    $("requests-empty").hidden = shown.length > 0;
    syncRows($("requests-body"), shown, (r) => r.id, (tr, r) => {
      tr.dataset.testid = "request";
      tr.dataset.id = r.id;
      const c = cells(tr, 9);
      // The client's own x-request-id (how a client names its request to an operator) under the gateway's id.
      const ids = el("span");
      ids.append(el("span", null, r.id));
      if (r.client_request_id && r.client_request_id !== r.id) ids.append(el("span", "muted client-id", r.client_request_id));
      fill(c[0], ids, "mono");
      fill(c[1], r.model);
      fill(c[2], r.tenant);
      fill(c[3], r.priority || "–");
      fill(c[4], badge(r.phase));
      fill(c[5], r.instance || "–", "mono");
      fill(c[6], fmtAge(r.age_ms / 1000), "num");
      fill(c[7], fmtNum(r.completion_tokens), "num");
      if (!c[8].firstChild) {
        const button = el("button", "btn btn-danger", "Cancel");
        button.type = "button";
        button.dataset.testid = "cancel";
        button.addEventListener("click", () => cancelRequest(r.id, button));
        c[8].appendChild(button);
      }
    });
  }

  async function cancelRequest(id, button) {
    button.disabled = true;
    button.textContent = "Cancelling…";
    try {
      const response = await fetch("/admin/requests/" + encodeURIComponent(id), { method: "DELETE", headers: authHeaders() });
      let message = "";
      try { message = (await response.json()).error?.message || ""; } catch (e) { /* not JSON */ }
      if (response.ok) toast(`Cancelled ${id}`);
      else if (response.status === 401 || response.status === 403) toast("Cancelling needs an admin key.", true);
      else toast(message || `Cancel failed (HTTP ${response.status})`, true);
      if (!response.ok) { button.disabled = false; button.textContent = "Cancel"; }
    } catch (err) {
      toast("Cancel failed: " + err, true);
      button.disabled = false;
      button.textContent = "Cancel";
    }
  }

  let toastTimer = null;
  function toast(text, bad) {
    const node = $("toast");
    node.textContent = text;
    node.className = "toast" + (bad ? " bad" : "");
    node.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { node.hidden = true; }, 4000);
  }

  function dedupCounters(d) {
    const o = d.outcomes;
    return [
      ["Led (miss)", fmtNum(o.miss || 0)],
      ["Coalesced", fmtNum(o.coalesced || 0)],
      ["Cache hits", fmtNum((o.hit || 0) + (o.semantic || 0))],
      ["Bypassed", fmtNum(o.bypass || 0)],
      ["Hit ratio", fmtPct(d.hit_ratio)],
      ["Shared calls now", fmtNum(d.flights_in_flight)],
      ["Cached results", fmtNum(d.cache.entries || 0)],
      ["Tokens saved", fmtNum((d.tokens_saved.prompt || 0) + (d.tokens_saved.completion || 0))],
    ];
  }
  function cancellationCounters(c) {
    const reasons = ["client_disconnect", "timeout", "admin", "preempted", "shutdown"];
    for (const k of Object.keys(c)) if (!reasons.includes(k)) reasons.push(k);
    return reasons.map((r) => [r.replace("_", " "), fmtNum(c[r] || 0), r]);
  }
  function renderCounters(id, items) {
    const root = $(id);
    const parts = [];
    for (const [label, value, key] of items) {
      const box = el("div");
      if (key) box.dataset.key = key;
      box.append(el("dt", "", label), el("dd", "", value));
      parts.push(box);
    }
    root.replaceChildren(...parts);
  }

  function renderSlo(slo, error) {
    const root = $("slo");
    if (error) { root.replaceChildren(el("div", "empty", "SLO evaluation failed: " + error)); return; }
    if (!slo || !slo.objectives || !slo.objectives.length) { root.replaceChildren(el("div", "empty", "No SLOs evaluated.")); return; }
    const parts = [];
    for (const o of slo.objectives) {
      const row = el("div", "slo-row");
      row.dataset.testid = "objective";
      const name = el("div");
      name.append(el("div", "slo-name", o.name), el("div", "slo-objective", `${o.objective ?? ""}${o.target !== undefined ? " · target " + o.target : ""}`));
      const status = ["met", "burning", "unknown"].includes(o.status) ? o.status : "unknown";
      const budget = o.budget_remaining;
      row.append(name, badge(status), budget === null || budget === undefined ? el("span", "muted", "budget –") : budgetBar(budget));
      parts.push(row);
    }
    root.replaceChildren(...parts);
  }

  // The error budget left: the bar shows what remains, amber under half, red under a fifth.
  function budgetBar(budget) {
    const left = Math.max(0, Math.min(1, budget));
    const wrap = el("span");
    const b = el("span", "bar budget" + (left < 0.2 ? " bad" : left < 0.5 ? " warn" : ""));
    const fillSpan = el("span");
    fillSpan.style.width = left * 100 + "%";
    b.appendChild(fillSpan);
    wrap.append(b, el("span", "bar-label", fmtPct(left) + " left"));
    return wrap;
  }

  document.addEventListener("DOMContentLoaded", () => {
    setupKeyForm();
    connect();
    window.addEventListener("resize", () => { if (state.rows.length) renderCharts(); });
  });
})();
