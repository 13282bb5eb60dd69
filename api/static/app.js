// The live page of one run: charts fed by the daemon's WebSocket stream (the history from seq 0,
// then live events), the live settings with a form for dynamic_offload.gpu_memory_threshold, the advisor's hints
// and the offload summary.
//
// The token arrives once in the address (?token=..., as `verl train` prints it). It moves into this
// tab's sessionStorage and out of the address bar at once, then goes with every call: the
// Authorization header for REST, the "bearer.<token>" subprotocol for the stream (never in a URL
// that could end up in a log). Without a token the page shows nothing of the run.

import { LineChart, formatBytes, formatNumber, formatRatio, formatSeconds } from "./charts.js";

const TOKEN_KEY = "verl-token";
const STATUS_POLL_MS = 5000;
const HINTS_POLL_MS = 5000;
const OFFLOAD_WINDOW_S = 60;
const LOG_LINES = 40;
const RECONNECT_MAX_MS = 10000;

const $ = (id) => document.getElementById(id);
// The live settings the page draws, by their canonical names (the API shows every setting by it).
const THRESHOLD = "dynamic_offload.gpu_memory_threshold";
const LAYER_MINIMUM = "dynamic_offload.min_transformer_layers_on_gpu";
// Charts over steps: a trainer restarted from a checkpoint redoes the steps since, which replace the old ones.
const STEP_CHARTS = ["reward", "kl", "loss", "throughput", "phases", "layers"];
// Charts of the NVML samples: empty on a machine without a GPU.
const GPU_CHARTS = ["gpu-util", "gpu-memory", "gpu-power", "gpu-pcie"];

const page = {
  token: null,
  lastSeq: 0,
  lastTime: null, // the time of the last event received: where a gap in the stream begins
  lastStep: null,
  threshold: null,
  charts: {},
  offloadCopies: [], // [time, seconds, bytes] of the last OFFLOAD_WINDOW_S
  reconnectMs: 500,
  locked: false,
};

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ------------------------------------------------------------------------------------------ token

function takeToken() {
  const address = new URL(window.location.href);
  const fromAddress = address.searchParams.get("token");
  if (fromAddress) {
    sessionStorage.setItem(TOKEN_KEY, fromAddress);
    address.searchParams.delete("token");
    window.history.replaceState(null, "", address.pathname + address.search + address.hash);
  }
  return fromAddress || sessionStorage.getItem(TOKEN_KEY);
}

// Hide everything of the run; `forget` drops a token the daemon refused (a reload would fail again).
function lock(title, text, { forget = false } = {}) {
  page.locked = true;
  if (forget) sessionStorage.removeItem(TOKEN_KEY);
  $("dashboard").hidden = true;
  $("dashboard").replaceChildren(); // nothing of the run stays in the document
  $("locked-title").textContent = title;
  $("locked-text").textContent = text;
  $("locked").hidden = false;
  document.body.dataset.state = "locked";
  setStream("not connected");
}

// ------------------------------------------------------------------------------------------- REST

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    cache: "no-store",
    headers: { Authorization: `Bearer ${page.token}`, "Content-Type": "application/json" },
  });
  const body = await response.json().catch(() => null);
  if (response.status === 401) {
    lock("The token was refused", "This daemon does not take the token this page was opened with: the run " +
         "may have ended and another taken its port.", { forget: true });
  }
  if (!response.ok) throw new ApiError(response.status, describeError(body, response.status));
  return body;
}

function describeError(body, status) {
  const detail = body && body.detail;
  if (Array.isArray(detail)) return detail.map((problem) => `${problem.loc.at(-1)}: ${problem.msg}`).join("; ");
  return typeof detail === "string" ? detail : `HTTP ${status}`;
}

// ----------------------------------------------------------------------------------------- charts

function chart(name, options) {
  const made = new LineChart($(`chart-${name}`), $(`legend-${name}`), options);
  page.charts[name] = made;
  return made;
}

function buildCharts() {
  const seconds = { format: formatSeconds };
  chart("reward", {});
  chart("kl", {});
  chart("loss", {});
  chart("throughput", {});
  chart("phases", { ...seconds, yMin: 0 });
  chart("layers", { yMin: 0 });
  const ratio = { x: "time", format: formatRatio, yMin: 0, yMax: 1 };
  const gpuSample = { x: "time", empty: "waiting for a GPU sample" };
  chart("gpu-util", { ...ratio, ...gpuSample });
  chart("gpu-memory", { ...ratio, ...gpuSample });
  chart("gpu-power", { ...gpuSample, format: (value) => `${formatNumber(value)} W`, yMin: 0 });
  chart("gpu-pcie", { ...gpuSample, format: (value) => `${formatBytes(value)}/s`, yMin: 0 });
  chart("offload-latency", { x: "time", ...seconds, yMin: 0, empty: "no offload copies yet" });
  chart("offload-bandwidth", { x: "time", format: (value) => `${formatBytes(value)}/s`, yMin: 0,
                               empty: "no offload copies yet" });
  chart("host", { ...ratio, empty: "waiting for a host sample" });
}

