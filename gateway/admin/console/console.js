// The operator's console. It polls the admin API once a second, keeps the last five minutes
// in this page's memory for the charts, and changes the gateway only through the admin API,
// so every change is validated (and logged) by the gateway as a curl call would be. The token
// lives in one variable of this module: never in a URL, a cookie or web storage.
//
// Each change the operator makes carries an Idempotency-Key of its own, sent again when the
// same action is sent again (no answer came, or "Try again" after a refusal), so the gateway
// applies it once at most. A change answered 202 (in the fleet's log but not applied here yet,
// or taken by Redis without an answer) is said as such and followed by its id
// (GET /admin/changes/{id}) until its fate is known. A fleet view answered from the last state
// known ("stale": Redis does not answer) says so beside it.

const POLL_MS = 1000;
const HISTORY_S = 300; // what the charts show
const WINDOW_S = 5; // rates and percentiles are over the last five seconds
const CHANGES_SHOWN = 10; // the audit trail's newest entries
const RESENDS = 2; // a change sent again (the same key) when no answer came at all
const RESEND_MS = 1000;
const FOLLOW_MS = 1000; // how often a change of unknown fate is asked after
const FOLLOW_FOR_MS = 10 * 60 * 1000; // then the page stops asking, and says how to
const PALETTE = [
  "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
  "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
];

let token = null;
let timer = null;
let polling = false; // one poll at a time
let history = []; // [{at, stats, derived, inFlight, canary}]
let latest = { policy: null, aliases: null, backends: null, replicas: null, changes: null, keys: null, rollouts: null, capacity: null };
let policyFormDoc = null; // the policy document the form was last built from
let rolloutShape = ""; // aliases and pools the rollout section was built for
let startShape = ""; // aliases and pools the form starting a rollout was built for
const colors = new Map();

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function colorOf(id) {
  if (!colors.has(id)) colors.set(id, PALETTE[colors.size % PALETTE.length]);
  return colors.get(id);
}

// ---- formatting ---------------------------------------------------------------------------

function fmtSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  return `${s.toFixed(2)} s`;
}

function fmtRate(r) {
  if (r === null || r === undefined || !Number.isFinite(r)) return "–";
  return r >= 100 ? r.toFixed(0) : r >= 10 ? r.toFixed(1) : r.toFixed(2);
}

function fmtNumber(n, digits = 2) {
  if (n === null || n === undefined) return "–";
  if (typeof n !== "number") return String(n);
  return Number.isInteger(n) ? String(n) : n.toFixed(digits);
}

function fmtPct(x) {
  return x === null || x === undefined ? "–" : `${(x * 100).toFixed(0)} %`;
}

