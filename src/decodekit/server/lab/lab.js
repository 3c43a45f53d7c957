// decodekit lab: plain JavaScript over the server's /lab/api routes (server/lab.py); the
// charts are SVG drawn here. No dependencies, no build step.
"use strict";

const state = { info: null, generated: [], last: {} };  // last: view -> {request, response}
const $ = (sel, root = document) => root.querySelector(sel);
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children.flat()) if (child !== null && child !== undefined)
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

const pct = (p) => (p >= 0.1 ? (100 * p).toFixed(1) : (100 * p).toFixed(2)) + "%";
const visible = (text) => text.replace(/\n/g, "⏎").replace(/ /g, "␣") || "∅";

async function api(path, body) {
  const headers = { "Content-Type": "application/json" };
  const key = $("#api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch("/lab/api/" + path, body === undefined ? { headers } :
    { method: "POST", headers, body: JSON.stringify(body) });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
  return data;
}

function showError(error) {
  const box = $("#error");
  box.hidden = !error;
  box.textContent = error ? "Error: " + error.message : "";
}

async function run(view, request, render) {
  const out = $("#" + view + "-out");
  out.setAttribute("aria-busy", "true");
  try {
    const response = await api(view, request);
    state.last[view] = { view, request, response };
    showError(null);
    render(response, out);
  } catch (error) {
    showError(error);
  } finally {
    out.removeAttribute("aria-busy");
  }
}

function exportJSON(view) {
  const data = state.last[view];
  if (!data) return showError(new Error("run the view first: there is nothing to export"));
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 1)], { type: "application/json" }));
  const link = el("a", { href: url, download: "decodekit-lab-" + view + ".json" });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

// -- tabs -------------------------------------------------------------------------------------

function selectTab(tab) {
  for (const other of document.querySelectorAll("[role=tab]")) {
    const on = other === tab;
    other.setAttribute("aria-selected", on);
    other.tabIndex = on ? 0 : -1;
    $("#" + other.getAttribute("aria-controls")).hidden = !on;
  }
  tab.focus();
}

function setupTabs() {
  const tabs = [...document.querySelectorAll("[role=tab]")];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (step) selectTab(tabs[(i + step + tabs.length) % tabs.length]);
    });
  });
}

// -- forms ------------------------------------------------------------------------------------

function fillModels() {
  for (const select of document.querySelectorAll("select.models")) {
    const extra = select.dataset.extra ? select.dataset.extra.split(",") : [];
    for (const name of [...extra, ...state.info.models]) select.append(el("option", { value: name, text: name }));
    const wanted = select.dataset.default || state.info.served[0];
    if ([...select.options].some((o) => o.value === wanted)) select.value = wanted;
  }
}

function formValues(form) {
  const values = {};
  for (const input of form.elements) {
    if (!input.name) continue;
    if (input.type === "checkbox") values[input.name] = input.checked;
    else if (input.type === "number") values[input.name] = input.value === "" ? null : Number(input.value);
    else values[input.name] = input.value;
  }
  return values;
}

function pick(values, names) {
  return Object.fromEntries(names.filter((n) => values[n] !== undefined && values[n] !== null).map((n) => [n, values[n]]));
}

// -- 1. sampler chain -------------------------------------------------------------------------

// Numeric fields, and fields whose empty input means null (off), by type (/lab/api/info).
const isNumber = (field) => state.info.numbers.includes(field);
const isOptional = (field) => state.info.nullable.includes(field);

function chainRow(name) {
  const fields = state.info.fields[name];
  const inputs = Object.entries(fields).map(([field, value]) => {
    const text = typeof value === "object" && value !== null ? JSON.stringify(value) : (value ?? "");
    return el("label", {}, field + " ", el("input", {
      "data-field": field, type: isNumber(field) ? "number" : "text", step: "any", value: text, size: 8,
      placeholder: isOptional(field) ? "off" : null,
    }));
  });
  const move = (delta) => (event) => {
    const item = event.target.closest("li");
    const target = delta < 0 ? item.previousElementSibling : item.nextElementSibling;
    if (target) {
      delta < 0 ? target.before(item) : target.after(item);
      event.target.focus();
    }
  };
  return el("li", { "data-adapter": name },
    el("span", { class: "adapter", text: name }),
    el("button", { type: "button", "aria-label": "move " + name + " up", onclick: move(-1) }, "↑"),
    el("button", { type: "button", "aria-label": "move " + name + " down", onclick: move(1) }, "↓"),
    inputs);
}

