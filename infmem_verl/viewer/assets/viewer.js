// The trajectory viewer's page logic (see infmem_verl/viewer/page.py). Data comes from JSON script
// tags: "runs" (the index) is parsed at load; a sample's turns ("detail-N") when it is opened; a
// chunk's text ("chunk-HASH-I") only when it is asked for. Every text from the
// data goes into the page as a text node, never as markup.
"use strict";

const RUNS = JSON.parse(document.getElementById("runs").textContent);
const parsed = new Map();
const state = { a: 0, b: -1, sort: { key: "order", dir: 1 }, selected: null };

function data(id) {
  if (!parsed.has(id)) {
    const tag = document.getElementById(id);
    parsed.set(id, tag ? JSON.parse(tag.textContent) : null);
  }
  return parsed.get(id);
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "onclick" || name === "ontoggle" || name === "onchange" || name === "oninput") node[name] = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(digits);
  return String(value);
}

// ------------------------------------------------------------------------------------- index

function byKey(run) {
  const map = new Map();
  for (const row of run.samples) map.set(row.key, row);
  return map;
}

function setupControls() {
  const selA = document.getElementById("run-a");
  const selB = document.getElementById("run-b");
  RUNS.runs.forEach((run, i) => {
    selA.append(el("option", { value: i }, run.name));
    selB.append(el("option", { value: i }, run.name));
  });
  selA.value = "0";
  selB.value = "-1";
  // Filtering and sorting redraw the index only; the opened sample stays as it is.
  const redraw = () => { render(); if (state.selected) showDetail(state.selected); };
  selA.onchange = () => { state.a = Number(selA.value); refreshFlags(); redraw(); };
  selB.onchange = () => { state.b = Number(selB.value); redraw(); };
  for (const id of ["f-text", "f-correct", "f-stopped", "f-flag", "f-status", "f-compare"]) {
    const control = document.getElementById(id);
    control.oninput = render;
    control.onchange = render;
  }
  refreshFlags();
}

function refreshFlags() {
  const select = document.getElementById("f-flag");
  const flags = new Set();
  for (const row of RUNS.runs[state.a].samples) row.flags.forEach((f) => flags.add(f));
  select.replaceChildren(el("option", { value: "" }, "any"), ...[...flags].sort().map((f) => el("option", { value: f }, f)));
}

function matches(row, other) {
  const text = document.getElementById("f-text").value.trim().toLowerCase();
  if (text) {
    const hay = [row.sample_id, row.dataset, row.length, row.question, row.prediction, ...row.answers].join(" ").toLowerCase();
    if (!hay.includes(text)) return false;
  }
  const tri = (value, wanted) => wanted === "" || (wanted === "yes" ? value === true : value === false);
  if (!tri(row.correct, document.getElementById("f-correct").value)) return false;
  if (!tri(row.stopped_early, document.getElementById("f-stopped").value)) return false;
  const flag = document.getElementById("f-flag").value;
  if (flag && !row.flags.includes(flag)) return false;
  const status = document.getElementById("f-status").value;
  if (status && row.status !== status) return false;
  const compare = document.getElementById("f-compare").value;
  if (compare && state.b >= 0) {
    if (!other) return false;
    if (compare === "a-only" && !(row.correct && !other.correct)) return false;
    if (compare === "b-only" && !(!row.correct && other.correct)) return false;
    if (compare === "differ" && row.correct === other.correct) return false;
  }
  return true;
}

const SORTS = {
  order: (r) => r.order,
  dataset: (r) => `${r.dataset}/${r.length}`,
  id: (r) => r.sample_id,
  question: (r) => r.question || "",
  correct: (r) => (r.correct === null ? -1 : Number(r.correct)),
  chunks: (r) => (r.chunks_read === null ? -1 : r.chunks_read),
  stopped: (r) => (r.stopped_early === null ? -1 : Number(r.stopped_early)),
  reward: (r) => (r.reward === null ? -Infinity : r.reward),
  flags: (r) => r.flags.length,
};