function fmtValue(v) {
  if (v === null || v === undefined) return "none";
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

// ---- the admin API ------------------------------------------------------------------------

class ApiError extends Error {}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function request(method, path, body, extra = {}) {
  // One call: {status, doc, headers}; the admin API's refusal of the token signs out. A call
  // that got no answer at all (the connection failed) throws a TypeError, as fetch does.
  const headers = { Authorization: `Bearer ${token}`, ...extra };
  const init = { method, headers, cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  let doc = null;
  try {
    doc = await response.json();
  } catch {
    doc = null;
  }
  if (response.status === 401) {
    signOut("The admin API refused the token.");
    throw new ApiError("The admin API refused the token.");
  }
  return { status: response.status, doc, headers: response.headers };
}

async function api(method, path, body) {
  const { status, doc } = await request(method, path, body);
  if (status < 200 || status > 299) {
    throw new ApiError(doc?.error?.message ?? `${method} ${path}: HTTP ${status}`);
  }
  return doc;
}

function newChangeId() {
  // An Idempotency-Key (letters, digits and '_'); getRandomValues works over plain HTTP too.
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return `console_${[...bytes].map((b) => b.toString(16).padStart(2, "0")).join("")}`;
}

// ---- signing in and out -------------------------------------------------------------------

async function signIn(event) {
  event.preventDefault();
  const input = $("token");
  const given = input.value;
  input.value = "";
  if (!given) return;
  token = given;
  $("login-error").hidden = true;
  try {
    latest.policy = await api("GET", "/admin/policy");
  } catch (err) {
    if (token !== null) signOut(err instanceof ApiError ? err.message : `No answer: ${err}`);
    return;
  }
  $("login").hidden = true;
  $("console").hidden = false;
  $("sign-out").hidden = false;
  buildPolicyForm(latest.policy);
  poll();
}

function signOut(message) {
  token = null;
  clearTimeout(timer);
  timer = null;
  history = [];
  latest = { policy: null, aliases: null, backends: null };
  policyFormDoc = null;
  rolloutShape = "";
  startShape = "";
  $("rollouts").replaceChildren();
  $("capacity-card").hidden = true;
  $("engines").tBodies[0].replaceChildren();
  $("capacity-models").tBodies[0].replaceChildren();
  $("console").hidden = true;
  $("sign-out").hidden = true;
  $("policy-name").hidden = true;
  $("login").hidden = false;
  $("backends").tBodies[0].replaceChildren();
  setStatus("signed out", "");
  const error = $("login-error");
  error.textContent = message ?? "";
  error.hidden = !message;
  $("token").focus();
}

function setStatus(text, kind) {
  const status = $("status");
  status.textContent = text;
  status.className = `status ${kind}`;
}

function showBanner(text, kind = "error", again = null) {
  // ``again``: the change to send once more (its key unchanged), offered as a button.
  const banner = $("banner");
  banner.replaceChildren(text);
  if (again) banner.append(el("button", { type: "button", class: "again quiet", onclick: () => sendChange(again) }, "Try again"));
  banner.className = `banner ${kind}`;
  banner.hidden = false;
}

// ---- polling and what is derived from it --------------------------------------------------

async function poll() {
  if (token === null || polling) return;
  polling = true;
  clearTimeout(timer);
  try {
    const [backends, stats, policy, aliases, replicas, changes, keys, rollouts, capacity] = await Promise.all([
      api("GET", "/admin/backends"),
      api("GET", "/admin/stats"),
      api("GET", "/admin/policy"),
      api("GET", "/admin/aliases"),
      api("GET", "/admin/replicas"),
      api("GET", `/admin/changes?limit=${CHANGES_SHOWN}`),
      api("GET", "/admin/keys"),
      api("GET", "/admin/rollouts"),
      api("GET", "/admin/capacity"),
    ]);
    if (token === null) return;
    latest = { policy, aliases, backends, replicas, changes, keys, rollouts, capacity };
    record(backends, stats, replicas);
    render();
    const at = `live · ${new Date(stats.at * 1000).toLocaleTimeString()}`;
    if ([replicas, changes, keys, rollouts].some((doc) => doc.stale)) {
      setStatus(`${at} · Redis does not answer: the fleet's views as last known`, "warn");
    } else {
      setStatus(at, "ok");
    }
  } catch (err) {
    if (token !== null) setStatus(`no answer: ${err.message ?? err}`, "bad");
  } finally {
    polling = false;
    if (token !== null) timer = setTimeout(poll, POLL_MS);
  }
}

function windowBase(at) {
  // The oldest sample at most WINDOW_S before ``at`` (a little slack for a late poll).
  let base = null;
  for (let i = history.length - 1; i >= 0; i--) {
    if (at - history[i].at > WINDOW_S + 0.5) break;
    base = history[i];
  }
  return base;
}

const sum = (numbers) => numbers.reduce((a, b) => a + b, 0);

function sumValues(obj, keep = () => true) {
  let total = 0;
  for (const [k, v] of Object.entries(obj ?? {})) if (keep(k)) total += v;
  return total;
}

const isError = (status) => Number(status) >= 500;

function bucketQuantile(now, then, q) {
  // Prometheus-style quantile of the observations between two cumulative bucket lists.
  if (!now || now.length === 0) return null;
  const before = new Map((then ?? []).map(([le, n]) => [le, n]));
  const buckets = now.map(([le, n]) => [le === null ? Infinity : le, n - (before.get(le) ?? 0)]);
  const total = buckets[buckets.length - 1][1];
  if (total <= 0) return null;
  const rank = q * total;
  let prevLe = 0;
  let prevCount = 0;
  for (const [le, count] of buckets) {
    if (count >= rank) {
      if (le === Infinity) return prevLe;
      const span = count - prevCount;
      return prevLe + (le - prevLe) * (span <= 0 ? 0 : (rank - prevCount) / span);
    }
    prevLe = le;
    prevCount = count;
  }
  return prevLe;
}

function sumBuckets(lists) {
  const total = new Map();
  for (const list of lists) for (const [le, n] of list ?? []) total.set(le, (total.get(le) ?? 0) + n);
  return [...total.entries()].sort((a, b) => (a[0] ?? Infinity) - (b[0] ?? Infinity));
}

function derive(stats, base) {
  const dt = base ? stats.at - base.stats.at : 0;
  const rate = (now, then) => (dt > 0 ? Math.max(0, now - (then ?? 0)) / dt : null);
  const per = {};
  const ids = new Set([...Object.keys(stats.backends), ...latestIds()]);
  for (const id of ids) {
    const now = stats.backends[id] ?? { requests: {} };
    const then = base?.stats.backends[id] ?? { requests: {} };
    per[id] = {
      rps: rate(sumValues(now.requests), sumValues(then.requests)),
      errors: rate(sumValues(now.requests, isError), sumValues(then.requests, isError)),
      ttft50: dt > 0 ? bucketQuantile(now.ttft, then.ttft, 0.5) : null,
      ttft99: dt > 0 ? bucketQuantile(now.ttft, then.ttft, 0.99) : null,
      itl50: dt > 0 ? bucketQuantile(now.itl, then.itl, 0.5) : null,
    };
  }
  const all = Object.values(stats.backends);
  const allThen = Object.values(base?.stats.backends ?? {});
  const requests = (list, keep) => sum(list.map((b) => sumValues(b.requests, keep)));
  const rejected = (s) => sum(s.rate_limit_rejections.map((r) => r.count));
  return {
    dt,
    backends: per,
    fleet: {
      rps: rate(requests(all), requests(allThen)),
      errors: rate(requests(all, isError), requests(allThen, isError)),
      ttft99: dt > 0 ? bucketQuantile(sumBuckets(all.map((b) => b.ttft)), sumBuckets(allThen.map((b) => b.ttft)), 0.99) : null,
      rejections: base ? rate(rejected(stats), rejected(base.stats)) : null,
    },
    rate,
  };
}

function latestIds() {
  return (latest.backends?.backends ?? []).map((b) => b.id);
}

function record(backends, stats, replicas) {
  const base = windowBase(stats.at);
  const derived = derive(stats, base);
  const inFlight = Object.fromEntries(backends.backends.map((b) => [b.id, b.in_flight]));
  // The canary split as the fleet served it (requests per alias per pool, summed over the
  // replicas' reports); null when this gateway acts alone: its own counters are the whole.
  const canary = replicas.fleet === null ? null : replicas.summary?.figures?.canary ?? {};
  history.push({ at: stats.at, stats, derived, inFlight, canary });
  while (history.length > 1 && stats.at - history[0].at > HISTORY_S) history.shift();
}

// ---- rendering ----------------------------------------------------------------------------

function render() {
  const last = history[history.length - 1];
  const policy = latest.policy;
  const name = $("policy-name");
  name.textContent = `policy: ${policy.policy}`;
  name.hidden = false;
  renderTiles(last);
  renderCharts();
  renderBackends(last);
  renderCapacity();
  refreshPolicyForm(policy);
  renderRollout(last);
  renderRollouts();
  renderRejections(last);
  renderDecisions(last);
  renderRetryBudget(last);
  renderFleet();
  renderKeys();
  markStale("replicas-stale", latest.replicas, $("replicas"), $("fleet-figures"));
  markStale("changes-stale", latest.changes, $("changes"));
  markStale("keys-stale", latest.keys, $("keys"));
  markStale("rollouts-stale", latest.rollouts, $("rollouts"));
}

function fmtAge(s) {
  return s < 1 ? "less than a second" : fmtDuration(s);
}

function staleText(stale) {
  // A view answered from the last state known: how old it is, and why.
  const why = stale.why ? ` (${stale.why})` : "";
  if (stale.age_s === null || stale.age_s === undefined) {
    return `Redis does not answer${why}: nothing read from it since this replica started; shown as this replica alone knows it.`;
  }
  return `Redis does not answer${why}: shown as of ${fmtAge(stale.age_s)} ago.`;
}

function markStale(id, doc, ...shown) {
  // Said above the view, and what it shows dimmed, while it is not live.
  const mark = $(id);
  const stale = doc?.stale ?? null;
  mark.hidden = stale === null;
  const text = stale === null ? "" : staleText(stale);
  if (mark.textContent !== text) mark.textContent = text;
  for (const node of shown) node.classList.toggle("stale", stale !== null);
}

function renderTiles(last) {
  const d = last.derived;
  const backends = latest.backends.backends;
  const up = backends.filter((b) => b.health === "up" && !b.draining && b.circuit !== "open" && restOf(b.id) === "awake").length;
  const admission = last.stats.admission;
  const budget = last.stats.retry_budget;
  const tiles = [
    ["Requests/s", fmtRate(d.fleet.rps)],
    ["Errors/s (5xx)", fmtRate(d.fleet.errors)],
    ["TTFT p99", fmtSeconds(d.fleet.ttft99)],
    ["Routable backends", `${up} / ${backends.length}`],
    ["Queue depth (fleet)", fmtNumber(last.stats.queue_depth, 0)],
    ["Admission queue", `${fmtNumber(admission.waiting, 0)} waiting · ${fmtNumber(admission.holding, 0)} admitted · ${fmtNumber(admission.outcomes.shed ?? 0, 0)} shed`],
    ["Rate-limited/s", fmtRate(d.fleet.rejections)],
  ];
  if (budget) tiles.push(["Retry budget used", `${fmtPct(budget.use)}${budget.degraded ? " · alone (Redis out)" : ""}`]);
  $("tiles").replaceChildren(
    ...tiles.map(([label, value]) => el("div", { class: "tile card" }, el("span", { class: "label" }, label), el("span", { class: "value" }, value))),
  );
}

function chart(id, legendId, series, format) {
  // series: [{name, color, points: [[at, value|null]]}] over the last HISTORY_S.
  const node = $(id);
  const W = 400;
  const H = 110;
  const PAD = 4;
  node.setAttribute("viewBox", `0 0 ${W} ${H}`);
  node.setAttribute("preserveAspectRatio", "none");
  const now = history.length ? history[history.length - 1].at : 0;
  let max = 0;
  for (const s of series) for (const [, v] of s.points) if (v !== null && v > max) max = v;
  const top = max > 0 ? max * 1.1 : 1;
  const x = (at) => W - ((now - at) / HISTORY_S) * W;
  const y = (v) => H - PAD - (v / top) * (H - 2 * PAD);
  const children = [svg("line", { x1: 0, y1: H - PAD, x2: W, y2: H - PAD, class: "axis" })];
  for (const s of series) {
    const pts = s.points.filter(([, v]) => v !== null).map(([at, v]) => `${x(at).toFixed(1)},${y(v).toFixed(1)}`);
    if (pts.length) {
      children.push(svg("polyline", { points: pts.join(" "), stroke: s.color, fill: "none", "stroke-width": 1.5, "vector-effect": "non-scaling-stroke" }));
    }
  }
  node.replaceChildren(...children);
  const legend = $(legendId);
  legend.replaceChildren(
    el("span", { class: "scale" }, `max ${format(max)} · last ${HISTORY_S / 60} min`),
    ...series.map((s) => {
      const swatch = el("i");
      swatch.style.background = s.color;
      return el("span", {}, swatch, s.name);
    }),
  );
}

function renderCharts() {
  const ids = latestIds();
  const perBackend = (pick) =>
    ids.map((id) => ({ name: id, color: colorOf(id), points: history.map((h) => [h.at, pick(h, id)]) }));
  chart("chart-rps", "legend-rps", perBackend((h, id) => h.derived.backends[id]?.rps ?? null), fmtRate);
  chart("chart-ttft", "legend-ttft", perBackend((h, id) => h.derived.backends[id]?.ttft99 ?? null), fmtSeconds);
  chart("chart-inflight", "legend-inflight", perBackend((h, id) => h.inFlight[id] ?? null), (v) => fmtNumber(v, 0));
  chart("chart-queue", "legend-queue", [
    { name: "engines + admission", color: PALETTE[0], points: history.map((h) => [h.at, h.stats.queue_depth]) },
    { name: "admission", color: PALETTE[1], points: history.map((h) => [h.at, h.stats.admission.waiting]) },
  ], (v) => fmtNumber(v, 0));
}

function stateClass(value) {
  if (value === "up" || value === "closed") return "ok";
  if (value === "down" || value === "open") return "bad";
  return "warn";
}

function upsertRow(tbody, key, cells) {
  // Rows are kept by key and updated in place, so a button is never replaced under a click.
  let row = [...tbody.rows].find((r) => r.dataset.key === key);
  if (!row) {
    row = el("tr", { dataset: { key } });
    tbody.append(row);
  }
  cells.forEach((cell, i) => {
    let td = row.cells[i];
    if (!td) td = row.insertCell();
    if (cell instanceof Node) {
      if (td.firstChild?.dataset?.sig !== cell.dataset.sig) td.replaceChildren(cell);
    } else {
      const { text, cls } = typeof cell === "object" && cell !== null ? cell : { text: cell, cls: "" };
      if (td.textContent !== String(text)) td.textContent = String(text);
      td.className = cls ?? "";
    }
  });
  return row;
}

function prune(tbody, keys) {
  for (const row of [...tbody.rows]) if (!keys.has(row.dataset.key)) row.remove();
}

function renderBackends(last) {
  const tbody = $("backends").tBodies[0];
  const keys = new Set();
  for (const b of latest.backends.backends) {
    keys.add(b.id);
    const d = last.derived.backends[b.id] ?? {};
    const drainButton = el(
      "button",
      { type: "button", class: b.draining ? "undrain" : "drain", dataset: { sig: `${b.draining}` }, onclick: () => drainBackend(b.id, !b.draining) },
      b.draining ? "Undrain" : "Drain",
    );
    const rest = restOf(b.id); // an engine not awake (capacity) says so beside its name
    const resting = rest === "awake" ? null : el("span", { class: `pill rest ${rest}` }, REST[rest] ?? rest);
    const name = el("span", { dataset: { sig: `${b.id}|${b.url}|${b.draining}|${rest}` }, title: b.url }, el("i", { class: "swatch" }), b.id, b.draining ? el("span", { class: "pill warn" }, "draining") : null, resting);
    name.firstChild.style.background = colorOf(b.id);
    const row = upsertRow(tbody, b.id, [
      name,
      { text: b.health, cls: stateClass(b.health) },
      { text: b.circuit, cls: stateClass(b.circuit) },
      fmtNumber(b.in_flight, 0),
      fmtNumber(b.queue_depth, 0),
      fmtNumber(b.running, 0),
      fmtPct(b.kv_cache_usage),
      fmtNumber(b.score, 2),
      fmtRate(d.rps),
      fmtRate(d.errors),
      fmtSeconds(d.ttft50),
      fmtSeconds(d.ttft99),
      fmtSeconds(d.itl50),
      fmtSeconds(b.latency?.predicted_ttft_s),
      fmtSeconds(b.latency?.predicted_itl_s),
      drainButton,
    ]);
    row.dataset.backend = b.id;
    row.classList.toggle("draining", b.draining);
  }
  prune(tbody, keys);
}

// ---- capacity: engines asleep and awake --------------------------------------------------
// Each engine's state as this replica sees it (GET /admin/capacity), and the capacity
// manager's last turn: this replica's own when it manages, else the managing replica's, as
// its report in GET /admin/replicas carries it.

// An engine's state, as the page says it (the class of its pill is the state's own name)
const REST = { awake: "awake", going_to_sleep: "going to sleep", asleep: "asleep", waking: "waking" };

function restOf(id) {
  return latest.capacity?.engines.find((e) => e.backend === id)?.state ?? "awake";
}

function capacityShown(cap) {
  // On, or an engine not awake all the same (slept by hand with the manager off).
  return cap.enabled || cap.engines.some((e) => e.state !== "awake");
}

function managerLook() {
  // {look, by, self}: the manager's last turn, the replica that made it (null: this gateway,
  // acting alone) and whether that is this one; look null while no replica manages. Two
  // reports may carry a turn during a hand-over: the newer lease's.
  const cap = latest.capacity;
  const replicas = latest.replicas;
  const alone = replicas.fleet === null;
  if (cap.managing) {
    return { look: cap.look?.models ? cap.look : null, by: alone ? null : replicas.self, self: true, alone };
  }
  const reports = (replicas.replicas ?? []).filter((r) => r.capacity?.models);
  reports.sort((a, b) => (b.capacity.token ?? 0) - (a.capacity.token ?? 0));
  const r = reports[0];
  return r ? { look: r.capacity, by: r.id, self: r.id === replicas.self, alone } : { look: null, by: null, self: false, alone };
}

function fmtEngineSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  const whole = `${Math.round(s).toLocaleString("en-US")} engine-s`;
  return s >= 3600 ? `${whole} (${(s / 3600).toFixed(1)} engine-h)` : whole;
}

function managedBy(m) {
  if (m.look === null) return "no replica manages yet (its lease is free or being taken)";
  if (m.alone) return "managed by this gateway";
  return `managed by ${m.by}${m.self ? " (this one)" : ""}`;
}

function savedNote(m) {
  // What the figure counts, said plainly: only the manager's own count is at hand here.
  if (m.look === null) return "Engine-seconds asleep: no manager's count yet.";
  const metric = "llm_gateway_capacity_asleep_seconds_total";
  if (m.alone) return `Engine-seconds asleep (saved): counted since this gateway started (${metric}).`;
  return `Engine-seconds asleep (saved): counted by ${m.by} while it managed, since it started; ` +
    `a replica that managed before it counts its own, so the fleet's total is ${metric} summed over the replicas.`;
}

function renderCapacity() {
  const cap = latest.capacity;
  const card = $("capacity-card");
  card.hidden = !capacityShown(cap);
  if (card.hidden) return;
  const m = managerLook();
  const counts = cap.states;
  const on = cap.enabled ? "capacity manager on" : "capacity manager OFF: engines wanted asleep stay as they are";
  $("capacity-summary").textContent = `${on} · ${managedBy(m)}${m.look ? ` (lease token ${m.look.token})` : ""}`;
  const tiles = [
    ["awake", counts.awake],
    ["going_to_sleep", counts.going_to_sleep],
    ["asleep", counts.asleep],
    ["waking", counts.waking],
  ].map(([state, n]) => [state, REST[state], fmtNumber(n, 0)]);
  tiles.push(["saved", "engine-seconds asleep (saved)", fmtEngineSeconds(m.look?.asleep_seconds)]);
  $("capacity-tiles").replaceChildren(
    ...tiles.map(([key, label, value]) => el("div", { class: "tile card", dataset: { key } }, el("span", { class: "label" }, label), el("span", { class: "value" }, value))),
  );
  $("capacity-saved-note").textContent = savedNote(m);
  renderEngines(cap);
  renderCapacityModels(cap, m.look);
}

function renderEngines(cap) {
  const tbody = $("engines").tBodies[0];
  const keys = new Set();
  for (const e of cap.engines) {
    keys.add(e.backend);
    const label = REST[e.state] ?? e.state;
    const state = el("span", { class: `rest ${e.state}`, dataset: { sig: e.state } }, label);
    const wanted = e.sleep_wanted;
    const button = el(
      "button",
      { type: "button", class: wanted ? "wake" : "sleep", dataset: { sig: `${wanted}` }, onclick: () => restEngine(e.backend, !wanted) },
      wanted ? "Wake" : "Sleep",
    );
    const row = upsertRow(tbody, e.backend, [e.backend, state, fmtDuration(e.state_for_s), e.models.join(", ") || "–", fmtNumber(e.in_flight, 0), button]);
    row.dataset.state = e.state;
    for (const s of Object.keys(REST)) row.classList.toggle(s, s === e.state);
  }
  prune(tbody, keys);
}

function renderCapacityModels(cap, look) {
  const tbody = $("capacity-models").tBodies[0];
  const models = Object.keys(cap.rules).sort();
  for (const model of models) {
    const rule = cap.rules[model];
    const turn = look?.models?.[model] ?? {};
    upsertRow(tbody, model, [
      model,
      fmtNumber(rule.min_awake, 0),
      rule.max_awake === null || rule.max_awake === undefined ? "all" : fmtNumber(rule.max_awake, 0),
      fmtNumber(turn.awake ?? null, 0),
      fmtNumber(turn.load ?? null),
      fmtNumber(turn.trend_per_s ?? null, 3),
      fmtNumber(turn.need ?? null, 0),
      fmtNumber(turn.desired ?? null, 0),
      fmtNumber(turn.held ?? null, 0),
      turn.idle_for_s === null || turn.idle_for_s === undefined ? "–" : fmtDuration(turn.idle_for_s),
      turn.why ?? "–",
    ]);
  }
  prune(tbody, new Set(models));
}

async function restEngine(id, asleep) {
  const cap = latest.capacity;
  const e = cap.engines.find((x) => x.backend === id);
  const managed = (e?.models ?? []).some((model) => model in cap.rules);
  let text = asleep
    ? `No new requests go to ${id}; once the ones in flight finish, it is put to sleep (POST /sleep).`
    : `${id} is woken (POST /wake_up) and takes requests again once it says it is awake.`;
  if (!cap.enabled) {
    text += asleep ? " The capacity manager is off: nothing puts it to sleep, it only stops taking requests." : "";
  } else if (managed) {
    text += asleep
      ? " The capacity manager wakes it again if its models' rules or demand need it."
      : " The capacity manager puts it to sleep again after an idle spell, by its models' rules.";
  }
  const title = `${asleep ? "Sleep" : "Wake"} ${id}`;
  if (!(await confirmChange(title, text, [["sleep wanted", e?.sleep_wanted ?? !asleep, asleep]]))) return;
  const verb = asleep ? "sleep" : "wake";
  await act(`${id}: wanted ${asleep ? "asleep" : "awake"}.`, "POST", `/admin/backends/${encodeURIComponent(id)}/${verb}`, { why: "from the console" });
}

// ---- the confirmation dialog: what changes, before it changes -----------------------------

function confirmChange(title, text, rows) {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  const table = $("confirm-diff");
  table.hidden = rows.length === 0;
  table.tBodies[0].replaceChildren(
    ...rows.map(([setting, now, after]) => el("tr", {}, el("td", {}, setting), el("td", { class: "old" }, fmtValue(now)), el("td", { class: "new" }, fmtValue(after)))),
  );
  return new Promise((resolve) => {
    const done = (ok) => {
      $("confirm-apply").onclick = null;
      $("confirm-cancel").onclick = null;
      dialog.onclose = null;
      if (dialog.open) dialog.close();
      resolve(ok);
    };
    $("confirm-apply").onclick = () => done(true);
    $("confirm-cancel").onclick = () => done(false);
    dialog.onclose = () => done(false);
    dialog.showModal();
  });
}

// ---- a change: its id, its answer, its fate ------------------------------------------------

// One operator action: ``done`` is what the page says once it is applied. Its hooks, called
// however it ends (sent again by "Try again" too): ``applied(doc)`` with what applying it
// answered; ``unsure(doc)`` with a 202's document, at once (a key's secret is in it and nowhere
// else); ``notApplied()`` when it certainly was not applied.
function act(done, method, path, body, hooks = {}) {
  return sendChange({ done, method, path, body, hooks, key: newChangeId() });
}

async function sendChange(change) {
  const { method, path, body, key } = change;
  let answer = null;
  for (let attempt = 0; answer === null; attempt++) {
    try {
      answer = await request(method, path, body, { "Idempotency-Key": key });
    } catch (err) {
      if (token === null || err instanceof ApiError) return;
      if (attempt >= RESENDS) {
        const text = `No answer from the gateway to ${method} ${path} (change ${key}): it may have been applied. Sent again, it is applied once at most.`;
        showBanner(text, "error", change);
        return;
      }
      await sleep(RESEND_MS); // no answer at all: the same change (the same key) once more
    }
  }
  if (token === null) return;
  const { status, doc } = answer;
  if (status === 202) {
    await followFate(change, doc);
    return;
  }
  if (status < 200 || status > 299) {
    // 503: nothing was changed, for now (Redis away, or the fleet's log being healed)
    showBanner(doc?.error?.message ?? `${method} ${path}: HTTP ${status}`, "error", status === 503 ? change : null);
    return;
  }
  showBanner(doc?.replayed_note ? `${change.done} (${doc.replayed_note})` : change.done, "ok");
  change.hooks.applied?.(doc ?? {});
  poll(); // show the effect now, not at the next tick
}

const WAITING = {
  pending: "in the fleet's log, not applied here yet",
  unknown: "Redis did not answer: may be applied",
};

async function followFate(change, doc) {
  // A 202: said as what it is, then asked after by its id until its fate is known.
  const id = doc?.id ?? change.key;
  let state = doc?.state ?? "unknown";
  const say = () => showBanner(`${change.method} ${change.path} (change ${id}): ${WAITING[state] ?? state}; checking…`, "info");
  say();
  change.hooks.unsure?.(doc);
  const until = Date.now() + FOLLOW_FOR_MS;
  while (token !== null && Date.now() < until) {
    await sleep(FOLLOW_MS);
    let fate;
    try {
      fate = await api("GET", `/admin/changes/${encodeURIComponent(id)}`);
    } catch {
      continue; // no answer this time: asked again
    }
    if (token === null) return;
    if (fate.state === "applied") {
      showBanner(`${change.done} (change ${id}: applied)`, "ok");
      change.hooks.applied?.(fate.outcome?.body ?? {});
      poll();
      return;
    }
    if (fate.state === "refused") {
      const outcome = fate.outcome ?? {};
      showBanner(`Refused (change ${id}): ${outcome.body?.error?.message ?? `HTTP ${outcome.status}`}`, "error");
      return;
    }
    if (fate.state === "not_applied") {
      change.hooks.notApplied?.();
      showBanner(`Not applied (change ${id}): Redis never took it; nothing changed on any replica.`, "error", change);
      return;
    }
    if (fate.state !== state) {
      state = fate.state;
      say();
    }
  }
  if (token !== null) {
    showBanner(`Change ${id}: its fate is not known yet; GET /admin/changes/${id} tells once Redis answers.`, "error");
  }
}

async function drainBackend(id, draining) {
  const verb = draining ? "Drain" : "Undrain";
  const text = draining
    ? `No new requests go to ${id}; the ones in flight finish.`
    : `${id} takes new requests again.`;
  const b = latest.backends.backends.find((x) => x.id === id);
  if (!(await confirmChange(`${verb} ${id}`, text, [["draining", b?.draining ?? !draining, draining]]))) return;
  const path = `/admin/backends/${encodeURIComponent(id)}/${draining ? "drain" : "undrain"}`;
  await act(`${verb}ed ${id}.`, "POST", path);
}

// ---- the policy form ----------------------------------------------------------------------

const SECTIONS = ["weights", "affinity", "latency"];

function inputFor(name, value) {
  let input;
  if (typeof value === "boolean") input = el("input", { type: "checkbox", name, dataset: { kind: "boolean" } });
  else if (typeof value === "number") input = el("input", { type: "number", step: "any", name, dataset: { kind: "number" } });
  else input = el("input", { type: "text", name, dataset: { kind: value === null ? "nullable" : "string" } });
  setInput(input, value);
  return input;
}

function buildPolicyForm(doc) {
  policyFormDoc = doc;
  const form = $("policy-form");
  const select = el("select", { name: "policy", id: "policy-select" }, ...doc.policies.map((p) => el("option", { value: p }, p)));
  setInput(select, doc.policy);
  const rows = [el("div", { class: "field" }, el("label", { for: "policy-select" }, "policy"), select, el("span", { class: "current", dataset: { field: "policy" } }))];
  for (const section of SECTIONS) {
    const values = doc[section];
    if (!values) continue;
    rows.push(el("h3", {}, section));
    for (const [key, value] of Object.entries(values)) {
      if (typeof value === "object" && value !== null) continue; // nested: edit through the API
      const name = `${section}.${key}`;
      const input = inputFor(name, value);
      input.id = `field-${section}-${key}`;
      rows.push(el("div", { class: "field" }, el("label", { for: input.id }, key), input, el("span", { class: "current", dataset: { field: name } })));
    }
  }
  form.replaceChildren(...rows);
  for (const span of form.querySelectorAll("span.current")) {
    span.textContent = `now ${fmtValue(valueAt(doc, span.dataset.field))}`;
  }
}

function valueAt(doc, name) {
  if (name === "policy") return doc.policy;
  const [section, key] = name.split(".");
  return doc[section]?.[key];
}

function formShape(doc) {
  return JSON.stringify(SECTIONS.map((s) => Object.keys(doc[s] ?? {})));
}

function setInput(input, value) {
  if (input.type === "checkbox") input.checked = Boolean(value);
  else input.value = value ?? "";
  input.dataset.base = JSON.stringify(value ?? null);
}

function edited(input) {
  return JSON.stringify(readInput(input) ?? null) !== input.dataset.base;
}

function follow(input, now) {
  const value = JSON.stringify(now ?? null);
  if (JSON.stringify(readInput(input) ?? null) === value) input.dataset.base = value; // caught up
  else if (!edited(input)) setInput(input, now);
  input.classList.toggle("edited", edited(input));
}

function refreshPolicyForm(doc) {
  // The "now" beside each input follows the gateway, and so does every input the operator has
  // not edited (a change made elsewhere shows); an edited one keeps what was typed.
  const form = $("policy-form");
  const inputs = [...form.querySelectorAll("input, select")];
  if (formShape(doc) !== formShape(policyFormDoc) && !inputs.some(edited)) {
    buildPolicyForm(doc);
    return;
  }
  for (const input of inputs) follow(input, valueAt(doc, input.name));
  for (const span of form.querySelectorAll("span.current")) {
    span.textContent = `now ${fmtValue(valueAt(doc, span.dataset.field))}`;
  }
}

function readInput(input) {
  switch (input.dataset.kind) {
    case "boolean":
      return input.checked;
    case "number": {
      const n = Number(input.value);
      return input.value.trim() === "" || !Number.isFinite(n) ? input.value : n; // the API refuses it
    }
    case "nullable":
      return input.value === "" ? null : input.value;
    default:
      return input.value;
  }
}

function policyChange() {
  // The body for PUT /admin/policy (only what differs from the running policy) and its diff.
  const now = latest.policy;
  const form = $("policy-form");
  const body = {};
  const rows = [];
  const chosen = form.elements.policy.value;
  if (chosen !== now.policy) {
    body.policy = chosen;
    rows.push(["policy", now.policy, chosen]);
  }
  for (const section of SECTIONS) {
    const changed = {};
    for (const input of form.querySelectorAll(`[name^="${section}."]`)) {
      const key = input.name.slice(section.length + 1);
      const value = readInput(input);
      const was = now[section]?.[key];
      if (value !== was) {
        changed[key] = value;
        rows.push([input.name, was, value]);
      }
    }
    if (Object.keys(changed).length === 0) continue;
    // Weights go whole (the API takes all three); the other sections take only what changed.
    body[section] = section === "weights" ? { ...now.weights, ...changed } : changed;
  }
  return { body, rows };
}

async function reviewPolicy() {
  const { body, rows } = policyChange();
  if (rows.length === 0) {
    showBanner("Nothing to change: the form says what the gateway runs now.", "info");
    return;
  }
  const ok = await confirmChange("Change the routing policy", "PUT /admin/policy, applied to the next request:", rows);
  if (!ok) return;
  await act("Policy changed.", "PUT", "/admin/policy", body, {
    applied: (result) => {
      latest.policy = { ...latest.policy, ...result };
      buildPolicyForm(latest.policy);
    },
  });
}

// ---- pools and canary weights -------------------------------------------------------------

function renderRollout(last) {
  const { aliases, pools } = latest.aliases;
  const shape = JSON.stringify([aliases.map((a) => [a.alias, Object.keys(a.weights)]), Object.keys(pools)]);
  if (shape !== rolloutShape) {
    rolloutShape = shape;
    buildRollout(aliases);
  }
  const base = windowBase(last.at);
  const inFleet = last.canary !== null;
  $("traffic-source").hidden = aliases.length === 0;
  $("traffic-source").textContent = inFleet
    ? `traffic: the last ${WINDOW_S} s, summed over the fleet's ${latest.replicas.summary.replicas} replicas`
    : `traffic: the last ${WINDOW_S} s through this gateway`;
  for (const a of aliases) {
    const now = servedByPool(last, a.alias, inFleet) ?? {};
    const then = base ? servedByPool(base, a.alias, inFleet) : {};
    const rate = (p) => (then === null ? null : last.derived.rate(now[p] ?? 0, then[p] ?? 0));
    const rates = Object.fromEntries(Object.keys(a.weights).map((p) => [p, rate(p)]));
    const total = sumValues(rates);
    for (const [p, w] of Object.entries(a.weights)) {
      const row = document.querySelector(`#aliases tr[data-alias="${CSS.escape(a.alias)}"][data-pool="${CSS.escape(p)}"]`);
      if (!row) continue;
      row.cells[1].textContent = fmtNumber(w);
      row.cells[2].textContent = total > 0 ? fmtPct(rates[p] / total) : "–";
      follow(row.querySelector("input"), w);
      row.classList.toggle("drained", a.drained.includes(p));
    }
    const rollback = document.querySelector(`button.rollback[data-alias="${CSS.escape(a.alias)}"]`);
    if (rollback) {
      rollback.disabled = !a.previous;
      rollback.title = a.previous ? `back to ${fmtValue(a.previous)}` : "no earlier weights";
    }
  }
  const tbody = $("pools").tBodies[0];
  const keys = new Set();
  for (const [name, p] of Object.entries(pools)) {
    keys.add(name);
    const button = el(
      "button",
      { type: "button", dataset: { sig: `${p.drained}` }, onclick: () => drainPool(name, !p.drained) },
      p.drained ? "Undrain" : "Drain",
    );
    upsertRow(tbody, name, [name, p.model, p.backends.join(", "), { text: p.drained ? "drained" : "serving", cls: p.drained ? "warn" : "ok" }, button]);
  }
  prune(tbody, keys);
}

function servedByPool(entry, alias, inFleet) {
  // Requests per pool for ``alias`` so far, from the same source at both ends of a window: the
  // fleet's figures in a fleet (null for a poll made before this gateway knew its fleet), this
  // gateway's own counters alone.
  if (inFleet) return entry.canary === null ? null : entry.canary[alias] ?? {};
  const byPool = entry.stats.aliases?.[alias] ?? {};
  return Object.fromEntries(Object.entries(byPool).map(([p, byStatus]) => [p, sumValues(byStatus)]));
}

function buildRollout(aliases) {
  const container = $("aliases");
  if (aliases.length === 0) {
    container.replaceChildren(el("p", { class: "quiet" }, "No aliases: [[pools]] and [aliases] in the configuration make canaries."));
    return;
  }
  container.replaceChildren(
    ...aliases.map((a) => {
      const rows = Object.entries(a.weights).map(([p, w]) =>
        el("tr", { dataset: { alias: a.alias, pool: p } },
          el("td", {}, p),
          el("td", {}, fmtNumber(w)),
          el("td", {}, "–"),
          el("td", {}, weightInput(p, w)),
        ));
      return el("div", { class: "alias", dataset: { alias: a.alias } },
        el("h3", {}, a.alias),
        el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "pool"), el("th", {}, "weight"), el("th", {}, "traffic"), el("th", {}, "new weight"))), el("tbody", {}, rows)),
        el("div", { class: "actions" },
          el("button", { type: "button", class: "review-weights", dataset: { alias: a.alias }, onclick: () => reviewWeights(a.alias) }, "Review weights"),
          el("button", { type: "button", class: "rollback quiet", dataset: { alias: a.alias }, onclick: () => rollBack(a.alias) }, "Roll back"),
        ));
    }),
  );
}

