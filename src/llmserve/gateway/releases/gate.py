"""``llmserve release check CANDIDATE --against STABLE``: the performance and quality
gates of a release, measured on a running server that serves both releases' targets.

* performance: the same random workload (:mod:`llmserve.bench.workloads`) is streamed
  to each release's target with the bench's load generator (:mod:`llmserve.bench.loadgen`,
  ``stream_one``) at ``--concurrency``, and summarized by :mod:`llmserve.bench.metrics`:
  TTFT p95, TPOT p95, output-token throughput and failed requests;
* quality: the quality eval's fixed prompts (:data:`llmserve.eval.presets.PROMPTS`) are
  continued greedily by both, and compared token for token with the eval's
  :func:`llmserve.eval.metrics.greedy_agreement`; with ``min_structured_validity`` in the
  gates, the candidate also answers them in JSON mode (``response_format``
  ``json_object``) and the share of answers that parse as JSON is gated;
* offline quality (optional, ``--eval-model PATH --eval-config PRESET``): the quality
  gate of :mod:`llmserve.eval.gate` -- perplexity, top-1 agreement and KL of the
  candidate's preset (e.g. ``int8``) against ``--eval-reference`` (``fp32``) on the
  model files, with the preset's own thresholds.

The candidate passes when its TTFT p95 and TPOT p95 are at most
``max_ttft_p95_ratio`` / ``max_tpot_p95_ratio`` times the stable release's, its
throughput at least ``min_throughput_ratio`` times, its failed share at most
``max_error_rate`` and its greedy agreement at least ``min_greedy_agreement`` -- the
``gates`` of its model in the gateway config. Prints one line per gate and exits 1
when any fails (2 for bad arguments). The offline quality gate of a quantization
(``llmserve eval``: perplexity, top-1, KL) needs model files, not a server: run it
before a release gets a target. The machine's noise applies: both releases are
measured in the same run, one after the other.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import IO, Any, Optional, Sequence

import httpx

from llmserve.bench.loadgen import ENDPOINT_PATHS, build_payload, stream_one
from llmserve.bench.metrics import RequestRecord, compute_metrics
from llmserve.bench.workloads import RequestSpec, load_tokenizer, random_workload
from llmserve.eval.presets import PROMPTS
from llmserve.gateway.config.gateway_config import GatewayConfig
from llmserve.gateway.releases.config import GateThresholds, ModelReleases, ReleaseSpec


def find_release(config: GatewayConfig, rid: str) -> tuple[ModelReleases, ReleaseSpec]:
    """The public model and configured release of id ``rid``; ValueError if none."""
    for model in config.releases.values():
        if rid in model.versions:
            return model, model.versions[rid]
    known = sorted(r for m in config.releases.values() for r in m.versions)
    raise ValueError(f"no release {rid!r} in the config's releases (known: {known})")


async def measure_performance(client: httpx.AsyncClient, base_url: str, target: str,
                              specs: Sequence[RequestSpec], concurrency: int) -> dict[str, Any]:
    """Stream ``specs`` to ``target``; the bench's metrics of the run."""
    url = base_url.rstrip("/") + ENDPOINT_PATHS["completions"]
    records = [RequestRecord(s.request_id, s.input_len, expected_output_len=s.output_len)
               for s in specs]
    sem = asyncio.Semaphore(concurrency)

    async def one(spec: RequestSpec, record: RequestRecord) -> None:
        async with sem:
            await stream_one(client, url, build_payload(spec, target, "completions"), record)

    start = time.perf_counter()
    await asyncio.gather(*(one(s, r) for s, r in zip(specs, records)))
    return compute_metrics(records, max(time.perf_counter() - start, 1e-9))


