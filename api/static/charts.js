// Line charts on <canvas> for the live page.
//
// Written here rather than vendored: the page must load nothing from the network, and the few
// features it needs (lines over step or time, reference lines, a legend with the latest values,
// the point count and reference lines as data- attributes for tests) take less code than a
// charting library's smallest build.

export const PALETTE = ["#3b6fd8", "#e4572e", "#2a9d5c", "#a356c4", "#d4a017", "#17a2b8", "#c2185b", "#6d7b8d",
                        "#8c6d31", "#5e60ce"];

const MARGIN = { left: 58, right: 12, top: 10, bottom: 24 };

export function formatNumber(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  const size = Math.abs(value);
  if (size !== 0 && (size >= 1e5 || size < 1e-3)) return value.toExponential(2);
  if (Number.isInteger(value)) return String(value);
  if (size >= 100) return value.toFixed(0);
  if (size >= 10) return value.toFixed(1);
  return value.toFixed(3).replace(/\.?0+$/, "") || "0";
}

export function formatRatio(value) {
  if (!Number.isFinite(value)) return "–";
  return `${(value * 100).toFixed(value > 0 && value < 0.1 ? 1 : 0)}%`;
}

export function formatBytes(value) {
  if (!Number.isFinite(value)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let size = value;
  let unit = 0;
  while (Math.abs(size) >= 1024 && unit < units.length - 1) {
    size /= 1024;
    unit += 1;
  }
  return `${size.toFixed(size >= 100 || unit === 0 ? 0 : 1)} ${units[unit]}`;
}

export function formatSeconds(value) {
  if (!Number.isFinite(value)) return "–";
  if (value === 0) return "0 s";
  if (Math.abs(value) < 1e-3) return `${(value * 1e6).toFixed(0)} µs`;
  if (Math.abs(value) < 1) return `${(value * 1e3).toFixed(value < 0.01 ? 2 : 0)} ms`;
  return `${formatNumber(value)} s`;
}

function formatClock(epochSeconds) {
  const date = new Date(epochSeconds * 1000);
  return date.toTimeString().slice(0, 8);
}

// Round tick positions covering [low, high]: steps of 1, 2 or 5 times a power of ten.
export function niceTicks(low, high, wanted = 4) {
  if (!(high > low)) return [low];
  const rough = (high - low) / wanted;
  const power = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].map((factor) => factor * power).find((candidate) => candidate >= rough);
  const ticks = [];
  for (let tick = Math.ceil(low / step) * step; tick <= high + step * 1e-9; tick += step) {
    ticks.push(Math.abs(tick) < step * 1e-9 ? 0 : tick);
  }
  return ticks;
}

export class LineChart {
  // canvas: where to draw; legend: an element for the series' names and latest values.
  // options: x ("step" or "time"), format (y values), yMin/yMax (fixed ends, e.g. 0 and 1 for
  // ratios), windowSeconds (time charts keep this much), maxPoints (per series), empty (text while
  // there is nothing to draw).
  constructor(canvas, legend, options = {}) {
    this.canvas = canvas;
    this.legend = legend;
    this.x = options.x || "step";
    this.format = options.format || formatNumber;
    this.yMin = options.yMin;
    this.yMax = options.yMax;
    this.windowSeconds = options.windowSeconds || 900;
    this.maxPoints = options.maxPoints || 4000;
    this.empty = options.empty || "waiting for data";
    this.series = new Map();
    this.lines = new Map();
    this.points = 0;
    this.pending = false;
    new ResizeObserver(() => this.redraw()).observe(canvas);
  }

  add(name, x, y) {
    if (y === null || y === undefined || !Number.isFinite(y) || !Number.isFinite(x)) return;
    let series = this.series.get(name);
    if (!series) {
      series = { color: PALETTE[this.series.size % PALETTE.length], points: [] };
      this.series.set(name, series);
    }
    series.points.push([x, y]);
    this.points += 1;
    this.prune(series, x);
    this.countChanged();
  }

  // Forget points at x and beyond: a trainer restarted from a checkpoint redoes those steps.
  dropFrom(x) {
    for (const series of this.series.values()) {
      const keep = series.points.findIndex((point) => point[0] >= x);
      if (keep >= 0) {
        this.points -= series.points.length - keep;
        series.points.length = keep;
      }
    }
    this.countChanged();
  }

  // A dashed horizontal reference (e.g. the memory threshold); null removes it.
  setLine(name, value) {
    if (this.lines.get(name) === (value ?? undefined)) return; // status polls repeat the same settings
    if (value === null || value === undefined) this.lines.delete(name);
    else this.lines.set(name, value);
    this.canvas.dataset.lines = JSON.stringify(Object.fromEntries(this.lines)); // like data-points, for tests
    this.redraw();
  }

  setEmptyText(text) {
    this.empty = text;
    this.redraw();
  }

  prune(series, newest) {
    const points = series.points;
    let drop = 0;
    if (this.x === "time") {
      while (drop < points.length && points[drop][0] < newest - this.windowSeconds) drop += 1;
    }
    drop = Math.max(drop, points.length - this.maxPoints);
    if (drop > 0) {
      points.splice(0, drop);
      this.points -= drop;
    }
  }

  countChanged() {
    // Tests (and curious readers of the DOM) see how much each chart holds without waiting for a frame.
    this.canvas.dataset.points = String(this.points);
    this.redraw();
  }

