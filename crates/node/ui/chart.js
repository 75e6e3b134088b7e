// Throughput over time: this node's `/metrics` read every few seconds; per model the
// tokens generated per second and the mean time to first token of the answers that
// started in each interval, as two small line charts over the last five minutes.

import { h, s, fill } from "./util.js";
import { send } from "./api.js";

const EVERY = 2000;
const SPAN = 300; // seconds shown
const COLORS = ["#1f6feb", "#d4622a", "#1a7f37", "#8250df", "#bf3989", "#9a6700"];

let view = null;
let last = null; // the previous reading
const series = new Map(); // model → [{t, tps, ttft}]

/** Per model: generated tokens, TTFT sum and count, from the Prometheus text. */
export function parse(text) {
  const out = new Map();
  const get = (m) => out.get(m) || (out.set(m, { tokens: 0, ttftSum: 0, ttftCount: 0 }), out.get(m));
  for (const line of text.split("\n")) {
    const m = line.match(/^(shoal_[a-z_]+)\{([^}]*)\}\s+([0-9.eE+-]+)/);
    if (!m) continue;
    const model = m[2].match(/model="([^"]*)"/)?.[1];
    if (model === undefined) continue;
    const v = Number(m[3]);
    if (m[1] === "shoal_generated_tokens_total") get(model).tokens = v;
    else if (m[1] === "shoal_time_to_first_token_seconds_sum") get(model).ttftSum = v;
    else if (m[1] === "shoal_time_to_first_token_seconds_count") get(model).ttftCount = v;
  }
  return out;
}

async function read() {
  try {
    const r = await send("GET", "/metrics");
    const now = performance.now() / 1000;
    const reading = { t: now, models: parse(await r.text()) };
    if (last) {
      const dt = now - last.t;
      for (const [model, v] of reading.models) {
        const p = last.models.get(model) || { tokens: 0, ttftSum: 0, ttftCount: 0 };
        const answers = v.ttftCount - p.ttftCount;
        const point = {
          t: now,
          tps: Math.max(0, (v.tokens - p.tokens) / dt),
          ttft: answers > 0 ? (v.ttftSum - p.ttftSum) / answers : null,
        };
        const list = series.get(model) || [];
        list.push(point);
        while (list.length && list[0].t < now - SPAN) list.shift();
        series.set(model, list);
      }
    }
    last = reading;
    draw(now);
  } catch (_) {
    /* the next reading tries again */
  }
}

function plot(title, unit, key, now) {
  const W = 300;
  const H = 150;
  const pad = { l: 40, r: 8, t: 18, b: 18 };
  let max = 0;
  for (const list of series.values()) for (const p of list) if (p[key] !== null) max = Math.max(max, p[key]);
  max = max > 0 ? max * 1.15 : 1;
  const x = (t) => pad.l + ((t - (now - SPAN)) / SPAN) * (W - pad.l - pad.r);
  const y = (v) => H - pad.b - (v / max) * (H - pad.t - pad.b);
  const lines = [...series.entries()].map(([model, list], i) => {
    const color = COLORS[i % COLORS.length];
    const shown = list.filter((p) => p[key] !== null);
    const pts = shown.map((p) => `${x(p.t).toFixed(1)},${y(p[key]).toFixed(1)}`);
    return s("g", {},
      s("polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 2 }, s("title", {}, model)),
      // A lone reading still shows.
      shown.map((p) => s("circle", { cx: x(p.t), cy: y(p[key]), r: 2, fill: color })));
  });
  return s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title },
    s("text", { x: pad.l, y: 12 }, `${title} (${unit})`),
    s("line", { class: "axis", x1: pad.l, y1: H - pad.b, x2: W - pad.r, y2: H - pad.b }),
    s("line", { class: "axis", x1: pad.l, y1: pad.t, x2: pad.l, y2: H - pad.b }),
    s("text", { x: pad.l - 4, y: pad.t + 4, "text-anchor": "end" }, max >= 10 ? max.toFixed(0) : max.toFixed(2)),
    s("text", { x: pad.l - 4, y: H - pad.b, "text-anchor": "end" }, "0"),
    s("text", { x: W - pad.r, y: H - 4, "text-anchor": "end" }, "now"),
    s("text", { x: pad.l, y: H - 4 }, "−5 min"),
    lines);
}

function draw(now) {
  if (!view) return;
  const models = [...series.keys()];
  const latest = (m) => series.get(m).at(-1);
  fill(view,
    models.length ? null : h("p", { class: "muted" }, "No answers through this node yet."),
    h("div", { class: "charts" },
      h("div", { class: "chart" }, plot("generated tokens/s", "tok/s", "tps", now)),
      h("div", { class: "chart" }, plot("time to first token", "s", "ttft", now))),
    h("div", { class: "row" }, models.map((m, i) => h("span", { style: { color: COLORS[i % COLORS.length] } },
      `■ ${m}: ${latest(m).tps.toFixed(1)} tok/s`))));
}

export function mount(el) {
  view = el;
  draw(performance.now() / 1000);
  read();
  setInterval(read, EVERY);
}
