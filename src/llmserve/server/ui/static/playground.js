// The playground page: chat with streaming, stop, regenerate, sampling settings, a model
// picker from /v1/models, per-message figures and conversations in localStorage.
import {ApiError, getJSON, getKey, setKey, streamEvents} from "./api.js";
import {ConversationStore, loadSettings, saveSettings} from "./conversations.js";
import {renderInto} from "./markdown.js";

const $ = (id) => document.getElementById(id);
const NUMBER_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "seed"];
const store = new ConversationStore();
let controller = null;   // the AbortController of the generation in flight

function notice(text) {
  const box = $("notice");
  box.textContent = text || "";
  box.hidden = !text;
}

function askForKey(message) {
  const box = $("key-box");
  box.hidden = false;
  box.open = true;
  notice(message);
  $("api-key").focus();
}

// ------------------------------------------------------------------ settings

function readSettings() {
  const s = {system: $("system").value, ignore_eos: $("ignore_eos").checked,
             model: $("model").value};
  for (const name of NUMBER_FIELDS) s[name] = $(name).value;
  return s;
}

function applySettings() {
  const s = loadSettings();
  if (typeof s.system === "string") $("system").value = s.system;
  $("ignore_eos").checked = Boolean(s.ignore_eos);
  for (const name of NUMBER_FIELDS) {
    if (s[name] !== undefined && s[name] !== null) $(name).value = s[name];
  }
}

function requestBody(messages) {
  const s = readSettings();
  const body = {model: s.model || undefined, messages, stream: true,
                stream_options: {include_usage: true}};
  const num = (v) => (v === "" || v === null || v === undefined ? null : Number(v));
  if (num(s.temperature) !== null) body.temperature = num(s.temperature);
  if (num(s.top_p) !== null) body.top_p = num(s.top_p);
  if (num(s.top_k) !== null && num(s.top_k) !== -1) body.top_k = num(s.top_k);
  if (num(s.max_tokens) !== null) body.max_tokens = num(s.max_tokens);
  if (num(s.seed) !== null) body.seed = num(s.seed);
  if (s.ignore_eos) body.ignore_eos = true;
  return body;
}

// ------------------------------------------------------------------ rendering

function figures(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.ttft_ms !== undefined && stats.ttft_ms !== null) {
    parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  }
  if (stats.tokens_per_s) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (stats.completion_tokens !== undefined) parts.push(`${stats.completion_tokens} tokens`);
  if (stats.cached_tokens !== undefined) parts.push(`${stats.cached_tokens} cached`);
  if (stats.finish_reason) parts.push(stats.finish_reason);
  return parts.join(" · ");
}

function messageNode(msg) {
  const li = document.createElement("li");
  li.className = "msg role-" + msg.role;
  li.dataset.role = msg.role;
  li.dataset.state = msg.state || "done";
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = msg.role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "figures";
  li.append(who, content, meta);
  updateMessage(li, msg);
  return li;
}

function updateMessage(li, msg) {
  const content = li.querySelector(".content");
  if (msg.role === "assistant") renderInto(content, msg.content);
  else content.textContent = msg.content;
  li.querySelector(".figures").textContent = figures(msg.stats);
  li.dataset.state = msg.state || "done";
}

function renderMessages() {
  const list = $("messages");
  list.replaceChildren(...store.current().messages.map(messageNode));
  list.lastElementChild?.scrollIntoView({block: "end"});
  updateButtons();
}

function renderConversations() {
  const list = $("conversations");
  const items = store.items.map((conv) => {
    const li = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-open";
    open.textContent = conv.title;
    if (conv.id === store.currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => {
      store.open(conv.id);
      renderAll();
    });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "conv-delete";
    del.textContent = "×";
    del.setAttribute("aria-label", `Delete conversation: ${conv.title}`);
    del.addEventListener("click", () => {
      store.remove(conv.id);
      renderAll();
    });
    li.append(open, del);
    return li;
  });
  list.replaceChildren(...items);
}

function renderAll() {
  renderConversations();
  renderMessages();
}

function updateButtons() {
  const busy = controller !== null;
  const msgs = store.current().messages;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !msgs.some((m) => m.role === "user");
  $("new-chat").disabled = busy;
  $("messages").setAttribute("aria-busy", String(busy));   // read out once the answer is done
}

