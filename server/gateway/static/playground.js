// dialspec playground: two streams side by side with independent quality dials.
// Talks only to the public HTTP API: GET /v1/dial, POST /v1/chat/completions (stream, dialspec_trace).
// The API key lives in the key field and in requests' headers only: never written to storage.
import { drawBars } from "./chart.js";
import { sseData } from "./sse.js";

const SOURCE_TEXT = {
  draft: "accepted draft token",
  corrected: "correction from the residual",
  bonus: "bonus token (all drafts accepted)",
  target: "target token (autoregressive)",
};

const THUMB_PX = 16; // the range input's thumb width (set in playground.css)
let dial = null; // GET /v1/dial
let running = []; // AbortControllers of the runs in flight

const $ = (sel, root = document) => root.querySelector(sel);

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("#api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// ---- errors --------------------------------------------------------------------------------------
async function errorFrom(resp) {
  let body = null;
  try {
    body = await resp.json();
  } catch (_) {
    /* not JSON */
  }
  const e = (body && body.error) || {};
  return {
    status: resp.status,
    message: e.message || resp.statusText || "request failed",
    param: e.param || null,
    code: e.code || null,
    retryAfter: resp.headers.get("Retry-After"),
  };
}

function describe(err) {
  const head =
    err.status === 429
      ? `HTTP 429: the server is busy${err.retryAfter ? `, retry after ${err.retryAfter} s` : ""}`
      : err.status === 401
        ? "HTTP 401: this server needs an API key (enter it at the top)"
        : err.status
          ? `HTTP ${err.status}${err.code ? ` (${err.code})` : ""}`
          : "error";
  const param = err.param ? ` [${err.param}]` : "";
  return { head, detail: `${err.message}${param}` };
}

function showError(box, err) {
  const { head, detail } = describe(err);
  box.replaceChildren();
  const strong = document.createElement("strong");
  strong.textContent = head;
  box.append(strong, document.createTextNode(detail));
  box.dataset.status = err.status || "";
  box.hidden = false;
}

// ---- the dial ------------------------------------------------------------------------------------
async function loadDial() {
  const box = $("#global-error");
  let resp;
  try {
    resp = await fetch("/v1/dial", { headers: headers() });
  } catch (exc) {
    showError(box, { message: `cannot reach the server: ${exc.message}` });
    return;
  }
  if (!resp.ok) {
    showError(box, await errorFrom(resp));
    $("#served").textContent = "not connected";
    return;
  }
  box.hidden = true;
  dial = await resp.json();
  const mode = dial.token_provenance ? "" : " · this backend does not report per-token provenance";
  $("#served").textContent =
    `${dial.model} · ${dial.backend} · N = ${dial.num_draft} · context ${dial.max_context}` +
    (dial.has_head ? " · learned head" : "") + mode;
  for (const col of columns) col.setDial(dial);
  $("#run").disabled = false;
}

// ---- one column ----------------------------------------------------------------------------------
class Column {
  constructor(section, name) {
    this.el = section;
    section.append($("#column-template").content.cloneNode(true));
    $(".col-title", section).id = `${section.id}-title`;
    $(".col-name", section).textContent = name;
    this.slider = $(".quality", section);
    this.schema = $(".schema", section);
    this.schema.setAttribute("aria-label", `JSON schema for column ${name}`);
    this.auto = $(".auto-toggle", section);
    this.output = $(".output", section);
    this.errorBox = $(".error", section);
    this.chart = $(".chart", section);
    this.slider.setAttribute("aria-label", `quality for column ${name}`);
    this.slider.addEventListener("input", () => this.readout());
    this.auto.addEventListener("change", () => this.readout());
  }

  setDial(d) {
    const marks = $(".marks", this.el);
    marks.replaceChildren();
    for (const t of d.tiers) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "mark";
      b.textContent = t.name;
      b.dataset.tier = t.name;
      // Under the slider's thumb centre: the track runs from THUMB/2 to 100% - THUMB/2; the
      // label is anchored at its left edge for 0, its centre for 0.5, its right edge for 1.
      b.style.left = `calc(${THUMB_PX / 2}px + ${t.quality} * (100% - ${THUMB_PX}px))`;
      b.style.setProperty("--q", `${t.quality * 100}%`);
      b.title = `${t.name}: quality ${t.quality}`;
      b.addEventListener("click", () => {
        this.slider.value = t.quality;
        this.auto.checked = false;
        this.readout();
      });
      marks.append(b);
    }
    // The column's default tier on the first load only: the dial is loaded again whenever the key
    // field changes (a browser fires "change" when it loses focus), and that must not undo a
    // setting the user has made since.
    if (!this.placed) {
      const start = d.tiers.find((t) => t.name === this.el.dataset.default) || d.tiers[d.tiers.length - 1];
      this.slider.value = start.quality;
      this.placed = true;
    }
    $(".auto", this.el).hidden = !d.has_head;
    if (!d.has_head) this.auto.checked = false;
    this.readout();
  }

  tierAt(q) {
    return dial ? dial.tiers.find((t) => Math.abs(t.quality - q) < 1e-9) : undefined;
  }

  // The request's quality: "auto", a tier name when the slider sits on one, else the number.
  quality() {
    if (this.auto.checked) return "auto";
    const q = Number(this.slider.value);
    const tier = this.tierAt(q);
    return tier ? tier.name : q;
  }

  readout() {
    const q = Number(this.slider.value);
    const tier = this.tierAt(q);
    this.slider.disabled = this.auto.checked;
    $(".dial-readout", this.el).textContent = this.auto.checked
      ? "quality auto (learned w_t)"
      : `quality ${q.toFixed(2)}${tier ? ` (${tier.name})` : ""}`;
    for (const m of this.el.querySelectorAll(".mark")) {
      m.classList.toggle("on", !this.auto.checked && tier !== undefined && m.dataset.tier === tier.name);
    }
  }

  reset() {
    this.output.replaceChildren();
    this.errorBox.hidden = true;
    this.chart.hidden = true;
    this.tokens = 0;
    this.accepted = 0;
    this.proposed = 0;
    this.rounds = 0;
    this.chunks = 0;
    this.wSum = 0;
    this.wCount = 0;
    this.byPosition = []; // [{accepted, rounds}] per position in the round
    this.final = null;
    this.endAt = null;
    this.start = performance.now();
    this.firstAt = null;
    this.el.dataset.state = "running";
    this.el.dataset.chunks = "0";
    for (const dd of this.el.querySelectorAll(".metrics dd")) dd.textContent = "–";
  }

  // One `dialspec_trace` entry -> a coloured span and the live counters.
  addToken(t) {
    this.tokens += 1;
    if (t.source !== "target" && t.position === 0) {
      this.rounds += 1;
      this.proposed += t.num_draft;
      for (let i = 0; i < t.num_draft; i++) {
        this.byPosition[i] = this.byPosition[i] || { accepted: 0, rounds: 0 };
        this.byPosition[i].rounds += 1;
      }
    }
    if (t.source === "draft") {
      this.accepted += 1;
      this.byPosition[t.position].accepted += 1;
    }
    if (t.w !== null && t.w !== undefined) {
      this.wSum += t.w;
      this.wCount += 1;
    }
    if (!t.text) return; // held back (a stop-string prefix or an incomplete character)
    const span = document.createElement("span");
    span.className = `tok src-${t.source}`;
    span.textContent = t.text;
    span.dataset.source = t.source;
    span.dataset.w = t.w === null ? "" : String(t.w);
    const where = t.source === "target" ? "" : ` · round position ${t.position + 1} (N = ${t.num_draft})`;
    const w = t.w === null ? "w: none (target or baseline verifier)" : `w = ${t.w.toFixed(3)}`;
    span.dataset.tip = `${SOURCE_TEXT[t.source]}${where} · ${w}`;
    this.output.append(span);
  }

  addText(text) {
    this.output.append(document.createTextNode(text));
  }

  onChunk(choice) {
    this.chunks += 1;
    this.el.dataset.chunks = String(this.chunks);
    const trace = choice.dialspec_trace;
    const text = choice.delta && choice.delta.content;
    if ((trace && trace.length) || text) {
      if (this.firstAt === null) this.firstAt = performance.now();
    }
    if (trace) for (const t of trace) this.addToken(t);
    else if (text) this.addText(text);
    this.output.scrollTop = this.output.scrollHeight;
    this.showMetrics();
  }

  set(metric, value) {
    $(`[data-metric="${metric}"]`, this.el).textContent = value;
  }

  showMetrics() {
    const now = this.endAt || performance.now();
    const f = this.final;
    const tokens = f ? f.usage.completion_tokens : this.tokens;
    const secs = (now - this.start) / 1000;
    this.set("tokens", String(tokens));
    if (secs > 0 && tokens) this.set("tps", (tokens / secs).toFixed(1));
    if (this.firstAt !== null) this.set("ttft", `${Math.round(this.firstAt - this.start)} ms`);
    const s = f && f.dialspec;
    const rate = s ? s.acceptance_rate : this.proposed ? this.accepted / this.proposed : null;
    const mal = s ? s.mean_accepted_length : this.rounds ? 1 + this.accepted / this.rounds : null;
    const meanW = s ? s.mean_w : this.wCount ? this.wSum / this.wCount : null;
    if (rate !== null && rate !== undefined) {
      this.set("acceptance", `${(rate * 100).toFixed(1)}%`);
      this.el.dataset.acceptance = String(rate);
    } else if (s && s.policy === "autoregressive") this.set("acceptance", "n/a (no drafts)");
    if (mal !== null && mal !== undefined) this.set("mal", mal.toFixed(2));
    if (meanW !== null && meanW !== undefined) this.set("meanw", meanW.toFixed(3));
  }

  fail(err) {
    showError(this.errorBox, err);
    this.el.dataset.state = "error";
  }

  finish(final) {
    this.endAt = performance.now();
    this.final = final;
    this.showMetrics();
    this.drawChart();
    this.el.dataset.state = "done";
  }

  // Acceptance by position: the share of rounds whose draft at position i was accepted. The
  // server's counters when it sends them (they also count drafts accepted after a stop token),
  // else what the trace showed.
  drawChart() {
    const s = this.final && this.final.dialspec;
    const bars =
      s && s.drafts && s.accepted_per_position && s.accepted_per_position.length
        ? s.accepted_per_position.map((a) => a / s.drafts)
        : this.byPosition.map((p) => (p.rounds ? p.accepted / p.rounds : 0));
    if (!bars.length) return;
    drawBars($(".chart-svg", this.el), bars);
    this.chart.hidden = false;
  }
}