function countPoints() {
  const total = Object.values(page.charts).reduce((sum, each) => sum + each.points, 0);
  document.body.dataset.points = String(total);
}

// -------------------------------------------------------------------------------------- the stream

function connectStream() {
  if (page.locked) return;
  const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
  const socket = new WebSocket(`${scheme}//${window.location.host}/v1/stream?since=${page.lastSeq}`,
                               [`bearer.${page.token}`]);
  socket.onopen = () => {
    page.reconnectMs = 500;
    setStream("live");
  };
  socket.onmessage = (message) => {
    const event = JSON.parse(message.data);
    handleEvent(event);
    countPoints();
    document.body.dataset.lastSeq = String(page.lastSeq);
  };
  socket.onclose = () => {
    if (page.locked) return;
    setStream("reconnecting");
    // A refused handshake looks like any other close here: a status call tells a bad token apart.
    api("/v1/status").then(showStatus, (error) => error.status || setStream("daemon gone"));
    window.setTimeout(connectStream, page.reconnectMs);
    page.reconnectMs = Math.min(page.reconnectMs * 2, RECONNECT_MAX_MS);
  };
}

function setStream(text) {
  $("stream").textContent = `stream: ${text}`;
  $("stream").dataset.state = text;
}

function handleEvent(event) {
  const handler = {
    step: onStep, gpu: onGpu, offload: onOffload, settings: showSettingsState, status: showStatus,
    phase: onPhase, restart: onRestart, log: onLog, gap: onGap,
  }[event.kind];
  if (handler) handler(event.data, event.time, event.seq);
  if (event.kind !== "gap") {
    page.lastSeq = Math.max(page.lastSeq, event.seq);
    page.lastTime = event.time;
  }
}

function onStep(data) {
  const { step, metrics } = data;
  if (page.lastStep !== null && step <= page.lastStep) {
    // After a restart the trainer redoes the steps since its checkpoint: they replace the old ones.
    for (const each of STEP_CHARTS) page.charts[each].dropFrom(step);
  }
  page.lastStep = step;
  const add = (name, series, key) => page.charts[name].add(series, step, metrics[key]);
  add("reward", "score mean", "critic/score/mean");
  add("kl", "ppo_kl", "actor/ppo_kl");
  add("kl", "kl_loss", "actor/kl_loss");
  add("loss", "pg_loss", "actor/pg_loss");
  add("loss", "vf_loss", "critic/vf_loss");
  add("throughput", "tokens/s", "perf/throughput");
  for (const [key, value] of Object.entries(metrics)) {
    if (key.startsWith("timing_s/")) page.charts.phases.add(key.slice("timing_s/".length), step, value);
    // One series per offloaded model (offload/<role>/transformer_layers_on_gpu): the minimum is per model.
    const layers = /^offload\/([a-z_]+)\/transformer_layers_on_gpu$/.exec(key);
    if (layers) page.charts.layers.add(layers[1], step, value);
  }
  showProgress(step, null);
}

function onGpu(data, time) {
  const gpus = data.gpus || [];
  for (const gpu of gpus) {
    page.charts["gpu-util"].add(`GPU ${gpu.index}`, time, gpu.utilization_ratio);
    if (gpu.memory_total_bytes) {
      page.charts["gpu-memory"].add(`GPU ${gpu.index}`, time, gpu.memory_used_bytes / gpu.memory_total_bytes);
    }
    page.charts["gpu-power"].add(`GPU ${gpu.index}`, time, gpu.power_watts);
    // PCIe counters come on a slower cadence (null until the first one): add() skips what is missing.
    page.charts["gpu-pcie"].add(`GPU ${gpu.index} tx`, time, gpu.pcie_tx_bytes_per_second);
    page.charts["gpu-pcie"].add(`GPU ${gpu.index} rx`, time, gpu.pcie_rx_bytes_per_second);
  }
  if (!data.nvml && gpus.length === 0) {
    for (const name of GPU_CHARTS) page.charts[name].setEmptyText("no GPU: NVML is not available");
  }
  const host = data.host;
  if (host) {
    page.charts.host.add("CPU", time, host.cpu_ratio);
    if (host.memory_total_bytes) page.charts.host.add("memory", time, host.memory_used_bytes / host.memory_total_bytes);
  }
}

