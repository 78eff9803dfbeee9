"""Seeded, reproducible request workloads for the serving benchmark.

Every generator returns a list of :class:`RequestSpec` (prompt text, chat messages, the
prompt's token count by the client's tokenizer and the output length to ask for). Same
arguments and seed give the same list.

Workloads:

* ``random``: input and output lengths drawn uniformly from
  [round(L * (1 - r)), round(L * (1 + r))] (at least 1) for range ratio r in [0, 1);
  prompts are random token ids from a safe pool, decoded to text.
* ``shared-prefix``: G groups, each with its own system prefix of P tokens; every request
  is its group's prefix + a distinct random suffix of ``input_len`` tokens.
* ``chat``: multi-turn conversations. Turn k's prompt is turn k-1's prompt + a synthetic
  assistant reply (``output_len`` tokens, generated here, not the server's) + a new user
  message of ``input_len`` tokens, so later turns extend earlier ones exactly. The load
  generator sends turn k only after turn k-1 finished.
* ``extractive``: long passages with an instruction to repeat, correct or reformat them
  (bench/extractive.py); the output length is the passage's, so ``output_len`` is unused.
* ``agent-edit``: a Python file to return with one function renamed, or a JSON tool result
  to echo with one field changed, alternating (bench/agent_edit.py); the output length is
  the file's or the JSON's, so ``output_len`` is unused.
* ``json-schema``: ``random`` prompts whose requests carry a JSON schema
  (``structured_outputs.json``, accepted on both endpoints) (an object holding an unbounded array of records), so every token is sampled
  under a grammar mask; the schema never forces the output to end, so ``ignore_eos``
  runs keep their exact output length. Compare with ``random`` at the same seed and
  lengths for the cost of the masks.
* ``json-validity``: chat requests with a ``response_format`` JSON schema, sampled
  (temperature 1, one seed each), ``num_prompts`` per schema; the answers end themselves
  and are scored for validity (bench/json_validity.py). Unlike ``json-schema`` it measures
  how often an answer is valid, not what the masks cost.
* ``multi-turn``: conversations whose later turns carry the server's real answers (use
  with ``--endpoint chat``): turn 0 is a system message + a user message of
  ``input_len`` tokens; each later turn sends the previous turn's messages, the answer
  the server streamed back, and a new user message (the load generator builds it), so
  the prefix cache can serve turn k its whole history. ``turn_reuse`` in the results
  reports turn k's cached tokens against turn k-1's prompt + answer.
* ``jsonl``: one JSON object per line with ``prompt`` (string) or ``messages`` (chat list),
  and optionally ``max_tokens``/``output_len``; lines are cycled to ``num_prompts``.

Random text: token ids are drawn from a pool of ids that decode on their own to printable
text and re-encode to themselves; the decoded text is re-encoded and adjusted (truncated or
extended) until its length is the target, so ``input_len`` is exact for random prompts
(up to a few attempts; the measured length is what gets recorded).
"""
from __future__ import annotations

import json
import logging
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

logger = logging.getLogger(__name__)

WORKLOADS = ("random", "shared-prefix", "chat", "multi-turn", "json-schema", "json-validity",
             "jsonl", "extractive", "agent-edit")

#: Request settings a workload needs, used where the user did not set them (the CLI's
#: --endpoint, --temperature, --no-ignore-eos); the rest get "completions", 0.0 and True.
WORKLOAD_DEFAULTS: dict[str, dict] = {
    "json-validity": {"endpoint": "chat", "temperature": 1.0, "ignore_eos": False},
}

#: The schema of the json-schema workload: records without a bound, so never forced to end.
BENCH_JSON_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                       "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "score", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}