// ---- streaming -----------------------------------------------------------------------------------
function requestBody(col) {
  const body = {
    model: dial.model,
    messages: [{ role: "user", content: $("#prompt").value }],
    stream: true,
    stream_options: { include_usage: true },
    quality: col.quality(),
  };
  // Sent as typed, unchecked here: the server validates, and the page shows its 4xx.
  const maxTokens = $("#max-tokens").value;
  const temperature = $("#temperature").value;
  const seed = $("#seed").value;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  if (temperature !== "") body.temperature = Number(temperature);
  if (seed !== "") body.seed = Number(seed);
  if (dial.token_provenance) body.dialspec_trace = true;
  // A schema in the column's box: response_format, so the dial runs on constrained output.
  const schema = col.schema.value.trim();
  if (schema !== "") {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "playground", schema: JSON.parse(schema), strict: true },
    };
  }
  return body;
}

async function runColumn(col, controller) {
  col.reset();
  let body;
  try {
    body = JSON.stringify(requestBody(col));
  } catch (exc) {
    col.fail({ message: `the JSON schema is not JSON: ${exc.message}`, param: "response_format" });
    return;
  }
  let resp;
  try {
    resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body,
      signal: controller.signal,
    });
  } catch (exc) {
    col.fail({ message: exc.name === "AbortError" ? "stopped" : `network error: ${exc.message}` });
    return;
  }
  if (!resp.ok) {
    col.fail(await errorFrom(resp));
    return;
  }
  const final = { usage: null, dialspec: null };
  try {
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") break;
      const obj = JSON.parse(data);
      if (obj.error) {
        col.fail({ message: obj.error.message, code: obj.error.code, param: obj.error.param });
        return;
      }
      if (obj.usage) final.usage = obj.usage;
      if (obj.dialspec) final.dialspec = obj.dialspec;
      for (const choice of obj.choices || []) col.onChunk(choice);
    }
  } catch (exc) {
    col.fail({ message: exc.name === "AbortError" ? "stopped" : `stream broken: ${exc.message}` });
    return;
  }
  if (!final.usage) final.usage = { completion_tokens: col.tokens };
  col.finish(final);
}

async function runBoth(event) {
  event.preventDefault();
  if (!dial) {
    await loadDial();
    if (!dial) return;
  }
  $("#run").disabled = true;
  $("#stop").disabled = false;
  running = columns.map(() => new AbortController());
  await Promise.all(columns.map((col, i) => runColumn(col, running[i])));
  running = [];
  $("#run").disabled = false;
  $("#stop").disabled = true;
}

// ---- hover: w_t of the token under the pointer ---------------------------------------------------
function tooltip(event) {
  const tip = $("#tooltip");
  const tok = event.target.closest && event.target.closest(".output .tok");
  if (!tok) {
    tip.hidden = true;
    return;
  }
  tip.textContent = tok.dataset.tip;
  tip.hidden = false;
  tip.style.left = `${Math.min(event.clientX + 12, window.innerWidth - 260)}px`;
  tip.style.top = `${event.clientY + 16}px`;
}

const columns = [new Column($("#col-a"), "A"), new Column($("#col-b"), "B")];
$("#controls").addEventListener("submit", runBoth);
$("#stop").addEventListener("click", () => running.forEach((c) => c.abort()));
$("#api-key").addEventListener("change", () => loadDial());
document.addEventListener("mousemove", tooltip);
$("#run").disabled = true;
loadDial();