function weightInput(pool, weight) {
  const input = el("input", { type: "number", step: "any", min: 0, name: `weight.${pool}`, "aria-label": `new weight of ${pool}`, dataset: { kind: "number" } });
  setInput(input, weight);
  return input;
}

function aliasDoc(alias) {
  return latest.aliases.aliases.find((a) => a.alias === alias);
}

async function reviewWeights(alias) {
  const doc = aliasDoc(alias);
  const block = document.querySelector(`#aliases div.alias[data-alias="${CSS.escape(alias)}"]`);
  const weights = {};
  const rows = [];
  for (const input of block.querySelectorAll("input[name^='weight.']")) {
    const pool = input.name.slice("weight.".length);
    const n = Number(input.value);
    weights[pool] = input.value.trim() === "" || !Number.isFinite(n) ? input.value : n;
    if (weights[pool] !== doc.weights[pool]) rows.push([`${alias} → ${pool}`, doc.weights[pool], weights[pool]]);
  }
  if (rows.length === 0) {
    showBanner(`Nothing to change: those are ${alias}'s weights now.`, "info");
    return;
  }
  if (!(await confirmChange(`Shift ${alias}'s traffic`, `PUT /admin/aliases/${alias}; roll back undoes it.`, rows))) return;
  // once applied, the inputs are rebuilt from what the gateway then runs
  await act(`${alias}'s weights changed.`, "PUT", `/admin/aliases/${encodeURIComponent(alias)}`, weights, { applied: () => { rolloutShape = ""; } });
}