function onOffload(data, time) {
  const copies = data.copies || [];
  for (const copy of copies) page.offloadCopies.push([time, copy.seconds, copy.bytes]);
  page.offloadCopies = page.offloadCopies.filter(([when]) => when >= time - OFFLOAD_WINDOW_S);
  if (copies.length && page.offloadCopies.length) {
    const durations = page.offloadCopies.map(([, seconds]) => seconds).sort((a, b) => a - b);
    page.charts["offload-latency"].add("p50", time, percentile(durations, 50));
    page.charts["offload-latency"].add("p99", time, percentile(durations, 99));
    const busy = durations.reduce((sum, seconds) => sum + seconds, 0);
    const bytes = page.offloadCopies.reduce((sum, [, , size]) => sum + size, 0);
    if (busy > 0) page.charts["offload-bandwidth"].add("bandwidth", time, bytes / busy);
  }
  if (data.summary) showOffloadSummary(data.summary);
}

// Linear interpolation between the closest ranks, as the daemon's own percentiles (api.hub).
function percentile(sorted, q) {
  const position = ((sorted.length - 1) * q) / 100;
  const below = Math.floor(position);
  const above = Math.min(below + 1, sorted.length - 1);
  return sorted[below] + (sorted[above] - sorted[below]) * (position - below);
}

function onPhase(data) {
  $("phase").textContent = data.phase ? `phase: ${data.phase}` : "";
}

function onRestart(data, time, seq) {
  onLog({ level: "warning", source: "daemon", message: `trainer restart (${data.reason || "?"})` }, time, seq);
}

// A gap with nothing lost is the stream resuming from the history after the page fell behind: every
// event still arrives, in order. One that lost events goes where they are missing: after the last
// event received (the gap's seq is that event's).
function onGap(data, time, seq) {
  if (!data.lost) return;
  onLog({ level: "warning", source: "page", message: `missed ${data.lost} events (${data.reason})` },
        page.lastTime ?? time, seq + 0.5);
}

// Newest first (the panel scrolls: the top is what a reader sees), ordered by when each line was
// written: a trainer's lines reach the daemon later than its own (those of the trainer's start wait for
// its connection), and a replayed history arrives before the live lines it is older than.
function onLog(data, time, seq) {
  const written = Number.isFinite(data.time) ? data.time : time;
  const item = document.createElement("li");
  item.dataset.level = data.level;
  item.dataset.time = String(written);
  item.dataset.seq = String(seq);
  const when = document.createElement("time");
  when.textContent = new Date(written * 1000).toTimeString().slice(0, 8);
  item.append(when, ` ${data.source || ""} ${data.message}`);
  const log = $("log");
  const newer = (other) => {
    const otherTime = Number(other.dataset.time);
    return otherTime > written || (otherTime === written && Number(other.dataset.seq) > seq);
  };
  let next = log.firstElementChild;
  while (next && newer(next)) next = next.nextElementSibling;
  log.insertBefore(item, next);
  while (log.children.length > LOG_LINES) log.lastElementChild.remove();
}

// ---------------------------------------------------------------------------------- status panels

function showStatus(status) {
  const run = status.run || {};
  $("run-name").textContent = run.name ? `· ${run.name}` : "";
  document.title = run.name ? `verl · ${run.name}` : "verl run";
  $("run-state").textContent = run.state || "";
  $("run-state").dataset.state = run.state || "";
  const progress = status.progress || {};
  showProgress(progress.step, progress.total_steps);
  onPhase(progress);
  const restarts = status.restarts || {};
  $("restarts").textContent = restarts.total ? `restarts: ${restarts.total}/${restarts.max}` : "";
  if (status.settings) showSettingsState(status.settings);
  showOffloadSummary((status.offload || {}).summary || []);
}

function showProgress(step, total) {
  const bar = $("progress-bar");
  if (total) bar.max = total;
  if (Number.isFinite(step)) bar.value = step;
  $("progress-text").textContent = `step ${bar.value} / ${bar.max}`;
  $("progress").hidden = false;
}

// `device` holds the group (on a CPU-only run: the CPU, whatever the placement); `placement` is the
// offload_policy's: cpu means offloaded to the host.
function showOffloadSummary(summary) {
  const rows = summary.map((entry) => row([entry.role, entry.group, entry.device,
                                            entry.placement === "cpu" ? "yes" : "no", formatBytes(entry.bytes)]));
  $("offload").tBodies[0].replaceChildren(...rows);
  const offloaded = summary.filter((entry) => entry.placement === "cpu");
  const computing = summary.some((entry) => entry.placement === "gpu" && entry.device === "cpu")
    ? "; the run computes on the CPU" : "";
  $("offload-note").textContent = summary.length === 0
    ? "no summary yet: every group stays on the compute device until the offload engine reports"
    : `${offloaded.length} of ${summary.length} groups offloaded to the host (${formatBytes(
      offloaded.reduce((sum, entry) => sum + entry.bytes, 0))})${computing}`;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    td.textContent = cell;
    tr.append(td);
  }
  return tr;
}

