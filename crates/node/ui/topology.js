// The machines: a graph of the nodes and the links between them (round trip and
// bandwidth as each node measured them), then a card per machine with its memory,
// cores, GPUs, models and ranks.

import { h, s, bytes, rate, nodeName, bar, fill } from "./util.js";

function backend(r) {
  const b = r.resources?.backend;
  if (b && b.kind === "cuda") {
    const n = b.count || 1;
    return `${n}× ${b.name} · ${bytes(b.memory_total - b.memory_free)} / ${bytes(b.memory_total)} each`;
  }
  return "CPU";
}

function linkLabel(a, b) {
  const l = a.links?.[b.id] || b.links?.[a.id];
  if (!l) return "measuring…";
  const ms = l.rtt_us / 1000;
  return `${ms <= 1 ? "≤1" : ms.toFixed(0)} ms · ${rate(l.bandwidth)}`;
}

function graph(nodes, masterId, meId, width) {
  // Drawn at the width it is shown at, so that its text stays readable on a phone.
  const W = Math.max(320, Math.min(900, width || 720));
  const H = nodes.length > 2 ? 300 : 170;
  const r = 30;
  const at = nodes.map((_, i) => {
    if (nodes.length === 1) return [W / 2, H / 2 - 10];
    if (nodes.length === 2) return [W * (0.22 + 0.56 * i), H / 2 - 10];
    const a = (2 * Math.PI * i) / nodes.length - Math.PI / 2;
    return [W / 2 + Math.cos(a) * (W * 0.3), H / 2 - 10 + Math.sin(a) * (H * 0.34)];
  });
  const links = [];
  for (let i = 0; i < nodes.length; i++) {
    for (let j = i + 1; j < nodes.length; j++) {
      const [x1, y1] = at[i];
      const [x2, y2] = at[j];
      links.push(
        s("line", { class: "link", x1, y1, x2, y2 }),
        s("text", { class: "link-label", x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 6, "text-anchor": "middle" },
          linkLabel(nodes[i], nodes[j])),
      );
    }
  }
  const circles = nodes.map((n, i) => {
    const [x, y] = at[i];
    const total = n.resources?.memory_total || 1;
    const used = total - (n.resources?.memory_free ?? total);
    const arc = 2 * Math.PI * (r + 5);
    return s("g", { "data-testid": "graph-node" },
      s("circle", { class: `machine ${n.id === masterId ? "master" : ""}`, cx: x, cy: y, r }),
      // The ring around a machine is its memory in use.
      s("circle", { cx: x, cy: y, r: r + 5, fill: "none", class: "mem-bg", stroke: "var(--bar)", "stroke-width": 4 }),
      s("circle", { cx: x, cy: y, r: r + 5, fill: "none", stroke: "var(--accent)", "stroke-width": 4,
        "stroke-dasharray": `${(arc * used) / total} ${arc}`, transform: `rotate(-90 ${x} ${y})` }),
      s("text", { x, y: y + 5, "text-anchor": "middle" }, n.id === masterId ? "★" : n.id === meId ? "●" : ""),
      s("text", { x, y: y + r + 24, "text-anchor": "middle" }, nodeName(n)),
    );
  });
  return s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "the machines and their links" },
    links, circles);
}

function ranksOn(store, id) {
  let n = 0;
  for (const i of store.status.instances || []) for (const r of i.ranks) if (r.node === id) n++;
  return n;
}

function card(store, n) {
  const st = store.status;
  const total = n.resources?.memory_total || 0;
  const used = total - (n.resources?.memory_free ?? total);
  const fetching = Object.entries(n.fetching || {});
  return h("div", { class: "card", "data-testid": "machine", "data-node-id": n.id },
    h("header", {},
      h("b", {}, nodeName(n)),
      n.id === st.master_id ? h("span", { class: "badge master" }, "master") : null,
      n.id === st.node_id ? h("span", { class: "badge" }, "this node") : null),
    h("div", { class: "muted" }, `${n.http} · ${n.resources?.cores ?? "?"} cores · ${backend(n)}`),
    h("div", { class: "row" }, h("span", { class: "muted" }, "memory"),
      bar(total ? used / total : 0, `${bytes(used)} / ${bytes(total)}`)),
    h("div", { class: "muted" },
      `${(n.models || []).length} model file${(n.models || []).length === 1 ? "" : "s"} · ${ranksOn(store, n.id)} rank(s)`),
    fetching.map(([m, pct]) => h("div", { class: "row" }, h("span", { class: "muted" }, `${m} arriving`), bar(pct / 100))),
  );
}

export function render(el, store) {
  const st = store.status;
  if (!st) {
    fill(el, h("p", { class: "muted" }, store.error || "waiting for the node…"));
    return;
  }
  const nodes = [...(st.nodes || [])].sort((a, b) => a.id.localeCompare(b.id));
  el.classList.add("topo");
  fill(el,
    nodes.length ? graph(nodes, st.master_id, st.node_id, el.clientWidth) : h("p", { class: "muted" }, "no machines yet"),
    h("div", { class: "cards", style: { gridTemplateColumns: "repeat(auto-fit, minmax(240px, 1fr))" } },
      nodes.map((n) => card(store, n))),
  );
}