async function rollBack(alias) {
  const doc = aliasDoc(alias);
  if (!doc?.previous) return;
  const pools = [...new Set([...Object.keys(doc.weights), ...Object.keys(doc.previous)])];
  const rows = pools.map((p) => [`${alias} → ${p}`, doc.weights[p] ?? 0, doc.previous[p] ?? 0]);
  if (!(await confirmChange(`Roll back ${alias}`, "Back to the weights in force before the last change.", rows))) return;
  await act(`${alias} rolled back.`, "POST", `/admin/aliases/${encodeURIComponent(alias)}/rollback`, undefined, { applied: () => { rolloutShape = ""; } });
}

async function drainPool(pool, drained) {
  const verb = drained ? "Drain" : "Undrain";
  const text = drained ? `No new requests reach pool ${pool} through its aliases.` : `Pool ${pool} takes its share again.`;
  if (!(await confirmChange(`${verb} pool ${pool}`, text, [["drained", !drained, drained]]))) return;
  await act(`${verb}ed pool ${pool}.`, "POST", `/admin/pools/${encodeURIComponent(pool)}/${drained ? "drain" : "undrain"}`);
}

// ---- progressive rollouts ------------------------------------------------------------------
// Each rollout's record (every replica holds it, from the fleet's log) and its driver's last
// look (the gates' figures, the hold left), which any replica's GET /admin/rollouts shows.

