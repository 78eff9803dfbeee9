// Line charts on <canvas>, drawn by hand (no library): a few series over time.

function cssVar(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

export const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/** A short human form of a number (1.2k, 3.4M). */
export function short(value) {
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
export function drawLines(canvas, times, series, {yMax = 0} = {}) {
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
export function legend(element, series) {
  element.replaceChildren(...series.map((s, i) => {
    const span = document.createElement("span");
    const swatch = document.createElement("span");
    swatch.textContent = "■ ";
    swatch.style.color = s.color || PALETTE[i % PALETTE.length];
    span.append(swatch, document.createTextNode(`${s.label} ${short(s.last)}   `));
    return span;
  }));
}