// ------------------------------------------------------------------------------------ live settings

function showSettingsTable(described) {
  const rows = described.settings.map((setting) => {
    const tr = row([setting.name, formatValue(setting.value), setting.applied_by]);
    tr.cells[0].replaceChildren(...breakableName(setting.name));
    tr.title = setting.short_name ? `${setting.description} (also taken as ${setting.short_name})`
                                  : setting.description;
    tr.dataset.setting = setting.name;
    return tr;
  });
  $("settings").tBodies[0].replaceChildren(...rows);
  showSettingsState(described);
}

// A dotted name that may wrap after each dot in a narrow column: <wbr> adds nothing to the text copied.
function breakableName(name) {
  return name.split(".").flatMap((part, index) => (index ? [document.createElement("wbr"), `.${part}`] : [part]));
}

// The settings part of /v1/status, a "settings" event or the GET /v1/settings body.
function showSettingsState(state) {
  for (const [name, value] of Object.entries(state.values || {})) {
    const tr = $("settings").querySelector(`tr[data-setting="${CSS.escape(name)}"]`);
    if (tr) tr.cells[1].textContent = formatValue(value);
  }
  const minimum = (state.values || {})[LAYER_MINIMUM];
  if (minimum !== undefined) page.charts.layers.setLine(LAYER_MINIMUM, minimum);
  const threshold = (state.values || {})[THRESHOLD];
  if (threshold !== undefined && threshold !== page.threshold) {
    page.threshold = threshold;
    page.charts["gpu-memory"].setLine("threshold", threshold);
    const input = $("threshold-input");
    if (document.activeElement !== input) input.value = String(threshold);
  }
  const acknowledged = state.acknowledged_version >= state.version;
  $("settings-version").textContent = state.version
    ? `version ${state.version}: ${acknowledged ? `in effect from step ${state.applied_at_step ?? "?"}`
                                              : "waiting for the trainer's next safe point"}`
    : "as started (version 0)";
}

function formatValue(value) {
  return typeof value === "number" ? formatNumber(value) : String(value);
}

async function submitThreshold(event) {
  event.preventDefault();
  const input = $("threshold-input");
  const result = $("threshold-result");
  const value = Number(input.value);
  if (input.value.trim() === "" || !Number.isFinite(value)) {
    showResult("error", "enter a number: the fraction of GPU memory in use, above 0 and at most 1");
    return;
  }
  result.textContent = "sending…";
  try {
    const answer = await api("/v1/settings", { method: "PATCH", body: JSON.stringify({ [THRESHOLD]: value }) });
    const changed = Object.keys(answer.new).length > 0;
    showResult("ok", changed
      ? `${formatValue(answer.old[THRESHOLD])} → ${formatValue(answer.new[THRESHOLD])}: ` +
        `version ${answer.version}, the trainer applies it at step ${answer.applies_at_step}`
      : `already ${formatValue(value)}: nothing changed`);
    showSettingsState({ values: answer.values, version: answer.version, acknowledged_version: 0 });
  } catch (error) {
    showResult("error", error.message);
  }
}

function showResult(kind, text) {
  const result = $("threshold-result");
  result.dataset.kind = kind;
  result.textContent = text;
}

// -------------------------------------------------------------------------------------------- hints

async function refreshHints() {
  const body = await api("/v1/hints");
  const items = body.hints.map((hint) => {
    const item = document.createElement("li");
    item.textContent = hint;
    return item;
  });
  if (items.length === 0) {
    const item = document.createElement("li");
    item.className = "quiet";
    item.textContent = "Nothing looks wrong.";
    items.push(item);
  }
  $("hints").replaceChildren(...items);
}

// --------------------------------------------------------------------------------------------- start

function every(milliseconds, task) {
  const run = () => {
    if (!page.locked) task().catch(() => {});
  };
  window.setInterval(run, milliseconds);
}

async function main() {
  page.token = takeToken();
  if (!page.token) {
    lock("This page needs the run's token", "It was opened without one.");
    return;
  }
  let status;
  let settings;
  try {
    [status, settings] = await Promise.all([api("/v1/status"), api("/v1/settings")]);
  } catch (error) {
    if (!page.locked) lock("The daemon does not answer", error.message);
    return;
  }
  $("dashboard").hidden = false;
  buildCharts();
  showSettingsTable(settings);
  showStatus(status);
  $("threshold-form").addEventListener("submit", submitThreshold);
  document.body.dataset.state = "ready";
  connectStream();
  refreshHints().catch(() => {});
  every(HINTS_POLL_MS, refreshHints);
  every(STATUS_POLL_MS, async () => showStatus(await api("/v1/status")));
}

main();