function chainParams() {
  const params = {}, order = [];
  for (const item of document.querySelectorAll("#chain li")) {
    order.push(item.dataset.adapter);
    for (const input of item.querySelectorAll("input")) {
      const field = input.dataset.field, raw = input.value.trim();
      const initial = state.info.fields[item.dataset.adapter][field];
      if (raw === "" && isOptional(field)) continue;
      if (isNumber(field)) params[field] = Number(raw);
      else params[field] = raw ? JSON.parse(raw) : initial;  // a dict or list (logit_bias, bad_words)
    }
  }
  params.order = order;
  return params;
}

function samplerRequest(choose) {
  const values = formValues($("#sampler-form"));
  let params;
  try {
    params = chainParams();
  } catch (error) {
    showError(new Error("an adapter field is not valid JSON: " + error.message));
    return null;
  }
  params.seed = values.seed;
  return { model: values.model, prompt: values.prompt, top: values.top, generated: state.generated, choose, params };
}

function sampler(choose = null) {
  const request = samplerRequest(choose);
  return request ? run("sampler", request, renderSampler) : Promise.resolve();
}

function bar(p, width = 70) {
  return el("svg:svg", { width, height: 10, class: "bar", "aria-hidden": "true" },
    el("svg:rect", { x: 0, y: 0, width, height: 10, class: "track" }),
    el("svg:rect", { x: 0, y: 0, width: Math.max(p * width, p > 0 ? 1 : 0), height: 10, class: "fill" }));
}

function renderSampler(data, out) {
  state.generated = data.generated;
  const active = new Set(data.stages.map((s) => s.name));  // the stages the server ran
  for (const item of document.querySelectorAll("#chain li")) item.classList.toggle("active", active.has(item.dataset.adapter));
  const request = state.last.sampler.request;
  out.replaceChildren(
    el("p", { class: "text" }, el("span", { class: "prompt", text: request.prompt }),
      el("mark", { text: data.text, id: "sampler-generated" }),
      data.chosen ? el("span", { class: "note", text: `  (last token: ${visible(data.chosen.text)})` }) : null),
    el("table", { class: "stages" },
      el("caption", { text: "Each stage of the chain at the next position" }),
      el("thead", {}, el("tr", {}, ["stage", "entropy (bits)", "tokens kept", "removed here", "mass kept"].map((h) => el("th", { scope: "col", text: h })))),
      el("tbody", {}, data.stages.map((s) => el("tr", {},
        el("th", { scope: "row", text: s.name }), el("td", { text: s.entropy_bits.toFixed(3) }),
        el("td", { text: s.kept_tokens }), el("td", { text: s.removed_tokens }), el("td", { text: pct(s.kept_mass) }))))),
    el("table", { class: "tokens", id: "sampler-tokens" },
      el("caption", { text: "Top tokens through the chain: click a kept token to take it as the next token" }),
      el("thead", {}, el("tr", {}, el("th", { scope: "col", text: "token" }),
        data.stages.map((s) => el("th", { scope: "col", text: s.name })))),
      el("tbody", {}, data.tokens.map((t) => el("tr", { class: t.removed_by ? "removed" : "" },
        el("th", { scope: "row" }, el("button", {
          type: "button", class: "token", disabled: t.removed_by ? true : null,
          title: "token " + t.id, onclick: () => sampler(t.id),
        }, visible(t.text))),
        t.probs.map((p, i) => {
          const stage = data.stages[i].name;
          const removedHere = t.removed_by === stage;
          const cls = p > 0 ? "kept" : removedHere ? "zero removed-here" : "zero";
          return el("td", { class: cls, "data-stage": stage },
            p > 0 ? [bar(p), " ", pct(p)] : removedHere ? "✕ removed" : "–");
        })))),
    ));
}

