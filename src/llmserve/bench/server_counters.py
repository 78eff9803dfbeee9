"""llmserve's own counters around a benchmark run, read from the server's ``/metrics``.

A run against llmserve reports what the server did, not only what the client saw: the
speculative-decoding proposals and acceptances, the grammar-mask time and the prefix-cache
hits during the run (the difference of two scrapes, summed over label sets). Servers without
these series (peers) simply report nothing. No torch.
"""
from __future__ import annotations

import logging
from typing import Optional

import httpx

logger = logging.getLogger(__name__)

#: Prometheus sample name -> key in a run's ``server_counters``.
COUNTERS = {
    "llmserve_spec_proposed_tokens_total": "spec_proposed_tokens",
    "llmserve_spec_accepted_tokens_total": "spec_accepted_tokens",
    "llmserve_grammar_mask_seconds_total": "grammar_mask_seconds",
    "llmserve_grammar_mask_steps_total": "grammar_mask_steps",
    "llmserve_prefix_cache_queries_total": "prefix_cache_queries",
    "llmserve_prefix_cache_hits_total": "prefix_cache_hits",
}


def parse_counters(text: str) -> dict[str, float]:
    """The :data:`COUNTERS` found in a Prometheus text exposition, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = COUNTERS.get(name)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[key] = out.get(key, 0.0) + value
    return out


async def scrape(base_url: str) -> Optional[dict[str, float]]:
    """The counters now, or None when the server has no llmserve ``/metrics``."""
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError as exc:
        logger.debug("no /metrics at %s: %s", base_url, exc)
        return None
    if resp.status_code != 200:
        return None
    found = parse_counters(resp.text)
    return found or None


def counter_delta(before: Optional[dict[str, float]], after: Optional[dict[str, float]]
                  ) -> Optional[dict[str, float]]:
    """What the run added, with the speculative acceptance rate when there were proposals."""
    if before is None or after is None:
        return None
    delta = {k: round(after[k] - before.get(k, 0.0), 6) for k in after}
    proposed = delta.get("spec_proposed_tokens", 0.0)
    if proposed:
        delta["spec_acceptance_rate"] = round(delta.get("spec_accepted_tokens", 0.0) / proposed, 4)
    return delta


def describe(delta: Optional[dict[str, float]]) -> list[tuple[str, str]]:
    """Report rows for a run's counters (empty without any)."""
    if not delta:
        return []
    rows = []
    if delta.get("spec_proposed_tokens"):
        rows.append(("Speculative tokens accepted / proposed (server)",
                     f"{int(delta.get('spec_accepted_tokens', 0))} / "
                     f"{int(delta['spec_proposed_tokens'])} "
                     f"({100 * delta['spec_acceptance_rate']:.1f}%)"))
    if delta.get("grammar_mask_steps"):
        rows.append(("Grammar mask time per masked step (server)",
                     f"{1000 * delta['grammar_mask_seconds'] / delta['grammar_mask_steps']:.2f} ms"))
    if delta.get("prefix_cache_queries"):
        rows.append(("Prefix-cache hit rate (server)",
                     f"{100 * delta.get('prefix_cache_hits', 0) / delta['prefix_cache_queries']:.1f}%"))
    return rows
