// Placement: pick a model (and, if you like, a strategy, a rank count and a context),
// see every plan that fits with each machine's share of memory against what it has
// free, and launch one.

import { h, bytes, nodeName, fill } from "./util.js";
import { call } from "./api.js";

let form = null;

export function mount(el, store) {
  const model = h("select", { "data-testid": "place-model", "aria-label": "model" });
  const strategy = h("select", { "data-testid": "place-strategy", "aria-label": "strategy" },
    ["any", "pipeline", "tensor", "sequence"].map((s) => h("option", { value: s }, s)));
  const ranks = h("select", { "data-testid": "place-ranks", "aria-label": "ranks" }, h("option", { value: "" }, "any"));
  const ctx = h("input", { type: "number", min: 64, step: 64, placeholder: "default", "data-testid": "place-ctx", size: 7 });
  const plans = h("div", { class: "cards", "data-testid": "plans" });
  const note = h("p", { class: "muted", "data-testid": "place-note" });
  const preview = h("button", { type: "button", "data-testid": "preview" }, "Preview");
  const body = () => {
    const b = { model: model.value };
    if (strategy.value !== "any") b.strategy = strategy.value;
    if (ranks.value) b.nodes = Number(ranks.value);
    if (ctx.value) b.ctx = Number(ctx.value);
    return b;
  };
  preview.addEventListener("click", async () => {
    note.textContent = "planning…";
    fill(plans);
    try {
      const list = await call("POST", "/v1/place", { ...body(), preview: true });
      note.textContent = `${list.length} plan${list.length === 1 ? "" : "s"} fit${list.length === 1 ? "s" : ""} ${model.value}.`;
      fill(plans, list.map((p) => plan(store, p, body(), note)));
    } catch (e) {
      note.textContent = "";
      fill(plans, h("p", { class: "error" }, e.message));
    }
  });
  fill(el,
    h("div", { class: "row" },
      h("label", {}, "model", model),
      h("label", {}, "strategy", strategy),
      h("label", {}, "ranks", ranks),
      h("label", {}, "context", ctx),
      preview),
    note, plans);
  form = { model, ranks };
}

function plan(store, p, asked, note) {
  const nodes = new Map((store.status?.nodes || []).map((n) => [n.id, n]));
  const launch = h("button", { type: "button", "data-testid": "launch" }, "Launch");
  launch.addEventListener("click", async () => {
    launch.disabled = true;
    try {
      const body = { model: asked.model, strategy: p.strategy, nodes: p.nodes.length };
      if (asked.ctx) body.ctx = asked.ctx;
      const inst = await call("POST", "/v1/place", body);
      note.textContent = `Placed ${inst.model} (${inst.strategy}, ${inst.ranks.length} ranks): instance ${inst.id}.`;
      store.refresh();
    } catch (e) {
      note.textContent = `Not placed: ${e.message}`;
      launch.disabled = false;
    }
  });
  return h("div", { class: "card", "data-testid": "plan", "data-strategy": p.strategy, "data-ranks": p.nodes.length },
    h("div", { class: "plan" },
      h("b", {}, `${p.strategy} over ${p.nodes.length} rank${p.nodes.length === 1 ? "" : "s"}`),
      launch),
    h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "rank"), h("th", {}, "machine"), h("th", {}, "needs"), h("th", {}, "free there"))),
      h("tbody", {}, p.nodes.map((id, k) => {
        const n = nodes.get(id);
        return h("tr", {},
          h("td", {}, k),
          h("td", {}, nodeName(n, id), p.gpus?.[k] !== null && p.gpus?.[k] !== undefined ? ` · GPU ${p.gpus[k]}` : ""),
          h("td", {}, bytes(p.memory[k])),
          h("td", {}, bytes(n?.resources?.memory_free)));
      })))));
}

export function update(store) {
  if (!form) return;
  const names = store.catalog.map((c) => c.name);
  const have = [...form.model.options].map((o) => o.value);
  if (names.join() !== have.join()) {
    const keep = form.model.value;
    fill(form.model, names.map((n) => h("option", { value: n }, n)));
    if (names.includes(keep)) form.model.value = keep;
  }
  // A rank is a machine's CPU or one of its GPUs.
  const count = (store.status?.nodes || []).reduce((k, n) => k + (n.resources?.backend?.kind === "cuda" ? n.resources.backend.count || 1 : 1), 0);
  if (form.ranks.options.length !== count + 1) {
    const keep = form.ranks.value;
    fill(form.ranks, h("option", { value: "" }, "any"),
      Array.from({ length: count }, (_, i) => h("option", { value: i + 1 }, i + 1)));
    form.ranks.value = Number(keep) <= count ? keep : "";
  }
}
