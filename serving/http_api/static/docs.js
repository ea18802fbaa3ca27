// API docs rendered from /openapi.json on the page itself: paths, methods, parameters, request bodies
// (every property with its type, limits, default and description) and responses. Text only, never HTML
// from the document, and nothing fetched but /openapi.json.
"use strict";

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function typeOf(s) {
  if (!s) return "";
  if (s.oneOf || s.anyOf) return (s.oneOf || s.anyOf).map(typeOf).join(" | ");
  if (s.type === "array") return `array of ${typeOf(s.items) || "any"}`;
  if (s.type === "object" && s.properties) return `{${Object.keys(s.properties).join(", ")}}`;
  return s.type || "any";
}

function limits(s) {
  const out = [];
  if (s.enum) out.push(`one of ${s.enum.map((x) => JSON.stringify(x)).join(", ")}`);
  if (s.minimum !== undefined) out.push(`≥ ${s.minimum}`);
  if (s.exclusiveMinimum !== undefined) out.push(`> ${s.exclusiveMinimum}`);
  if (s.maximum !== undefined) out.push(`≤ ${s.maximum}`);
  if (s.minLength) out.push(`at least ${s.minLength} characters`);
  if (s.maxLength !== undefined) out.push(`at most ${s.maxLength} characters`);
  if (s.minItems !== undefined) out.push(`at least ${s.minItems} items`);
  if (s.maxItems !== undefined) out.push(`at most ${s.maxItems} items`);
  if (s.default !== undefined) out.push(`default ${JSON.stringify(s.default)}`);
  if (s.nullable) out.push("may be null");
  return out.join("; ");
}

function schemaTable(schema) {
  if (!schema || !schema.properties) return el("p", typeOf(schema) || "any");
  const table = el("table");
  const head = el("tr");
  ["field", "type", "limits", "description"].forEach((h) => head.appendChild(el("th", h)));
  table.appendChild(head);
  const required = new Set(schema.required || []);
  for (const [name, prop] of Object.entries(schema.properties)) {
    const row = el("tr");
    const cell = el("td");
    cell.appendChild(el("code", name));
    if (required.has(name)) cell.appendChild(el("span", " (required)"));
    row.appendChild(cell);
    row.appendChild(el("td", typeOf(prop)));
    row.appendChild(el("td", limits(prop)));
    row.appendChild(el("td", prop.description || ""));
    table.appendChild(row);
  }
  return table;
}

function operation(path, method, op, shared) {
  const section = el("section");
  section.id = op.operationId || `${method}-${path}`;
  const h = el("h2");
  h.appendChild(el("span", method, "method"));
  h.appendChild(el("code", path));
  section.appendChild(h);
  if (op.summary || op.description) section.appendChild(el("p", op.summary || op.description));
  const params = [...(shared || []), ...(op.parameters || [])];
  if (params.length) {
    section.appendChild(el("h3", "Parameters"));
    const ul = el("ul");
    params.forEach((p) => ul.appendChild(el("li", `${p.name} (${p.in}${p.required ? ", required" : ""}): ${typeOf(p.schema)}${p.description ? ` — ${p.description}` : ""}`)));
    section.appendChild(ul);
  }
  if (op.requestBody) {
    for (const [type, media] of Object.entries(op.requestBody.content || {})) {
      section.appendChild(el("h3", `Request body: ${type}`));
      section.appendChild(schemaTable(media.schema));
    }
  }
  section.appendChild(el("h3", "Responses"));
  const ul = el("ul");
  for (const [code, r] of Object.entries(op.responses || {})) {
    const types = Object.keys(r.content || {});
    ul.appendChild(el("li", `${code}: ${r.description || ""}${types.length ? ` (${types.join(", ")})` : ""}`));
  }
  section.appendChild(ul);
  return section;
}

async function render() {
  try {
    const r = await fetch("/openapi.json");
    if (!r.ok) throw new Error(`${r.status} ${r.statusText}`);
    const doc = await r.json();
    $("title").textContent = doc.info.title;
    $("version").textContent = `version ${doc.info.version} · OpenAPI ${doc.openapi}`;
    const paths = $("paths");
    paths.replaceChildren();
    const toc = el("ul");
    for (const [path, item] of Object.entries(doc.paths)) {
      for (const method of ["get", "post", "put", "patch", "delete"]) {
        if (!item[method]) continue;
        const section = operation(path, method, item[method], item.parameters);
        paths.appendChild(section);
        const li = el("li");
        const a = el("a", `${method.toUpperCase()} ${path}`);
        a.href = `#${section.id}`;
        li.appendChild(a);
        toc.appendChild(li);
      }
    }
    $("toc").replaceChildren(toc);
  } catch (e) {
    $("error").textContent = `could not read /openapi.json: ${e.message}`;
    $("error").hidden = false;
  }
}

render();