function render() {
  const run = RUNS.runs[state.a];
  const other = state.b >= 0 ? byKey(RUNS.runs[state.b]) : null;
  const rows = run.samples.map((row, order) => ({ ...row, order })).filter((row) => matches(row, other && other.get(row.key)));
  const { key, dir } = state.sort;
  rows.sort((x, y) => {
    const a = SORTS[key](x), b = SORTS[key](y);
    return (a < b ? -1 : a > b ? 1 : x.order - y.order) * dir;
  });
  const head = document.querySelector("#index thead tr");
  const columns = [["order", "#"], ["dataset", "dataset / length"], ["id", "sample"], ["question", "question"], [null, "gold"],
    [null, "prediction"], ["correct", "correct"], ["chunks", "chunks read"], ["stopped", "stopped early"]];
  const rewarded = run.samples.some((r) => r.reward !== null);  // training runs; evaluations have scores only
  columns.push(rewarded ? ["reward", "reward"] : null, [null, rewarded ? "components" : "scores"], ["flags", "flags"]);
  if (other) columns.push([null, "B: prediction"], [null, "B: correct"], [null, "B: chunks read"]);
  head.replaceChildren(...columns.filter(Boolean).map(([sortKey, label]) => el("th", {
    class: sortKey ? "sortable" + (sortKey === key ? (dir > 0 ? " asc" : " desc") : "") : null,
    "data-sort": sortKey,
    onclick: sortKey ? () => { state.sort = { key: sortKey, dir: state.sort.key === sortKey ? -state.sort.dir : 1 }; render(); } : null,
  }, label)));
  const body = document.querySelector("#index tbody");
  body.replaceChildren(...rows.map((row) => indexRow(row, other && other.get(row.key), rewarded)));
  document.getElementById("count").textContent = `${rows.length} of ${run.samples.length} samples`;
}

function correctCell(row) {
  if (row.status !== "ok") return el("td", { class: "failed", title: row.reason }, "failed");
  if (row.correct === null || row.correct === undefined) return el("td", {}, "–");
  return el("td", { class: row.correct ? "yes" : "no" }, row.correct ? "✓" : "✗");
}

function chunksText(row) {
  return row.chunks_read === null || row.chunks_read === undefined ? "–" : `${row.chunks_read} / ${fmt(row.num_chunks)}`;
}

function indexRow(row, other, rewarded) {
  const components = Object.entries(row.components).map(([k, v]) => `${k} ${fmt(v, 2)}`).join(" · ");
  const cells = [
    el("td", {}, row.order + 1),
    el("td", {}, `${row.dataset} / ${row.length}`),
    el("td", { class: "mono" }, row.sample_id),
    el("td", { class: "question", title: row.question || "" }, row.question || "–"),
    el("td", {}, row.answers.join(" | ") || "–"),
    el("td", {}, row.prediction ?? "–"),
    correctCell(row),
    el("td", {}, chunksText(row)),
    el("td", {}, row.stopped_early === null ? "–" : row.stopped_early ? "yes" : "no"),
    rewarded ? el("td", {}, fmt(row.reward)) : null,
    el("td", { class: "small" }, components || "–"),
    el("td", { class: "small" }, row.flags.join(", ")),
  ];
  if (state.b >= 0) {
    cells.push(
      el("td", {}, other ? other.prediction ?? "–" : "not in B"),
      other ? correctCell(other) : el("td", {}, "–"),
      el("td", {}, other ? chunksText(other) : "–"),
    );
  }
  return el("tr", {
    class: "sample" + (row.key === state.selected ? " selected" : ""),
    "data-key": row.key,
    onclick: () => { state.selected = row.key; render(); showDetail(row.key); },
  }, cells);
}

// ------------------------------------------------------------------------------------ detail

function showDetail(key) {
  const panes = [RUNS.runs[state.a]];
  if (state.b >= 0) panes.push(RUNS.runs[state.b]);
  const detail = document.getElementById("detail");
  detail.className = panes.length > 1 ? "two" : "one";
  detail.replaceChildren(...panes.map((run) => pane(run, byKey(run).get(key))));
}

