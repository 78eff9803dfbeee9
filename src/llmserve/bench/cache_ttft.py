"""TTFT of one chat request with a long system prompt, four ways, measured side by side.

Starts ``llmserve serve --config`` (the default model) with one tenant that has the
response cache on and registers the system prompt as a prompt bundle, then runs R
rounds; each round sends, in turn (streamed, one at a time, unique user question):

* ``cold``: the system prompt with a fresh nonce in front (nothing cached);
* ``prefix``: the plain system prompt (the prefix cache holds it from earlier rounds);
* ``bundle``: ``"prompt_bundle": "support"`` (the same prompt, pinned KV);
* ``cache_hit``: a repeat of the round's ``prefix`` request (a response-cache hit).

Prints the median TTFT of each and its ratio to ``cold``, as JSON.
Usage: ``llmserve bench caches [--rounds 8] [--system-words 300] [--eager] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import yaml

from llmserve.bench.compare import ServerProcess, ServerSpec
from llmserve.gateway.config.gateway_config import hash_api_key

KEY = "sk-bench-" + uuid.uuid4().hex


def ttft(client: httpx.Client, url: str, body: dict) -> tuple[float, str]:
    """Seconds to the first content token; the stream is read to its end (so the answer
    completes and can be stored)."""
    start = time.perf_counter()
    first = None
    with client.stream("POST", url, json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and '"content":"' in line \
                    and '"content":""' not in line:
                first = time.perf_counter() - start
        if first is None:
            raise RuntimeError("no token")
        return first, resp.headers.get("x-cache", "")


def add_parser(sub: "argparse._SubParsersAction") -> None:
    """Register ``bench caches``."""
    ap = sub.add_parser("caches", help="TTFT cold / prefix cache / prompt bundle / "
                        "response-cache hit, side by side (a gateway server on loopback)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (quicker start)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the comparison (see the module docstring); 0 on success."""
    folder = Path(tempfile.mkdtemp(prefix="cache-ttft-"))
    config = {"database": "gw.db", "response_cache": {"store": "sqlite"},
              "tenants": {"t": {"keys": [hash_api_key(KEY)], "response_cache": True,
                                "bundle_pinned_blocks": 256}}}
    (folder / "gw.yaml").write_text(yaml.safe_dump(config))
    spec = ServerSpec("llmserve-gateway", [
        sys.executable, "-m", "llmserve.cli", "serve", "--config", str(folder / "gw.yaml"),
        "--served-model-name", "default", "--host", "{host}", "--port", "{port}",
        "--num-kv-blocks", "1024", "--max-model-len", "2048", "--num-threads", str(args.threads),
        *(["--enforce-eager"] if args.eager else [])], port=args.port, ready_paths=("/ready",))
    with ServerProcess(spec, folder / "server.log") as server:
        base = server.url
        system = " ".join(f"rule{i % 97} applies" for i in range(args.system_words // 2))
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=base, headers=headers, timeout=300) as client:
            r = client.post("/v1/prompt_bundles", json={
                "name": "support", "messages": [{"role": "system", "content": system}]})
            r.raise_for_status()
            bundle = r.json()
            times: dict[str, list[float]] = {k: [] for k in ("cold", "prefix", "bundle", "cache_hit")}
            chat = "/v1/chat/completions"
            for i in range(args.rounds + 1):  # round 0 warms up (not counted)
                q = [{"role": "user", "content": f"Question {uuid.uuid4().hex}: what applies?"}]
                base_body = {"model": "default", "max_tokens": 4, "temperature": 0}
                runs = {
                    "cold": {**base_body, "messages": [{"role": "system", "content":
                             uuid.uuid4().hex + " " + system}] + q},
                    "prefix": {**base_body, "messages": [{"role": "system", "content": system}] + q},
                    "bundle": {**base_body, "prompt_bundle": "support", "messages": q},
                }
                runs["cache_hit"] = runs["prefix"]
                for name, body in runs.items():
                    t, xcache = ttft(client, chat, body)
                    if name == "cache_hit" and xcache != "hit":
                        raise RuntimeError("expected a response-cache hit")
                    if i:
                        times[name].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        report = json.dumps({
            "rounds": args.rounds, "bundle_prefix_tokens": bundle["prefix_tokens"],
            "pinned_blocks": bundle["pinned_blocks"],
            "median_ttft_ms": {k: round(v * 1000, 1) for k, v in med.items()},
            "ratio_to_cold": {k: round(v / med["cold"], 3) for k, v in med.items()}}, indent=2)
        sys.stdout.write(report + "\n")
        if args.json:
            Path(args.json).write_text(report + "\n", encoding="utf-8")
    return 0

