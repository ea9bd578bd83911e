// ringllm's chat page: streams chat and completions from this server's own
// OpenAI routes with fetch and server-sent events. Stop aborts the fetch; the
// server sees the connection close and aborts the request in the engine.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), modelInfo: $("model-info"), keyRow: $("api-key-row"), key: $("api-key"),
  settings: $("settings"), temperature: $("temperature"), maxTokens: $("max-tokens"), topP: $("top-p"),
  ignoreEos: $("ignore-eos"),
  logs: { chat: $("log-chat"), completion: $("log-completion") },
  status: $("status"), form: $("composer"), prompt: $("prompt"), promptLabel: $("prompt-label"),
  send: $("send"), stop: $("stop"), clear: $("clear"),
};
const KEY_STORE = "ringllm.apiKey";
const state = {
  mode: "chat",
  history: [],          // chat messages sent so far, for the next request
  controller: null,     // AbortController of the request in flight
  keyRequired: false,
  drafts: { chat: "", completion: "Once upon a time" },
};

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = ui.key.value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function setStatus(text) { ui.status.textContent = text; }

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function loadConfig() {
  try {
    const response = await fetch("/ui/config");
    if (response.ok) state.keyRequired = Boolean((await response.json()).api_key_required);
  } catch (_) { /* unreachable: loadModels reports it */ }
  if (state.keyRequired) showKeyField();
}

function showKeyField() {
  ui.keyRow.hidden = false;
  ui.key.value = ui.key.value || sessionStorage.getItem(KEY_STORE) || "";
}

async function loadModels() {
  if (state.keyRequired && !ui.key.value.trim()) {
    setStatus("Enter the API key to start.");
    ui.key.focus();
    return;
  }
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (err) {
    setStatus(`Cannot reach the server: ${err.message}`);
    return;
  }
  if (response.status === 401) {
    state.keyRequired = true;
    showKeyField();
    setStatus(ui.key.value ? "The API key was refused." : "Enter the API key to start.");
    return;
  }
  if (!response.ok) {
    setStatus(`Cannot list models: ${await errorMessage(response)}`);
    return;
  }
  const models = (await response.json()).data || [];
  const previous = ui.model.value;
  ui.model.replaceChildren(...models.map((m) => {
    const option = new Option(m.id, m.id);
    option.dataset.maxModelLen = m.max_model_len;
    return option;
  }));
  if (models.some((m) => m.id === previous)) ui.model.value = previous;
  describeModel();
  setStatus("");
  document.body.dataset.ready = "true";
}

function describeModel() {
  const option = ui.model.selectedOptions[0];
  if (!option) { ui.modelInfo.textContent = "No model is served."; return; }
  const limit = Number(option.dataset.maxModelLen);
  ui.modelInfo.textContent = `Context window: ${limit} tokens.`;
  ui.maxTokens.max = String(limit - 1);
}

function setMode(mode) {
  state.drafts[state.mode] = ui.prompt.value;
  state.mode = mode;
  ui.logs.chat.hidden = mode !== "chat";
  ui.logs.completion.hidden = mode !== "completion";
  ui.prompt.value = state.drafts[mode];
  ui.promptLabel.textContent = mode === "chat" ? "Message" : "Prompt to continue";
  ui.prompt.placeholder = mode === "chat" ? "Say hello to Lily" : "Once upon a time";
  ui.send.textContent = mode === "chat" ? "Send" : "Generate";
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function addMessage(log, role, who, text) {
  const article = element("article", `msg ${role}`);
  article.append(element("p", "who", who));
  const body = element("p", "text");
  if (text) body.textContent = text;
  article.append(body);
  log.append(article);
  article.scrollIntoView({ block: "end" });
  return article;
}

function numberFrom(input, fallback) {
  const value = Number(input.value);
  return input.value !== "" && Number.isFinite(value) ? value : fallback;
}

function requestBody() {
  return {
    model: ui.model.value,
    stream: true,
    stream_options: { include_usage: true },  // exact token counts for the statistics line
    temperature: numberFrom(ui.temperature, 1),
    top_p: numberFrom(ui.topP, 1),
    max_tokens: Math.max(1, Math.round(numberFrom(ui.maxTokens, 128))),
    ignore_eos: ui.ignoreEos.checked,  // a vLLM extension: generate up to max_tokens
  };
}

// Yields the JSON body of each server-sent event until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function formatStats(s) {
  const parts = [];
  const approx = s.usageTokens === null ? "≈" : "";
  const tokens = s.usageTokens ?? s.chunks;
  parts.push(`${approx}${tokens} tokens`);
  // Decode speed between the first and last token; when the whole answer came
  // in one network read (a fast server, a short answer), over the whole request.
  if (tokens > 1 && s.last > s.first) {
    parts.push(`${((tokens - 1) / ((s.last - s.first) / 1000)).toFixed(1)} tokens/s`);
  } else if (tokens > 1 && s.last > s.start) {
    parts.push(`${(tokens / ((s.last - s.start) / 1000)).toFixed(1)} tokens/s`);
  }
  if (s.first !== null) parts.push(`TTFT ${Math.round(s.first - s.start)} ms`);
  if (s.finish) parts.push(s.finish === "aborted" ? "stopped" : `finish: ${s.finish}`);
  return parts.join(" · ");
}

