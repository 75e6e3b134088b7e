// Markdown for the chat's answers: fenced code blocks, inline code, headings, lists,
// bold, italics and http(s) links. Everything is escaped first, so a model's text can
// never become markup of its own; an unclosed fence (an answer still streaming) is code
// to the end.

const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escape(t) {
  return t.replace(/[&<>"']/g, (c) => ESC[c]);
}

function inline(text) {
  // Code spans first: nothing inside them is markdown.
  const parts = text.split(/(`[^`\n]+`)/);
  return parts
    .map((p, i) => {
      if (i % 2 === 1) return `<code>${escape(p.slice(1, -1))}</code>`;
      let t = escape(p);
      t = t.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
      t = t.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
      t = t.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
      t = t.replace(/(^|[^\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
      return t;
    })
    .join("");
}

/** The HTML of `md`. */
export function render(md) {
  const lines = md.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let para = [];
  let list = null; // "ul" | "ol"
  const closePara = () => {
    if (para.length) out.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`);
    para = [];
  };
  const closeList = () => {
    if (list) out.push(`</${list}>`);
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)/);
    if (fence) {
      closePara();
      closeList();
      const code = [];
      i++;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
      const lang = fence[1] ? ` class="language-${escape(fence[1])}"` : "";
      out.push(`<pre><code${lang}>${escape(code.join("\n"))}</code></pre>`);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      closePara();
      closeList();
      const n = Math.min(heading[1].length + 2, 6);
      out.push(`<h${n}>${inline(heading[2])}</h${n}>`);
    } else if (bullet || numbered) {
      closePara();
      const kind = bullet ? "ul" : "ol";
      if (list !== kind) {
        closeList();
        out.push(`<${kind}>`);
        list = kind;
      }
      out.push(`<li>${inline((bullet || numbered)[1])}</li>`);
    } else if (!line.trim()) {
      closePara();
      closeList();
    } else {
      closeList();
      para.push(line);
    }
  }
  closePara();
  closeList();
  return out.join("");
}