function badge(text, cls, title) {
  return el("span", { class: `badge ${cls || ""}`, title }, text);
}

function pane(run, row) {
  if (!row) return el("section", { class: "pane" }, el("h2", {}, run.name), el("p", {}, "This run has no such sample."));
  const d = row.detail === null || row.detail === undefined ? null : data(`detail-${row.detail}`);
  const answers = (d && d.answers) || row.answers;
  const head = [
    el("h2", {}, run.name),
    el("p", { class: "mono" }, row.key),
    el("p", { class: "question" }, el("b", {}, "Question: "), row.question || (d && d.question) || "(not recorded)"),
    el("p", {}, el("b", {}, "Gold: "), answers.join(" | ") || "(not recorded)"),
    el("p", {}, el("b", {}, "Prediction: "), row.prediction ?? "(none)", " ", row.status !== "ok" ? badge("failed", "bad", row.reason)
      : row.correct === true ? badge("correct", "good") : row.correct === false ? badge("wrong", "bad") : null),
    el("p", {}, `Chunks read ${chunksText(row)} · stop step ${fmt(row.stop_step)} · stopped early ${row.stopped_early ? "yes" : "no"}`
      + (row.reward !== null && row.reward !== undefined ? ` · reward ${fmt(row.reward)}` : "")),
    Object.keys(row.components).length ? el("p", { class: "small" }, Object.entries(row.components).map(([k, v]) => `${k} ${fmt(v)}`).join(" · ")) : null,
    row.flags.length ? el("p", {}, row.flags.map((f) => badge(f, "flag"))) : null,
  ];
  if (row.status !== "ok") head.push(el("pre", { class: "reason" }, row.reason));
  if (!d) {
    head.push(el("p", { class: "note" }, run.kind === "eval"
      ? "Turns were not recorded: run python -m infmem_verl.eval with --record-turns."
      : "This trajectory has no turn facts."));
    return el("section", { class: "pane", "data-run": run.name }, head);
  }
  return el("section", { class: "pane", "data-run": run.name }, head, trajectory(d, answers));
}

function chunkSteps(d) {
  // Turns grouped by the chunk they were made before (PreThink) or on (Write); the answer apart.
  const steps = new Map();
  let answer = null;
  for (const turn of d.turns) {
    if (turn.kind === "answer") { answer = turn; continue; }
    if (!steps.has(turn.chunk)) steps.set(turn.chunk, { chunk: turn.chunk, prethink: [], write: null });
    const step = steps.get(turn.chunk);
    if (turn.kind === "prethink") step.prethink.push(turn); else step.write = turn;
  }
  return { steps: [...steps.values()].sort((x, y) => x.chunk - y.chunk), answer };
}

function trajectory(d, answers) {
  const units = d.units || {};
  const gold = new Set((d.gold_units || []).map(String));
  const goldChunks = new Set((d.gold_units || []).map((u) => units[u] && units[u].chunk).filter((c) => c !== undefined));
  const { steps, answer } = chunkSteps(d);
  const read = new Set(steps.filter((s) => s.write).map((s) => s.chunk));
  const retrievedFrom = new Set();
  for (const s of steps) for (const t of s.prethink) for (const u of t.retrieved_units || []) if (units[u]) retrievedFrom.add(units[u].chunk);
  const stepNodes = new Map();
  const container = el("div", { class: "steps" });
  const timeline = el("div", { class: "timeline" });
  for (let c = 0; c < (d.num_chunks || 0); c++) {
    const cls = ["chunk", read.has(c) ? "read" : "unread"];
    if (d.stop_step === c) cls.push("stop");
    if (retrievedFrom.has(c)) cls.push("retrieved");
    if (goldChunks.has(c)) cls.push("gold");
    const title = `chunk ${c}: ${read.has(c) ? "read" : "not read"}${d.stop_step === c ? ", stopped here" : ""}`
      + `${retrievedFrom.has(c) ? ", evidence retrieved from it" : ""}${goldChunks.has(c) ? ", holds gold evidence" : ""}`;
    timeline.append(el("span", { class: cls.join(" "), "data-chunk": c, title, onclick: () => {
      const node = stepNodes.get(c);
      if (node) { node.open = true; node.scrollIntoView({ block: "nearest" }); }
    } }));
  }
  const legend = el("p", { class: "legend small" }, badge("read", "read"), badge("not read", "unread"), badge("stopped", "stop"),
    badge("retrieved from", "retrieved"), badge("gold evidence", "gold"));
  let previous = "";
  for (const step of steps) {
    const before = previous;
    if (step.write && step.write.memory !== undefined && step.write.memory !== null) previous = step.write.memory;
    const node = stepNode(d, step, before, units, gold, answers);
    stepNodes.set(step.chunk, node);
    container.append(node);
  }
  const missed = [...gold].filter((u) => ![...steps].some((s) => s.prethink.some((t) => (t.retrieved_units || []).map(String).includes(u))));
  const goldNote = gold.size
    ? el("div", { class: "gold-note" }, el("b", {}, "Gold evidence: "), [...gold].map((u) => `unit #${u} (chunk ${units[u] ? units[u].chunk : "?"})`).join(", "),
      missed.length ? ` · never retrieved: ${missed.map((u) => "#" + u).join(", ")}` : " · all retrieved")
    : el("p", { class: "note small" }, "The data records no gold positions for this sample.");
  return el("div", { class: "trajectory" }, legend, timeline, goldNote, container, answer ? answerNode(answer, answers) : null);
}