const EVENTS_SHOWN = 6;

function fmtDuration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  const whole = Math.ceil(s);
  if (whole < 60) return `${whole} s`;
  const m = Math.floor(whole / 60);
  return whole % 60 ? `${m} min ${whole % 60} s` : `${m} min`;
}

function fmtGate(gate, x) {
  if (x === null || x === undefined) return "–";
  if (gate === "errors") return `${(x * 100).toFixed(1)} %`;
  if (gate === "probes") return fmtPct(x);
  return fmtSeconds(x);
}

function renderRollouts() {
  const runs = latest.rollouts.rollouts;
  const container = $("rollouts");
  const seen = new Set(runs.map((r) => r.alias));
  for (const block of [...container.children]) if (!seen.has(block.dataset.alias)) block.remove();
  if (runs.length === 0) {
    if (!container.querySelector("p.none")) container.replaceChildren(el("p", { class: "quiet none" }, "None yet: start one below, or POST /admin/rollouts/{alias}."));
  } else {
    container.querySelector("p.none")?.remove();
  }
  for (const run of runs) renderRun(container, run);
  buildStartForm();
}

function rolloutBlock(container, alias) {
  // Built once per alias and updated in place: its buttons are never replaced under a click.
  let block = container.querySelector(`div.rollout[data-alias="${CSS.escape(alias)}"]`);
  if (block) return block;
  const button = (cls, text, onclick) => el("button", { type: "button", class: cls, onclick }, text);
  block = el("div", { class: "rollout", dataset: { alias } },
    el("div", { class: "title" }, el("strong", { class: "name" }), el("span", { class: "state" }), el("span", { class: "quiet driver" })),
    el("ol", { class: "steps" }),
    el("p", { class: "summary" }),
    el("table", { class: "gates" }, el("thead", {}, el("tr", {}, ...["gate", "canary", "stable", "limit", ""].map((h) => el("th", {}, h)))), el("tbody")),
    el("h3", {}, "Events"),
    el("table", { class: "events" }, el("thead", {}, el("tr", {}, ...["when", "event", "step", "why", "by"].map((h) => el("th", {}, h)))), el("tbody")),
    el("div", { class: "actions" },
      button("pause quiet", "Pause", () => rolloutAction(alias, "pause")),
      button("resume", "Resume", () => rolloutAction(alias, "resume")),
      button("abort drain", "Abort", () => rolloutAction(alias, "abort")),
    ));
  container.append(block);
  return block;
}

