// Talking to the node: every call carries the API key (asked for once, kept in this
// browser), and a 401 asks for it again. Server-sent events are read with fetch, since
// EventSource cannot send a key.

const KEY = "shoal-api-key";
let askForKey = () => Promise.resolve(null);

/** Sets what asks the person for the key (returns a promise of the key or null). */
export function onKeyNeeded(ask) {
  askForKey = ask;
}

export function key() {
  return localStorage.getItem(KEY);
}

export function setKey(k) {
  if (k) localStorage.setItem(KEY, k.trim());
  else localStorage.removeItem(KEY);
}

/** An error the node answered with: its status and message. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(json) {
  const h = {};
  const k = key();
  if (k) h["Authorization"] = `Bearer ${k}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function message(r) {
  const text = await r.text();
  try {
    const v = JSON.parse(text);
    const e = v.error;
    if (typeof e === "string") return e;
    if (e && e.message) return e.message;
  } catch (_) {
    /* not JSON: the text itself */
  }
  return text || r.statusText;
}

/** fetch with the key; a 401 asks for the key once and tries again. */
export async function send(method, path, body, signal) {
  for (let attempt = 0; ; attempt++) {
    const r = await fetch(path, {
      method,
      headers: headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
    if (r.status === 401 && attempt === 0) {
      const why = await message(r);
      const k = await askForKey(why);
      if (k) {
        setKey(k);
        continue;
      }
    }
    if (!r.ok) throw new ApiError(r.status, await message(r));
    return r;
  }
}

/** A JSON call. */
export async function call(method, path, body) {
  const r = await send(method, path, body);
  return r.json();
}

/** Reads a response of server-sent events: onEvent(name, data) per event, onComment(text). */
export async function readEvents(response, onEvent, onComment = () => {}) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) onComment(line.slice(1).trim());
        else if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

/** Follows `/events` for as long as the page lives, reconnecting after a failure. */
export function follow(onChange, onConnected) {
  const run = async () => {
    for (;;) {
      try {
        const r = await send("GET", "/events");
        onConnected(true);
        await readEvents(r, () => onChange());
      } catch (_) {
        /* the node went away or refused: try again shortly */
      }
      onConnected(false);
      await new Promise((ok) => setTimeout(ok, 2000));
    }
  };
  run();
}
