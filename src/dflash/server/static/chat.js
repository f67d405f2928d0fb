// Chat page of `dflash serve`: talks to the server's own OpenAI-compatible API on the same origin.
// Answers stream from POST /v1/chat/completions (stream: true); the last chunk's `timings` give the speed
// line and the acceptance histogram under each answer. Model output is only ever set as textContent.
"use strict";

const KEY_STORAGE = "dflash.apiKey";
const state = { messages: [], controller: null, model: null };

function byId(id) {
  return document.getElementById(id);
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function requestHeaders(withBody) {
  const headers = {};
  if (withBody) headers["Content-Type"] = "application/json";
  const key = byId("api-key").value.trim();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

function errorMessage(body, status) {
  const error = body && body.error;
  if (error && typeof error.message === "string") return error.message;
  return "request failed (HTTP " + status + ")";
}

function showNotice(text) {
  const notice = byId("notice");
  notice.textContent = text;
  notice.hidden = !text;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: requestHeaders(false) });
    const body = await response.json().catch(() => null);
    if (!response.ok) {
      state.model = null;
      byId("model").textContent = "model unavailable";
      showNotice(response.status === 401 ? "This server needs an API key: " + errorMessage(body, 401)
        : errorMessage(body, response.status));
      return;
    }
    const card = body.data[0];
    state.model = card.id;
    byId("model").textContent = card.id + (card.spec ? " · spec " + card.spec : "");
    showNotice("");
  } catch (err) {
    byId("model").textContent = "server unreachable";
    showNotice(String(err));
  }
}

function scrollToEnd() {
  const view = byId("conversation");
  view.scrollTop = view.scrollHeight;
}

function addUserMessage(text) {
  const box = element("div", "message user");
  box.append(element("div", "role", "you"), element("div", "text", text));
  byId("conversation").append(box);
  scrollToEnd();
}

function addAssistantMessage() {
  const box = element("div", "message assistant");
  const parts = {
    box,
    reasoning: element("div", "reasoning"),
    text: element("div", "text"),
    status: element("div", "status", "…"),
  };
  box.append(element("div", "role", "assistant"), parts.reasoning, parts.text, parts.status);
  byId("conversation").append(box);
  scrollToEnd();
  return parts;
}

function statItem(name, label, value) {
  const item = element("span", "stat " + name);
  item.append(label + " ", element("b", "value", value));
  return item;
}

// Bars for rounds that accepted k drafts, k = 0..max, scaled to the tallest bin.
function histogram(counts) {
  const wrap = element("div", "histogram-wrap");
  const bins = element("div", "histogram");
  const tallest = Math.max(1, ...counts);
  counts.forEach((count, k) => {
    const bin = element("div", "bin");
    bin.dataset.k = String(k);
    bin.dataset.count = String(count);
    bin.title = count + " round(s) accepted " + k + " draft token(s)";
    const bar = element("div", "bar");
    bar.style.height = Math.round((count / tallest) * 32) + "px";
    bin.append(element("span", "count", String(count)), bar, element("span", "k", String(k)));
    bins.append(bin);
  });
  wrap.append(element("div", "histogram-label", "rounds by drafts accepted"), bins);
  return wrap;
}

function showTimings(parts, timings) {
  const stats = element("div", "stats");
  stats.append(statItem("tokens-per-second", "tokens/s", Number(timings.predicted_per_second).toFixed(1)));
  const rounds = Number(timings.rounds) || 0;
  if (rounds > 0) {
    stats.append(
      statItem("acceptance-length", "acceptance length", Number(timings.acceptance_length).toFixed(2)),
      statItem("rounds", "rounds", String(rounds)),
      statItem("accepted", "accepted", String(timings.accepted_tokens)),
    );
  }
  stats.append(statItem("spec", "spec", String(timings.spec)));
  if (rounds > 0 && Array.isArray(timings.acceptance_histogram)) {
    stats.append(histogram(timings.acceptance_histogram.map(Number)));
  }
  parts.box.append(stats);
  scrollToEnd();
}

// The `data:` payloads of a server-sent event stream, one string per event (comments skipped).
async function* eventData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

function setBusy(busy) {
  byId("send").disabled = busy;
  byId("stop").disabled = !busy;
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  addUserMessage(text);
  const parts = addAssistantMessage();
  const history = state.messages;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let content = "";
  let finish = null;
  try {
    const body = { messages: history, stream: true };
    if (state.model) body.model = state.model;
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: requestHeaders(true), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      throw new Error(errorMessage(error, response.status));
    }
    for await (const data of eventData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(errorMessage(chunk, 500));
      const choice = chunk.choices && chunk.choices[0];
      const delta = (choice && choice.delta) || {};
      if (typeof delta.content === "string" && delta.content) {
        content += delta.content;
        parts.text.textContent = content;
        scrollToEnd();
      }
      if (typeof delta.reasoning_content === "string") parts.reasoning.textContent += delta.reasoning_content;
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (chunk.timings && !parts.box.querySelector(".stats")) showTimings(parts, chunk.timings);
    }
    parts.status.textContent = finish ? "finished: " + finish : "stream ended early";
  } catch (err) {
    const stopped = controller.signal.aborted;
    parts.status.textContent = stopped ? "stopped" : "error: " + err.message;
    parts.status.classList.toggle("error", !stopped);
  } finally {
    // A stopped answer stays in the history as far as it got, so the next turn sees what the user saw
    // (unless the conversation was cleared meanwhile).
    if (content && state.messages === history) history.push({ role: "assistant", content });
    if (state.controller === controller) {
      state.controller = null;
      setBusy(false);
    }
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

function clearConversation() {
  stop();
  state.messages = [];
  byId("conversation").replaceChildren();
  byId("prompt").focus();
}

function setUp() {
  const keyInput = byId("api-key");
  keyInput.value = localStorage.getItem(KEY_STORAGE) || "";
  // The key is kept only once the user typed one; emptying the field forgets it.
  keyInput.addEventListener("input", () => {
    const key = keyInput.value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  });
  keyInput.addEventListener("change", loadModel);
  byId("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = byId("prompt");
    const text = prompt.value.trim();
    if (!text || state.controller) return;
    prompt.value = "";
    send(text);
  });
  byId("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      byId("composer").requestSubmit();
    }
  });
  byId("stop").addEventListener("click", stop);
  byId("clear").addEventListener("click", clearConversation);
  loadModel();
}

document.addEventListener("DOMContentLoaded", setUp);