function renderRun(container, run) {
  const block = rolloutBlock(container, run.alias);
  const { plan } = run;
  const active = run.status === "running" || run.status === "paused";
  const last = run.history[run.history.length - 1];
  block.querySelector(".name").textContent = `${run.alias}: ${plan.stable} → ${plan.canary}`;
  const state = block.querySelector(".state");
  state.textContent = run.status;
  state.className = `state ${run.status}`;
  block.querySelector(".driver").textContent = active
    ? run.driven_by ? `driven by ${run.driven_by}${run.driven_here ? " (this one)" : ""}` : "no driver has looked yet"
    : "";
  const steps = block.querySelector("ol.steps");
  steps.replaceChildren(...plan.steps.map((share, i) => {
    let cls = i < run.step || run.status === "promoted" ? "done" : i === run.step ? "current" : "";
    if (i === run.step && run.status === "aborted") cls = "failed";
    return el("li", { class: cls, dataset: { step: i } }, `${fmtNumber(share)} %`);
  }));
  const now = active ? run.now : null;
  const summary = block.querySelector(".summary");
  summary.className = `summary${run.status === "aborted" ? " bad" : ""}`;
  summary.textContent = summaryOf(run, now, last);
  // The gates' figures: the driver's last look while it runs; the final ones after.
  const readings = now?.readings ?? (active ? [] : last?.readings ?? []);
  const gates = block.querySelector("table.gates");
  gates.hidden = readings.length === 0;
  const tbody = gates.tBodies[0];
  for (const r of readings) {
    const verdict = r.passed ? (r.canary === null || r.limit === null ? "no figure yet" : "passes") : "FAILED";
    upsertRow(tbody, r.gate, [r.gate, fmtGate(r.gate, r.canary), fmtGate(r.gate, r.stable), fmtGate(r.gate, r.limit), { text: verdict, cls: r.passed ? "ok" : "bad" }]);
  }
  prune(tbody, new Set(readings.map((r) => r.gate)));
  const events = block.querySelector("table.events").tBodies[0];
  const shown = run.history.slice(-EVENTS_SHOWN).reverse();
  events.replaceChildren(...shown.map((e) => el("tr", { dataset: { action: e.action } },
    el("td", {}, new Date(e.at * 1000).toLocaleTimeString()),
    el("td", {}, e.action),
    el("td", {}, `${e.step + 1} (${fmtNumber(plan.steps[e.step])} %)`),
    el("td", {}, e.why || "–"),
    el("td", {}, e.by || "–"))));
  block.querySelector("button.pause").hidden = run.status !== "running";
  block.querySelector("button.resume").hidden = run.status !== "paused";
  block.querySelector("button.abort").hidden = !active;
}

function summaryOf(run, now, last) {
  const { plan } = run;
  const n = plan.steps.length;
  const at = `step ${run.step + 1} of ${n} (${fmtNumber(plan.steps[run.step])} % to ${plan.canary})`;
  if (run.status === "promoted") return `Promoted: ${plan.canary} serves all of ${run.alias}.`;
  if (run.status === "aborted") {
    return `Rolled back to ${plan.stable} at ${at}: ${last?.why || "aborted"}. ${plan.canary} stays drained until someone acts.`;
  }
  const paused = run.status === "paused" ? "Paused at " : "At ";
  if (!now) return `${paused}${at}; waiting for the driver's first look.`;
  // The least time left: this step's hold, then each later step's.
  const left = now.hold_left_s + plan.hold_s * (n - 1 - run.step);
  const requests = `${now.canary_requests} of ${plan.min_requests} canary requests`;
  let doing = run.status === "paused" ? requests : `${now.why} (${requests})`;
  if (run.status !== "paused" && now.canary_requests < plan.min_requests) doing = `waiting for canary requests: ${now.canary_requests} of ${plan.min_requests}`;
  return `${paused}${at}: ${doing}; this step's hold ${fmtDuration(now.hold_left_s)} more, the rollout at least ${fmtDuration(left)}.`;
}

async function rolloutAction(alias, verb) {
  const run = latest.rollouts.rollouts.find((r) => r.alias === alias);
  if (!run) return;
  const share = run.weights[run.plan.canary] ?? 0;
  const texts = {
    pause: [`Pause ${alias}'s rollout`, "It holds at this step (a failing gate still rolls it back).", []],
    resume: [`Resume ${alias}'s rollout`, "The driver judges the step again: on when its hold and requests are in.", []],
    abort: [`Abort ${alias}'s rollout`, `Back to ${run.plan.stable} at once, on every replica; ${run.plan.canary} is drained.`, [[`${alias} → ${run.plan.canary}`, share, 0]]],
  };
  const [title, text, rows] = texts[verb];
  if (!(await confirmChange(title, text, rows))) return;
  const body = verb === "abort" ? { why: "aborted from the console" } : undefined;
  const done = { pause: "paused", resume: "resumed", abort: "aborted" }[verb];
  await act(`${alias}'s rollout ${done}.`, "POST", `/admin/rollouts/${encodeURIComponent(alias)}/${verb}`, body);
}

