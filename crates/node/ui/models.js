// The models: every model this build knows or a node holds, and on each machine
// whether its file is there, on its way (with a progress bar and its rate), or absent.

import { h, bytes, rate, nodeName, bar, fill } from "./util.js";

export function render(el, store) {
  const st = store.status;
  if (!st) return fill(el);
  const nodes = [...(st.nodes || [])].sort((a, b) => a.id.localeCompare(b.id));
  const known = new Map(store.catalog.map((c) => [c.name, c]));
  const names = new Set(known.keys());
  for (const n of nodes) {
    for (const m of n.models || []) names.add(m);
    for (const m of Object.keys(n.fetching || {})) names.add(m);
  }
  const served = (m) => (st.instances || []).filter((i) => i.model === m);
  const cell = (n, m) => {
    const card = known.get(m);
    if (m in (n.fetching || {})) {
      const pct = n.fetching[m];
      const r = store.arrivalRate(n.id, m, card?.size);
      return h("td", { "data-testid": "arriving" }, bar(pct / 100, `${pct} %${r ? ` · ${rate(r)}` : ""}`));
    }
    if ((n.models || []).includes(m)) return h("td", { "data-testid": "installed", title: "installed" }, "✓ installed");
    return h("td", { class: "muted" }, "–");
  };
  const rows = [...names].sort().map((m) => {
    const card = known.get(m);
    const inst = served(m);
    return h("tr", { "data-testid": "model-row", "data-model": m },
      h("td", {}, h("b", {}, m), h("div", { class: "muted" },
        card ? `${card.parameters} · ${bytes(card.size)} · ctx ${card.context_length}${card.tools ? " · tools" : ""}` : "not a known model")),
      h("td", {}, inst.length ? `${inst.length} instance${inst.length === 1 ? "" : "s"}` : h("span", { class: "muted" }, "none")),
      nodes.map((n) => cell(n, m)),
    );
  });
  fill(el, h("div", { class: "scroll" }, h("table", {},
    h("thead", {}, h("tr", {}, h("th", {}, "model"), h("th", {}, "serving"), nodes.map((n) => h("th", {}, nodeName(n))))),
    h("tbody", {}, rows))));
}
