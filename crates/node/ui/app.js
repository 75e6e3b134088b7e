// The dashboard's one store: the node's status (refreshed on every `/events` change and
// every two seconds), the catalog of known models, and how fast each model file arrives.
// Views render from it; the chat, placement and chart keep their own inputs.

import { call, follow, onKeyNeeded, setKey, key } from "./api.js";
import { nodeName } from "./util.js";
import * as topology from "./topology.js";
import * as models from "./models.js";
import * as instances from "./instances.js";
import * as place from "./place.js";
import * as chat from "./chat.js";
import * as chart from "./chart.js";

const $ = (id) => document.getElementById(id);

const store = {
  status: null,
  catalog: [],
  error: null,
  live: false,
  /** "node model" → [{t, pct}], for the rate of a file on its way in. */
  arrivals: new Map(),
  refresh,
};

function noteArrivals(status) {
  const now = performance.now() / 1000;
  const seen = new Set();
  for (const n of status.nodes || []) {
    for (const [model, pct] of Object.entries(n.fetching || {})) {
      const k = `${n.id} ${model}`;
      seen.add(k);
      const h = store.arrivals.get(k) || [];
      if (!h.length || h[h.length - 1].pct !== pct) h.push({ t: now, pct });
      while (h.length > 8) h.shift();
      store.arrivals.set(k, h);
    }
  }
  for (const k of store.arrivals.keys()) if (!seen.has(k)) store.arrivals.delete(k);
}

/** Bytes per second at which `model` arrives on node `id` (null before two readings). */
store.arrivalRate = (id, model, size) => {
  const h = store.arrivals.get(`${id} ${model}`);
  if (!h || h.length < 2 || !size) return null;
  const [a, b] = [h[0], h[h.length - 1]];
  const dt = performance.now() / 1000 - a.t;
  return dt > 0 ? (((b.pct - a.pct) / 100) * size) / dt : null;
};

function render() {
  const s = store.status;
  if (s) {
    const nodes = s.nodes || [];
    const master = nodes.find((n) => n.id === s.master_id);
    const me = nodes.find((n) => n.id === s.node_id);
    $("summary").textContent =
      `${nodes.length} machine${nodes.length === 1 ? "" : "s"} · master ${master ? nodeName(master) : "none yet"}` +
      ` · this page from ${me ? nodeName(me) : s.node_id.slice(-6)}` +
      (store.error ? ` · ${store.error}` : "");
  } else {
    $("summary").textContent = store.error || "connecting…";
  }
  $("live").classList.toggle("on", store.live);
  topology.render($("topology-view"), store);
  models.render($("models-view"), store);
  instances.render($("instances-view"), store);
  place.update(store);
  chat.update(store);
}

let pending = null;
async function refresh() {
  if (pending) return pending;
  pending = (async () => {
    try {
      store.status = await call("GET", "/v1/status");
      if (!store.catalog.length) store.catalog = await call("GET", "/v1/catalog");
      store.error = null;
      noteArrivals(store.status);
    } catch (e) {
      store.error = `the node did not answer: ${e.message}`;
    } finally {
      pending = null;
    }
    render();
  })();
  return pending;
}

let soon = null;
function refreshSoon() {
  clearTimeout(soon);
  soon = setTimeout(refresh, 150);
}

function askKey(why) {
  const dialog = $("key-dialog");
  if (dialog.open) return Promise.resolve(null);
  $("key-why").textContent = why || "This node needs an API key.";
  $("key-input").value = key() || "";
  dialog.showModal();
  return new Promise((done) => {
    dialog.addEventListener(
      "close",
      () => done(dialog.returnValue === "ok" ? $("key-input").value : null),
      { once: true },
    );
  });
}

async function start() {
  onKeyNeeded(askKey);
  $("key-button").addEventListener("click", async () => {
    const k = await askKey("The key this node was started with (--api-key-file).");
    if (k !== null) {
      setKey(k);
      refresh();
    }
  });
  place.mount($("place-view"), store);
  chat.mount($("chat-view"), store);
  chart.mount($("throughput-view"));
  await refresh();
  follow(refreshSoon, (live) => {
    store.live = live;
    $("live").classList.toggle("on", live);
  });
  setInterval(refresh, 2000);
}

start();