function buildStartForm() {
  const { aliases, pools } = latest.aliases;
  const shape = JSON.stringify([aliases.map((a) => a.alias), Object.keys(pools)]);
  if (shape === startShape) return;
  startShape = shape;
  const alias = $("rollout-alias");
  const kept = alias.value;
  alias.replaceChildren(...aliases.map((a) => el("option", { value: a.alias }, a.alias)));
  for (const id of ["rollout-stable", "rollout-canary"]) {
    $(id).replaceChildren(...Object.keys(pools).map((p) => el("option", { value: p }, p)));
  }
  $("rollout-review").disabled = aliases.length === 0;
  if (aliases.some((a) => a.alias === kept)) alias.value = kept;
  pickPools(alias.value);
}

function pickPools(alias) {
  // From the pool serving most of the alias now, to another of its pools.
  const doc = latest.aliases.aliases.find((a) => a.alias === alias);
  if (!doc) return;
  const ranked = Object.entries(doc.weights).sort((a, b) => b[1] - a[1]).map(([p]) => p);
  const others = Object.keys(latest.aliases.pools).filter((p) => p !== ranked[0]);
  if (ranked[0]) $("rollout-stable").value = ranked[0];
  const canary = ranked.find((p) => p !== ranked[0]) ?? others[0];
  if (canary) $("rollout-canary").value = canary;
}

function startPlan() {
  // Sent as typed: the gateway checks the plan and says what is wrong with it.
  const number = (id) => {
    const raw = $(id).value.trim();
    const n = Number(raw);
    return raw !== "" && Number.isFinite(n) ? n : raw;
  };
  const steps = $("rollout-steps").value.split(/[\s,]+/).filter(Boolean).map((x) => (Number.isFinite(Number(x)) ? Number(x) : x));
  return {
    stable: $("rollout-stable").value,
    canary: $("rollout-canary").value,
    steps,
    hold_s: number("rollout-hold"),
    min_requests: number("rollout-min"),
    gates: {
      error_margin: number("rollout-error-margin"),
      ttft_p99_factor: number("rollout-ttft-factor"),
      itl_p50_factor: number("rollout-itl-factor"),
    },
  };
}

async function reviewStart(event) {
  event.preventDefault();
  const alias = $("rollout-alias").value;
  if (!alias) return;
  const plan = startPlan();
  const rows = [
    ["pools", null, `${plan.stable} → ${plan.canary}`],
    ["steps, %", null, plan.steps.join(", ")],
    ["hold, s", null, plan.hold_s],
    ["min requests", null, plan.min_requests],
    ...Object.entries(plan.gates).map(([k, v]) => [`gates.${k}`, null, v]),
  ];
  const text = `${alias} goes to its first step at once, on every replica; the gateway moves it on, or back, by its gates.`;
  if (!(await confirmChange(`Start a rollout of ${alias}`, text, rows))) return;
  await act(`${alias}'s rollout started.`, "POST", `/admin/rollouts/${encodeURIComponent(alias)}`, plan);
}

// ---- limits and decisions -----------------------------------------------------------------

function renderRejections(last) {
  const base = windowBase(last.at);
  const before = new Map((base?.stats.rate_limit_rejections ?? []).map((r) => [`${r.key}|${r.reason}`, r.count]));
  const tbody = $("rejections").tBodies[0];
  const keys = new Set();
  for (const r of last.stats.rate_limit_rejections) {
    const key = `${r.key}|${r.reason}`;
    keys.add(key);
    upsertRow(tbody, key, [r.key, r.reason, fmtNumber(r.count, 0), fmtRate(last.derived.rate(r.count, before.get(key)))]);
  }
  prune(tbody, keys);
  const outcomes = last.stats.admission.outcomes;
  const thenOutcomes = base?.stats.admission.outcomes ?? {};
  const admission = $("admission").tBodies[0];
  const okeys = new Set(Object.keys(outcomes));
  for (const [outcome, n] of Object.entries(outcomes)) {
    upsertRow(admission, outcome, [outcome, fmtNumber(n, 0), fmtRate(last.derived.rate(n, thenOutcomes[outcome]))]);
  }
  prune(admission, okeys);
}

// The one budget of extra attempts (retries, hedges, stream continuations): per kind those it
// granted and refused, this replica's use of it, and who decides (the fleet's on Redis, or this
// replica alone while Redis does not answer, or always when the limits keep no Redis).
const BUDGET_KINDS = ["retry", "hedge", "continuation"];

function budgetState(budget) {
  const use = `${fmtPct(budget.use)} of what this replica's own requests allow`;
  if (budget.degraded) return [`Redis does not answer: this replica's own budget decides until it does (${use}).`, "warn"];
  if (budget.shared) return [`Shared by the fleet on Redis. Used here: ${use}.`, ""];
  return [`This gateway's own (its limits keep no Redis). Used: ${use}.`, ""];
}

function renderRetryBudget(last) {
  const budget = last.stats.retry_budget;
  $("retry-budget-block").hidden = !budget;
  if (!budget) return;
  const [text, cls] = budgetState(budget);
  const state = $("retry-budget-state");
  if (state.textContent !== text) state.textContent = text;
  state.className = cls;
  const then = windowBase(last.at)?.stats.retry_budget?.attempts ?? {};
  const tbody = $("retry-budget").tBodies[0];
  const kinds = [...BUDGET_KINDS, ...Object.keys(budget.attempts).filter((k) => !BUDGET_KINDS.includes(k))];
  for (const kind of kinds) {
    const n = budget.attempts[kind] ?? {};
    const refused = n.refused ?? 0;
    upsertRow(tbody, kind, [
      kind,
      fmtNumber(n.taken ?? 0, 0),
      { text: fmtNumber(refused, 0), cls: refused > 0 ? "warn" : "" },
      fmtRate(last.derived.rate(refused, then[kind]?.refused)),
    ]);
  }
  prune(tbody, new Set(kinds));
}

function renderDecisions(last) {
  const base = windowBase(last.at);
  const groups = [["prefix", "prefix_decisions"], ["latency", "latency_decisions"], ["retry", "retries"], ["continuation", "continuations"]];
  const tbody = $("decisions").tBodies[0];
  const keys = new Set();
  for (const [label, field] of groups) {
    const now = last.stats[field] ?? {};
    const then = base?.stats[field] ?? {};
    const total = sumValues(now);
    for (const [reason, n] of Object.entries(now)) {
      const key = `${label}:${reason}`;
      keys.add(key);
      upsertRow(tbody, key, [key, fmtNumber(n, 0), fmtRate(last.derived.rate(n, then[reason])), total > 0 ? fmtPct(n / total) : "–"]);
    }
  }
  prune(tbody, keys);
}

// ---- the fleet: replicas, the audit trail, API keys ------------------------------------------

function fleetFigureRows(f) {
  // [key, figure, total, share] in the order shown: the fleet's figures summed over the
  // replicas (each since it started), then routing decisions, the canary split, rejections.
  const share = (n, whole) => (whole > 0 ? fmtPct(n / whole) : "–");
  const byName = (obj) => Object.entries(obj ?? {}).sort((a, b) => a[0].localeCompare(b[0]));
  const rows = [
    ["requests", "requests", fmtNumber(f.requests, 0), ""],
    ["errors", "errors (5xx)", fmtNumber(f.errors, 0), share(f.errors, f.requests)],
    ["ttft-p50", "TTFT p50", fmtSeconds(f.ttft_p50_s), ""],
    ["ttft-p99", "TTFT p99", fmtSeconds(f.ttft_p99_s), ""],
  ];
  const routed = sumValues(f.decisions);
  for (const [backend, n] of byName(f.decisions)) {
    rows.push([`routed:${backend}`, `routed → ${backend}`, fmtNumber(n, 0), share(n, routed)]);
  }
  for (const [alias, pools] of byName(f.canary)) {
    const total = sumValues(pools);
    for (const [pool, n] of byName(pools)) {
      rows.push([`canary:${alias}:${pool}`, `canary ${alias} → ${pool}`, fmtNumber(n, 0), share(n, total)]);
    }
  }
  const rejected = sumValues(f.rejections);
  const byCount = Object.entries(f.rejections ?? {}).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  for (const [key, n] of byCount) {
    rows.push([`rejected:${key}`, `rejected: ${key}`, fmtNumber(n, 0), share(n, rejected)]);
  }
  return rows;
}

function renderFleetFigures(figures) {
  const tbody = $("fleet-figures").tBodies[0];
  const rows = figures ? fleetFigureRows(figures) : [];
  for (const [key, ...cells] of rows) upsertRow(tbody, key, cells);
  prune(tbody, new Set(rows.map(([key]) => key)));
  for (const [key] of rows) tbody.append([...tbody.rows].find((r) => r.dataset.key === key));
}