function setupSampler() {
  const chain = $("#chain");
  for (const name of state.info.adapters) chain.append(chainRow(name));
  const preset = $("#preset");
  for (const name of Object.keys(state.info.presets)) preset.append(el("option", { value: name, text: name }));
  preset.addEventListener("change", () => {  // a use case's temperature and top_p (SamplingParams.preset)
    const values = state.info.presets[preset.value];
    if (!values) return;
    for (const [field, value] of Object.entries(values)) {
      const input = document.querySelector(`#chain input[data-field="${field}"]`);
      if (input) input.value = value;
    }
  });
  $("#sampler-form").addEventListener("submit", (event) => { event.preventDefault(); sampler(); });
  $("#sampler-sample").addEventListener("click", () => sampler("sample"));
  $("#sampler-reset").addEventListener("click", () => { state.generated = []; sampler(); });
  $("#sampler-form [name=prompt]").addEventListener("change", () => { state.generated = []; });
}

// -- 2. trees ---------------------------------------------------------------------------------

// nodes: [{id, parent, chosen, ...}]; label(node) -> [line1, line2]; cls(node) -> class names.
// Laid out top-aligned with the chosen child first, so the root and the whole chosen path sit
// on the first row; a tree wider than the page is scaled to its width. The view opens with
// both in sight, whatever the tree's size (issue 26).
function drawTree(nodes, label, cls, depthOf) {
  const children = new Map(nodes.map((n) => [n.id, []]));
  for (const n of nodes) if (n.parent !== null) children.get(n.parent).push(n);
  const chosenFirst = (list) => [...list.filter((n) => n.chosen), ...list.filter((n) => !n.chosen)];
  const y = new Map();
  let row = 0;
  const place = (n) => {
    const kids = chosenFirst(children.get(n.id));
    y.set(n.id, row);
    if (!kids.length) row++;
    else kids.forEach(place);
  };
  chosenFirst(nodes.filter((n) => n.parent === null)).forEach(place);
  const W = 124, H = 34, boxW = 106, boxH = 28;  // 15 characters of 11px monospace a box
  const depth = Math.max(...nodes.map(depthOf));
  const width = (depth + 1) * W + 10, height = row * H + 10;
  const svg = el("svg:svg", { class: "tree", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `search tree of ${nodes.length} nodes` });
  const pos = (n) => [5 + depthOf(n) * W, 5 + y.get(n.id) * H];
  const byId = new Map(nodes.map((n) => [n.id, n]));
  for (const n of nodes) if (n.parent !== null) {
    const [x1, y1] = pos(byId.get(n.parent)), [x2, y2] = pos(n);
    svg.append(el("svg:path", { d: `M${x1 + boxW},${y1 + boxH / 2} C${x1 + boxW + 12},${y1 + boxH / 2} ${x2 - 12},${y2 + boxH / 2} ${x2},${y2 + boxH / 2}`,
      class: "edge " + cls(n) }));
  }
  const fit = (text, n) => text.length > n ? text.slice(0, n - 1) + "…" : text;  // stays inside its box
  for (const n of nodes) {
    const [x, yy] = pos(n);
    const [top, bottom] = label(n);
    svg.append(el("svg:g", { class: "node " + cls(n), transform: `translate(${x},${yy})`, "data-id": n.id },
      el("svg:title", { text: top + "\n" + bottom }),
      el("svg:rect", { width: boxW, height: boxH, rx: 4 }),
      el("svg:text", { x: 4, y: 12, text: fit(top, 15) }),
      el("svg:text", { x: 4, y: 24, class: "small", text: fit(bottom, 17) })));
  }
  return el("div", { class: "scroll", tabindex: 0, "aria-label": "tree (scrolls)" }, svg);
}

function showTree(out) {  // the page scrolls to the output when the tree's first row is out of sight
  const root = out.querySelector("svg.tree g.node");
  const box = root && root.getBoundingClientRect();
  if (box && (box.top < 0 || box.bottom > innerHeight)) out.scrollIntoView({ block: "start" });
}

function legend(items) {
  return el("ul", { class: "legend" }, items.map(([c, t]) => el("li", {}, el("span", { class: "swatch " + c }), t)));
}