class TextTokenizer(Protocol):
    """What the workloads need from a tokenizer (llmserve.tokenizer.tokenizer.Tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class RequestSpec:
    """One request to send. ``prompt`` is used on /v1/completions, ``messages`` on chat."""

    request_id: str
    prompt: str
    messages: list[dict]
    input_len: int
    output_len: int
    conversation_id: Optional[int] = None
    turn: Optional[int] = None
    extra: dict = field(default_factory=dict)   # more request-body fields (response_format ...)
    meta: dict = field(default_factory=dict)    # workload facts for the load generator, never sent


class WhitespaceTokenizer:
    """Fallback when no real tokenizer is available: one token per whitespace-separated word.

    Lengths are then approximate for the server's tokenizer; a warning says so.
    """

    vocab_size = 4096

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for word in text.split():
            if word[:1] == "w" and word[1:].isdigit() and int(word[1:]) < self.vocab_size:
                ids.append(int(word[1:]))
            else:
                ids.append(zlib.crc32(word.encode("utf-8")) % self.vocab_size)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


class TokenizersFileTokenizer:
    """Adapter over a HuggingFace ``tokenizers`` tokenizer.json file."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self._tok = _HFTokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: Optional[str] = None) -> TextTokenizer:
    """The tokenizer at ``path`` (None or ``"default"``: the default model's), with fallbacks.

    Order: llmserve.tokenizer.tokenizer (HF folder or GGUF), then a tokenizer.json via ``tokenizers``,
    then :class:`WhitespaceTokenizer` (with a warning).
    """
    p = Path(path) if path and path != "default" else None
    if p is not None and p.is_file() and p.suffix == ".json":
        return TokenizersFileTokenizer(str(p))
    try:
        from llmserve.tokenizer.tokenizer import Tokenizer  # type: ignore[import-not-found]

        if p is None:
            from llmserve.default_model import default_model_path  # type: ignore[import-not-found]

            p = Path(default_model_path())
        return Tokenizer.from_path(str(p))
    except ImportError as exc:
        logger.debug("llmserve.tokenizer.tokenizer unavailable: %s", exc)
    if p is not None and p.is_dir() and (p / "tokenizer.json").is_file():
        return TokenizersFileTokenizer(str(p / "tokenizer.json"))
    logger.warning("no tokenizer available; counting whitespace words as tokens (approximate)")
    return WhitespaceTokenizer()


def _vocab_size(tok: TextTokenizer) -> int:
    for name in ("vocab_size", "get_vocab_size"):
        v = getattr(tok, name, None)
        if callable(v):
            v = v()
        if isinstance(v, int) and v > 0:
            return v
    try:
        return len(tok)  # type: ignore[arg-type]
    except TypeError:
        return 32000


