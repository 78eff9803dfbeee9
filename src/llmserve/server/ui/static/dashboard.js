// The live dashboard: polls GET /v1/status every second and draws cards, a latency
// table, three line charts on <canvas> (drawn here, no library) and, with a gateway and
// an admin key, per-tenant usage.
import {ApiError, getJSON, getKey, setKey} from "./api.js";

// ------------------------------------------------------------------ charts
function cssVar(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/** A short human form of a number (1.2k, 3.4M). */
function short(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const abs = Math.abs(value);
  if (abs >= 1e6) return (value / 1e6).toFixed(1) + "M";
  if (abs >= 1e4) return (value / 1e3).toFixed(1) + "k";
  if (Number.isInteger(value)) return String(value);
  return value.toFixed(abs >= 100 ? 0 : 1);
}

/**
 * Draw `series` ([{label, values: [number], color}]) against `times` (seconds) on
 * `canvas`; the y axis runs from 0 to max(`yMax`, the largest value).
 */
function drawLines(canvas, times, series, {yMax = 0} = {}) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300;
  const height = canvas.clientHeight || 150;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const text = cssVar("--muted", "#666");
  const grid = cssVar("--line", "#ddd");
  const left = 44, right = 8, top = 8, bottom = 20;
  const plotW = Math.max(10, width - left - right);
  const plotH = Math.max(10, height - top - bottom);
  let top_ = yMax;
  for (const s of series) for (const v of s.values) if (v > top_) top_ = v;
  if (top_ <= 0) top_ = 1;
  const t0 = times.length ? times[0] : 0;
  const t1 = times.length ? times[times.length - 1] : 1;
  const span = Math.max(1, t1 - t0);
  const x = (t) => left + ((t - t0) / span) * plotW;
  const y = (v) => top + plotH - (v / top_) * plotH;

  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = text;
  ctx.strokeStyle = grid;
  ctx.lineWidth = 1;
  for (const frac of [0, 0.5, 1]) {
    const yy = top + plotH - frac * plotH;
    ctx.beginPath();
    ctx.moveTo(left, yy);
    ctx.lineTo(left + plotW, yy);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(short(top_ * frac), left - 4, yy + 4);
  }
  ctx.textAlign = "left";
  ctx.fillText(`-${Math.round(span)} s`, left, height - 4);
  ctx.textAlign = "right";
  ctx.fillText("now", left + plotW, height - 4);

  series.forEach((s, i) => {
    ctx.strokeStyle = s.color || PALETTE[i % PALETTE.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    s.values.forEach((v, j) => {
      const px = x(times[j]), py = y(Math.max(0, v));
      if (j === 0) ctx.moveTo(px, py);
      else ctx.lineTo(px, py);
    });
    ctx.stroke();
  });
}

/** Fill `element` with a text legend: "■ label value" per series (no markup from data). */
function legend(element, series) {
  element.replaceChildren(...series.map((s, i) => {
    const span = document.createElement("span");
    const swatch = document.createElement("span");
    swatch.textContent = "■ ";
    swatch.style.color = s.color || PALETTE[i % PALETTE.length];
    span.append(swatch, document.createTextNode(`${s.label} ${short(s.last)}   `));
    return span;
  }));
}

// ------------------------------------------------------------------ the page

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
let last = null;

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds >= 1 ? seconds.toFixed(2) + " s" : (seconds * 1000).toFixed(1) + " ms";
}

function pct(ratio) {
  return ratio === null || ratio === undefined ? "–" : (ratio * 100).toFixed(1) + " %";
}

function setText(id, text) {
  $(id).textContent = text;
}

function latencyRow(id, lat) {
  const cells = $(id).querySelectorAll("td");
  [ms(lat.p50), ms(lat.p90), ms(lat.p99), short(lat.count)].forEach((t, i) => {
    cells[i].textContent = t;
  });
}

function tenants(status) {
  const panel = $("tenants-panel");
  panel.hidden = !status.gateway;
  const table = $("tenants");
  table.hidden = !status.tenants;
  if (!status.tenants) return;
  const rows = Object.entries(status.tenants).sort(([a], [b]) => a.localeCompare(b))
    .map(([name, u]) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = name;
      tr.appendChild(th);
      for (const key of ["requests", "errors", "prompt_tokens", "cached_tokens",
                         "completion_tokens"]) {
        const td = document.createElement("td");
        td.textContent = short(u[key]);
        tr.appendChild(td);
      }
      return tr;
    });
  table.tBodies[0].replaceChildren(...rows);
}

function chart(canvasId, legendId, times, series, opts) {
  drawLines($(canvasId), times, series, opts);
  legend($(legendId), series.map((s) => ({...s, last: s.values[s.values.length - 1]})));
}

function draw(status) {
  last = status;
  const now = status.now, win = status.window;
  setText("running", short(now.running));
  setText("waiting", short(now.waiting));
  setText("kv", `${short(now.kv_blocks_used)} / ${short(now.kv_blocks_total)}`);
  $("kv").dataset.used = String(now.kv_blocks_used);
  setText("hit-rate", pct(win.prefix_cache_hit_rate));
  const newest = status.series[status.series.length - 1] || {};
  setText("tok-in", short(newest.prompt_tokens_per_s));
  setText("tok-out", short(newest.generation_tokens_per_s));
  setText("tok-in-avg", `window average ${short(win.prompt_tokens_per_s)}`);
  setText("tok-out-avg", `window average ${short(win.generation_tokens_per_s)}`);
  setText("preemptions", `${short(win.preemptions)} / ${short(status.totals.preemptions)}`);
  setText("aborted", `${short(win.aborted)} / ${short(win.rejected)}`);
  latencyRow("lat-ttft", status.latency.ttft);
  latencyRow("lat-itl", status.latency.itl);
  const times = status.series.map((p) => p.t);
  const col = (key) => status.series.map((p) => p[key]);
  chart("chart-requests", "legend-requests", times, [
    {label: "running", values: col("running"), color: PALETTE[0]},
    {label: "waiting", values: col("waiting"), color: PALETTE[1]}]);
  chart("chart-kv", "legend-kv", times, [
    {label: `used of ${short(now.kv_blocks_total)}`, values: col("kv_blocks_used"),
     color: PALETTE[2]}], {yMax: 1});
  chart("chart-tokens", "legend-tokens", times, [
    {label: "prompt", values: col("prompt_tokens_per_s"), color: PALETTE[0]},
    {label: "generated", values: col("generation_tokens_per_s"), color: PALETTE[3]}]);
  tenants(status);
  const when = new Date(status.time * 1000).toLocaleTimeString();
  setText("updated", `Updated ${when} · window figures cover the last ${Math.round(status.window_s)} s` +
          (status.gateway && !status.admin ? " · per-tenant usage needs the admin key" : ""));
  document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
}

async function poll() {
  const admin = getKey("admin");
  try {
    const status = await getJSON(`/v1/status?window=${$("window").value}`,
                                 {kind: admin ? "admin" : "none"});
    notice("");
    draw(status);
  } catch (err) {
    if (err instanceof ApiError && (err.status === 401 || err.status === 403) && admin) {
      setKey("", "admin");
      notice("The admin key was refused: " + err.message);
    } else {
      notice("Cannot read the status: " + err.message);
    }
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

$("admin-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setKey($("admin-key").value.trim(), "admin");
  $("admin-key").value = "";
});
$("forget-admin").addEventListener("click", () => setKey("", "admin"));
$("window").addEventListener("change", () => last && draw(last));
window.addEventListener("resize", () => last && draw(last));
poll();