function renderBeam(data, out) {
  const cls = (n) => [n.fate, n.chosen ? "chosen" : ""].join(" ");
  const label = (n) => n.token === null ? ["prompt", visible(n.text)] : [visible(n.text), `Σ ${n.total.toFixed(2)}  (${n.score.toFixed(2)})`];
  const b = data.budget;
  out.replaceChildren(
    el("p", { class: "budget", text: `${b.num_beams} beams, ${data.steps} steps of at most ${b.max_new_tokens}, ${b.model_calls} model calls, ${b.candidates} candidates ranked` }),
    legend([["live", "kept (a live beam)"], ["finished", "finished hypothesis"], ["pruned", "ranked, not kept (greyed)"], ["chosen", "the chosen hypothesis"]]),
    drawTree(data.nodes, label, cls, (n) => n.step),
    el("ol", { class: "hypotheses" }, data.hypotheses.map((h) => el("li", {},
      el("code", { text: h.text }), ` score ${h.score.toFixed(3)}, ${h.tokens} tokens, ${h.finish_reason}`))));
  showTree(out);
}

function renderTreeSearch(data, out) {
  const cls = (n) => [n.fate === "pruned" ? "pruned" : n.fate === "expanded" ? "live" : "finished", n.chosen ? "chosen" : ""].join(" ");
  const label = (n) => [n.step, n.depth ? `v ${n.value.toFixed(2)} · ${n.fate}` : "question"];
  const b = data.budget;
  out.replaceChildren(
    el("p", { class: "budget", text: `N = ${b.n}, width ${b.width}, depth ≤ ${b.max_depth}: ${b.generator_calls} generator calls, ${b.generated_tokens} tokens generated, ${b.reused_prefix_tokens} prefix tokens reused, ${b.scorer_calls} PRM calls` }),
    el("p", { class: "answer" }, `answer ${data.answer ?? "none"} (true: ${data.truth}) `,
      el("strong", { class: data.correct ? "ok" : "bad", text: data.correct ? "correct" : "wrong" })),
    legend([["live", "expanded"], ["finished", "finished leaf"], ["pruned", "not expanded (greyed)"], ["chosen", "chosen path"]]),
    drawTree(data.nodes, label, cls, (n) => n.depth));
  showTree(out);
}

// -- 3. speculative ---------------------------------------------------------------------------

function chips(block, outcome) {
  const items = block.draft.map((d, i) => {
    const fate = i < outcome.accepted ? "accepted" : i === outcome.accepted ? "rejected" : "unexamined";
    return el("span", { class: "chip " + fate, title: `p ${d.p} q ${d.q} h ${outcome === block.token ? d.h_token : d.h_block}` }, visible(d.text));
  });
  items.push(el("span", { class: "chip extra", title: "from " + outcome.source }, visible(outcome.extra.text),
    el("small", { text: " " + outcome.source })));
  return el("div", { class: "chips" }, items);
}

function renderSpeculative(data, out) {
  const rules = ["token", "block"];
  const totals = el("table", { class: "totals" },
    el("caption", { text: data.greedy ? "Temperature 0: both rules are greedy verification" : "Both rules on the same drafts and uniforms" }),
    el("thead", {}, el("tr", {}, ["rule", "accepted draft tokens", "target calls", "α", "tokens per target call"].map((h) => el("th", { scope: "col", text: h })))),
    el("tbody", {}, rules.map((r) => {
      const t = data.totals[r];
      return el("tr", {}, el("th", { scope: "row", text: r + (r === data.follow ? " (text)" : "") }),
        el("td", { text: t.accepted, class: "accepted-total", "data-rule": r }), el("td", { text: t.target_calls }),
        el("td", { text: t.alpha ?? "–" }), el("td", { text: t.tokens_per_call }));
    })));
  const rows = data.blocks.map((b, i) => el("tr", {},
    el("th", { scope: "row", text: i + 1 }),
    rules.map((r) => el("td", {}, chips(b, b[r]),
      el("small", { text: `τ = ${b[r].accepted}` + (b[r].expected_accepted !== null ? `, E[τ] = ${b[r].expected_accepted}` : "") +
        ` · α ${b.running[r].alpha ?? "–"} · ${b.running[r].tokens_per_call} tok/call` })))));
  out.replaceChildren(
    el("p", { class: "text" }, el("span", { class: "prompt", text: state.last.speculative.request.prompt }), el("mark", { text: data.text })),
    totals,
    legend([["accepted", "accepted draft token"], ["rejected", "rejected"], ["unexamined", "after a rejection"], ["extra", "token from the target (residual or p)"]]),
    el("table", { class: "blocks", id: "speculative-blocks" },
      el("thead", {}, el("tr", {}, el("th", { scope: "col", text: "block" }), rules.map((r) => el("th", { scope: "col", text: r + " verification" })))),
      el("tbody", {}, rows)));
}