class PromptBuilder:
    """Builds text of an exact token length from a seeded pool of safe token ids."""

    def __init__(self, tokenizer: TextTokenizer, seed: int = 0, pool_size: int = 2048,
                 max_tries: int = 8) -> None:
        self.tokenizer = tokenizer
        self.max_tries = max_tries
        self.pool = self._safe_pool(random.Random(seed ^ 0x5EED), pool_size)
        if not self.pool:
            raise ValueError("found no token id that decodes and re-encodes to itself")

    def _safe_pool(self, rng: random.Random, pool_size: int) -> list[int]:
        vocab = _vocab_size(self.tokenizer)
        lo, hi = min(vocab // 20, 1000), max(vocab - vocab // 20, 1)
        candidates = list(range(lo, hi))
        rng.shuffle(candidates)
        pool: list[int] = []
        for i in candidates[: pool_size * 4]:
            text = self.tokenizer.decode([i])
            if not text.strip() or not text.isprintable() or "\ufffd" in text:
                continue
            if self.tokenizer.encode(text, add_special_tokens=False) == [i]:
                pool.append(i)
                if len(pool) >= pool_size:
                    break
        return sorted(pool)

    def text(self, rng: random.Random, length: int) -> tuple[str, int]:
        """Random text of ``length`` tokens; returns (text, measured length)."""
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        ids = [rng.choice(self.pool) for _ in range(length)]
        best: tuple[str, int] = ("", 0)
        for _ in range(self.max_tries):
            text = self.tokenizer.decode(ids)
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            if not best[0] or abs(len(enc) - length) < abs(best[1] - length):
                best = (text, len(enc))
            if len(enc) == length:
                return text, length
            if len(enc) > length:
                ids = enc[:length]
            else:
                ids = enc + [rng.choice(self.pool) for _ in range(length - len(enc))]
        logger.debug("prompt length %d instead of %d after %d tries", best[1], length,
                     self.max_tries)
        return best

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _draw_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, round(mean * (1 - range_ratio)))
    hi = max(lo, round(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def _check_counts(**kwargs: int) -> None:
    for name, v in kwargs.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def random_workload(tokenizer: TextTokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[RequestSpec]:
    """Random prompts with uniformly drawn input/output lengths (see module docstring)."""
    _check_counts(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    rng = random.Random(seed)
    builder = PromptBuilder(tokenizer, seed)
    specs = []
    for i in range(num_prompts):
        n_in = _draw_len(rng, input_len, range_ratio)
        n_out = _draw_len(rng, output_len, range_ratio)
        text, measured = builder.text(rng, n_in)
        specs.append(RequestSpec(f"random-{i}", text, [{"role": "user", "content": text}],
                                 measured, n_out))
    return specs


def shared_prefix_workload(tokenizer: TextTokenizer, num_prompts: int, num_groups: int,
                           prefix_len: int, suffix_len: int, output_len: int,
                           seed: int = 0) -> list[RequestSpec]:
    """G system prefixes of P tokens, each request = its group's prefix + a distinct suffix.

    Requests go round-robin over groups, then the order is shuffled with the seed.
    """
    _check_counts(num_prompts=num_prompts, num_groups=num_groups, prefix_len=prefix_len,
                  suffix_len=suffix_len, output_len=output_len)
    rng = random.Random(seed)
    builder = PromptBuilder(tokenizer, seed)
    prefixes = [builder.text(rng, prefix_len)[0] for _ in range(num_groups)]
    specs = []
    for i in range(num_prompts):
        g = i % num_groups
        suffix, _ = builder.text(rng, suffix_len)
        prompt = prefixes[g] + "\n" + suffix
        messages = [{"role": "system", "content": prefixes[g]},
                    {"role": "user", "content": suffix}]
        specs.append(RequestSpec(f"prefix-g{g}-{i}", prompt, messages, builder.count(prompt),
                                 output_len, extra={"group": g}))
    rng.shuffle(specs)
    return specs


def render_chat_as_text(messages: list[dict]) -> str:
    """Plain-text rendering of a conversation for /v1/completions."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"


def chat_workload(tokenizer: TextTokenizer, num_prompts: int, num_turns: int, input_len: int,
                  output_len: int, seed: int = 0) -> list[RequestSpec]:
    """ceil(N / turns) conversations of ``num_turns`` turns, truncated to N requests.

    Ordered turn-major (every conversation's turn 0, then turn 1, ...).
    """
    _check_counts(num_prompts=num_prompts, num_turns=num_turns, input_len=input_len,
                  output_len=output_len)
    rng = random.Random(seed)
    builder = PromptBuilder(tokenizer, seed)
    num_convs = -(-num_prompts // num_turns)
    per_conv: list[list[RequestSpec]] = []
    for c in range(num_convs):
        history: list[dict] = []
        turns = []
        for t in range(num_turns):
            user, _ = builder.text(rng, input_len)
            messages = history + [{"role": "user", "content": user}]
            prompt = render_chat_as_text(messages)
            turns.append(RequestSpec(f"chat-c{c}-t{t}", prompt, messages, builder.count(prompt),
                                     output_len, conversation_id=c, turn=t))
            reply, _ = builder.text(rng, output_len)
            history = messages + [{"role": "assistant", "content": reply}]
        per_conv.append(turns)
    ordered = [per_conv[c][t] for t in range(num_turns) for c in range(num_convs)]
    return ordered[:num_prompts]


def multi_turn_workload(tokenizer: TextTokenizer, num_prompts: int, num_turns: int,
                        input_len: int, output_len: int, seed: int = 0) -> list[RequestSpec]:
    """ceil(N / turns) conversations of ``num_turns`` turns (see the module docstring);
    a later turn's ``messages`` hold only its new user message (``meta["follow_up"]``)."""
    _check_counts(num_prompts=num_prompts, num_turns=num_turns, input_len=input_len,
                  output_len=output_len)
    rng = random.Random(seed)
    builder = PromptBuilder(tokenizer, seed)
    num_convs = -(-num_prompts // num_turns)
    per_conv = []
    for c in range(num_convs):
        turns = []
        for t in range(num_turns):
            user, n = builder.text(rng, input_len)
            messages = [{"role": "user", "content": user}]
            if t == 0:
                messages.insert(0, {"role": "system", "content": f"Conversation {c}."})
            turns.append(RequestSpec(f"multi-c{c}-t{t}", render_chat_as_text(messages), messages,
                                     n, output_len, conversation_id=c, turn=t,
                                     meta={"follow_up": t > 0}))
        per_conv.append(turns)
    ordered = [per_conv[c][t] for t in range(num_turns) for c in range(num_convs)]
    return ordered[:num_prompts]


def jsonl_workload(path: str, tokenizer: TextTokenizer, num_prompts: Optional[int],
                   output_len: int, seed: int = 0, shuffle: bool = False) -> list[RequestSpec]:
    """Prompts from a JSONL file (see module docstring); ``num_prompts`` None: every line."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
            if isinstance(obj, str):
                obj = {"prompt": obj}
            if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
                raise ValueError(f"{path}:{lineno}: need an object with 'prompt' or 'messages'")
            rows.append(obj)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    if shuffle:
        random.Random(seed).shuffle(rows)
    n = len(rows) if num_prompts is None else num_prompts
    specs = []
    for i in range(n):
        row = rows[i % len(rows)]
        if "messages" in row:
            messages = list(row["messages"])
            prompt = render_chat_as_text(messages)
        else:
            prompt = str(row["prompt"])
            messages = [{"role": "user", "content": prompt}]
        out_len = int(row.get("max_tokens", row.get("output_len", output_len)))
        specs.append(RequestSpec(f"jsonl-{i}", prompt, messages,
                                 len(tokenizer.encode(prompt, add_special_tokens=False)), out_len))
    return specs


def build_workload(name: str, tokenizer: TextTokenizer, *, num_prompts: int, input_len: int,
                   output_len: int, range_ratio: float = 0.0, num_groups: int = 4,
                   prefix_len: int = 256, num_turns: int = 3, dataset: Optional[str] = None,
                   seed: int = 0) -> list[RequestSpec]:
    """Dispatch on the workload name (one of :data:`WORKLOADS`)."""
    if name == "random":
        return random_workload(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    if name == "shared-prefix":
        return shared_prefix_workload(tokenizer, num_prompts, num_groups, prefix_len, input_len,
                                      output_len, seed)
    if name == "chat":
        return chat_workload(tokenizer, num_prompts, num_turns, input_len, output_len, seed)
    if name == "extractive":
        from llmserve.bench.extractive import extractive_workload

        return extractive_workload(tokenizer, num_prompts, input_len, seed)
    if name == "agent-edit":
        from llmserve.bench.agent_edit import agent_edit_workload

        return agent_edit_workload(tokenizer, num_prompts, input_len, seed)
    if name == "json-schema":
        specs = random_workload(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
        for s in specs:
            s.request_id = s.request_id.replace("random", "json-schema", 1)
            s.extra["structured_outputs"] = {"json": BENCH_JSON_SCHEMA}   # chat and completions
        return specs
    if name == "json-validity":
        from llmserve.bench.json_validity import json_validity_workload

        return json_validity_workload(tokenizer, num_prompts, output_len, seed)
    if name == "multi-turn":
        return multi_turn_workload(tokenizer, num_prompts, num_turns, input_len, output_len, seed)
    if name == "jsonl":
        if not dataset:
            raise ValueError("the jsonl workload needs --dataset PATH")
        return jsonl_workload(dataset, tokenizer, num_prompts, output_len, seed)
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