// ------------------------------------------------------------------ generation

async function generate() {
  const conv = store.current();
  const s = readSettings();
  const history = conv.messages.map(({role, content}) => ({role, content}));
  if (s.system.trim()) history.unshift({role: "system", content: s.system});
  const msg = {role: "assistant", content: "", state: "streaming", stats: null};
  conv.messages.push(msg);
  const li = messageNode(msg);
  $("messages").appendChild(li);
  controller = new AbortController();
  updateButtons();
  notice("");
  const started = performance.now();
  let firstAt = null;
  let usage = null;
  let finish = null;
  let pending = false;
  const paint = () => {
    pending = false;
    updateMessage(li, msg);
    li.scrollIntoView({block: "end"});
  };
  try {
    for await (const event of streamEvents("/v1/chat/completions", requestBody(history),
                                           controller.signal)) {
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      const text = choice.delta && choice.delta.content;
      if (text) {
        if (firstAt === null) firstAt = performance.now();
        msg.content += text;
        if (!pending) {
          pending = true;
          requestAnimationFrame(paint);
        }
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    msg.state = "done";
  } catch (err) {
    if (err.name === "AbortError") {
      msg.state = "stopped";
      finish = "stopped";
    } else {
      msg.state = "error";
      if (err instanceof ApiError && err.status === 401) {
        askForKey("This server needs an API key: " + err.message);
      } else {
        notice("The request failed: " + err.message);
      }
      if (!msg.content) conv.messages.pop();
    }
  } finally {
    const ended = performance.now();
    const stats = {finish_reason: finish};
    if (firstAt !== null) stats.ttft_ms = firstAt - started;
    if (usage) {
      stats.completion_tokens = usage.completion_tokens;
      stats.prompt_tokens = usage.prompt_tokens;
      const details = usage.prompt_tokens_details || {};
      stats.cached_tokens = details.cached_tokens || 0;
      if (firstAt !== null && usage.completion_tokens > 1 && ended > firstAt) {
        stats.tokens_per_s = (usage.completion_tokens - 1) / ((ended - firstAt) / 1000);
      }
    }
    msg.stats = stats;
    controller = null;
    store.save();
    if (conv.messages.includes(msg)) updateMessage(li, msg);
    else li.remove();
    renderConversations();
    updateButtons();
  }
}

function send() {
  const prompt = $("prompt");
  const text = prompt.value;
  if (!text.trim() || controller) return;
  store.current().messages.push({role: "user", content: text});
  prompt.value = "";
  store.save();
  renderAll();
  generate();
}

function regenerate() {
  const msgs = store.current().messages;
  if (controller || !msgs.some((m) => m.role === "user")) return;
  while (msgs.length && msgs[msgs.length - 1].role === "assistant") msgs.pop();
  store.save();
  renderMessages();
  generate();
}

// ------------------------------------------------------------------ models and keys

async function loadModels() {
  try {
    const models = await getJSON("/v1/models");
    const select = $("model");
    const previous = loadSettings().model;
    select.replaceChildren(...models.data.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.id;
      return option;
    }));
    if (models.data.some((m) => m.id === previous)) select.value = previous;
    document.body.dataset.ready = "true";
    if (getKey()) $("key-box").hidden = false;
    notice("");
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) {
      document.body.dataset.ready = "needs-key";
      askForKey("This server needs an API key (" + err.message + ")");
    } else {
      notice("Could not list the models: " + err.message);
    }
  }
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    } else if (e.key === "Escape" && controller) {
      controller.abort();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => {
    store.create();
    renderAll();
    $("prompt").focus();
  });
  $("settings").addEventListener("change", () => saveSettings(readSettings()));
  $("model").addEventListener("change", () => saveSettings(readSettings()));
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setKey($("api-key").value.trim());
    $("api-key").value = "";
    loadModels();
  });
  $("forget-key").addEventListener("click", () => {
    setKey("");
    loadModels();
  });
}

applySettings();
if (window.matchMedia("(max-width: 720px)").matches) $("settings").open = false;  // phones: chat first
wire();
renderAll();
loadModels();