// -- 4. votes ---------------------------------------------------------------------------------

function tallyChart(title, tallies, winner) {
  const max = Math.max(1e-9, ...tallies.map((t) => t.total));
  return el("figure", { class: "tally" }, el("figcaption", { text: title }),
    el("svg:svg", { width: 260, height: 22 * tallies.length + 4, role: "img", "aria-label": title },
      tallies.flatMap((t, i) => [
        el("svg:text", { x: 0, y: 22 * i + 15, text: String(t.answer) }),
        el("svg:rect", { x: 50, y: 22 * i + 4, height: 14, width: 150 * t.total / max, class: t.answer === winner ? "win" : "fill" }),
        el("svg:text", { x: 56 + 150 * t.total / max, y: 22 * i + 15, text: t.total.toFixed(2) })])));
}

function renderVotes(data, out) {
  const p = data.picks;
  const pickOf = (name, rule) => el("li", { "data-rule": rule }, el("strong", { text: name + ": " }),
    `answer ${p[rule].answer ?? "none"}` + (p[rule].index !== null ? ` (sample #${p[rule].index})` : ""),
    p[rule].answer === data.truth ? el("span", { class: "ok", text: " ✓" }) : el("span", { class: "bad", text: " ✗" }));
  out.replaceChildren(
    el("p", {}, `True answer: ${data.truth}`),
    el("ul", { class: "picks" }, pickOf("Majority vote", "majority"), pickOf("Weighted vote (by reward)", "weighted"),
      pickOf("Best-of-N (highest reward)", "best_of_n")),
    el("div", { class: "charts" }, tallyChart("Vote counts", p.majority.tallies, p.majority.answer),
      tallyChart("Reward-weighted votes", p.weighted.tallies, p.weighted.answer)),
    el("table", { class: "samples", id: "votes-samples" },
      el("thead", {}, el("tr", {}, ["#", "answer", "reward (arith-orm)", "correct", "solution"].map((h) => el("th", { scope: "col", text: h })))),
      el("tbody", {}, data.samples.map((s) => el("tr", { class: s.index === p.best_of_n.index ? "best" : "" },
        el("th", { scope: "row", text: s.index }), el("td", { text: s.answer ?? "–" }),
        el("td", {}, bar(s.reward), " " + s.reward.toFixed(3)),
        el("td", { class: s.correct ? "ok" : "bad", text: s.correct ? "✓" : "✗" }),
        el("td", {}, el("pre", { text: s.text })))))));
}

// -- start ------------------------------------------------------------------------------------

function onSubmit(id, build, view, render) {
  $(id).addEventListener("submit", (event) => {
    event.preventDefault();
    run(view, build(formValues(event.target)), render);
  });
}

async function load() {
  try {
    state.info = await api("info");
  } catch (error) {  // 401: the views start once the key is entered
    showError(new Error(error.message + " (enter the server's API key above)"));
    $("#api-key").addEventListener("change", load, { once: true });
    return;
  }
  showError(null);
  fillModels();
  setupSampler();
  onSubmit("#beam-form", (v) => ({ model: v.model, prompt: v.prompt, num_beams: v.num_beams, length_penalty: v.length_penalty,
    early_stopping: v.early_stopping, params: pick(v, ["max_new_tokens"]) }), "beam", renderBeam);
  onSubmit("#tree-form", (v) => ({ model: v.model, question: v.question, method: v.method, n: v.n, width: v.width,
    max_depth: v.max_depth, params: pick(v, ["temperature", "seed"]) }), "tree", renderTreeSearch);
  onSubmit("#speculative-form", (v) => ({ model: v.model, draft: v.draft, prompt: v.prompt, num_draft_tokens: v.num_draft_tokens,
    follow: v.follow, params: pick(v, ["temperature", "max_new_tokens", "seed"]) }), "speculative", renderSpeculative);
  onSubmit("#votes-form", (v) => ({ model: v.model, question: v.question, n: v.n, params: pick(v, ["temperature", "seed"]) }),
    "votes", renderVotes);
  await sampler();  // the first view opens showing its default chain at work
  document.body.dataset.ready = "true";
}

setupTabs();
for (const button of document.querySelectorAll("button.export")) button.addEventListener("click", () => exportJSON(button.dataset.view));
load();
