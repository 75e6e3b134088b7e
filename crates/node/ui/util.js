// Small helpers every view uses: building elements, formatting sizes and rates.

/** An element: h("div", {class: "x", onclick: f}, child, "text", …). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** An SVG element, like h. */
export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    el.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** 1536 → "1.5 KiB". */
export function bytes(n) {
  if (n === undefined || n === null || isNaN(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n >= 100 || i === 0 ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
}

/** Bytes per second → "12 MB/s" (decimal, as links are quoted). */
export function rate(n) {
  if (!n) return "–";
  if (n >= 1e9) return `${(n / 1e9).toFixed(1)} GB/s`;
  if (n >= 1e6) return `${Math.round(n / 1e6)} MB/s`;
  return `${Math.round(n / 1e3)} kB/s`;
}

/** A node's name for people: its host name and the end of its id. */
export function nodeName(node, id) {
  const tail = (id || node?.id || "").slice(-6);
  return node?.hostname ? `${node.hostname} ·${tail}` : `node ·${tail}`;
}

/** A progress bar of `fraction` (0..1) with a label. */
export function bar(fraction, label, testid) {
  const pct = Math.max(0, Math.min(1, fraction || 0)) * 100;
  return h(
    "div",
    { class: "bar", role: "progressbar", "aria-valuenow": Math.round(pct), "data-testid": testid },
    h("div", { class: "fill", style: { width: `${pct}%` } }),
    h("span", {}, label ?? `${Math.round(pct)} %`),
  );
}

/** Replaces the children of `el`. */
export function fill(el, ...children) {
  el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}