async function run(article, path, body, onText) {
  const output = document.createTextNode("");  // one node that grows, however long the answer
  article.querySelector(".text").append(output);
  const statsLine = element("p", "stats");
  article.append(statsLine);
  const stats = { start: performance.now(), first: null, last: null, chunks: 0, usageTokens: null, finish: null };
  const controller = new AbortController();
  state.controller = controller;
  article.dataset.state = "streaming";
  article.setAttribute("aria-busy", "true");  // screen readers read the answer once, when it is complete
  ui.send.disabled = true;
  ui.stop.disabled = false;
  setStatus("");
  // Text is shown in batches: a fast server sends hundreds of chunks a
  // second, and rendering each one would starve the page (and the Stop
  // button) of the main thread. Every ~30 ms the loop shows what arrived
  // and yields, so clicks and painting get their turn.
  let pending = "";
  let shownAt = performance.now();
  const show = () => {
    const log = article.parentElement;
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 48;
    if (pending) { output.appendData(pending); pending = ""; }
    statsLine.textContent = formatStats(stats);
    if (atBottom) log.scrollTop = log.scrollHeight;  // follow the answer unless the user scrolled up
  };
  try {
    const response = await fetch(path, {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) stats.usageTokens = event.usage.completion_tokens;
      for (const choice of event.choices || []) {
        const piece = choice.delta ? choice.delta.content : choice.text;
        if (piece) {
          const now = performance.now();
          if (stats.first === null) stats.first = now;
          stats.last = now;
          stats.chunks += 1;
          pending += piece;
          onText(piece);
        }
        if (choice.finish_reason) stats.finish = choice.finish_reason;
      }
      if (stats.chunks === 1 || performance.now() - shownAt > 30) {
        show();
        await new Promise((resolve) => setTimeout(resolve, 0));
        shownAt = performance.now();
      }
    }
    show();
    article.dataset.state = "done";
  } catch (err) {
    if (controller.signal.aborted) {
      stats.finish = "aborted";
      article.dataset.state = "stopped";
    } else {
      article.dataset.state = "error";
      const line = element("p", "error", err.message);
      line.setAttribute("role", "alert");
      article.append(line);
    }
  } finally {
    show();
    article.removeAttribute("aria-busy");
    state.controller = null;
    ui.send.disabled = false;
    ui.stop.disabled = true;
    article.scrollIntoView({ block: "end" });
  }
}

async function submit() {
  if (state.controller) return;
  const prompt = ui.prompt.value;
  if (!prompt.trim()) { ui.prompt.focus(); return; }
  if (!ui.model.value) { await loadModels(); if (!ui.model.value) return; }
  const body = requestBody();
  if (state.mode === "chat") {
    addMessage(ui.logs.chat, "user", "You", prompt);
    state.history.push({ role: "user", content: prompt });
    ui.prompt.value = "";
    body.messages = state.history.slice();
    const article = addMessage(ui.logs.chat, "assistant", ui.model.value);
    const reply = { role: "assistant", content: "" };
    await run(article, "/v1/chat/completions", body, (piece) => { reply.content += piece; });
    if (reply.content) state.history.push(reply);
    else state.history.pop();  // no answer: forget the question too, so turns stay paired
  } else {
    body.prompt = prompt;
    const article = addMessage(ui.logs.completion, "completion", ui.model.value);
    const text = article.querySelector(".text");
    text.append(element("span", "prompt-text", prompt));
    await run(article, "/v1/completions", body, () => {});
  }
  ui.prompt.focus();
}

function stop() {
  if (state.controller) state.controller.abort();
}

function clearLog() {
  stop();
  ui.logs[state.mode].replaceChildren();
  if (state.mode === "chat") state.history = [];
  ui.prompt.focus();
}

ui.form.addEventListener("submit", (e) => { e.preventDefault(); submit(); });
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
});
document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
ui.stop.addEventListener("click", stop);
ui.clear.addEventListener("click", clearLog);
ui.model.addEventListener("change", describeModel);
ui.key.addEventListener("change", () => {
  sessionStorage.setItem(KEY_STORE, ui.key.value.trim());
  loadModels();
});
for (const radio of document.querySelectorAll('input[name="mode"]')) {
  radio.addEventListener("change", () => setMode(radio.value));
}

if (window.matchMedia("(min-width: 48rem)").matches) ui.settings.open = true;
setMode("chat");
loadConfig().then(loadModels);
