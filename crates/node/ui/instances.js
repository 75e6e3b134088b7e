// The instances: model, strategy, state (failed with its reason), and each rank: the
// machine it runs on, its GPU, the memory placement counts for it and its state
// (fetching or loading with a percent). Delete asks once more before it removes.

import { h, bytes, nodeName, bar, fill } from "./util.js";
import { call } from "./api.js";

/** Instances whose delete button was pressed once, until when. */
const armed = new Map();
let message = null;

function rankState(r) {
  const st = r.status?.state || "idle";
  const d = r.status?.detail;
  if ((st === "fetching" || st === "loading") && typeof d === "number")
    return bar(d, `${st === "fetching" ? "fetching" : "loading"} ${Math.round(d * 100)} %`, "rank-progress");
  if (st === "failed") return h("span", { class: "badge failed", title: d }, `failed: ${d}`);
  return h("span", { class: `badge ${st}` }, st.replace("_", " "));
}

async function remove(store, id) {
  if ((armed.get(id) || 0) < Date.now()) {
    armed.set(id, Date.now() + 4000);
    setTimeout(() => store.refresh(), 4100);
    return store.refresh();
  }
  armed.delete(id);
  try {
    await call("DELETE", `/v1/instances/${encodeURIComponent(id)}`);
    message = null;
  } catch (e) {
    message = `delete ${id}: ${e.message}`;
  }
  store.refresh();
}

export function render(el, store) {
  const st = store.status;
  if (!st) return fill(el);
  const nodes = new Map((st.nodes || []).map((n) => [n.id, n]));
  const load = new Map((st.serving || []).map((l) => [l.instance, l]));
  const list = st.instances || [];
  fill(el,
    message ? h("p", { class: "error" }, message) : null,
    list.length ? null : h("p", { class: "muted" }, "No instances yet: place a model, or just ask one in the chat."),
    h("div", { class: "cards" }, list.map((i) => {
      const state = i.status?.state || "starting";
      const l = load.get(i.id);
      const isArmed = (armed.get(i.id) || 0) > Date.now();
      return h("div", { class: "card", "data-testid": "instance", "data-instance-id": i.id, "data-state": state },
        h("header", {},
          h("b", {}, i.model),
          h("span", { class: `badge ${state}`, "data-testid": "instance-state" }, state),
          h("span", { class: "muted" }, `${i.strategy} · ${i.ranks.length} rank${i.ranks.length === 1 ? "" : "s"} · ctx ${i.context}`),
          h("span", { style: { flex: 1 } }),
          h("button", { class: isArmed ? "danger" : "quiet", "data-testid": "delete", onclick: () => remove(store, i.id) },
            isArmed ? "Really delete?" : "Delete")),
        state === "failed" ? h("p", { class: "error" }, i.status.reason) : null,
        l ? h("div", { class: "muted" }, `serving: ${l.running} running · ${l.prefilling} prefilling · ${l.waiting} waiting`) : null,
        h("div", { class: "scroll" }, h("table", {},
          h("thead", {}, h("tr", {}, h("th", {}, "rank"), h("th", {}, "machine"), h("th", {}, "memory"), h("th", {}, "state"))),
          h("tbody", {}, i.ranks.map((r, k) => h("tr", {},
            h("td", {}, k),
            h("td", {}, nodeName(nodes.get(r.node), r.node), r.gpu !== null && r.gpu !== undefined ? ` · GPU ${r.gpu}` : ""),
            h("td", {}, i.memory?.[k] ? bytes(i.memory[k]) : "–"),
            h("td", {}, rankState(r))))))),
        h("div", { class: "muted", style: { fontSize: "12px" } }, `id ${i.id}${i.attempt ? ` · placed again ${i.attempt}×` : ""}`),
      );
    })));
}