  redraw() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  extent() {
    let xLow = Infinity;
    let xHigh = -Infinity;
    let yLow = Infinity;
    let yHigh = -Infinity;
    for (const series of this.series.values()) {
      for (const [x, y] of series.points) {
        xLow = Math.min(xLow, x);
        xHigh = Math.max(xHigh, x);
        yLow = Math.min(yLow, y);
        yHigh = Math.max(yHigh, y);
      }
    }
    for (const value of this.lines.values()) {
      yLow = Math.min(yLow, value);
      yHigh = Math.max(yHigh, value);
    }
    if (this.yMin !== undefined) yLow = Math.min(this.yMin, yLow);
    if (this.yMax !== undefined) yHigh = Math.max(this.yMax, yHigh);
    if (yHigh - yLow < 1e-12) {
      const pad = Math.abs(yHigh) * 0.1 || 1;
      yLow -= pad;
      yHigh += pad;
    } else if (this.yMin === undefined || this.yMax === undefined) {
      const pad = (yHigh - yLow) * 0.06;
      if (this.yMin === undefined) yLow -= pad;
      if (this.yMax === undefined) yHigh += pad;
    }
    if (xHigh <= xLow) {
      xLow -= 1;
      xHigh += 1;
    }
    return { xLow, xHigh, yLow, yHigh };
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const context = canvas.getContext("2d");
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    context.clearRect(0, 0, width, height);
    context.font = "11px system-ui, sans-serif";
    this.drawLegend();
    if (this.points === 0) {
      context.fillStyle = "#8a94a6";
      context.textAlign = "center";
      context.fillText(this.empty, width / 2, height / 2);
      return;
    }
    const extent = this.extent();
    const yTicks = niceTicks(extent.yLow, extent.yHigh).map((tick) => [tick, this.format(tick)]);
    // Room for the widest y label ("17.5 GiB/s" needs more than "0.5").
    const labelWidth = Math.max(...yTicks.map(([, label]) => context.measureText(label).width));
    const left = Math.max(MARGIN.left, Math.ceil(labelWidth) + 12);
    const box = { left, top: MARGIN.top, right: width - MARGIN.right, bottom: height - MARGIN.bottom };
    const toX = (x) => box.left + ((x - extent.xLow) / (extent.xHigh - extent.xLow)) * (box.right - box.left);
    const toY = (y) => box.bottom - ((y - extent.yLow) / (extent.yHigh - extent.yLow)) * (box.bottom - box.top);
    this.drawAxes(context, box, extent, yTicks, toX, toY);
    for (const [name, value] of this.lines) this.drawReference(context, box, toY(value), name, value);
    for (const series of this.series.values()) this.drawSeries(context, series, toX, toY);
  }

  drawAxes(context, box, extent, yTicks, toX, toY) {
    context.strokeStyle = "#e3e7ee";
    context.fillStyle = "#5b6475";
    context.lineWidth = 1;
    context.textAlign = "right";
    context.textBaseline = "middle";
    for (const [tick, label] of yTicks) {
      const y = Math.round(toY(tick)) + 0.5;
      context.beginPath();
      context.moveTo(box.left, y);
      context.lineTo(box.right, y);
      context.stroke();
      context.fillText(label, box.left - 6, y);
    }
    context.textAlign = "center";
    context.textBaseline = "top";
    const xTicks = this.x === "time"
      ? niceTicks(extent.xLow, extent.xHigh, 3)
      : niceTicks(extent.xLow, extent.xHigh, 5).filter((tick) => Number.isInteger(tick));
    for (const tick of xTicks) {
      const x = toX(tick);
      context.fillText(this.x === "time" ? formatClock(tick) : String(tick), x, box.bottom + 6);
    }
    context.strokeStyle = "#b8c0cc";
    context.beginPath();
    context.moveTo(box.left, box.top);
    context.lineTo(box.left, box.bottom);
    context.lineTo(box.right, box.bottom);
    context.stroke();
  }

  drawReference(context, box, y, name, value) {
    context.save();
    context.strokeStyle = "#c0392b";
    context.setLineDash([6, 4]);
    context.beginPath();
    context.moveTo(box.left, y);
    context.lineTo(box.right, y);
    context.stroke();
    context.restore();
    context.fillStyle = "#c0392b";
    context.textAlign = "right";
    context.textBaseline = "bottom";
    context.fillText(`${name} ${this.format(value)}`, box.right, y - 2);
  }

  drawSeries(context, series, toX, toY) {
    const points = series.points;
    if (points.length === 0) return;
    context.strokeStyle = series.color;
    context.fillStyle = series.color;
    context.lineWidth = 1.6;
    if (points.length === 1) {
      context.beginPath();
      context.arc(toX(points[0][0]), toY(points[0][1]), 2.5, 0, 2 * Math.PI);
      context.fill();
      return;
    }
    context.beginPath();
    points.forEach(([x, y], index) => (index ? context.lineTo(toX(x), toY(y)) : context.moveTo(toX(x), toY(y))));
    context.stroke();
  }

  drawLegend() {
    if (!this.legend) return;
    const items = [];
    for (const [name, series] of this.series) {
      const last = series.points[series.points.length - 1];
      const item = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = series.color;
      item.append(swatch, `${name} `);
      const value = document.createElement("b");
      value.textContent = last ? this.format(last[1]) : "–";
      item.append(value);
      items.push(item);
    }
    this.legend.replaceChildren(...items);
  }
}