// A replica's change log, as it reports it (or, on another epoch, as the fleet sees it)
const LOG_STATES = {
  ok: ["ok", "ok"],
  lost: ["lost: being healed", "bad"],
  unreachable: ["unreachable", "bad"],
  "other epoch": ["on another epoch", "warn"],
};

function logCell(r, problems) {
  const state = problems[r.id] ?? r.log;
  if (state === undefined) return "–"; // a replica of before the log had a state
  const [text, cls] = LOG_STATES[state] ?? [state, "warn"];
  return { text, cls };
}

function fleetLog(replicas) {
  // The fleet's change log as this replica sees it, whose log is not the fleet's, and how
  // often this replica found it lost (Redis lost its data): [text, class].
  const s = replicas.summary;
  const parts = [];
  let cls = "ok";
  if (replicas.log === "lost") {
    parts.push("change log LOST (Redis lost its data): being healed by the replica furthest ahead; admin changes are refused meanwhile");
    cls = "bad";
  } else if (replicas.log === "unreachable") {
    parts.push("change log unreachable: Redis does not answer this replica; admin changes are refused or their fate unknown");
    cls = "bad";
  } else {
    parts.push(`change log ok${s.epoch ? ` (epoch ${s.epoch})` : ""}`);
  }
  const problems = Object.entries(s.log_problems ?? {});
  if (problems.length) {
    parts.push(`not on the fleet's log: ${problems.map(([id, what]) => `${id} (${LOG_STATES[what]?.[0] ?? what})`).join(", ")}`);
    if (cls === "ok") cls = "warn";
  }
  const losses = replicas.losses ?? 0;
  if (losses > 0) {
    parts.push(`found lost ${losses} time${losses === 1 ? "" : "s"} since this replica started`);
    if (cls === "ok") cls = "warn";
  }
  return [parts.join(" · "), cls];
}

function renderFleet() {
  const { replicas, changes } = latest;
  const tbody = $("replicas").tBodies[0];
  const keys = new Set();
  const summary = $("fleet-summary");
  const logLine = $("fleet-log");
  const lagging = new Set(replicas.summary?.lagging ?? []);
  const problems = replicas.summary?.log_problems ?? {};
  if (replicas.fleet === null) {
    summary.textContent = "This gateway acts alone (no fleet: see docs/fleet.md).";
    logLine.hidden = true;
  } else {
    const s = replicas.summary;
    const lag = s.lagging.length ? `behind the log: ${s.lagging.join(", ")}` : "all up to date";
    const split = Object.keys(s.disagree).length ? ` · health seen differently: ${Object.keys(s.disagree).join(", ")}` : "";
    summary.textContent = `fleet ${replicas.fleet}: ${s.replicas} replicas, ${lag}, ${sumValues(s.in_flight)} in flight${split}`;
    const [text, cls] = fleetLog(replicas);
    logLine.textContent = text;
    logLine.className = cls;
    logLine.hidden = false;
  }
  for (const r of replicas.replicas) {
    keys.add(r.id);
    const self = r.id === replicas.self ? " (this one)" : "";
    const applied = { text: r.applied ?? "–", cls: lagging.has(r.id) ? "warn" : "" };
    const requests = fmtNumber(r.figures?.requests ?? null, 0); // none from an older replica
    upsertRow(tbody, r.id, [r.id + self, r.version, r.address, fmtSeconds(r.uptime_s), sumValues(r.in_flight), requests, applied, logCell(r, problems)]);
  }
  prune(tbody, keys);
  renderFleetFigures(replicas.fleet === null ? null : replicas.summary.figures);
  const trail = $("changes").tBodies[0];
  const seen = new Set();
  for (const c of changes.changes) {
    seen.add(c.position);
    const when = new Date(c.at * 1000).toLocaleTimeString();
    const id = { text: c.id ?? "–", cls: "id" }; // none for an entry of before changes had ids
    upsertRow(trail, c.position, [when, id, `${c.method} ${c.path}`, c.replica, c.caller, fmtValue(c.old), fmtValue(c.new)]);
  }
  prune(trail, seen);
  // newest first, as listed
  for (const c of changes.changes) trail.append([...trail.rows].find((r) => r.dataset.key === c.position));
}

function renderKeys() {
  const tbody = $("keys").tBodies[0];
  const keys = new Set();
  for (const k of latest.keys.keys) {
    keys.add(k.name);
    const rotate = el("button", { type: "button", class: "rotate", dataset: { sig: k.name }, onclick: () => rotateKey(k.name) }, "Rotate");
    const revoke = el("button", { type: "button", class: "revoke", dataset: { sig: k.name }, onclick: () => revokeKey(k.name) }, "Revoke");
    const labels = Object.entries(k.labels ?? {}).map(([n, v]) => `${n}=${v}`).join(" ") || "–";
    const expires = k.expires_at ? k.expires_at.replace("T", " ").replace("Z", " UTC") : "–";
    const period = (p) => {
      const got = k.budget?.periods?.[p];
      return got ? `${fmtNumber(got.spent ?? null, 0)} of ${fmtNumber(got.limit, 0)}` : "–";
    };
    const from = k.budget ? ` (${k.budget.source})` : "";
    upsertRow(tbody, k.name, [k.name, k.tier, k.source, k.hash, labels, expires, period("day") + (k.budget?.periods?.day ? from : ""), period("month") + (k.budget?.periods?.month ? from : ""), el("span", { dataset: { sig: `actions:${k.name}` } }, rotate, " ", revoke)]);
  }
  prune(tbody, keys);
}

async function makeKey(event) {
  event.preventDefault();
  const name = $("key-name").value.trim();
  const tier = $("key-tier").value.trim();
  const known = latest.keys?.keys.find((k) => k.name === name);
  const text = known ? `${name} has a key: this replaces it (the old one stops working).` : `A new key for ${name}, shown once.`;
  if (!(await confirmChange(`Make a key for ${name}`, text, [["tier", known?.tier ?? null, tier]]))) return;
  await keyChange(`Made a key for ${name}.`, "POST", "/admin/keys", { name, tier });
}

function showSecret(secret, note) {
  $("key-secret").textContent = secret;
  $("key-note").textContent = note;
  $("key-made").hidden = false;
}

async function keyChange(done, method, path, body) {
  // A new secret is in the answer to the call that made it, and nowhere else: shown at once,
  // even from a 202 (said to be good only if its change is applied), hidden if it was not.
  $("key-made").hidden = true;
  await act(done, method, path, body, {
    unsure: (doc) => doc?.key && showSecret(doc.key, "(good only once its change is applied: see above)"),
    notApplied: () => { $("key-made").hidden = true; },
    applied: (made) => {
      if (made.key) showSecret(made.key, "");
      else $("key-note").textContent = ""; // applied: a secret shown from its 202 works
    },
  });
}

async function rotateKey(name) {
  const text = `A new key for ${name}, shown once. The old one keeps working for an hour, on every replica, then is refused.`;
  if (!(await confirmChange(`Rotate ${name}'s key`, text, [["old key works for", null, "3600 s"]]))) return;
  await keyChange(`Rotated ${name}'s key.`, "POST", `/admin/keys/${encodeURIComponent(name)}/rotate`, { overlap_seconds: 3600 });
}

async function revokeKey(name) {
  if (!(await confirmChange(`Revoke ${name}`, `Requests with ${name}'s key are refused from now on, on every replica.`, []))) return;
  await act(`Revoked ${name}.`, "DELETE", `/admin/keys/${encodeURIComponent(name)}`);
}

async function reload() {
  if (!(await confirmChange("Reload the configuration", "The gateway re-reads its configuration file: what can change live is applied now, the rest is listed as needing a restart.", []))) return;
  await act("Configuration reloaded.", "POST", "/admin/reload", undefined, {
    applied: (result) => {
      if (!Array.isArray(result.applied)) return;
      const applied = result.applied.length ? result.applied.join(", ") : "nothing";
      const later = result.restart_required ?? [];
      const restart = later.length ? ` Needs a restart: ${later.join(", ")}.` : "";
      $("reload-result").textContent = `Applied: ${applied}.${restart}`;
    },
  });
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut());
  $("policy-review").addEventListener("click", reviewPolicy);
  $("policy-reset").addEventListener("click", () => latest.policy && buildPolicyForm(latest.policy));
  $("reload").addEventListener("click", reload);
  $("key-form").addEventListener("submit", makeKey);
  $("rollout-form").addEventListener("submit", reviewStart);
  $("rollout-alias").addEventListener("change", () => pickPools($("rollout-alias").value));
  $("token").focus();
});
