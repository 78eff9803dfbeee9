"""How often sampled structured outputs are valid, against any OpenAI-compatible server.

    python scripts/structured_validity.py --base-url http://127.0.0.1:8000 [--model M]
        [--num 20] [--temperature 1.0] [--max-tokens 200] [--first-seed 0]

Sends ``--num`` seeded chat requests (one seed each, the same seeds for every server) with
``response_format`` a JSON schema of a nested object, an enum, a bounded integer and a
list of 1-4 items, and counts the answers that parse as JSON and validate against the
schema (jsonschema). An answer cut at ``--max-tokens`` is invalid: that is the failure
under sampling (a string or a run of whitespace that never closes). Prints the count,
the finish reasons, and the share of answers that hold whitespace between JSON tokens.
"""
from __future__ import annotations

import argparse
import collections
import json
from typing import Any, Optional

import httpx
import jsonschema

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "teacher", "artist", "doctor"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"], "additionalProperties": False},
        "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                    "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "hobbies"],
    "additionalProperties": False,
}
PROMPT = ("Invent a person and describe them as JSON with their name, age, role, address "
          "(city and country) and a few hobbies.")


def run(base_url: str, model: Optional[str], num: int, temperature: float, max_tokens: int,
        first_seed: int) -> dict[str, Any]:
    """Send the requests one after another; the counts and every answer."""
    with httpx.Client(base_url=base_url, timeout=600.0, trust_env=False) as client:
        model = model or client.get("/v1/models").json()["data"][0]["id"]
        valid, finishes, spaced, answers = 0, collections.Counter(), 0, []
        for i in range(num):
            r = client.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": max_tokens, "temperature": temperature, "seed": first_seed + i,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "person", "schema": SCHEMA, "strict": True}}})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] or ""
            finishes[choice["finish_reason"]] += 1
            ok = True
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
            except (json.JSONDecodeError, jsonschema.ValidationError):
                ok = False
            valid += ok
            spaced += any(c in text for c in "\n\t") or ", " in text or ": " in text
            answers.append({"seed": first_seed + i, "valid": ok, "text": text})
    return {"model": model, "num": num, "valid": valid, "finish_reasons": dict(finishes),
            "with_whitespace": spaced, "answers": answers}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--num", type=int, default=20)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write every answer here")
    args = p.parse_args(argv)
    out = run(args.base_url, args.model, args.num, args.temperature, args.max_tokens,
              args.first_seed)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    print(f"{args.base_url}: {out['valid']}/{out['num']} valid; finish reasons "
          f"{out['finish_reasons']}; {out['with_whitespace']} with whitespace")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
