// A small Markdown subset rendered to DOM nodes: fenced code blocks, inline code, bold,
// italic, headings, bulleted and numbered lists, paragraphs and line breaks.
//
// Safety: model text only ever becomes the data of text nodes (textContent /
// createTextNode); nothing here assigns innerHTML or builds HTML strings, so a
// "<script>" or "<img onerror=...>" in an answer is shown as those characters and never
// parsed as markup. Links and images are not rendered (their text stays as typed).

const FENCE = /^\s{0,3}(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=[^\s*])([^*]*?[^\s*]|[^\s*])\*|(?<![\w])_(?=[^\s_])([^_]*?[^\s_]|[^\s_])_(?![\w])/g;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

/** Append the inline Markdown of `text` (code, bold, italic) to `parent` as nodes. */
export function renderInline(parent, text, depth = 0) {
  let last = 0;
  INLINE.lastIndex = 0;
  const matches = [...text.matchAll(INLINE)];
  for (const m of matches) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    if (m[1] !== undefined) {
      const code = el("code");
      code.textContent = m[2];
      parent.appendChild(code);
    } else {
      const node = el(m[3] !== undefined || m[4] !== undefined ? "strong" : "em");
      const inner = m[3] ?? m[4] ?? m[5] ?? m[6];
      if (depth < 4) renderInline(node, inner, depth + 1);
      else node.textContent = inner;
      parent.appendChild(node);
    }
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

function paragraph(lines) {
  const p = el("p");
  lines.forEach((line, i) => {
    if (i > 0) p.appendChild(el("br"));
    renderInline(p, line);
  });
  return p;
}

function list(items, ordered, start) {
  const node = el(ordered ? "ol" : "ul");
  if (ordered && start !== 1) node.start = start;
  for (const item of items) {
    const li = el("li");
    renderInline(li, item);
    node.appendChild(li);
  }
  return node;
}

function codeBlock(lines, language) {
  const pre = el("pre");
  const code = el("code");
  const lang = language.replace(/[^\w+#.-]/g, "");
  if (lang) {
    code.className = "lang-" + lang;
    code.dataset.lang = lang;
  }
  code.textContent = lines.join("\n");
  pre.appendChild(code);
  return pre;
}

/** Render `text` as a DocumentFragment of safe nodes (see the file header). */
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  let para = [];
  let items = null;   // {ordered, start, list}
  const flush = () => {
    if (para.length) out.appendChild(paragraph(para));
    para = [];
    if (items) out.appendChild(list(items.list, items.ordered, items.start));
    items = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flush();
      const body = [];
      i++;
      while (i < lines.length && !(lines[i].trim().startsWith(fence[1]) &&
                                   lines[i].trim().replaceAll(fence[1][0], "") === "")) {
        body.push(lines[i]);
        i++;
      }
      out.appendChild(codeBlock(body, fence[2]));   // an unclosed fence (still streaming) too
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      flush();
      const h = el("h" + Math.min(6, heading[1].length + 2));
      renderInline(h, heading[2]);
      out.appendChild(h);
      continue;
    }
    const bullet = BULLET.exec(line);
    const numbered = bullet ? null : NUMBERED.exec(line);
    if (bullet || numbered) {
      const ordered = Boolean(numbered);
      if (para.length || (items && items.ordered !== ordered)) flush();
      if (!items) items = {ordered, start: ordered ? Number(numbered[1]) : 1, list: []};
      items.list.push(ordered ? numbered[2] : bullet[1]);
      continue;
    }
    if (line.trim() === "") {
      flush();
      continue;
    }
    if (items && /^\s+\S/.test(line)) {   // a continuation line of the last list item
      items.list[items.list.length - 1] += " " + line.trim();
      continue;
    }
    if (items) flush();
    para.push(line);
  }
  flush();
  return out;
}

/** Replace the children of `container` with the rendering of `text`. */
export function renderInto(container, text) {
  container.replaceChildren(renderMarkdown(text));
}
