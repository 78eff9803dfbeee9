// HTTP helpers shared by the playground and the dashboard: API keys kept in the
// browser only, JSON calls, and an SSE reader over fetch() + ReadableStream.

const KEY_STORE = "llmserve.apiKey";
const ADMIN_KEY_STORE = "llmserve.adminKey";

/** An error answer of the server (OpenAI error shape) or a network failure. */
export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code || null;
  }
}

function store(kind) {
  return kind === "admin" ? ADMIN_KEY_STORE : KEY_STORE;
}

/** The API key saved in this tab (`kind` "tenant" or "admin"), or "". */
export function getKey(kind = "tenant") {
  try {
    return sessionStorage.getItem(store(kind)) || "";
  } catch {
    return "";
  }
}

/** Save (or with "" forget) the API key of this tab; never sent anywhere but as a header. */
export function setKey(value, kind = "tenant") {
  try {
    if (value) sessionStorage.setItem(store(kind), value);
    else sessionStorage.removeItem(store(kind));
  } catch {
    /* storage disabled: the key lives for this page only */
  }
}

/** Headers of a JSON call, with `Authorization: Bearer <key>` when a key is set. */
export function headers(kind = "tenant") {
  const h = {"Content-Type": "application/json", "Accept": "application/json"};
  const key = kind === "none" ? "" : getKey(kind);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    /* not JSON: keep the status line */
  }
  return new ApiError(response.status, message, code);
}

/** GET `path` as JSON; throws ApiError on an error status. */
export async function getJSON(path, {kind = "tenant", signal} = {}) {
  let response;
  try {
    response = await fetch(path, {headers: headers(kind), signal, cache: "no-store"});
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "The server cannot be reached: " + err.message);
  }
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

/**
 * POST `body` to `path` with `stream: true` and yield each SSE event's JSON payload
 * until `[DONE]`. Aborting `signal` closes the connection (the server then cancels
 * the request and frees its KV blocks).
 */
export async function* streamEvents(path, body, signal) {
  let response;
  try {
    response = await fetch(path, {method: "POST", headers: headers(), body: JSON.stringify(body),
                                  signal});
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "The server cannot be reached: " + err.message);
  }
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new ApiError(event.error.status || 500, event.error.message,
                                            event.error.code);
        yield event;
      }
    }
  } finally {
    reader.releaseLock();
  }
}
