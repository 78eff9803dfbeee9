// Conversations and settings kept in the browser's localStorage (never on the server).

const CONVERSATIONS = "llmserve.conversations";
const CURRENT = "llmserve.current";
const SETTINGS = "llmserve.settings";
const MAX_CONVERSATIONS = 50;

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw ? JSON.parse(raw) : fallback;
  } catch {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    /* full or disabled storage: the page keeps working for this visit */
  }
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function valid(conv) {
  return conv && typeof conv.id === "string" && Array.isArray(conv.messages) &&
    conv.messages.every((m) => m && typeof m.content === "string" &&
                          (m.role === "user" || m.role === "assistant"));
}

/** All saved conversations, newest first, and the id of the open one. */
export class ConversationStore {
  constructor() {
    const saved = read(CONVERSATIONS, []);
    this.items = Array.isArray(saved) ? saved.filter(valid) : [];
    this.currentId = read(CURRENT, null);
    if (!this.items.some((c) => c.id === this.currentId)) this.currentId = null;
  }

  /** The open conversation (a new empty one when none is open). */
  current() {
    let conv = this.items.find((c) => c.id === this.currentId);
    if (!conv) conv = this.create();
    return conv;
  }

  create() {
    const conv = {id: newId(), title: "New chat", created: Date.now(), messages: []};
    this.items.unshift(conv);
    this.items = this.items.slice(0, MAX_CONVERSATIONS);
    this.currentId = conv.id;
    this.save();
    return conv;
  }

  open(id) {
    if (this.items.some((c) => c.id === id)) {
      this.currentId = id;
      this.save();
    }
  }

  remove(id) {
    this.items = this.items.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = this.items.length ? this.items[0].id : null;
    this.save();
  }

  /** Persist everything (titles follow the first user message). */
  save() {
    for (const conv of this.items) {
      const first = conv.messages.find((m) => m.role === "user");
      if (first) conv.title = first.content.replace(/\s+/g, " ").trim().slice(0, 48) || "Chat";
    }
    write(CONVERSATIONS, this.items.map((c) => ({
      ...c, messages: c.messages.map(({role, content, stats}) => ({role, content, stats}))})));
    write(CURRENT, this.currentId);
  }
}

/** Sampling settings and the system prompt, as last used. */
export function loadSettings() {
  return read(SETTINGS, {});
}

export function saveSettings(settings) {
  write(SETTINGS, settings);
}
