// The chat: a model picker, the conversation, and an answer streamed from
// `/v1/chat/completions` with its time to first token and tokens per second. Stop
// aborts the request; the node sees the client leave and cancels the sequence. Answers
// render as markdown.

import { h, fill } from "./util.js";
import { send, readEvents } from "./api.js";
import { render as markdown } from "./markdown.js";

let ui = null;
const history = [];
let running = null; // the AbortController of the answer in flight

export function mount(el) {
  const model = h("select", { "data-testid": "chat-model", "aria-label": "model" });
  const maxTokens = h("input", { type: "number", min: 1, value: 256, size: 5, "data-testid": "chat-max-tokens" });
  const temperature = h("input", { type: "number", min: 0, max: 2, step: 0.1, value: 0.7, size: 4, "data-testid": "chat-temperature" });
  const log = h("div", { class: "log", "data-testid": "chat-log", "aria-live": "polite" });
  const input = h("textarea", { rows: 3, placeholder: "Ask something… (Enter sends, Shift+Enter a new line)", "data-testid": "chat-input" });
  const sendButton = h("button", { type: "submit", "data-testid": "send" }, "Send");
  const stop = h("button", { type: "button", class: "danger", disabled: true, "data-testid": "stop" }, "Stop");
  const clear = h("button", { type: "button", class: "quiet" }, "New chat");
  const form = h("form", {}, input, h("div", { class: "row", style: { marginTop: "6px" } }, sendButton, stop, clear));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    ask();
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      ask();
    }
  });
  stop.addEventListener("click", () => running?.abort());
  clear.addEventListener("click", () => {
    running?.abort();
    history.length = 0;
    fill(log);
  });
  fill(el, h("div", { class: "row" }, h("label", {}, "model", model), h("label", {}, "max tokens", maxTokens), h("label", {}, "temperature", temperature)), log, form);
  ui = { model, maxTokens, temperature, log, input, sendButton, stop };
}

export function update(store) {
  if (!ui) return;
  const instances = store.status?.instances || [];
  const ready = instances.filter((i) => i.status?.state === "ready").map((i) => i.model);
  const names = [...new Set([...ready, ...instances.map((i) => i.model), ...store.catalog.map((c) => c.name)])];
  const label = (n) => (ready.includes(n) ? `${n} (ready)` : instances.some((i) => i.model === n) ? `${n} (starting)` : `${n} (placed on first use)`);
  const have = [...ui.model.options].map((o) => o.textContent);
  if (names.map(label).join() !== have.join()) {
    const keep = ui.model.value;
    fill(ui.model, names.map((n) => h("option", { value: n }, label(n))));
    ui.model.value = names.includes(keep) ? keep : ready[0] || names[0] || "";
  }
}

function stats(t0, first, tokens, end) {
  const parts = [];
  if (first) parts.push(`first token ${((first - t0) / 1000).toFixed(2)} s`);
  if (first && tokens > 1 && end > first) parts.push(`${((tokens - 1) / ((end - first) / 1000)).toFixed(1)} tok/s`);
  parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
  return parts.join(" · ");
}

async function ask() {
  const text = ui.input.value.trim();
  if (!text || running) return;
  ui.input.value = "";
  history.push({ role: "user", content: text });
  ui.log.append(h("div", { class: "msg user" }, text));
  const body = h("div", { class: "body" });
  const note = h("div", { class: "stats", "data-testid": "chat-stats" }, "waiting for the first token…");
  const msg = h("div", { class: "msg assistant", "data-testid": "answer", "data-state": "streaming" }, body, note);
  ui.log.append(msg);
  ui.log.scrollTop = ui.log.scrollHeight;
  running = new AbortController();
  ui.stop.disabled = false;
  ui.sendButton.disabled = true;
  let answer = "";
  let tokens = 0;
  let first = 0;
  let usage = null;
  const t0 = performance.now();
  let state = "done";
  let failure = null;
  try {
    const r = await send("POST", "/v1/chat/completions", {
      model: ui.model.value,
      messages: history,
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: Number(ui.maxTokens.value) || 256,
      temperature: ui.temperature.value === "" ? 0.7 : Number(ui.temperature.value),
    }, running.signal);
    await readEvents(r, (_, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        failure = chunk.error.message || String(chunk.error);
        return;
      }
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        if (!first) first = performance.now();
        tokens++;
        answer += delta;
        body.innerHTML = markdown(answer);
        note.textContent = stats(t0, first, tokens, performance.now());
        ui.log.scrollTop = ui.log.scrollHeight;
      }
    }, (comment) => {
      // Keepalives and placement progress (a model placed on first use) come as comments.
      if (!first && comment && comment !== "keepalive") note.textContent = comment;
    });
    if (failure) state = "failed";
  } catch (e) {
    if (running.signal.aborted) state = "stopped";
    else {
      state = "failed";
      failure = failure || e.message;
    }
  }
  const end = performance.now();
  const count = usage?.completion_tokens ?? tokens;
  note.textContent = stats(t0, first, count, end) +
    (state === "stopped" ? " · stopped" : state === "failed" ? "" : usage ? ` · prompt ${usage.prompt_tokens}` : "");
  if (failure) msg.append(h("div", { class: "error" }, `The answer failed: ${failure}`));
  msg.dataset.state = state;
  if (answer) history.push({ role: "assistant", content: answer });
  running = null;
  ui.stop.disabled = true;
  ui.sendButton.disabled = false;
}