async def structured_validity(client: httpx.AsyncClient, base_url: str, target: str,
                              max_tokens: int) -> float:
    """Share of the fixed prompts answered in JSON mode with text that parses as JSON."""
    valid = 0
    for prompt in PROMPTS:
        resp = await client.post(base_url.rstrip("/") + "/v1/chat/completions", json={
            "model": target, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_object"}})
        resp.raise_for_status()
        try:
            json.loads(resp.json()["choices"][0]["message"]["content"] or "")
            valid += 1
        except ValueError:
            pass
    return valid / len(PROMPTS)


def offline_eval_gate(args: argparse.Namespace) -> dict[str, Any]:
    """The eval quality gate of ``--eval-config`` against ``--eval-reference``."""
    from llmserve.eval.gate import run_gate

    results = run_gate(args.eval_model, [args.eval_config], reference=args.eval_reference,
                       max_tokens=args.eval_tokens, window=max(2, args.eval_tokens // 2),
                       continuation_tokens=4)
    res = results[-1]
    return {"gate": f"eval:{args.eval_config}", "value": res.top1,
            "threshold": f"preset vs {args.eval_reference}",
            "passed": res.passed is not False, "ppl_increase": res.ppl_increase,
            "kl": res.kl, "failures": list(res.failures)}


async def greedy_tokens(client: httpx.AsyncClient, base_url: str, target: str,
                        max_tokens: int) -> list[list[str]]:
    """The greedy continuation (tokens) of each fixed eval prompt."""
    out = []
    for prompt in PROMPTS:
        resp = await client.post(base_url.rstrip("/") + "/v1/completions", json={
            "model": target, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 0})
        resp.raise_for_status()
        out.append(list(resp.json()["choices"][0]["logprobs"]["tokens"]))
    return out


def evaluate_gates(stable: dict[str, Any], candidate: dict[str, Any], agreement: float,
                   gates: GateThresholds) -> list[dict[str, Any]]:
    """One row per gate: name, measured value, threshold, passed."""
    def p95(m: dict[str, Any], key: str) -> Optional[float]:
        return (m.get(key) or {}).get("p95")

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or not b else a / b

    failed_share = candidate["failed"] / max(1, candidate["num_requests"])
    rows = [
        ("ttft_p95_ratio", ratio(p95(candidate, "ttft_ms"), p95(stable, "ttft_ms")),
         gates.max_ttft_p95_ratio, "<="),
        ("tpot_p95_ratio", ratio(p95(candidate, "tpot_ms"), p95(stable, "tpot_ms")),
         gates.max_tpot_p95_ratio, "<="),
        ("throughput_ratio", ratio(candidate["output_token_throughput"],
                                   stable["output_token_throughput"]),
         gates.min_throughput_ratio, ">="),
        ("error_rate", failed_share, gates.max_error_rate, "<="),
        ("greedy_agreement", agreement, gates.min_greedy_agreement, ">="),
    ]
    out = []
    for name, value, limit, op in rows:
        ok = value is not None and (value <= limit if op == "<=" else value >= limit)
        out.append({"gate": name, "value": value, "threshold": f"{op} {limit:g}", "passed": ok})
    return out


async def run_check(config: GatewayConfig, candidate_id: str, stable_id: str, base_url: str,
                    api_key: str, specs: Sequence[RequestSpec], concurrency: int,
                    output_len: int) -> dict[str, Any]:
    """Measure both releases and evaluate the candidate's model's gates."""
    from llmserve.eval.metrics import greedy_agreement

    model, candidate = find_release(config, candidate_id)
    _stable_model, stable = find_release(config, stable_id)
    headers = {"Authorization": f"Bearer {api_key}"}
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, trust_env=False) as client:
        perf_stable = await measure_performance(client, base_url, stable.target, specs,
                                                concurrency)
        perf_candidate = await measure_performance(client, base_url, candidate.target, specs,
                                                   concurrency)
        ref = await greedy_tokens(client, base_url, stable.target, output_len)
        got = await greedy_tokens(client, base_url, candidate.target, output_len)
        validity = None
        if model.gates.min_structured_validity is not None:
            validity = await structured_validity(client, base_url, candidate.target,
                                                 max(output_len, 64))
    agreement = greedy_agreement(ref, got)
    gates = evaluate_gates(perf_stable, perf_candidate, agreement, model.gates)
    limit = model.gates.min_structured_validity
    if validity is not None and limit is not None:
        gates.append({"gate": "structured_validity", "value": validity,
                      "threshold": f">= {limit:g}", "passed": validity >= limit})
    keep = ("num_requests", "failed", "output_token_throughput", "ttft_ms", "tpot_ms")
    return {"candidate": candidate_id, "stable": stable_id, "model": model.name,
            "passed": all(g["passed"] for g in gates), "gates": gates,
            "performance": {"stable": {k: perf_stable[k] for k in keep},
                            "candidate": {k: perf_candidate[k] for k in keep}},
            "greedy_agreement": agreement}


def format_report(report: dict[str, Any]) -> str:
    """The human-readable report: one line per gate and the verdict."""
    lines = [f"release check {report['candidate']} against {report['stable']} "
             f"(model {report['model']})"]
    for g in report["gates"]:
        value = "n/a" if g["value"] is None else f"{g['value']:.3f}"
        lines.append(f"  {'PASS' if g['passed'] else 'FAIL'}  {g['gate']:<18} {value:>9}  "
                     f"(needs {g['threshold']})")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines) + "\n"


def run_check_command(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    """The CLI entry: 0 pass, 1 fail (or the server failed), 2 bad arguments."""
    out = out if out is not None else sys.stdout   # read at call time (tests capture it)
    key = args.api_key or os.environ.get("LLMSERVE_API_KEY") or ""
    try:
        config = GatewayConfig.load(args.config)
        find_release(config, args.candidate)
        find_release(config, args.against)
        if args.candidate == args.against:
            raise ValueError("the candidate and the stable release are the same")
        if args.eval_config:
            from llmserve.eval.presets import PRESETS

            for preset in (args.eval_config, args.eval_reference):
                if preset not in PRESETS:
                    raise ValueError(f"unknown eval preset {preset!r} (presets: "
                                     f"{sorted(PRESETS)})")
        for name in ("num_prompts", "input_len", "output_len", "concurrency", "eval_tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    except (OSError, ValueError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    specs = random_workload(load_tokenizer(args.tokenizer), args.num_prompts, args.input_len,
                            args.output_len)
    try:
        report = asyncio.run(run_check(config, args.candidate, args.against, args.url, key,
                                       specs, args.concurrency, args.output_len))
    except (httpx.HTTPError, KeyError, ValueError) as e:
        sys.stderr.write(f"error: the check could not run against {args.url}: {e}\n")
        return 1
    if args.eval_config:
        report["gates"].append(offline_eval_gate(args))
        report["passed"] = all(g["passed"] for g in report["gates"])
    out.write(json.dumps(report, indent=2) + "\n" if args.json else format_report(report))
    return 0 if report["passed"] else 1
