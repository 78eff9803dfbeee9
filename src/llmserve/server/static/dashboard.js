// The live dashboard: polls GET /v1/status every second and draws cards, a latency
// table, three charts and (with a gateway and an admin key) per-tenant usage.
import {ApiError, getJSON, getKey, setKey} from "./api.js";
import {PALETTE, drawLines, legend, short} from "./charts.js";

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
  setText("tok-in", short(win.prompt_tokens_per_s));
  setText("tok-out", short(win.generation_tokens_per_s));
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
