"""The ``agent-edit`` benchmark workload: the edits an agent loop asks for, where the
answer re-emits most of the prompt with a few changes.

Requests alternate between two kinds:

* **code edit**: a seeded Python file (small functions over common names) and an
  instruction to rename one identifier and return the whole updated file;
* **JSON tool result**: a tool's JSON answer (a list of order records) and an instruction
  to echo it back with one field of one record changed.

This is where suffix decoding and prompt lookup pay most (docs/SPECULATIVE.md): a model
that follows the instruction copies long stretches of the file or the JSON. Both kinds
are one user message, so any chat template takes them. The output length asked for is
the file's (or the JSON's) token count plus a margin; ``output_len`` is unused.
"""
from __future__ import annotations

import json
import random
from typing import Any

_VERBS = ("load", "parse", "build", "check", "merge", "count", "split", "format", "update",
          "find", "send", "read", "write", "close", "open", "sort")
_NOUNS = ("order", "user", "item", "record", "price", "total", "line", "name", "batch",
          "report", "path", "token", "request", "value", "table", "event")
_STATUSES = ("pending", "paid", "shipped", "cancelled")
_CITIES = ("Lisbon", "Oslo", "Quito", "Kyoto", "Austin", "Leeds", "Perth", "Turin")


def _function(rng: random.Random) -> str:
    verb, noun = rng.choice(_VERBS), rng.choice(_NOUNS)
    a, b = rng.sample(_NOUNS, 2)
    var = f"{rng.choice(_NOUNS)}_{rng.choice(('count', 'sum', 'size', 'id'))}"
    lim, mul = rng.randint(2, 99), rng.randint(2, 9)
    return (f"def {verb}_{noun}({a}, {b}):\n"
            f'    """{verb.capitalize()} the {noun} from {a} and {b}."""\n'
            f"    {var} = len({a}) + len({b})\n"
            f"    if {var} > {lim}:\n"
            f"        return {var} * {mul}\n"
            f"    return {var}\n")


def _code_edit(rng: random.Random, tokenizer: Any, input_len: int) -> tuple[str, str]:
    functions: list[str] = []
    while len(tokenizer.encode("\n\n".join(functions), add_special_tokens=False)) < input_len:
        functions.append(_function(rng))
    source = "\n\n".join(functions)
    old = source.split("(", 1)[0].removeprefix("def ")
    new = f"{old}_v2"
    instruction = (f"Rename the function `{old}` to `{new}` in this file and return the "
                   f"whole updated file, unchanged otherwise.")
    return f"{instruction}\n\n```python\n{source}```", source


def _json_result(rng: random.Random, tokenizer: Any, input_len: int) -> tuple[str, str]:
    orders: list[dict] = []
    while len(tokenizer.encode(json.dumps(orders, indent=1), add_special_tokens=False)) < input_len:
        orders.append({"id": 1000 + len(orders), "customer": rng.choice(_NOUNS) + str(rng.randint(1, 99)),
                       "city": rng.choice(_CITIES), "status": rng.choice(_STATUSES),
                       "total": round(rng.uniform(5, 500), 2), "items": rng.randint(1, 9)})
    body = json.dumps({"orders": orders}, indent=1)
    target = rng.choice(orders)["id"]
    instruction = (f"The tool `list_orders` returned the JSON below. Return the same JSON, "
                   f"unchanged except that order {target} has status \"shipped\".")
    return f"{instruction}\n\n```json\n{body}\n```", body


def agent_edit_workload(tokenizer: Any, num_prompts: int, input_len: int, seed: int = 0
                        ) -> list:
    """``num_prompts`` edit requests of about ``input_len`` tokens, alternating code edits
    and JSON tool results; output length = the edited text's tokens + 24."""
    from llmserve.bench.workloads import RequestSpec, _check_counts

    _check_counts(num_prompts=num_prompts, input_len=input_len)
    rng = random.Random(seed)
    specs = []
    for i in range(num_prompts):
        kind = "code" if i % 2 == 0 else "json"
        make = _code_edit if kind == "code" else _json_result
        content, edited = make(rng, tokenizer, max(16, int(input_len * 0.9)))
        specs.append(RequestSpec(
            f"agent-edit-{i}", content, [{"role": "user", "content": content}],
            len(tokenizer.encode(content, add_special_tokens=False)),
            len(tokenizer.encode(edited, add_special_tokens=False)) + 24,
            meta={"task": kind}))
    return specs