function turnFlags(turn) {
  return [turn.valid === false ? badge("invalid", "bad", turn.reason) : null, ...(turn.flags || []).map((f) => badge(f, "flag"))];
}

function actionText(turn) {
  const a = turn.action || {};
  if (a.kind === "retrieve") return `retrieve${a.query ? ` “${a.query}”` : ""}${a.top_k ? ` top_k=${a.top_k}` : ""}`;
  return a.kind || "?";
}

function stepNode(d, step, before, units, gold, answers) {
  const summary = el("summary", {}, el("b", {}, `chunk ${step.chunk}`), " ",
    step.prethink.map((t) => el("span", { class: "action" }, actionText(t), " ", turnFlags(t))),
    step.write ? el("span", { class: "small" }, ` · memory ${fmt(step.write.memory_tokens)} tokens `, turnFlags(step.write)) : badge("not read", "unread"));
  const node = el("details", { class: "step", "data-chunk": step.chunk }, summary);
  let filled = false;
  node.ontoggle = () => {
    if (!node.open || filled) return;
    filled = true;
    node.append(stepBody(d, step, before, units, gold, answers));
  };
  return node;
}

function stepBody(d, step, before, units, gold, answers) {
  const body = el("div", { class: "body" });
  for (const turn of step.prethink) {
    const a = turn.action || {};
    body.append(el("h4", {}, "PreThink"), el("p", {}, el("b", {}, "action: "), actionText(turn), " · ",
      a.valid === false || turn.valid === false ? el("span", { class: "bad" }, `invalid: ${a.reason || turn.reason || "?"}`) : "valid",
      a.clamped ? " · top_k clamped" : ""));
    if (turn.output) body.append(el("pre", { class: "output" }, turn.output));
    const retrieved = turn.retrieved_units || [];
    if (retrieved.length) {
      body.append(el("h4", {}, `Retrieved (${retrieved.length})`));
      for (const u of retrieved) {
        const unit = units[u];
        const isGold = gold.has(String(u));
        body.append(el("div", { class: "unit" + (isGold ? " gold" : ""), "data-unit": u },
          el("div", { class: "unit-head" }, `unit #${u} · chunk ${unit ? unit.chunk : "?"}`, isGold ? badge("gold evidence", "gold") : null),
          unit ? el("pre", {}, highlight(unit.text, answers)) : el("p", { class: "note" }, "text not recorded")));
      }
    }
  }
  if (step.write) {
    const w = step.write;
    body.append(el("h4", {}, "Write: memory after", " ", turnFlags(w)));
    if (w.memory === undefined || w.memory === null) body.append(el("p", { class: "note" }, "memory text not recorded"));
    else body.append(el("pre", { class: "memory" }, diff(before, w.memory, answers)));
    if (w.output) body.append(el("p", { class: "small" }, "raw output:"), el("pre", { class: "output" }, w.output));
  }
  if (d.document) {
    const slot = el("div", { class: "chunk-slot" });
    body.append(el("button", { type: "button", class: "show-chunk", onclick: (event) => {
      event.target.remove();
      slot.append(chunkText(d.document, step.chunk, answers));
    } }, "show chunk text"), slot);
  }
  return body;
}

