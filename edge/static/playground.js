// Sluice playground: chat with the edge's /v1 API from a browser. No build step, no dependencies.
// It reads the same Server-Sent Events the SDKs read: `data:` chunks, `event: error`, `: heartbeat`
// comments and `data: [DONE]`. An API key, when the edge asks for one, lives in `state.apiKey` only.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  // `epoch` changes when the conversation is cleared, so a turn still finishing cannot write into it.
  const state = { apiKey: "", history: [], controller: null, pendingToolCalls: [], epoch: 0, images: [] };
  const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
  const views = new WeakMap(); // answer <li> → its AnswerView
  const EXAMPLE_TOOLS = [{
    type: "function",
    function: {
      name: "get_weather",
      description: "Current weather in a city",
      parameters: {
        type: "object",
        properties: {
          city: { type: "string", maxLength: 40 },
          unit: { type: "string", enum: ["celsius", "fahrenheit"] },
        },
        required: ["city", "unit"],
      },
    },
  }];
  const EXAMPLE_SCHEMA = {
    type: "object",
    properties: { name: { type: "string", maxLength: 20 }, age: { type: "integer", minimum: 0, maximum: 120 } },
    required: ["name", "age"],
    additionalProperties: false,
  };

  // Builds an element; children are nodes or strings (always text, never HTML).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "hidden") node.hidden = value;
      else node.setAttribute(key, value);
    }
    node.append(...children);
    return node;
  }

  function say(text) { $("status").textContent = text; }

  function headers() {
    const out = { "Content-Type": "application/json" };
    if (state.apiKey) out.Authorization = `Bearer ${state.apiKey}`;
    for (const [id, name] of [["timeout", "X-Sluice-Timeout"], ["idle_timeout", "X-Sluice-Idle-Timeout"]]) {
      if ($(id).value !== "") out[name] = $(id).value;
    }
    return out;
  }

  function describeError(body, status) {
    const error = body && body.error;
    if (!error || typeof error !== "object") return `HTTP ${status}`;
    const kind = [error.type, error.code].filter(Boolean).join(", ");
    return `${kind ? kind + ": " : ""}${error.message || "error"}${error.param ? ` (param: ${error.param})` : ""}`;
  }

  // ------------------------------------------------------------------ API key and models

  function askForKey(reason) {
    $("key-reason").textContent = reason;
    $("key-form").hidden = false;
    $("api-key").focus();
  }

  async function loadModels() {
    say("");
    $("models-status").textContent = "loading models…";
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (error) {
      $("models-status").textContent = `cannot reach the edge (${error.message})`;
      return;
    }
    const body = await response.json().catch(() => null);
    if (response.status === 401) {
      $("models-status").textContent = "an API key is needed";
      askForKey(state.apiKey ? `The edge refused this key: ${describeError(body, 401)}` :
        "This edge requires an API key.");
      return;
    }
    if (!response.ok) {
      $("models-status").textContent = `models: ${describeError(body, response.status)}`;
      return;
    }
    const select = $("model");
    const previous = select.value;
    select.replaceChildren(...body.data.map((m) => el("option", { value: m.id }, m.id)));
    if (body.data.some((m) => m.id === previous)) select.value = previous;
    $("models-status").textContent = `${body.data.length} model${body.data.length === 1 ? "" : "s"}`;
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.apiKey = $("api-key").value.trim();
    $("api-key").value = "";
    $("key-form").hidden = true;
    say("API key set (kept in this page's memory only).");
    loadModels().then(() => { if ($("key-form").hidden) $("composer").focus(); });
  });

  // ------------------------------------------------------------------ settings → request body

  class FieldError extends Error {
    constructor(field, message) { super(message); this.field = field; }
  }

  function number(id, body, name) {
    const input = $(id);
    if (input.validity.badInput) throw new FieldError(id, `${name}: not a number`);
    if (input.value === "") return;
    if (!input.checkValidity() || Number.isNaN(input.valueAsNumber)) {
      throw new FieldError(id, `${name}: ${input.validationMessage || "not a number"}`);
    }
    body[name] = input.valueAsNumber;
  }

  function json(id, what) {
    const text = $(id).value.trim();
    if (!text) return undefined;
    try {
      return JSON.parse(text);
    } catch (error) {
      throw new FieldError(id, `${what} is not valid JSON: ${error.message}`);
    }
  }

  function parseTools() {
    const tools = json("tools", "Tools");
    if (tools !== undefined && !Array.isArray(tools)) throw new FieldError("tools", "Tools must be a JSON array.");
    return tools;
  }

  // Offers each defined function as a forced tool choice.
  function refreshToolChoices() {
    const select = $("tool_choice");
    const chosen = select.value;
    select.querySelectorAll("option[data-function]").forEach((option) => option.remove());
    let tools = [];
    try { tools = parseTools() || []; } catch { /* reported when sending */ }
    for (const tool of tools) {
      const name = tool && tool.function && tool.function.name;
      if (typeof name === "string") {
        select.append(el("option", { value: `function:${name}`, "data-function": "" }, `force ${name}`));
      }
    }
    if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
  }

  function requestBody(messages) {
    const body = {
      model: $("model").value,
      messages,
      stream: true,
      // Usage on every chunk: the figures are known even for a stream stopped early.
      stream_options: { include_usage: true, continuous_usage_stats: true },
    };
    if (!body.model) throw new FieldError("model", "No model to ask: the model list is empty.");
    number("temperature", body, "temperature");
    number("top_p", body, "top_p");
    number("max_tokens", body, "max_tokens");
    number("seed", body, "seed");
    if ($("logprobs").checked) {
      body.logprobs = true;
      number("top_logprobs", body, "top_logprobs");
    }
    const tools = parseTools();
    if (tools && tools.length) body.tools = tools;
    const choice = $("tool_choice").value;
    if (choice.startsWith("function:")) body.tool_choice = { type: "function", function: { name: choice.slice(9) } };
    else if (choice) body.tool_choice = choice;
    const format = $("format").value;
    if (format === "json_object") body.response_format = { type: "json_object" };
    if (format === "json_schema") {
      const schema = json("schema", "The JSON schema");
      if (schema === undefined) throw new FieldError("schema", "Response format JSON schema needs a schema.");
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
    }
    const extra = json("extra", "Extra request fields");
    if (extra !== undefined && (extra === null || typeof extra !== "object" || Array.isArray(extra))) {
      throw new FieldError("extra", "Extra request fields must be a JSON object.");
    }
    return Object.assign(body, extra || {});
  }

  function showSettingsError(error) {
    const box = $("settings-error");
    box.textContent = error.message;
    box.hidden = false;
    const field = $(error.field);
    const details = field.closest("details");
    if (details) details.open = true;
    field.setAttribute("aria-invalid", "true");
    field.focus();
  }

  // ------------------------------------------------------------------ SSE parsing

  // Returns push(text): feeds decoded text; calls onEvent(type, data) per event and onComment(text).
  function sseParser(onEvent, onComment) {
    let buffer = "";
    let type = "";
    let data = [];
    return (text) => {
      buffer += text;
      // A trailing "\r" may be the first half of "\r\n": keep it for the next piece.
      const cut = buffer.endsWith("\r") ? buffer.length - 1 : buffer.length;
      const lines = buffer.slice(0, cut).split(/\r\n|\r|\n/);
      buffer = lines.pop() + buffer.slice(cut);
      for (const line of lines) {
        if (line === "") {
          if (data.length) onEvent(type || "message", data.join("\n"));
          type = "";
          data = [];
        } else if (line.startsWith(":")) {
          onComment(line.slice(1).trim());
        } else {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (field === "event") type = value;
          else if (field === "data") data.push(value);
        }
      }
    };
  }

  // ------------------------------------------------------------------ the conversation view

  // A message's content as nodes: its text, and each image part as a thumbnail.
  function contentNodes(content) {
    if (!Array.isArray(content)) return [content];
    return content.map((p) => (p.type === "text" ? p.text : el("img", { src: p.image_url.url, alt: "image" })));
  }

  // Attached images (data URLs) wait under the composer until the next message takes them.
  function showImages() {
    $("images").replaceChildren(...state.images.map((url, i) => {
      const remove = el("button", { type: "button", "aria-label": `Remove image ${i + 1}` }, "×");
      remove.addEventListener("click", () => { state.images.splice(i, 1); showImages(); });
      return el("span", { class: "thumb" }, el("img", { src: url, alt: `image ${i + 1}` }), remove);
    }));
  }

  function attach(files) {
    for (const file of files) {
      if (!IMAGE_TYPES.includes(file.type)) { say(`Not attached: ${file.type || "unknown type"} (PNG, JPEG, WebP or GIF only)`); continue; }
      const reader = new FileReader();
      reader.onload = () => { state.images.push(reader.result); showImages(); say("Image attached."); };
      reader.readAsDataURL(file);
    }
  }

  function addUserTurn(message) {
    const label = message.role === "tool" ? `Tool result for ${message.tool_call_id}` : "You";
    const item = el("li", { class: "user" }, el("div", { class: "who" }, label),
      el("div", { class: "answer" }, ...contentNodes(message.content)));
    $("log").append(item);
    return item;
  }

  // One assistant answer being streamed; every method renders one kind of event.
  class AnswerView {
    constructor() {
      this.reasoning = el("div");
      this.reasoningBox = el("details", { class: "reasoning", open: "", hidden: true },
        el("summary", {}, "Reasoning"), this.reasoning);
      this.answer = el("div", { class: "answer", "aria-live": "polite", "aria-busy": "true",
        "aria-label": "Answer" });
      this.tools = el("div", { class: "tool-calls" });
      this.events = el("p", { class: "events", hidden: true });
      this.error = el("p", { class: "error", role: "alert", hidden: true });
      this.stats = el("dl", { class: "stats", hidden: true });
      this.item = el("li", { class: "assistant" }, el("div", { class: "who" }, "Assistant"),
        this.reasoningBox, this.answer, this.tools, this.events, this.error, this.stats);
      this.tokens = []; // logprob entries per token span, by data-i
      this.calls = []; // {id, name, arguments, nameNode, argsNode, badge}
      this.content = "";
      this.heartbeats = 0;
      $("log").append(this.item);
      this.item.scrollIntoView({ block: "end" });
    }

    addReasoning(text) {
      this.reasoningBox.hidden = false;
      this.reasoning.append(text);
    }

    // `entries`: the chunk's logprobs.content (or undefined). Each token gets its own span when the
    // tokens spell the text exactly; otherwise the text shares one span holding all its entries.
    addContent(text, entries) {
      this.content += text;
      if (!entries || !entries.length) {
        this.answer.append(text);
        return;
      }
      const pieces = entries.map((e) => e.token).join("") === text ? entries.map((e) => [e.token, [e]])
        : [[text, entries]];
      for (const [piece, held] of pieces) {
        this.answer.append(el("span", { class: "tok", "data-i": String(this.tokens.length) }, piece));
        this.tokens.push(held);
      }
      this.answer.tabIndex = 0;
      this.answer.setAttribute("aria-description",
        "Use the left and right arrow keys to read each token's probability and alternatives.");
    }

    addRefusal(text) {
      this.addContent(text);
      this.answer.classList.add("refusal");
    }

    addToolCall(delta) {
      let call = this.calls[delta.index];
      if (!call) {
        const nameNode = el("code", { class: "name" });
        const argsNode = el("pre", { class: "args", "aria-label": "Arguments" });
        const badge = el("span", { class: "badge", hidden: true });
        const box = el("div", { class: "tool" }, "Tool call ", nameNode, " ", badge, argsNode);
        this.tools.append(box);
        call = this.calls[delta.index] = { id: "", name: "", arguments: "", nameNode, argsNode, badge };
      }
      const fn = delta.function || {};
      if (delta.id) call.id = delta.id;
      if (fn.name) { call.name += fn.name; call.nameNode.textContent = call.name; }
      if (fn.arguments) { call.arguments += fn.arguments; call.argsNode.textContent = call.arguments; }
    }

    heartbeat() {
      this.heartbeats += 1;
      this.events.hidden = false;
      const time = new Date().toLocaleTimeString();
      this.events.textContent = `♥ ${this.heartbeats} heartbeat${this.heartbeats > 1 ? "s" : ""} ` +
        `(the server is still working; last at ${time})`;
      say(`Heartbeat at ${time}: still waiting for the model.`);
    }

    fail(text) {
      this.error.hidden = false;
      this.error.textContent = this.error.textContent ? `${this.error.textContent}\n${text}` : text;
    }

    // Marks JSON validity of tool arguments, and of the answer when a JSON format was asked.
    checkJson(jsonAnswer) {
      for (const call of this.calls.filter(Boolean)) {
        call.badge.hidden = false;
        try {
          call.argsNode.textContent = JSON.stringify(JSON.parse(call.arguments), null, 2);
          call.badge.textContent = "valid JSON";
        } catch {
          call.badge.textContent = "not valid JSON";
        }
      }
      if (jsonAnswer && this.content) {
        let verdict = "valid JSON";
        try { JSON.parse(this.content); } catch { verdict = "not valid JSON"; }
        this.answer.before(el("span", { class: "badge json-verdict" }, verdict));
      }
    }

    finish(figures) {
      this.answer.setAttribute("aria-busy", "false");
      this.stats.hidden = false;
      for (const [key, label, value] of figures) {
        if (value !== undefined && value !== null && value !== "") {
          this.stats.append(el("div", { "data-stat": key }, el("dt", {}, label), el("dd", {}, String(value))));
        }
      }
    }

    message() {
      const calls = this.calls.filter(Boolean).map((c) => ({
        id: c.id, type: "function", function: { name: c.name, arguments: c.arguments },
      }));
      const message = { role: "assistant", content: this.content || (calls.length ? null : "") };
      if (calls.length) message.tool_calls = calls;
      return message;
    }
  }

  // ------------------------------------------------------------------ logprob tooltip

  function showTip(span) {
    const view = views.get(span.closest("li"));
    const entries = view && view.tokens[Number(span.dataset.i)];
    if (!entries) return;
    const tip = $("tip");
    const rows = [];
    for (const entry of entries) {
      const p = (lp) => `${(100 * Math.exp(lp)).toFixed(1)}%`;
      rows.push(el("tr", { class: "chosen" }, el("td", {}, el("code", {}, JSON.stringify(entry.token))),
        el("td", {}, entry.logprob.toFixed(3)), el("td", {}, p(entry.logprob))));
      for (const alt of entry.top_logprobs || []) {
        rows.push(el("tr", { class: "alt" }, el("td", {}, el("code", {}, JSON.stringify(alt.token))),
          el("td", {}, alt.logprob.toFixed(3)), el("td", {}, p(alt.logprob))));
      }
    }
    const head = el("tr", {}, el("th", {}, "token"), el("th", {}, "logprob"), el("th", {}, "p"));
    tip.replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
    tip.hidden = false;
    tip.dataset.summary = entries.map(describeEntry).join("; ");
    // Above the token when it fits (the text being read stays visible below), else under it.
    const box = span.getBoundingClientRect();
    tip.style.left = `${Math.max(4, Math.min(window.scrollX + box.left,
      window.scrollX + document.documentElement.clientWidth - tip.offsetWidth - 4))}px`;
    const above = box.top - tip.offsetHeight - 4;
    tip.style.top = `${window.scrollY + (above > 0 ? above : box.bottom + 4)}px`;
  }

  // One token's figures as a sentence, for screen readers.
  function describeEntry(entry) {
    const p = (lp) => `${(100 * Math.exp(lp)).toFixed(1)}%`;
    const alternatives = (entry.top_logprobs || []).map((a) => `${JSON.stringify(a.token)} ${p(a.logprob)}`);
    return `${JSON.stringify(entry.token)}, logprob ${entry.logprob.toFixed(3)} (${p(entry.logprob)})` +
      (alternatives.length ? `; alternatives: ${alternatives.join(", ")}` : "");
  }

  function hideTip() { $("tip").hidden = true; }

  $("log").addEventListener("mouseover", (event) => {
    const span = event.target.closest && event.target.closest(".tok");
    if (span) showTip(span); else hideTip();
  });
  $("log").addEventListener("mouseleave", hideTip);
  // Keyboard: an answer with logprobs takes focus; arrows move between its tokens.
  $("log").addEventListener("keydown", (event) => {
    const answer = event.target;
    if (!answer.classList || !answer.classList.contains("answer") || answer.tabIndex !== 0) return;
    const spans = answer.querySelectorAll(".tok");
    if (!spans.length) return;
    if (event.key === "Escape") { hideTip(); return; }
    const step = { ArrowRight: 1, ArrowLeft: -1, Home: -Infinity, End: Infinity }[event.key];
    if (step === undefined) return;
    event.preventDefault();
    const current = answer.querySelector(".tok.active");
    let index = current ? [...spans].indexOf(current) : -1;
    index = Math.max(0, Math.min(spans.length - 1, Number.isFinite(step) ? index + step :
      (step > 0 ? spans.length - 1 : 0)));
    if (current) current.classList.remove("active");
    spans[index].classList.add("active");
    showTip(spans[index]);
    say(`Token ${index + 1} of ${spans.length}: ${$("tip").dataset.summary}`);
  });
  $("log").addEventListener("focusout", hideTip);

  // ------------------------------------------------------------------ one chat turn

  function streaming(on) {
    // A focused button that gets disabled would drop the focus to the page: move it on first.
    if (!on && document.activeElement === $("stop")) $("composer").focus();
    $("send").disabled = on;
    $("stop").disabled = !on;
  }

  function nextMessage(text) {
    if (!$("reply-as-tool").hidden && $("as-tool").checked) {
      return { role: "tool", tool_call_id: state.pendingToolCalls[0], content: text };
    }
    if (!state.images.length) return { role: "user", content: text };
    const images = state.images.map((url) => ({ type: "image_url", image_url: { url } }));
    return { role: "user", content: [{ type: "text", text }, ...images] };
  }

  function showPendingToolCall() {
    const pending = state.pendingToolCalls[0];
    $("reply-as-tool").hidden = !pending;
    $("as-tool").checked = Boolean(pending);
    $("tool-call-id").textContent = pending || "";
  }

  async function send() {
    const text = $("composer").value;
    if (!text.trim() || state.controller) return;
    $("settings-error").hidden = true;
    document.querySelectorAll("[aria-invalid]").forEach((node) => node.removeAttribute("aria-invalid"));
    const message = nextMessage(text);
    const system = $("system").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history, message];
    let body;
    try {
      body = requestBody(messages);
    } catch (error) {
      if (error instanceof FieldError) { showSettingsError(error); return; }
      throw error;
    }
    const epoch = state.epoch;
    const userItem = addUserTurn(message);
    $("composer").value = "";
    state.images = [];
    showImages();
    const view = new AnswerView();
    views.set(view.item, view);
    const controller = state.controller = new AbortController();
    streaming(true);
    say("Sending…");
    const began = performance.now();
    const figures = { began, first: null, last: null, usage: null, finish: null };
    let response = null;
    let outcome = "done";
    try {
      response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) {
        const error = await response.json().catch(() => null);
        outcome = "refused";
        view.fail(`The edge refused the request (HTTP ${response.status}) ${describeError(error, response.status)}`);
        if (response.status === 401) askForKey(`The edge needs a valid API key: ${describeError(error, 401)}`);
      } else {
        say("Streaming…");
        outcome = await readStream(response, view, figures);
      }
    } catch (error) {
      if (error.name === "AbortError") {
        outcome = "stopped";
      } else {
        outcome = "failed";
        view.fail(`The stream broke: ${error.message}`);
      }
    }
    state.controller = null;
    finishTurn(view, figures, response, outcome, body);
    // A conversation cleared meanwhile is gone: this turn no longer belongs anywhere.
    if (epoch === state.epoch) recordTurn(message, view, outcome, userItem, text);
    showPendingToolCall();
    streaming(false);
  }

  // Keeps a finished turn in the conversation; a turn that got no answer gives its text back instead.
  function recordTurn(message, view, outcome, userItem, text) {
    if (outcome === "refused" || (outcome === "failed" && !view.content && !view.calls.length)) {
      userItem.classList.add("not-sent");
      userItem.querySelector(".who").append(" (not sent)");
      $("composer").value = text;
      if (Array.isArray(message.content)) {
        state.images = message.content.filter((p) => p.type === "image_url").map((p) => p.image_url.url);
        showImages();
      }
      return;
    }
    state.history.push(message);
    if (message.role === "tool") state.pendingToolCalls.shift();
    const answer = view.message();
    if (answer.content !== "" || answer.tool_calls) state.history.push(answer);
    state.pendingToolCalls.push(...(answer.tool_calls || []).map((c) => c.id));
  }

  // Reads the SSE body to its end; returns "done", "error" (an error event) or "incomplete" (no [DONE]).
  async function readStream(response, view, figures) {
    let outcome = "incomplete";
    const onEvent = (type, data) => {
      if (data === "[DONE]") {
        if (outcome === "incomplete") outcome = "done";
        return;
      }
      let chunk;
      try { chunk = JSON.parse(data); } catch {
        view.fail(`An event that is not JSON: ${data.slice(0, 200)}`);
        return;
      }
      if (type === "error" || chunk.error) {
        outcome = "error";
        view.fail(`Error event from the server: ${describeError(chunk, 200)}`);
        say("The stream ended with an error.");
        return;
      }
      if (chunk.usage) figures.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const got = delta.reasoning_content || delta.content || delta.refusal || delta.tool_calls;
        if (got) {
          figures.last = performance.now();
          if (figures.first === null) figures.first = figures.last;
        }
        if (delta.reasoning_content) view.addReasoning(delta.reasoning_content);
        if (delta.content) view.addContent(delta.content, choice.logprobs && choice.logprobs.content);
        if (delta.refusal) view.addRefusal(delta.refusal);
        for (const call of delta.tool_calls || []) view.addToolCall(call);
        if (choice.finish_reason) figures.finish = choice.finish_reason;
      }
    };
    const push = sseParser(onEvent, (comment) => { if (comment === "heartbeat") view.heartbeat(); });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      push(value);
    }
    push("\n\n"); // dispatch a last event that lacked its blank line
    if (outcome === "incomplete") view.fail("The stream ended without data: [DONE].");
    return outcome;
  }

  function finishTurn(view, figures, response, outcome, body) {
    const usage = figures.usage || {};
    const ms = (t) => (t === null ? null : `${Math.round(t)} ms`);
    let rate = null;
    if (usage.completion_tokens > 1 && figures.last > figures.first) {
      rate = ((usage.completion_tokens - 1) * 1000 / (figures.last - figures.first)).toFixed(1);
    }
    const header = (name) => (response ? response.headers.get(name) : null);
    const ended = { done: figures.finish || "done", stopped: "stopped by you", error: "error event",
      refused: "refused", failed: "connection failed", incomplete: "incomplete" }[outcome];
    view.checkJson(body.response_format && body.response_format.type !== "text");
    view.finish([
      ["end", "End", ended],
      ["ttft", "Time to first token", figures.first === null ? null : ms(figures.first - figures.began)],
      ["rate", "Tokens/s", rate],
      ["prompt", "Prompt tokens", usage.prompt_tokens],
      ["completion", "Completion tokens", usage.completion_tokens],
      ["cached", "Cached tokens", usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null],
      ["reasoning", "Reasoning tokens", usage.completion_tokens_details &&
        usage.completion_tokens_details.reasoning_tokens || null],
      ["worker", "Worker", header("X-Sluice-Worker-ID")],
      ["request", "Request id", header("X-Request-ID")],
    ]);
    say({ done: "Done.", stopped: "Stopped.", error: "The stream ended with an error.",
      refused: "The request was refused.", failed: "The connection failed.",
      incomplete: "The stream ended early." }[outcome]);
  }

  // ------------------------------------------------------------------ wiring

  $("send-form").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("composer").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); send(); }
    if (event.key === "Escape" && state.controller) state.controller.abort();
  });
  $("composer").addEventListener("paste", (event) => {
    const files = [...(event.clipboardData ? event.clipboardData.files : [])];
    if (files.length) { event.preventDefault(); attach(files); }
  });
  $("send-form").addEventListener("dragover", (event) => event.preventDefault());
  $("send-form").addEventListener("drop", (event) => {
    event.preventDefault();
    attach(event.dataTransfer ? event.dataTransfer.files : []);
  });
  $("image-file").addEventListener("change", (event) => { attach(event.target.files); event.target.value = ""; });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.epoch += 1;
    state.history = [];
    state.images = [];
    showImages();
    state.pendingToolCalls = [];
    showPendingToolCall();
    $("log").replaceChildren();
    say("Conversation cleared.");
    $("composer").focus();
  });
  $("tools").addEventListener("input", refreshToolChoices);
  $("tools-example").addEventListener("click", () => {
    $("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
    refreshToolChoices();
  });
  $("schema-example").addEventListener("click", () => {
    $("schema").value = JSON.stringify(EXAMPLE_SCHEMA, null, 2);
    $("format").value = "json_schema";
  });
  $("format").addEventListener("change", () => { $("schema").required = $("format").value === "json_schema"; });
  refreshToolChoices();
  loadModels();
})();