function chunkText(digest, chunk, answers) {
  const text = data(`chunk-${digest}-${chunk}`);
  if (text === null) {
    const doc = data(`doc-${digest}`);
    return el("p", { class: "note" }, doc && doc.missing ? doc.missing : "chunk text not included");
  }
  return el("pre", { class: "chunk-text" }, highlight(text, answers));
}

function answerNode(turn, answers) {
  return el("div", { class: "answer-turn" }, el("h4", {}, "Answer turn", " ", turnFlags(turn)),
    el("pre", {}, highlight(turn.output || "", answers)));
}

// ------------------------------------------------------------------------------ text helpers

function highlight(text, needles) {
  // Gold answers marked in a text (case-insensitive), as text nodes and <mark>s.
  const wanted = (needles || []).filter((n) => n && n.length > 1).map((n) => n.toLowerCase());
  const out = document.createDocumentFragment();
  if (!wanted.length) { out.append(text); return out; }
  const lower = text.toLowerCase();
  let at = 0;
  while (at < text.length) {
    let best = -1, len = 0;
    for (const n of wanted) {
      const i = lower.indexOf(n, at);
      if (i >= 0 && (best < 0 || i < best)) { best = i; len = n.length; }
    }
    if (best < 0) break;
    out.append(text.slice(at, best), el("mark", {}, text.slice(best, best + len)));
    at = best + len;
  }
  out.append(text.slice(at));
  return out;
}

function diff(before, after, answers) {
  // Word diff of the memory (longest common subsequence): <del> left out, <ins> added.
  const a = before ? before.split(/(\s+)/) : [];
  const b = after.split(/(\s+)/);
  const out = document.createDocumentFragment();
  if (a.length * b.length > 4e6) { out.append(highlight(after, answers)); return out; }
  const n = a.length, m = b.length;
  const lcs = new Uint16Array((n + 1) * (m + 1));
  for (let i = n - 1; i >= 0; i--) {
    for (let j = m - 1; j >= 0; j--) {
      lcs[i * (m + 1) + j] = a[i] === b[j] ? lcs[(i + 1) * (m + 1) + j + 1] + 1
        : Math.max(lcs[(i + 1) * (m + 1) + j], lcs[i * (m + 1) + j + 1]);
    }
  }
  const ops = [];  // [tag, text]: tag "ins", "del" or null (kept)
  let i = 0, j = 0;
  while (i < n || j < m) {
    if (i < n && j < m && a[i] === b[j]) { ops.push([null, b[j]]); i++; j++; }
    else if (j < m && (i >= n || lcs[i * (m + 1) + j + 1] >= lcs[(i + 1) * (m + 1) + j])) { ops.push(["ins", b[j]]); j++; }
    else { ops.push(["del", a[i]]); i++; }
  }
  // A run of changes (with the kept whitespace inside it) reads as one replacement: what went, then what came.
  const isChange = (k) => ops[k] && ops[k][0];
  let k = 0;
  while (k < ops.length) {
    if (!isChange(k)) { out.append(highlight(ops[k][1], answers)); k++; continue; }
    let gone = "", came = "";
    while (k < ops.length && (isChange(k) || (/^\s+$/.test(ops[k][1]) && isChange(k + 1)))) {
      const [tag, text] = ops[k];
      if (tag !== "ins") gone += text;
      if (tag !== "del") came += text;
      k++;
    }
    if (gone.trim()) out.append(el("del", {}, gone));
    if (came.trim()) out.append(el("ins", {}, highlight(came, answers)));
  }
  return out;
}

setupControls();
render();
